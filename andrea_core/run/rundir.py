"""The run directory (contract), addressed by a path or an fsspec URL.

Every read and write of a run directory goes through `RunDir`, so that where the run lives (local disk,
memory for tests, an object store, anything else fsspec reaches) is decided here and nowhere else.
Files appear under their final names only whole:

  local disk      temporary name, fsync, rename, fsync of the directory;
  everything else one atomic put (on S3: one PUT, or a multipart upload that is either completed or
                  aborted, so that a failed upload leaves neither an object nor billed parts). Object
                  stores (S3, GCS, Azure, memory) publish a put whole or not at all; a filesystem
                  whose put can tear (ftp, sftp) gets no more than that from fsspec.

The append-only files (`.loss.json`, `forks.jsonl`, `data.jsonl`: JSON Lines, every one) are appended
to through `open_append` alone, which ends a torn last line (a crash mid-append) before the first new
byte, so that a record is never glued onto it. They are appended to in place on local disk. A store
without append keeps them in a local mirror in the run cache and publishes the mirror whole, by one
atomic put, at each durable write (every checkpoint, and exit): the published file only ever grows by
a prefix extension of itself, and a crash loses at most what was written since the last durable write.

This module is also the one path layer (docs/design.md, "Threat model"): a run directory may come from
someone else, so every name a run file holds, or that code builds from one, is checked run-relative
(`check_name`: no absolute path, no `..`, no NUL) before it is joined to the root; on local disk every
write, move, delete, append and read walks from the root one folder at a time with O_NOFOLLOW, so a
symlink planted below the root is refused, naming it, never followed; temporary names carry a random
suffix and are created with O_EXCL. And it holds the URL gate (`url_to_fs`, `open_url`): every fsspec
URL the project opens passes the protocol allow-list there first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import posixpath
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from andrea_core.bounded import read_bounded
from andrea_core.checkpoint import (
    HEADER,
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    decode,
    expected_size,
    is_stray_checkpoint_name,
    step_from_name,
)
from andrea_core.config import ConfigError, check_limit, limit
from andrea_core.run import objstore
from andrea_core.run.objstore import ABSENT, ConcurrentWriteError, Version
from andrea_core.signals import process_start_ticks

RUN_YAML = "run.yaml"
POLICY_YAML = "policy.yaml"
TOKENIZER_JSON = "tokenizer.json"  # a BPE run's tokenizer, frozen when the run is created
LOSS_LOG = ".loss.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
LOCK = ".trainer.json"
FORKS = "forks.jsonl"
GUARD_LOG = "guard.jsonl"  # the divergence guard's events (run/guard_events.py)
TARGET = "target.jsonl"  # the run's target (max_steps): one line per change, append-only
ARCHIVE = "archive"
REFUSED = "refused"  # checkpoints that failed validation, set aside at resume

S3_PROTOCOLS = {"s3", "s3a"}
# A run URL may come from someone else (a Prefect parameter, a forks.jsonl line): only the filesystems
# a run directory lives on, never http(s), ftp or anything else that would make this process a client
# of internal addresses. A plain path is "file". ANDREA_ALLOWED_PROTOCOLS (comma-separated) replaces it.
DEFAULT_ALLOWED_PROTOCOLS = ("file", "local", "s3", "s3a", "gcs", "gs", "az", "abfs", "memory")
# `.NAME.tmp.PID.RANDOM`: a write in progress, or a dead writer's (`.NAME.tmp.PID`: one from before the
# random suffix). The random part makes the name unguessable: nobody can plant a link where we will write.
TEMP_RE = re.compile(r"\..+\.tmp\.(\d+)(?:\.[0-9a-f]{16})?")  # fullmatch
# Tests only: temporary names without the random suffix, opened as before (a test plants a full-disk
# link or holds a lease at the name the writer will use). Never set in production.
TEST_FIXED_TEMPS_ENV = "ANDREA_TEST_FIXED_TEMP_NAMES"

Buffer = bytes | bytearray | memoryview


def cache_dir() -> Path:
    """This machine's cache (token caches, append mirrors): ANDREA_CACHE_DIR or ~/.cache/andrea."""
    return Path(os.environ.get("ANDREA_CACHE_DIR") or Path.home() / ".cache" / "andrea")


class ProtocolNotAllowed(ConfigError):
    """A URL over a protocol outside the allow-list (see check_protocol)."""


class UnsafeRunPath(ConfigError):
    """A run file's name that is not run-relative, or a symlink (or other non-file) where a run file
    or folder should be: refused, never followed."""


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


def allowed_protocols() -> list[str]:
    raw = os.environ.get("ANDREA_ALLOWED_PROTOCOLS")
    if raw is None or not raw.strip():
        return sorted(DEFAULT_ALLOWED_PROTOCOLS)
    return sorted({p.strip().lower() for p in raw.split(",") if p.strip()})


