"""The divergence guard (issue 27): a run that survives its own divergence, bounded, recorded, replayable.

Real trainer processes on andrea-tiny, one thread. The divergences are real too: a learning rate far too
high, or a batch whose gradient is NaN (ANDREA_TEST_GUARD_NAN_AT names data positions; the NaN goes into
a real gradient, so the weights really are poisoned); everything after the detection is the trainer's
own recovery.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, _env, andrea, last_logged_step, library_run
from guard_parent import guard_parent_fixture  # noqa: F401 (the guard_parent fixture)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_systemd import read_unit
from tiny import tiny_config

from andrea_core.checkpoint import restore
from andrea_core.config import load_run_config
from andrea_core.data.pipeline import DataPipeline
from andrea_core.model.gpt import GPT
from andrea_core.run.guard_events import read_events
from andrea_core.run.loss_log import parse_entries, read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import GUARD_LOG, RunDir
from andrea_core.run.samples import read_audits
from andrea_core.train.guard import EXIT_DIVERGED
from andrea_core.train.optim import lr_at

POISON = 25  # the data position whose batch makes a NaN gradient
STEPS = 60


def env(**extra: str) -> dict[str, str]:
    return {**_env(), **extra}


def train(run: Path, *args: str, check: bool = True, **extra: str):
    return andrea("train", "--run-dir", str(run), "--device", "cpu", *args, check=check, env=env(**extra))


# Checkpoints every 10 steps, all kept; a rollback at least 10 steps before the spike.
POISONED = {
    "train__checkpoint_every": 10,
    "train__max_steps": STEPS,
    "train__log_every": 10,
    "train__guard__rollback_margin": 10,
    "retention__keep_last": None,
}


def poisoned_config(folder: Path, **overrides) -> str:
    """tests/tiny.py's config with POISONED's settings (and `overrides`)."""
    return tiny_config(folder, **{**POISONED, **overrides})


def facts(run: Path) -> list[dict]:
    """The events as recorded, all but their time."""
    return [{k: v for k, v in e.__dict__.items() if k != "time"} for e in read_events(RunDir(str(run)))]


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> Path:
    """Steps 1..60, the batch at position 25 poisoned: diverges at step 25, recovers, finishes."""
    root = tmp_path_factory.mktemp("recovered")
    train(root / "run", "--config", poisoned_config(root), ANDREA_TEST_GUARD_NAN_AT=str(POISON))
    return root / "run"


def test_b_a_nan_gradient_rolls_back_and_skips_exactly_the_recorded_batches(recovered, one_thread):
    run = RunDir(str(recovered))
    (event,) = facts(recovered)
    # Read one step late (while step 26 trains), at once: no checkpoint of the poisoned timeline exists.
    assert event == {
        "number": 1,
        "action": "rollback",
        "step": POISON,
        "spike_start": POISON,
        "kind": "non-finite-grad-norm",
        "value": event["value"],
        "statistic": None,
        "threshold": None,
        "rolled_back_to": 10,  # the newest checkpoint at least rollback_margin (10) steps before 25
        "level": 0,
        "skip": 10,  # the batches of steps 16..25: step 16 now draws position 26
        "lr_scale": 0.3,
        "cooldown": 1000,
        "remedy_from": 15,  # 25 - rollback_margin, whichever checkpoint: steps 11..15 retrain as they were
    }
    assert math.isnan(event["value"])
    # The abandoned timeline's checkpoint 20 is kept as evidence, out of the resume's way.
    assert [n.rsplit(".", 1)[0] for n in run.listdir("refused")] == ["step_000020.bin"]
    assert run.checkpoint_steps() == [10, 20, 30, 40, 50, 60]

    # .loss.json keeps the diverging steps in their segment (the poisoned step's norm is NaN); the
    # rollback opened a new one at step 11, as a resume from checkpoint 10 would.
    entries = parse_entries((recovered / ".loss.json").read_bytes())[0]
    assert [e.step for e in entries if e.segment == 1] == list(range(1, POISON + 1))
    assert math.isnan(entries[POISON - 1].grad_norm) and math.isfinite(entries[POISON - 1].loss)
    assert [e.step for e in entries if e.segment == 2] == list(range(11, STEPS + 1))
    history = read_history(run)
    assert [e.step for e in history] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e.loss) and math.isfinite(e.grad_norm) for e in history)
    # TensorBoard's view restarts with it: one event file per segment, the second opening at step 11,
    # so its reader drops the abandoned steps 11..25 and shows exactly the canonical history.
    files = sorted(p.name.rsplit(".", 1)[1] for p in (recovered / "tensorboard").iterdir())
    assert files == ["segment0001", "segment0002"]
    acc = EventAccumulator(str(recovered / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (e.step, float(np.float32(e.loss))) for e in history
    ]
    cfg = read_run(run).config
    by_step = {e.step: e for e in history}
    for s in (10, 11, 15, 16, 60):  # the cooldown's factor from step 16 on, none before
        assert by_step[s].lr == lr_at(s, cfg.train) * (0.3 if s > 15 else 1.0)

    # Exactly the recorded batches are skipped: the loss logged for step 21 is the loss of checkpoint
    # 20's weights on the batch at position 31, not on the step's own; step 11 (before remedy_from)
    # draws its own, and logged exactly what the abandoned timeline (segment 1) logged there.
    torch.manual_seed(0)
    model = GPT(cfg.model)
    data = DataPipeline.for_run(run, cfg, warn=lambda _: None)  # one arm: the mixer has no say
    for ckpt_step in (10, 20):
        restore(run.read_checkpoint(ckpt_step, model.n_params), model, torch.optim.AdamW(model.parameters()))
        s = ckpt_step + 1
        with torch.no_grad():
            losses = {
                p: model(data.batch(s, position=p).x, data.batch(s, position=p).y)[1].item()
                for p in (s, s + 10)
            }
        assert by_step[s].loss == (losses[s] if s <= 15 else losses[s + 10]), s
        assert losses[s] != losses[s + 10]
    first = {e.step: e for e in entries if e.segment == 1}
    assert [by_step[s].loss for s in range(11, 16)] == [first[s].loss for s in range(11, 16)]
    assert by_step[16].loss != first[16].loss


@pytest.fixture(scope="module")
def at_twenty(tmp_path_factory) -> Path:
    """Steps 1..20 of the poisoned config, before the poison (checkpoints 10, 20): the library's run of
    that recipe (conftest.library_run), this module's copy. Read it; copy it before changing anything."""
    return library_run(
        tmp_path_factory, tmp_path_factory.mktemp("at-twenty") / "run", 20, "--device", "cpu", **POISONED
    )


