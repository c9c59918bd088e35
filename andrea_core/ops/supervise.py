"""Supervising a trainer from outside its process: launch and follow it, wait for its checkpoints and
its exit, and check that its loss log was only ever appended to.

An orchestrator talks to a trainer only through signals and the run directory (docs/design.md "Processes"),
and hears from a trainer it started through its structured events (train/events.py), never by reading
its human log: that is passed on to people as it is, and nothing in it is taken as progress or an error.
Nothing here imports Prefect: the tasks in tasks/ are thin wrappers over these functions, and a shell
tool could use them just as well.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from andrea_core.checkpoint import Checkpoint, CheckpointError, checkpoint_name
from andrea_core.command import trainer_command
from andrea_core.config import REPO_ROOT
from andrea_core.oom import OomWatch
from andrea_core.poll import poll_until
from andrea_core.run.lineage import phase_folder, phases
from andrea_core.run.lock import (
    ALIVE,
    UNKNOWN,
    TrainerIdentity,
    live_trainer,
    read_lock,
    require_not_elsewhere,
    still_holds,
)
from andrea_core.run.loss_log import parse_entries, parse_lines, read_history
from andrea_core.run.rundir import LOSS_LOG, NO_SUCH_CHECKPOINT, RunDir
from andrea_core.train.events import EVENTS_ENV, EVENTS_PREFIX, EventReader
from andrea_core.train.progress import TIMESTAMP_RE


class SupervisionError(RuntimeError):
    """The trainer did not do what the orchestration waited for; the message says what and where."""


class CheckpointPassed(SupervisionError):
    """The trainer published a newer checkpoint while the one waited for is not there: it was written
    and removed by retention before anything protected it, or never written (a boundary whose write
    failed: a full disk, a lease that could not be renewed). It will not appear: wait for a later one."""


class TrainerChanged(SupervisionError):
    """The trainer a wait was for no longer holds the run before it did what was waited for: it exited
    (killed, stopped) or another trainer took the run over (one restarted in its place, as systemd's
    Restart=on-failure would). Whatever waited decides again from whoever holds the run now."""


# --- a trainer process -----------------------------------------------------------------------------


def trainer_env() -> dict[str, str]:
    """The caller's environment, with this andrea_core first on the path and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class TrainerOutcome:
    """How a trainer process ended, read from its last words and checked against the run directory."""

    run_dir: str
    returncode: int
    reason: str  # completed, SIGTERM, SIGINT, already-complete, stopped-before-first-step, error, killed
    step: int | None  # the last step trained and checkpointed
    checkpoint: str | None  # that checkpoint's file name, validated on disk
    detail: str = ""  # an error line, or what is wrong with the checkpoint

    @property
    def ok(self) -> bool:
        if self.returncode != 0:
            return False
        return self.checkpoint is not None or self.reason in ("already-complete", "stopped-before-first-step")

    def describe(self) -> str:
        where = f"{self.run_dir}"
        if self.reason == "completed":
            text = f"trainer completed step {self.step}; checkpoint {self.checkpoint} is valid"
        elif self.reason in ("SIGTERM", "SIGINT"):
            text = (
                f"trainer stopped at step {self.step} on {self.reason}; checkpoint {self.checkpoint} is valid"
            )
        elif self.reason == "already-complete":
            text = f"nothing to train: the run is already at step {self.step}"
        elif self.reason == "stopped-before-first-step":
            text = "trainer was stopped before its first step: nothing new to checkpoint"
        elif self.reason == "killed":
            text = f"trainer was killed ({self.detail}); resume takes the newest valid checkpoint"
        else:
            text = f"trainer failed (exit {self.returncode}): {self.detail}"
        if self.detail and self.reason not in ("error", "killed"):
            text += f" ({self.detail})"
        return f"{where}: {text}"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "summary": self.describe()}


