"""Tokenizers and per-arm token caches (uint16, memory-mapped, built once, rebuilt on change).

A run's tokenizer never changes during the run: raw bytes need nothing, and a BPE is trained on the
run's own sources when the run is created and frozen into its directory as tokenizer.json. A token
cache is keyed by the source's fingerprint and the tokenizer's id (for a BPE, the hash of its frozen
JSON), so it is reused across restarts and rebuilt exactly when either changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np

from andrea_core.atomic import atomic_file
from andrea_core.config import ConfigError, RunConfig
from andrea_core.data.policy import ARM_NAME_RE, ARM_NAME_RULE, Policy, SourceUnavailable
from andrea_core.data.sources import Source, open_source
from andrea_core.run.rundir import TOKENIZER_JSON, RunDir, cache_dir, open_url

DOC_SEPARATOR = "\n\n"
# Text a BPE is trained on at run creation, over all arms: enough for a few thousand merges, and a
# bound that keeps creating an andrea-12m or -120m run to well under a minute on a small CPU.
BPE_TRAIN_BYTES = 4_000_000
ENCODE_BATCH_DOCS = 256


class Tokenizer(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Raw UTF-8 bytes: vocabulary 256, nothing to train or freeze."""

    id = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @staticmethod
    def to_json() -> bytes:
        """This tokenizer as a Hugging Face tokenizer.json (for `andrea export`): byte-level, token id =
        byte value. GPT-2's ByteLevel pre-tokenizer maps each byte to a printable character (no regex
        split, no prefix space); a BPE with those 256 characters as its vocabulary and no merges then
        gives one token per byte, id for id the values `encode` returns, and ByteLevel decodes back."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        byte_of = {ch: b for b, ch in enumerate(_gpt2_bytes_to_unicode())}
        tok = Tokenizer(models.BPE(vocab=byte_of, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok.to_str().encode()


def _gpt2_bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> character table (openai/gpt-2 encoder.py), the one ByteLevel uses: printable
    bytes stand for themselves, the others are shifted past 255. Index = byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return [table[b] for b in range(256)]


class BPETokenizer:
    """A `tokenizers` tokenizer loaded from its frozen JSON: the per-run byte-level BPE (id `bpe-…`) or
    a user's tokenizer.json (`kind` "hf", id `hf-…`)."""

    def __init__(self, frozen: bytes, kind: str = "bpe"):
        from tokenizers import Tokenizer as HFTokenizer

        self.frozen = frozen
        self._tok = HFTokenizer.from_str(frozen.decode())
        self.id = f"{kind}-" + hashlib.sha256(frozen).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def train_bpe(texts: Iterable[str], vocab_size: int) -> bytes:
    """Train a byte-level BPE of at most `vocab_size` tokens; returns its JSON, ready to freeze.

    Byte-level: every byte is in the initial alphabet, so any text (any language, any binary junk in
    a source file) encodes without an unknown token, and decode(encode(t)) == t.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 256, got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str().encode()


def train_run_bpe(policy: Policy, cfg: RunConfig) -> bytes:
    """The BPE of a new run: trained on the first BPE_TRAIN_BYTES of its arms, shared evenly."""
    per_arm = max(1, min(cfg.data.max_source_bytes, BPE_TRAIN_BYTES // len(policy.arms)))
    texts: list[str] = []
    for spec in policy.arms:
        try:
            texts.extend(open_source(spec, per_arm).documents())
        except SourceUnavailable:
            continue  # the arm is reported when the trainer loads its data
    if not texts:
        raise SourceUnavailable(f"policy {policy.name!r}: no arm has text to train a tokenizer on")
    return train_bpe(texts, cfg.model.vocab_size)


def user_tokenizer(url: str, cfg: RunConfig) -> bytes:
    """A user's Hugging Face tokenizer.json (path or URL), checked before any work: readable, and no
    larger than model.vocab_size. Its bytes are what the run freezes."""
    from andrea_core.bounded import read_bounded
    from andrea_core.config import limit

    where = f"data.tokenizer: {url}"
    try:
        with open_url(url, "rb", "data.tokenizer") as f:
            frozen = read_bounded(f, limit("ANDREA_MAX_SIDECAR_BYTES"), where)
    except ConfigError:
        raise  # the URL gate's refusal, or more bytes than any tokenizer.json holds
    except Exception as e:  # fsspec raises many types; all mean "not usable"
        raise ConfigError(f"{where}: not a readable tokenizer.json ({e})") from None
    _checked_tokenizer(frozen, "hf", f"data.tokenizer: {url}", cfg)
    return frozen


def _checked_tokenizer(frozen: bytes, kind: str, where: str, cfg: RunConfig) -> BPETokenizer:
    """A tokenizer.json's tokenizer, refused (naming `where`) if unreadable or larger than the model's
    vocabulary: a run must never train on ids its embedding does not have."""
    try:
        tok = BPETokenizer(frozen, kind)
    except Exception as e:  # the tokenizers library raises plain Exceptions for a malformed file
        raise ConfigError(f"{where}: not a readable tokenizer.json ({e})") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"{where}: its {tok.vocab_size} tokens exceed model.vocab_size {cfg.model.vocab_size}; "
            f"raise model.vocab_size to at least {tok.vocab_size}"
        )
    return tok


def new_run_tokenizer(policy: Policy, cfg: RunConfig) -> bytes | None:
    """What a new run freezes as its tokenizer.json: nothing for bytes, the BPE trained on its sources,
    or the user's tokenizer.json."""
    if cfg.data.tokenizer == "bytes":
        return None
    if cfg.data.tokenizer == "bpe":
        return train_run_bpe(policy, cfg)
    return user_tokenizer(cfg.data.tokenizer, cfg)


