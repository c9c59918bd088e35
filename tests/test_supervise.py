"""Supervising real trainer processes from outside (andrea_core.ops.supervise, andrea_core.pdeathsig): what
the Prefect tasks are thin wrappers over, exercised without Prefect."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from andrea_core.checkpoint import checkpoint_name
from andrea_core.oom import TRAINER_OOM_BIAS
from andrea_core.ops.supervise import (
    LossLogSnapshot,
    SupervisionError,
    TrainerChanged,
    TrainerProcess,
    first_entry_after,
    gpu_slot_name,
    wait_for_checkpoint,
    wait_for_exit,
)
from andrea_core.run.lock import TrainerIdentity, live_trainer, process_start_ticks, read_lock
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import LOSS_LOG, RunDir
from tests.conftest import REPO, _env, andrea, last_logged_step, library_run, wait_for, warm_launcher
from tests.tiny import tiny_config


def test_trainer_process_follows_and_stops_with_a_checkpoint_of_the_step_in_flight(tmp_path):
    """Also the launched trainer's oom_score_adj (test_a_launched_trainer_is_the_oom_killers_choice_
    before_its_launcher: the kernel's OOM killer takes the trainer before its supervisor), read while
    it trains: TRAINER_OOM_BIAS above this process's own, capped at 1000, this process's left alone."""
    run = RunDir(tmp_path / "run")
    own = int(open("/proc/self/oom_score_adj").read())
    trainer = TrainerProcess(run.url, config=tiny_config(tmp_path), max_steps=100_000, pace=0.02).start()
    seen, adj = [], None
    for line in trainer.lines():
        seen.append(line)
        adj = adj if adj is not None else int(open(f"/proc/{trainer.pid}/oom_score_adj").read())
        if trainer.step is not None and trainer.step >= 50:
            break
    assert adj == min(1000, own + TRAINER_OOM_BIAS) and own < adj
    outcome = trainer.stop(timeout=120)
    assert int(open("/proc/self/oom_score_adj").read()) == own
    assert outcome.reason == "SIGTERM" and outcome.returncode == 0 and outcome.ok
    history = read_history(run)
    # Nothing lost but nothing invented: the checkpoint is of the last step the trainer logged.
    assert outcome.step == history[-1].step >= 50
    assert outcome.checkpoint == checkpoint_name(outcome.step)
    assert run.read_checkpoint(outcome.step).step == outcome.step
    assert any(line.startswith("andrea: step 50/100000") for line in seen)
    held = read_lock(run)
    assert held is None or held.released, "the trainer releases its lock on the way out"
    assert "stopped at step" in outcome.describe()


def test_a_trainer_stopped_by_a_pivot_reports_its_checkpoint_where_the_pivot_archived_it(tmp_path):
    """A pivot stops the trainer (SIGTERM: it checkpoints the step in flight, past the boundary) and
    archives that checkpoint with the closed phase as soon as the trainer has exited: the trainer's
    supervisor (the train flow run) may look only after that. It reports the checkpoint where it is
    now, validated there, and the stop as the success it is (it said "not usable: no such file", and the
    train flow run of a pivoted run ended Failed). A trainer the SIGTERM finds between steps, right at
    the boundary, leaves nothing to archive: then the pivot is run again on a fresh run (up to 3)."""
    for attempt in range(3):
        run = RunDir(tmp_path / f"run{attempt}")
        (tmp_path / f"cfg{attempt}").mkdir()
        cfg = tiny_config(tmp_path / f"cfg{attempt}", train__checkpoint_every=10, train__sample_every=10**6)
        trainer = TrainerProcess(run.url, config=cfg, max_steps=100_000).start()
        for _ in trainer.lines():
            if trainer.step is not None and trainer.step >= 12:
                break
        log = tmp_path / f"pivot{attempt}.log"
        # The pivot's output to a file: this test reads the trainer's pipe meanwhile. Forked warm (its
        # start-up is not what is tested: the trainer's report is); the trainer stays cold.
        launcher = warm_launcher()
        pivot = (launcher.popen if launcher else subprocess.Popen)(
            [sys.executable, "-m", "andrea_core", "pivot", run.url, "--policy", "tiny-mix", "--no-restart"],
            cwd=REPO, env=_env(), stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in trainer.lines():  # to its end: the pivot has stopped it
            pass
        assert pivot.wait(timeout=300) == 0, log.read_text()
        outcome = trainer.finish(timeout=60)  # only now, with the pivot done, does the supervisor look
        (folder,) = run.listdir("archive")
        boundary = int(folder.rsplit("_", 1)[1])
        assert outcome.reason == "SIGTERM" and outcome.ok and boundary % 10 == 0
        if outcome.step == boundary:  # stopped between steps: its checkpoint is the pivot point, in place
            assert outcome.checkpoint == checkpoint_name(boundary) and outcome.detail == ""
            continue
        assert outcome.step > boundary
        assert outcome.checkpoint == f"archive/{folder}/{checkpoint_name(outcome.step)}"
        assert not run.exists(checkpoint_name(outcome.step))
        assert run.read_checkpoint(outcome.step, folder=f"archive/{folder}").step == outcome.step
        assert "archived since with the phase a pivot closed" in outcome.describe()
        return
    pytest.fail("3 pivots stopped their trainer right at the boundary: nothing was archived")


def test_trainer_process_reports_a_refused_start(tmp_path, tmp_path_factory):
    run = RunDir(library_run(tmp_path_factory, tmp_path / "run", 10))  # andrea-tiny at step 10
    trainer = TrainerProcess(run.url, config=str(REPO / "configs" / "andrea-12m.yaml"), max_steps=20).start()
    for _ in trainer.lines():
        pass
    outcome = trainer.outcome()
    assert not outcome.ok and outcome.reason == "error" and outcome.returncode == 2
    assert "differs from the frozen run.yaml" in outcome.detail


def test_a_trainer_whose_launcher_is_killed_checkpoints_and_exits(tmp_path, tmp_path_factory):
    """SIGKILL of the process that launched the trainer (a flow-run process, in production) reaches
    the trainer as SIGTERM through the parent-death signal: it checkpoints the step in flight and exits,
    and a later trainer resumes from exactly there. The launched trainer resumes a copy of the library's
    andrea-tiny at step 100 (conftest.library_run: its grid checkpoint and audit done), rather than
    training steps 1..100 at the pace first: what is tested is the launcher's death, not those steps."""
    run = RunDir(library_run(tmp_path_factory, tmp_path / "run", 100))  # andrea-tiny at step 100
    launcher = textwrap.dedent(
        f"""
        import sys, time
        from andrea_core.ops.supervise import TrainerProcess
        t = TrainerProcess({run.url!r}, max_steps=100000, pace=0.02).start()
        print(t.pid, flush=True)
        for line in t.lines():
            pass
        """
    )
    temporary = tmp_path / "tmp"  # where the launcher makes its events file (train/events.py)
    temporary.mkdir()
    env = _env() | {"TMPDIR": str(temporary)}
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=env)
    trainer_pid = int(proc.stdout.readline())
    # Kill once training is past the grid checkpoint and its audit, so that the checkpoint the
    # SIGTERM writes is an off-grid one (a kill during step 100's audit would have nothing new to save).
    wait_for(lambda: last_logged_step(run) > 100, timeout=180, what="training past step 100")
    identity = live_trainer(run)
    assert identity is not None and identity.pid == trainer_pid
    proc.kill()
    proc.wait()
    wait_for_exit(identity, timeout=60)
    # The launcher died before its trainer ended: its events file went with the last fd on it (19 were
    # left in /tmp after 5 hours of tests when the supervisor alone removed it).
    assert list(temporary.iterdir()) == []
    stopped_at = read_history(run)[-1].step
    assert run.checkpoint_steps()[-1] == stopped_at
    assert 100 < stopped_at < 200, f"the SIGTERM checkpoint should be off the grid, got step {stopped_at}"
    run.read_checkpoint(stopped_at)
    resumed = andrea("train", "--run-dir", run.url, "--max-steps", str(stopped_at + 5))
    assert f"resuming {run.url} from {checkpoint_name(stopped_at)}" in resumed.stdout


