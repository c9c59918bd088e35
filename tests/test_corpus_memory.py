"""The corpus readers' promise (issue 30): memory stays bounded by the reading, not by the file. For
each document kind (one text file, one JSON Lines file, one Parquet file in row groups of 4 MiB) a
real file of 40 MiB and one of 120 MiB are each built into a token cache in a fresh process, and the
growth of that process's peak RSS over the build is compared: tripling the file may add at most
SCALE_BOUND to it. A reader that held the file, its lines or its table whole would add at least the
80 MiB more it read (ASCII text is one byte a character, even as a str). What one build costs at any
size (the allocators' arenas, pyarrow's buffers: about 75 MiB for Parquet) is measured, not bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, _env

MIB = 1 << 20
SMALL, LARGE = 40 * MIB, 120 * MIB
SCALE_BOUND = 16 * MIB  # a fifth of the 80 MiB more that the larger file holds

# The child: imports first, its peak RSS read, then the build, then the peak again. VmHWM, the peak of
# this process's own memory since its exec (ru_maxrss would carry over the parent's from before it).
CHILD = """
import json, re, sys
from andrea_core.config import load_yaml
from andrea_core.data.corpora import open_corpus
from andrea_core.data.policy import parse_policy
from andrea_core.data.shards import corpus_cache
from andrea_core.data.tokens import ByteTokenizer
def peak():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024
(arm,) = parse_policy(load_yaml(sys.argv[1], "policy"), "policy").arms
source = open_corpus(arm, max_bytes=1 << 20)
before = peak()
corpus_cache(source, ByteTokenizer(), val_fraction=0.1, warn=lambda line: None)
print(json.dumps({"before": before, "after": peak()}))
"""


WORDS = "the model reads every shard of the corpus once and the bandit mixes arms".split()


def paragraph(i: int) -> str:
    """Document i: 1200 words, WORDS from the i-th on, round and round."""
    turned = WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]
    return f"doc {i}: " + " ".join((turned * (1200 // len(WORDS) + 1))[:1200]) + ".\n"


def write_corpus(kind: str, folder, file_bytes: int) -> tuple[str, int]:
    """One file of `file_bytes` of text in `kind`'s format: its path and its number of documents."""
    folder.mkdir()
    docs, size = [], 0
    while size < file_bytes:
        docs.append(paragraph(len(docs)))
        size += len(docs[-1])
    if kind == "text":
        path = folder / "book.txt"
        path.write_text("".join(docs))
    elif kind == "jsonl":
        path = folder / "posts.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "table.parquet"
        per_group = max(1, 4 * MIB // len(docs[0]))
        pq.write_table(pa.table({"text": docs}), path, row_group_size=per_group, compression="none")
        assert pq.ParquetFile(path).metadata.num_row_groups >= file_bytes // (4 * MIB)
    return str(path), 1 if kind == "text" else len(docs)


def build_growth(kind: str, folder, file_bytes: int) -> int:
    """How much a fresh process's peak RSS grew while it built the token cache of one such file."""
    path, documents = write_corpus(kind, folder, file_bytes)
    policy = f'name: one\narms:\n  - {{name: big, kind: {kind}, paths: ["{path}"]}}\n'
    env = _env() | {"ANDREA_CACHE_DIR": str(folder / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, policy], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.splitlines()[-1])
    # The cache holds every document and every byte: the build read the whole file, not a prefix.
    (manifest,) = (folder / "cache").rglob("manifest.json")
    totals = json.loads(manifest.read_text())
    assert (totals["documents"], totals["bad"]) == (documents, 0), totals
    assert totals["train_tokens"] + totals["val_tokens"] >= file_bytes, totals  # raw bytes: a token each
    return rss["after"] - rss["before"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_a_file_three_times_larger_costs_the_builder_no_more_memory(kind, tmp_path):
    small = build_growth(kind, tmp_path / "small", SMALL)
    large = build_growth(kind, tmp_path / "large", LARGE)
    print(f"{kind}: peak RSS grew {small / MIB:.1f} MiB for 40 MiB, {large / MIB:.1f} MiB for 120 MiB")
    assert large - small <= SCALE_BOUND, (
        f"{kind}: the 120 MiB file grew the peak RSS by {large / MIB:.1f} MiB, the 40 MiB one by "
        f"{small / MIB:.1f} MiB: the builder's memory follows the file"
    )
