"""The user's own data as arms: text, JSON Lines, Parquet and pre-tokenized shards, over fsspec URLs.

An arm's `paths` are local paths, `file://`, `s3://`, `memory://` or any URL fsspec reaches, each a
file, a folder (searched recursively) or a glob; credentials and endpoints come from the usual
`AWS_*` / `FSSPEC_*` variables, as for run directories. The files are listed once, sorted, and
fingerprinted by (URL, size, ETag or mtime), so that a cache is rebuilt exactly when a file is added,
removed or replaced.

Document kinds (`text`, `jsonl`, `parquet`) yield records. Each record has an identity, the file's
path relative to the arm's path plus the record's index in it, and the validation split is chosen by a
hash of that identity (see `is_validation`): adding files to a corpus never moves a document between
train and validation. A record that cannot be used (an unreadable file, a bad JSON line, a missing
field, a value that is not text, text that is not valid Unicode: bytes that are not UTF-8, or a lone
surrogate that JSON's \\ud83d escapes let through; a JSON line nested too deep or longer than
ANDREA_MAX_LINE_BYTES) is yielded as bad, naming the file and line or row, and the reader goes on with
the next one, so that the cache builder counts it and refuses an arm where more than 1% of the records
are bad. A compressed file is read through a bound on what it expands to (ANDREA_MAX_EXPANSION times
its stored size, checked as the bytes arrive): a small .gz or .zst that would expand to gigabytes is
refused by name, not read.

`tokens` arms are shards made by other tools, read as they are: nanoGPT's `train.bin` / `val.bin`
(raw uint16) and llm.c's shards (a header of 256 int32: magic, version, token count; magic 20240520
with version 1 for uint16 tokens, 20240801 with version 7 for uint32). A file named exactly
`train.bin` or `val.bin` is nanoGPT's; any other `.bin` must carry llm.c's header. Shards whose name
has a `val` part (`val.bin`, `fineweb_val_000000.bin`) are the validation split.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from andrea_core.bounded import BoundedReader, LongLine, TooLarge, bounded_lines, read_at_most
from andrea_core.config import limit
from andrea_core.data.policy import ArmSpec, SourceUnavailable
from andrea_core.run.rundir import url_to_fs

# Part of every corpus fingerprint: bump it when reading changes what a corpus yields.
CORPUS_FORMAT = 1
COMPRESSIONS = (".gz", ".zst")
SUFFIXES = {
    "text": (".txt", ".md", ".rst"),
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "parquet": (".parquet",),
    "tokens": (".bin",),
}
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INTS
LLMC_FORMATS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}  # magic: (version, dtype)
NANOGPT_NAMES = ("train.bin", "val.bin")
READ_CHUNK = 1 << 20
# A text file stored larger than this is not read whole: its document is checked (UTF-8) in one pass
# and streamed in chunks in a second (Record.chunks), so that one 10 GB file is not 10 GB in memory.
WHOLE_TEXT_BYTES = 32 << 20
# A compressed file may expand to ANDREA_MAX_EXPANSION times its stored size, and to at least this.
EXPANSION_FLOOR_BYTES = 64 << 20
GLOB_CHARS = re.compile(r"[*?\[]")


class CorpusError(RuntimeError):
    """An arm's data that cannot be used as it is (a bad shard, too many bad records, a tokenizer that
    is not the run's): an error that stops the run, never a silent garbage run."""


@dataclass(frozen=True)
class CorpusFile:
    url: str  # what messages name, and what the file is opened by
    rel: str  # its path relative to the arm's path: the document identity, stable if the corpus moves
    size: int
    version: str  # ETag, mtime or creation time: whatever the store says changes when the file does
    fs: Any = field(compare=False, repr=False)
    path: str = field(compare=False, repr=False, default="")

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


