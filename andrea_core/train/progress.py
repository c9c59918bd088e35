"""Progress: one live status line on a terminal, plain log lines elsewhere (Prefect, CI, files).

Every line printed as a line starts with its UTC time (`2026-12-01 10:42:07Z andrea: ...`): a weeks-long
run's trainer.log or nohup file says when each thing happened. A reader that stamps lines itself (the
Prefect task, supervise.TrainerProcess) strips it (TIMESTAMP_RE). The log is for people: a supervisor
reads the trainer's structured events (train/events.py), each progress line's also sent as one.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import TextIO

from andrea_core.train import events

TIMESTAMP_RE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ ")


def stamp(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ ", time.gmtime(t))


class Progress:
    def __init__(self, total_steps: int, log_every: int, stream: TextIO | None = None, events: bool = True):
        self.stream = stream or sys.stdout
        self.events = events  # rank 0 only: one "progress" event per log line (train/events.py)
        self.tty = self.stream.isatty()
        self.total = total_steps
        self.log_every = log_every
        self._t = time.perf_counter()
        self._tokens = 0
        self._drawn = 0.0
        self.tokens_per_s = 0.0
        self._reader_gone = False

    def _write(self, text: str) -> None:
        if self._reader_gone:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError:
            # Whoever read our output is gone (a killed launcher: the trainer's SIGTERM comes with this).
            # The run directory is the record; the trainer must still checkpoint and exit cleanly.
            self._reader_gone = True
            _discard_output_of(self.stream)

    def message(self, text: str) -> None:
        """A line that must be seen (start, checkpoints, signals, warnings)."""
        self._write(("\r\033[K" if self.tty else "") + f"{stamp()}andrea: {text}\n")

    def step(self, step: int, loss: float, tokens: int, next_checkpoint: int) -> None:
        self._tokens += tokens
        now = time.perf_counter()
        on_log_step = step % self.log_every == 0
        # A terminal is redrawn at most 10 times a second; logs get one line every log_every steps.
        if not on_log_step and (not self.tty or now - self._drawn < 0.1):
            return
        self._drawn = now
        if now - self._t >= 0.5 or on_log_step:
            self.tokens_per_s = self._tokens / max(now - self._t, 1e-9)
            self._t, self._tokens = now, 0
        if on_log_step and self.events:  # before the line: a reader of both sees the event first
            finite = loss if math.isfinite(loss) else None
            speed = self.tokens_per_s
            events.emit("progress", step=step, max_steps=self.total, loss=finite, tokens_per_s=speed)
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  {self.tokens_per_s:,.0f} tok/s  "
            f"next checkpoint {next_checkpoint}"
        )
        self._write(f"\r\033[K{line}" if self.tty else f"{stamp()}andrea: {line}\n")


def _discard_output_of(stream: TextIO) -> None:
    """Point the stream's file descriptor, and stdout/stderr where they share its pipe, at /dev/null:
    what is still buffered, or printed later (an exit message), then goes nowhere instead of raising."""
    try:
        fd = stream.fileno()
        shared = [f for f in (1, 2) if f != fd and os.path.sameopenfile(f, fd)]
    except (OSError, ValueError, AttributeError):
        return  # not a file (a test's StringIO): nothing to redirect
    devnull = os.open(os.devnull, os.O_WRONLY)
    for target in (fd, *shared):
        os.dup2(devnull, target)
    os.close(devnull)
