"""The user's own data as arms: each kind read as its format says, the sharded cache (one builder at a
time), the split by document, bad records, shard headers, tokenizers, and a source that changes or
vanishes; the review's findings (issue 25: a policy's relative paths, an arm unavailable at first load,
compare's held-out set; issue 24.4: the readers' bounds), some through the CLI."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, _env, andrea
from corpus_files import (
    byte_tokens,
    corpus_policy,
    document,
    jsonl_bytes,
    llmc_shard,
    put,
    write_corpus,
    write_text_folder,
    zstd,
)

from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import ConfigError, load_run_config, load_yaml
from andrea_core.data import corpora, shards
from andrea_core.data.changes import DATA_LOG, read_data_log
from andrea_core.data.corpora import CorpusError, is_validation
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy, parse_policy
from andrea_core.data.tokens import DOC_SEPARATOR, BPETokenizer, ByteTokenizer, run_tokenizer
from andrea_core.run.rundir import POLICY_YAML, RunDir
from andrea_core.train.setup import create_run

CFG = load_run_config("andrea-tiny")
QUIET = lambda line: None  # noqa: E731


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test builds its caches from scratch, in shards of 3000 tokens so that arms span several."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ANDREA_SHARD_TOKENS", "3000")


def policy(text: str):
    return parse_policy(load_yaml(text, "policy"), "policy")


def one_arm(line: str):
    return policy(f"name: one\narms:\n  - {line}\n")


def stream(tokens) -> bytes:
    return b"".join(np.asarray(p).astype(np.uint8).tobytes() for p in tokens.parts)


def test_every_kind_is_read_as_its_format_says_and_documents_split_by_identity(tmp_path):
    root = str(tmp_path / "corpus")
    written = write_corpus(root)
    data = DataPipeline(CFG, policy(corpus_policy(root)), QUIET)
    assert sorted(data.arms) == ["llmc", "nano", "notes", "posts", "table"]

    # Document kinds: the cache holds exactly the documents, each in the split its identity hashes to.
    identities = {
        "notes": [(f"doc_{i:03d}.txt.gz:0", d) for i, d in enumerate(written["text"])],
        "posts": [(f"docs.jsonl.zst:{i}", d) for i, d in enumerate(written["jsonl"])],
        "table": [(f"table.parquet:{i}", d) for i, d in enumerate(written["parquet"])],
    }
    for arm, docs in identities.items():
        val = [d for ident, d in docs if is_validation(ident, CFG.data.val_fraction)]
        train = [d for ident, d in docs if not is_validation(ident, CFG.data.val_fraction)]
        assert val and train, arm
        assert stream(data.arms[arm].train) == "".join(d + DOC_SEPARATOR for d in train).encode(), arm
        assert stream(data.arms[arm].val) == "".join(d + DOC_SEPARATOR for d in val).encode(), arm
        assert data.arms[arm].info["shards"] > 3, "3000-token shards: the arm spans several"
        assert data.arms[arm].info["documents"] == len(docs)

    # Tokens kinds: the shards as they are; the ones named val are the validation split.
    for arm, key in (("nano", "nanogpt"), ("llmc", "llmc")):
        for split in ("train", "val"):
            got = np.concatenate(getattr(data.arms[arm], split).parts)
            assert got.dtype == np.uint16 and np.array_equal(got, written[key][split]), (arm, split)

    # A batch is a window of the concatenated stream, across shard boundaries too.
    notes = data.arms["notes"].train
    whole = np.frombuffer(stream(notes), np.uint8)
    offsets = np.array([0, 2990, int(notes.starts[2]) - 1, len(whole) - 65])
    assert np.array_equal(notes.rows(offsets, 65), whole[offsets[:, None] + np.arange(65)])


def test_adding_files_moves_no_document_between_train_and_validation(tmp_path):
    root = str(tmp_path / "corpus")
    write_text_folder(root, n=40)
    arm = one_arm(f'{{name: notes, kind: text, paths: ["{root}/text"]}}')
    before = DataPipeline(CFG, arm, QUIET).arms["notes"]
    write_text_folder(root, n=40, first=40)  # the corpus grows
    after = DataPipeline(CFG, arm, QUIET).arms["notes"]
    assert after.fingerprint != before.fingerprint
    old_val = stream(before.val).decode().split(DOC_SEPARATOR)[:-1]
    new_val = stream(after.val).decode().split(DOC_SEPARATOR)[:-1]
    assert [d for d in new_val if int(d.split(":")[0][4:]) < 40] == old_val  # every old val doc stays val
    old_train = stream(before.train).decode().split(DOC_SEPARATOR)[:-1]
    new_train = stream(after.train).decode().split(DOC_SEPARATOR)[:-1]
    assert [d for d in new_train if int(d.split(":")[0][4:]) < 40] == old_train


def test_an_interrupted_build_resumes_after_its_last_published_shard(tmp_path, monkeypatch):
    root = str(tmp_path / "corpus")
    docs = [document(i, 60) for i in range(400)]
    put(f"{root}/posts.jsonl.gz", gzip.compress(jsonl_bytes(docs)))
    arm = one_arm(f'{{name: posts, kind: jsonl, paths: ["{root}/posts.jsonl.gz"]}}')

    real = shards.batch_encoder
    calls = {"n": 0}

    def dies_after_ten_batches(tokenizer, dtype):
        encode = real(tokenizer, dtype)

        def encode_or_die(texts):
            calls["n"] += 1
            if calls["n"] > 10:
                raise KeyboardInterrupt  # the process is stopped mid-build
            return encode(texts)

        return encode_or_die

    monkeypatch.setattr(shards, "batch_encoder", dies_after_ten_batches)
    with pytest.raises(KeyboardInterrupt):
        DataPipeline(CFG, arm, QUIET)
    (folder,) = (tmp_path / "cache" / "corpora").iterdir()
    published = sorted(p.name for p in folder.glob("*.json"))
    assert published and "manifest.json" not in published
    assert not list(folder.glob(".*.tmp")), "the interrupted shard's temporary files are cleaned up"
    # A half-written shard, as a SIGKILL between its data and its .json leaves it: never read.
    n = len(published)
    (folder / f"{n:06d}.train.u16").write_bytes(b"\x41\x00" * 999)
    (folder / f".{n + 1:06d}.val.123.tmp").write_bytes(b"junk")

    monkeypatch.setattr(shards, "batch_encoder", real)
    lines = []
    resumed = DataPipeline(CFG, arm, lines.append).arms["posts"]
    assert (
        f"arm 'posts': resuming its token cache build after shard {n - 1} (file 1 of 1, record "
        in "\n".join(lines)
    )
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "fresh"))
    whole = DataPipeline(CFG, arm, QUIET).arms["posts"]
    assert stream(resumed.train) == stream(whole.train) and stream(resumed.val) == stream(whole.val)
    assert resumed.info["documents"] == whole.info["documents"] == 400

    # A finished cache that lost a shard (someone cleaned the cache folder) is finished again.
    (folder / "000003.val.u16").unlink()
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    lines.clear()
    again = DataPipeline(CFG, arm, lines.append).arms["posts"]
    assert "lost shards; finishing it again" in "\n".join(lines)
    assert stream(again.train) == stream(whole.train) and stream(again.val) == stream(whole.val)


def test_bad_records_are_counted_and_named_and_more_than_one_percent_refuses_the_arm(tmp_path):
    docs = [document(i, 30) for i in range(1000)]
    bad = {
        3: '{"text": "unterminated',
        17: '{"body": "no text field"}',
        40: '{"text": 42}',
        41: "[1, 2]",
        99: '{"text": null}',
    }
    bad.update({100 + 50 * k: "not json" for k in range(5)})  # 10 bad of 1000: exactly 1%, accepted
    put(str(tmp_path / "ok.jsonl.zst"), zstd(jsonl_bytes(docs, bad)))
    lines: list[str] = []
    data = DataPipeline(
        CFG, one_arm(f"{{name: posts, kind: jsonl, paths: [{tmp_path}/ok.jsonl.zst]}}"), lines.append
    )
    log = "\n".join(lines)
    url = f"{tmp_path}/ok.jsonl.zst"
    assert f"skipping bad record: {url}:4: not valid JSON" in log
    assert f"skipping bad record: {url}:18: no field 'text'" in log
    assert f"skipping bad record: {url}:41: field 'text' is int, not text" in log
    assert f"skipping bad record: {url}:42: no field 'text'" in log
    assert f"skipping bad record: {url}:100: field 'text' is NoneType, not text" in log
    assert "arm 'posts': 10 of 1,000 records (1.00%) are bad (first: " in log and "they were skipped" in log
    assert data.arms["posts"].info["documents"] == 990 and data.arms["posts"].info["bad"] == 10

    bad[500] = "{"  # 11 of 1000: refused
    put(str(tmp_path / "bad.jsonl.zst"), zstd(jsonl_bytes(docs, bad)))
    with pytest.raises(CorpusError) as e:
        DataPipeline(CFG, one_arm(f"{{name: posts, kind: jsonl, paths: [{tmp_path}/bad.jsonl.zst]}}"), QUIET)
    assert "arm 'posts': 11 of 1,000 records (1.10%) are bad (first: " in str(e.value)
    assert "more than 1% of its records are bad, so the arm is refused" in str(e.value)


def test_parquet_rows_that_are_null_or_a_missing_column_are_bad_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [document(i, 30) for i in range(300)]
    pq.write_table(pa.table({"text": docs[:299] + [None]}), tmp_path / "a.parquet", row_group_size=100)
    pq.write_table(pa.table({"body": docs}), tmp_path / "b.parquet")
    lines: list[str] = []
    DataPipeline(CFG, one_arm(f"{{name: t, kind: parquet, paths: [{tmp_path}/a.parquet]}}"), lines.append)
    assert f"skipping bad record: {tmp_path}/a.parquet: row 299: 'text' is null" in "\n".join(lines)
    with pytest.raises(CorpusError, match=rf"{tmp_path}/b.parquet: no column 'text' \(it has body\)"):
        DataPipeline(CFG, one_arm(f"{{name: t, kind: parquet, paths: [{tmp_path}/*.parquet]}}"), QUIET)
    data = DataPipeline(
        CFG, one_arm(f"{{name: t, kind: parquet, column: body, paths: [{tmp_path}/b.parquet]}}")
    )
    assert data.arms["t"].info["documents"] == 300


def test_bad_token_shards_are_refused_naming_the_file_and_what_is_wrong(tmp_path):
    tokens = byte_tokens(1, 5000)
    folder = tmp_path / "llmc"
    folder.mkdir()
    put(f"{folder}/c_val_000000.bin", llmc_shard(tokens[:1000]))
    arm = one_arm(f"{{name: l, kind: tokens, tokenizer: bytes, paths: [{folder}]}}")
    cases = {
        llmc_shard(tokens, magic=20240521): "bad shard header: magic 20240521, expected 20240520",
        llmc_shard(tokens, version=2): "bad shard header: version 2 with magic 20240520, expected 1",
        llmc_shard(tokens)[:-10]: "wrong size: the header says 5000 tokens of 2 bytes (11024 bytes with the "
        "header) but the file has 11014 bytes (truncated?)",
        llmc_shard(tokens, count=6000): "wrong size: the header says 6000 tokens",
        b"\x00" * 100: "100 bytes, shorter than the 1024-byte llm.c shard header",
    }
    for data, problem in cases.items():
        put(f"{folder}/c_train_000001.bin", data)
        with pytest.raises(CorpusError) as e:
            DataPipeline(CFG, arm, QUIET)
        assert str(e.value).startswith(f"{folder}/c_train_000001.bin: {problem}"), str(e.value)
    put(f"{folder}/c_train_000001.bin", llmc_shard(tokens.astype(np.uint32), magic=20240801, version=7))
    loaded = DataPipeline(CFG, arm, QUIET).arms["l"]
    assert loaded.train.parts[0].dtype == np.uint32 and np.array_equal(loaded.train.parts[0], tokens)

    nano = tmp_path / "nano"
    nano.mkdir()
    put(f"{nano}/val.bin", tokens[:500].astype("<u2").tobytes())
    put(f"{nano}/train.bin", tokens.astype("<u2").tobytes()[:-1])
    with pytest.raises(CorpusError, match=rf"^{nano}/train.bin: 9999 bytes is not a whole number of uint16"):
        DataPipeline(CFG, one_arm(f"{{name: n, kind: tokens, tokenizer: bytes, paths: [{nano}]}}"), QUIET)
    put(f"{nano}/train.bin", np.full(100, 300, "<u2").tobytes())
    with pytest.raises(
        CorpusError, match=rf"^{nano}/train.bin: token id 300 is outside the model's vocabulary"
    ):
        DataPipeline(CFG, one_arm(f"{{name: n, kind: tokens, tokenizer: bytes, paths: [{nano}]}}"), QUIET)


def word_tokenizer(path, size: int) -> str:
    """A Hugging Face tokenizer.json of `size` words, made with `tokenizers` in no time."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(" ".join(document(0)).split())))}}
    vocab.update({f"w{i}": i for i in range(len(vocab), size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


def test_a_users_tokenizer_json_is_frozen_checked_against_the_model_and_tokens_arms(tmp_path):
    root = str(tmp_path / "corpus")
    write_text_folder(root, n=40)
    (tmp_path / "p.yaml").write_text(
        f'name: p\narms:\n  - {{name: notes, kind: text, paths: ["{root}/text"]}}\n'
    )
    big = word_tokenizer(tmp_path / "big.json", 70_000)
    cfg = CFG.with_overrides({"data.tokenizer": big, "data.policy": str(tmp_path / "p.yaml")})
    with pytest.raises(
        ConfigError, match=rf"data.tokenizer: {big}: its 70000 tokens exceed model.vocab_size 256"
    ):
        create_run(RunDir(str(tmp_path / "small")), cfg)
    assert not (tmp_path / "small").exists(), "rejected before any work"

    cfg = cfg.with_overrides({"model.vocab_size": 70_000})
    run = RunDir(str(tmp_path / "run"))
    create_run(run, cfg)
    assert run.read_bytes("tokenizer.json") == (tmp_path / "big.json").read_bytes()
    tok = run_tokenizer(run, cfg)
    assert isinstance(tok, BPETokenizer) and tok.id.startswith("hf-") and tok.vocab_size == 70_000
    data = DataPipeline.for_run(run, cfg, QUIET)
    notes = data.arms["notes"]
    assert notes.train.parts[0].dtype == np.uint32, "a vocabulary over 65536 tokens is cached as uint32"
    assert len(notes.train) + len(notes.val) == sum(
        len(tok.encode(d + DOC_SEPARATOR)) for d in written_text(root)
    )

    # A tokens arm declares its tokenizer: the same file is accepted, bytes is a mismatch.
    put(f"{root}/tok/val.bin", np.arange(200, dtype="<u2").tobytes())
    put(f"{root}/tok/train.bin", np.arange(2000, dtype="<u2").tobytes())
    ok = one_arm(f"{{name: pre, kind: tokens, tokenizer: {big}, paths: [{root}/tok]}}")
    assert len(DataPipeline(cfg, ok, QUIET, tok).arms["pre"].train) == 2000
    wrong = one_arm(f"{{name: pre, kind: tokens, tokenizer: bytes, paths: [{root}/tok]}}")
    with pytest.raises(
        CorpusError, match=r"arm 'pre' \(tokens\): its shards were made with tokenizer 'bytes' but"
    ):
        DataPipeline(cfg, wrong, QUIET, tok)
    with pytest.raises(
        CorpusError, match=rf"its shards were made with tokenizer {big!r} but the run's tokenizer is bytes"
    ):
        DataPipeline(CFG, ok, QUIET, ByteTokenizer())


def written_text(root: str) -> list[str]:
    return [document(i) for i in range(40)]


def test_a_changed_source_is_rebuilt_with_a_warning_and_recorded_with_its_step(tmp_path):
    root = str(tmp_path / "corpus")
    write_text_folder(root, n=40)
    put(f"{root}/more/posts.jsonl", jsonl_bytes([document(i, 60) for i in range(100)]))
    text = (
        f'name: p\nmixer: exp3\narms:\n  - {{name: notes, kind: text, paths: ["{root}/text"]}}\n'
        f'  - {{name: posts, kind: jsonl, paths: ["{root}/more/*.jsonl"]}}\n'
    )
    run = RunDir(str(tmp_path / "run"))
    create_run(run, CFG, policy_text=text)

    def start(step: int, trains_to: int) -> tuple[DataPipeline, str]:
        """A trainer start that resumes `step` and checkpoints `trains_to`."""
        lines: list[str] = []
        data = DataPipeline.for_run(run, CFG, lines.append)
        data.resume(step)
        data.save_state(trains_to)
        return data, "\n".join(lines)

    first, _ = start(0, 100)
    assert [(e["step"], e["arm"], e["event"]) for e in read_data_log(run)] == [
        (0, "notes", "loaded"),
        (0, "posts", "loaded"),
    ]
    _, log = start(100, 150)  # nothing changed: nothing recorded
    assert len(read_data_log(run)) == 2 and "changed" not in log

    put(f"{root}/text/doc_999.txt.gz", gzip.compress(document(999).encode()))  # a file is added
    second, log = start(150, 200)
    old, new = first.arms["notes"].fingerprint, second.arms["notes"].fingerprint
    assert (
        f"warning: arm 'notes': its source changed since step 0 (fingerprint {old} -> {new}): its token "
        f"cache was rebuilt for the new source; recorded in {DATA_LOG} at step 150"
    ) in log
    assert document(999).encode() in stream(second.arms["notes"].train) + stream(second.arms["notes"].val)
    entry = read_data_log(run)[-1]
    assert (entry["step"], entry["arm"], entry["event"], entry["previous"], entry["fingerprint"]) == (
        150, "notes", "changed", old, new,
    )  # fmt: skip

    # A resume from before the change (a rollback to checkpoint 100): steps 101.. are trained again, on
    # the new source, so the change is recorded at 100 too; a later resume past it records nothing.
    _, log = start(100, 200)
    entry = read_data_log(run)[-1]
    assert (entry["step"], entry["arm"], entry["event"], entry["previous"], entry["fingerprint"]) == (
        100, "notes", "changed", old, new,
    ) and "recorded in data.jsonl at step 100" in log  # fmt: skip
    _, log = start(120, 200)
    assert read_data_log(run)[-1] == entry and len(read_data_log(run)) == 4 and "changed" not in log

    os.remove(f"{root}/more/posts.jsonl")  # the arm's objects are gone: the zombie case
    third, log = start(200, 250)
    assert list(third.arms) == ["notes"] and "posts" in third.unavailable
    assert (
        "arm 'posts' is unavailable and will not be drawn: arm 'posts' (jsonl): no .jsonl/.ndjson/.json files"
        in log
    )
    assert "warning: zombie arm 'posts' dropped" in log
    entry = read_data_log(run)[-1]
    assert (entry["step"], entry["arm"], entry["event"]) == (200, "posts", "unavailable")


def test_memory_urls_and_globs_reach_the_corpus(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    docs = [document(i, 60) for i in range(100)]
    fs.pipe("/h7-corpus/a/part-0.jsonl", jsonl_bytes(docs[:50]))
    fs.pipe("/h7-corpus/a/part-1.jsonl", jsonl_bytes(docs[50:]))
    fs.pipe("/h7-corpus/a/notes.txt", b"not matched by the glob")
    data = DataPipeline(
        CFG, one_arm("{name: m, kind: jsonl, paths: ['memory://h7-corpus/a/part-*.jsonl']}"), QUIET
    )
    arm = data.arms["m"]
    assert arm.info["documents"] == 100
    text = (stream(arm.train) + stream(arm.val)).decode()
    assert all(d in text for d in docs) and "not matched" not in text
    assert json.loads(jsonl_bytes(docs[:1]))["text"] == docs[0]


def test_data_stats_of_a_run_reports_documents_tokens_and_passes(tmp_path, capsys):
    from andrea_core.cli import main

    root = str(tmp_path / "corpus")
    write_text_folder(root, n=40)
    text = (
        f'name: p\nmixer: exp3\narms:\n  - {{name: notes, kind: text, paths: ["{root}/text"], cap: 0.7}}\n'
        "  - {name: stdlib-code, kind: python-stdlib, floor: 0.3}\n"
    )
    (tmp_path / "p.yaml").write_text(text)
    assert main(["data", "stats", str(tmp_path / "p.yaml")]) == 2
    assert "policy 'p': give --config" in capsys.readouterr().err
    cfg = CFG.with_overrides({"data.max_source_bytes": 100_000})
    run = RunDir(str(tmp_path / "run"))
    create_run(run, cfg, policy_text=text)
    capsys.readouterr()
    assert main(["data", "stats", run.url, "--json"]) == 0
    rows = {r["arm"]: r for r in json.loads(capsys.readouterr().out)}
    notes = rows["notes"]
    run_tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.model.block_size
    assert notes["documents"] == 40 and notes["kind"] == "text" and notes["bad_records"] == 0
    assert notes["train_tokens"] + notes["val_tokens"] == sum(len(d) + 2 for d in written_text(root))
    assert notes["cache_bytes"] == 2 * (notes["train_tokens"] + notes["val_tokens"])
    assert notes["passes_at_cap"] == pytest.approx(0.7 * run_tokens / notes["train_tokens"])
    assert notes["passes_at_floor"] == 0.0
    assert rows["stdlib-code"]["passes_at_floor"] == pytest.approx(
        0.3 * run_tokens / rows["stdlib-code"]["train_tokens"]
    )
    assert main(["data", "stats", run.url]) == 0
    table = capsys.readouterr().out
    assert (
        f"run {run.url}: tokenizer bytes; a run of 300 steps x 8 x 64 tokens = {run_tokens:,} tokens" in table
    )
    assert "\nnotes                text                   40 " in table


@pytest.mark.parametrize("compress", ["", ".gz", ".zst"])
def test_building_shows_progress_with_an_eta_inside_a_single_file(tmp_path, monkeypatch, compress):
    """One large file is the common corpus (a 40 GB .jsonl.zst): its ETA must come from how far
    through that file the build is, not wait for the file to end."""
    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(shards, "BATCH_DOCS", 20)
    monkeypatch.setattr(corpora, "READ_CHUNK", 1 << 14)  # the file is read in many chunks, as a large one is
    # The builder's clock, made to advance 1000 s per reading: at its k-th progress line 1000*k seconds
    # have passed, so each ETA tells how far through the file's stored bytes the build says it is.
    ticks = itertools.count()
    monkeypatch.setattr(shards, "time", types.SimpleNamespace(monotonic=lambda: 1000.0 * next(ticks)))
    root = str(tmp_path / "corpus")
    n, words = (400, 1000) if compress == ".zst" else (400, 200)  # zstandard reads 128 KiB at a time
    raw = jsonl_bytes([document(i, words) for i in range(n)])
    put(f"{root}/posts.jsonl{compress}", {"": raw, ".gz": gzip.compress(raw), ".zst": zstd(raw)}[compress])
    lines: list[str] = []
    DataPipeline(CFG, one_arm(f'{{name: posts, kind: jsonl, paths: ["{root}"]}}'), lines.append)
    progress = [line for line in lines if "building its token cache" in line]
    assert len(progress) >= 10, lines
    etas = [line.rsplit("ETA ", 1)[1] for line in progress]
    assert etas[-1] == "0s" and "documents" in progress[-1] and "tokens/s" in progress[-1]
    assert all(e.endswith("s") and e[:-1].replace(",", "").isdigit() for e in etas[1:]), etas
    # elapsed / (elapsed + ETA): the fraction done, which grows through the file and is 1 only at its end.
    done = [1000 * k / (1000 * k + int(e[:-1].replace(",", ""))) for k, e in enumerate(etas, 1) if e != "?"]
    assert all(a <= b + 1e-4 for a, b in itertools.pairwise(done)), etas  # ETAs: rounded to seconds
    assert done[-1] == 1 and 0 < done[0] < 0.5, etas
    assert len({round(f, 2) for f in done}) >= 3, f"the ETA does not follow the bytes read: {etas}"
    docs = [int(line.split("cache: ")[1].split(" documents")[0].replace(",", "")) for line in progress]
    assert docs == sorted(docs) and docs[-1] == n


def policy_file(folder: Path, name: str, arms: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nmixer: uniform\narms:\n{arms}")
    return str(path)


def one_arm_file(folder: Path, line: str):
    return load_policy(policy_file(folder, "one", f"  - {line}\n"))[0]


def cached_text(arm) -> str:
    return (stream(arm.train) + stream(arm.val)).decode()


# --- issue 25.4 (review): one over-deep JSON line is one bad record -----------------------------------------


def test_an_over_deep_json_line_is_one_bad_record_and_the_rest_of_the_file_is_read(tmp_path):
    docs = [document(i, 30) for i in range(1000)]
    deep = "[" * 100_000 + "]" * 100_000
    put(str(tmp_path / "posts.jsonl"), jsonl_bytes(docs, {600: deep}))
    lines: list[str] = []
    arm = DataPipeline(
        CFG, one_arm_file(tmp_path, f"{{name: posts, kind: jsonl, paths: [{tmp_path}]}}"), lines.append
    )
    posts = arm.arms["posts"]
    assert posts.info["documents"] == 999 and posts.info["bad"] == 1 and posts.info["records"] == 1000
    assert f"skipping bad record: {tmp_path}/posts.jsonl:601: not valid JSON (nested" in "\n".join(lines)
    text = cached_text(posts)
    assert document(999, 30) in text and document(601, 30) in text


# --- issue 25.1 (review): text that is not valid Unicode is a bad record, for every reader and tokenizer ----


def invalid_parquet(docs: list[bytes]) -> bytes:
    """A Parquet file whose string column holds bytes that are not UTF-8 (as some writers leave them)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    b = pa.array(docs, pa.binary())
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), len(b), b.buffers())}), buf,
                   row_group_size=100)  # fmt: skip
    return buf.getvalue()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_text_that_is_not_valid_unicode_is_a_bad_record_in_every_reader(tmp_path, tokenizer):
    from andrea_core.train.setup import create_run

    docs = [document(i, 30) for i in range(300)]
    lines = [json.dumps({"text": d}).encode() for d in docs]
    lines[10] = b'{"text": "emoji cut \\ud83d in half"}'  # valid JSON, not valid Unicode
    lines[20] = b'{"text": "raw bytes \xed\xa0\x80 in half"}'  # an encoded surrogate: not UTF-8
    put(str(tmp_path / "j" / "posts.jsonl.zst"), zstd(b"\n".join(lines) + b"\n"))
    rows = [d.encode() for d in docs]
    rows[150] = b"cut \xed\xa0\x80 here"
    put(str(tmp_path / "p" / "t.parquet"), invalid_parquet(rows))
    text = (
        "name: u\narms:\n"
        f"  - {{name: posts, kind: jsonl, paths: [{tmp_path}/j]}}\n"
        f"  - {{name: table, kind: parquet, paths: [{tmp_path}/p]}}\n"
    )
    cfg = CFG.with_overrides(
        {"data.tokenizer": tokenizer, "model.vocab_size": 256 if tokenizer == "bytes" else 300}
    )
    run = RunDir(str(tmp_path / "run"))
    create_run(run, cfg, policy_text=text)
    log: list[str] = []
    data = DataPipeline.for_run(run, cfg, log.append)
    log_text = "\n".join(log)
    assert f"{tmp_path}/j/posts.jsonl.zst:11: field 'text' is not valid Unicode (a lone surrogate" in log_text
    assert f"{tmp_path}/j/posts.jsonl.zst:21: not UTF-8" in log_text
    assert f"{tmp_path}/p/t.parquet: row 150: 'text' is not UTF-8" in log_text
    assert data.arms["posts"].info["bad"] == 2 and data.arms["posts"].info["documents"] == 298
    assert data.arms["table"].info["bad"] == 1 and data.arms["table"].info["documents"] == 299
    posts = cached_text(data.arms["posts"]) if tokenizer == "bytes" else ""
    assert "emoji cut" not in posts and "raw bytes" not in posts


# --- issue 25.9 (review): a glob that matches folders searches them -----------------------------------------


def test_a_glob_that_matches_folders_searches_them_as_a_folder_path_does(tmp_path):
    for sub in ("A", "B", "C"):
        for i in range(40):
            put(f"{tmp_path}/corpus/{sub}/d{i:02d}.txt", document(i + 100 * ord(sub)).encode())
    counts = {}
    for pattern in ("corpus", "corpus/*", "corpus/[AB]", "corpus/**"):
        arm = one_arm_file(tmp_path, f'{{name: n, kind: text, paths: ["{tmp_path}/{pattern}"]}}')
        counts[pattern] = DataPipeline(CFG, arm, QUIET).arms["n"].info["documents"]
    assert counts == {"corpus": 120, "corpus/*": 120, "corpus/[AB]": 80, "corpus/**": 120}


# --- issue 25.6 (review): a malformed data.jsonl line is skipped and counted --------------------------------


def test_malformed_data_log_lines_are_skipped_and_counted_not_a_traceback(tmp_path):
    put(f"{tmp_path}/corpus/a.txt", document(1, 300).encode())
    text = f"name: p\narms:\n  - {{name: notes, kind: text, paths: [{tmp_path}/corpus]}}\n"
    from andrea_core.train.setup import create_run

    run = RunDir(str(tmp_path / "run"))
    create_run(run, CFG.with_overrides({"data.val_fraction": 0.4}), policy_text=text)
    cfg = CFG.with_overrides({"data.val_fraction": 0.4})
    put(f"{tmp_path}/corpus/b.txt", document(2, 300).encode())
    run.append(DATA_LOG, b'7\n{"arm":"A","fingerprint":"zzz","event":"loaded"}\n[1]\n{"arm": 3, "step": 1}\n')
    lines: list[str] = []
    assert read_data_log(run, lines.append) == []
    assert lines == [f"{run.path(DATA_LOG)}: skipped 4 malformed line(s): lines 1, 2, 3, 4"]
    data = DataPipeline.for_run(run, cfg, QUIET)
    data.resume(0)
    assert [(e["arm"], e["event"]) for e in read_data_log(run)] == [("notes", "loaded")]


# --- issue 25.3 (review): relative corpus paths, frozen; an arm unavailable at first load -------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "andrea_core", *args], capture_output=True, text=True, cwd=cwd, env=_env(),
        timeout=600,
    )  # fmt: skip


def tiny_run(url: str, steps: list[int], policy_text: str) -> RunDir:
    from andrea_core.run.record import run_n_params
    from andrea_core.train.setup import create_run

    run = RunDir(url)
    record = create_run(run, CFG, policy_text=policy_text)
    n = run_n_params(record)
    for step in steps:
        run.write_atomic(checkpoint_name(step), encode(step, np.zeros(3 * n, dtype=np.float32)))
    return run


def test_a_policys_relative_paths_are_resolved_against_its_folder_and_frozen(tmp_path):
    work = tmp_path / "work"
    for i in range(40):
        put(f"{work}/data/notes/d{i:02d}.txt", document(i, 200).encode())
    policy_file(work, "relpol", '  - {name: notes, kind: text, paths: ["data/notes"], floor: 0.3}\n'
                "  - {name: stdlib-code, kind: python-stdlib}\n")  # fmt: skip
    run = tiny_run(
        str(tmp_path / "run"), [100], "name: s\narms:\n  - {name: stdlib-code, kind: python-stdlib}\n"
    )
    # From another folder: the paths are the policy file's, not the shell's.
    proc = cli("pivot", str(tmp_path / "run"), "--policy", "work/relpol.yaml", "--no-restart", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    installed = run.read_text(POLICY_YAML)
    assert f"{work}/data/notes" in installed and '"data/notes"' not in installed
    policy = load_policy(str(work / "relpol.yaml"))[0]
    assert policy.arm("notes").paths == [f"{work}/data/notes"]
    # The trainer (started in the repository root) reads the same files.
    data = DataPipeline.for_run(run, CFG, QUIET)
    assert data.arms["notes"].info["documents"] == 40


def test_an_arm_unavailable_at_first_load_refuses_a_pivot_and_a_new_run_before_anything_is_touched(tmp_path):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    bad = policy_file(work, "gone", '  - {name: notes, kind: text, paths: ["data/notes"], floor: 0.3}\n'
                      "  - {name: stdlib-code, kind: python-stdlib}\n")  # fmt: skip
    run = tiny_run(
        str(tmp_path / "run"), [100], "name: s\narms:\n  - {name: stdlib-code, kind: python-stdlib}\n"
    )
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    proc = cli("pivot", run.url, "--policy", "gone.yaml", "--no-restart", cwd=work)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"andrea: error: policy 'gone': arm 'notes' is unavailable (arm 'notes' (text): no .txt/.md/.rst "
        f"files at {work}/data/notes)"
    ) in proc.stderr
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        Path(REPO / "configs" / "andrea-tiny.yaml")
        .read_text()
        .replace("policy: stdlib-only", f"policy: {bad}")
    )
    assert f"policy: {bad}" in cfg.read_text()
    proc = andrea(
        "train", "--config", str(cfg), "--run-dir", str(tmp_path / "new"), "--max-steps", "1", check=False
    )
    assert proc.returncode == 2 and "arm 'notes' is unavailable" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()


def test_an_arm_unavailable_the_first_time_it_appears_is_recorded_in_the_data_log(tmp_path):
    from andrea_core.train.setup import create_run

    text = (
        "name: p\narms:\n  - {name: stdlib-code, kind: python-stdlib}\n"
        f"  - {{name: notes, kind: text, paths: [{tmp_path}/none]}}\n"
    )
    run = RunDir(str(tmp_path / "run"))
    create_run(run, CFG, policy_text=text)  # as a run made before its arm's data went missing
    data = DataPipeline.for_run(run, CFG, QUIET)
    data.resume(0)
    events = [(e["step"], e["arm"], e["event"]) for e in read_data_log(run)]
    assert events == [(0, "stdlib-code", "loaded"), (0, "notes", "unavailable")]
    assert "no .txt/.md/.rst files" in read_data_log(run)[-1]["why"]
    data = DataPipeline.for_run(run, CFG, QUIET)
    data.resume(100)
    assert len(read_data_log(run)) == 2, "recorded once"


# --- issue 25.2 (review): compare's held-out set is the parent's, and no branch that trained on it is scored


def test_compare_refuses_a_branch_that_trains_on_the_parents_held_out_documents(tmp_path):
    from andrea_core.ops.compare import check_audit, compare_branches
    from andrea_core.ops.fork import BranchSpec, fork

    for sub in ("a", "b"):
        for i in range(40):
            put(
                f"{tmp_path}/notes/{sub}/d{i:02d}.txt", document(i + (0 if sub == "a" else 500), 120).encode()
            )
    narrow = f"name: narrow\narms:\n  - {{name: notes, kind: text, paths: [{tmp_path}/notes/a]}}\n"
    wide = policy_file(tmp_path, "wide", f"  - {{name: notes, kind: text, paths: [{tmp_path}/notes/]}}\n")
    parent = tiny_run(str(tmp_path / "P"), [100], narrow)
    # A branch that reads the held-out files under the parent's paths, and more besides, is fine.
    for i in range(5):
        put(f"{tmp_path}/prose/p{i}.md", (document(900 + i, 200) + "\n").encode())
    extra = policy_file(tmp_path, "extra", f"  - {{name: notes, kind: text, paths: [{tmp_path}/notes/a]}}\n"
                        f"  - {{name: more, kind: prose, paths: [{tmp_path}/prose]}}\n")  # fmt: skip
    check_audit(parent.url, [BranchSpec("base"), BranchSpec("extra", {"data.policy": extra})], 10, 4, None)
    specs = [BranchSpec("base"), BranchSpec("wide", {"data.policy": wide})]
    with pytest.raises(
        ConfigError, match=r"branch 'wide': its arm 'notes' trains on \d+ of the \d+ held-out"
    ):
        check_audit(parent.url, specs, 10, 4, None)
    urls = fork(parent.url, specs, step=100)
    held = [f"d{i:02d}.txt:0" for i in range(40) if is_validation(f"d{i:02d}.txt:0", 0.05)]
    trained = [h for h in held if not is_validation(f"a/{h}", 0.05)]
    assert trained, "the wide branch trains on some of the parent's held-out documents"
    for order in (urls, urls[::-1]):
        with pytest.raises(ConfigError) as e:
            compare_branches(parent.url, order, 100, val_sequences=4, warn=QUIET)
        assert (
            f"branch 'wide': its arm 'notes' trains on {len(trained)} of the {len(held)} held-out documents "
            "of arm 'notes'"
        ) in str(e.value)
    # The CLI says so in one line.
    proc = andrea("compare", *urls, check=False)
    assert proc.returncode == 2 and "andrea: error: " in proc.stderr and "branch 'wide'" in proc.stderr


# --- issue 24.4a/4b (review): decompressed bytes and line lengths bounded as the bytes arrive ---------------


@pytest.mark.parametrize("name", ["posts.jsonl.zst", "posts.jsonl.gz", "notes.txt.gz", "notes.txt.zst"])
def test_a_small_compressed_file_that_expands_past_its_bound_is_refused_by_name(tmp_path, monkeypatch, name):
    from andrea_core.data import corpora

    monkeypatch.setattr(corpora, "EXPANSION_FLOOR_BYTES", 1 << 20)
    monkeypatch.setenv("ANDREA_MAX_EXPANSION", "50")
    body = b'{"text": "' + b"a" * (40 << 20) + b'"}\n' if "jsonl" in name else b"a" * (40 << 20)
    data = gzip.compress(body) if name.endswith(".gz") else zstd(body)
    assert len(data) < 200_000
    put(f"{tmp_path}/c/{name}", data)
    kind = "jsonl" if "jsonl" in name else "text"
    arm = one_arm_file(tmp_path, f"{{name: c, kind: {kind}, paths: [{tmp_path}/c]}}")
    with pytest.raises(CorpusError) as e:
        DataPipeline(CFG, arm, QUIET)
    bound = max(1 << 20, 50 * len(data))
    assert str(e.value) == (
        f"{tmp_path}/c/{name}: expands past {bound:,} bytes (50 times its {len(data):,} stored bytes): "
        "refused as a decompression bomb; set ANDREA_MAX_EXPANSION to allow more"
    )


def test_a_json_line_over_the_line_bound_is_one_bad_record_read_past_as_it_streams(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_MAX_LINE_BYTES", "5000")
    docs = [document(i, 30) for i in range(200)]
    long_line = json.dumps({"text": "x" * 20_000})
    put(f"{tmp_path}/j/posts.jsonl", jsonl_bytes(docs, {4: long_line}))
    lines: list[str] = []
    data = DataPipeline(
        CFG, one_arm_file(tmp_path, f"{{name: j, kind: jsonl, paths: [{tmp_path}/j]}}"), lines.append
    )
    assert (
        f"skipping bad record: {tmp_path}/j/posts.jsonl:5: a line of {len(long_line):,} bytes, over "
        "ANDREA_MAX_LINE_BYTES (5,000)"
    ) in "\n".join(lines)
    assert data.arms["j"].info["documents"] == 199 and data.arms["j"].info["bad"] == 1


# --- issue 25.7 (review): a remote tokens arm copies only the shard that was added --------------------------


def test_a_remote_tokens_arm_copies_only_an_added_shard_and_drops_a_replaced_ones_copy(tmp_path):
    import fsspec
    from corpus_files import byte_tokens, llmc_shard

    fs = fsspec.filesystem("memory")
    root = f"/h25-shards-{os.getpid()}"
    shards = {i: llmc_shard(byte_tokens(i, 20_000)) for i in range(6)}
    fs.pipe(f"{root}/c_val_000000.bin", shards[0])
    for i in range(1, 4):
        fs.pipe(f"{root}/c_train_{i:06d}.bin", shards[i])
    arm = one_arm_file(tmp_path, f"{{name: l, kind: tokens, tokenizer: bytes, paths: ['memory://{root}']}}")
    lines: list[str] = []
    first = DataPipeline(CFG, arm, lines.append).arms["l"]
    size = len(shards[1])
    assert f"arm 'l': copied {4 * size / 1e6:,.1f} MB of token shards" in "\n".join(lines)
    fs.pipe(f"{root}/c_train_000004.bin", shards[4])  # a fifth shard
    lines.clear()
    second = DataPipeline(CFG, arm, lines.append).arms["l"]
    copied = [line for line in lines if "copied" in line]
    assert copied == [f"arm 'l': copied {size / 1e6:,.1f} MB of token shards into {first.info['cache']}"]
    assert second.info["cache"] == first.info["cache"] and len(second.train) == 4 * 20_000
    fs.pipe(f"{root}/c_train_000004.bin", shards[5])  # replaced
    DataPipeline(CFG, arm, QUIET)
    assert len(list(Path(first.info["cache"]).glob("c_train_000004.bin.*"))) == 1
    fs.rm(root, recursive=True)


# --- issue 25.5 (review): memory bounded for text without cut points ----------------------------------------


CHINESE = "数据混合器在下限和上限之间选择每一步的来源，检查点保存权重和动量，恢复的运行逐位看到相同的批次。"


@pytest.mark.parametrize("compressed", [False, True])
def test_text_without_cut_points_is_cut_within_a_bound_and_counted(tmp_path, monkeypatch, compressed):
    from andrea_core.data import corpora, shards

    monkeypatch.setattr(shards, "PIECE_CHARS", 20_000)
    monkeypatch.setattr(corpora, "WHOLE_TEXT_BYTES", 100_000)  # the file streams, never read whole
    chinese = CHINESE * 8000  # 392,000 characters, 1.2 MB, not one exact cut
    english = [document(i, 100) for i in range(20)]
    name = "zh.txt.gz" if compressed else "zh.txt"
    put(f"{tmp_path}/c/{name}", gzip.compress(chinese.encode()) if compressed else chinese.encode())
    for i, doc in enumerate(english):
        put(f"{tmp_path}/c/en{i:02d}.txt", doc.encode())
    seen: list[int] = []
    real = shards.batch_encoder
    monkeypatch.setattr(
        shards, "batch_encoder",
        lambda t, d: (lambda enc: lambda texts: (seen.extend(map(len, texts)), enc(texts))[1])(real(t, d)),
    )  # fmt: skip
    lines: list[str] = []
    cfg = CFG.with_overrides({"data.val_fraction": 0.3})
    arm = DataPipeline(
        cfg, one_arm_file(tmp_path, f"{{name: c, kind: text, paths: [{tmp_path}/c]}}"), lines.append
    )
    data = arm.arms["c"]
    assert max(seen) <= 40_000, "no piece longer than 2 x PIECE_CHARS"
    assert data.info["split_documents"] == 1 and data.info["documents"] == 21
    assert (
        "arm 'c': 1 document(s) had no exact cut within 40,000 characters (text without spaces, or a "
        "tokenizer that admits no cut) and were encoded in pieces of at most that size (9 cuts)"
    ) in "\n".join(lines)
    # Bytes are exact at any cut: the cache is still the documents' bytes.
    assert sorted(cached_text(data).split(DOC_SEPARATOR)[:-1]) == sorted([chinese, *english])


# --- the token cache: one builder at a time (issue 30: a promise no test held the code to)

BUILDER = """
import sys
from andrea_core.config import load_run_config, load_yaml
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import parse_policy
arm = '{name: posts, kind: jsonl, paths: ["%s"]}' % sys.argv[1]
policy = parse_policy(load_yaml(f"name: one\\narms:\\n  - {arm}\\n", "policy"), "policy")
lines = []
data = DataPipeline(load_run_config("andrea-tiny"), policy, lines.append)
built = sum("building its token cache" in line for line in lines)
print(data.arms["posts"].info["cache"], built, len(data.arms["posts"].train), flush=True)
"""


def test_processes_building_one_corpus_cache_at_once_build_it_once(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "posts.jsonl").write_bytes(jsonl_bytes([document(i, 200) for i in range(300)]))
    env = _env() | {"ANDREA_CACHE_DIR": str(tmp_path / "cache"), "ANDREA_SHARD_TOKENS": "3000"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(root)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )  # fmt: skip
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert len({(o[0], o[2]) for o in outs}) == 1, outs  # one cache, the same tokens, for all three
    # One of them built it; the others waited on its lock and read its work (or came after it).
    assert sorted(int(o[1]) > 0 for o in outs) == [False, False, True], outs
