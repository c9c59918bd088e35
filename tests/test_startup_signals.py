"""Issue 18.1: a SIGTERM during start-up, before torch is imported, ends in a clean exit 0 with a line
saying so; and the commands that never train never import torch."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, _env, andrea, start_trainer, wait_for

from andrea_core.run.rundir import RunDir
from tests.tiny import tiny_config


def handles(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_sigterm_after_the_handlers_and_before_torch_exits_cleanly(tmp_path):
    """The window is made certain, not hit by luck: the test waits (polling /proc, sub-millisecond)
    for the trainer's SIGTERM handler to appear, freezes the trainer with SIGSTOP, and checks in
    /proc/PID/maps that torch is not loaded yet. Only then is SIGTERM sent (and SIGCONT). A freeze
    that came too late (torch already mapped) is not counted: a new trainer is started."""
    config = tiny_config(tmp_path)
    late = 0
    for attempt in range(8):
        run = tmp_path / f"run{attempt}"
        log = tmp_path / f"train{attempt}.log"
        proc = start_trainer("--config", config, "--run-dir", str(run), log=log, cold=True)
        deadline = time.monotonic() + 120
        try:
            while proc.poll() is None and not handles(proc.pid, signal.SIGTERM):
                assert time.monotonic() < deadline, "the trainer never installed its SIGTERM handler"
                time.sleep(0.0002)
        except (OSError, StopIteration):
            pass
        assert proc.poll() is None, log.read_text()
        os.kill(proc.pid, signal.SIGSTOP)
        while state(proc.pid) != "T":
            time.sleep(0.001)
        if torch_loaded(proc.pid):
            late += 1
            proc.kill()
            proc.wait()
            continue
        os.kill(proc.pid, signal.SIGTERM)  # the handler is in, torch is not: the start-up window
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 0, log.read_text()
        text = log.read_text()
        assert "andrea: SIGTERM before the first step (during start-up): nothing to checkpoint" in text
        assert not run.exists()  # stopped before any work: no run directory, no lock, no checkpoint
        return
    raise AssertionError(
        f"in {late} tries torch was always loaded by the time the SIGTERM handler was installed"
    )


def test_commands_that_never_train_never_import_torch(tmp_path):
    run = tmp_path / "run"
    andrea(
        "train",
        "--config",
        tiny_config(tmp_path, train__checkpoint_every=10),
        "--run-dir",
        str(run),
        "--max-steps",
        "10",
    )
    ckpt = str(run / "step_000010.bin")
    for args in (
        ["loss", str(run)],
        ["inspect", ckpt],
        ["lineage", str(run)],
        ["status", str(run)],  # an operator's `watch andrea status`: 0.2 s, not 3 s of importing torch
        ["audit", str(run)],
        ["gc", str(run)],
    ):
        code = (
            "import sys; from andrea_core import cli; rc = cli.main(sys.argv[1:]); "
            "print('TORCH', 'torch' in sys.modules); sys.exit(rc)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(), cwd=REPO
        )
        assert proc.returncode == 0, proc.stderr
        assert "TORCH False" in proc.stdout, f"andrea {' '.join(args)} imported torch"
    assert RunDir(str(run)).checkpoint_steps() == [10]
    assert Path(ckpt).exists()


@pytest.mark.parametrize("config", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_the_parameter_count_by_arithmetic_is_the_models(config):
    """fork.run_n_params counts by arithmetic (no torch for status, gc, lineage): it must be exactly
    what GPT allocates, for every shipped config and for odd shapes."""
    import torch

    from andrea_core.config import estimated_n_params, load_run_config
    from andrea_core.model.gpt import GPT
    from andrea_core.model_config import ModelConfig

    shapes = [
        load_run_config(config).model,
        ModelConfig(vocab_size=300, block_size=7, n_layer=3, n_head=2, n_embd=6),
    ]
    for m in shapes:
        with torch.device("meta"):
            assert estimated_n_params(m) == GPT(m).n_params, m


def test_a_two_rank_cpu_job_becomes_the_torchrun_agent_without_importing_torch(tmp_path):
    """`andrea train --nproc-per-node 2 --device cpu` checks the world size and the config, then replaces
    itself with the torchrun agent (which imports torch): it must not import torch first for nothing (a
    GPU count is all it would need it for). The exec is stopped here to look at what was imported."""
    code = (
        "import os, sys; from andrea_core import cli\n"
        "def execv(path, argv): print('TORCH', 'torch' in sys.modules, argv[2]); sys.exit(0)\n"
        "os.execv = execv; sys.exit(cli.main(sys.argv[1:]))"
    )
    args = ["train", "--config", tiny_config(tmp_path), "--run-dir", str(tmp_path / "run")]
    args += ["--nproc-per-node", "2", "--device", "cpu", "--max-steps", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(), cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "TORCH False andrea_core.train.distributed", proc.stdout


def test_a_stop_while_a_completed_trainer_exits_leaves_its_exit_status_0(tmp_path):
    """The end of a trainer's life, the other window (the chaos soak, 2026-12-07: a request's stop, then
    the soak's SIGTERM as the trainer exited, status -15): once it has said "completed", the trainer
    signals reach a process whose work is done, and Python's finalization put their default action
    back (here 1.5-2.7 s of exit at load 10): each killed it, a unit failed, a flow run crashed. Sent
    every 2 ms from that line to the process's end, in turn, none changes its status: 0."""
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    config = tiny_config(tmp_path, train__checkpoint_every=2, train__sample_every=10**6)
    proc = start_trainer("--config", config, "--run-dir", str(run), "--max-steps", "2", log=log, cold=True)
    try:
        wait_for(lambda: "completed step 2" in log.read_text() or proc.poll() is not None, what="step 2")
        sent = 0
        for signum in itertools.cycle((signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)):
            if proc.poll() is not None:
                break
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                break
            sent += 1
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(60) == 0 and sent > 0, (proc.returncode, sent, log.read_text()[-2000:])
    assert RunDir(str(run)).checkpoint_steps() == [2]
