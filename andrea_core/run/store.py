"""The store a run directory lives on: one protocol, one implementation per backend, chosen once.

`Store` is what `RunDir`, the lease (run/lock.py) and the loss log need of a place to keep files:
bounded reads, tail reads, conditional puts (fenced, or over a known version), appends, listing,
removal and renames within the run. `rundir.open_store` picks the implementation from the URL once,
when a run is opened; nothing above this module asks which backend it is on.

  LocalStore   local disk: the one path layer (from the root down, O_NOFOLLOW, one link per appended
               file), temporary name + fsync + rename, flock(2) for compare-and-replace;
  S3Store      S3 (and what speaks it): conditional puts (If-Match / If-None-Match), multipart uploads
               that are completed or aborted, appends kept in a local mirror and published whole;
  MemoryStore  fsspec's memory filesystem, which lives in this one process: one lock of this process
               makes every compare-and-put exact (the tests' store, and a real one for a run that
               lives and dies with its process).

Other fsspec protocols (gcs, az, ...) are refused for run directories (rundir.open_store): without a
conditional put tested on a real server of that kind, a lease there could not fence anything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import posixpath
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import fsspec.asyn

from andrea_core import faults
from andrea_core.atomic import fsync_dir, makedirs_durable, open_nofollow
from andrea_core.bounded import read_bounded
from andrea_core.config import ConfigError, check_limit, limit
from andrea_core.poll import awake_clock, poll_until
from andrea_core.run import objstore
from andrea_core.run.objstore import ABSENT, ConcurrentWriteError, Fence, Version
from andrea_core.signals import process_start_ticks

Buffer = bytes | bytearray | memoryview
Log = Callable[[str], None]
# `.NAME.tmp.PID.RANDOM`: a write in progress, or a dead writer's (`.NAME.tmp.PID`: one from before the
# random suffix). The random part makes the name unguessable: nobody can plant a link where we will write.
TEMP_RE = re.compile(r"\..+\.tmp\.(\d+)(?:\.[0-9a-f]{16})?")  # fullmatch


class UnsafeRunPath(ConfigError):
    """A run file's name that is not run-relative, or a symlink, a hard link or another non-file where
    a run file or folder should be: refused, never followed or written through."""


def check_name(name: object, where: str = "run file") -> str:
    """`name` if it is a run-relative name (folders joined by "/"), else UnsafeRunPath: a name from a
    run file (a journal's archive folder, a forks line) must never reach outside the run."""
    if not isinstance(name, str) or not name:
        raise UnsafeRunPath(f"{where}: {name!r} is not a run-relative name")
    if "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        raise UnsafeRunPath(
            f"{where}: {name!r} is not a run-relative name "
            "(no absolute path, no '.', '..' or empty part, no NUL)"
        )
    return name


def byte_views(parts: Buffer | Iterable[Buffer]) -> Iterable[memoryview]:
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = [parts]
    # A float32 array's memoryview counts floats, not bytes: cast so every size below is in bytes.
    return (memoryview(p).cast("B") for p in parts)


def sha256_version(data: bytes) -> Version:
    # The version of a file on a store without ETags: its content (the same bytes are the same version).
    return Version(len(data), hashlib.sha256(data).hexdigest())


FenceOf = Callable[[], Fence | None]  # the holder's check for one file, looked up at each publish


class AppendHandle(Protocol):
    in_place: bool  # False: a write reaches the run only when durable (a mirror published whole)

    def read(self) -> bytes: ...
    def write(self, data: bytes, durable: bool = False) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> AppendHandle: ...
    def __exit__(self, *exc: object) -> None: ...


class Store(Protocol):
    """Files of one run, by run-relative name (check_name). Every method that publishes takes the
    holder's `fence` (None: unfenced), called once the write can be undone by a takeover
    (abort_writes_in_flight) and before it is visible."""

    fs: Any  # the fsspec filesystem (tests reach the S3 client through it)
    root: str
    url: str  # the canonical address: what lineage, forks.jsonl and Prefect parameters record

    def path(self, name: str) -> str: ...
    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def read(self, name: str, most: int | None, bound: str) -> bytes: ...
    def read_versioned(self, name: str, most: int, bound: str) -> tuple[bytes, Version]: ...
    def read_checkpoint(self, name: str, head: int, check: Callable[[bytes, int], None]) -> bytes: ...
    def read_tail(self, name: str, most: int) -> tuple[bytes, int]: ...
    def listdir(self, sub: str) -> list[str]: ...
    def makedirs(self, sub: str) -> None: ...
    def put(
        self, name: str, views: Iterable[memoryview], expect: Version | None, fence: Fence | None, mode: int
    ) -> Version: ...
    def extend(self, name: str, data: bytes, expect: Version, fence: Fence | None) -> Version: ...
    def create_exclusive(self, name: str, data: bytes, mode: int) -> Version: ...
    def replace_if_unchanged(self, name: str, data: bytes, expect: Version, mode: int) -> Version: ...
    def open_append(
        self, name: str, lines: bool, fence_of: FenceOf, mirror: Path, bound: str
    ) -> AppendHandle: ...
    def log_path(self, name: str, mirror: Path) -> str: ...
    def open_log(self, name: str, mirror: Path) -> Any: ...
    def move(self, src: str, dst: str) -> None: ...
    def remove(self, name: str) -> None: ...
    def root_exists(self) -> bool: ...
    def remove_root_if_empty(self) -> None: ...
    def remove_folder(self, sub: str) -> None: ...
    def discard_incomplete_writes(self, log: Log, remove: Callable[[str], None]) -> list[str]: ...
    def abort_writes_in_flight(self, pid: int, log: Log, remove: Callable[[str], None]) -> list[str]: ...
    def is_dead_temporary(self, name: str) -> bool: ...


