"""The run directory (contract), addressed by a path or an fsspec URL.

Every read and write of a run directory goes through `RunDir`, so that where the run lives (local disk,
memory for tests, an object store) is decided here and nowhere else. Files appear under their final
names only whole: locally through temporary name + fsync + rename, elsewhere as one atomic put.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from andrea_core.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    decode,
    step_from_name,
)

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

Buffer = bytes | bytearray | memoryview


class RunDir:
    def __init__(self, url: str | os.PathLike):
        url = os.fspath(url)
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        # The canonical address: what lineage, forks.jsonl and Prefect parameters record.
        self.url = self.root if self.is_local else self.fs.unstrip_protocol(self.root)

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    # --- plain files -------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

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
        if isinstance(parts, (bytes, bytearray, memoryview)):
            parts = [parts]
        final = self.path(name)
        if not self.is_local:
            self.fs.pipe_file(final, b"".join(bytes(p) for p in parts))
            return
        folder = posixpath.dirname(final)
        os.makedirs(folder, exist_ok=True)
        tmp = posixpath.join(folder, f".{posixpath.basename(final)}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)

    def write_text(self, name: str, text: str) -> None:
        self.write_atomic(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        self.write_atomic(name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())

    def open_append(self, name: str) -> AppendFile:
        if not self.is_local:
            raise NotImplementedError(f"append to {self.url}/{name}: not a local run directory")
        return AppendFile(open(self.path(name), "ab"))

    def append(self, name: str, data: bytes, durable: bool = False) -> None:
        with self.open_append(name) as f:
            f.write(data, durable=durable)

    def move(self, src: str, dst: str) -> None:
        self.fs.makedirs(posixpath.dirname(self.path(dst)), exist_ok=True)
        self.fs.mv(self.path(src), self.path(dst))
        if self.is_local:
            _fsync_dir(posixpath.dirname(self.path(dst)))
            _fsync_dir(posixpath.dirname(self.path(src)))

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.path(name))

    # --- checkpoints ---------------------------------------------------------------------------

    def checkpoint_steps(self) -> list[int]:
        """Steps of every file named like a checkpoint, oldest first (valid or not)."""
        steps = (step_from_name(n) for n in self.listdir())
        return sorted(s for s in steps if s is not None)

    def read_checkpoint(self, step: int, n_params: int | None = None) -> Checkpoint:
        name = checkpoint_name(step)
        try:
            data = self.read_bytes(name)
        except FileNotFoundError:
            raise CheckpointError(self.path(name), "no such file") from None
        try:
            return decode(data, name, n_params)
        except CheckpointError as e:
            raise CheckpointError(self.path(name), e.problem) from None

    def newest_valid_checkpoint(self, n_params: int | None = None, warn=None) -> Checkpoint | None:
        """The newest checkpoint that passes validation; bad ones are reported, never deleted."""
        for step in reversed(self.checkpoint_steps()):
            try:
                return self.read_checkpoint(step, n_params)
            except CheckpointError as e:
                if warn is not None:
                    warn(f"refusing checkpoint {e}; trying the previous one")
        return None


class AppendFile:
    """An append-only handle: `write` never seeks, and `durable` fsyncs before returning."""

    def __init__(self, f):
        self._f = f

    def write(self, data: bytes, durable: bool = False) -> None:
        self._f.write(data)
        self._f.flush()
        if durable:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the directory entry is: without this a power cut can lose it.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