class TrainerProcess:
    """One trainer process, started in the caller's process group.

    Not in a session of its own on purpose: a Prefect cancellation signals the flow run's whole process
    group, and the trainer must get that SIGTERM itself to checkpoint the step in flight."""

    def __init__(
        self,
        run_dir: str,
        *,
        config: str | None = None,
        max_steps: int | None = None,
        device: str = "auto",
        pace: float = 0.0,
        nproc_per_node: int = 1,
        settings: dict | None = None,
        policy: str | None = None,
    ):
        self.run = RunDir(run_dir)
        self.argv = trainer_command(
            self.run.url,
            config=config,
            max_steps=max_steps,
            device=device,
            pace=pace,
            nproc_per_node=nproc_per_node,
            settings=settings,
            policy=policy,
        )
        self.proc: subprocess.Popen | None = None
        self.step: int | None = None
        self.total: int | None = max_steps
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.tail: deque[str] = deque(maxlen=30)  # the human log's last lines: shown, never parsed
        self.checkpoints: list[str] = []  # the checkpoints it published, as its events said
        self.on_event: Callable[[dict], None] | None = None  # called with each event record
        self._result: dict | None = None
        self._error: str | None = None
        self._events: EventReader | None = None
        self._oom: OomWatch | None = None
        self._oom_why: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> TrainerProcess:
        """Start the trainer, its events going to a file of this process's own (mkstemp: 0600, a new
        name in the temporary folder), named to it in ANDREA_EVENTS; the trainer removes the name once
        it has opened the file (events.py), so a killed supervisor leaves nothing behind."""
        fd, path = tempfile.mkstemp(prefix=EVENTS_PREFIX, suffix=".jsonl")
        os.close(fd)
        try:
            self._events = EventReader(path)
            env = {**trainer_env(), EVENTS_ENV: path}
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                env=env,
            )
        except BaseException:
            self._close_events()
            raise
        self._oom = OomWatch(self.proc.pid)
        return self

    def _oom_said(self) -> str | None:
        """Once it has exited: whether the kernel's OOM killer killed it or a process of its memory
        cgroup (a torchrun rank) while it ran (andrea_core.oom), read once."""
        if self._oom is not None:
            self._oom_why, self._oom = self._oom.why(), None
        return self._oom_why

    def _close_events(self) -> None:
        """Once the trainer has exited: what is left is read, the file removed."""
        if self._events is not None:
            self._apply_all(self._events.read())
            self._events.remove()  # a trainer that never opened it: the name is still there
            self._events.close()
            self._events = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def lines(self) -> Iterator[str]:
        """The trainer's output, line by line, as it comes; ends when the trainer exits. Its events
        are read as each line arrives (the trainer writes an event before the line that tells it)."""
        assert self.proc is not None and self.proc.stdout is not None, "start() first"
        for raw in self.proc.stdout:
            line = TIMESTAMP_RE.sub("", raw.rstrip("\n"), count=1)  # the reader stamps its lines itself
            self.tail.append(line)
            self.read_events()
            yield line
        self.proc.wait()
        self._close_events()

    def read_events(self) -> list[dict]:
        """The trainer's events since the last call, applied (step, total, loss, how it ended)."""
        records = self._events.read() if self._events is not None else []
        self._apply_all(records)
        return records

    def _apply_all(self, records: list[dict]) -> None:
        for record in records:
            self._apply(record)
            if self.on_event is not None:
                self.on_event(record)

    def _apply(self, record: dict) -> None:
        event = record["event"]
        if event == "progress":
            self.step = _whole(record.get("step"), self.step)
            self.total = _whole(record.get("max_steps"), self.total)
            self.loss = _number(record.get("loss"), self.loss)
            self.tokens_per_s = _number(record.get("tokens_per_s"), self.tokens_per_s)
        elif event == "started":
            first = _whole(record.get("first_step"), None)
            self.step = first - 1 if first is not None else self.step
            self.total = _whole(record.get("max_steps"), self.total)
        elif event == "checkpoint" and isinstance(record.get("name"), str):
            self.checkpoints.append(record["name"])
        elif event == "result":
            self._result = record
        elif event == "error":
            self._error = str(record.get("message"))

    def stop(self, timeout: float = 120.0, on_line: Callable[[str], None] | None = None) -> TrainerOutcome:
        """SIGTERM (our own child: its pid cannot have been reused before we reap it), then wait for
        the checkpoint of the step in flight and the exit. A second SIGTERM is harmless: the trainer
        only sets its stop flag again."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.finish(timeout, on_line)

    def finish(self, timeout: float = 120.0, on_line: Callable[[str], None] | None = None) -> TrainerOutcome:
        """Wait for the exit, reading whatever the trainer still prints, and report how it ended."""
        assert self.proc is not None and self.proc.stdout is not None, "start() first"
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise SupervisionError(
                f"{self.run.url}: trainer pid {self.proc.pid} did not exit within {timeout:.0f}s of being "
                "asked to stop; it still runs (signal it again, or kill it: resume takes the newest "
                "valid checkpoint)"
            ) from None
        for raw in self.proc.stdout:
            line = TIMESTAMP_RE.sub("", raw.rstrip("\n"), count=1)  # the reader stamps its lines itself
            self.tail.append(line)
            if on_line is not None:
                on_line(line)
        self._close_events()
        return self.outcome()

    def outcome(self) -> TrainerOutcome:
        """How it ended: its `result` event (the TrainResult), else its `error` event, else its exit
        status; a checkpoint it names is validated in the run directory."""
        assert self.proc is not None and self.proc.returncode is not None, "the trainer has not exited"
        self._close_events()
        rc, url, end = self.proc.returncode, self.run.url, self._result
        oom = self._oom_said()  # read, and the kernel log closed, whatever the exit
        oom = oom if rc != 0 else None
        reason = end.get("reason") if end is not None else None
        step = _whole(end.get("step"), None) if end is not None else None
        checkpoint = end.get("checkpoint") if end is not None else None
        if reason in ("SIGTERM", "SIGINT") and isinstance(checkpoint, str) and step is not None:
            result = TrainerOutcome(url, rc, reason, step, checkpoint)
        elif reason == "completed" and isinstance(checkpoint, str) and step is not None:
            result = TrainerOutcome(url, rc, "completed", step, checkpoint)
        elif reason == "already-complete":
            return TrainerOutcome(url, rc, "already-complete", step, None)
        elif reason in ("SIGTERM", "SIGINT"):  # stopped before its first step: no checkpoint
            return TrainerOutcome(url, rc, "stopped-before-first-step", self.step, None)
        elif rc < 0:
            signame = signal.Signals(-rc).name
            return TrainerOutcome(
                url, rc, "killed", self.step, None, f"signal {signame}, {oom}" if oom else f"signal {signame}"
            )
        else:
            if self._error is not None:
                detail = self._error
            elif reason is not None:
                detail = f"it reported {reason} at step {step}"
            else:
                last = " | ".join(list(self.tail)[-3:]) or "none"
                detail = f"it reported no result; its last output: {last}"
            # A torchrun rank killed: the agent exits 1, and its own error says no more than -9.
            return TrainerOutcome(url, rc, "error", self.step, None, f"{oom}; {detail}" if oom else detail)
        try:
            self.run.read_checkpoint(result.step)
        except CheckpointError as e:
            archived = archived_checkpoint(self.run, result.step) if e.problem == NO_SUCH_CHECKPOINT else None
            if archived is None:
                result.detail = f"but its checkpoint is not usable: {e}"
                result.checkpoint = None
            else:  # a pivot stopped it and has closed the phase since: its tail went to the archive
                result.checkpoint = archived
                result.detail = "archived since with the phase a pivot closed"
        return result


def _whole(value: object, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _number(value: object, default: float | None) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else default


def archived_checkpoint(run: RunDir, step: int) -> str | None:
    """Where checkpoint `step` is now if a pivot has moved it (run-relative, validated there): the
    phase folder of the newest boundary below it. A trainer stopped by a pivot writes a checkpoint past
    the boundary, which the pivot archives as soon as the trainer has exited, maybe before the
    trainer's flow run looked at it."""
    for number, boundary in reversed(phases(run)):
        if boundary < step:
            folder = phase_folder(number, boundary)
            try:
                run.read_checkpoint(step, folder=folder)
            except CheckpointError:
                return None
            return f"{folder}/{checkpoint_name(step)}"
    return None


