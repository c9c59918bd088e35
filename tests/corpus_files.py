"""A small corpus of every arm kind, written by the tests to each format's published layout, anywhere
fsspec reaches (a local folder, memory://, the moto S3 server):

  text/doc_NNN.txt.gz            one document per file, gzip
  docs.jsonl.zst                 JSON Lines, zstandard, the document in "text"
  table.parquet                  a "text" column in two row groups
  nanogpt/train.bin, val.bin     nanoGPT: raw uint16 tokens
  llmc/corpus_train_000000.bin   llm.c: 256 x int32 header (magic 20240520, version 1, count), uint16
  llmc/corpus_val_000000.bin

The documents are deterministic word salad, so every test sees the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json

import fsspec
import numpy as np

WORDS = (
    "the model reads every shard of the corpus once and the bandit mixes arms under floors and caps while "
    "checkpoints keep weights and moments so that a resumed run sees the same batches bit for bit"
).split()


def document(seed: int, words: int = 120) -> str:
    rng = np.random.default_rng([seed, 7])
    picked = rng.choice(len(WORDS), size=words)
    return f"doc {seed}: " + " ".join(WORDS[i] for i in picked) + "."


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def llmc_shard(
    tokens: np.ndarray, magic: int = 20240520, version: int = 1, count: int | None = None
) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    dtype = "<u2" if magic == 20240520 else "<u4"
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def byte_tokens(seed: int, n: int) -> np.ndarray:
    """Text as byte tokens (ids < 256): what a bytes-tokenizer pipeline of another tool would write."""
    text = " ".join(document(seed * 1000 + i) for i in range(n // 500 + 1))
    return np.frombuffer(text.encode(), np.uint8)[:n].astype(np.uint16)


def put(url: str, data: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(data)


def write_text_folder(root: str, n: int = 40, first: int = 0) -> list[str]:
    docs = []
    for i in range(first, first + n):
        doc = document(i)
        put(f"{root}/text/doc_{i:03d}.txt.gz", gzip.compress(doc.encode(), mtime=0))
        docs.append(doc)
    return docs


def jsonl_bytes(docs: list[str], bad_lines: dict[int, str] | None = None) -> bytes:
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    for i, line in (bad_lines or {}).items():
        lines[i] = line
    return ("\n".join(lines) + "\n").encode()


def parquet_bytes(docs: list[str], row_group_size: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), buf, row_group_size=row_group_size)
    return buf.getvalue()


def write_corpus(root: str) -> dict[str, object]:
    """All five kinds under `root`; returns what was written, for the tests to compare against."""
    text = write_text_folder(root)
    jsonl = [document(1000 + i, 60) for i in range(200)]
    put(f"{root}/docs.jsonl.zst", zstd(jsonl_bytes(jsonl)))
    table = [document(2000 + i, 60) for i in range(200)]
    put(f"{root}/table.parquet", parquet_bytes(table, row_group_size=100))
    nano = {"train": byte_tokens(3, 20_000), "val": byte_tokens(4, 2_000)}
    for split, tokens in nano.items():
        put(f"{root}/nanogpt/{split}.bin", tokens.astype("<u2").tobytes())
    llmc = {"train": byte_tokens(5, 20_000), "val": byte_tokens(6, 2_000)}
    for split, tokens in llmc.items():
        put(f"{root}/llmc/corpus_{split}_000000.bin", llmc_shard(tokens))
    return {"text": text, "jsonl": jsonl, "parquet": table, "nanogpt": nano, "llmc": llmc}


def corpus_policy(root: str, name: str = "corpora", mixer: str = "exp3") -> str:
    """A policy over all five kinds of arm under `root`."""
    return f"""name: {name}
mixer: {mixer}
arms:
  - {{name: notes, kind: text, paths: ["{root}/text/"], floor: 0.1, cap: 0.5}}
  - {{name: posts, kind: jsonl, paths: ["{root}/*.jsonl.zst"], floor: 0.1, cap: 0.5}}
  - {{name: table, kind: parquet, paths: ["{root}/table.parquet"], floor: 0.1, cap: 0.5}}
  - {{name: nano, kind: tokens, tokenizer: bytes, paths: ["{root}/nanogpt/"], floor: 0.1, cap: 0.5}}
  - {{name: llmc, kind: tokens, tokenizer: bytes, paths: ["{root}/llmc/*.bin"], floor: 0.1, cap: 0.5}}
"""
