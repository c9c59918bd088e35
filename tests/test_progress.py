"""Progress output must never stop a trainer: its reader may die first (a SIGKILLed launcher)."""

from __future__ import annotations

import os
import re

from andrea_core.train.progress import Progress


def test_a_vanished_reader_silences_progress_instead_of_raising():
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    progress = Progress(total_steps=10, log_every=1, stream=stream)
    progress.message("before the reader goes")
    line = os.read(read_end, 100)
    # `2026-12-01 10:42:07Z andrea: ...`: the UTC time, then the message (progress.stamp)
    assert re.fullmatch(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ andrea: before the reader goes\n", line), line
    os.close(read_end)  # the launcher is gone: a write now raises BrokenPipeError (SIGPIPE is ignored)

    progress.message("SIGTERM: checkpointing step 103, then exiting")
    progress.step(104, 2.5, 4096, 200)
    # The descriptor now points at /dev/null: an exit message printed later raises nothing either.
    assert os.path.samestat(os.fstat(write_end), os.stat(os.devnull))
    stream.write("an exit message\n")
    stream.flush()
    stream.close()
