"""Asynchronous checkpoints: the same bytes as the synchronous writer, one write in flight, signals that
wait for it, and failed writes that cost nothing but themselves.

A write is held in flight for real, not by a stand-in for the checkpointer: the test takes a read lease
(fcntl F_SETLEASE) on the file the writer is about to open, and the kernel holds the writer's open()
until the lease is released; the kernel's SIGIO tells the test that the writer got there. A write fails
for real too: its temporary name is a symlink to /dev/full, so the kernel answers ENOSPC.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import signal
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, andrea, last_logged_step, start_trainer, wait_for

from andrea_core.checkpoint import checkpoint_name, encode, snapshot
from andrea_core.config import load_run_config
from andrea_core.data.mixer import Exp3Mixer
from andrea_core.data.pipeline import step_rng
from andrea_core.model.gpt import GPT
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import TEST_FIXED_TEMPS_ENV, RunDir
from andrea_core.train.checkpoint_writer import Checkpointer
from andrea_core.train.optim import build_optimizer
from andrea_core.train.trainer import Trainer

F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)  # Linux: F_LINUX_SPECIFIC_BASE + 0
EVERY = 20  # checkpoint_every of these tests' runs: the tiny config, on a finer grid
SLOW = 600  # seconds: what a trainer may take on a machine shared with other work, start-up included
REFERENCE_STEPS = (20, 40, 60, 70)


def temp_name(step: int, pid: int) -> str:
    """RunDir.write_atomic's temporary name for a checkpoint written by process `pid`, under
    ANDREA_TEST_FIXED_TEMP_NAMES (fixed_temp_names): without it the name has a random suffix."""
    return f".{checkpoint_name(step)}.tmp.{pid}"


@pytest.fixture(autouse=True)
def fixed_temp_names(monkeypatch):
    """These tests plant a full-disk link or hold a lease at the name the writer will use: the
    writers they start (in this process and in trainers, which inherit the environment) use the
    fixed temporary names of TEST_FIXED_TEMPS_ENV instead of unguessable ones."""
    monkeypatch.setenv(TEST_FIXED_TEMPS_ENV, "1")


class HeldOpen:
    """Holds whoever opens `path` for writing inside open() until `release()`: a read lease."""

    def __init__(self, path: Path):
        path.write_bytes(b"")
        self.fd = os.open(path, os.O_RDONLY)
        fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_RDLCK)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_UNLCK)
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def sigio():
    """Counts the kernel's lease-break notices (SIGIO would otherwise terminate the test process)."""
    seen: list[float] = []
    previous = signal.signal(signal.SIGIO, lambda *_: seen.append(time.monotonic()))
    yield seen
    signal.signal(signal.SIGIO, previous)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_logged(log: Path, pattern: str, proc) -> int:
    """The step in the first line of the trainer's log that matches `pattern` (with one `(\\d+)`)."""

    def found():
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before logging {pattern!r}"
        m = re.search(pattern, log.read_text())
        return m and int(m.group(1))

    return wait_for(found, timeout=SLOW, what=f"a line like {pattern!r}")


def assert_held(run: Path, step: int, proc, seconds: float = 1.0) -> None:
    """Training logs `step`, then stays there (the process alive) while a write is held."""
    wait_for(lambda: last_logged_step(run) >= step, timeout=SLOW, what=f"step {step}'s loss")
    time.sleep(seconds)
    assert proc.poll() is None and last_logged_step(run) == step


def tiny_config(tmp: Path, async_checkpoint: bool = True) -> str:
    raw = yaml.safe_load(Path(TINY).read_text())
    # No sample audit on the grid: not what these tests are about, and the slowest part of a tiny run.
    # One intra-op thread (tests/tiny.py): two spin-wait on each other on a small shared machine.
    raw["train"].update(
        checkpoint_every=EVERY, async_checkpoint=async_checkpoint, sample_every=10**6, num_threads=1
    )
    path = tmp / f"andrea-tiny-every{EVERY}-{'async' if async_checkpoint else 'sync'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class Reference:
    """An uninterrupted run to step 70 with the synchronous writer."""

    def __init__(self, run: Path):
        self.run = run
        self.checkpoints = {s: (run / checkpoint_name(s)).read_bytes() for s in REFERENCE_STEPS}

    def __getitem__(self, step: int) -> bytes:
        return self.checkpoints[step]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    tmp = tmp_path_factory.mktemp("reference")
    run = str(tmp / "run")
    andrea("train", "--config", tiny_config(tmp, False), "--run-dir", run, "--max-steps", "70", timeout=SLOW)
    return Reference(tmp / "run")


