"""Sharded, memory-mapped token caches for the user's corpora (corpora.py), built to scale past memory.

A corpus arm's cache is a folder in this machine's cache directory, keyed by the source's fingerprint,
the tokenizer's id and the validation fraction:

  NNNNNN.train.u16   the training tokens of shard N (.u32 where the vocabulary exceeds 65536)
  NNNNNN.val.u16     the validation tokens of shard N (documents chosen by corpora.is_validation)
  NNNNNN.json        shard N's counts, and where in the corpus the next shard starts
  manifest.json      the whole cache's counts; written last, when the build is complete

A shard holds whole documents (a shard is closed at the first document boundary past its size), its
token files are written under temporary names and renamed, and its .json is renamed last: a shard
without its .json, or whose files disagree with it, was never published and is never read. An
interrupted build resumes after the last published shard. The documents stream through the tokenizer
in bounded batches and straight to disk, so memory stays bounded whatever the corpus size; the
tokenizer (`tokenizers` encodes a batch on every core) is where the time goes. A long document is
encoded in pieces where that gives exactly its whole tokens (`document_pieces`): `tokenizers` holds
about 270 bytes per token while it encodes, so a 4 MB document alone would cost 430 MB. Where no such
cut lies within 2 x PIECE_CHARS characters (Chinese, Japanese or Thai text has no spaces to cut at; a
tokenizer that sees the whole text admits no cut at all), the document is cut at that size all the
same: memory stays bounded for every script, the document stays one document (no separator is added),
its tokens at those cuts differ from the whole's, and the cache's manifest and `andrea data stats`
count the documents so split.

The caches hold the documents' tokens in corpus order, each followed by DOC_SEPARATOR, as one stream
split into files; `ShardedTokens` reads the shards back as that one stream, so where a shard ends
changes nothing a batch sees.

`tokens` arms are not built: their shards are used as they are (memory-mapped in place when local,
copied into the cache directory, atomically and one file at a time, when remote: each copy named by
the shard's own fingerprint, so that adding a shard copies that one only).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from andrea_core.atomic import TEMP_SUFFIX, open_nofollow, open_temp, publish, temp_path, write_atomic
from andrea_core.bounded import read_bounded
from andrea_core.config import RunConfig, limit
from andrea_core.data.corpora import CorpusError, CorpusFile, CorpusSource, inspect_shard, is_validation
from andrea_core.data.tokens import DOC_SEPARATOR, ByteTokenizer, Tokenizer
from andrea_core.run.rundir import cache_dir, open_url

CACHE_FORMAT = 2  # part of every cache key: bump it when the cache layout or contents change (2: issue 25)
SHARD_TOKENS = 64 * 2**20  # training tokens per shard (ANDREA_SHARD_TOKENS overrides: tests)
BATCH_DOCS = 256  # documents (or pieces of one) handed to the tokenizer at once ...
BATCH_BYTES = 2 << 20  # ... or this much text, whichever comes first: what bounds the builder's memory
PIECE_CHARS = 256 << 10  # a longer document is encoded in pieces of about this size, where that is exact
# ... and in pieces of at most twice that where no exact cut is (build_corpus_cache: counted in the stats)
BAD_FRACTION = 0.01  # more bad records than this refuses the arm
NAMED_BAD = 5  # bad records named in the log (all are counted)
PROGRESS_EVERY_S = 2.0


def shard_tokens() -> int:
    return int(os.environ.get("ANDREA_SHARD_TOKENS") or SHARD_TOKENS)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardedTokens:
    """Token arrays (memory-mapped shards) read as their concatenation, never concatenated in memory."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0, *(len(p) for p in self.parts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def rows(self, offsets: np.ndarray, length: int) -> np.ndarray:
        """`length` tokens from each offset of the concatenated stream, as int64 rows: the same values
        `concatenation[offsets[:, None] + arange(length)]` would give."""
        out = np.empty((len(offsets), length), dtype=np.int64)
        shard_of = np.searchsorted(self.starts, offsets, side="right") - 1
        for r, (o, i) in enumerate(zip(offsets, shard_of, strict=True)):
            local, n = int(o - self.starts[i]), 0
            while n < length:  # a window that runs past its shard's end continues in the next shard
                take = min(length - n, len(self.parts[i]) - local)
                out[r, n : n + take] = self.parts[i][local : local + take]
                n, i, local = n + take, i + 1, 0
        return out