@pytest.fixture(scope="module")
def before_the_spike(at_twenty, tmp_path_factory) -> Path:
    """Steps 1..30 of the poisoned config, no poison yet: checkpoints 10, 20, 30 (at_twenty trained on)."""
    run = tmp_path_factory.mktemp("before-the-spike") / "run"
    shutil.copytree(at_twenty, run, symlinks=True)
    train(run, "--max-steps", "30")
    return run


def test_the_remedy_does_not_depend_on_which_checkpoints_a_fault_left(before_the_spike, tmp_path, one_thread):
    """Issue 48 (the strongest lead on the soak's step-7961 divergence): the rollback's target depends on
    which checkpoints exist, so the remedy must not. One run, the batch at position 35 poisoned, trained
    on from checkpoint 30 twice: with every checkpoint (rollback to 20, the newest at or before
    35 - rollback_margin = 25) and with checkpoint 20 gone, as a full disk leaves it unwritten (rollback
    to 10). Keyed on the target the second skipped data from step 11, the first from 21: two lives on
    other data. Keyed on remedy_from = 25, steps 11..25 retrain bit for bit and both skip from 26:
    bit-equal final checkpoints, equal canonical histories, equal remedies."""
    runs, said = {}, {}
    for how in ("every-checkpoint", "20-unwritten"):
        run = runs[how] = tmp_path / how
        shutil.copytree(before_the_spike, run)
        if how == "20-unwritten":
            (run / "step_000020.bin").unlink()
        proc = train(run, "--max-steps", "60", ANDREA_TEST_GUARD_NAN_AT="35")
        said[how] = proc.stdout + proc.stderr
    for how, to in (("every-checkpoint", 20), ("20-unwritten", 10)):
        assert (
            f"back to step_{to:06d}.bin, steps {to + 1}..25 retrained on their own data, data positions "
            "26..35 skipped, lr x0.3 for steps 26..1025"
        ) in said[how], said[how][-3000:]
    events = {how: facts(run) for how, run in runs.items()}
    assert [e["rolled_back_to"] for e in events["every-checkpoint"]] == [20]
    assert [e["rolled_back_to"] for e in events["20-unwritten"]] == [10]
    final = {how: (run / "step_000060.bin").read_bytes() for how, run in runs.items()}
    assert final["every-checkpoint"] == final["20-unwritten"]
    # Checkpoint 20, retrained from 10 in the second run, is the first run's, byte for byte.
    assert (runs["20-unwritten"] / "step_000020.bin").read_bytes() == (
        runs["every-checkpoint"] / "step_000020.bin"
    ).read_bytes()

    def history(how: str) -> list[tuple]:
        return [
            (e.step, e.loss, e.grad_norm, e.lr, e.arm, e.tokens) for e in read_history(RunDir(str(runs[how])))
        ]

    assert [h[0] for h in history("every-checkpoint")] == list(range(1, STEPS + 1))
    assert history("every-checkpoint") == history("20-unwritten")
    assert [(e["step"], e["remedy_from"], e["skip"]) for e in events["every-checkpoint"]] == [(35, 25, 10)]

    def remedies(how: str) -> list[dict]:
        return [{k: v for k, v in e.items() if k not in ("rolled_back_to", "value")} for e in events[how]]

    assert remedies("every-checkpoint") == remedies("20-unwritten")