def sync_checkpoints(tmp: Path, steps: list[int]) -> dict[int, bytes]:
    """Checkpoints at arbitrary steps from synchronous runs (one start per step, each a resume)."""
    run = tmp / "sync-run"
    config = tiny_config(tmp, async_checkpoint=False)
    for step in sorted(steps):
        args = ["--config", config] if not run.exists() else []
        andrea("train", *args, "--run-dir", str(run), "--max-steps", str(step), timeout=SLOW)
    return {s: (run / checkpoint_name(s)).read_bytes() for s in steps}


# --- the checkpointer in process ------------------------------------------------------------------


def tiny_model_and_optimizer(steps: int):
    cfg = load_run_config(TINY)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.train, "cpu")
    for _ in range(steps):
        train_one_step(model, optimizer)
    return model, optimizer


def train_one_step(model, optimizer) -> None:
    x = torch.randint(0, 256, (4, 32))
    _, loss = model(x, torch.roll(x, -1, dims=1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_async_file_is_byte_identical_to_sync(tmp_path):
    model, optimizer = tiny_model_and_optimizer(steps=3)
    sync = Checkpointer(RunDir(tmp_path / "sync"), model, optimizer, asynchronous=False, log=lambda _: None)
    background = Checkpointer(RunDir(tmp_path / "async"), model, optimizer, log=lambda _: None)
    n = model.n_params
    for step in (3, 4):  # the second save reuses both buffers
        if step == 4:
            train_one_step(model, optimizer)
        expected = encode(step, snapshot(model, optimizer).numpy())
        sync.save(step)
        background.save(step)
        assert background.wait().error is None
        name = checkpoint_name(step)
        written = (tmp_path / "async" / name).read_bytes()
        assert written == (tmp_path / "sync" / name).read_bytes() == expected
        assert len(written) == 8 + 12 * n + 8  # header, floats, checksum trailer
        assert struct.unpack_from("<ii", written) == (step, n)
        assert struct.unpack_from("<3sBI", written, 8 + 12 * n) == (b"ANC", 1, zlib.crc32(written[:-8]))
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name]


def test_at_most_one_write_in_flight(tmp_path, sigio):
    """While the write of step 1 is held in the kernel, save(1) has returned and training goes on;
    save(2) waits for it without touching the buffer the held write is about to read."""
    model, optimizer = tiny_model_and_optimizer(steps=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = Checkpointer(RunDir(run_dir), model, optimizer, log=lambda _: None)
    at_step_1 = encode(1, snapshot(model, optimizer).numpy())
    held = HeldOpen(run_dir / temp_name(1, os.getpid()))
    try:
        ckpt.save(1)  # returns at once: the write goes on in the background
        wait_for(lambda: sigio, timeout=30, what="the writer to open step 1's temporary file")
        assert ckpt.in_flight and not (run_dir / checkpoint_name(1)).exists()

        train_one_step(model, optimizer)  # training goes on while step 1 is being written
        at_step_2 = encode(2, snapshot(model, optimizer).numpy())
        second = threading.Thread(target=ckpt.save, args=(2,))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive(), "a second save started while the first write was in flight"
        assert not (run_dir / temp_name(2, os.getpid())).exists()
        assert not (run_dir / checkpoint_name(1)).exists()
    finally:
        held.release()
    second.join(timeout=30)
    assert ckpt.wait().error is None
    assert (run_dir / checkpoint_name(1)).read_bytes() == at_step_1
    assert (run_dir / checkpoint_name(2)).read_bytes() == at_step_2
    first, then = ckpt.records
    assert first.error is None and then.stall_s >= 1.0  # the second save blocked until the release


# --- the trainer, as a real process ---------------------------------------------------------------


@pytest.mark.slow
def test_sigusr1_and_sigterm_wait_for_the_write_in_flight(tmp_path, reference, sigio):
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "train.log"
    args = ["--config", tiny_config(tmp_path), "--run-dir", str(run), "--max-steps", "100", "--pace", "0.05"]
    proc = start_trainer(*args, log=log)
    held = HeldOpen(run / temp_name(20, proc.pid))
    later = None
    try:
        wait_for(lambda: len(sigio) >= 1, timeout=SLOW, what="the write of step 20 to start")
        wait_for(lambda: last_logged_step(run) >= 24, timeout=SLOW, what="training to go on past step 24")
        assert not (run / checkpoint_name(20)).exists()

        proc.send_signal(signal.SIGUSR1)
        usr1_step = wait_logged(log, r"SIGUSR1: checkpoint of step (\d+) requested", proc)
        assert 24 <= usr1_step < 40
        assert_held(run, usr1_step, proc)  # its checkpoint waits for the write in flight
        assert not (run / checkpoint_name(20)).exists()
        assert not (run / checkpoint_name(usr1_step)).exists()

        later = HeldOpen(run / temp_name(40, proc.pid))
        held.release()
        wait_for(
            lambda: (run / checkpoint_name(usr1_step)).exists(), timeout=SLOW, what="the SIGUSR1 checkpoint"
        )
        wait_for(lambda: len(sigio) >= 2, timeout=SLOW, what="the write of step 40 to start")
        assert proc.poll() is None  # SIGUSR1 trains on
        wait_for(lambda: last_logged_step(run) >= 44, timeout=SLOW, what="training to go on past step 44")

        proc.send_signal(signal.SIGTERM)
        term_step = wait_logged(log, r"SIGTERM: checkpointing step (\d+), then exiting", proc)
        assert 44 <= term_step < 60
        assert_held(run, term_step, proc)  # finished its step, and waits for the write in flight
        assert not (run / checkpoint_name(40)).exists()
        later.release()
        assert proc.wait(timeout=SLOW) == 0
    finally:
        held.release()
        if later is not None:
            later.release()
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert f"SIGUSR1: checkpoint of step {usr1_step} requested" in text
    assert f"SIGTERM: stopped at step {term_step}, checkpoint {checkpoint_name(term_step)}" in text
    assert read_history(RunDir(run))[-1].step == term_step
    assert RunDir(run).checkpoint_steps() == [20, usr1_step, 40, term_step]
    assert (run / checkpoint_name(20)).read_bytes() == reference[20]
    assert (run / checkpoint_name(40)).read_bytes() == reference[40]
    expected = sync_checkpoints(tmp_path, [usr1_step, term_step])
    for step in (usr1_step, term_step):
        assert (run / checkpoint_name(step)).read_bytes() == expected[step], step
    assert not [p for p in run.iterdir() if ".tmp." in p.name]


def test_a_sigterm_during_a_grid_steps_checkpoint_exits_with_that_checkpoint(tmp_path, reference, sigio):
    """A stop that lands after a grid step was taken, while its checkpoint waits for the write in flight:
    that step is the one in flight. The trainer trains nothing more, says so, and exits 0 with that
    checkpoint, whose write began before the signal and ends after it (docs/design.md "Signals"; a
    cancelled flow run met it, tests/test_prefect_flows.py)."""
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "train.log"
    args = ["--config", tiny_config(tmp_path), "--run-dir", str(run), "--max-steps", "70"]
    proc = start_trainer(*args, log=log)
    held = HeldOpen(run / temp_name(20, proc.pid))
    try:
        # Step 40's loss is logged once its end was reached with no stop asked for; its checkpoint then
        # waits for step 20's write, held open here: the SIGTERM lands inside step 40's save.
        wait_for(lambda: last_logged_step(run) >= 40, timeout=SLOW, what="step 40's loss")
        assert len(sigio) == 1 and not (run / checkpoint_name(20)).exists()
        proc.send_signal(signal.SIGTERM)
        held.release()
        assert proc.wait(timeout=SLOW) == 0
    finally:
        held.release()
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "SIGTERM during step 40's checkpoint: exiting with it" in text
    assert "checkpointing step" not in text
    assert "SIGTERM: stopped at step 40, checkpoint step_000040.bin" in text
    assert [e.step for e in read_history(RunDir(run))] == list(range(1, 41))
    assert RunDir(run).checkpoint_steps() == [20, 40]
    assert (run / checkpoint_name(20)).read_bytes() == reference[20]
    assert (run / checkpoint_name(40)).read_bytes() == reference[40]


def test_failed_write_is_logged_and_retried_at_the_next_boundary(tmp_path, reference):
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "train.log"
    args = ["--config", tiny_config(tmp_path), "--run-dir", str(run), "--max-steps", "70", "--pace", "0.02"]
    proc = start_trainer(*args, log=log)
    # The disk is full for step 40's write and for the first try of the final step's (70).
    (run / temp_name(40, proc.pid)).symlink_to("/dev/full")
    (run / temp_name(70, proc.pid)).symlink_to("/dev/full")
    try:
        wait_for(lambda: (run / checkpoint_name(20)).exists(), timeout=SLOW, what="step_000020.bin")
        first = sha(run / checkpoint_name(20))
        assert proc.wait(timeout=SLOW) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    for step in (40, 70):
        error = (
            f"ERROR: checkpoint {checkpoint_name(step)} was NOT written: OSError: [Errno 28] No space left"
        )
        assert error in text
    assert f"checkpoint {checkpoint_name(60)} (" in text and f"checkpoint {checkpoint_name(70)} (" in text
    assert sha(run / checkpoint_name(20)) == first
    assert RunDir(run).checkpoint_steps() == [20, 60, 70]
    for step in (20, 60, 70):
        assert (run / checkpoint_name(step)).read_bytes() == reference[step], step
    assert not [p for p in run.iterdir() if ".tmp." in p.name]


def test_final_checkpoint_that_cannot_be_written_fails_the_exit(tmp_path, reference):
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "train.log"
    proc = start_trainer(
        "--config", tiny_config(tmp_path), "--run-dir", str(run), "--max-steps", "30", log=log
    )
    (run / temp_name(30, proc.pid)).mkdir()  # in the way of both tries
    assert proc.wait(timeout=SLOW) == 1
    text = log.read_text()
    assert text.count(f"ERROR: checkpoint {checkpoint_name(30)} was NOT written") == 2
    assert (
        "ERROR: completed at step 30, but its checkpoint could not be written; "
        f"the newest checkpoint on disk is {checkpoint_name(20)}"
    ) in text
    assert (run / checkpoint_name(20)).read_bytes() == reference[20]
    assert RunDir(run).checkpoint_steps() == [20]


# --- the mixer hears of each loss at the same point, resumed or not --------------------------------


class RecordingMixer:
    def __init__(self, inner, events: list, on_choose=None):
        self.inner, self.events, self.on_choose = inner, events, on_choose
        self.arms, self.kind = inner.arms, inner.kind

    def probabilities(self):
        return self.inner.probabilities()

    def choose(self, step, rng):
        self.events.append(("choose", step))
        if self.on_choose is not None:
            self.on_choose(step)
        return self.inner.choose(step, rng)

    def observe(self, step, arm, loss):
        self.events.append(("observe", step, arm, loss))
        self.inner.observe(step, arm, loss)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def record_training(run: Path, max_steps: int, on_choose=None) -> tuple[list, str]:
    events: list = []

    class RecordingTrainer(Trainer):
        def _build(self) -> None:
            super()._build()
            self.data.mixer = RecordingMixer(self.data.mixer, events, on_choose)

    cfg = None if (run / "run.yaml").exists() else load_run_config(tiny_config(run.parent))
    result = RecordingTrainer(str(run), cfg, max_steps=max_steps, log=lambda _: None).train()
    return events, result.reason


def test_observation_schedule_is_the_same_in_resumed_runs(tmp_path):
    """Step s's loss reaches the mixer after batch s+1 is drawn and before batch s+2, whether or not a
    checkpoint, SIGUSR1, SIGTERM or a restart came in between."""
    straight, _ = record_training(tmp_path / "a", 50)
    for s in range(1, 49):
        i = straight.index(("choose", s + 1))
        assert straight[i + 1][:2] == ("observe", s) and straight[i + 2] == ("choose", s + 2)
    assert [e for e in straight if e[0] == "observe"][-1][1] == 49  # step 50's loss: nobody left to hear

    def signals(step: int) -> None:
        if step == 15:
            os.kill(os.getpid(), signal.SIGUSR1)  # an off-grid checkpoint of step 15
        if step == 30:
            os.kill(os.getpid(), signal.SIGTERM)  # checkpoint of step 30, exit

    first, reason = record_training(tmp_path / "b", 50, on_choose=signals)
    assert reason == "SIGTERM"
    assert RunDir(tmp_path / "b").checkpoint_steps() == [15, 20, 30]
    resumed, reason = record_training(tmp_path / "b", 50)
    assert reason == "completed"
    assert resumed[:3] == [("choose", 31), straight[straight.index(("choose", 31)) + 1], ("choose", 32)]
    assert first + resumed == straight


# --- bit-exact resume, with checkpoints written in the background ---------------------------------


@pytest.mark.slow
def test_bit_exact_resume_across_signals_and_kill(tmp_path, reference):
    run = tmp_path / "run"
    run.mkdir()

    def start(*extra: str, pace: str = "0.05"):
        return start_trainer(*extra, "--run-dir", str(run), "--max-steps", "70", "--pace", pace)

    proc = start("--config", tiny_config(tmp_path))
    wait_for(lambda: last_logged_step(run) >= 12, timeout=SLOW, what="step 12")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=SLOW) == 0
    stopped = RunDir(run).checkpoint_steps()[-1]
    assert stopped == last_logged_step(run) >= 12, "SIGTERM checkpoints the step in flight"

    proc = start(pace="0.1")
    after = max(21, stopped + 1)  # a step of this trainer's: its handlers are installed
    wait_for(lambda: last_logged_step(run) >= after, timeout=SLOW, what=f"step {after}")
    # Up to 19 steps (>= 1.9 s, however loaded the machine) before the grid's step 40.
    proc.send_signal(signal.SIGUSR1)
    usr1 = wait_for(
        lambda: [s for s in RunDir(run).checkpoint_steps() if s >= after and s % EVERY],
        timeout=SLOW,
        what="the SIGUSR1 checkpoint of the step in flight, off the grid",
    )[0]
    assert usr1 < 40, f"the SIGUSR1 checkpoint is of the step in flight ({after}-39), not step {usr1}"
    RunDir(run).read_checkpoint(usr1)
    wait_for(lambda: last_logged_step(run) >= 50, timeout=SLOW, what="step 50")
    assert proc.poll() is None, "SIGUSR1 does not stop the trainer"
    proc.kill()
    proc.wait(timeout=SLOW)
    (run / temp_name(40, 999_999)).write_bytes(b"left by a writer killed mid-write")

    log = tmp_path / "last.log"
    proc = start_trainer("--run-dir", str(run), "--max-steps", "70", log=log)
    assert proc.wait(timeout=SLOW) == 0
    assert f"{temp_name(40, 999_999)}, left by a writer that did not finish" in log.read_text()
    assert not [p for p in run.iterdir() if ".tmp." in p.name]
    assert (run / checkpoint_name(70)).read_bytes() == reference[70]
    history = read_history(RunDir(run))
    assert [e.step for e in history] == list(range(1, 71))
    assert len({e.segment for e in history}) == 3
    assert [e.loss for e in history] == [e.loss for e in read_history(RunDir(reference.run))]


def test_late_observation_is_weighted_by_the_probability_drawn_with_even_across_a_restart():
    """The loss of step 6 arrives after step 5's has moved the distribution: EXP3 must still divide by
    the probability arm 6 was drawn with, and so must a bandit restored from the state of checkpoint 6."""
    mixer = Exp3Mixer(["a", "b", "c"], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0])
    for step, arm in enumerate(["a", "b", "c", "b"], start=1):
        mixer.observe(step, arm, 3.0 - 0.1 * step)  # baselines and the reward scale are set now
    arm = mixer.choose(6, step_rng(1337, 6))
    i = mixer.arms.index(arm)
    drawn_with = float(mixer.probabilities()[i])
    mixer.observe(5, "c", 1.0)  # step 5's loss, heard after the draw of step 6
    assert mixer.probabilities()[i] != drawn_with, "the test needs a distribution that moved"
    saved = json.loads(json.dumps(mixer.state_dict()))  # .state.json of checkpoint 6
    restored = Exp3Mixer(["a", "b", "c"], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0])
    restored.load_state_dict(saved)

    before = mixer.reward.copy()
    for bandit in (mixer, restored):
        bandit.observe(6, arm, 0.01)  # a huge improvement: the normalised reward clips to exactly 1
    expected = (1 - mixer.reward_ema) * before
    expected[i] += mixer.reward_ema * 1.0 / drawn_with
    assert np.array_equal(mixer.reward, expected) and np.array_equal(restored.reward, expected)
    assert mixer.state_dict() == restored.state_dict() and mixer.drawn == {}
