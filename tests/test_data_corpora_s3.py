"""Real trainer processes on the user's corpora in the moto S3 server: all five kinds of arm, bit-exact
resume across SIGTERM and SIGKILL on sharded S3-backed arms, and an S3 prefix deleted mid-run."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
from conftest import andrea, last_logged_step, start_trainer, wait_for
from corpus_files import corpus_policy, write_corpus
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name
from andrea_core.data.changes import DATA_LOG, read_data_log
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir

STEPS = 150  # three checkpoints of 50: a SIGTERM off the grid, a SIGKILL past the second
ARMS = {"notes", "posts", "table", "nano", "llmc"}


@pytest.fixture
def corpus(s3_bucket, tmp_path, monkeypatch):
    """The five kinds in S3, a policy over them and an andrea-tiny config; caches of this test only,
    in shards of 2000 tokens so that every document arm spans several."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ANDREA_SHARD_TOKENS", "2000")
    root = f"{s3_bucket}/corpus"
    write_corpus(root)
    (tmp_path / "policy.yaml").write_text(corpus_policy(root))
    cfg = tiny_config(
        tmp_path,
        data__policy=str(tmp_path / "policy.yaml"),
        train__checkpoint_every=50,
        train__max_steps=STEPS,
    )
    return root, cfg


@pytest.mark.slow
def test_five_kinds_in_s3_train_every_arm_and_resume_bit_exactly(corpus, tmp_path):
    root, cfg = corpus
    stats = andrea("data", "prepare", str(tmp_path / "policy.yaml"), "--config", cfg)
    for arm in ARMS:
        assert f"\n{arm} " in stats.stdout, stats.stdout
    assert "building its token cache" in stats.stderr
    again = andrea("data", "stats", str(tmp_path / "policy.yaml"), "--config", cfg)
    assert "building its token cache" not in again.stderr, "stats after prepare rebuilds nothing"
    assert again.stdout == stats.stdout

    a, b = tmp_path / "a", tmp_path / "b"
    out = andrea("train", "--config", cfg, "--run-dir", str(a))
    assert "building its token cache" not in out.stdout + out.stderr, "the prepared caches are used"
    drawn = Counter(e.arm for e in read_history(RunDir(str(a))))
    assert set(drawn) == ARMS, drawn

    # SIGTERM mid-run, then SIGKILL mid-run, then finish: the same final checkpoint, byte for byte.
    proc = start_trainer("--config", cfg, "--run-dir", str(b), "--pace", "0.03", log=tmp_path / "b1.log")
    try:
        wait_for(lambda: last_logged_step(b) >= 60, timeout=300, what="step 60")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        stopped = RunDir(str(b)).checkpoint_steps()[-1]
        assert stopped % 50 != 0
        proc = start_trainer("--run-dir", str(b), "--pace", "0.03", log=tmp_path / "b2.log")
        wait_for(lambda: last_logged_step(b) >= 110, timeout=300, what="step 110")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert last_logged_step(b) < STEPS
    andrea("train", "--run-dir", str(b))
    final = checkpoint_name(STEPS)
    assert RunDir(str(a)).read_bytes(final) == RunDir(str(b)).read_bytes(final)
    assert [(e.step, e.loss, e.arm) for e in read_history(RunDir(str(a)))] == [
        (e.step, e.loss, e.arm) for e in read_history(RunDir(str(b)))
    ]
    assert {e["arm"] for e in read_data_log(RunDir(str(b)))} == ARMS
    assert {e["event"] for e in read_data_log(RunDir(str(b)))} == {"loaded"}, "nothing changed"


@pytest.mark.slow
def test_an_s3_prefix_deleted_mid_run_is_a_zombie_dropped_and_never_pulled(corpus, tmp_path, s3_server):
    root, cfg = corpus
    run = RunDir(str(tmp_path / "run"))
    proc = start_trainer("--config", cfg, "--run-dir", run.url, "--pace", "0.03", log=tmp_path / "1.log")
    try:
        wait_for(lambda: last_logged_step(run) >= 30, timeout=300, what="step 30")
        s3_server.client().rm(f"{root}/llmc", recursive=True)  # the objects vanish under the run
        wait_for(lambda: last_logged_step(run) >= 40, timeout=300, what="step 40")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = run.checkpoint_steps()[-1]
    out = andrea("train", "--run-dir", run.url, "--max-steps", str(stopped + 40))
    log = out.stdout + out.stderr
    assert "arm 'llmc' is unavailable and will not be drawn: arm 'llmc' (tokens): no .bin files at" in log
    assert "warning: zombie arm 'llmc' dropped: its source is unavailable" in log
    resumed = [e for e in read_history(run) if e.step > stopped]
    assert [e.step for e in resumed] == list(range(stopped + 1, stopped + 41))
    assert "llmc" not in {e.arm for e in resumed}, "the zombie was pulled"
    assert {e.arm for e in resumed} == ARMS - {"llmc"}
    entry = read_data_log(run)[-1]
    assert (entry["step"], entry["arm"], entry["event"]) == (stopped, "llmc", "unavailable")
    assert run.exists(DATA_LOG)