def test_c_sigkill_or_sigterm_at_any_moment_of_a_recovery_ends_in_the_same_bytes(
    recovered, at_twenty, tmp_path
):
    """Each recovery starts from a copy of the run at step 20 (steps 1..20 are not the subject: a resume
    is bit-exact, and the guard rebuilds its state from .loss.json), is killed at one moment of the
    recovery from the spike at 25, restarted, and must end in the bytes and events of `recovered`,
    which trained 1..60 in one process."""
    reference = (recovered / "step_000060.bin").read_bytes()
    for point, sig, status in [
        ("set-aside", "SIGKILL", -signal.SIGKILL),  # checkpoint 20 moved aside, the event not yet written
        ("recorded", "SIGKILL", -signal.SIGKILL),  # the event written, the weights not yet restored
        ("restored", "SIGKILL", -signal.SIGKILL),  # restored, not one step trained since
        ("recorded", "SIGTERM", 0),  # as everywhere else: exit 0, nothing lost
    ]:
        root = tmp_path / f"{point}-{sig}"
        root.mkdir()
        shutil.copytree(at_twenty, root / "run", symlinks=True)
        proc = train(
            root / "run",
            "--max-steps",
            str(STEPS),  # the copy's target.jsonl holds its own 20
            check=False,
            ANDREA_TEST_GUARD_NAN_AT=str(POISON),
            ANDREA_TEST_GUARD_SIGNAL=f"{point}:{sig}",
        )
        assert proc.returncode == status, (point, sig, proc.stdout, proc.stderr)
        assert not (root / "run" / "step_000060.bin").exists()
        train(root / "run", ANDREA_TEST_GUARD_NAN_AT=str(POISON))  # the restart systemd would make
        assert (root / "run" / "step_000060.bin").read_bytes() == reference, (point, sig)
        assert facts(root / "run") == facts(recovered), (point, sig)


@pytest.mark.slow
def test_a_a_learning_rate_far_too_high_recovers_and_finishes_near_a_sane_run(guard_parent, tmp_path):
    """The sane run is the session's guard parent (tests/guard_parent.py: the same andrea-tiny on one
    thread to step 300, at its own learning rate; checkpoints are not training), read, not retrained."""
    sane, high = guard_parent, tmp_path / "high"
    common = {"train__checkpoint_every": 10, "train__max_steps": 300}
    proc = train(high, "--config", tiny_config(tmp_path, "high", train__lr=1.0, **common))
    assert "guard: loss-spike at step" in proc.stdout + proc.stderr

    events = read_events(RunDir(str(high)))
    assert events and all(e.action == "rollback" for e in events)
    first = events[0]
    # In warm-up, long before step 50: no checkpoint is rollback_margin steps back, so the oldest one
    # before the spike (issue 41), or the initial weights before checkpoint 10.
    oldest = 10 if first.spike_start > 10 else 0
    assert first.kind == "loss-spike" and first.step < 50 and first.rolled_back_to == oldest
    assert first.value > first.threshold and first.value > 1.5 * math.log(256)  # worse than uniform
    assert RunDir(str(high)).checkpoint_steps()[-1] == 300

    def final(run: Path) -> float:
        tail = read_history(RunDir(str(run)))[-20:]
        assert tail[-1].step == 300
        return sum(e.loss for e in tail) / len(tail)

    # Unguarded, this run stays between 17 and 37 to step 300; recovered, it is within a nat of sane.
    assert final(high) < final(sane) + 1.0, (final(high), final(sane))


