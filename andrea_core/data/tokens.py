"""Tokenizers and per-arm token caches (uint16, memory-mapped, built once, rebuilt on change)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from andrea_core.data.sources import Source

DOC_SEPARATOR = "\n\n"


class Tokenizer(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Raw UTF-8 bytes: vocabulary 256, nothing to train or freeze."""

    id = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def cache_dir() -> Path:
    return Path(os.environ.get("ANDREA_CACHE_DIR") or Path.home() / ".cache" / "andrea")


def token_cache(source: Source, tokenizer: Tokenizer) -> np.ndarray:
    """The arm's tokens as a read-only uint16 memmap; built on first use, atomically."""
    key = hashlib.sha256(f"{source.fingerprint}|{tokenizer.id}".encode()).hexdigest()[:16]
    path = cache_dir() / f"{source.arm.name}-{key}.u16"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        ids: list[int] = []
        for doc in source.documents():
            ids.extend(tokenizer.encode(doc + DOC_SEPARATOR))
        if len(ids) < 1024:
            raise ValueError(f"arm {source.arm.name!r}: only {len(ids)} tokens of text")
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        os.replace(tmp, path)  # concurrent builders produce identical files; last rename wins
    return np.memmap(path, dtype=np.uint16, mode="r")
