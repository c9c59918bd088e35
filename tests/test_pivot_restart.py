"""A pivot restarts the trainer with the stopped trainer's own command line (issue 23.8): the options its
lock recorded (train_args), only --max-steps replaced when the pivot is given one; its output goes to
RUN/trainer.log, or for a run on an object store to this machine's cache of the run (printed)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import andrea, last_logged_step, start_trainer, wait_for

from andrea_core.command import train_options
from andrea_core.config import ConfigError
from andrea_core.ops.pivot import recorded_train_options, trainer_log_path
from andrea_core.run.lock import live_trainer, read_lock
from andrea_core.run.rundir import LOCK, RunDir, cache_dir
from tests.tiny import tiny_config


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [None, 5000], ids=["same", "given"])
def test_a_pivot_restarts_the_trainer_with_its_own_command_line(tmp_path, max_steps):
    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=20)
    args = ["--run-dir", str(run), "--device", "cpu", "--max-steps", "100000", "--pace", "0.05"]
    first = start_trainer("--config", cfg, *args, log=tmp_path / "first.log")
    resumed = None
    try:
        wait_for(lambda: last_logged_step(run) >= 25, 300, "step 25")
        assert read_lock(RunDir(str(run))).train_args == ["--config", cfg, *args]
        given = ["--max-steps", str(max_steps)] if max_steps else []
        out = andrea("pivot", str(run), "--policy", "tiny-mix", "--timeout", "600", *given).stdout
        first.wait(120)
        resumed = live_trainer(RunDir(str(run)))
        assert resumed is not None and resumed.pid != first.pid, out
        argv = cmdline(resumed.pid)
        train = argv[argv.index("train") + 1 :]
        expected = {"--device": "cpu", "--pace": "0.05", "--max-steps": str(max_steps or 100000)}
        for flag, value in expected.items():
            assert train[train.index(flag) + 1] == value, (flag, train)
        assert f"(output in {run}/trainer.log)" in out, out
        wait_for(lambda: "training steps" in (run / "trainer.log").read_text(), 120, "the resumed log")
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
                p.wait()
        if resumed is not None and live_trainer(RunDir(str(run))) is not None:
            os.kill(resumed.pid, signal.SIGTERM)
            wait_for(lambda: live_trainer(RunDir(str(run))) is None, 120, "the resumed trainer to stop")


def test_a_remote_runs_trainer_log_is_in_this_machines_cache_of_the_run():
    path = trainer_log_path(RunDir("s3://some-bucket/runs/r1"))
    assert path.startswith(str(cache_dir())) and path.endswith("/trainer.log") and "r1-" in path
    assert not Path("trainer-r1.log").exists()


def test_a_recorded_command_line_is_parsed_never_run(tmp_path):
    assert train_options(["--run-dir", "x", "--device=cuda:1", "--pace", "0.5", "--max-steps", "7"]) == {
        "device": "cuda:1",
        "max_steps": 7,
        "pace": 0.5,
        "nproc_per_node": 1,
    }
    for bad in (["--device", "cpu; rm -rf /"], ["--exec", "sh"], ["--pace", "nan"], ["--max-steps"]):
        with pytest.raises(ValueError):
            train_options(bad)
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    from andrea_core.run import lock

    me = lock.acquire(run, log=lambda m: None)
    from dataclasses import replace

    run.write_atomic(LOCK, replace(me, train_args=["--device", "$(reboot)"]).encode())
    with pytest.raises(ConfigError, match=r"recorded command line cannot be restarted .*--device"):
        recorded_train_options(run)