@dataclass
class ArmData:
    """A corpus arm ready to train on, with what `andrea data stats` reports of it."""

    train: ShardedTokens
    val: ShardedTokens
    info: dict[str, Any] = field(default_factory=dict)


def batch_encoder(tokenizer: Tokenizer, dtype: np.dtype) -> Callable[[list[str]], list[np.ndarray]]:
    """The tokenizer's batch encode, straight to arrays: bytes need no tokenizer at all, and a
    `tokenizers` tokenizer skips the offsets it would otherwise compute."""
    if isinstance(tokenizer, ByteTokenizer):
        return lambda texts: [np.frombuffer(t.encode("utf-8", "replace"), np.uint8) for t in texts]
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None:
        encode = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
        return lambda texts: [np.asarray(e.ids, dtype=dtype) for e in encode(texts)]
    return lambda texts: [np.asarray(ids, dtype=dtype) for ids in tokenizer.encode_batch(texts)]


# A pre-token of GPT-2's byte-level regex always ends before a whitespace character that precedes a
# printable ASCII one: the whitespace before it is a token of its own (`\s+(?!\S)` leaves its last
# character for the next token) and nothing else spans whitespace. No pattern looks behind, so text cut
# there pre-tokenizes, hence encodes, exactly as its two halves do; unless an added token follows, since
# added tokens are split off first and the whitespace before one is then a segment of its own.
PIECE_CUT = re.compile(r"[ \t\n](?=[!-~])")


def _next_cut(text: str, at: int, end: int, added: tuple[str, ...]) -> int | None:
    """The first exact cut in text[at:end] (seen only as far as `end`), or None."""
    while cut := PIECE_CUT.search(text, at, end):
        at = cut.start() + 1
        if not (added and text.startswith(added, at)):
            return cut.start()
    return None


def document_pieces(
    text: str,
    size: int = PIECE_CHARS,
    added: tuple[str, ...] = (),
    bound: int | None = None,
    cuts: dict[str, int] | None = None,
) -> Iterator[str]:
    """`text` in pieces of about `size` characters, cut only where the tokens of the pieces,
    concatenated, are the tokens of the whole (for a tokenizer that `exact_cuts` admits, with the
    added tokens it names). With a `bound`, where no such cut lies within `bound` characters (text
    without spaces: Chinese, Japanese, Thai) the text is cut at the bound all the same, each such cut
    counted in `cuts["forced"]`: a bound on memory for every script, at the price of those cuts."""
    return streamed_pieces([text], size, added, bound, cuts)


def streamed_pieces(
    chunks: Iterable[str],
    size: int = PIECE_CHARS,
    added: tuple[str, ...] = (),
    bound: int | None = None,
    cuts: dict[str, int] | None = None,
) -> Iterator[str]:
    """`document_pieces` of the concatenation of `chunks`, holding about `size` (at most `bound`)
    characters plus a chunk: an exact cut is taken only where enough text follows it to tell that no
    added token starts there."""
    margin = max(map(len, added), default=0) + 2
    buffer = ""
    for chunk in itertools.chain(chunks, [None]):
        end = chunk is None
        buffer += chunk or ""
        start = 0
        while len(buffer) - start > (size if end else size + margin):
            seen = len(buffer) if end else len(buffer) - margin
            cut = _next_cut(buffer, start + size, seen if bound is None else min(seen, start + bound), added)
            if cut is None:
                if bound is None or len(buffer) - start <= (bound if end else bound + margin):
                    break  # no exact cut yet: wait for more text (or end within the bound)
                cut = start + bound
                if cuts is not None:
                    cuts["forced"] = cuts.get("forced", 0) + 1
            yield buffer[start:cut]
            start = cut
        buffer = buffer[start:]
    yield buffer