def test_e_the_bound_stops_with_its_own_status_and_systemd_does_not_restart_on_it(tmp_path):
    run = tmp_path / "run"
    cfg = poisoned_config(tmp_path, train__guard__max_rollbacks=2, train__guard__rollback_margin=5)
    every_batch = ",".join(map(str, range(15, 400)))  # every rollback lands on poison again
    proc = train(run, "--config", cfg, check=False, ANDREA_TEST_GUARD_NAN_AT=every_batch)
    assert proc.returncode == EXIT_DIVERGED == 3, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    events = facts(run)
    assert [(e["action"], e["step"], e["rolled_back_to"], e["level"], e["skip"]) for e in events] == [
        ("rollback", 15, 10, 0, 5),  # step 11 then draws position 16: poisoned
        # No checkpoint 5 steps before 11: the initial weights (step 0's, which no fault can leave
        # unwritten), the remedy after 11 - 5 = 6 whatever the rollback found: steps 1..6 retrain on
        # their own data, twice the skip from 6 (replacing the first event's): step 7 draws 17, poisoned.
        ("rollback", 11, 0, 1, 10),
        ("stop", 7, None, 2, 0),  # a third in the region: the bound
    ]
    assert line.startswith("andrea: diverged again at step 7 (non-finite-grad-norm")
    for named in (
        "event 1: non-finite-grad-norm at step 15, back to 10",
        "event 2:",
        "event 3 in",
        "train.lr",
    ):
        assert named in line, line
    assert proc.stderr.count("andrea:") == 1

    # A restart cannot help, and does not train on: it stops again at once, with the same status.
    again = train(run, check=False, ANDREA_TEST_GUARD_NAN_AT=every_batch)
    assert again.returncode == EXIT_DIVERGED
    assert [e["action"] for e in facts(run)] == ["rollback", "rollback", "stop", "stop"]

    service = read_unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert str(EXIT_DIVERGED) in service["RestartPreventExitStatus"].split()


def test_a_fork_copies_the_events_up_to_its_fork_point_and_status_shows_the_last(recovered, tmp_path):
    parent = tmp_path / "parent"
    shutil.copytree(recovered, parent)
    branches = {}
    for step in (10, 20):
        andrea("fork", str(parent), "--step", str(step), "--branch", "b")  # the control: no override
        branches[step] = tmp_path / f"parent-fork{step}-b"
    assert not (branches[10] / GUARD_LOG).exists()  # the rollback to 10 shaped nothing up to step 10
    assert (branches[20] / GUARD_LOG).read_bytes() == (parent / GUARD_LOG).read_bytes()

    # The branch at 20 replays the remedy: its steps 21..30 are the parent's, batch for batch.
    andrea("train", "--run-dir", str(branches[20]), "--max-steps", "30", "--device", "cpu")
    mine = {e.step: e.loss for e in read_history(RunDir(str(branches[20])))}
    theirs = {e.step: e.loss for e in read_history(RunDir(str(parent)))}
    assert [mine[s] for s in range(21, 31)] == [theirs[s] for s in range(21, 31)]

    (status,) = json.loads(andrea("status", str(parent), "--json").stdout)
    assert status["guard"]["number"] == 1 and status["guard"]["rolled_back_to"] == 10
    text = andrea("status", str(parent)).stdout
    assert "non-finite-grad-norm at step 25 (since step 25); rolled back to step_000010.bin" in text
    assert (
        "rolled back to step_000010.bin, steps 11..15 retrained on their own data, data positions 16..25 "
        "skipped, lr x0.3 for steps 16..1015" in text
    )


