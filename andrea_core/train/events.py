"""The trainer's structured channel to whoever supervises it (docs/design.md "Trainer events").

The human log (stdout, train/progress.py) is for people and may be reworded at will; a supervisor
(ops/supervise.py) reads these records instead. A supervisor that wants them creates an empty file of
its own (never a run file) and names it in the trainer's environment as ANDREA_EVENTS; the trainer (rank
0 only) appends one JSON object per line to it:

    {"v": 1, "event": NAME, "time": UNIX_TIME, "pid": PID, ...fields}

    started     first_step, max_steps      training steps first_step..max_steps
    progress    step, max_steps, loss, tokens_per_s
    checkpoint  step, name                 a checkpoint published
    result      step, reason, checkpoint   the trainer's TrainResult, once, at the end (reason:
                                           completed, SIGTERM, SIGINT, already-complete,
                                           checkpoint-failed; checkpoint null: none written)
    error       message                    the error it exits with (status 1 or 2)

A string from a run file can only ever be a field's value, never a record: each record is one
json.dumps line. The file is opened without O_CREAT and without following a symlink (it must be the
supervisor's), in append mode. Without ANDREA_EVENTS nothing is written. A failed write is dropped: the
channel never stops training. Stdlib only.

A supervisor's temporary file (named EVENTS_PREFIX..., a regular file of ours with one link) loses its
name as soon as the trainer has opened it: both ends then hold it open, and it is gone from the disk
when the last of them closes it, however either one dies (a killed supervisor left its file behind).
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

EVENTS_ENV = "ANDREA_EVENTS"
EVENTS_FORMAT = 1
EVENT_NAMES = ("started", "progress", "checkpoint", "result", "error")
EVENTS_PREFIX = "andrea-events-"  # a supervisor's temporary file: its name is removed once opened


class EventChannel:
    """The writer's end (the trainer). `emit` never raises."""

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get(EVENTS_ENV)
        self._fd: int | None = None
        if self.path:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                self._fd = None  # no supervisor listening: the human log is all there is
            else:
                self._remove_temporary_name()

    def _remove_temporary_name(self) -> None:
        """Unlink the path if it still names the supervisor's temporary file that we hold open."""
        if not os.path.basename(self.path).startswith(EVENTS_PREFIX):
            return  # a file someone named on purpose (a test's, an operator's): it keeps its name
        try:
            held, named = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
            ours = stat.S_ISREG(held.st_mode) and held.st_uid == os.geteuid() and held.st_nlink == 1
            if ours and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                os.unlink(self.path)
        except OSError:
            pass  # the supervisor removes it when the trainer exits

    def emit(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        assert event in EVENT_NAMES, event
        record = {"v": EVENTS_FORMAT, "event": event, "time": time.time(), "pid": os.getpid(), **fields}
        try:
            os.write(self._fd, (json.dumps(record, allow_nan=False, default=str) + "\n").encode())
        except (OSError, ValueError):
            pass  # a full disk, a NaN loss: the supervisor falls back on the exit status

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_channel: EventChannel | None = None


def channel() -> EventChannel:
    """This process's channel (opened once, from ANDREA_EVENTS)."""
    global _channel
    if _channel is None:
        _channel = EventChannel()
    return _channel


def emit(event: str, **fields: Any) -> None:
    channel().emit(event, **fields)


class EventReader:
    """The reader's end (the supervisor): the complete records appended since the last read. A line that
    is not a record of this format (torn, foreign, unknown event) is skipped; fields are typed by the
    caller (supervise.TrainerProcess)."""

    MAX_LINE = 1 << 16

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._pending = b""

    def remove(self) -> None:
        """Unlink the path if it still names the file this reader holds (the trainer may have removed
        it already, and a new file may have that name since)."""
        try:
            held, named = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def read(self) -> list[dict[str, Any]]:
        records = []
        while chunk := os.read(self._fd, 1 << 16):
            self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > self.MAX_LINE:
            self._pending = b""  # no record is this long: not ours
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(record, dict)
                and record.get("v") == EVENTS_FORMAT
                and record.get("event") in EVENT_NAMES
            ):
                records.append(record)
        return records

    def close(self) -> None:
        os.close(self._fd)