def run_tokenizer(run: RunDir, cfg: RunConfig) -> Tokenizer:
    """The run's frozen tokenizer: raw bytes, or the BPE (or user's tokenizer) in its tokenizer.json."""
    if cfg.data.tokenizer == "bytes":
        return ByteTokenizer()
    kind = "bpe" if cfg.data.tokenizer == "bpe" else "hf"
    if not run.exists(TOKENIZER_JSON):
        what = "the run's BPE" if kind == "bpe" else f"a copy of {cfg.data.tokenizer}"
        raise ConfigError(
            f"{run.path(TOKENIZER_JSON)}: missing; data.tokenizer is {cfg.data.tokenizer} and {what} is "
            "frozen there when the run is created (copy it from the run this one came from)"
        )
    return _checked_tokenizer(run.read_bounded(TOKENIZER_JSON), kind, run.path(TOKENIZER_JSON), cfg)


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for doc in docs:
        batch.append(doc + DOC_SEPARATOR)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def token_cache(source: Source, tokenizer: Tokenizer) -> np.ndarray:
    """The arm's tokens as a read-only uint16 memmap; built on first use, atomically."""
    if tokenizer.vocab_size > 65536:
        raise ValueError(f"tokenizer {tokenizer.id}: {tokenizer.vocab_size} tokens do not fit uint16")
    if not ARM_NAME_RE.fullmatch(source.arm.name):  # checked when the policy loads; this is a file name
        raise ValueError(
            f"arm name {source.arm.name!r} cannot name a token cache: it must be {ARM_NAME_RULE}"
        )
    key = hashlib.sha256(f"{source.fingerprint}|{tokenizer.id}".encode()).hexdigest()[:16]
    path = cache_dir() / f"{source.arm.name}-{key}.u16"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        # Written batch by batch: a 50 MB arm never sits in memory as a list of Python ints. Concurrent
        # builders produce identical files; the last rename wins.
        with atomic_file(path) as f:
            for batch in _batches(source.documents(), ENCODE_BATCH_DOCS):
                for ids in tokenizer.encode_batch(batch):
                    np.asarray(ids, dtype=np.uint16).tofile(f)
                    n += len(ids)
            if n < 1024:
                raise ValueError(f"arm {source.arm.name!r}: only {n} tokens of text")
    return np.memmap(path, dtype=np.uint16, mode="r")