def test_a_pivot_keeps_the_events(recovered, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(recovered, run)
    before = (run / GUARD_LOG).read_bytes()
    andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")
    andrea("train", "--run-dir", str(run), "--max-steps", "70", "--device", "cpu")
    assert (run / GUARD_LOG).read_bytes() == before
    assert read_history(RunDir(str(run)))[-1].step == 70


@pytest.mark.parametrize(
    "override, named",
    [
        ("train.guard.window=2", "train.guard.window must be >= 3"),
        ("train.guard.lr_scale=0", "train.guard.lr_scale must be in (0, 1]"),
        ("train.guard.max_rollbacks=0", "train.guard.max_rollbacks must be >= 1"),
        ("train.guard.loss_ceiling=1", "train.guard.loss_ceiling must be > 1"),
        ("train.guard.consecutive=yes", "train.guard.consecutive: expected int"),
    ],
)
def test_guard_settings_are_validated_before_any_work(tmp_path, override, named):
    key, value = override.split("=")
    cfg = load_run_config(tiny_config(tmp_path)).to_dict()
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = {"yes": "yes"}.get(value) or float(value)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(cfg))
    proc = andrea("train", "--config", str(path), "--run-dir", str(tmp_path / "run"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("andrea: error:") == 1 and named in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_d_long_clean_runs_fire_no_event(guard_parent, tmp_path):
    """CI's share of (d): 1,500 clean steps (bench/divergence.py --clean runs the 10,000). Steps 1..300
    are the session's guard parent (tests/guard_parent.py: tests/tiny.py's config, which trains the
    same bytes whatever its checkpoint_every, log_every and max_steps), trained on to 1,500: the guard
    rebuilds its state from .loss.json at every start (train/guard.py), so a resume judges each step
    as the uninterrupted run does, and the history asserted is the whole 1..1500."""
    run = tmp_path / "run"
    shutil.copytree(guard_parent, run, symlinks=True)
    assert last_logged_step(run) == 300 and not (run / GUARD_LOG).exists()
    train(run, "--max-steps", "1500")
    history = read_history(RunDir(str(run)))
    assert [e.step for e in history] == list(range(1, 1501))
    assert [e.segment for e in parse_entries((run / ".loss.json").read_bytes())[0]] == [1] * 300 + [2] * 1200
    assert not (run / GUARD_LOG).exists()


def test_the_trainer_logs_each_event_it_replays(recovered, tmp_path):
    """Issue 41: the record is input, and the trainer says what it obeys: one line per replayed event."""
    run = tmp_path / "run"
    shutil.copytree(recovered, run)
    proc = train(run, "--max-steps", "62")
    assert (
        "guard: replaying event 1: non-finite-grad-norm at step 25 (since step 25): rolled back to step 10, "
        "steps 11..15 retrained on their own data, data positions 16..25 skipped, lr x0.3 for steps "
        "16..1015 (guard.jsonl)"
    ) in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_rollback_to_a_phase_start_in_process_is_a_restart_from_it(tmp_path):
    """Issue 48 (the soak's guard-rollback, fault 5 of `--kinds guard-rollback,pivot-remote,data-change
    --faults 6`): a trainer that started from a restored bandit and rolls back, in its own process, to
    its phase's start (a pivot's boundary, where the bandit is fresh) must go on exactly as a trainer
    started from that checkpoint: the fresh bandit hears of no loss before its first step. It heard of
    the boundary step's (a phantom pull of the closed phase's arm: `restored` stayed True from its start),
    and from step 388 on the soak's run and its reference drew other arms."""
    root = tmp_path / "base"
    root.mkdir()
    stdlib = str(REPO / "configs" / "policies" / "stdlib-only.yaml")
    cfg = poisoned_config(root, data__policy=stdlib)
    train(root / "run", "--config", cfg, "--max-steps", "30")
    andrea("pivot", str(root / "run"), "--policy", "tiny-mix", "--no-restart")  # phase 2 from step 30
    train(root / "run", "--max-steps", "40")  # a state of phase 2's bandit: the next start restores it
    runs = {}
    for how in ("in-process", "restarted"):
        run = runs[how] = tmp_path / how
        shutil.copytree(root / "run", run)
        kill = {"ANDREA_TEST_GUARD_SIGNAL": "restored:SIGKILL"} if how == "restarted" else {}
        proc = train(run, "--max-steps", "60", check=False, ANDREA_TEST_GUARD_NAN_AT="45", **kill)
        assert proc.returncode == (-signal.SIGKILL if kill else 0), (how, proc.stdout[-3000:], proc.stderr)
        if kill:
            # The abandoned timeline's audit of step 40 is out of the file once the rollback restored:
            # killed after retraining step 40's checkpoint and before its audit, the next trainer must
            # audit it, not take the old one for it (the soak's guard-rollback, issue 48).
            assert read_audits(RunDir(str(run))) == []
            train(run, "--max-steps", "60", ANDREA_TEST_GUARD_NAN_AT="45")
    for how, run in runs.items():
        (event,) = facts(run)
        assert (event["step"], event["rolled_back_to"]) == (45, 30), how  # back to the phase's start

    def states(run: Path) -> dict[int, dict]:
        head = json.loads((run / ".state.json").read_text())
        return {s["step"]: {k: v for k, v in s.items() if k != "previous"} for s in (head, *head["previous"])}

    assert sorted(states(runs["in-process"])) == [40, 50, 60]
    assert states(runs["in-process"]) == states(runs["restarted"])
    for step in (40, 50, 60):
        name = f"step_{step:06d}.bin"
        assert (runs["in-process"] / name).read_bytes() == (runs["restarted"] / name).read_bytes(), name
