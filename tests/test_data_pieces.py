"""Long documents are encoded in pieces (bounded memory) only where the pieces' tokens are exactly the
whole document's: checked token for token on real text and on adversarial random text, for the per-run
BPE and for a GPT-2-style tokenizer.json; every other tokenizer gets whole documents, and the builder's
cache of a corpus with one large document equals the whole document's encoding."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from corpus_files import jsonl_bytes, put

from andrea_core.data import shards
from andrea_core.data.corpora import open_corpus
from andrea_core.data.policy import ArmSpec
from andrea_core.data.shards import document_pieces, exact_cuts
from andrea_core.data.tokens import DOC_SEPARATOR, BPETokenizer, ByteTokenizer, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Whitespace of every kind GPT-2's regex treats apart, letters, digits, punctuation, contractions,
# non-ASCII letters and spaces, and an added token: what random text is drawn from.
ALPHABET = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\x1c", "a", "Z", "é", "ß", "日", "7", "42",
            "'s", "'ll", "!", "(", '"', "—", "<|endoftext|>", "x", " def", "\n    "]  # fmt: skip


def real_texts() -> list[str]:
    """Source code, JSON indented by spaces, prose, and whitespace runs: about 200 KB."""
    texts = [(STDLIB / name).read_text(encoding="utf-8") for name in ("json/encoder.py", "textwrap.py")]
    texts.append(json.dumps({"k": [{"a": i, "b": ["x y", "z"] * 3} for i in range(300)]}, indent=3))
    texts.append("words  and\ttabs \n\n\n  lines\r\n" * 400 + "end")
    return texts


@pytest.fixture(scope="module")
def run_bpe() -> BPETokenizer:
    return BPETokenizer(train_bpe(real_texts()[:2], 700))


def gpt2_style(extra: dict | None = None) -> BPETokenizer:
    """A GPT-2-style tokenizer.json (ByteLevel pre-tokenizer and post-processor, <|endoftext|>), made
    with `tokenizers` and then edited as a user's file might differ."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(real_texts()[1:], trainer)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    spec = json.loads(tok.to_str())
    spec.update(extra or {})
    return BPETokenizer(json.dumps(spec).encode(), "hf")


def random_text(rng: np.random.Generator, n: int) -> str:
    return "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), size=n))


def pieces_ids(tok, text: str, size: int) -> list[int]:
    return [i for piece in document_pieces(text, size, exact_cuts(tok) or ()) for i in tok.encode(piece)]


def test_pieces_are_the_whole_text_cut_before_whitespace_that_precedes_printable_ascii():
    text = "alpha beta\n  gamma\t(delta)   é  日本 end"
    pieces = list(document_pieces(text, 3))
    assert "".join(pieces) == text and len(pieces) > 3
    for p in pieces[1:]:
        assert p[0] in " \t\n" and "!" <= p[1] <= "~", pieces
    assert list(document_pieces(text, len(text))) == [text]
    assert list(document_pieces("x" * 1000, 10)) == ["x" * 1000], "no cut point: the text stays whole"


@pytest.mark.parametrize("which", ["run bpe", "gpt-2 style"])
def test_pieces_encode_to_exactly_the_whole_documents_tokens(which, run_bpe):
    tok = run_bpe if which == "run bpe" else gpt2_style()
    assert exact_cuts(tok) == (() if which == "run bpe" else ("<|endoftext|>",))
    for text in real_texts():
        whole = tok.encode(text)
        for size in (17, 300, 4096):
            assert len(list(document_pieces(text, size))) > 1
            assert pieces_ids(tok, text, size) == whole, (text[:40], size)
    rng = np.random.default_rng(9)
    for _ in range(300):
        text = random_text(rng, int(rng.integers(1, 400)))
        whole = tok.encode(text)
        for size in (1, 5, 40):
            assert pieces_ids(tok, text, size) == whole, (text, size)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"normalizer": {"type": "Lowercase"}}, "a normalizer"),
        (
            {
                "pre_tokenizer": {
                    "type": "ByteLevel",
                    "add_prefix_space": True,
                    "trim_offsets": True,
                    "use_regex": True,
                }
            },
            "a prefix space per encode",
        ),  # fmt: skip
        (
            {
                "post_processor": {
                    "type": "TemplateProcessing",
                    "single": [
                        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                    ],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                    "special_tokens": {
                        "<|endoftext|>": {"id": "<|endoftext|>", "ids": [600], "tokens": ["<|endoftext|>"]}
                    },
                }
            },
            "a special token added per encode",
        ),  # fmt: skip
        ({"pre_tokenizer": {"type": "Whitespace"}}, "another pre-tokenizer"),
        (
            {
                "added_tokens": [
                    {
                        "id": 600,
                        "content": "<|endoftext|>",
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": True,
                        "normalized": False,
                        "special": True,
                    }
                ]
            },
            "an added token eating whitespace",
        ),  # fmt: skip
    ],
)
def test_a_tokenizer_that_sees_the_whole_text_gets_whole_documents(change, why):
    tok = gpt2_style(change)
    assert exact_cuts(tok) is None, why
    if why not in ("a normalizer", "another pre-tokenizer"):  # refused for a reason: cut, these differ
        text = "one<|endoftext|>   more\nwords\tend"
        cut = [i for p in document_pieces(text, 1, ("<|endoftext|>",)) for i in tok.encode(p)]
        assert cut != tok.encode(text)


def test_bytes_always_split_exactly():
    assert exact_cuts(ByteTokenizer()) == ()