def fixed_pieces(chunks: Iterable[str], size: int, cuts: dict[str, int] | None = None) -> Iterator[str]:
    """The concatenation of `chunks` in pieces of exactly `size` characters (the last: what is left),
    for a tokenizer that admits no exact cut; each cut counted in `cuts["forced"]`."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        start = 0
        while len(buffer) - start > size:
            yield buffer[start : start + size]
            start += size
            if cuts is not None:
                cuts["forced"] = cuts.get("forced", 0) + 1
        buffer = buffer[start:]
    yield buffer


def exact_cuts(tokenizer: Tokenizer) -> tuple[str, ...] | None:
    """Whether a document may be encoded in `document_pieces`, and the added tokens a cut must not
    precede; None where documents are encoded whole. Admitted: raw bytes, and a byte-level BPE on
    GPT-2's pre-tokenizer with nothing around it that sees the whole text (no normalizer, no prefix
    space, no special tokens added per encode, no added token that strips its neighbours' whitespace or
    holds whitespace). The per-run BPE is one; so are GPT-2's own tokenizer.json and its kin."""
    if isinstance(tokenizer, ByteTokenizer):
        return ()
    frozen = getattr(tokenizer, "frozen", None)
    if frozen is None:
        return None
    spec = json.loads(frozen)
    pre, post, model = spec.get("pre_tokenizer") or {}, spec.get("post_processor"), spec.get("model") or {}
    added = spec.get("added_tokens") or []
    exact = (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and (post is None or post.get("type") == "ByteLevel")
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and not any(a.get("lstrip") or a.get("rstrip") or re.search(r"\s", a["content"]) for a in added)
    )
    return tuple(a["content"] for a in added) if exact else None


# --- document arms: the sharded cache ------------------------------------------------------------


def cache_key(source: CorpusSource, tokenizer: Tokenizer, val_fraction: float) -> str:
    text = f"{source.fingerprint}|{tokenizer.id}|val {val_fraction!r}|cache-v{CACHE_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def corpus_cache_dir(source: CorpusSource, tokenizer: Tokenizer, val_fraction: float) -> Path:
    return cache_dir() / "corpora" / f"{source.arm.name}-{cache_key(source, tokenizer, val_fraction)}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _suffix(dtype: np.dtype) -> str:
    return "u16" if dtype == np.uint16 else "u32"


def _shard_file(folder: Path, index: int, split: str, dtype: np.dtype) -> Path:
    return folder / f"{index:06d}.{split}.{_suffix(dtype)}"


def _zero_totals() -> dict[str, Any]:
    return {"documents": 0, "records": 0, "bad": 0, "bad_examples": [], "text_bytes": 0, "train_tokens": 0,
            "val_tokens": 0}  # fmt: skip


def _published_shards(folder: Path, dtype: np.dtype) -> list[dict[str, Any]]:
    """The metas of the shards published so far, in order; anything after the first shard that is not
    whole (its .json missing, or its files' sizes disagreeing with it) is removed, to be rebuilt."""
    metas: list[dict[str, Any]] = []
    while (meta := _read_json(folder / f"{len(metas):06d}.json")) is not None:
        i = len(metas)
        sizes_ok = all(
            _shard_file(folder, i, s, dtype).exists()
            and _shard_file(folder, i, s, dtype).stat().st_size == meta[f"{s}_tokens"] * dtype.itemsize
            for s in ("train", "val")
        )
        if not sizes_ok:
            break
        metas.append(meta)
    # The caller holds the folder's lock: no other builder is writing here.
    for p in folder.iterdir():
        m = re.match(r"^(\d{6})\.", p.name)
        if m and int(m.group(1)) >= len(metas):
            p.unlink(missing_ok=True)  # an unpublished shard (or one that lost its files): never read
        elif p.name.endswith(TEMP_SUFFIX):
            p.unlink(missing_ok=True)  # a dead builder's half-written file
    return metas


