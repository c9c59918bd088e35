"""Trainer signals (contract): handlers only set flags; the trainer acts on them at step boundaries.

Installed as early as possible (before torch is imported) so that a SIGTERM during start-up, such as
a Prefect cancellation of a flow run that just launched the trainer, still ends in a clean exit 0.
"""

from __future__ import annotations

import signal


class TrainerSignals:
    def __init__(self) -> None:
        self.stop: str | None = None  # "SIGTERM" / "SIGINT": checkpoint the step in flight, exit 0
        self.checkpoint = False  # SIGUSR1: checkpoint the step in flight, train on

    def _on_stop(self, signum, frame) -> None:
        self.stop = signal.Signals(signum).name

    def _on_checkpoint(self, signum, frame) -> None:
        self.checkpoint = True


_installed: TrainerSignals | None = None


def install() -> TrainerSignals:
    """Install the handlers once per process and return the flags they set."""
    global _installed
    if _installed is None:
        _installed = TrainerSignals()
        signal.signal(signal.SIGTERM, _installed._on_stop)
        signal.signal(signal.SIGINT, _installed._on_stop)
        signal.signal(signal.SIGUSR1, _installed._on_checkpoint)
    return _installed


def uninstall() -> None:
    """Restore the default handlers (for in-process use such as tests and benchmarks)."""
    global _installed
    if _installed is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        _installed = None