class Record(NamedTuple):
    """One document of a file (`text`), or a bad record (`problem`, naming the file and line or row).
    `index` is the record's position in its file; `count` how many records a bad entry stands for (a
    Parquet file without the column: all its rows); `read` about how many of the file's bytes (as
    stored: compressed where it is) were read through this record, for the builder's ETA. A large text
    file's document has no `text` but `chunks`: a function that streams it, checked UTF-8 already."""

    file: int
    index: int
    text: str | None
    problem: str | None = None
    count: int = 1
    read: int = 0
    chunks: Callable[[], Iterator[str]] | None = None

    @property
    def bad(self) -> bool:
        return self.problem is not None

    def identity(self, files: list[CorpusFile]) -> str:
        return f"{files[self.file].rel}:{self.index}"


def is_validation(identity: str, val_fraction: float) -> bool:
    """Whether a document is held out: a hash of its identity, so the split never depends on what
    else is in the corpus (a tail-of-stream split moves documents whenever files are added)."""
    h = int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "big")
    return h < val_fraction * 2.0**64


def _suffix_ok(kind: str, name: str) -> bool:
    for comp in ("", *COMPRESSIONS) if kind in ("text", "jsonl") else ("",):
        if any(name.endswith(s + comp) for s in SUFFIXES[kind]):
            return True
    return False


def _version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def list_files(arm: ArmSpec) -> list[CorpusFile]:
    """The arm's files of its kind, sorted by URL; a path that does not exist contributes nothing."""
    found: dict[str, CorpusFile] = {}
    for url in arm.paths:
        try:
            fs, path = url_to_fs(url, f"arm {arm.name!r} path", use_listings_cache=False)
            path = path.rstrip("/") or "/"
            glob = GLOB_CHARS.search(path)
            if glob:
                base = path[: glob.start()].rsplit("/", 1)[0]
                matches = fs.glob(path, detail=True)
                # A folder the glob matches is searched, as a folder path is.
                for folder in [p for p, info in matches.items() if info.get("type") == "directory"]:
                    matches.update(fs.find(folder, detail=True))
            elif fs.isdir(path):
                base, matches = path, fs.find(path, detail=True)
            elif fs.exists(path):
                base, matches = posixpath.dirname(path), {path: fs.info(path)}
            else:
                continue
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SourceUnavailable(f"arm {arm.name!r} ({arm.kind}): cannot list {url}: {e}") from None
        for p, info in matches.items():
            if info.get("type") != "file" or not _suffix_ok(arm.kind, posixpath.basename(p)):
                continue
            full = fs.unstrip_protocol(p) if "://" in url else p
            rel = posixpath.relpath(p, base) if base else p
            found[full] = CorpusFile(full, rel, int(info.get("size") or 0), _version(info), fs, p)
    return [found[u] for u in sorted(found)]


@dataclass(frozen=True)
class CorpusSource:
    """An arm over the user's files; the `Source` of sources.py for the corpus kinds."""

    arm: ArmSpec
    files: list[CorpusFile]
    max_bytes: int  # bounds documents() only (the text a per-run BPE is trained on), never a cache

    @property
    def fingerprint(self) -> str:
        a = self.arm
        h = hashlib.sha256(f"{a.kind}|{a.field}|{a.column}|corpus-v{CORPUS_FORMAT}".encode())
        for f in self.files:
            h.update(f"{f.url}|{f.size}|{f.version}\n".encode())
        return h.hexdigest()[:16]

    def records(self, start: tuple[int, int] = (0, 0)) -> Iterator[Record]:
        """Every record from position `start` (file, index in file) on, good and bad, in order."""
        first_file, first_index = start
        for i in range(first_file, len(self.files)):
            skip = first_index if i == first_file else 0
            yield from READERS[self.arm.kind](self.arm, i, self.files[i], skip)

    def documents(self) -> Iterator[str]:
        """The good documents in order, stopping once max_bytes of text were produced."""
        if self.arm.kind == "tokens":
            return
        produced = 0
        for rec in self.records():
            if rec.bad:
                continue
            if produced >= self.max_bytes:
                return
            text = (
                rec.text if rec.chunks is None else "".join(_until(rec.chunks(), self.max_bytes - produced))
            )
            doc = text[: self.max_bytes - produced]
            produced += len(doc.encode())
            yield doc


