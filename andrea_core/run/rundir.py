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
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import posixpath
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

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

RUN_YAML = "run.yaml"
POLICY_YAML = "policy.yaml"
TOKENIZER_JSON = "tokenizer.json"  # a BPE run's tokenizer, frozen when the run is created
LOSS_LOG = ".loss.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
LOCK = ".trainer.json"
FORKS = "forks.jsonl"
ARCHIVE = "archive"
REFUSED = "refused"  # checkpoints that failed validation, set aside at resume

S3_PROTOCOLS = {"s3", "s3a"}
# A run URL may come from someone else (a Prefect parameter, a forks.jsonl line): only the filesystems
# a run directory lives on, never http(s), ftp or anything else that would make this process a client
# of internal addresses. A plain path is "file". ANDREA_ALLOWED_PROTOCOLS (comma-separated) replaces it.
DEFAULT_ALLOWED_PROTOCOLS = ("file", "local", "s3", "s3a", "gcs", "gs", "az", "abfs", "memory")
TEMP_RE = re.compile(r"^\..+\.tmp\.(\d+)$")  # `.NAME.tmp.PID`: a write in progress, or a dead writer's

Buffer = bytes | bytearray | memoryview


def cache_dir() -> Path:
    """This machine's cache (token caches, append mirrors): ANDREA_CACHE_DIR or ~/.cache/andrea."""
    return Path(os.environ.get("ANDREA_CACHE_DIR") or Path.home() / ".cache" / "andrea")


class ProtocolNotAllowed(ConfigError):
    """A run URL over a protocol outside the allow-list (see check_protocol)."""


def allowed_protocols() -> list[str]:
    raw = os.environ.get("ANDREA_ALLOWED_PROTOCOLS")
    if raw is None or not raw.strip():
        return sorted(DEFAULT_ALLOWED_PROTOCOLS)
    return sorted({p.strip().lower() for p in raw.split(",") if p.strip()})


def check_protocol(url: str) -> None:
    """Refuse, before anything is contacted, a URL whose protocol (any link of a chained URL such as
    `simplecache::s3://...`) is not allowed. The error names the protocol, never the URL (it may
    carry credentials)."""
    allowed = allowed_protocols()
    for link in url.split("::"):
        protocol, _ = fsspec.core.split_protocol(link)
        protocol = (protocol or "file").lower()
        if protocol not in allowed:
            raise ProtocolNotAllowed(
                f"run directory URL: protocol {protocol!r} is not allowed (allowed: {', '.join(allowed)}; "
                "set ANDREA_ALLOWED_PROTOCOLS to change the list)"
            )


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def _byte_views(parts: Buffer | Iterable[Buffer]) -> Iterable[memoryview]:
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = [parts]
    # A float32 array's memoryview counts floats, not bytes: cast so every size below is in bytes.
    return (memoryview(p).cast("B") for p in parts)


