"""The trainer's run-directory requests (lock.send_request, read at each lease renewal by
Trainer._take_request): each taken once, none lost to a removal racing a new one (issue 43.7)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

from andrea_core import signals
from andrea_core.run import lock
from andrea_core.run.rundir import RunDir
from andrea_core.train.trainer import Trainer


def test_a_stop_written_while_a_checkpoint_request_is_taken_is_not_lost(tmp_path):
    """A pivot asks a remote trainer for a checkpoint, then for a stop. The stop lands between the
    trainer's read of the checkpoint request and its removal of the file (here: while it logs the
    checkpoint request). The old code then removed the stop unread: the trainer trained on and the
    pivot failed at `checkpointed` after 300 s. Now the stop is taken at the next renewal."""
    run = RunDir(tmp_path / "run")
    run.makedirs()
    holder = lock.TrainerIdentity(1, socket.gethostname(), "boot", 1, time.time(), run.url, generation=7)
    lock.send_request(run, holder, "checkpoint")
    written = []

    def log(message: str) -> None:  # the window between the read and the removal
        if not written:
            written.append(lock.send_request(run, holder, "stop"))

    trainer = SimpleNamespace(run=run, lease=SimpleNamespace(generation=7), log=log, _taken_requests=set())
    flags = signals.TrainerSignals()
    Trainer._take_request(trainer, flags)
    assert flags.checkpoint and flags.stop is None
    Trainer._take_request(trainer, flags)  # the next lease renewal
    assert flags.stop == "SIGTERM", "the stop written during the first take was lost"
    # Each request is acted on once: a third renewal finds nothing new.
    flags.stop, flags.checkpoint = None, False
    Trainer._take_request(trainer, flags)
    assert flags.stop is None and not flags.checkpoint
