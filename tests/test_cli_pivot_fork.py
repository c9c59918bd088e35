"""`andrea pivot`, `andrea fork` and `andrea compare` in a plain shell (issue 11.1-3), and a pivot and a
fork that survive being killed at any step (issue 12.1-2): the pivot journal (pivot.json) lets a rerun
complete the pivot exactly once, and a trainer refuses to start on a half-done pivot."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from conftest import _env, andrea, last_logged_step, library_run, start_trainer, wait_for
from prefect_ephemeral import ephemeral_prefect  # noqa: F401
from test_pivot_checks import half_policy
from test_retention import fabricated_run

from andrea_core.data.policy import load_policy
from andrea_core.run.lock import live_trainer
from andrea_core.run.loss_log import read_history
from andrea_core.run.pivot_journal import PIVOT_JSON
from andrea_core.run.rundir import FORKS, LOSS_LOG, RunDir
from tests.tiny import tiny_config

ARCHIVE_1 = "archive/phase_001_step_000200"


def files_of(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and str(p.relative_to(folder)) not in skip
    }


def new_entries(run: Path, after: bytes) -> list[dict]:
    data = (run / LOSS_LOG).read_bytes()
    assert data.startswith(after), ".loss.json is not a byte prefix of itself"
    return [json.loads(line) for line in data[len(after) :].splitlines()]


def wait_until_stopped(run: Path, timeout: float = 300) -> None:
    wait_for(lambda: live_trainer(RunDir(str(run))) is None, timeout, "the trainer to exit")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """andrea-tiny trained to step 200 (checkpoints 100 and 200, sidecars of its one phase): the
    library's (conftest.library_run), this module's copy."""
    return library_run(tmp_path_factory, tmp_path_factory.mktemp("cli-pivot") / "base", 200)


def copy_run(base: Path, to: Path) -> Path:
    shutil.copytree(base, to, symlinks=True)
    return to


# --- bad inputs: one line naming it, exit 2, nothing touched ---------------------------------------


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line_and_touch_nothing(tmp_path):
    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    missing = str(tmp_path / "no-such-run")
    half = half_policy(tmp_path)
    cases = [
        (["pivot", missing, "--policy", "tiny-mix"], "no run here"),
        (["pivot", run.url, "--policy", "no-such-policy"], "no-such-policy"),
        (["pivot", run.url, "--policy", half, "--no-restart"], "arm 'gone' is unavailable"),
        (["pivot", run.url, "--abandon"], "no pivot under way"),
        (["fork", missing, "--branch", "a"], "no-such-run"),
        (["fork", run.url, "--step", "150", "--branch", "a"], "step_000150.bin"),
        (["fork", run.url, "--branch", "a", "--set", "train.no_such=1"], "train.no_such"),
        (["fork", run.url, "--branch", "../up"], "'../up' is not allowed"),
        (["compare", run.url], "no lineage.parent"),
        (["compare", missing], "no run here"),
    ]
    before = files_of(tmp_path)
    for args, named in cases:
        proc = andrea(*args, check=False, timeout=300)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        # One error line (a warning about the input may come before it), no traceback.
        lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("andrea: warning: ")]
        assert len(lines) == 1 and lines[0].startswith("andrea: error: "), (args, proc.stderr)
        assert named in lines[0], (args, lines[0])
        assert files_of(tmp_path) == before, args
    # A --set before any --branch is a usage error (argparse: exit 2, the error on the last line).
    proc = andrea("fork", run.url, "--set", "train.lr=1", "--branch", "a", check=False)
    assert proc.returncode == 2 and "name its branch first" in proc.stderr
    # Another pivot's journal: refused, naming it, nothing touched.
    policy, _ = load_policy("tiny-mix")
    RunDir(run.url).write_json(PIVOT_JSON, {"policy": "other", "policy_hash": "0" * 16, "step": "archived"})
    before = files_of(tmp_path)
    proc = andrea("pivot", run.url, "--policy", "tiny-mix", "--no-restart", check=False)
    assert proc.returncode == 2 and "a pivot to policy 'other'" in proc.stderr and "--abandon" in proc.stderr
    assert files_of(tmp_path) == before


# --- the pivot journal: killed after each step, then rerun -----------------------------------------

KILL_POINTS = [
    "checkpointed",
    "stopped",
    "archive-move-1",  # between the two moves of step 3 (.samples.json moved, .state.json not yet)
    "archived",
    "loss-kept",
    "installed",
    "restarted",
]


def end_state(run: Path, base_log: bytes) -> dict:
    """What an uninterrupted pivot leaves: the file set, the bytes of every sidecar, checkpoint and
    policy (times aside), and the first steps after the boundary with their losses."""
    # These hold times (and the lock a pid and a nonce): the lock is compared by whether it is released.
    skip = ("trainer.log", f"{ARCHIVE_1}/phase.json", LOSS_LOG, "data.jsonl", ".trainer.json", "target.jsonl")
    skip += ("segments.jsonl",)  # each trainer start's conditions and time (run/resume_check.py)
    # TensorBoard's event files are named by and hold wall-clock times: their segments are compared.
    views = sorted(str(p.relative_to(run)) for p in run.glob("tensorboard/*"))
    skip += tuple(views)
    entries = new_entries(run, base_log)
    events = [json.loads(line) for line in (run / "data.jsonl").read_text().splitlines()]
    targets = (run / "target.jsonl").read_text().splitlines()  # the pivot's --max-steps, once
    return {
        "files": sorted(
            re.sub(r"tfevents\.\d+\.", "tfevents.TIME.", str(p.relative_to(run)))
            for p in run.rglob("*")
            if p.is_file()
        ),
        "bytes": files_of(run, skip),
        "data_events": [{k: v for k, v in e.items() if k != "time"} for e in events],
        "targets": [{k: v for k, v in json.loads(t).items() if k != "time"} for t in targets],
        "lock_released": json.loads((run / ".trainer.json").read_text()).get("released"),
        "new_steps": [(e["step"], e["loss"], e["segment"]) for e in entries],
    }


@pytest.mark.slow
def test_a_pivot_killed_after_any_step_completes_exactly_once_when_rerun(trained, tmp_path):
    base_log = (trained / LOSS_LOG).read_bytes()
    pivot = ("--policy", "tiny-mix", "--max-steps", "202", "--timeout", "600")

    reference = copy_run(trained, tmp_path / "reference")
    andrea("pivot", str(reference), *pivot)
    wait_until_stopped(reference)
    expected = end_state(reference, base_log)
    assert [s for s, _, _ in expected["new_steps"]] == [201, 202]
    assert (reference / "policy.yaml").read_text() == load_policy("tiny-mix")[1]
    for name in (".samples.json", ".state.json", "policy.yaml"):
        assert (reference / ARCHIVE_1 / name).read_bytes() == (trained / name).read_bytes()
    assert not (reference / PIVOT_JSON).exists()
    # Killed before "installed", a pivot has not reached its restart: those points are checked with
    # --no-restart against a reference pivot without one (the rerun's restart is the same code as the
    # uninterrupted one's, which the later points check), sparing a trainer start each.
    unrestarted = copy_run(trained, tmp_path / "reference-no-restart")
    andrea("pivot", str(unrestarted), *pivot, "--no-restart")
    expected_unrestarted = end_state(unrestarted, base_log)
    assert expected_unrestarted["new_steps"] == [] and expected_unrestarted["lock_released"]

    # ANDREA_TEST_KILL_POINTS=a,b: only those (when debugging one).
    for point in os.environ.get("ANDREA_TEST_KILL_POINTS", ",".join(KILL_POINTS)).split(","):
        run = copy_run(trained, tmp_path / point)
        early = KILL_POINTS.index(point) < KILL_POINTS.index("installed")
        flags = (*pivot, "--no-restart") if early else pivot
        env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": point}
        killed = andrea("pivot", str(run), *flags, env=env, check=False, timeout=900)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stdout, killed.stderr)
        journal = json.loads((run / PIVOT_JSON).read_text())
        assert journal["step"] == ("archiving" if point == "archive-move-1" else point)
        if point == "archive-move-1":
            # Half done: a trainer refuses, saying how to finish or abandon it.
            refused = andrea("train", "--run-dir", str(run), check=False)
            assert refused.returncode == 2
            assert "a pivot to policy 'tiny-mix' is half done" in refused.stderr
            assert f"andrea pivot {run} --policy tiny-mix" in refused.stderr
            assert f"andrea pivot {run} --abandon" in refused.stderr
        wait_until_stopped(run)  # after "restarted" the resumed trainer may still be finishing
        andrea("pivot", str(run), *flags)
        wait_until_stopped(run)
        assert end_state(run, base_log) == (expected_unrestarted if early else expected), point
        assert os.listdir(run / "archive") == ["phase_001_step_000200"], point


@pytest.mark.slow
def test_abandon_restores_the_old_phase(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    before = files_of(run)
    env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "archive-move-1"}
    killed = andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart", env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert not (run / ".samples.json").exists()
    andrea("pivot", str(run), "--abandon")
    assert files_of(run) == before
    assert not (run / "archive").exists() or not list((run / "archive").iterdir())
    andrea("train", "--run-dir", str(run), "--max-steps", "201")  # the old phase trains on
    assert read_history(RunDir(str(run)))[-1].step == 201


# --- a live trainer: at the boundary, then now ------------------------------------------------------


@pytest.mark.slow
def test_pivot_a_live_trainer_at_the_boundary_then_now(tmp_path):
    run = tmp_path / "run"
    trainer = start_trainer(
        "--config",
        tiny_config(tmp_path),
        "--run-dir",
        str(run),
        "--max-steps",
        "100000",
        "--pace",
        "0.02",
        log=tmp_path / "first.log",
    )
    pids = []
    try:
        wait_for(lambda: last_logged_step(run) >= 20, 300, "the trainer's step 20")
        log_before = (run / LOSS_LOG).read_bytes()
        out = andrea("pivot", str(run), "--policy", "tiny-mix", "--max-steps", "100000", "--timeout", "600")
        trainer.wait(120)  # the pivot stopped it (SIGTERM after the boundary's checkpoint)
        m = re.search(
            r"pivoted .* at step (\d+) to policy 'tiny-mix'; resumed at step (\d+), trainer pid (\d+)",
            out.stdout,
        )
        assert m, out.stdout
        boundary, first, pid = map(int, m.groups())
        pids.append(pid)
        assert boundary % 100 == 0 and boundary >= 100 and first == boundary + 1
        assert (run / "policy.yaml").read_text() == load_policy("tiny-mix")[1]
        phase = run / "archive" / f"phase_001_step_{boundary:06d}"
        assert {p.name for p in phase.iterdir()} >= {
            ".samples.json",
            ".state.json",
            "policy.yaml",
            "phase.json",
        }
        assert not (run / PIVOT_JSON).exists()
        assert live_trainer(RunDir(str(run))).pid == pid
        assert new_entries(run, log_before)  # appended only
        assert (run / "trainer.log").exists()

        wait_for(lambda: last_logged_step(run) >= boundary + 10, 300, "the resumed trainer's progress")
        log_before = (run / LOSS_LOG).read_bytes()
        out = andrea("pivot", str(run), "--policy", "stdlib-only", "--at", "now", "--max-steps", "100000")
        m = re.search(
            r"at step (\d+) to policy 'stdlib-only'; resumed at step (\d+), trainer pid (\d+)", out.stdout
        )
        assert m, out.stdout
        now_at, first, pid = map(int, m.groups())
        pids.append(pid)
        assert now_at > boundary and first == now_at + 1
        assert (run / "archive" / f"phase_002_step_{now_at:06d}").is_dir()
        steps = RunDir(str(run)).checkpoint_steps()
        assert max(s for s in steps if s <= now_at) == now_at
        entries = new_entries(run, log_before)
        resumed = [e for e in entries if e["segment"] == max(x["segment"] for x in entries)]
        assert resumed[0]["step"] == now_at + 1
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        wait_until_stopped(run)


# --- fork + compare ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_fork_and_compare_from_the_shell_and_a_fork_killed_mid_copy(trained, tmp_path):
    parent = copy_run(trained, tmp_path / "parent")
    before = files_of(parent)
    out = andrea(
        "fork",
        str(parent),
        "--step",
        "100",
        "--replicates",  # one run a branch: two to train here (the verdict's noise: test_verdict.py)
        "1",
        "--branch",
        "base",
        "--branch",
        "hot",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.min_lr=1e-3",
    )
    urls = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert set(urls) == {"base", "hot"}
    from andrea_core.run.record import read_run

    hot = read_run(RunDir(urls["hot"]))
    assert hot.config.train.lr == 0.01 and hot.lineage["overrides"] == {
        "train.lr": 0.01,
        "train.min_lr": 0.001,
    }
    assert files_of(parent, (FORKS,)) == {k: v for k, v in before.items()}
    assert len((parent / FORKS).read_text().splitlines()) == 1
    for url in urls.values():
        andrea("train", "--run-dir", url, "--max-steps", "130")
    report = tmp_path / "report"
    out = andrea("compare", urls["base"], urls["hot"], "--out", str(report))
    assert re.search(r"margin \d+\.\d{4}, noise \d+\.\d{4}", out.stdout), out.stdout
    assert (report / "report.md").read_text().startswith(f"# Audit fork of `{parent}` at step 100")
    # The default held-out set (ops/compare.DEFAULT_VAL_SEQUENCES; 32 told lr 1e-4 apart in 17 of 20).
    assert "Held-out data: 256 sequences of 64 tokens" in (report / "report.md").read_text()
    assert (report / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A fork killed right after copying its first branch's checkpoint, then rerun.
    env = {**_env(), "ANDREA_TEST_FORK_KILL_AFTER": "x/step_000200.bin"}
    killed = andrea(
        "fork", str(parent), "--step", "200", "--branch", "x", "--branch", "y", env=env, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    half = Path(f"{parent}-fork200-x")
    assert (half / "step_000200.bin").exists() and not (half / "run.yaml").exists()
    assert not Path(f"{parent}-fork200-y").exists()
    andrea("fork", str(parent), "--step", "200", "--branch", "x", "--branch", "y")
    assert len((parent / FORKS).read_text().splitlines()) == 2  # one line per fork, not per attempt
    assert files_of(parent, (FORKS,)) == before
    for name in ("x", "y"):
        branch = Path(f"{parent}-fork200-{name}")
        assert read_run(RunDir(str(branch))).lineage["parent_step"] == 200
        assert (branch / "step_000200.bin").read_bytes() == (parent / "step_000200.bin").read_bytes()
        assert (branch / LOSS_LOG).read_bytes() == (parent / LOSS_LOG).read_bytes()


@pytest.mark.slow
@pytest.mark.usefixtures("ephemeral_prefect")
def test_the_pivot_flow_completes_a_pivot_the_shell_left_half_done(tmp_path):
    """One journal for both front ends: `andrea pivot` killed between the two moves of step 3, then the
    Prefect flow with the same policy finishes it into the same phase folder."""
    from flows.pivot import pivot

    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    sidecars = {".samples.json": b'{"samples": 1}\n', ".state.json": b'{"state": 2}\n'}
    for name, data in sidecars.items():
        RunDir(run.url).write_atomic(name, data)
    old_policy = (tmp_path / "run" / "policy.yaml").read_bytes()
    env = {**_env(), "ANDREA_TEST_PIVOT_KILL_AFTER": "archive-move-1"}
    killed = andrea("pivot", run.url, "--policy", "tiny-mix", "--no-restart", env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    result = pivot(run.url, "tiny-mix", restart="none")
    folder = tmp_path / "run" / ARCHIVE_1
    assert result["boundary"] == 200 and os.listdir(tmp_path / "run" / "archive") == [folder.name]
    for name, data in sidecars.items():
        assert (folder / name).read_bytes() == data and not (tmp_path / "run" / name).exists()
    assert (folder / "policy.yaml").read_bytes() == old_policy
    assert (tmp_path / "run" / "policy.yaml").read_text() == load_policy("tiny-mix")[1]
    assert not (tmp_path / "run" / PIVOT_JSON).exists()