# --- waiting on a trainer we did not start (found through .trainer.json) --------------------------


def require_live_trainer(run: RunDir) -> TrainerIdentity:
    """The run's trainer, alive as checked here; one that cannot be checked is refused by name."""
    verdict = require_not_elsewhere(run, "signalling its trainer")
    if verdict.state != ALIVE:
        raise SupervisionError(f"{run.url}: no live trainer ({verdict.why})")
    return verdict.holder


class TrainerGone(SupervisionError):
    """A trainer that cannot be checked from here stopped renewing its lease: dead, as far as anyone
    here can tell. Waiting for it any longer would only wait out the timeout."""


class LeaseWatch:
    """Whether a trainer elsewhere (lock: UNKNOWN from here) still renews its lease, watched on this
    machine's monotonic clock (no other machine's clock is trusted): a lock unchanged (generation,
    renewals) for twice its ttl is a dead trainer's, and `check` raises TrainerGone saying what to do.
    A trainer checked here by its pid is left to still_holds."""

    def __init__(self, run: RunDir, trainer: TrainerIdentity | None):
        self.run, self.trainer = run, trainer
        self.remote = trainer is not None and trainer.liveness()[0] == UNKNOWN
        self.seen: tuple | None = None
        self.since = self.looked = time.monotonic()

    def check(self) -> None:
        ttl = self.trainer.lease_ttl_s if self.remote else None
        if ttl is None or time.monotonic() - self.looked < min(1.0, ttl / 4):
            return
        self.looked = time.monotonic()
        now = read_lock(self.run)
        mark = (now.generation, now.renewals, now.released) if now is not None else None
        if mark != self.seen:
            self.seen, self.since = mark, time.monotonic()
            return
        quiet = time.monotonic() - self.since
        if quiet > 2 * ttl:
            t = self.trainer
            raise TrainerGone(
                f"{self.run.url}: trainer pid {t.pid} on host {t.host} has not renewed its lease for "
                f"{quiet:.0f}s, twice its ttl of {ttl:g}s: it looks dead, so nothing will answer; stopped "
                f"waiting. The way forward: start a trainer for the run here or anywhere (andrea train "
                f"--run-dir {self.run.url} takes over the expired lease), then run this again; if that "
                f"host is only cut off, let it come back first"
            )


