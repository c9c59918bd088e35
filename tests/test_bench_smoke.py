"""Every benchmark that runs on a CPU still runs, at its smallest size (the least steps, repeats and
data that still take each code path), and prints the figures its issue asks for. Not a timed test:
nothing here compares a speed. It exists because a benchmark that broke unnoticed (bench/audit.py
did, when the trainer gained `world`) wastes the rare GPU session that was lent to run it.

None of these is about start-up: each script is run as `python -m bench.NAME` forked warm by a launcher
of this module's (tests/warm_launcher.py, torch and the trainer imported once), a real process with its
own pid and exit status; the processes a script starts itself (trainers, torchrun, its children) are
its own, cold as on an operator's machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, _env

pytestmark = pytest.mark.slow
NUMBER = r"[\d,]+(?:\.\d+)?"
_launcher = None


@pytest.fixture(scope="module", autouse=True)
def bench_launcher():
    """This module's fork server (the bench package among its preloads, so `-m bench.NAME` runs warm),
    stopped when the module ends; none under ANDREA_WARM_LAUNCHER=0 (every script cold)."""
    global _launcher
    if os.environ.get("ANDREA_WARM_LAUNCHER", "1") == "0":
        yield None
        return
    from warm_launcher import ANDREA_PRELOAD, WarmLauncher

    _launcher = WarmLauncher([*ANDREA_PRELOAD, "bench"], _env(), str(REPO))
    try:
        yield _launcher
    finally:
        _launcher.stop()
        _launcher = None


def bench(*args: str, timeout: float = 600) -> str:
    """`python -m bench.NAME ARGS` for bench/NAME.py (args[0]), warm where the launcher can fork it."""
    argv = [sys.executable, "-m", f"bench.{args[0].removesuffix('.py')}", *args[1:]]
    proc = (_launcher.run if _launcher else subprocess.run)(
        argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env()
    )
    assert proc.returncode == 0, (
        f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_train_throughput_prints_every_arm_and_ratio(tmp_path):
    out = bench("train_throughput.py", "--device", "cpu", "--config", "andrea-tiny", "--rounds", "1",
                "--round-steps", "10", "--checkpoint-every", "10", "--skip", "2", "--with-sync",
                "--threads", "1", "--run-root", str(tmp_path),
                "--variant", "fused loss:train.loss_chunk_tokens=128",
                "--variant", "audit async:train.sample_every=10,train.audit_async=true")  # fmt: skip
    assert re.search(rf"v/b = {NUMBER}\s+\(fused loss: \{{'train.loss_chunk_tokens': 128\}}\)", out), out
    assert re.search(rf"v/b = {NUMBER}\s+\(audit async: .*'train.audit_async': True\}}\)", out), out
    for arm in (
        "(a) plain loop",
        "(b) trainer",
        "(c) trainer + checkpoints",
        "(d) trainer + sync checkpoints",
        "(v) fused loss",
    ):
        assert re.search(rf"{re.escape(arm)}\s+{NUMBER}\s+{NUMBER}%", out), (arm, out)
    for ratio in ("b/a", "c/b", "d/b"):
        assert re.search(rf"{ratio} = {NUMBER}", out), (ratio, out)
    assert re.search(rf"sample audit: {NUMBER} ms = {NUMBER} steps of \(b\)", out), out
    assert re.search(rf"per checkpoint: loop blocked in save\(\) {NUMBER} ms", out), out


def test_audit_prints_before_after_and_the_speed_up():
    out = bench("audit.py", "--config", "andrea-tiny", "--repeats", "1", "--steps", "1", "--threads", "1")
    for part in ("training step", "validation, before", "validation, after", "generation, before",
                 "generation, after", "audit before", "audit after"):  # fmt: skip
        assert re.search(rf"{re.escape(part)}.*{NUMBER} ms", out), (part, out)
    assert re.search(rf"speed-up: audit {NUMBER}x, generation {NUMBER}x, validation {NUMBER}x", out), out


def test_data_prepare_prints_both_baselines_the_ratio_and_the_peak_rss(tmp_path):
    out = bench("data_prepare.py", "--sizes-mb", "1", "--workdir", str(tmp_path / "work"))
    assert re.search(rf"\(a\) tokenizers encode_batch: {NUMBER} tokens", out), out
    assert re.search(rf"\(a'\) encode_batch_fast: {NUMBER} tokens", out), out
    assert re.search(rf"b/a = {NUMBER}\s+b/a' = {NUMBER}\s+builder peak RSS {NUMBER} MiB", out), out
    assert "NOTE: token counts differ" not in out, "the builder and the tokenizer must agree on every token"


def test_data_path_at_the_120m_shape_prints_batches_per_second_against_the_h200_step():
    out = bench("data_path.py", "--shape-120m", "--corpus-mb", "2", "--shard-mb", "1", "--batches", "20")
    assert re.search(rf"data path: {NUMBER} batches/s", out), out
    assert re.search(rf"delivers {NUMBER}x the batches it consumes", out), out


def test_checkpoint_io_and_loss_log_print_their_figures(tmp_path):
    out = bench("checkpoint_io.py", "--config", "andrea-tiny", "--repeats", "1", "--dir", str(tmp_path))
    for what in ("write", "read \\(cold\\)", "read \\(warm\\)"):
        assert re.search(rf"{what}: project {NUMBER} MB/s vs raw {NUMBER} MB/s, ratio {NUMBER}", out), out
    out = bench("loss_log.py", "--entries", "2000", "--dir", str(tmp_path))
    assert re.search(rf"append .* {NUMBER} s .* target < 2 s", out), out
    assert re.search(rf"read the canonical history\s+{NUMBER} s .* target < 1 s", out), out


def test_checkpoint_checksum_prints_every_hash_and_each_ratio(tmp_path):
    out = bench("checkpoint_checksum.py", "--params", "100000", "--repeats", "1", "--dir", str(tmp_path))
    for name in ("zlib.crc32", "hashlib.blake2b", "hashlib.sha256", "numpy xor of uint64"):
        assert re.search(rf"hash {re.escape(name)}\s+{NUMBER} ms\s+{NUMBER} GB/s", out), out
    for what in ("encode", "decode", "write", "read \\(cold\\)", "read \\(warm\\)"):
        assert re.search(rf"{what}\s+legacy .* checksummed .* time ratio\s+{NUMBER}", out), out


def test_source_listing_lists_each_arm_kind_three_ways_and_prints_the_ratio():
    """The bench itself asserts the three listings equal; here each arm's row and its ratio."""
    out = bench("source_listing.py", "--repeats", "1")
    for arm in ("stdlib", "docstrings \\(default packages\\)", "docstrings \\(tiny-mix", "prose"):
        assert re.search(rf"^{arm}.*\s(\d+)\s+({NUMBER} \(\s*{NUMBER}\)\s+){{3}}{NUMBER}x$", out, re.M), out


