"""Atomic writes of this machine's own files (caches, an export), one home: a file appears under its
final name whole, fsynced, or not at all.

A temporary file is `.NAME.PID.RANDOM.tmp` beside its final name, created with O_EXCL | O_NOFOLLOW (an
unguessable name, nothing planted there written through); `publish` fsyncs it, renames it over the final
name and fsyncs the folder, so that a power cut after it returns keeps the file. A run directory's
files never come here: they go through RunDir (run/rundir.py), whose stores do the same for runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"  # every temporary name ends so: a sweep of a dead writer's files looks for it


def temp_path(path: str | os.PathLike) -> Path:
    """An unguessable temporary name beside `path`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}{TEMP_SUFFIX}")


def open_temp(path: str | os.PathLike, mode: int = 0o666) -> tuple[Path, BinaryIO]:
    """(temporary path, file open for writing) of a new file that `publish` will make `path`."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return tmp, open(fd, "wb")


def open_nofollow(
    path: str | os.PathLike,
    flags: int,
    mode: int = 0o666,
    dir_fd: int | None = None,
    refuse: Callable[[], BaseException] | None = None,
) -> int:
    """os.open with O_NOFOLLOW | O_CLOEXEC: a symlink at `path` is never followed; `refuse()` is raised
    for one (an error naming what should be there) instead of ELOOP's OSError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and refuse is not None:
            raise refuse() from None
        raise


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable (without it a power cut can lose the new entry)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(folder: str | os.PathLike) -> None:
    """os.makedirs(exist_ok=True), each folder it makes fsynced into its parent: a power cut loses a
    folder whose entry was never synced, and every file in it (the power-cut soak's first finding)."""
    folder = os.path.abspath(folder)
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(folder)
    makedirs_durable(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder)
        fsync_dir(parent)


def publish(tmp: str | os.PathLike, path: str | os.PathLike, f: BinaryIO | None = None) -> None:
    """Make temporary file `tmp` (written through `f`, or by someone else: a download) `path`: fsync,
    close, rename over `path`, fsync the folder. The temporary is removed if any of it fails."""
    try:
        if f is None:
            f = open(tmp, "rb")
        with f:
            if f.writable():
                f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o666) -> Iterator[BinaryIO]:
    """A binary file to write, published as `path` at a clean exit of the block, removed otherwise."""
    tmp, f = open_temp(path, mode)
    try:
        yield f
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    publish(tmp, path, f)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (text is UTF-8) as `path`, whole or not at all."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
