"""Fill a real disk: one file takes all of a filesystem's free space but `leave` bytes (the full-disk
tests and bench/soak.py's disk-full fault both use it).

The free space is read once, but a live trainer keeps writing meanwhile (its loss log, a checkpoint's
temporary file), so the space can run out before the filler has written what it measured: that is a
full disk too, the goal when `leave` is 0, and the filler stops there instead of failing.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path


def fill(disk: Path, leave: int = 0, prefix: str = "filler-") -> Path:
    """Take all the free space of `disk` but `leave` bytes (0: every byte, until ENOSPC), with one file."""
    st = os.statvfs(disk)
    filler = Path(disk) / f"{prefix}{uuid.uuid4().hex}"
    want = st.f_bavail * st.f_frsize - leave if leave else None
    chunk = memoryview(b"\0" * (1 << 20))
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while want is None or want > 0:
            try:
                want_now = len(chunk) if want is None else min(len(chunk), want)
                written = os.write(fd, chunk[:want_now])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break  # the space ran out before the filler measured it would: the disk is full
            if want is not None:
                want -= written
        os.fsync(fd)
    finally:
        os.close(fd)
    return filler