def test_dashboard_prints_before_now_and_the_status_read():
    out = bench("dashboard.py", "--steps", "600", "--segments", "3", "--repeats", "1")
    assert "dashboard of a run of 600 steps in 3 segments" in out, out
    assert re.search(rf"before \(.*\): {NUMBER} s", out), out
    assert re.search(rf"now \(.*\):\s+{NUMBER} s\s+\({NUMBER}x\)", out), out
    assert re.search(rf"now \(the log's end.*\): {NUMBER} s\s+\({NUMBER}x\)", out), out


def test_ddp_overhead_prints_the_flag_all_reduce():
    out = bench("ddp_overhead.py", "--config", "andrea-tiny", "--nproc", "2", "--steps", "5", "--skip", "2",
                "--flag-iterations", "10")  # fmt: skip
    assert re.search(rf"\(a\) 1 process, batch 8:\s+{NUMBER} ms/step", out), out
    assert re.search(rf"\(b\) 2 ranks, global batch 16:\s+{NUMBER} ms/step", out), out
    assert re.search(rf"\(c\) flag all-reduce: {NUMBER} us per step", out), out


def test_divergence_prints_the_three_runs_and_the_clean_headroom():
    out = bench("divergence.py", "--steps", "30", "--checkpoint-every", "10")
    for arm in ("lr 1, guard on", "lr 1, guard off", "lr 0.003 (sane), guard on"):
        row = rf"{re.escape(arm)}\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+( \+stop)?\s+{NUMBER}"
        assert re.search(row, out), (arm, out)
    out = bench("divergence.py", "--clean", "30")
    assert re.search(r"false-positive rate: 0 / 30 steps", out), out
    assert re.search(rf"loss\s+x{NUMBER} of its median at step \d+", out), out


def test_peer_nanogpt_runs_the_andrea_side_alone_without_a_checkout(tmp_path):
    """No nanoGPT checkout in CI: the andrea side runs (a round, a final run and its validation loss on
    nanoGPT's estimator) and the nanoGPT side says loudly that it was skipped; nothing is fetched."""
    out = bench("peer_nanogpt.py", "--pairs", "1", "--round-steps", "9", "--skip", "2", "--window", "3",
                "--final-steps", "9", "--threads", "1", "--chars", "200000",
                "--workdir", str(tmp_path))  # fmt: skip
    text = rf"text: 200,000 characters of Python .*, {NUMBER} distinct; train 180,000, val 20,000"
    assert re.search(text, out), out
    assert re.search(rf"B1 andrea\s+median\s+{NUMBER} ms\s+mean\s+{NUMBER} ms\s+\(load {NUMBER}", out), out
    assert "SKIPPED the nanoGPT side: no --nanogpt DIR given" in out, out
    assert "nanoGPT  SKIPPED: no --nanogpt DIR given" in out, out
    assert re.search(rf"andrea\s+val loss {NUMBER} \(the same estimator\)\s+median step {NUMBER}", out), out
    assert re.search(rf"its audit's val loss {NUMBER}", out), out
    # nanoGPT's ids (prepare.py: indices of the sorted distinct characters) and andrea's bytes are the
    # same characters, split at the same place.
    ng, an = tmp_path / "nanogpt-data", tmp_path / "andrea-data"
    splits = {
        s: (np.fromfile(ng / s, np.uint16), np.fromfile(an / s, np.uint16)) for s in ("train.bin", "val.bin")
    }
    vocab = np.unique(np.concatenate([b for _, b in splits.values()]))
    assert vocab.max() < 128  # ASCII: one byte a character
    for ids, raw in splits.values():
        assert np.array_equal(np.searchsorted(vocab, raw), ids)


def test_s3_requests_counts_each_kind_and_every_fenced_publish_is_an_upload():
    out = bench("s3_requests.py", "--checkpoints", "2", "--every", "2")  # 14 CPU-s where every 5 took 19
    rows = {k: float(v) for k, v in re.findall(rf"^  ([a-z ]+?)\s+({NUMBER})$", out, re.M)}
    assert rows["all"] == pytest.approx(sum(v for k, v in rows.items() if k != "all"), abs=0.2), out
    # The holder's publishes are multipart uploads (abortable by a taker): created, one part, completed.
    assert rows["create upload"] == rows["upload part"] == rows["complete upload"] >= 4, out
