"""Issue 25: corpora, a pivot with relative paths, compare's held-out set, fork overrides; and the corpus
readers' bounds (issue 24, 4a/4b). Real corpora made for the purpose (corpus_files.py), real CLI runs."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, _env, andrea
from corpus_files import document, jsonl_bytes, put, zstd
from test_retention import fabricated_run

from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.config import ConfigError, load_run_config
from andrea_core.data.changes import DATA_LOG, read_data_log
from andrea_core.data.corpora import CorpusError, is_validation
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.data.tokens import DOC_SEPARATOR
from andrea_core.run.rundir import POLICY_YAML, RunDir

CFG = load_run_config("andrea-tiny")
QUIET = lambda line: None  # noqa: E731


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ANDREA_SHARD_TOKENS", "3000")


def policy_file(folder: Path, name: str, arms: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nmixer: uniform\narms:\n{arms}")
    return str(path)


def one_arm(folder: Path, line: str):
    return load_policy(policy_file(folder, "one", f"  - {line}\n"))[0]


def stream(tokens) -> bytes:
    return b"".join(np.asarray(p).astype(np.uint8).tobytes() for p in tokens.parts)


def cached_text(arm) -> str:
    return (stream(arm.train) + stream(arm.val)).decode()


# --- item 4: one over-deep JSON line is one bad record ----------------------------------------------


def test_an_over_deep_json_line_is_one_bad_record_and_the_rest_of_the_file_is_read(tmp_path):
    docs = [document(i, 30) for i in range(1000)]
    deep = "[" * 100_000 + "]" * 100_000
    put(str(tmp_path / "posts.jsonl"), jsonl_bytes(docs, {600: deep}))
    lines: list[str] = []
    arm = DataPipeline(
        CFG, one_arm(tmp_path, f"{{name: posts, kind: jsonl, paths: [{tmp_path}]}}"), lines.append
    )
    posts = arm.arms["posts"]
    assert posts.info["documents"] == 999 and posts.info["bad"] == 1 and posts.info["records"] == 1000
    assert f"skipping bad record: {tmp_path}/posts.jsonl:601: not valid JSON (nested" in "\n".join(lines)
    text = cached_text(posts)
    assert document(999, 30) in text and document(601, 30) in text


# --- item 1: text that is not valid Unicode is a bad record, for every reader and tokenizer ----------


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


# --- item 9: a glob that matches folders searches them ---------------------------------------------


def test_a_glob_that_matches_folders_searches_them_as_a_folder_path_does(tmp_path):
    for sub in ("A", "B", "C"):
        for i in range(40):
            put(f"{tmp_path}/corpus/{sub}/d{i:02d}.txt", document(i + 100 * ord(sub)).encode())
    counts = {}
    for pattern in ("corpus", "corpus/*", "corpus/[AB]", "corpus/**"):
        arm = one_arm(tmp_path, f'{{name: n, kind: text, paths: ["{tmp_path}/{pattern}"]}}')
        counts[pattern] = DataPipeline(CFG, arm, QUIET).arms["n"].info["documents"]
    assert counts == {"corpus": 120, "corpus/*": 120, "corpus/[AB]": 80, "corpus/**": 120}


# --- item 6: a malformed data.jsonl line is skipped and counted -------------------------------------


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


# --- item 3: relative corpus paths, frozen; an arm unavailable at first load ------------------------


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


# --- item 2: compare's held-out set is the parent's, and no branch that trained on it is scored ------


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


# --- item 8: fork overrides validated as a config file's values; a branch that changes nothing -------


@pytest.mark.parametrize(
    "override,error",
    [
        ("train.lr=.inf", r"train\.lr .*finite"),
        ("train.min_lr=.nan", r"train\.min_lr .*finite"),
        ("data={}", r"data: is a section"),
        ("data.max_source_bytes=-1", r"data\.max_source_bytes must be positive"),
    ],
)
def test_a_fork_override_is_validated_as_the_same_value_in_a_config_file(tmp_path, override, error):
    url = str(tmp_path / "run")
    fabricated_run(url, [100])
    proc = andrea("fork", url, "--branch", "b", "--set", override, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("andrea: error: ") and len(proc.stderr.strip().splitlines()) == 1
    import re

    assert re.search(error, proc.stderr), proc.stderr
    assert not (tmp_path / "run-fork100-b").exists()


def test_a_branch_whose_override_changes_nothing_over_its_steps_is_refused_naming_why(tmp_path):
    url = str(tmp_path / "run")
    run = fabricated_run(url, [100, 200])
    record = run.read_text("run.yaml").replace("lr_decay_steps: 2000", "lr_decay_steps: 200")
    assert "lr_decay_steps: 200\n" in record
    run.write_text("run.yaml", record)
    proc = andrea("fork", url, "--branch", "base", "--branch", "hot", "--set", "train.lr=1e-2", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "branch 'hot': train.lr=0.01 changes nothing over the steps it trains (201 to 300): the learning "
        "rate is train.min_lr from train.lr_decay_steps=200 on; set train.min_lr or train.lr_decay_steps"
    ) in proc.stderr
    proc = andrea("fork", url, "--branch", "quiet", "--set", "train.log_every=5", check=False)
    assert proc.returncode == 2 and "branch 'quiet': train.log_every=5 changes nothing" in proc.stderr
    # An override that does change training is accepted.
    andrea("fork", url, "--branch", "hot", "--set", "train.min_lr=1e-3")
    assert (tmp_path / "run-fork200-hot" / "run.yaml").exists()


# --- issue 24, 4a/4b: decompressed bytes and line lengths bounded as the bytes arrive ----------------


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
    arm = one_arm(tmp_path, f"{{name: c, kind: {kind}, paths: [{tmp_path}/c]}}")
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
        CFG, one_arm(tmp_path, f"{{name: j, kind: jsonl, paths: [{tmp_path}/j]}}"), lines.append
    )
    assert (
        f"skipping bad record: {tmp_path}/j/posts.jsonl:5: a line of {len(long_line):,} bytes, over "
        "ANDREA_MAX_LINE_BYTES (5,000)"
    ) in "\n".join(lines)
    assert data.arms["j"].info["documents"] == 199 and data.arms["j"].info["bad"] == 1


# --- item 7: a remote tokens arm copies only the shard that was added --------------------------------


def test_a_remote_tokens_arm_copies_only_an_added_shard_and_drops_a_replaced_ones_copy(tmp_path):
    import fsspec
    from corpus_files import byte_tokens, llmc_shard

    fs = fsspec.filesystem("memory")
    root = f"/h25-shards-{os.getpid()}"
    shards = {i: llmc_shard(byte_tokens(i, 20_000)) for i in range(6)}
    fs.pipe(f"{root}/c_val_000000.bin", shards[0])
    for i in range(1, 4):
        fs.pipe(f"{root}/c_train_{i:06d}.bin", shards[i])
    arm = one_arm(tmp_path, f"{{name: l, kind: tokens, tokenizer: bytes, paths: ['memory://{root}']}}")
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


# --- item 5: memory bounded for text without cut points -------------------------------------------


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
        cfg, one_arm(tmp_path, f"{{name: c, kind: text, paths: [{tmp_path}/c]}}"), lines.append
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
