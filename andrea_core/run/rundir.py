"""The run directory (contract), addressed by a path or a URL: the one path layer.

Every read and write of a run directory goes through `RunDir`, which talks to the run's store
(run/store.py: local disk, S3, or memory), chosen once when the run is opened (`open_store`); nothing
here or above asks which one it is. Files appear under their final names only whole:

  local disk      temporary name, fsync, rename, fsync of the directory;
  S3              one PUT, or a multipart upload that is either completed or aborted, so that a failed
                  upload leaves neither an object nor billed parts;
  memory          one assignment, under one lock of this process.

Other fsspec protocols (gcs, az, ...) are refused for a run directory, naming the URL: without a
conditional put tested on a real server of that kind, the lease could fence nothing there. They
remain readable through the URL gate (corpora, tokenizers).

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
symlink planted below the root is refused, naming it, never followed; a file appended to in place with
more than one link (a hard link to a file outside the run) is refused the same way; temporary names
carry a random suffix and are created with O_EXCL. And it holds the URL gate (`url_to_fs`,
`open_url`): every fsspec URL the project opens passes the protocol allow-list there first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from andrea_core import faults
from andrea_core.checkpoint import (
    HEADER,
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    decode,
    is_stray_checkpoint_name,
    size_problem,
    step_from_name,
)
from andrea_core.config import ConfigError, limit
from andrea_core.run import objstore
from andrea_core.run.objstore import ConcurrentWriteError, Version
from andrea_core.run.store import (  # noqa: F401 (re-exported: the path layer's names)
    TEMP_RE,
    AppendHandle,
    Buffer,
    LocalStore,
    MemoryStore,
    ReplacePaused,
    S3Store,
    Store,
    UnsafeRunPath,
    byte_views,
    check_name,
)

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
RUN_DIR_PROTOCOLS = {"file", "local", "s3", "s3a", "memory"}  # open_store
RUN_DIR_SCHEMES = ("a local path", "file://", "s3://", "s3a://", "memory://")  # open_store
# The name of the fixed-temporary-names hook, for tests/test_async_checkpoint.py (new tests import
# andrea_core.faults, where every test hook lives).
TEST_FIXED_TEMPS_ENV = faults.FIXED_TEMP_NAMES
# A run URL may come from someone else (a Prefect parameter, a forks.jsonl line): only the filesystems
# a run directory lives on, never http(s), ftp or anything else that would make this process a client
# of internal addresses. A plain path is "file". ANDREA_ALLOWED_PROTOCOLS (comma-separated) replaces it.
DEFAULT_ALLOWED_PROTOCOLS = ("file", "local", "s3", "s3a", "gcs", "gs", "az", "abfs", "memory")


def cache_dir() -> Path:
    """This machine's cache (token caches, append mirrors): ANDREA_CACHE_DIR or ~/.cache/andrea."""
    return Path(os.environ.get("ANDREA_CACHE_DIR") or Path.home() / ".cache" / "andrea")


class ProtocolNotAllowed(ConfigError):
    """A URL over a protocol outside the allow-list (see check_protocol)."""


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


def open_store(url: str | os.PathLike) -> Store:
    """The store of run directory `url`, after the URL gate: local disk (a path, file://), S3 (s3://,
    s3a://) or memory (memory://, one process's). Any other protocol is refused, naming the URL and
    the ones a run directory may live on."""
    url = os.fspath(url)
    check_protocol(url, "run directory URL")  # the gate's refusal first (it never names the URL)
    protocol = (fsspec.core.split_protocol(url)[0] or "file").lower()
    if "::" in url or protocol not in RUN_DIR_PROTOCOLS:
        raise ConfigError(
            f"{url}: a run directory cannot live on {protocol}{' (a chained URL)' if '::' in url else ''} "
            f"(supported: {', '.join(RUN_DIR_SCHEMES)}): its lease needs a conditional put, which is "
            "implemented and tested for those alone"
        )
    # Other processes (the trainer, the flows, the CLI) change a run directory under our feet: a
    # cached listing would hide a new checkpoint or show a deleted one.
    fs, root = url_to_fs(url, "run directory URL", use_listings_cache=False)
    root = root.rstrip("/") or "/"
    if isinstance(fs, LocalFileSystem):
        return LocalStore(fs, root)
    return S3Store(fs, root) if protocol in S3_PROTOCOLS else MemoryStore(fs, root)


# The problem of a CheckpointError for a checkpoint that is not there (a reader may look elsewhere).
NO_SUCH_CHECKPOINT = "no such file"


