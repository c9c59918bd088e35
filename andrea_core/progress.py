"""Progress: one live status line on a terminal, plain log lines elsewhere (Prefect, CI, files)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total_steps: int, log_every: int, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.total = total_steps
        self.log_every = log_every
        self._t = time.perf_counter()
        self._tokens = 0
        self._drawn = 0.0
        self.tokens_per_s = 0.0

    def message(self, text: str) -> None:
        """A line that must be seen (start, checkpoints, signals, warnings)."""
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"andrea: {text}\n")
        self.stream.flush()

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
        line = (
            f"step {step}/{self.total}  loss {loss:.4f}  {self.tokens_per_s:,.0f} tok/s  "
            f"next checkpoint {next_checkpoint}"
        )
        if self.tty:
            self.stream.write(f"\r\033[K{line}")
        else:
            self.stream.write(f"andrea: {line}\n")
        self.stream.flush()
