"""A trainer that cannot be checked from here is a live trainer elsewhere (issue 23.1, 23.7): one verdict,
lock.trainer_liveness, for every caller. Run from another pid namespace (unshare, real) or another
host (ANDREA_TEST_HOST): a gc and a fork of the newest checkpoint refuse, naming the host, the lease
generation and how recently it was renewed, and touch nothing; `andrea status` says the trainer cannot
be checked instead of calling it crashed; and a pivot asks the trainer through the run directory (a
request file it reads at each lease renewal), so it works from any machine that shares the storage."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, _env, start_trainer, wait_for

from andrea_core.run.rundir import RunDir
from tests.tiny import tiny_config

FAST_LEASE = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"}


def run_files(run: RunDir) -> dict[str, str]:
    """Every file of the run but the ones a live trainer keeps writing, with its bytes' hash."""
    found = run.fs.find(run.root)
    skip = (".loss.json", ".trainer.json", "trainer.log", ".samples.json", ".state.json")
    names = [p.removeprefix(run.root + "/") for p in found if ".tmp." not in p]  # a write in flight
    out = {n: hashlib.sha256(run.read_bytes(n)).hexdigest()[:12] for n in names if not n.endswith(skip)}
    # Checkpoints and TensorBoard's event files (appended at each checkpoint) are the live trainer's too.
    return {n: h for n, h in out.items() if not n.startswith(("step_", "tensorboard/"))}


def elsewhere(how: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a process that cannot check the trainer's pid."""
    if how == "pid-namespace":
        if shutil.which("unshare") is None:
            pytest.skip("no unshare(1) here")
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.decode().strip()}")
        return ["unshare", "--pid", "--fork", "--mount-proc"], _env() | FAST_LEASE
    return [], _env() | FAST_LEASE | {"ANDREA_TEST_HOST": "host-b"}


def andrea_from(prefix: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "andrea_core", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


@pytest.mark.parametrize("how", ["pid-namespace", pytest.param("another-host-s3", marks=pytest.mark.slow)])
def test_nothing_is_pivoted_abandoned_collected_or_forked_under_a_trainer_that_cannot_be_checked(
    how, tmp_path, request
):
    if how == "pid-namespace":
        url, host = str(tmp_path / "run"), None
    else:
        url, host = f"{request.getfixturevalue('s3_bucket')}/run", "host-a"
    run = RunDir(url)
    prefix, env = elsewhere(how)
    cfg = tiny_config(tmp_path, train__checkpoint_every=20)
    trainer_env = _env() | FAST_LEASE | ({"ANDREA_TEST_HOST": host} if host else {})
    trainer = start_trainer(
        "--config", cfg, "--run-dir", url, "--device", "cpu", "--max-steps", "100000", "--pace", "0.05",
        env=trainer_env, log=tmp_path / "trainer.log",
    )  # fmt: skip
    try:
        wait_for(lambda: len(run.checkpoint_steps()) >= 2 and run.exists(".state.json"), 300, "checkpoints")
        before = run_files(run)
        where = "another pid namespace" if how == "pid-namespace" else "host host-a"
        for args, doing in (
            (["fork", url, "--branch", "x"], "not forking its newest checkpoint"),
            (["pivot", url, "--abandon"], "no pivot under way"),
        ):
            proc = andrea_from(prefix, env, *args)
            assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
            err = proc.stderr
            assert err.startswith("andrea: error: ") and err.count("\n") == 1, err
            assert doing in err, err
            if args[0] == "fork":
                assert "cannot be checked from here" in err and where in err, err
                assert "its lease (generation 1," in err and "was last renewed at" in err, err
            assert run_files(run) == before, f"andrea {' '.join(args)} touched the run"
        gc = andrea_from(prefix, env, "gc", url, "--keep-last", "2")
        assert gc.returncode == 2 and "its lease (generation 1) was renewed" in gc.stderr, gc.stderr
        assert "deleted" not in gc.stdout + gc.stderr, "gc deleted a checkpoint under a live trainer"
        # 23.7: status from there says it cannot be checked; it never calls a live trainer crashed.
        status = andrea_from(prefix, env, "status", url)
        assert status.returncode == 0, status.stderr
        assert ": REMOTE: " in status.stdout and "cannot be checked from here" in status.stdout, status.stdout
        assert "CRASHED" not in status.stdout
        assert trainer.poll() is None and not run.exists("pivot.json") and not run.exists("archive")

        # The pivot itself asks that trainer through the run directory: it checkpoints at the boundary,
        # stops at the stop request as on SIGTERM (exit 0), and the pivot completes from here.
        pivot = andrea_from(prefix, env, "pivot", url, "--policy", "tiny-mix", "--no-restart")
        assert pivot.returncode == 0, pivot.stdout + pivot.stderr
        assert "to stop (" in pivot.stdout and ".trainer-request.json" in pivot.stdout, pivot.stdout
        assert trainer.wait(120) == 0
        log = (tmp_path / "trainer.log").read_text()
        assert "stop requested by" in log and "(as SIGTERM)" in log, log[-2000:]
        folder = run.listdir("archive")
        assert len(folder) == 1 and run.exists(f"archive/{folder[0]}/.state.json")
        assert not run.exists(".state.json") and not run.exists("pivot.json")
        assert "name: tiny-mix" in run.read_text("policy.yaml")
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    assert Path(tmp_path / "trainer.log").read_text().count("lost its lease") == 0