def open_corpus(arm: ArmSpec, max_bytes: int) -> CorpusSource:
    files = list_files(arm)
    if not files:
        suffixes = "/".join(SUFFIXES[arm.kind])
        raise SourceUnavailable(
            f"arm {arm.name!r} ({arm.kind}): no {suffixes} files at {', '.join(arm.paths)}"
        )
    return CorpusSource(arm, files, max_bytes)


# --- readers -------------------------------------------------------------------------------------


class CorpusTooLarge(CorpusError):
    """A compressed file that expands past its bound: refused by name (a decompression bomb, or a file
    to allow with ANDREA_MAX_EXPANSION)."""


def expansion_bound(f: CorpusFile) -> int:
    """How many bytes a compressed file may expand to (ANDREA_MAX_EXPANSION x its stored size)."""
    return max(EXPANSION_FLOOR_BYTES, limit("ANDREA_MAX_EXPANSION") * f.size)


def _open_decompressed(f: CorpusFile, raw=None):
    """The file's bytes, decompressed where its name says, and bounded there (expansion_bound: a read
    past it raises TooLarge); `raw` (an open handle of it) is read from if given, so that its
    position tells how far through the stored file the reading is."""
    raw = raw or f.fs.open(f.path, "rb")
    if f.path.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
    elif f.path.endswith(".zst"):
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    else:
        return raw
    bound = expansion_bound(f)

    def refusal(seen: int) -> str:
        return (
            f"{f.url}: expands past {bound:,} bytes ({limit('ANDREA_MAX_EXPANSION')} times its {f.size:,} "
            "stored bytes): refused as a decompression bomb; set ANDREA_MAX_EXPANSION to allow more"
        )

    return BoundedReader(stream, bound, f.url, refusal)


def _refused(e: TooLarge) -> CorpusTooLarge:
    return CorpusTooLarge(str(e))


def _until(chunks: Iterator[str], n: int) -> Iterator[str]:
    """Chunks until at least n characters were given."""
    for chunk in chunks:
        yield chunk
        n -= len(chunk)
        if n <= 0:
            return


def _text_chunks(f: CorpusFile) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with _open_decompressed(f) as stream:
            while data := stream.read(READ_CHUNK):
                yield decoder.decode(data)
    except TooLarge as e:
        raise _refused(e) from None
    yield decoder.decode(b"", final=True)


def _utf8_problem(f: CorpusFile) -> str | None:
    """Why a large text file is not a document (not UTF-8, unreadable), read through once; None if it is."""
    decoder, at = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with _open_decompressed(f) as stream:
            while data := stream.read(READ_CHUNK):
                decoder.decode(data)
                at += len(data)
            decoder.decode(b"", final=True)
    except TooLarge as e:
        raise _refused(e) from None
    except UnicodeDecodeError as e:
        return f"{f.url}: not UTF-8 text ({e.reason} near byte {at + e.start})"
    except Exception as e:  # gzip, zstd and the stores raise many types; all mean "unreadable"
        return f"{f.url}: unreadable ({type(e).__name__}: {e})"
    return None


def _read_text(arm: ArmSpec, i: int, f: CorpusFile, skip: int) -> Iterator[Record]:
    if skip > 0:
        return  # a text file is one record, already consumed
    try:
        # Read whole only while it stays small as decompressed, whatever its stored size says.
        larger = f.size > WHOLE_TEXT_BYTES
        if not larger:
            with _open_decompressed(f) as stream:
                data, larger = read_at_most(stream, WHOLE_TEXT_BYTES, READ_CHUNK)
        if larger:
            problem = _utf8_problem(f)
            if problem is not None:
                yield Record(i, 0, None, problem)
            else:
                yield Record(i, 0, None, chunks=lambda: _text_chunks(f))  # read: as it streams
            return
        text = data.decode("utf-8")
    except TooLarge as e:
        raise _refused(e) from None
    except CorpusError:
        raise
    except UnicodeDecodeError as e:
        yield Record(i, 0, None, f"{f.url}: not UTF-8 text ({e.reason} at byte {e.start})")
        return
    except Exception as e:  # gzip, zstd and the stores raise many types; all mean "unreadable"
        yield Record(i, 0, None, f"{f.url}: unreadable ({type(e).__name__}: {e})")
        return
    yield Record(i, 0, text, read=f.size)