def check_protocol(url: str, what: str = "run directory URL") -> None:
    """Refuse, before anything is contacted, a URL whose protocol (any link of a chained URL such as
    `simplecache::s3://...`) is not allowed. The error names `what` and the protocol, never the URL
    (it may carry credentials)."""
    if not isinstance(url, str):
        raise ProtocolNotAllowed(f"{what}: expected a path or URL, got {type(url).__name__}")
    allowed = allowed_protocols()
    for link in url.split("::"):
        protocol, _ = fsspec.core.split_protocol(link)
        protocol = (protocol or "file").lower()
        if protocol not in allowed:
            raise ProtocolNotAllowed(
                f"{what}: protocol {protocol!r} is not allowed (allowed: {', '.join(allowed)}; "
                "set ANDREA_ALLOWED_PROTOCOLS to change the list)"
            )


def url_to_fs(url: str | os.PathLike, what: str = "URL", **options: Any) -> tuple[Any, str]:
    """The URL gate: (filesystem, path) for `url`, only after check_protocol. Every fsspec URL the
    project opens (run directories, corpus paths, tokenizers, `andrea inspect`, plots) comes through
    here or `open_url`; tests/test_security_paths.py fails if fsspec is opened anywhere else."""
    url = os.fspath(url)
    check_protocol(url, what)
    return fsspec.core.url_to_fs(url, **options)


def open_url(url: str | os.PathLike, mode: str = "rb", what: str = "URL") -> Any:
    """A file object for `url` (a context manager), after the URL gate."""
    fs, path = url_to_fs(url, what)
    return fs.open(path, mode)


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def _byte_views(parts: Buffer | Iterable[Buffer]) -> Iterable[memoryview]:
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = [parts]
    # A float32 array's memoryview counts floats, not bytes: cast so every size below is in bytes.
    return (memoryview(p).cast("B") for p in parts)


# The problem of a CheckpointError for a checkpoint that is not there (a reader may look elsewhere).
NO_SUCH_CHECKPOINT = "no such file"


