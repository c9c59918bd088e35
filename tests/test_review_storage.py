"""Issue 14 (storage, retention, stop handling) and issue 18.2: each test reproduces a defect found in
review, against real trainers, a real run directory and the moto S3 server."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import andrea, last_logged_step

from andrea_core.checkpoint import checkpoint_name, encode_header, step_from_name
from andrea_core.config import load_run_config
from andrea_core.run.retention import apply_retention
from andrea_core.run.rundir import RunDir
from andrea_core.train.audit import Auditor
from andrea_core.train.trainer import Trainer
from tests.tiny import tiny_config


def tiny(tmp_path, **overrides):
    return load_run_config(tiny_config(tmp_path, **overrides))


# --- 14.8: one canonical name per step -------------------------------------------------------------


def test_canonical_names_only():
    assert step_from_name("step_000350.bin") == 350
    assert step_from_name("step_1234567.bin") == 1234567  # more digits only when the step needs them
    assert step_from_name("step_0000350.bin") is None
    assert step_from_name("step_0001234567.bin") is None


def test_a_non_canonical_checkpoint_name_is_ignored_with_a_warning_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", config, "--run-dir", str(run_dir), "--max-steps", "20")
    good = (run_dir / checkpoint_name(20)).read_bytes()
    stray = run_dir / "step_0000030.bin"  # 7 digits for step 30: not the name the trainer writes
    stray.write_bytes(encode_header(30, int.from_bytes(good[4:8], "little")) + good[8:])
    run = RunDir(str(run_dir))
    assert run.checkpoint_steps() == [10, 20]
    warnings: list[str] = []
    assert run.checkpoint_steps(warn=warnings.append) == [10, 20]
    assert warnings and "step_0000030.bin" in warnings[0] and "not a canonical checkpoint name" in warnings[0]

    proc = andrea("train", "--run-dir", str(run_dir), "--max-steps", "25", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resuming {run.url} from step_000020.bin" in proc.stdout
    assert "ignoring" in proc.stdout and "step_0000030.bin" in proc.stdout
    assert stray.read_bytes()[:4] == (30).to_bytes(4, "little")  # never moved, never deleted
    assert not (run_dir / "refused").exists()
    plan = apply_retention(run, tiny(tmp_path).retention, None, lambda m: None)
    assert 30 not in plan.delete and stray.exists()


# --- 14.5: a retention error is not a failed checkpoint --------------------------------------------


def test_a_retention_error_is_logged_as_such_and_retried_at_the_next_checkpoint(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, train__checkpoint_every=10, retention__keep_last=2, retention__keep_every=None)
    url = str(tmp_path / "run")
    denied: list[str] = []
    real_remove = RunDir.remove

    def remove(self, name):  # a delete the store denies, once (step 30's retention)
        if not denied:
            denied.append(name)
            raise PermissionError(13, "Permission denied", self.path(name))
        return real_remove(self, name)

    monkeypatch.setattr(RunDir, "remove", remove)
    logged: list[str] = []
    result = Trainer(url, cfg, max_steps=40, device="cpu", log=logged.append).train()
    text = "\n".join(logged)
    assert "NOT written" not in text, text
    assert result.reason == "completed" and result.checkpoint == checkpoint_name(40)
    assert denied == [checkpoint_name(10)]
    assert any(
        line.startswith("ERROR: retention after step_000030.bin failed: PermissionError") for line in logged
    ), text
    # Retried at step 40's checkpoint: the two newest stay, everything older is gone.
    assert RunDir(url).checkpoint_steps() == [30, 40]


# --- 14.4: a stop seen during an off-grid sample audit still checkpoints that step --------------------


def test_sigterm_during_an_off_grid_audit_checkpoints_that_step(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, train__checkpoint_every=20, train__sample_every=3)
    url = str(tmp_path / "run")
    real_record = Auditor.record

    def record(self, step):
        if step == 27:  # an audit off the checkpoint grid: the SIGTERM lands while it runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_record(self, step)

    monkeypatch.setattr(Auditor, "record", record)
    result = Trainer(url, cfg, max_steps=200, device="cpu", log=lambda m: None).train()
    run = RunDir(url)
    assert result.reason == "SIGTERM" and result.step == 27
    assert result.checkpoint == checkpoint_name(27)
    assert run.checkpoint_steps() == [20, 27] and run.read_checkpoint(27).step == 27
    assert last_logged_step(run) == 27  # nothing trained that the checkpoint does not hold


# --- 14.1: a conditional put whose reply is lost ---------------------------------------------------


def drop_first_reply(fs, monkeypatch, which, method: str = "put_object") -> list[str]:
    """Make the store commit a put whose reply never arrives, then receive the SDK's identical retry:
    for the `method` calls (put_object, or the complete of a multipart upload) `which` picks, the real
    request is sent twice and the caller sees only the second answer (on S3, a 412 for a conditional
    put). Returns what each retry answered."""
    real = fs._call_s3
    answers: list[str] = []

    async def call_s3(called, *args, **kwargs):
        if called == method and which(kwargs):
            await real(called, *args, **kwargs)  # committed; the reply is lost on the way back
            try:
                r = await real(called, *args, **kwargs)
            except Exception as e:
                answers.append(type(e.__cause__ or e).__name__ + ": " + str(e))
                raise
            answers.append("ok")
            return r
        return await real(called, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", call_s3)
    return answers


def test_a_loss_log_put_whose_reply_is_lost_stops_no_checkpoint(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny(tmp_path, train__checkpoint_every=10, retention__keep_last=None)
    url = f"{s3_bucket}/run"
    puts = []
    # The trainer holds the lease: its publishes are fenced multipart uploads (objstore.s3_put), whose
    # complete carries the condition (If-Match).
    answers = drop_first_reply(
        RunDir(url).fs,
        monkeypatch,
        lambda kw: kw["Key"].endswith("/.loss.json") and len(puts.append(kw) or puts) == 2,
        method="complete_multipart_upload",
    )
    logged: list[str] = []
    result = Trainer(url, cfg, max_steps=60, device="cpu", log=logged.append).train()
    # The retry of the complete that had committed: the store answers it as done (a complete is
    # idempotent), or refuses its condition (412), which s3_put resolves by reading back its own bytes.
    assert len(answers) == 1 and (
        answers[0] == "ok" or "pre-conditions you specified did not hold" in answers[0]
    ), answers
    text = "\n".join(logged)
    assert "NOT written" not in text, text
    assert result.reason == "completed" and result.step == 60
    run = RunDir(url)
    assert len(puts) >= 6  # one publish per checkpoint at least, every one after the lost reply accepted
    assert run.checkpoint_steps() == [10, 20, 30, 40, 50, 60]
    from andrea_core.run.loss_log import read_history

    assert [e.step for e in read_history(run)] == list(range(1, 61))


def test_a_publish_that_committed_but_failed_is_adopted_at_the_next(tmp_path, s3_bucket, monkeypatch):
    """The put reached the store, then the call failed anyway (retries exhausted on a lost reply): the
    next publish finds the store holding this writer's own earlier bytes and goes on from them."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    from andrea_core.run.objstore import ConcurrentWriteError
    from andrea_core.run.rundir import LOSS_LOG

    run = RunDir(f"{s3_bucket}/run")
    f = run.open_append(LOSS_LOG)
    f.write(b"one\n", durable=True)
    real = run.fs._call_s3

    async def committed_then_failed(method, *args, **kwargs):
        r = await real(method, *args, **kwargs)
        if method == "put_object":
            raise OSError(104, "Connection reset by peer")
        return r

    monkeypatch.setattr(run.fs, "_call_s3", committed_then_failed)
    with pytest.raises(OSError, match="reset"):
        f.write(b"two\n", durable=True)
    monkeypatch.setattr(run.fs, "_call_s3", real)
    assert run.read_bytes(LOSS_LOG) == b"one\ntwo\n"
    f.write(b"three\n", durable=True)
    assert run.read_bytes(LOSS_LOG) == b"one\ntwo\nthree\n"
    f.close()
    # A true foreign write is still refused, and nothing of it is lost.
    g = run.open_append(LOSS_LOG)
    run.write_atomic(LOSS_LOG, b"someone else's\n")
    g.write(b"four\n")
    with pytest.raises(ConcurrentWriteError, match="changed since this process read it"):
        g.publish()
    assert run.read_bytes(LOSS_LOG) == b"someone else's\n"