def logged_step(run: RunDir) -> int | None:
    """Where the run's trainer is, give or take a step: the newest step of the canonical loss history,
    as long as the live trainer (if any) has logged there. A trainer that has just resumed and not yet
    logged its first step is at its resume point (its newest checkpoint), not at the end of a timeline
    that a crash abandoned: that dead tail is still the newest of the history until the new segment
    overwrites it."""
    history = read_history(run)
    trainer = live_trainer(run)
    if trainer is not None and history:
        newest_segment = max(e.segment for e in history)
        first = min(e.time for e in history if e.segment == newest_segment)
        if first < trainer.started_at:  # the live trainer's segment has no entry yet
            steps = run.checkpoint_steps()
            return steps[-1] if steps else 0
    return history[-1].step if history else None


def wait_for_checkpoint(
    run: RunDir,
    step: int,
    timeout: float,
    trainer: TrainerIdentity | None = None,
    poll: float = 0.1,
) -> Checkpoint:
    """Block until step_NNNNNN.bin is on disk and valid. Files appear only whole (atomic publish), so
    the first sight of the name is the finished file; it is validated all the same. Fails early if the
    trainer that was to write it exits first, and (CheckpointPassed) once a newer checkpoint is
    published without it: the trainer writes its checkpoints in step order, one at a time."""
    name = checkpoint_name(step)
    lease = LeaseWatch(run, trainer)

    def written() -> Checkpoint | None:
        if run.exists(name):
            return run.read_checkpoint(step)
        newer = [s for s in run.checkpoint_steps() if s > step]
        if newer and not run.exists(name):  # looked at again: it may have been published meanwhile
            raise CheckpointPassed(
                f"{run.url}: the trainer published {checkpoint_name(newer[0])} and {name} is not there "
                "(written and removed by retention before it was protected, or its write failed)"
            )
        if trainer is not None and not still_holds(run, trainer):
            if run.exists(name):
                return run.read_checkpoint(step)
            raise TrainerChanged(
                f"{run.url}: trainer pid {trainer.pid} no longer holds the run: it exited (or another took "
                f"the run over) before writing {name} (newest checkpoint: {_newest_name(run)})"
            )
        lease.check()
        return None

    if (checkpoint := poll_until(written, timeout, poll)) is None:
        raise SupervisionError(
            f"{run.url}: {name} did not appear within {timeout:.0f}s "
            f"(trainer at step {logged_step(run)}, newest checkpoint: {_newest_name(run)})"
        )
    return checkpoint