def test_the_builder_encodes_a_large_document_in_pieces_to_exactly_its_whole_tokens(
    tmp_path, monkeypatch, run_bpe
):
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    big = "\n\n".join(real_texts() * 3)  # about 600 KB: cut into pieces of 256 KB
    docs = ["a small document.", big, "another small one\n"]
    put(f"{tmp_path}/corpus/docs.jsonl", jsonl_bytes(docs))
    seen: list[int] = []
    real = shards.batch_encoder

    def measured(tokenizer, dtype):  # the real encoder, noting the longest text it is handed
        encode = real(tokenizer, dtype)
        return lambda texts: (seen.extend(len(t) for t in texts), encode(texts))[1]

    monkeypatch.setattr(shards, "batch_encoder", measured)
    source = open_corpus(ArmSpec("posts", "jsonl", paths=[f"{tmp_path}/corpus/docs.jsonl"]), 0)
    arm = shards.corpus_cache(source, run_bpe, 0.0, warn=lambda line: None)  # every document trains
    assert len(arm.val) == 0
    got = np.concatenate(arm.train.parts)
    want = [i for d in docs for i in run_bpe.encode(d + DOC_SEPARATOR)]
    assert got.tolist() == want
    assert max(seen) < shards.PIECE_CHARS + 1000 < len(big), "the large document went in pieces"


@pytest.mark.parametrize("which", ["run bpe", "gpt-2 style"])
def test_streamed_pieces_of_any_chunking_encode_to_exactly_the_whole_texts_tokens(which, run_bpe):
    tok = run_bpe if which == "run bpe" else gpt2_style()
    added = exact_cuts(tok)
    rng = np.random.default_rng(5)
    texts = [*real_texts(), *(random_text(rng, 3000) for _ in range(20))]
    for text in texts:
        whole = tok.encode(text)
        for size in (7, 300):
            bounds = np.sort(rng.integers(0, len(text), size=int(rng.integers(1, 60))))
            chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
            pieces = list(shards.streamed_pieces(chunks, size, added))
            assert "".join(pieces) == text
            assert [i for p in pieces for i in tok.encode(p)] == whole, (text[:40], size)
            longest_chunk = max(map(len, chunks))
            assert max(map(len, pieces)) <= 2 * size + longest_chunk + 20 or len(pieces) == 1


def test_a_large_text_file_streams_through_the_builder_to_exactly_its_whole_tokens(
    tmp_path, monkeypatch, run_bpe
):
    """A text file stored larger than WHOLE_TEXT_BYTES is checked in one pass and streamed in chunks in
    a second: never a whole string. Its tokens are the whole document's; a large file that is not
    UTF-8 is a bad record named with the byte, with nothing of it in the cache."""
    import gzip

    from andrea_core.data import corpora

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(corpora, "WHOLE_TEXT_BYTES", 50_000)
    monkeypatch.setattr(corpora, "READ_CHUNK", 4096)
    monkeypatch.setattr(shards, "PIECE_CHARS", 20_000)
    big = "\n\n".join(real_texts() * 3)  # about 290 KB
    smalls = [f"small document {i}.\n" for i in range(150)]  # one bad record in 154 is under 1%
    put(f"{tmp_path}/corpus/a_big.txt", big.encode())
    put(f"{tmp_path}/corpus/b_big.txt.gz", gzip.compress(big.encode(), mtime=0))
    for i, small in enumerate(smalls):
        put(f"{tmp_path}/corpus/c_small_{i:03d}.txt", small.encode())
    put(f"{tmp_path}/corpus/d_bad.txt", big.encode()[:200_000] + b"\xff\xfe" + big.encode()[200_000:])
    seen: list[int] = []
    real = shards.batch_encoder
    monkeypatch.setattr(
        shards, "batch_encoder",
        lambda t, d: (lambda enc: lambda texts: (seen.extend(map(len, texts)), enc(texts))[1])(real(t, d)),
    )  # fmt: skip
    lines: list[str] = []
    for tok in (run_bpe, gpt2_style({"normalizer": {"type": "NFC"}})):  # streamed; joined whole
        seen.clear()
        monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / f"cache-{tok.id}"))
        source = open_corpus(ArmSpec("notes", "text", paths=[f"{tmp_path}/corpus"]), 0)
        arm = shards.corpus_cache(source, tok, 0.0, warn=lines.append)
        got = np.concatenate(arm.train.parts).tolist()
        if exact_cuts(tok) is None:
            whole = big + DOC_SEPARATOR
            pieces = [whole[k : k + 40_000] for k in range(0, len(whole), 40_000)]
            want = [i for p in pieces for i in tok.encode(p)] * 2
            assert got == want + [i for d in smalls for i in tok.encode(d + DOC_SEPARATOR)]
        else:
            assert got == [i for d in (big, big, *smalls) for i in tok.encode(d + DOC_SEPARATOR)]
        assert arm.info["documents"] == 152 and arm.info["bad"] == 1
        if exact_cuts(tok) is not None:
            assert max(seen) < 20_000 + 4096 + 100, "streamed in pieces"
            assert arm.info["split_documents"] == 0
        else:  # no exact cut: pieces of 2 x PIECE_CHARS (issue 25 item 5), counted
            assert max(seen) == 40_000 and arm.info["split_documents"] == 2
    assert any("d_bad.txt: not UTF-8 text (invalid start byte near byte 200000)" in line for line in lines), (
        lines
    )