class _ShardWriter:
    """One shard being written: temporary files, renamed into place by publish()."""

    def __init__(self, folder: Path, index: int, dtype: np.dtype):
        self.folder, self.index, self.dtype = folder, index, dtype
        self.tokens = {"train": 0, "val": 0}
        self.tmp, self.files = {}, {}
        for s in ("train", "val"):
            self.tmp[s], self.files[s] = open_temp(_shard_file(folder, index, s, dtype))

    def write(self, ids: np.ndarray, val: bool) -> None:
        split = "val" if val else "train"
        ids.astype(self.dtype, copy=False).tofile(self.files[split])
        self.tokens[split] += len(ids)

    def publish(self, next_position: tuple[int, int], totals: dict[str, Any]) -> None:
        for split, f in self.files.items():
            publish(self.tmp[split], _shard_file(self.folder, self.index, split, self.dtype), f)
        meta = {
            "index": self.index,
            "train_tokens": self.tokens["train"],
            "val_tokens": self.tokens["val"],
            "next": list(next_position),
            "totals": totals,
        }
        _write_json_atomic(self.folder / f"{self.index:06d}.json", meta)  # last: the shard now exists

    def abandon(self) -> None:
        for split, f in self.files.items():
            f.close()
            self.tmp[split].unlink(missing_ok=True)


class BuildProgress:
    """Progress lines while a cache builds: documents, MB of text, tokens/s, ETA."""

    def __init__(self, source: CorpusSource, start_file: int, warn: Callable[[str], None]):
        self.name = source.arm.name
        self.cumulative = np.cumsum([0, *(f.size for f in source.files)])
        self.start_bytes = int(self.cumulative[start_file])
        self.warn = warn
        self.t0 = self.last = time.monotonic()
        self.tokens = 0

    def update(
        self, file_index: int, read: int, totals: dict[str, Any], new_tokens: int, force: bool = False
    ) -> None:
        """`read`: bytes of file `file_index` read so far (the ETA is by stored bytes, all files)."""
        self.tokens += new_tokens
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        at = int(self.cumulative[file_index]) + read
        done, left = at - self.start_bytes, int(self.cumulative[-1]) - at
        eta = f"{left * elapsed / done:,.0f}s" if done > 0 and left > 0 else ("0s" if left == 0 else "?")
        self.warn(
            f"arm {self.name!r}: building its token cache: {totals['documents']:,} documents, "
            f"{totals['text_bytes'] / 1e6:,.1f} MB of text, {self.tokens / elapsed:,.0f} tokens/s, "
            f"file {min(file_index + 1, len(self.cumulative) - 1)} of {len(self.cumulative) - 1}, ETA {eta}"
        )


def bad_summary(name: str, totals: dict[str, Any]) -> str:
    pct = 100.0 * totals["bad"] / max(1, totals["records"])
    first = "; ".join(totals["bad_examples"])
    bad, records = totals["bad"], totals["records"]
    return f"arm {name!r}: {bad:,} of {records:,} records ({pct:.2f}%) are bad (first: {first})"


def split_summary(name: str, totals: dict[str, Any]) -> str:
    return (
        f"arm {name!r}: {totals['split_documents']:,} document(s) had no exact cut within "
        f"{2 * PIECE_CHARS:,} characters (text without spaces, or a tokenizer that admits no cut) and were "
        f"encoded in pieces of at most that size ({totals['forced_cuts']:,} cuts): their tokens at those "
        "cuts are not the whole document's"
    )