class RunDir:
    def __init__(self, url: str | os.PathLike):
        url = os.fspath(url)
        check_protocol(url)
        # Other processes (the trainer, the flows, the CLI) change a run directory under our feet: a
        # cached listing would hide a new checkpoint or show a deleted one.
        self.fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_s3 = bool(_protocols(self.fs) & S3_PROTOCOLS)
        # The canonical address: what lineage, forks.jsonl and Prefect parameters record.
        self.url = self.root if self.is_local else self.fs.unstrip_protocol(self.root)
        # The holder's lease (lock.Lease) while a trainer holds the run: every publish, move and delete
        # but the lock's own passes its check first (fencing); None for everyone else.
        self.fence: Any = None

    def _fenced(self, name: str) -> None:
        if self.fence is not None and name != LOCK:
            self.fence.check(name)

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def cache_path(self, name: str) -> Path:
        """This machine's scratch copy of a run file (the append mirrors): rebuilt from the run when
        missing, so a machine that never saw the run needs nothing but its URL."""
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return cache_dir() / "runs" / f"{posixpath.basename(self.root)}-{key}" / name

    # --- plain files -------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

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

    def read_bounded(self, name: str, bound: str = "ANDREA_MAX_SIDECAR_BYTES") -> bytes:
        """A run file's bytes, refused unread (ConfigError naming the file, its size and the bound)
        when larger than the limit `bound` (config.LIMITS): a file from someone else must not take
        this machine's memory, or on an object store its bandwidth."""
        most = limit(bound)
        path = self.path(name)
        size = self.fs.size(path)
        if size is not None:
            check_limit(size, bound, f"{path}: {size} bytes")
        data = self.fs.cat_file(path, start=0, end=most + 1)  # it may have grown since
        check_limit(len(data), bound, f"{path}: more than {most} bytes")
        return data

    def size(self, name: str) -> int:
        return self.fs.size(self.path(name))

    def makedirs(self, sub: str = "") -> None:
        self.fs.makedirs(self.path(sub) if sub else self.root, exist_ok=True)

    def listdir(self, sub: str = "") -> list[str]:
        """Names (not paths) of the entries in the run directory or one of its subfolders."""
        where = self.path(sub) if sub else self.root
        if not self.fs.exists(where):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(where, detail=False))

    def write_atomic(self, name: str, parts: Buffer | Iterable[Buffer]) -> None:
        """Publish `name` whole or not at all; a reader never sees a torn file under a final name."""
        self._put(name, parts)

    def write_text(self, name: str, text: str) -> None:
        self.write_atomic(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        self.write_atomic(name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())

    def open_append(self, name: str) -> AppendFile | MirroredAppendFile:
        if not self.is_local:
            return MirroredAppendFile(self, name)
        return AppendFile(self.path(name), fenced=lambda: self._fenced(name))

    def append(self, name: str, data: bytes, durable: bool = False, attempts: int = 5) -> None:
        for attempt in range(attempts):
            try:
                with self.open_append(name) as f:
                    f.write(data, durable=durable or not self.is_local)
                return
            except ConcurrentWriteError:
                # Another process published between our read and our put (two forks of one parent
                # at once): read its version and append to that.
                if attempt == attempts - 1:
                    raise

    def move(self, src: str, dst: str) -> None:
        self._fenced(dst)
        self.fs.makedirs(posixpath.dirname(self.path(dst)), exist_ok=True)
        self.fs.mv(self.path(src), self.path(dst))
        if self.is_local:
            _fsync_dir(posixpath.dirname(self.path(dst)))
            _fsync_dir(posixpath.dirname(self.path(src)))

    def remove(self, name: str) -> None:
        self._fenced(name)
        self.fs.rm_file(self.path(name))

    def discard_incomplete_writes(self, log: Callable[[str], None] = print) -> list[str]:
        """Clear what a killed writer left half-done: temporary files, and on S3 the parts of
        multipart uploads that were never completed (invisible, but stored and billed). Only the
        holder of the run's lock may call this: to it, every write in progress is a dead one's."""
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_abort_uploads, self.fs, self.root, log)
        discarded = []
        for name in self.listdir():
            m = TEMP_RE.match(name)
            # Our own pid's temporaries are the writes we are about to make (write_atomic truncates).
            if m and int(m.group(1)) != os.getpid():
                self.remove(name)
                discarded.append(name)
                log(f"removed {self.path(name)}, left by a writer that did not finish")
        return discarded

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
            return Version(_create_local(final, data), _sha256(data))
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
            _replace_local_if_unchanged(final, data, expect)
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
        self._fenced(name)
        views = _byte_views(parts)
        if self.is_local:
            return Version(_write_local(final, views))
        if self.is_s3:
            return fsspec.asyn.sync(self.fs.loop, objstore.s3_put, self.fs, final, views, expect)
        if expect is not None:
            self._check_unchanged(name, expect)
        data = b"".join(views)
        self.fs.pipe_file(final, data)
        if self.fence is not None and name != LOCK:
            self.fence.verify(name)  # no conditional puts here: compare after the write
        return Version(len(data))

    def _read_versioned(self, name: str) -> tuple[bytes, Version]:
        """A file's bytes and the version they are, read as one (ABSENT if there is no such file)."""
        try:
            if self.is_s3:
                data, etag = fsspec.asyn.sync(self.fs.loop, objstore.s3_get, self.fs, self.path(name))
                return data, Version(len(data), etag)
            data = self.read_bytes(name)
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

    def read_checkpoint(self, step: int, n_params: int | None = None) -> Checkpoint:
        name = checkpoint_name(step)
        path = self.path(name)
        try:
            # The header first: a file whose size is not the 8 + 12 n its header promises is refused
            # before its body is read (a 3 GiB file claiming n = 1 would otherwise be read whole).
            size = self.fs.size(path)
            header = self.fs.cat_file(path, start=0, end=HEADER.size) if size else b""
            if len(header) == HEADER.size:
                n = HEADER.unpack(header)[1]
                if n > 0 and size != expected_size(n):
                    raise CheckpointError(
                        path, f"{size} bytes where 8 + 12*{n} = {expected_size(n)} are required"
                    )
            data = header if size <= HEADER.size else self.fs.cat_file(path, start=0, end=size)
        except FileNotFoundError:
            raise CheckpointError(path, "no such file") from None
        try:
            return decode(data, name, n_params)
        except CheckpointError as e:
            raise CheckpointError(self.path(name), e.problem) from None

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

    def __init__(self, path: str, fenced: Callable[[], None] | None = None):
        self.path = path
        self._fenced = fenced  # the holder's lease check (RunDir._fenced), before every append
        self._f = open(path, "ab", buffering=0)
        # Bytes accepted by write() that have not reached the file yet; first of all the newline that
        # ends a torn last line, sent with the first record (in one write: never a line of its own).
        self._pending = _line_end(_last_byte(path))
        self._lock = threading.Lock()  # the trainer appends while the checkpoint writer fsyncs

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

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

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MirroredAppendFile:
    """An append-only file on a store without append. Writes go to a mirror in the run cache, which
    starts as a copy of the published file (never from an older mirror: the run is the truth, and
    another machine may have extended it). A durable write publishes the whole mirror with one atomic
    put, and only over the version this handle last published, so the published file only grows.
    The mirror is this process's own (two forks of one parent may append at once) and is removed at
    a clean close; one a crash leaves behind holds the tail that was never published."""

    def __init__(self, run: RunDir, name: str):
        self.run = run
        self.name = name
        data, self._version = run._read_versioned(name)
        self.path = run.cache_path(f"{name}.{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w+b")
        self._f.write(data)
        self._f.flush()
        self._size = len(data)
        self._torn_end = _line_end(data[-1:])  # ends a torn last line, with the first write
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
            self._version = self.run._put(self.name, mirror, expect=self._version)
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
                self._version = self.run._put(self.name, mirror, expect=version)

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