def wait_for_new_checkpoint(
    run: RunDir,
    not_before: int,
    existing: set[int],
    timeout: float,
    trainer: TrainerIdentity | None = None,
    poll: float = 0.05,
) -> Checkpoint:
    """The first checkpoint at a step >= `not_before` that was not in `existing`: the one a SIGUSR1
    asked for (written at the end of the step in flight)."""
    lease = LeaseWatch(run, trainer)

    def written() -> Checkpoint | None:
        new = [s for s in run.checkpoint_steps() if s >= not_before and s not in existing]
        if new:
            return run.read_checkpoint(min(new))
        if trainer is not None and not still_holds(run, trainer):
            raise TrainerChanged(
                f"{run.url}: trainer pid {trainer.pid} no longer holds the run: it exited (or another took "
                "the run over) before checkpointing"
            )
        lease.check()
        return None

    if (checkpoint := poll_until(written, timeout, poll)) is None:
        raise SupervisionError(f"{run.url}: no new checkpoint within {timeout:.0f}s of the request")
    return checkpoint


def wait_for_exit(
    trainer: TrainerIdentity, timeout: float, poll: float = 0.05, run: RunDir | None = None
) -> float:
    """Block until the trainer process is gone (one that cannot be checked from here: until its lease
    is released or taken over, lock.still_holds; TrainerGone once it is unrenewed for twice its ttl);
    returns the seconds waited."""
    run = run or RunDir(trainer.run_dir)
    t0 = time.monotonic()
    lease = LeaseWatch(run, trainer)

    def gone() -> bool:
        if not still_holds(run, trainer):
            return True
        lease.check()
        return False

    if not poll_until(gone, timeout, poll):
        raise SupervisionError(
            f"{trainer.run_dir}: trainer pid {trainer.pid} still runs {timeout:.0f}s after SIGTERM"
        )
    return time.monotonic() - t0


def wait_for_logged_step(run: RunDir, step: int, timeout: float, poll: float = 0.2) -> int:
    at = [0]

    def reached() -> bool:
        at[0] = logged_step(run) or 0
        return at[0] >= step

    if not poll_until(reached, timeout, poll):
        raise SupervisionError(f"{run.url}: step {step} not reached within {timeout:.0f}s (at {at[0]})")
    return at[0]


def _newest_name(run: RunDir) -> str:
    steps = run.checkpoint_steps()
    return checkpoint_name(steps[-1]) if steps else "none"


# --- the loss log: append-only, checked byte for byte ---------------------------------------------