def unicode_problem(text: str) -> str | None:
    """Why a str is not valid Unicode text (a lone surrogate, which no UTF-8 can hold), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
    return None


def _json_record(arm: ArmSpec, i: int, n: int, where: str, line: bytes | LongLine, read: int) -> Record:
    """One JSON line as a record: the document, or a bad record saying what is wrong with the line."""
    if isinstance(line, LongLine):
        return Record(i, n, None, f"{where}: a line of {line.size:,} bytes, over ANDREA_MAX_LINE_BYTES "
                      f"({line.bound:,})")  # fmt: skip
    try:
        doc = json.loads(line.decode("utf-8"))  # strict: json.loads(bytes) would let surrogates through
    except UnicodeDecodeError as e:
        return Record(i, n, None, f"{where}: not UTF-8 ({e.reason} at byte {e.start})")
    except RecursionError:
        return Record(i, n, None, f"{where}: not valid JSON (nested deeper than the parser allows)")
    except ValueError as e:
        return Record(i, n, None, f"{where}: not valid JSON ({e})")
    if not isinstance(doc, dict) or arm.field not in doc:
        return Record(i, n, None, f"{where}: no field {arm.field!r}")
    value = doc[arm.field]
    if not isinstance(value, str):
        return Record(i, n, None, f"{where}: field {arm.field!r} is {type(value).__name__}, not text")
    problem = unicode_problem(value)
    if problem is not None:
        return Record(i, n, None, f"{where}: field {arm.field!r} is not valid Unicode ({problem})")
    return Record(i, n, value, read=read)


def _read_jsonl(arm: ArmSpec, i: int, f: CorpusFile, skip: int) -> Iterator[Record]:
    n = 0
    try:
        raw = f.fs.open(f.path, "rb")
        with raw, _open_decompressed(f, raw) as stream:
            lines = bounded_lines(stream, limit("ANDREA_MAX_LINE_BYTES"), f.url, READ_CHUNK, skip_long=True)
            for n, line in enumerate(lines):
                if n < skip or (isinstance(line, bytes) and not line.strip()):
                    continue
                # line numbers as an editor shows them
                yield _json_record(arm, i, n, f"{f.url}:{n + 1}", line, raw.tell())
    except TooLarge as e:
        raise _refused(e) from None
    except Exception as e:
        yield Record(i, n + 1, None, f"{f.url}: unreadable after line {n} ({type(e).__name__}: {e})")


def _row_values(column: Any, url: str, first_row: int, name: str) -> list[tuple[str | None, str | None]]:
    """(text, problem) per row of a string column: a value that is not UTF-8 (some writers leave such
    bytes in a string column) is a bad row of its own, not a bad row group."""
    import pyarrow as pa

    try:
        return [(v, None if v is not None else f"{url}: row {first_row + k}: {name!r} is null")
                for k, v in enumerate(column.to_pylist())]  # fmt: skip
    except UnicodeDecodeError:
        pass
    out: list[tuple[str | None, str | None]] = []
    for k, v in enumerate(column.cast(pa.binary()).to_pylist()):
        where = f"{url}: row {first_row + k}: {name!r}"
        if v is None:
            out.append((None, f"{where} is null"))
            continue
        try:
            out.append((v.decode("utf-8"), None))
        except UnicodeDecodeError as e:
            out.append((None, f"{where} is not UTF-8 ({e.reason} at byte {e.start})"))
    return out


def _read_parquet(arm: ArmSpec, i: int, f: CorpusFile, skip: int) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        raw = f.fs.open(f.path, "rb")
        pf = pq.ParquetFile(raw, buffer_size=READ_CHUNK)  # column chunks read 1 MiB at a time
    except Exception as e:
        yield Record(i, 0, None, f"{f.url}: not a readable Parquet file ({type(e).__name__}: {e})")
        return
    with raw:
        names = pf.schema_arrow.names
        rows = pf.metadata.num_rows
        if arm.column not in names:
            problem = f"{f.url}: no column {arm.column!r} (it has {', '.join(names)})"
            yield Record(i, 0, None, problem, count=max(1, rows))
            return
        ctype = pf.schema_arrow.field(arm.column).type
        if not (pa.types.is_string(ctype) or pa.types.is_large_string(ctype)):
            yield Record(
                i, 0, None, f"{f.url}: column {arm.column!r} is {ctype}, not text", count=max(1, rows)
            )
            return
        row = 0
        # One row group at a time: a file larger than memory streams.
        for g in range(pf.num_row_groups):
            n_rows = pf.metadata.row_group(g).num_rows
            if row + n_rows <= skip:
                row += n_rows
                continue
            try:
                values = _row_values(pf.read_row_group(g, columns=[arm.column]).column(0), f.url, row,
                                     arm.column)  # fmt: skip
            except Exception as e:
                yield Record(i, row, None, f"{f.url}: row group {g} unreadable ({e})", count=n_rows)
                row += n_rows
                continue
            for value, problem in values:  # decoded strictly: no surrogate gets through
                if row >= skip:
                    if problem is not None:
                        yield Record(i, row, None, problem)
                    else:
                        yield Record(i, row, value, read=f.size * (row + 1) // max(1, rows))
                row += 1


READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "tokens": lambda *a: iter(())}


# --- token shards --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenShard:
    file: CorpusFile
    dtype: np.dtype
    offset: int  # bytes before the first token (llm.c's header)
    count: int
    split: str  # "train" or "val"


def is_val_shard(name: str) -> bool:
    stem = name[: -len(".bin")] if name.endswith(".bin") else name
    return "val" in re.split(r"[_.\-]", stem)


def inspect_shard(f: CorpusFile) -> TokenShard:
    """The layout of one shard, from its name, header and size; a bad one is refused by name."""
    split = "val" if is_val_shard(f.name) else "train"
    if f.name in NANOGPT_NAMES:
        if f.size % 2:
            raise CorpusError(
                f"{f.url}: {f.size} bytes is not a whole number of uint16 tokens (nanoGPT .bin)"
            )
        return TokenShard(f, np.dtype("<u2"), 0, f.size // 2, split)
    if f.size < LLMC_HEADER_BYTES:
        raise CorpusError(
            f"{f.url}: {f.size} bytes, shorter than the {LLMC_HEADER_BYTES}-byte llm.c shard header"
        )
    head = f.fs.cat_file(f.path, start=0, end=LLMC_HEADER_BYTES)
    magic, version, count = (int(v) for v in np.frombuffer(head, "<i4", count=3))
    if magic not in LLMC_FORMATS:
        raise CorpusError(
            f"{f.url}: bad shard header: magic {magic}, expected 20240520 (llm.c, uint16 tokens) or "
            f"20240801 (uint32 tokens); nanoGPT's headerless files must be named train.bin or val.bin"
        )
    want_version, dtype = LLMC_FORMATS[magic]
    if version != want_version:
        raise CorpusError(
            f"{f.url}: bad shard header: version {version} with magic {magic}, expected {want_version}"
        )
    expected = LLMC_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or f.size != expected:
        raise CorpusError(
            f"{f.url}: wrong size: the header says {count} tokens of {dtype.itemsize} bytes "
            f"({expected} bytes with the header) but the file has {f.size} bytes (truncated?)"
        )
    return TokenShard(f, dtype, LLMC_HEADER_BYTES, count, split)