def _last_byte(path: str) -> bytes:
    """The last byte of a local file (b"" if it is empty or absent)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return b""
            f.seek(-1, os.SEEK_END)
            return f.read(1)
    except FileNotFoundError:
        return b""


def _line_end(last: bytes) -> bytes:
    """What an append to a JSON Lines file ending in `last` must send first: a newline after a torn
    line (its own record stays torn and skipped by readers), nothing after a whole one or none."""
    return b"\n" if last and last != b"\n" else b""


def _temp_path(final: str) -> str:
    """The temporary name a local write of `final` goes through (TEMP_RE matches it)."""
    return posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.tmp.{os.getpid()}")


def _write_local(final: str, views: Iterable[memoryview]) -> int:
    folder = posixpath.dirname(final)
    os.makedirs(folder, exist_ok=True)
    tmp = _temp_path(final)
    size = 0
    try:
        with open(tmp, "wb") as f:
            for view in views:
                size += f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return size


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
    """flock(2) on a directory, held for at most REPLACE_HOLD_S and waited for at most REPLACE_WAIT_S:
    serialises the processes of this kernel that compare-and-replace a file in it (renewal, takeover)
    without adding a file to the run directory, and without letting a paused holder block the others."""

    def __init__(self, folder: str):
        self.folder = folder
        self.guarded = False

    def __enter__(self) -> _DirectoryLock:
        self.fd = os.open(self.folder, os.O_RDONLY)
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


def _replace_local_if_unchanged(final: str, data: bytes, expect: Version) -> None:
    """Compare-and-replace on local disk: the bytes are written and fsynced under a temporary name
    first; under the directory's flock only the compare and the rename remain, each checked against
    the time bound (see _DirectoryLock)."""
    folder = posixpath.dirname(final)
    tmp = _temp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with _DirectoryLock(folder) as guard:
            try:
                with open(final, "rb") as f:
                    held = f.read()
            except FileNotFoundError:
                held = None
            if held is None or _sha256(held) != expect.etag:
                raise ConcurrentWriteError(f"{final} changed since this process read it; not replacing it")
            if not guard.within_bound():
                raise ConcurrentWriteError(
                    f"{final}: this process was paused for {time.monotonic() - guard.since:.1f}s while "
                    "replacing it (another may have replaced it meanwhile); not replacing it"
                )
            os.replace(tmp, final)
            if not guard.within_bound():
                raise ReplacePaused(
                    f"{final}: this process was paused for {time.monotonic() - guard.since:.1f}s while "
                    "replacing it: a waiter may have replaced it meanwhile, and been overwritten"
                )
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(folder)


def _create_local(final: str, data: bytes) -> int:
    """Write `data` durably under a temporary name, then link it to `final` (fails if it exists)."""
    folder = posixpath.dirname(final)
    os.makedirs(folder, exist_ok=True)
    tmp = _temp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(folder)
    return len(data)


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the directory entry is: without this a power cut can lose it.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