class _Named:
    """The run-relative naming every store shares."""

    fs: Any
    root: str
    url: str

    def path(self, name: str) -> str:
        """The full path of run file `name`, which must be run-relative (check_name)."""
        return posixpath.join(self.root, check_name(name, f"{self.url}: run file name"))

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int:
        return self.fs.size(self.path(name))

    def root_exists(self) -> bool:
        return self.fs.exists(self.root)

    def read_versioned(self, name: str, most: int, bound: str) -> tuple[bytes, Version]:
        """The file (each store's `read`) and its version, a hash of the bytes read (S3: its ETag)."""
        try:
            return (data := self.read(name, most, bound)), sha256_version(data)
        except FileNotFoundError:
            return b"", ABSENT

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# --- local disk --------------------------------------------------------------------------------------


class LocalStore(_Named):
    """Local disk, through the one path layer: every write, move, delete, append and read walks from
    the root one folder at a time with O_NOFOLLOW, so a symlink planted below the root is refused,
    naming it, never followed; a file appended to in place must have one link (a hard link to a file
    outside the run is refused like a symlink); temporary names carry a random suffix and are created
    with O_EXCL."""

    def __init__(self, fs: Any, root: str):
        self.fs, self.root, self.url = fs, root, root

    def exists(self, name: str) -> bool:
        return _local_exists(self.path(name))

    def root_exists(self) -> bool:
        return _local_exists(self.root)

    # --- the path layer: from the root down, never through a symlink ---------------------------

    def _parent_fd(self, name: str, create: bool = False) -> tuple[int, str]:
        """(an fd of the folder holding `name`, its last part), reached from the root one folder at a
        time with O_NOFOLLOW: a symlink (or a file) where a folder of the run should be is refused.
        The root itself is the operator's (it may be a link to another disk). `create` makes the
        missing folders. The caller closes the fd."""
        parts = check_name(name, f"{self.url}: run file name").split("/")
        if create:
            makedirs_durable(self.root)
        fd = self._root_fd()
        try:
            for i, part in enumerate(parts[:-1]):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                        os.fsync(fd)  # its entry durable: a power cut would lose the folder with its files
                try:
                    sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafeRunPath(
                            f"{self.path('/'.join(parts[: i + 1]))}: a symlink or a file where a folder of "
                            "the run should be: not followed (remove it)"
                        ) from None
                    raise
                os.close(fd)
                fd = sub
            return fd, parts[-1]
        except BaseException:
            os.close(fd)
            raise

    def _root_fd(self) -> int:
        """An fd of the run's folder. A file where it should be holds no run file: FileNotFoundError,
        as on an object store (where a key is never a folder), so that every reader takes "no run
        there" from one exception."""
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "a file, not the run's folder", self.root) from None

    def _open(self, name: str, flags: int, mode: int = 0o666) -> int:
        """An fd of run file `name` opened with `flags` (+ O_NOFOLLOW): a symlink is refused. One opened
        for writing in place (an append) must be a regular file with one link: a hard link to a file
        outside the run would have the run's lines written into that file."""
        dfd, base = self._parent_fd(name, create=bool(flags & os.O_CREAT))
        try:
            fd = open_nofollow(
                base,
                flags,
                mode,
                dfd,
                lambda: UnsafeRunPath(
                    f"{self.path(name)}: a symlink where a run file should be: not followed (remove it)"
                ),
            )
        finally:
            os.close(dfd)
        if flags & (os.O_WRONLY | os.O_RDWR):
            st = os.fstat(fd)
            if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise UnsafeRunPath(
                    f"{self.path(name)}: a hard link ({st.st_nlink} links) where a run file should be: "
                    "not written through (remove it)"
                )
        return fd

    def _regular(self, fd: int, name: str) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeRunPath(f"{self.path(name)}: not a regular file; not read")
        return st

    def _refuse_link(self, dfd: int, base: str, name: str) -> None:
        try:
            st = os.lstat(base, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeRunPath(
                f"{self.path(name)}: a symlink where a run file should be: not written through (remove it)"
            )

    # --- reads ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _naming(self, name: str) -> Iterator[None]:
        """An OSError of a read that names no file (EIO from read(2)) named with the run file's path:
        the operator is told which file the disk failed on."""
        try:
            yield
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            raise type(e)(e.errno, e.strerror, self.path(name)) from e

    def read(self, name: str, most: int | None, bound: str) -> bytes:
        # O_NONBLOCK: a FIFO planted under a run file's name must not hang the reader at open().
        fd = self._open(name, os.O_RDONLY | os.O_NONBLOCK)
        with self._naming(name), open(fd, "rb", buffering=0, closefd=True) as f:
            st = self._regular(fd, name)
            os.set_blocking(fd, True)
            if most is None:
                return f.read()
            check_limit(st.st_size, bound, f"{self.path(name)}: {st.st_size} bytes")
            return read_bounded(f, most, f"{self.path(name)} (set {bound} to allow more)")

    def read_checkpoint(self, name: str, head: int, check: Callable[[bytes, int], None]) -> bytes:
        fd = self._open(name, os.O_RDONLY | os.O_NONBLOCK)
        with self._naming(name), open(fd, "rb", buffering=0) as f:
            st = self._regular(fd, name)
            os.set_blocking(fd, True)
            check(os.pread(fd, head, 0), st.st_size)
            return read_bounded(f, max(st.st_size, head), self.path(name))

    def read_tail(self, name: str, most: int) -> tuple[bytes, int]:
        fd = self._open(name, os.O_RDONLY | os.O_NONBLOCK)
        with self._naming(name), open(fd, "rb", buffering=0):  # closes fd
            st = self._regular(fd, name)
            # The bytes it had when looked at (a log grows while it is read): at most `most`.
            start, data = max(0, st.st_size - most), bytearray()
            while len(data) < st.st_size - start:
                piece = os.pread(fd, st.st_size - start - len(data), start + len(data))
                if not piece:
                    break  # cut short meanwhile
                data += piece
            return bytes(data), start

    def listdir(self, sub: str) -> list[str]:
        try:
            fd = self._open(sub, os.O_RDONLY | os.O_DIRECTORY) if sub else self._root_fd()
        except FileNotFoundError:
            return []
        except (NotADirectoryError, UnsafeRunPath):  # O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR
            raise UnsafeRunPath(
                f"{self.path(sub) if sub else self.root}: a symlink or a file where a folder of the run "
                "should be: not followed (remove it)"
            ) from None
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    # --- writes --------------------------------------------------------------------------------

    def makedirs(self, sub: str) -> None:
        if sub:
            os.close(self._parent_fd(f"{sub}/_", create=True)[0])
        else:
            makedirs_durable(self.root)

    def put(
        self, name: str, views: Iterable[memoryview], expect: Version | None, fence: Fence | None, mode: int
    ) -> Version:
        """Write under an unguessable temporary name (O_EXCL, O_NOFOLLOW), fsync, rename over `name`
        (refused if `name` is a symlink), fsync the folder. `fence` is checked once the temporary file
        exists: a trainer taking the run over removes it (abort_writes_in_flight), and the rename fails.
        `expect` is not checked here: local appends are in place (open_append), never put over a version."""
        dfd, base = self._parent_fd(name, create=True)
        try:
            self._refuse_link(dfd, base, name)
            with _temporary(dfd, base, mode, views, fence) as (tmp, size):
                try:
                    os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
                except FileNotFoundError as e:
                    if fence is None:
                        raise
                    raise ConcurrentWriteError(
                        f"{self.path(name)}: its temporary file was removed before the rename (a "
                        "trainer taking the run over removes those of the holder it replaces): not "
                        "published"
                    ) from e
            os.fsync(dfd)
            return Version(size)
        finally:
            os.close(dfd)

    def extend(self, name: str, data: bytes, expect: Version, fence: Fence | None) -> Version:
        return self.put(name, byte_views(data), expect, fence, 0o666)

    def create_exclusive(self, name: str, data: bytes, mode: int) -> Version:
        """Write `data` durably under a temporary name, then link it to `name` (link(2) fails if the name
        exists, even as a symlink: it never follows the new name)."""
        dfd, base = self._parent_fd(name, create=True)
        try:
            with _temporary(dfd, base, mode, (data,)) as (tmp, _):
                os.link(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            os.fsync(dfd)
            return sha256_version(data)
        finally:
            os.close(dfd)

    def replace_if_unchanged(self, name: str, data: bytes, expect: Version, mode: int) -> Version:
        """Compare-and-replace: the bytes are written and fsynced under a temporary name first; under
        the folder's flock only the compare and the rename remain, each checked against the time bound
        (see _DirectoryLock). Never through a symlink (the path layer)."""
        final = self.path(name)
        dfd, base = self._parent_fd(name, create=True)
        try:
            self._refuse_link(dfd, base, name)
            with _temporary(dfd, base, mode, (data,)) as (tmp, _):
                with _DirectoryLock(dfd) as guard:
                    sidecar = "ANDREA_MAX_SIDECAR_BYTES"
                    _, version = self.read_versioned(name, limit(sidecar), sidecar)
                    if not version.exists or version.etag != expect.etag:
                        raise ConcurrentWriteError(
                            f"{final} changed since this process read it; not replacing it"
                        )
                    if not guard.within_bound():
                        raise ConcurrentWriteError(
                            f"{final}: this process was paused for {awake_clock() - guard.since:.1f}s "
                            "while replacing it (another may have replaced it meanwhile); "
                            "not replacing it"
                        )
                    os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
                    if not guard.within_bound():
                        raise ReplacePaused(
                            f"{final}: this process was paused for {awake_clock() - guard.since:.1f}s "
                            "while replacing it: a waiter may have replaced it meanwhile, and been "
                            "overwritten"
                        )
            os.fsync(dfd)
            return sha256_version(data)
        finally:
            os.close(dfd)

    def open_append(
        self, name: str, lines: bool, fence_of: FenceOf, mirror: Path, bound: str
    ) -> AppendHandle:
        opener = lambda _, flags: self._open(name, (flags & ~os.O_WRONLY) | os.O_RDWR)  # noqa: E731
        return AppendFile(self.path(name), fence_of, opener, lines)

    def log_path(self, name: str, mirror: Path) -> str:
        return self.path(name)

    def open_log(self, name: str, mirror: Path) -> Any:
        return open(self._open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")

    def move(self, src: str, dst: str) -> None:
        sfd, sbase = self._parent_fd(src)
        try:
            dfd, dbase = self._parent_fd(dst, create=True)
            try:
                self._refuse_link(dfd, dbase, dst)
                os.rename(sbase, dbase, src_dir_fd=sfd, dst_dir_fd=dfd)  # moves a link, never its target
                os.fsync(dfd)
                os.fsync(sfd)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def remove(self, name: str) -> None:
        dfd, base = self._parent_fd(name)
        try:
            os.unlink(base, dir_fd=dfd)  # a symlink is removed, never its target
            os.fsync(dfd)  # durable: a power cut would bring back a journal, a phase folder's file
        finally:
            os.close(dfd)

    def remove_root_if_empty(self) -> None:
        with contextlib.suppress(OSError):  # ENOTEMPTY: it holds something; ENOENT: already gone
            os.rmdir(self.root)

    def remove_folder(self, sub: str) -> None:
        dfd, base = self._parent_fd(sub)
        try:
            self._refuse_link(dfd, base, sub)
            os.rmdir(base, dir_fd=dfd)
            os.fsync(dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    # --- what a dead or replaced writer left -----------------------------------------------------

    def _remove_temporaries(
        self, which: Callable[[str, int], bool], why: str, log: Log, remove: Callable[[str], None]
    ) -> list[str]:
        """Remove (through `remove`: the run's, fenced) the temporary files (TEMP_RE) of the run's
        folder that `which(name, writer pid)` picks, each said to `log` with `why`; the names removed."""
        removed = []
        for name in self.listdir(""):
            m = TEMP_RE.fullmatch(name)
            if m and which(name, int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    remove(name)
                    removed.append(name)
                    log(f"removed {self.path(name)}, {why}")
        return removed

    def discard_incomplete_writes(self, log: Log, remove: Callable[[str], None]) -> list[str]:
        # Our own pid's temporaries are writes in flight on our other threads (the checkpoint writer).
        return self._remove_temporaries(
            lambda name, pid: pid != os.getpid() and self.is_dead_temporary(name),
            "left by a writer that did not finish",
            log,
            remove,
        )

    def abort_writes_in_flight(self, pid: int, log: Log, remove: Callable[[str], None]) -> list[str]:
        # Ours too if the numbers match (pid 1 in two containers): this process, taking the lock, has no
        # write in flight.
        whose = f"of trainer pid {pid}, whose lease is being taken over"
        return self._remove_temporaries(lambda _, p: p == pid, f"a write in flight {whose}", log, remove)

    def is_dead_temporary(self, name: str) -> bool:
        dfd, base = self._parent_fd(name)
        try:
            return stat.S_ISLNK(os.lstat(base, dir_fd=dfd).st_mode) or _writer_gone(dfd, base)
        except FileNotFoundError:
            return False  # renamed or removed meanwhile: nothing left to remove
        finally:
            os.close(dfd)


# --- stores without append: S3 and memory --------------------------------------------------------


class _ObjectStore(_Named):
    """What S3 and memory share: no folders, no append (a local mirror, published whole), no
    temporary names (a put is whole or nothing)."""

    def __init__(self, fs: Any, root: str):
        self.fs, self.root = fs, root
        self.url = fs.unstrip_protocol(root)

    def read_tail(self, name: str, most: int) -> tuple[bytes, int]:
        path = self.path(name)
        size = self.fs.size(path) or 0
        start = max(0, size - most)
        return (self.fs.cat_file(path, start=start, end=size) if size else b""), start

    def makedirs(self, sub: str) -> None:
        self.fs.makedirs(self.path(sub) if sub else self.root, exist_ok=True)

    def open_append(
        self, name: str, lines: bool, fence_of: FenceOf, mirror: Path, bound: str
    ) -> AppendHandle:
        return MirroredAppendFile(self, name, lines, fence_of, mirror, bound)

    def log_path(self, name: str, mirror: Path) -> str:
        mirror.parent.mkdir(parents=True, exist_ok=True)  # no appends here: this machine's copy
        return str(mirror)

    def open_log(self, name: str, mirror: Path) -> Any:
        return open(self.log_path(name, mirror), "ab")

    def move(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)
        self.fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
        self.fs.mv(src_path, dst_path)

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.path(name))

    def remove_root_if_empty(self) -> None:
        pass  # no folders

    def remove_folder(self, sub: str) -> None:
        pass  # no folders

    def is_dead_temporary(self, name: str) -> bool:
        return True  # nothing here writes temporaries: a name like one is left by no live writer


class S3Store(_ObjectStore):
    """S3: every read bounded by one ranged GET, every publish one atomic (conditional) put
    (objstore.s3_put / s3_extend), a killed writer's uploads aborted at the next start."""

    def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fsspec.asyn.sync(self.fs.loop, fn, self.fs, *args)

    def read(self, name: str, most: int | None, bound: str) -> bytes:
        if most is None:
            return self.fs.cat_file(self.path(name))
        return self._get(name, most, bound)[0]

    def _get(self, name: str, most: int, bound: str) -> tuple[bytes, str | None]:
        """The file and its ETag in one GET, refused unread above `most` (the GET's answer names the
        object's size before its body is read: no HEAD first)."""
        path = self.path(name)
        data, etag, size = self._sync(objstore.s3_get, path, most)
        check_limit(size, bound, f"{path}: {size} bytes")
        return data, etag

    def read_versioned(self, name: str, most: int, bound: str) -> tuple[bytes, Version]:
        try:
            data, etag = self._get(name, most, bound)
        except FileNotFoundError:
            return b"", ABSENT
        return data, Version(len(data), etag)

    def read_checkpoint(self, name: str, head: int, check: Callable[[bytes, int], None]) -> bytes:
        return self._sync(objstore.s3_get_checked, self.path(name), head, check)

    def read_tail(self, name: str, most: int) -> tuple[bytes, int]:
        return self._sync(objstore.s3_tail, self.path(name), most)

    def listdir(self, sub: str) -> list[str]:
        return sorted(self._sync(objstore.s3_list, self.path(sub) if sub else self.root))

    def put(
        self, name: str, views: Iterable[memoryview], expect: Version | None, fence: Fence | None, mode: int
    ) -> Version:
        return self._sync(objstore.s3_put, self.path(name), views, expect, fence)

    def extend(self, name: str, data: bytes, expect: Version, fence: Fence | None) -> Version:
        """Once the published file is a part's worth, only the new tail is uploaded (s3_extend)."""
        if not objstore.extendable(expect, len(data)):
            return self.put(name, byte_views(data), expect, fence, 0o666)
        return self._sync(objstore.s3_extend, self.path(name), data, expect, fence)

    def create_exclusive(self, name: str, data: bytes, mode: int) -> Version:
        try:
            return self.put(name, byte_views(data), ABSENT, None, mode)  # If-None-Match: *
        except ConcurrentWriteError:
            raise FileExistsError(errno.EEXIST, "already exists", self.path(name)) from None

    def replace_if_unchanged(self, name: str, data: bytes, expect: Version, mode: int) -> Version:
        return self.put(name, byte_views(data), expect, None, mode)  # If-Match

    def discard_incomplete_writes(self, log: Log, remove: Callable[[str], None]) -> list[str]:
        return self._sync(objstore.s3_abort_uploads, self.root, log)

    def abort_writes_in_flight(self, pid: int, log: Log, remove: Callable[[str], None]) -> list[str]:
        whose = f"of trainer pid {pid}, whose lease is being taken over"
        return self._sync(objstore.s3_abort_uploads, self.root, log, whose)


class MemoryStore(_ObjectStore):
    """fsspec's memory filesystem: one dict of this process. Every compare-and-put holds one lock of
    this process, so a conditional put is exact. A fenced put is fenced first, as on local disk (the
    fence may renew the lease, a put of the lock on the lease's own thread's lock order)."""

    _lock = threading.RLock()

    def read(self, name: str, most: int | None, bound: str) -> bytes:
        path = self.path(name)
        if most is None:
            return self.fs.cat_file(path)
        size = self.fs.size(path)
        if size is not None:
            check_limit(size, bound, f"{path}: {size} bytes")
        data = self.fs.cat_file(path, start=0, end=most + 1)  # it may have grown since
        check_limit(len(data), bound, f"{path}: more than {most} bytes")
        return data

    def read_checkpoint(self, name: str, head: int, check: Callable[[bytes, int], None]) -> bytes:
        path = self.path(name)
        size = self.fs.size(path)
        first = self.fs.cat_file(path, start=0, end=head) if size else b""
        check(first, size)
        return first if size <= head else self.fs.cat_file(path, start=0, end=size)

    def listdir(self, sub: str) -> list[str]:
        try:
            found = self.fs.ls(self.path(sub) if sub else self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in found)

    def put(
        self, name: str, views: Iterable[memoryview], expect: Version | None, fence: Fence | None, mode: int
    ) -> Version:
        data = b"".join(views)
        if fence is not None:  # outside the lock: a fence may renew the lease, whose thread holds it
            fence()
        with self._lock:
            if expect is not None:
                try:
                    held = sha256_version(self.fs.cat_file(self.path(name)))
                except FileNotFoundError:
                    held = ABSENT
                if held.exists != expect.exists or (expect.exists and held.etag != expect.etag):
                    raise ConcurrentWriteError(
                        f"{self.path(name)} changed since this process read it; not replacing it"
                    )
            self.fs.pipe_file(self.path(name), data)
        return sha256_version(data)

    def extend(self, name: str, data: bytes, expect: Version, fence: Fence | None) -> Version:
        return self.put(name, byte_views(data), expect, fence, 0o666)

    def create_exclusive(self, name: str, data: bytes, mode: int) -> Version:
        with self._lock:
            if self.fs.exists(self.path(name)):
                raise FileExistsError(errno.EEXIST, "already exists", self.path(name))
            return self.put(name, byte_views(data), None, None, mode)

    def replace_if_unchanged(self, name: str, data: bytes, expect: Version, mode: int) -> Version:
        return self.put(name, byte_views(data), expect, None, mode)

    def discard_incomplete_writes(self, log: Log, remove: Callable[[str], None]) -> list[str]:
        return []  # a put is one assignment: nothing is ever half-written

    def abort_writes_in_flight(self, pid: int, log: Log, remove: Callable[[str], None]) -> list[str]:
        return []


# --- appending ---------------------------------------------------------------------------------------


# What a stat answers when the name is not there (or cannot name a file): "absent". Any other error
# (EIO, EACCES) is the disk's or the system's failure, never an absence (below).
_ABSENT_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)


def _local_exists(path: str) -> bool:
    """Whether `path` exists (a symlink followed, as fsspec's exists follows it). fsspec's
    LocalFileSystem.exists answers False for any exception of its stat: an I/O error on .state.json
    started a fresh bandit, on guard.jsonl dropped the guard's remedies, each as if the file were
    absent (issue 48, the disk-error soak). Here only "not there" is False; any other error raises."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno in _ABSENT_ERRNOS:
            return False
        raise
    return True


class AppendFile:
    """An append-only local file: `write` never seeks, and `durable` fsyncs before returning.

    Unbuffered, so that this object knows exactly which bytes reached the file: on a full disk a write
    raises with the bytes that did not fit kept here, in order, and the next write sends them first.
    The file then only ever ends in a torn line (readers skip it), which the next write completes."""

    in_place = True

    def __init__(self, path: str, fence_of: FenceOf, opener: Callable[[str, int], int], lines: bool = True):
        self.path = path
        self._fence_of = fence_of  # the holder's lease check (RunDir._fence_of), before every append
        # opener: the path layer's, which refuses a symlink or a hard link and opens read-write.
        self._f = open(path, "ab", buffering=0, opener=opener)
        # Bytes accepted by write() that have not reached the file yet; first of all the newline that
        # ends a torn last line, sent with the first record (in one write: never a line of its own).
        self._pending = _line_end(self._last_byte()) if lines else b""
        self._lock = threading.Lock()  # the trainer appends while the checkpoint writer fsyncs
        self._name_durable = False  # its name may be new (O_CREAT): fsynced into its folder once

    def read(self) -> bytes:
        # The handle's own file (pread), not the name again: what is appended to is what is read.
        fd, parts, at = self._f.fileno(), [], 0
        while piece := os.pread(fd, 1 << 20, at):
            parts.append(piece)
            at += len(piece)
        return b"".join(parts)

    def _last_byte(self) -> bytes:
        """The file's last byte (b"" if it is empty), read through the handle (never the name again)."""
        size = os.fstat(self._f.fileno()).st_size
        return os.pread(self._f.fileno(), 1, size - 1) if size else b""

    def write(self, data: bytes, durable: bool = False) -> None:
        with self._lock:
            self._pending += data
        if (fence := self._fence_of()) is not None:
            # A fence that cannot confirm the lease now refuses like a full disk: the bytes stay pending.
            fence()
        with self._lock:
            while self._pending:
                written = self._f.write(self._pending) or 0  # raises OSError (ENOSPC) with nothing written
                self._pending = self._pending[written:]
            if durable:
                os.fsync(self._f.fileno())
                if not self._name_durable:  # a power cut would lose a new file with its lines
                    fsync_dir(os.path.dirname(self.path))
                    self._name_durable = True

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MirroredAppendFile:
    """An append-only file on a store without append. Writes go to a mirror in the run cache, which
    starts as a copy of the published file (never from an older mirror: the run is the truth, and
    another machine may have extended it). A durable write publishes the whole mirror atomically, and
    only over the version this handle last published, so the published file only grows (on S3, past a
    part's worth, the store copies the published prefix and only the new tail is sent: Store.extend).
    The mirror is this process's own (two forks of one parent may append at once), created new
    (O_EXCL: never another's, whose pid may be ours in another pid namespace sharing the cache) and
    held under its flock while open, and removed at a clean close. One a crash leaves behind holds only
    a tail that was never published (a resume reads the run, never a mirror): the next open of the file
    on this machine removes it, once its process is gone and no one holds its flock, so that a run's
    crashes over weeks do not pile up copies of its loss log in the cache. A write the cache folder has
    no room for (ENOSPC) keeps what it could not write pending, sent first by the next write, as
    AppendFile's: the mirror holds exactly the bytes counted (unbuffered writes), so a full cache delays
    the file's lines, never tears, repeats or loses them (the S3 soak's cache-full)."""

    in_place = False

    def __init__(
        self, store: _ObjectStore, name: str, lines: bool, fence_of: FenceOf, mirror: Path, bound: str
    ):
        self.store = store
        self.name = name
        self._bound = bound  # the limit (config.LIMITS) the published file is read under
        self._fence_of = fence_of
        data, self._version = self._read_published()
        self.path, self._f = _new_mirror(mirror)
        with contextlib.suppress(OSError):  # held by an earlier handle of this process: held all the same
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _remove_dead_mirrors(self.path, mirror.name)
        self._size, self._pending = 0, b""  # bytes in the mirror; bytes written to it yet to land there
        try:
            self._write_pending(data)
        except OSError:  # no room for the published copy: no mirror, nothing half made left behind
            self._f.close()
            self.path.unlink(missing_ok=True)
            raise
        self._torn_end = _line_end(data[-1:]) if lines else b""  # ends a torn last line, with the first write
        # The trainer appends on its thread while the checkpoint writer publishes on its own.
        self._lock = threading.Lock()

    def _read_published(self) -> tuple[bytes, Version]:
        return self.store.read_versioned(self.name, limit(self._bound), self._bound)

    def read(self) -> bytes:
        with self._lock:
            return self._read_locked()

    def _read_locked(self) -> bytes:
        # A separate handle: seeking the shared one would move where the next append lands.
        with open(self.path, "rb") as f:
            return f.read(self._size)

    def _write_pending(self, data: bytes) -> None:
        """Append `data` after what is pending; on OSError (ENOSPC) the unwritten rest stays pending."""
        self._pending += data
        while self._pending:
            written = self._f.write(self._pending) or 0  # unbuffered: OSError with nothing written
            self._pending = self._pending[written:]
            self._size += written

    def write(self, data: bytes, durable: bool = False) -> None:
        with self._lock:
            data, self._torn_end = self._torn_end + data, b""
            self._write_pending(data)
            if durable:
                self._publish_locked()

    def publish(self) -> None:
        with self._lock:
            self._publish_locked()

    def _publish_locked(self) -> None:
        if self._size == self._version.size and self._version.exists:
            return  # nothing new: the published file already is the mirror
        mirror = self._read_locked()
        try:
            self._version = self.store.extend(self.name, mirror, self._version, self._fence_of())
        except ConcurrentWriteError:
            # An earlier publish of ours may have reached the store although its call failed (a lost
            # reply): then the store holds a prefix of the mirror, at least as long as the version we
            # know, and the file still only grows if we go on from it. Anything else is foreign.
            held, version = self._read_published()
            known = self._version.size if self._version.exists else 0
            if not (version.exists and len(held) >= known and mirror.startswith(held)):
                raise
            self._version = version
            if len(held) < len(mirror):
                self._version = self.store.extend(self.name, mirror, version, self._fence_of())

    def close(self) -> None:
        with self._lock:
            published = self._size == self._version.size
            self._f.close()
        if published:
            self.path.unlink()

    def __enter__(self) -> MirroredAppendFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_mirror(stem: Path) -> tuple[Path, Any]:
    """(path, file) of a new mirror `STEM.PID` in the run cache, created with O_EXCL | O_NOFOLLOW (the
    cache folder is this machine's, but a link planted there is not written through). A file of that
    name is another writer's (the same pid in another pid namespace sharing the cache) or a dead one's:
    never truncated; one this process left (its flock free) is removed and the name taken, a live
    writer's leaves this one `STEM.PID.N`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    base = f"{stem.name}.{os.getpid()}"
    for n in range(1000):
        path = stem.parent / (base if n == 0 else f"{base}.{n}")
        try:
            return path, open(os.open(path, flags, 0o600), "w+b", buffering=0)
        except FileExistsError:
            dfd = os.open(stem.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _stale_own_mirror(dfd, path.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path.name, dir_fd=dfd)
                    with contextlib.suppress(FileExistsError):
                        return path, open(os.open(path, flags, 0o600), "w+b", buffering=0)
            finally:
                os.close(dfd)
    raise FileExistsError(errno.EEXIST, "no free mirror name", str(stem.parent / base))


def _mirror_pid(name: str, stem: str) -> int | None:
    """The writer pid of mirror `name` of `stem` (`STEM.PID` or `STEM.PID.N`), None if it is none."""
    rest = name[len(stem) + 1 :].split(".")
    if not name.startswith(stem + ".") or len(rest) > 2 or not all(p.isdigit() for p in rest):
        return None
    return int(rest[0])


def _stale_own_mirror(dfd: int, name: str) -> bool:
    """Whether mirror `name` (`STEM.PID`, PID ours) is a leftover of this very process (a handle
    closed unpublished): no one holds its flock. Another writer with our pid number (another pid
    namespace sharing the cache) holds it."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_dead_mirrors(own: Path, stem: str) -> None:
    """Remove the other mirrors of `stem`'s file (`STEM.PID[.N]` beside `own`) whose writer is gone
    (`_writer_gone`); a link planted among them is not followed, and not removed."""
    dfd = os.open(own.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for other in own.parent.iterdir():
            pid = _mirror_pid(other.name, stem)
            if other != own and pid is not None and _writer_gone(dfd, other.name, pid):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(other.name, dir_fd=dfd)
    finally:
        os.close(dfd)


def _writer_gone(dfd: int, name: str, pid: int | None = None) -> bool:
    """Whether the writer of file `name` in folder `dfd` is gone: the file is a regular one (not a
    link), its flock is free, and then its writer's pid (`pid`, or the one its temporary name holds:
    `.NAME.tmp.PID.RANDOM`) is no live process here (signals.process_start_ticks). Writers hold the
    flock from just after they create the file to its rename or close (`_create_temp`,
    MirroredAppendFile). Both checks, because a folder shared with another pid namespace names its
    writers by pids that mean nothing here (their flock says they live), and a writer of this namespace
    between its create and its flock is a live pid (looked at after the flock is taken, so one that
    created the file before it is seen)."""
    if pid is None:
        m = TEMP_RE.fullmatch(name)
        pid = int(m.group(1)) if m else int(name.rsplit(".", 1)[1])
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return False  # gone meanwhile, or a link: not a writer's file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return stat.S_ISREG(os.fstat(fd).st_mode) and process_start_ticks(pid) is None
    except OSError:
        return False  # its flock is held: its writer lives (in another pid namespace, or here)
    finally:
        os.close(fd)


def _line_end(last: bytes) -> bytes:
    """What an append to a JSON Lines file ending in `last` must send first: a newline after a torn
    line (its own record stays torn and skipped by readers), nothing after a whole one or none."""
    return b"\n" if last and last != b"\n" else b""


# --- local compare-and-replace ---------------------------------------------------------------------


class ReplacePaused(ConcurrentWriteError):
    """A compare-and-replace on local disk ran past its time bound after its rename: this process was
    paused in it, and a waiter may have replaced the file meanwhile, so what it replaced is not known."""


# The compare-and-replace's time bounds on local disk (issue 23.5). Its critical section is a read of a
# small file and a rename (the new bytes are fsynced before it): a holder longer than HOLD_S was paused
# there (SIGSTOP, a frozen VM). A waiter polls the flock for WAIT_S > 2 x HOLD_S (a holder before it and
# one more), then goes on without it, so that no paused process blocks a takeover for longer; the paused
# one, when it runs again, finds its bound exceeded and either writes nothing (before its rename) or
# reports ReplacePaused (after it), and a lease holder stops. HOLD_S is 3 s, not the 1 s it was: on a
# loaded machine a small read and a rename through a slow filesystem took 1.1 s unpaused (the 1000-fault
# soak, load 15, its FUSE layer; issue 48), and each such stop cost a restart.
REPLACE_HOLD_S, REPLACE_WAIT_S = 3.0, 7.0


class _DirectoryLock:
    """flock(2) on a directory (an fd the path layer opened), held for at most REPLACE_HOLD_S and waited
    for at most REPLACE_WAIT_S: serialises the processes of this kernel that compare-and-replace a file
    in it (renewal, takeover) without adding a file to the run directory, and without letting a paused
    holder block the others."""

    def __init__(self, folder_fd: int):
        # A description of its own (flock is per open file description), of the folder the path layer
        # reached without following a link.
        self.fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=folder_fd)
        self.guarded = False

    def __enter__(self) -> _DirectoryLock:
        # Not taken within REPLACE_WAIT_S: its holder is paused past its own bound and will write nothing.
        self.guarded = bool(poll_until(self._try_flock, REPLACE_WAIT_S, 0.01))
        self.since = awake_clock()
        faults.hold_replace(REPLACE_HOLD_S / 2)
        return self

    def _try_flock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def within_bound(self) -> bool:
        return awake_clock() - self.since < REPLACE_HOLD_S

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing drops the flock


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _temporary(
    dfd: int, base: str, mode: int, views: Iterable[bytes | memoryview], fence: Fence | None = None
) -> Iterator[tuple[str, int]]:
    """(name, size) of a new temporary beside `base` (_create_temp) holding `views`, fsynced, its flock
    held while the block publishes it (rename or link); removed after the block unless published.
    `fence` is checked once it exists, before a byte is written."""
    tmp, fd = _create_temp(dfd, base, mode)
    try:
        with open(fd, "wb", closefd=True) as f:
            if fence is not None:
                fence()
            size = 0
            for view in views:
                size += f.write(view)
            f.flush()
            os.fsync(f.fileno())
            yield tmp, size
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)


def _create_temp(dfd: int, base: str, mode: int) -> tuple[str, int]:
    """(name, fd) of a new temporary file beside `base` in folder `dfd`: `.BASE.tmp.PID.RANDOM`,
    created with O_EXCL and O_NOFOLLOW, so nothing planted in advance is ever written through. The fd
    holds the file's flock: keep it open until the rename, so that no lock holder's
    `discard_incomplete_writes` takes the write for a dead one's (`_writer_gone`)."""
    fixed = faults.fixed_temp_names()
    tmp = f".{base}.tmp.{os.getpid()}" + ("" if fixed else f".{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode, dir_fd=dfd)
    except FileExistsError:
        if not fixed:
            raise
        fd = faults.open_planted(dfd, tmp, mode)  # the fault a test planted at the fixed name
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: a sweep that looks at it holds it only for a moment
    except OSError:
        os.close(fd)
        raise
    return tmp, fd