def build_corpus_cache(
    source: CorpusSource, tokenizer: Tokenizer, val_fraction: float, folder: Path, warn: Callable[[str], None]
) -> dict[str, Any]:
    """Build (or finish building) the arm's cache in `folder`; returns its manifest."""
    name, files = source.arm.name, source.files
    dtype = token_dtype(tokenizer.vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    done = _published_shards(folder, dtype)
    totals = dict(done[-1]["totals"]) if done else _zero_totals()
    start = tuple(done[-1]["next"]) if done else (0, 0)
    if done:
        warn(
            f"arm {name!r}: resuming its token cache build after shard {len(done) - 1} "
            f"(file {start[0] + 1} of {len(files)}, record {start[1]})"
        )
    encode = batch_encoder(tokenizer, dtype)
    added = exact_cuts(tokenizer)
    limit = shard_tokens()
    progress = BuildProgress(source, start[0], warn)
    shard = _ShardWriter(folder, len(done), dtype)
    pending: list[tuple[str, bool]] = []
    pending_bytes = 0
    position = published_at = start

    def flush() -> int:
        nonlocal pending_bytes
        arrays = encode([text for text, _ in pending]) if pending else []
        for (_, val), ids in zip(pending, arrays, strict=True):
            shard.write(ids, val)
            totals["val_tokens" if val else "train_tokens"] += len(ids)
        pending.clear()
        pending_bytes = 0
        return sum(len(a) for a in arrays)

    try:
        for rec in source.records(start):
            position = (rec.file, rec.index + rec.count)
            totals["records"] += rec.count
            if rec.bad:
                totals["bad"] += rec.count
                if len(totals["bad_examples"]) < NAMED_BAD:
                    totals["bad_examples"].append(rec.problem)
                    warn(f"arm {name!r}: skipping bad record: {rec.problem}")
                continue
            totals["documents"] += 1
            val = is_validation(rec.identity(files), val_fraction)
            chunks = itertools.chain(rec.chunks() if rec.chunks is not None else [rec.text], [DOC_SEPARATOR])
            # In pieces cut where the tokens stay exactly the document's (a large text file streams
            # through them, never whole), within MAX_PIECE_CHARS all the same where no such cut is
            # (text without spaces, or a tokenizer that allows none): counted, and said in the stats.
            cuts: dict[str, int] = {}
            bound = 2 * PIECE_CHARS
            pieces = (
                fixed_pieces(chunks, bound, cuts)
                if added is None
                else streamed_pieces(chunks, PIECE_CHARS, added, bound, cuts)
            )
            for piece in pieces:
                size = len(piece.encode("utf-8", "replace"))
                totals["text_bytes"] += size
                pending.append((piece, val))
                pending_bytes += size
                if len(pending) >= BATCH_DOCS or pending_bytes >= BATCH_BYTES:
                    progress.update(rec.file, rec.read, totals, flush())
            totals["text_bytes"] -= len(DOC_SEPARATOR)  # counted with the last piece: not text
            if cuts.get("forced"):
                totals["split_documents"] = totals.get("split_documents", 0) + 1
                totals["forced_cuts"] = totals.get("forced_cuts", 0) + cuts["forced"]
            # Bytes bound the tokens of a batch (one token per byte at most, for byte-level tokenizers):
            # flushing once they could fill the shard keeps shards near their size on small corpora too.
            # A shard holds whole documents: it is published only here, between two of them.
            if shard.tokens["train"] + pending_bytes >= limit:
                progress.update(rec.file, rec.read, totals, flush())
            if shard.tokens["train"] >= limit:
                shard.publish(position, totals)
                published_at = position
                shard = _ShardWriter(folder, shard.index + 1, dtype)
        progress.update(len(files), 0, totals, flush(), force=True)
        if shard.tokens["train"] or shard.tokens["val"] or shard.index == 0 or position != published_at:
            shard.publish(position, totals)
            n_shards = shard.index + 1
        else:
            shard.abandon()
            n_shards = shard.index
    except BaseException:
        shard.abandon()
        raise
    if totals["bad"] > BAD_FRACTION * totals["records"]:
        raise CorpusError(
            f"{bad_summary(name, totals)}: more than {100 * BAD_FRACTION:g}% of its records are bad, so the "
            f"arm is refused; fix or remove them ({', '.join(source.arm.paths)})"
        )
    if totals["bad"]:
        warn(f"{bad_summary(name, totals)}; they were skipped")
    if totals.get("split_documents"):
        warn(split_summary(name, totals))
    manifest = {
        "format": CACHE_FORMAT,
        "arm": name,
        "fingerprint": source.fingerprint,
        "tokenizer": tokenizer.id,
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "files": len(files),
        "shards": n_shards,
        **totals,
    }
    _write_json_atomic(folder / "manifest.json", manifest)
    return manifest


def _intact(folder: Path, manifest: dict[str, Any]) -> bool:
    """Every shard the manifest counts is there at the size its .json says (a cache folder is a cache:
    someone may have deleted files from it)."""
    dtype = np.dtype(manifest["dtype"])
    for i in range(manifest["shards"]):
        meta = _read_json(folder / f"{i:06d}.json")
        if meta is None:
            return False
        for split in ("train", "val"):
            path = _shard_file(folder, i, split, dtype)
            if not path.exists() or path.stat().st_size != meta[f"{split}_tokens"] * dtype.itemsize:
                return False
    return True


def _open_lock_file(path: Path):
    """The cache folder's flock file, never through a symlink (one planted there would have its target
    truncated) and never truncated itself: it holds nothing, only the lock."""
    fd = open_nofollow(
        path,
        os.O_RDWR | os.O_CREAT,
        0o600,
        refuse=lambda: CorpusError(f"{path}: a symlink where the cache's lock file should be; not followed"),
    )
    return open(fd, "r+b")


def corpus_cache(
    source: CorpusSource, tokenizer: Tokenizer, val_fraction: float, warn: Callable[[str], None] = print
) -> ArmData:
    """The arm's train and validation tokens, from its cache (built first if missing or unfinished)."""
    folder = corpus_cache_dir(source, tokenizer, val_fraction)
    manifest = _read_json(folder / "manifest.json")
    if manifest is not None and not _intact(folder, manifest):
        warn(f"arm {source.arm.name!r}: its token cache {folder} lost shards; finishing it again")
        manifest = None
    if manifest is None:
        folder.mkdir(parents=True, exist_ok=True)
        with _open_lock_file(folder / ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; a second waits, then reads its work
            manifest = _read_json(folder / "manifest.json")
            if manifest is not None and not _intact(folder, manifest):
                (folder / "manifest.json").unlink()
                manifest = None
            if manifest is None:
                manifest = build_corpus_cache(source, tokenizer, val_fraction, folder, warn)
    elif manifest["bad"]:
        warn(f"{bad_summary(source.arm.name, manifest)}; they were skipped when its cache was built")
    dtype = np.dtype(manifest["dtype"])
    splits = {}
    for split in ("train", "val"):
        parts = []
        for i in range(manifest["shards"]):
            path = _shard_file(folder, i, split, dtype)
            if path.stat().st_size:
                parts.append(np.memmap(path, dtype=dtype, mode="r"))
        splits[split] = ShardedTokens(parts)
    info = {k: manifest[k] for k in ("documents", "records", "bad", "shards")}
    info["split_documents"] = manifest.get("split_documents", 0)
    info["cache_bytes"] = splits["train"].nbytes + splits["val"].nbytes
    info["cache"] = str(folder)
    return ArmData(splits["train"], splits["val"], info)


# --- tokens arms: shards used as they are --------------------------------------------------------

FROZEN_ID = re.compile(r"(bpe|hf)-([0-9a-f]{16})")  # fullmatch


def declared_tokenizer_hash(declared: str) -> str:
    """What a tokens arm's `tokenizer` names: `bytes`, a tokenizer id (`hf-…`, `bpe-…`), or the path or
    URL of a tokenizer.json, identified by the hash of its bytes as a run's frozen tokenizer is."""
    if declared == "bytes":
        return "bytes"
    m = FROZEN_ID.fullmatch(declared)
    if m:
        return m.group(2)
    try:
        with open_url(declared, "rb", "tokens arm tokenizer") as f:
            data = read_bounded(f, limit("ANDREA_MAX_SIDECAR_BYTES"), f"tokenizer {declared!r}")
        return hashlib.sha256(data).hexdigest()[:16]
    except OSError as e:
        raise CorpusError(f"tokenizer {declared!r}: cannot read it ({e})") from None


def shard_fingerprint(f: CorpusFile) -> str:
    """One shard's identity (URL, size, version): its copy is reused exactly while this is the same."""
    return hashlib.sha256(f"{f.url}|{f.size}|{f.version}".encode()).hexdigest()[:16]


def check_tokens_tokenizer(source: CorpusSource, tokenizer: Tokenizer) -> None:
    declared = source.arm.tokenizer
    want = declared_tokenizer_hash(declared)
    have = "bytes" if tokenizer.id == "bytes" else tokenizer.id.rsplit("-", 1)[-1]
    if want != have:
        raise CorpusError(
            f"arm {source.arm.name!r} (tokens): its shards were made with tokenizer {declared!r} but the "
            f"run's tokenizer is {tokenizer.id}; training on them would be a silent garbage run"
        )


def _chunked_max(a: np.ndarray, chunk: int = 1 << 24) -> int:
    return max((int(a[i : i + chunk].max()) for i in range(0, len(a), chunk)), default=0)


def token_shards(
    source: CorpusSource, tokenizer: Tokenizer, vocab_size: int, warn: Callable[[str], None] = print
) -> ArmData:
    """A tokens arm's shards, checked (headers, sizes, tokenizer, token ids) and memory-mapped."""
    check_tokens_tokenizer(source, tokenizer)
    shards = [inspect_shard(f) for f in source.files]
    # One folder per arm and list of paths; in it, each remote shard is a copy named by its own
    # fingerprint, so that a shard added to the arm is the only one copied, and a replaced one's old
    # copy is removed.
    where = hashlib.sha256("\n".join(source.arm.paths).encode()).hexdigest()[:16]
    folder = cache_dir() / "tokens" / f"{source.arm.name}-{where}"
    folder.mkdir(parents=True, exist_ok=True)
    maxima = _read_json(folder / "maxima.json") or {}
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    copied, keys = 0, set()
    for sh in shards:
        f = sh.file
        key = f"{f.rel.replace('/', '__')}.{shard_fingerprint(f)}"
        keys.add(key)
        if isinstance(f.fs, LocalFileSystem):
            path = Path(f.path)
        else:
            path = folder / key
            if not path.exists() or path.stat().st_size != f.size:
                tmp = temp_path(path)
                f.fs.get_file(f.path, str(tmp))  # streamed to disk, never whole in memory
                if tmp.stat().st_size != f.size:
                    tmp.unlink()
                    raise CorpusError(f"{f.url}: {f.size} bytes listed but a different size was read")
                publish(tmp, path)
                copied += f.size
        if sh.count == 0:
            continue
        arr = np.memmap(path, dtype=sh.dtype, mode="r", offset=sh.offset, shape=(sh.count,))
        if key not in maxima:
            maxima[key] = _chunked_max(arr)
        if maxima[key] >= vocab_size:
            raise CorpusError(
                f"{f.url}: token id {maxima[key]} is outside the model's vocabulary (model.vocab_size "
                f"{vocab_size}); the shard was made with another tokenizer"
            )
        parts[sh.split].append(arr)
    _write_json_atomic(folder / "maxima.json", {k: v for k, v in maxima.items() if k in keys})
    for p in folder.iterdir():  # copies of shards the arm no longer has (replaced or removed)
        if p.name != "maxima.json" and not p.name.startswith(".") and p.name not in keys:
            p.unlink(missing_ok=True)
    if copied:
        warn(f"arm {source.arm.name!r}: copied {copied / 1e6:,.1f} MB of token shards into {folder}")
    for split, what in (("val", "val.bin or *_val_*"), ("train", "train.bin or *_train_*")):
        if not parts[split]:
            raise CorpusError(
                f"arm {source.arm.name!r} (tokens): no {split} shard with tokens among "
                f"{', '.join(f.url for f in source.files)} (a {split} shard is named {what})"
            )
    train, val = ShardedTokens(parts["train"]), ShardedTokens(parts["val"])
    info = {"documents": None, "records": None, "bad": 0, "shards": len(shards)}
    info["cache_bytes"] = train.nbytes + val.nbytes
    info["cache"] = str(folder)
    return ArmData(train, val, info)


def corpus_arm(
    source: CorpusSource, tokenizer: Tokenizer, cfg: RunConfig, warn: Callable[[str], None] = print
) -> ArmData:
    """A corpus arm of any kind, ready to train on."""
    if source.arm.kind == "tokens":
        return token_shards(source, tokenizer, cfg.model.vocab_size, warn)
    return corpus_cache(source, tokenizer, cfg.data.val_fraction, warn)


def check_corpus_split(data: ArmData, block_size: int) -> None:
    """Both splits must hold a window; a corpus too small for that is unavailable, saying why."""
    for split in ("train", "val"):
        n = len(getattr(data, split))
        if n < block_size + 2:
            raise ValueError(
                f"its {split} split has {n} tokens, fewer than block_size + 2 = {block_size + 2} (the "
                "validation split is the documents whose identity hashes below data.val_fraction: "
                "add documents or raise data.val_fraction)"
            )