# --- 18.2: every pending multipart upload is aborted, not the first page ----------------------------


@pytest.fixture(scope="module")
def paged_s3_server():
    import sys
    from pathlib import Path

    from s3_server import start_s3_server

    server = start_s3_server(server=[sys.executable, str(Path(__file__).with_name("moto_paged.py"))])
    yield server
    server.stop()


def test_abort_uploads_pages_through_a_truncated_listing(paged_s3_server):
    import fsspec.asyn

    from andrea_core.run import objstore

    fs = paged_s3_server.client()
    fs.mkdir("paged")
    keys = [f"run/step_{s:06d}.bin" for s in (100, 200, 300)] * 2 + ["run-other/step_000100.bin"]
    for key in keys:
        fs.call_s3("create_multipart_upload", Bucket="paged", Key=key)
    first = fs.call_s3("list_multipart_uploads", Bucket="paged", Prefix="run/")
    assert first["IsTruncated"] and len(first["Uploads"]) == 2  # the server pages at 2
    logged: list[str] = []
    aborted = fsspec.asyn.sync(fs.loop, objstore.s3_abort_uploads, fs, "paged/run", logged.append)
    assert sorted(aborted) == sorted(keys[:6]) and len(logged) == 6
    left = fs.call_s3("list_multipart_uploads", Bucket="paged")
    assert [u["Key"] for u in left.get("Uploads", [])] == ["run-other/step_000100.bin"]