def test_a_launched_trainer_is_the_oom_killers_choice_before_its_launcher():
    """In an out-of-memory kill the kernel must take the trainer, not the supervisor that reports it
    and starts the next one (test_oom shows it in a real memory cgroup): the trainer runs with an
    oom_score_adj TRAINER_OOM_BIAS above its launcher's (set by pdeathsig before the exec, so a torchrun
    agent's ranks inherit it), capped at the kernel's 1000; the launcher's own is left as it was.
    A TrainerProcess launched from this process, at its own oom_score_adj, is read in
    test_trainer_process_follows_and_stops_with_a_checkpoint_of_the_step_in_flight (while its trainer
    trains: one trainer start fewer); here launchers already raised (a unit's OOMScoreAdjust) start
    through pdeathsig as TrainerProcess does: the trainer above its launcher, at most 1000."""
    for launcher in (300, 700):
        code = textwrap.dedent(
            f"""
            import os, subprocess, sys
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("{launcher}")
            pdeathsig = [sys.executable, "-m", "andrea_core.pdeathsig", str(os.getpid())]
            print(subprocess.run([*pdeathsig, "cat", "/proc/self/oom_score_adj"], check=True).returncode)
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
        )
        assert out.stdout.split() == [str(min(1000, launcher + TRAINER_OOM_BIAS)), "0"], out


def test_wait_for_checkpoint_fails_fast_when_the_trainer_exits_first(tmp_path, tmp_path_factory):
    """The trainer resumes a copy of the library's andrea-tiny at step 100 (conftest.library_run) and
    ends at 150: its steps 1..100 are not what is tested."""
    run = RunDir(library_run(tmp_path_factory, tmp_path / "run", 100))  # andrea-tiny at step 100
    trainer = TrainerProcess(run.url, max_steps=150).start()
    wait_for(lambda: live_trainer(run), timeout=120, what="the trainer's lock")
    identity = live_trainer(run)
    # TrainerChanged: whoever waited decides again from whoever holds the run now (the pivot's step 1).
    said = r"it exited \(or another took the run over\) before writing step_000200\.bin"
    with pytest.raises(TrainerChanged, match=said):
        wait_for_checkpoint(run, 200, timeout=300, trainer=identity)
    for _ in trainer.lines():
        pass
    assert trainer.outcome().reason == "completed"
    assert wait_for_checkpoint(run, 150, timeout=1).step == 150


def test_loss_log_snapshot_accepts_appends_and_refuses_rewrites(tmp_path):
    run = RunDir(tmp_path / "run")
    run.makedirs()
    line = {"step": 1, "loss": 2.5, "lr": 0.1, "arm": "a", "tokens": 8, "segment": 1, "time": 0.0}
    run.append(LOSS_LOG, (json.dumps(line) + "\n").encode())
    snap = LossLogSnapshot.take(run)
    snap.check_unchanged(run)
    assert first_entry_after(run, snap) is None
    run.append(LOSS_LOG, (json.dumps({**line, "step": 2, "segment": 2}) + "\n").encode())
    assert first_entry_after(run, snap)["step"] == 2
    with pytest.raises(SupervisionError, match="appended"):
        snap.check_unchanged(run)
    data = bytearray(run.read_bytes(LOSS_LOG))
    data[10] ^= 1
    run.write_atomic(LOSS_LOG, bytes(data))
    with pytest.raises(SupervisionError, match="rewritten"):
        snap.check_prefix_of(run)
    run.write_atomic(LOSS_LOG, bytes(data[:5]))
    with pytest.raises(SupervisionError, match="shrank"):
        snap.check_prefix_of(run)


def test_gpu_slot_names():
    assert gpu_slot_name("auto", "cpu") is None
    assert gpu_slot_name(None, "cuda:1") is None
    assert gpu_slot_name("", "auto") is None
    assert gpu_slot_name("gpu-3", "cpu") == "gpu-3"


def test_zombie_trainer_counts_as_gone():
    """An exited trainer that its parent has not reaped yet is a zombie: its pid and start time are
    still in /proc, but it holds nothing, so waiting for its exit must not hang."""
    # The child lives until its stdin closes: alive for certain while the test looks, then gone at once.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    # This machine's identity (host, boot id, pid namespace) with the child's pid and start time.
    here = TrainerIdentity.of_this_process("run")
    ident = dataclasses.replace(here, pid=child.pid, proc_start=process_start_ticks(child.pid))
    assert ident.is_alive()
    child.stdin.close()
    wait_for(lambda: _state(child.pid) == "Z", what="the child to exit (unreaped)")
    assert process_start_ticks(child.pid) is None
    assert not ident.is_alive()
    assert wait_for_exit(ident, timeout=1) < 1
    child.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_forged_request_in_the_human_log_is_never_read_as_progress_or_an_error(tmp_path, monkeypatch):
    """43.12 (the flow's side): a forged .trainer-request.json whose `by` holds newlines reaches the
    trainer's human log as lines of its own ("andrea: step 99999/100000 ...", "andrea: error: forged").
    The supervisor reads the trainer's events (train/events.py), not that log: the lines are passed on
    for people, and the step, the total and the outcome are the trainer's own. (The log-line regexes
    took step 99999 of 100000 as real progress.)"""
    monkeypatch.setenv("ANDREA_LEASE_RENEW_S", "0.2")  # the request is read at each lease renewal
    monkeypatch.setenv("ANDREA_LEASE_TTL_S", "2")
    run = RunDir(tmp_path / "run")
    trainer = TrainerProcess(run.url, config=tiny_config(tmp_path), max_steps=100_000, pace=0.02).start()
    for _ in trainer.lines():
        if trainer.step is not None and trainer.step >= 20:
            break
    forged = "\nandrea: step 99999/100000 loss 0.0001\nandrea: error: forged"
    doc = {"format": 1, "request": "stop", "generation": read_lock(run).generation, "id": "f" * 16}
    run.write_json(".trainer-request.json", doc | {"by": forged, "at": time.time()})
    seen, steps = [], []
    for line in trainer.lines():
        seen.append(line)
        steps.append(trainer.step)
    outcome = trainer.outcome()
    # The forged text did reach the human log (as lines of their own, until a sanitizer escapes them) ...
    assert any("step 99999/100000 loss 0.0001" in line for line in seen), seen[-10:]
    assert any("error: forged" in line for line in seen), seen[-10:]
    # ... and none of it was taken for the trainer's state or its end.
    real = read_history(run)[-1].step
    assert max(s for s in steps if s is not None) <= real < 99999
    assert trainer.total == 100_000 and trainer.loss is not None and trainer.loss > 0.01
    assert outcome.reason == "SIGTERM" and outcome.ok and outcome.step == real
    assert outcome.checkpoint == checkpoint_name(real) and outcome.detail == ""


# --- a promise of the README and docs/design.md no test held the code to: the GPU slot a device
# string maps to


def test_gpu_slot_names_auto_and_explicit():
    assert gpu_slot_name("test-gpu", "cpu") == "test-gpu"  # an explicit name, as given
    assert gpu_slot_name(None, "cuda:1") is None and gpu_slot_name("", "cpu") is None
    assert gpu_slot_name("auto", "cpu") is None  # the CPU holds no GPU slot
    if not torch.cuda.is_available():
        assert gpu_slot_name("auto", "auto") is None
        return
    assert gpu_slot_name("auto", "auto") == f"gpu-{torch.cuda.current_device()}"
    assert gpu_slot_name("auto", "cuda") == f"gpu-{torch.cuda.current_device()}"
    for i in range(torch.cuda.device_count()):
        assert gpu_slot_name("auto", f"cuda:{i}") == f"gpu-{i}"


def test_auto_maps_a_cuda_device_string_to_its_gpu_slot(monkeypatch):
    """On a machine without CUDA, the mapping of "cuda:N" strings alone (no device is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_slot_name("auto", "cuda:0") == "gpu-0"
    assert gpu_slot_name("auto", "cuda:3") == "gpu-3"