class RunDir:
    def __init__(self, url: str | os.PathLike):
        self.store = open_store(url)
        self.fs, self.root = self.store.fs, self.store.root
        # The canonical address: what lineage, forks.jsonl and Prefect parameters record.
        self.url = self.store.url
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
        return self.store.path(name)

    def cache_path(self, name: str) -> Path:
        """This machine's scratch copy of a run file (the append mirrors): rebuilt from the run when
        missing, so a machine that never saw the run needs nothing but its URL."""
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return cache_dir() / "runs" / f"{posixpath.basename(self.root)}-{key}" / name

    # --- plain files -------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return self.store.exists(name)

    def read_bytes(self, name: str) -> bytes:
        """A run file's bytes, bounded like every run file read (read_bounded); checkpoints, whose
        size their header checks (read_checkpoint), by nothing but that."""
        if step_from_name(name.rsplit("/", 1)[-1]) is not None:
            return self.store.read(name, None, "")
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
        this machine's memory, or on an object store its bandwidth. The bytes are counted as they
        arrive (a sparse file or /dev/zero behind the name, a store that lies about a size: refused at
        the bound)."""
        bound = bound or "ANDREA_MAX_SIDECAR_BYTES"
        return self.store.read(name, limit(bound), bound)

    def read_tail(self, name: str, most: int) -> tuple[bytes, int]:
        """The last `most` bytes of run file `name` (all of it when shorter) and the offset they start
        at: a reader that needs the end of a long log reads that, never the whole of it."""
        return self.store.read_tail(name, most)

    def size(self, name: str) -> int:
        return self.store.size(name)

    def makedirs(self, sub: str = "") -> None:
        self.store.makedirs(sub)

    def listdir(self, sub: str = "") -> list[str]:
        """Names (not paths) of the entries in the run directory or one of its subfolders (locally,
        a subfolder reached through a symlink is refused)."""
        return self.store.listdir(sub)

    def write_atomic(self, name: str, parts: Buffer | Iterable[Buffer]) -> None:
        """Publish `name` whole or not at all; a reader never sees a torn file under a final name."""
        self._put(name, parts)

    def log_path(self, name: str) -> str:
        """Where a subprocess's output kept as run file `name` (a detached trainer's) is appended: the
        run file on local disk; on a store with no appends, this machine's cache of the run."""
        return self.store.log_path(name, self.cache_path(name))

    def open_log(self, name: str) -> Any:
        """log_path(name) opened for appending, never through a symlink or a hard link: a binary
        file object whose fileno() a subprocess can write to."""
        return self.store.open_log(name, self.cache_path(name))

    def write_text(self, name: str, text: str) -> None:
        self.write_atomic(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        self.write_atomic(name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())

    def open_append(self, name: str, lines: bool = True) -> AppendHandle:
        """`lines`: a JSON Lines file, whose torn last line is ended before the first new byte; False for
        a file of binary records (TensorBoard's events), which is appended to byte for byte."""
        fence_of = functools.partial(self._fence_of, name)
        return self.store.open_append(name, lines, fence_of, self.cache_path(name), _bound_of(name))

    def append(
        self, name: str, data: bytes, durable: bool = False, attempts: int = 5, lines: bool = True
    ) -> None:
        for attempt in range(attempts):
            try:
                with self.open_append(name, lines) as f:
                    f.write(data, durable=durable or not f.in_place)
                return
            except ConcurrentWriteError:
                # Another process published between our read and our put (two forks of one parent
                # at once): read its version and append to that.
                if attempt == attempts - 1:
                    raise

    def move(self, src: str, dst: str) -> None:
        self.path(src), self.path(dst)  # both names checked before anything moves
        self._fenced(dst)
        self.store.move(src, dst)

    def remove(self, name: str) -> None:
        self._fenced(name)
        self.store.remove(name)

    def root_exists(self) -> bool:
        """Whether the run directory itself is there (on an object store: whether anything is under it)."""
        return self.store.root_exists()

    def remove_root_if_empty(self) -> None:
        """Remove the run directory itself if it is empty (local disk; object stores have no folders)."""
        self.store.remove_root_if_empty()

    def remove_folder(self, sub: str) -> None:
        """Remove an empty folder of the run (local disk; object stores have no folders)."""
        self.store.remove_folder(sub)

    def discard_incomplete_writes(self, log: Callable[[str], None] = print) -> list[str]:
        """Clear what a killed writer left half-done: temporary files, and on S3 the parts of
        multipart uploads that were never completed (invisible, but stored and billed). Only the
        holder of the run's lock may call this. A temporary file is a dead writer's only once its flock
        is free and its pid is no live process here (`store._writer_gone`): processes that do not hold
        the lock write in the run too (a trainer racing for `.trainer.json`, a pivot writing its
        journal), and their writes in flight are theirs to finish."""
        return self.store.discard_incomplete_writes(log, self.remove)

    def abort_writes_in_flight(self, writer_pid: int, log: Callable[[str], None] = print) -> list[str]:
        """Undo the unfinished writes of a lease holder that is being taken over (lock.acquire_lease,
        after its lease expired and before the takeover write): on S3 every unfinished upload of the
        run (a fenced publish is one), on local disk the temporary files its pid named in the run's
        folder, live or not. Its publish then fails (the upload's complete, the rename) instead of
        landing after the takeover; one it starts later meets its fence past the free window
        (RunDir._fence_of). `writer_pid` is the pid the holder's lock records, in its own namespace:
        a process of this namespace with the same number loses its write in flight too (it fails and
        can be run again; nothing published is touched)."""
        return self.store.abort_writes_in_flight(writer_pid, log, self.remove)

    def is_dead_temporary(self, name: str) -> bool:
        """Whether run file `name`, named as a temporary (TEMP_RE), is a dead writer's, to be removed:
        a link (no writer of ours makes one: removing it removes the link, never its target), or a
        file whose writer is gone. On a store that writes no temporaries, always."""
        return self.store.is_dead_temporary(name)

    # --- exclusive creation and conditional replacement (the trainer lock) ----------------------

    def read_versioned(self, name: str) -> tuple[bytes, Version]:
        """A file's bytes and the version they are, read as one (ABSENT if there is no such file):
        what `replace_if_unchanged` takes as `expect`."""
        return self._read_versioned(name)

    def create_exclusive(self, name: str, data: bytes) -> Version:
        """Publish `name` only if no file of that name exists, atomically: of any number of processes
        racing to create it, exactly one succeeds and the others get FileExistsError (local disk:
        link(2) of a written temporary; S3: If-None-Match: *; memory: under this process's lock)."""
        self.path(name)
        return self.store.create_exclusive(name, data, _mode(name))

    def replace_if_unchanged(self, name: str, data: bytes, expect: Version) -> Version:
        """Replace `name` with `data` only if it is still exactly version `expect` (as read by
        `read_versioned`), else ConcurrentWriteError: of two processes replacing the same version,
        one wins (local disk: compare and rename under flock(2) of the directory; S3: If-Match;
        memory: under this process's lock)."""
        self.path(name)
        return self.store.replace_if_unchanged(name, data, expect, _mode(name))

    def _put(self, name: str, parts: Buffer | Iterable[Buffer], expect: Version | None = None) -> Version:
        """Publish `name` atomically; with `expect`, only over that version of it (else raise
        ConcurrentWriteError). Returns the version published."""
        self.path(name)
        return self.store.put(name, byte_views(parts), expect, self._fence_of(name), _mode(name))

    def _extend(self, name: str, data: bytes, expect: Version) -> Version:
        """Publish `data` over version `expect` of `name`, its first expect.size bytes (an append-only
        file grown since), else ConcurrentWriteError (on S3 only the new tail travels)."""
        return self.store.extend(name, data, expect, self._fence_of(name))

    def _read_versioned(self, name: str) -> tuple[bytes, Version]:
        bound = _bound_of(name)
        return self.store.read_versioned(name, limit(bound), bound)

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
            check = functools.partial(_check_checkpoint_header, path)
            data = self.store.read_checkpoint(name, HEADER.size, check)
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

    def newest_valid_checkpoint(self, n_params: int | None = None, warn=None) -> Checkpoint | None:
        """The newest checkpoint that passes validation; bad ones are reported, never deleted."""
        for step in reversed(self.checkpoint_steps(warn=warn)):
            try:
                return self.read_checkpoint(step, n_params)
            except CheckpointError as e:
                if warn is not None:
                    warn(f"refusing checkpoint {e}; trying the previous one")
        return None


def _check_checkpoint_header(path: str, header: bytes, size: int) -> None:
    # The header first: a file whose size is not the 8 + 12 n (+ 8, the checksum trailer) its header
    # promises is refused before its body is read (a 3 GiB file claiming n = 1 would be read whole).
    if len(header) == HEADER.size:
        n = HEADER.unpack(header)[1]
        if n > 0 and (problem := size_problem(size, n)):
            raise CheckpointError(path, problem)


SECRET_FILES = (LOCK,)  # the lock holds the trainer's nonce: readable by its owner only


def _bound_of(name: str) -> str:
    """The limit (config.LIMITS) a run file is read under: the loss log's, or any sidecar's."""
    return "ANDREA_MAX_LOSS_LOG_BYTES" if name == LOSS_LOG else "ANDREA_MAX_SIDECAR_BYTES"


def _mode(name: str) -> int:
    return 0o600 if name in SECRET_FILES else 0o666  # 0o666 less the umask, as open() makes files