@dataclass(frozen=True)
class LossLogSnapshot:
    """The exact bytes of .loss.json at one moment, as (size, sha256): enough to prove later that the
    file still starts with them, without holding a long run's history in memory."""

    size: int
    sha256: str
    segments: list[int] = field(default_factory=list)

    @classmethod
    def take(cls, run: RunDir) -> LossLogSnapshot:
        data = run.read_bounded(LOSS_LOG, "ANDREA_MAX_LOSS_LOG_BYTES") if run.exists(LOSS_LOG) else b""
        segments = sorted({e.segment for e in parse_entries(data)[0]})
        return cls(len(data), hashlib.sha256(data).hexdigest(), segments)

    def check_prefix_of(self, run: RunDir, what: str = ".loss.json") -> bytes:
        """Raise unless the file now starts with exactly the snapshot's bytes; returns what was appended."""
        data = run.read_bytes(LOSS_LOG) if run.exists(LOSS_LOG) else b""
        if len(data) < self.size:
            raise SupervisionError(
                f"{run.path(LOSS_LOG)}: {what} shrank from {self.size} to {len(data)} bytes"
            )
        if hashlib.sha256(data[: self.size]).hexdigest() != self.sha256:
            raise SupervisionError(
                f"{run.path(LOSS_LOG)}: {what}: its first {self.size} bytes were rewritten (append-only log)"
            )
        return data[self.size :]

    def check_unchanged(self, run: RunDir) -> None:
        appended = self.check_prefix_of(run)
        if appended:
            raise SupervisionError(f"{run.path(LOSS_LOG)}: {len(appended)} bytes were appended unexpectedly")


def first_entry_after(run: RunDir, snapshot: LossLogSnapshot) -> dict | None:
    """The first complete loss entry appended since `snapshot`, after checking the prefix is intact."""
    entries, _ = parse_lines(snapshot.check_prefix_of(run))  # a torn (still being written) line is skipped
    return entries[0] if entries else None


def wait_for_first_entry_after(
    run: RunDir,
    snapshot: LossLogSnapshot,
    timeout: float,
    poll: float = 0.2,
    ended: Callable[[], str | None] | None = None,
) -> dict:
    """The first loss entry logged after `snapshot`. `ended` says whether the trainer expected to log it
    has already ended (and how): then there is nothing to wait for, and the error says why at once
    instead of after `timeout`."""

    def logged() -> dict | None:
        if (entry := first_entry_after(run, snapshot)) is not None:
            return entry
        why = ended() if ended is not None else None
        if why is not None:
            entry = first_entry_after(run, snapshot)  # it may have logged just before it ended
            if entry is not None:
                return entry
            raise SupervisionError(f"{run.url}: the trainer ended before logging a step: {why}")
        return None

    if (entry := poll_until(logged, timeout, poll)) is None:
        raise SupervisionError(f"{run.url}: no new loss entry within {timeout:.0f}s")
    return entry


# --- which GPU a trainer occupies -----------------------------------------------------------------


def gpu_slot_names(slot: str | None, device: str, nproc_per_node: int = 1) -> list[str]:
    """The slots of every GPU a trainer uses: under "auto" with N ranks on CUDA, gpu-0 .. gpu-(N-1)
    (rank r runs on cuda:r); otherwise the one slot of gpu_slot_name (or none)."""
    name = gpu_slot_name(slot, device)
    if nproc_per_node > 1 and slot == "auto" and name is not None:
        return [f"gpu-{rank}" for rank in range(nproc_per_node)]
    return [name] if name is not None else []


def gpu_slot_name(slot: str | None, device: str) -> str | None:
    """The concurrency slot a trainer on `device` must hold: "gpu-N" for CUDA device N under "auto",
    none on the CPU, or an explicit name (which also lets CPU tests exercise the limit)."""
    if slot != "auto":
        return slot or None
    from andrea_core.model.device import pick_device  # imports torch: only when asked to resolve a device

    resolved = pick_device(device)
    if not resolved.startswith("cuda"):
        return None
    if ":" in resolved:
        return f"gpu-{int(resolved.split(':', 1)[1])}"
    import torch

    return f"gpu-{torch.cuda.current_device()}"
