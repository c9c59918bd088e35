"""Does the cache builder add anything to the tokenizer? Builder throughput against `tokenizers`' own
`encode_batch`, and the builder's peak memory at two corpus sizes.

For each corpus size (a generated JSON Lines corpus: the Python standard library's source files as
documents, cycled with a per-copy header until the size is reached, in 32 MB files):
  (a) baseline: `tokenizers`' encode_batch over the same documents, 256 at a time, timed around the
      encode call only (the documents are read beforehand, one file at a time);
  (a') the same with encode_batch_fast (no offsets), which is what the builder calls;
  (b) the builder: `andrea_core.data.shards.corpus_cache`, everything included (listing, reading and
      parsing the JSON, the document hash that picks the split, encoding, writing the shards), in a
      child process whose peak RSS (VmHWM: ru_maxrss would carry the parent's peak across exec) is
      reported.
The tokenizer is a byte-level BPE of 8192 tokens (andrea-12m's size) trained on 4 MB of the corpus.
Both use all cores (`tokenizers` encodes a batch in parallel; the builder calls its encode_batch_fast,
which skips the offsets that encode_batch computes). Prints tokens/s of each, b/a (target
>= 0.9), b/a' (what the builder adds to the very call it makes) and the builder's peak RSS (target:
under 1 GB whatever the size).

    python bench/data_prepare.py [--sizes-mb 64 512] [--workdir /tmp/andrea-bench-prepare]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FILE_BYTES = 32 << 20


def generate(folder: Path, size_mb: int) -> int:
    """A JSON Lines corpus of about size_mb MB; returns the number of documents."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = []
    for p in stdlib:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    target, written, n, part, copy = size_mb << 20, 0, 0, 0, 0
    out = open(folder / f"part-{part:04d}.jsonl", "w")
    while written < target:
        for t in texts:
            line = json.dumps({"text": f"# copy {copy}\n{t}"}) + "\n"
            out.write(line)
            written += len(line)
            n += 1
            if out.tell() >= FILE_BYTES:
                out.close()
                part += 1
                out = open(folder / f"part-{part:04d}.jsonl", "w")
            if written >= target:
                break
        copy += 1
    out.close()
    return n


def child_build(corpus: Path, tokenizer_json: Path, cache: Path) -> None:
    """(b), in its own process so that its peak RSS is its own."""
    os.environ["ANDREA_CACHE_DIR"] = str(cache)
    from andrea_core.data.corpora import open_corpus
    from andrea_core.data.policy import ArmSpec
    from andrea_core.data.shards import corpus_cache
    from andrea_core.data.tokens import BPETokenizer

    tok = BPETokenizer(tokenizer_json.read_bytes())
    with open("/proc/self/status") as f:  # what the imports alone hold
        imports_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    source = open_corpus(ArmSpec("bench", "jsonl", paths=[str(corpus)]), 0)
    t0 = time.perf_counter()
    data = corpus_cache(source, tok, 0.05, warn=lambda line: print(line, file=sys.stderr))
    elapsed = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    tokens = len(data.train) + len(data.val)
    out = {"tokens": tokens, "seconds": elapsed, "peak_rss": rss, "imports_rss": imports_rss}
    print(json.dumps({**out, "shards": data.info["shards"]}))


def baseline(corpus: Path, tokenizer_json: Path, fast: bool = False) -> tuple[int, float]:
    """(a): encode_batch alone over the same documents (each followed by the same separator); (a')
    encode_batch_fast."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.read_text())
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    tokens, seconds = 0, 0.0
    for path in sorted(corpus.glob("*.jsonl")):
        docs = [json.loads(line)["text"] + "\n\n" for line in path.open()]
        for i in range(0, len(docs), 256):
            t0 = time.perf_counter()
            enc = encode(docs[i : i + 256])
            seconds += time.perf_counter() - t0
            tokens += sum(len(e.ids) for e in enc)
    return tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--workdir", default="/tmp/andrea-bench-prepare")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_build(*(Path(p) for p in args.child))
        return

    from andrea_core.data.tokens import train_bpe

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    tokenizer_json = work / "tokenizer.json"
    for size in args.sizes_mb:
        corpus = work / f"corpus-{size}mb"
        t0 = time.perf_counter()
        n_docs = generate(corpus, size)
        on_disk = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
        print(f"corpus {size} MB: {n_docs:,} documents, {on_disk / 1e6:,.0f} MB of JSON Lines "
              f"({time.perf_counter() - t0:.1f}s to generate)")  # fmt: skip
        if not tokenizer_json.exists():
            first = corpus / "part-0000.jsonl"
            texts, got = [], 0
            for line in first.open():
                texts.append(json.loads(line)["text"])
                got += len(texts[-1])
                if got > 4 << 20:
                    break
            tokenizer_json.parent.mkdir(parents=True, exist_ok=True)
            tokenizer_json.write_bytes(train_bpe(texts, 8192))

        a_tokens, a_s = baseline(corpus, tokenizer_json)
        f_tokens, f_s = baseline(corpus, tokenizer_json, fast=True)
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(corpus),
                str(tokenizer_json),
                str(work / f"cache-{size}"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        b = json.loads(proc.stdout.strip().splitlines()[-1])
        progress = [line for line in proc.stderr.splitlines() if "building" in line]
        a_rate, b_rate = a_tokens / a_s, b["tokens"] / b["seconds"]
        f_rate = f_tokens / f_s
        print(f"  (a) tokenizers encode_batch: {a_tokens:,} tokens in {a_s:.1f}s = {a_rate:,.0f} tokens/s")
        print(f"  (a') encode_batch_fast: {f_tokens:,} tokens in {f_s:.1f}s = {f_rate:,.0f} tokens/s")
        print(
            f"  (b) builder (read, parse, split, encode, write {b['shards']} shards): {b['tokens']:,} tokens "
            f"in {b['seconds']:.1f}s = {b_rate:,.0f} tokens/s"
        )
        print(
            f"  b/a = {b_rate / a_rate:.3f}   b/a' = {b_rate / f_rate:.3f}   builder peak RSS "
            f"{b['peak_rss'] / 2**20:,.0f} MiB (of which {b['imports_rss'] / 2**20:,.0f} MiB before"
            " the build: the imports)"
        )
        if progress:
            print(f"  last progress line: {progress[-1]}")
        if a_tokens != b["tokens"]:
            print(f"  NOTE: token counts differ ({a_tokens} vs {b['tokens']})")
        shutil.rmtree(corpus)
        shutil.rmtree(work / f"cache-{size}", ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