class RunDir:
    def __init__(self, url: str | os.PathLike):
        # Other processes (the trainer, the flows, the CLI) change a run directory under our feet: a
        # cached listing would hide a new checkpoint or show a deleted one.
        self.fs, root = url_to_fs(url, "run directory URL", use_listings_cache=False)
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_s3 = bool(_protocols(self.fs) & S3_PROTOCOLS)
        # The canonical address: what lineage, forks.jsonl and Prefect parameters record.
        self.url = self.root if self.is_local else self.fs.unstrip_protocol(self.root)
        # The holder's lease (lock.Lease) while a trainer holds the run: every publish, move and delete
        # but the lock's own passes its check first (fencing); None for everyone else.
        self.fence: Any = None

    def _fenced(self, name: str) -> None:
        if (check := self._fence_of(name)) is not None:
            check()

    def _fence_of(self, name: str) -> objstore.Fence | None:
        """The holder's check before publishing `name` (None: unfenced). A publish calls it once its
        write can be undone by a trainer taking the run over (an upload created, a temporary file made:
        abort_writes_in_flight), so that a holder paused past it publishes nothing after a takeover."""
        if self.fence is None or name == LOCK:
            return None
        return functools.partial(self.fence.check, name)

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def path(self, name: str) -> str:
        """The full path of run file `name`, which must be run-relative (check_name)."""
        return posixpath.join(self.root, check_name(name, f"{self.url}: run file name"))

    # --- the local path layer: from the root down, never through a symlink ----------------------

    def _parent_fd(self, name: str, create: bool = False) -> tuple[int, str]:
        """(an fd of the folder holding `name`, its last part), reached from the root one folder at a
        time with O_NOFOLLOW: a symlink (or a file) where a folder of the run should be is refused.
        The root itself is the operator's (it may be a link to another disk). `create` makes the
        missing folders. The caller closes the fd."""
        parts = check_name(name, f"{self.url}: run file name").split("/")
        if create:
            _makedirs_durable(self.root)
        fd = self._root_fd()
        try:
            for i, part in enumerate(parts[:-1]):
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                        os.fsync(fd)  # its entry durable: a power cut would lose the folder with its files
                    except FileExistsError:
                        pass
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

    def _open_local(self, name: str, flags: int, mode: int = 0o666) -> int:
        """An fd of run file `name` opened with `flags` (+ O_NOFOLLOW): a symlink is refused."""
        dfd, base = self._parent_fd(name, create=bool(flags & os.O_CREAT))
        try:
            return os.open(base, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeRunPath(
                    f"{self.path(name)}: a symlink where a run file should be: not followed (remove it)"
                ) from None
            raise
        finally:
            os.close(dfd)

    def _read_local(self, name: str, most: int | None, bound: str) -> bytes:
        # O_NONBLOCK: a FIFO planted under a run file's name must not hang the reader at open().
        fd = self._open_local(name, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb", buffering=0, closefd=True) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeRunPath(f"{self.path(name)}: not a regular file; not read")
            os.set_blocking(fd, True)
            if most is None:
                return f.read()
            check_limit(st.st_size, bound, f"{self.path(name)}: {st.st_size} bytes")
            return read_bounded(f, most, f"{self.path(name)} (set {bound} to allow more)")

    def cache_path(self, name: str) -> Path:
        """This machine's scratch copy of a run file (the append mirrors): rebuilt from the run when
        missing, so a machine that never saw the run needs nothing but its URL."""
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return cache_dir() / "runs" / f"{posixpath.basename(self.root)}-{key}" / name

    # --- plain files -------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        """A run file's bytes, bounded like every run file read (read_bounded); checkpoints, whose
        size their header checks (read_checkpoint), by nothing but that."""
        if step_from_name(name.rsplit("/", 1)[-1]) is not None:
            if self.is_local:
                return self._read_local(name, None, "")
            return self.fs.cat_file(self.path(name))
        return self.read_bounded(name, _bound_of(name))

    def read_text(self, name: str) -> str:
        """A sidecar's text (run.yaml, policy.yaml, data.jsonl ...), bounded like every sidecar read."""
        try:
            return self.read_bounded(name).decode()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.path(name)}: not UTF-8 text (byte {e.start}: {e.reason})") from None

    def read_json(self, name: str) -> Any:
        """The parsed file; ValueError (callers name the file) for bad JSON of any kind."""
        try:
            return json.loads(self.read_bounded(name))
        except RecursionError:
            raise ValueError("JSON nested deeper than the parser's recursion limit") from None

    def read_bounded(self, name: str, bound: str | None = "ANDREA_MAX_SIDECAR_BYTES") -> bytes:
        """A run file's bytes, refused unread (ConfigError naming the file, its size and the bound)
        when larger than the limit `bound` (config.LIMITS): a file from someone else must not take
        this machine's memory, or on an object store its bandwidth. On local disk the bytes are
        counted as they arrive (a sparse file or /dev/zero behind the name is refused at the bound)."""
        bound = bound or "ANDREA_MAX_SIDECAR_BYTES"
        most = limit(bound)
        if self.is_local:
            return self._read_local(name, most, bound)
        if self.is_s3:
            return self._s3_read(name, bound)[0]
        path = self.path(name)
        size = self.fs.size(path)
        if size is not None:
            check_limit(size, bound, f"{path}: {size} bytes")
        data = self.fs.cat_file(path, start=0, end=most + 1)  # it may have grown since
        check_limit(len(data), bound, f"{path}: more than {most} bytes")
        return data

    def _s3_read(self, name: str, bound: str) -> tuple[bytes, str | None]:
        """S3 run file `name` and its ETag in one GET, refused unread above limit `bound` (the GET's
        answer names the object's size before its body is read: no HEAD first)."""
        path = self.path(name)
        data, etag, size = fsspec.asyn.sync(self.fs.loop, objstore.s3_get, self.fs, path, limit(bound))
        check_limit(size, bound, f"{path}: {size} bytes")
        return data, etag

    def read_tail(self, name: str, most: int) -> tuple[bytes, int]:
        """The last `most` bytes of run file `name` (all of it when shorter) and the offset they start
        at: a reader that needs the end of a long log reads that, never the whole of it."""
        if self.is_local:
            fd = self._open_local(name, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise UnsafeRunPath(f"{self.path(name)}: not a regular file; not read")
                # The bytes it had when looked at (a log grows while it is read): at most `most`.
                start, data = max(0, st.st_size - most), bytearray()
                while len(data) < st.st_size - start:
                    piece = os.pread(fd, st.st_size - start - len(data), start + len(data))
                    if not piece:
                        break  # cut short meanwhile
                    data += piece
                return bytes(data), start
            finally:
                os.close(fd)
        path = self.path(name)
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_tail, self.fs, path, most)
        size = self.fs.size(path) or 0
        start = max(0, size - most)
        return (self.fs.cat_file(path, start=start, end=size) if size else b""), start

    def size(self, name: str) -> int:
        return self.fs.size(self.path(name))

    def makedirs(self, sub: str = "") -> None:
        if self.is_local:
            if sub:
                os.close(self._parent_fd(f"{sub}/_", create=True)[0])
            else:
                _makedirs_durable(self.root)
            return
        self.fs.makedirs(self.path(sub) if sub else self.root, exist_ok=True)

    def listdir(self, sub: str = "") -> list[str]:
        """Names (not paths) of the entries in the run directory or one of its subfolders (locally,
        a subfolder reached through a symlink is refused)."""
        where = self.path(sub) if sub else self.root
        if self.is_local:
            try:
                fd = self._open_local(sub, os.O_RDONLY | os.O_DIRECTORY) if sub else self._root_fd()
            except FileNotFoundError:
                return []
            except (NotADirectoryError, UnsafeRunPath):  # O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR
                raise UnsafeRunPath(
                    f"{where}: a symlink or a file where a folder of the run should be: "
                    "not followed (remove it)"
                ) from None
            try:
                return sorted(os.listdir(fd))
            finally:
                os.close(fd)
        if self.is_s3:
            return sorted(fsspec.asyn.sync(self.fs.loop, objstore.s3_list, self.fs, where))
        try:  # no exists() first: on an object store that is a request more at every listing
            found = self.fs.ls(where, detail=False)
        except FileNotFoundError:  # nothing there
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in found)

    def write_atomic(self, name: str, parts: Buffer | Iterable[Buffer]) -> None:
        """Publish `name` whole or not at all; a reader never sees a torn file under a final name."""
        self._put(name, parts)

    def open_log(self, name: str) -> Any:
        """A local run file opened for appending (a detached trainer's output), never through a
        symlink: a binary file object whose fileno() a subprocess can write to."""
        if not self.is_local:
            raise ValueError(f"{self.url}: open_log is for local run directories")
        return open(self._open_local(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")

    def write_text(self, name: str, text: str) -> None:
        self.write_atomic(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        self.write_atomic(name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())

    def open_append(self, name: str, lines: bool = True) -> AppendFile | MirroredAppendFile:
        """`lines`: a JSON Lines file, whose torn last line is ended before the first new byte; False for
        a file of binary records (TensorBoard's events), which is appended to byte for byte."""
        if not self.is_local:
            return MirroredAppendFile(self, name, lines)
        return AppendFile(
            self.path(name),
            fenced=lambda: self._fenced(name),
            opener=lambda _, flags: self._open_local(name, (flags & ~os.O_WRONLY) | os.O_RDWR),
            lines=lines,
        )

    def append(
        self, name: str, data: bytes, durable: bool = False, attempts: int = 5, lines: bool = True
    ) -> None:
        for attempt in range(attempts):
            try:
                with self.open_append(name, lines) as f:
                    f.write(data, durable=durable or not self.is_local)
                return
            except ConcurrentWriteError:
                # Another process published between our read and our put (two forks of one parent
                # at once): read its version and append to that.
                if attempt == attempts - 1:
                    raise

    def move(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)  # both names checked before anything moves
        self._fenced(dst)
        if not self.is_local:
            self.fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
            self.fs.mv(src_path, dst_path)
            return
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
        self._fenced(name)
        if not self.is_local:
            self.fs.rm_file(self.path(name))
            return
        dfd, base = self._parent_fd(name)
        try:
            os.unlink(base, dir_fd=dfd)  # a symlink is removed, never its target
        finally:
            os.close(dfd)

    def root_exists(self) -> bool:
        """Whether the run directory itself is there (on an object store: whether anything is under it)."""
        return self.fs.exists(self.root)

    def remove_root_if_empty(self) -> None:
        """Remove the run directory itself if it is empty (local disk; object stores have no folders)."""
        if self.is_local:
            with contextlib.suppress(OSError):  # ENOTEMPTY: it holds something; ENOENT: already gone
                os.rmdir(self.root)

    def remove_folder(self, sub: str) -> None:
        """Remove an empty folder of the run (local disk; object stores have no folders)."""
        if not self.is_local:
            return
        dfd, base = self._parent_fd(sub)
        try:
            self._refuse_link(dfd, base, sub)
            os.rmdir(base, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def _refuse_link(self, dfd: int, base: str, name: str) -> None:
        try:
            st = os.lstat(base, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeRunPath(
                f"{self.path(name)}: a symlink where a run file should be: not written through (remove it)"
            )

    def discard_incomplete_writes(self, log: Callable[[str], None] = print) -> list[str]:
        """Clear what a killed writer left half-done: temporary files, and on S3 the parts of
        multipart uploads that were never completed (invisible, but stored and billed). Only the
        holder of the run's lock may call this. A temporary file is a dead writer's only once its flock
        is free and its pid is no live process here (`_writer_gone`): processes that do not hold the
        lock write in the run too (a trainer racing for `.trainer.json`, a pivot writing its journal),
        and their writes in flight are theirs to finish."""
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_abort_uploads, self.fs, self.root, log)
        if not self.is_local:
            return []  # one put a file (pipe_file): no temporaries
        # Our own pid's temporaries are writes in flight on our other threads (the checkpoint writer).
        return self._remove_temporaries(
            lambda name, pid: pid != os.getpid() and self.is_dead_temporary(name),
            "left by a writer that did not finish",
            log,
        )

    def _remove_temporaries(
        self, which: Callable[[str, int], bool], why: str, log: Callable[[str], None]
    ) -> list[str]:
        """Remove the temporary files (TEMP_RE) of the run's folder that `which(name, writer pid)`
        picks, each said to `log` with `why`; the names removed."""
        removed = []
        for name in self.listdir():
            m = TEMP_RE.fullmatch(name)
            if m and which(name, int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    self.remove(name)
                    removed.append(name)
                    log(f"removed {self.path(name)}, {why}")
        return removed

    def abort_writes_in_flight(self, writer_pid: int, log: Callable[[str], None] = print) -> list[str]:
        """Undo the unfinished writes of a lease holder that is being taken over (lock.acquire_lease,
        after its lease expired and before the takeover write): on S3 every unfinished upload of the
        run (a fenced publish is one), on local disk the temporary files its pid named in the run's
        folder, live or not. Its publish then fails (the upload's complete, the rename) instead of
        landing after the takeover; one it starts later meets its fence past the free window
        (RunDir._fence_of). `writer_pid` is the pid the holder's lock records, in its own namespace:
        a process of this namespace with the same number loses its write in flight too (it fails and
        can be run again; nothing published is touched)."""
        whose = f"of trainer pid {writer_pid}, whose lease is being taken over"
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_abort_uploads, self.fs, self.root, log, whose)
        if not self.is_local:
            return []
        # Ours too if the numbers match (pid 1 in two containers): this process, taking the lock, has no
        # write in flight.
        return self._remove_temporaries(lambda _, pid: pid == writer_pid, f"a write in flight {whose}", log)

    def is_dead_temporary(self, name: str) -> bool:
        """Whether run file `name`, named as a temporary (TEMP_RE), is a dead writer's, to be removed:
        a link (no writer of ours makes one: removing it removes the link, never its target), or a
        file whose writer is gone (`_writer_gone`). Off local disk, nothing writes temporaries."""
        if not self.is_local:
            return True
        dfd, base = self._parent_fd(name)
        try:
            return stat.S_ISLNK(os.lstat(base, dir_fd=dfd).st_mode) or _writer_gone(dfd, base)
        except FileNotFoundError:
            return False  # renamed or removed meanwhile: nothing left to remove
        finally:
            os.close(dfd)

    # --- exclusive creation and conditional replacement (the trainer lock) ----------------------

    def read_versioned(self, name: str) -> tuple[bytes, Version]:
        """A file's bytes and the version they are, read as one (ABSENT if there is no such file):
        what `replace_if_unchanged` takes as `expect`."""
        return self._read_versioned(name)

    def create_exclusive(self, name: str, data: bytes) -> Version:
        """Publish `name` only if no file of that name exists, atomically: of any number of processes
        racing to create it, exactly one succeeds and the others get FileExistsError.

          local disk   the bytes are written and fsynced under a temporary name, then hard-linked
                       to the final name (link(2) fails if the name exists: O_EXCL for a whole file);
          S3           one put with If-None-Match: * (a lost reply is resolved by s3_put);
          others       check then put, made exclusive only among this process's threads (the memory
                       filesystem of the tests lives in one process)."""
        final = self.path(name)
        if self.is_local:
            return Version(self._create_local(name, data), _sha256(data))
        if self.is_s3:
            try:
                return self._put(name, data, expect=ABSENT)
            except ConcurrentWriteError:
                raise FileExistsError(errno.EEXIST, "already exists", final) from None
        with _IN_PROCESS:
            if self.fs.exists(final):
                raise FileExistsError(errno.EEXIST, "already exists", final)
            self.fs.pipe_file(final, data)
            return Version(len(data), _sha256(data))

    def replace_if_unchanged(self, name: str, data: bytes, expect: Version) -> Version:
        """Replace `name` with `data` only if it is still exactly version `expect` (as read by
        `read_versioned`), else ConcurrentWriteError: of two processes replacing the same version,
        one wins. Local disk: compare and rename under flock(2) of the directory; S3: If-Match."""
        final = self.path(name)
        if self.is_s3:
            return self._put(name, data, expect=expect)
        if self.is_local:
            self._replace_local_if_unchanged(name, data, expect)
            return Version(len(data), _sha256(data))
        with _IN_PROCESS:
            held, version = self._read_versioned(name)
            if not version.exists or version.etag != expect.etag:
                raise ConcurrentWriteError(f"{final} changed since this process read it; not replacing it")
            self.fs.pipe_file(final, data)
        return Version(len(data), _sha256(data))

    # --- publishing, per kind of filesystem ---------------------------------------------------

    def _put(self, name: str, parts: Buffer | Iterable[Buffer], expect: Version | None = None) -> Version:
        """Publish `name` atomically; with `expect`, only over that version of it (else raise
        ConcurrentWriteError). Returns the version published."""
        final = self.path(name)
        fence = self._fence_of(name)
        views = _byte_views(parts)
        if self.is_local:
            return Version(self._write_local(name, views, fence))
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_put, self.fs, final, views, expect, fence)
        if fence is not None:  # no conditional puts here: checked before, compared after (verify)
            fence()
        if expect is not None:
            self._check_unchanged(name, expect)
        data = b"".join(views)
        self.fs.pipe_file(final, data)
        if self.fence is not None and name != LOCK:
            self.fence.verify(name)  # no conditional puts here: compare after the write
        return Version(len(data))

    def _extend(self, name: str, data: bytes, expect: Version) -> Version:
        """Publish `data` over version `expect` of `name`, its first expect.size bytes (an append-only
        file grown since), else ConcurrentWriteError. On S3, once the published file is a part's worth,
        only the new tail is uploaded (objstore.s3_extend); elsewhere, and below that, it is put whole."""
        if not (self.is_s3 and objstore.extendable(expect, len(data))):
            return self._put(name, data, expect=expect)
        fence = self._fence_of(name)
        return fsspec.asyn.sync(
            self.fs.loop, objstore.s3_extend, self.fs, self.path(name), data, expect, fence
        )

    def _read_versioned(self, name: str) -> tuple[bytes, Version]:
        """A file's bytes and the version they are, read as one (ABSENT if there is no such file)."""
        try:
            if self.is_s3:
                data, etag = self._s3_read(name, _bound_of(name))
                return data, Version(len(data), etag)
            data = self.read_bounded(name, _bound_of(name))
        except FileNotFoundError:
            return b"", ABSENT
        return data, Version(len(data), _sha256(data))

    def _check_unchanged(self, name: str, expect: Version) -> None:
        # Without conditional puts this is check-then-act; the trainer's lock makes it enough for
        # .loss.json, and forks.jsonl retries.
        exists = self.exists(name)
        if exists != expect.exists or (exists and self.size(name) != expect.size):
            raise ConcurrentWriteError(
                f"{self.path(name)} changed since this process read it ({expect.size} bytes); "
                "not replacing it"
            )

    def _write_local(
        self, name: str, views: Iterable[memoryview], fence: objstore.Fence | None = None
    ) -> int:
        """Write under an unguessable temporary name (O_EXCL, O_NOFOLLOW), fsync, rename over `name`
        (refused if `name` is a symlink), fsync the folder. `fence` is checked once the temporary file
        exists: a trainer taking the run over removes it (abort_writes_in_flight), and the rename fails."""
        dfd, base = self._parent_fd(name, create=True)
        try:
            self._refuse_link(dfd, base, name)
            tmp, fd = _create_temp(dfd, base, _mode(name))
            size = 0
            try:
                with open(fd, "wb", closefd=True) as f:  # its flock held to the rename (_create_temp)
                    if fence is not None:
                        fence()
                    for view in views:
                        size += f.write(view)
                    f.flush()
                    os.fsync(f.fileno())
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
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            os.fsync(dfd)
            return size
        finally:
            os.close(dfd)

    def _replace_local_if_unchanged(self, name: str, data: bytes, expect: Version) -> None:
        """Compare-and-replace on local disk: the bytes are written and fsynced under a temporary name
        first; under the folder's flock only the compare and the rename remain, each checked against
        the time bound (see _DirectoryLock). Never through a symlink (the path layer)."""
        final = self.path(name)
        dfd, base = self._parent_fd(name, create=True)
        try:
            self._refuse_link(dfd, base, name)
            tmp, fd = _create_temp(dfd, base, _mode(name))
            try:
                with open(fd, "wb", closefd=True) as f:  # its flock held to the rename (_create_temp)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                    with _DirectoryLock(dfd) as guard:
                        try:
                            held = self.read_bounded(name)
                        except FileNotFoundError:
                            held = None
                        if held is None or _sha256(held) != expect.etag:
                            raise ConcurrentWriteError(
                                f"{final} changed since this process read it; not replacing it"
                            )
                        if not guard.within_bound():
                            raise ConcurrentWriteError(
                                f"{final}: this process was paused for {time.monotonic() - guard.since:.1f}s "
                                "while replacing it (another may have replaced it meanwhile); "
                                "not replacing it"
                            )
                        os.replace(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
                        if not guard.within_bound():
                            raise ReplacePaused(
                                f"{final}: this process was paused for {time.monotonic() - guard.since:.1f}s "
                                "while replacing it: a waiter may have replaced it meanwhile, and been "
                                "overwritten"
                            )
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _create_local(self, name: str, data: bytes) -> int:
        """Write `data` durably under a temporary name, then link it to `name` (fails if it exists,
        even as a symlink: link(2) never follows the new name)."""
        dfd, base = self._parent_fd(name, create=True)
        try:
            tmp, fd = _create_temp(dfd, base, _mode(name))
            try:
                with open(fd, "wb", closefd=True) as f:  # its flock held to the link (_create_temp)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                    os.link(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
            os.fsync(dfd)
            return len(data)
        finally:
            os.close(dfd)

    # --- checkpoints ---------------------------------------------------------------------------

    def checkpoint_steps(self, warn: Callable[[str], None] | None = None) -> list[int]:
        """Steps of every file named like a checkpoint, oldest first (valid or not). Only canonical
        names count (checkpoint_name); a stray spelling such as step_0000350.bin is never listed, so
        nothing reads, moves or deletes it: `warn` hears of each one."""
        steps = []
        for name in self.listdir():
            step = step_from_name(name)
            if step is not None:
                steps.append(step)
            elif warn is not None and is_stray_checkpoint_name(name):
                warn(
                    f"warning: ignoring {self.path(name)}: not a canonical checkpoint name "
                    "(step_NNNNNN.bin, six digits below step 1,000,000); it is left as it is"
                )
        return sorted(steps)

    def read_checkpoint(self, step: int, n_params: int | None = None, folder: str = "") -> Checkpoint:
        """Checkpoint `step` of the run (or of its subfolder `folder`: a closed phase's archive), whole
        and validated; CheckpointError names the file and what is wrong with it."""
        name = f"{folder}/{checkpoint_name(step)}" if folder else checkpoint_name(step)
        path = self.path(name)
        try:
            if self.is_local:
                data = self._read_checkpoint_local(name)
            elif self.is_s3:
                check = functools.partial(_check_checkpoint_header, path)
                get = objstore.s3_get_checked
                data = fsspec.asyn.sync(self.fs.loop, get, self.fs, path, HEADER.size, check)
            else:
                size = self.fs.size(path)
                header = self.fs.cat_file(path, start=0, end=HEADER.size) if size else b""
                _check_checkpoint_header(path, header, size)
                data = header if size <= HEADER.size else self.fs.cat_file(path, start=0, end=size)
        except FileNotFoundError:
            raise CheckpointError(path, NO_SUCH_CHECKPOINT) from None
        except ConcurrentWriteError as e:  # written again as it was read (S3): not one version, refused
            raise CheckpointError(path, str(e).removeprefix(f"{path}: ")) from None
        except UnsafeRunPath as e:
            raise CheckpointError(path, str(e).removeprefix(f"{path}: ")) from None
        try:
            return decode(data, name, n_params)
        except CheckpointError as e:
            raise CheckpointError(self.path(name), e.problem) from None

    def _read_checkpoint_local(self, name: str) -> bytes:
        fd = self._open_local(name, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeRunPath(f"{self.path(name)}: not a regular file; not read")
            os.set_blocking(fd, True)
            header = os.pread(fd, HEADER.size, 0)
            _check_checkpoint_header(self.path(name), header, st.st_size)
            return read_bounded(f, max(st.st_size, HEADER.size), self.path(name))

    def newest_valid_checkpoint(self, n_params: int | None = None, warn=None) -> Checkpoint | None:
        """The newest checkpoint that passes validation; bad ones are reported, never deleted."""
        for step in reversed(self.checkpoint_steps(warn=warn)):
            try:
                return self.read_checkpoint(step, n_params)
            except CheckpointError as e:
                if warn is not None:
                    warn(f"refusing checkpoint {e}; trying the previous one")
        return None


class AppendFile:
    """An append-only local file: `write` never seeks, and `durable` fsyncs before returning.

    Unbuffered, so that this object knows exactly which bytes reached the file: on a full disk a write
    raises with the bytes that did not fit kept here, in order, and the next write sends them first.
    The file then only ever ends in a torn line (readers skip it), which the next write completes."""

    def __init__(
        self,
        path: str,
        fenced: Callable[[], None] | None = None,
        opener: Callable[[str, int], int] | None = None,
        lines: bool = True,
    ):
        self.path = path
        self._fenced = fenced  # the holder's lease check (RunDir._fenced), before every append
        # opener: RunDir's, which refuses a symlink (O_NOFOLLOW) and opens read-write for read().
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
        try:
            size = os.fstat(self._f.fileno()).st_size
            return os.pread(self._f.fileno(), 1, size - 1) if size else b""
        except OSError:  # opened write-only (no opener): read it by name, as before
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return b""
                f.seek(-1, os.SEEK_END)
                return f.read(1)

    def write(self, data: bytes, durable: bool = False) -> None:
        with self._lock:
            self._pending += data
        if self._fenced is not None:
            # A fence that cannot confirm the lease now refuses like a full disk: the bytes stay pending.
            self._fenced()
        with self._lock:
            while self._pending:
                written = self._f.write(self._pending) or 0  # raises OSError (ENOSPC) with nothing written
                self._pending = self._pending[written:]
            if durable:
                os.fsync(self._f.fileno())
                if not self._name_durable:  # a power cut would lose a new file with its lines
                    _fsync_dir(os.path.dirname(self.path))
                    self._name_durable = True

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MirroredAppendFile:
    """An append-only file on a store without append. Writes go to a mirror in the run cache, which
    starts as a copy of the published file (never from an older mirror: the run is the truth, and
    another machine may have extended it). A durable write publishes the whole mirror atomically, and
    only over the version this handle last published, so the published file only grows (on S3, past a
    part's worth, the store copies the published prefix and only the new tail is sent: RunDir._extend).
    The mirror is this process's own (two forks of one parent may append at once), held under its
    flock while open, and removed at a clean close. One a crash leaves behind holds only a tail that
    was never published (a resume reads the run, never a mirror): the next open of the file on this
    machine removes it, once its process is gone and no one holds its flock, so that a run's crashes
    over weeks do not pile up copies of its loss log in the cache."""

    def __init__(self, run: RunDir, name: str, lines: bool = True):
        self.run = run
        self.name = name
        data, self._version = run._read_versioned(name)
        self.path = run.cache_path(f"{name}.{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: the cache folder is this machine's, but a link planted there is not written through.
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        self._f = open(os.open(self.path, flags, 0o600), "w+b")
        with contextlib.suppress(OSError):  # held by an earlier handle of this process: held all the same
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _remove_dead_mirrors(self.path)
        self._f.write(data)
        self._f.flush()
        self._size = len(data)
        self._torn_end = _line_end(data[-1:]) if lines else b""  # ends a torn last line, with the first write
        # The trainer appends on its thread while the checkpoint writer publishes on its own.
        self._lock = threading.Lock()

    def read(self) -> bytes:
        with self._lock:
            return self._read_locked()

    def _read_locked(self) -> bytes:
        # A separate handle: seeking the shared one would move where the next append lands.
        with open(self.path, "rb") as f:
            return f.read(self._size)

    def write(self, data: bytes, durable: bool = False) -> None:
        with self._lock:
            data, self._torn_end = self._torn_end + data, b""
            self._f.write(data)
            self._f.flush()
            self._size += len(data)
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
            self._version = self.run._extend(self.name, mirror, self._version)
        except ConcurrentWriteError:
            # An earlier publish of ours may have reached the store although its call failed (a lost
            # reply): then the store holds a prefix of the mirror, at least as long as the version we
            # know, and the file still only grows if we go on from it. Anything else is foreign.
            held, version = self.run._read_versioned(self.name)
            known = self._version.size if self._version.exists else 0
            if not (version.exists and len(held) >= known and mirror.startswith(held)):
                raise
            self._version = version
            if len(held) < len(mirror):
                self._version = self.run._extend(self.name, mirror, version)

    def close(self) -> None:
        with self._lock:
            published = self._size == self._version.size
            self._f.close()
        if published:
            self.path.unlink()

    def __enter__(self) -> MirroredAppendFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_dead_mirrors(own: Path) -> None:
    """Remove the other mirrors of `own`'s file (`<name>.<pid>` beside it) whose writer is gone
    (`_writer_gone`); a link planted among them is not followed, and not removed."""
    stem = own.name.rsplit(".", 1)[0]
    dfd = os.open(own.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for other in own.parent.iterdir():
            pid = other.name[len(stem) + 1 :]
            if (
                other != own
                and other.name.startswith(stem + ".")
                and pid.isdigit()
                and _writer_gone(dfd, other.name)
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(other.name, dir_fd=dfd)
    finally:
        os.close(dfd)


def _writer_gone(dfd: int, name: str) -> bool:
    """Whether the writer of file `name` in folder `dfd` is gone: the file is a regular one (not a
    link), its flock is free, and then the pid its name ends with (`.PID`, or `.PID.RANDOM` for a
    temporary) is no live process here (signals.process_start_ticks). Writers hold the flock from
    just after they create the file to its rename or close (`_create_temp`, MirroredAppendFile).
    Both checks, because a folder shared with another pid namespace names its writers by pids that
    mean nothing here (their flock says they live), and a writer of this namespace between its
    create and its flock is a live pid (looked at after the flock is taken, so one that created the
    file before it is seen)."""
    pid = TEMP_RE.fullmatch(name)
    pid = int(pid.group(1)) if pid else int(name.rsplit(".", 1)[1])
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


def _sha256(data: bytes) -> str:
    # The version of a file on a store without ETags: its content (the same bytes are the same version).
    return hashlib.sha256(data).hexdigest()


# Serialises check-then-act on filesystems that offer nothing better, among this process's threads.
_IN_PROCESS = threading.Lock()


class ReplacePaused(ConcurrentWriteError):
    """A compare-and-replace on local disk ran past its time bound after its rename: this process was
    paused in it, and a waiter may have replaced the file meanwhile, so what it replaced is not known."""


# The compare-and-replace's time bounds on local disk (issue 23.5). Its critical section is a read of a
# small file and a rename (the new bytes are fsynced before it): a holder longer than HOLD_S was paused
# there (SIGSTOP, a frozen VM). A waiter polls the flock for WAIT_S > HOLD_S, then goes on without it,
# so that no paused process blocks a takeover for longer; the paused one, when it runs again, finds its
# bound exceeded and either writes nothing (before its rename) or reports ReplacePaused (after it).
REPLACE_HOLD_S, REPLACE_WAIT_S = 1.0, 2.5
TEST_HOLD_ENV = "ANDREA_TEST_REPLACE_HELD"  # tests only: a file created while the flock is held


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
        deadline = time.monotonic() + REPLACE_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.guarded = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break  # its holder is paused past its own bound: it will write nothing now
                time.sleep(0.01)
        self.since = time.monotonic()
        held = os.environ.get(TEST_HOLD_ENV)
        if held:
            with open(held, "a"):
                pass
            time.sleep(REPLACE_HOLD_S / 2)
        return self

    def within_bound(self) -> bool:
        return time.monotonic() - self.since < REPLACE_HOLD_S

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing drops the flock


def _check_checkpoint_header(path: str, header: bytes, size: int) -> None:
    # The header first: a file whose size is not the 8 + 12 n its header promises is refused before
    # its body is read (a 3 GiB file claiming n = 1 would otherwise be read whole).
    if len(header) == HEADER.size:
        n = HEADER.unpack(header)[1]
        if n > 0 and size != expected_size(n):
            raise CheckpointError(path, f"{size} bytes where 8 + 12*{n} = {expected_size(n)} are required")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
SECRET_FILES = (LOCK,)  # the lock holds the trainer's nonce: readable by its owner only


def _bound_of(name: str) -> str:
    """The limit (config.LIMITS) a run file is read under: the loss log's, or any sidecar's."""
    return "ANDREA_MAX_LOSS_LOG_BYTES" if name == LOSS_LOG else "ANDREA_MAX_SIDECAR_BYTES"


def _mode(name: str) -> int:
    return 0o600 if name in SECRET_FILES else 0o666  # 0o666 less the umask, as open() makes files


def _create_temp(dfd: int, base: str, mode: int) -> tuple[str, int]:
    """(name, fd) of a new temporary file beside `base` in folder `dfd`: `.BASE.tmp.PID.RANDOM`,
    created with O_EXCL and O_NOFOLLOW, so nothing planted in advance is ever written through. The fd
    holds the file's flock: keep it open until the rename, so that no lock holder's
    `discard_incomplete_writes` takes the write for a dead one's (`_writer_gone`)."""
    if os.environ.get(TEST_FIXED_TEMPS_ENV):
        tmp = f".{base}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode, dir_fd=dfd)
    else:
        tmp = f".{base}.tmp.{os.getpid()}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: a sweep that looks at it holds it only for a moment
    except OSError:
        os.close(fd)
        raise
    return tmp, fd


def _makedirs_durable(folder: str) -> None:
    """os.makedirs, each folder it makes fsynced into its parent (a power cut loses it otherwise)."""
    if not os.path.isdir(folder):
        _makedirs_durable(os.path.dirname(os.path.abspath(folder)))
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder)
            _fsync_dir(os.path.dirname(os.path.abspath(folder)))


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the directory entry is: without this a power cut can lose it.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
