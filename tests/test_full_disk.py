"""A full disk for real (issue 12, item 5): a run on a small tmpfs that fills up under a live trainer.

Training goes on while its checkpoints cannot be written (ENOSPC), the last good checkpoint stays valid
and untouched, .loss.json is never torn except perhaps its last line, and once space is freed the next
checkpoint boundary writes a valid checkpoint again. The mount needs root (CI runs as root); elsewhere
the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from andrea_core.checkpoint import CheckpointError
from andrea_core.run.loss_log import json_lines, read_history
from andrea_core.run.rundir import RunDir
from andrea_core.run.samples import read_audits
from tests.conftest import andrea, start_trainer, wait_for
from tests.full import fill
from tests.tiny import tiny_config

EVERY = 20
# Room for the small sidecars and the loss log but none for a 1.7 MB checkpoint; or none at all, when
# the loss log's appends, the bandit state and the audit fail too.
ROOM_LEFT = {"room-for-sidecars": 256 * 1024, "not-a-byte": 0}


@contextlib.contextmanager
def tmpfs_disk(disk: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs mounted at `disk` (made here) for the block; pytest.skip.Exception, saying
    why, where it cannot be mounted (needs root; CI runs as root)."""
    disk.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root; CI runs as root): {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs_disk(tmp_path / "disk") as disk:
        yield disk


def test_the_filler_fills_the_disk_when_a_writer_took_space_after_it_measured(small_disk, monkeypatch):
    """A live trainer writes between the filler's statvfs and its writes (the CI failure of 9088b60:
    ENOSPC out of the filler's own flush): it stops at ENOSPC, the disk full, instead of failing."""
    import tests.full

    real = os.statvfs
    free = lambda: real(small_disk).f_bavail * real(small_disk).f_frsize  # noqa: E731
    (small_disk / "taken").write_bytes(b"\0" * (free() // 2))  # "the trainer's" half, after the measure
    measured = os.statvfs_result(
        (*real(small_disk)[:4], real(small_disk).f_bavail * 2, *real(small_disk)[5:])
    )
    monkeypatch.setattr(tests.full.os, "statvfs", lambda path: measured)
    for leave in (0, 4096):
        filler = fill(small_disk, leave)
        assert free() == 0, f"leave={leave}: {free()} bytes still free"
        filler.unlink()


def loss_lines_whole_but_last(run: Path) -> None:
    loss_lines_whole_but_last_of((run / ".loss.json").read_bytes())


def loss_lines_whole_but_last_of(data: bytes) -> None:
    _, bad = json_lines(data)
    last = data.rstrip(b"\n").count(b"\n") + 1
    assert all(n == last for n in bad), (
        f".loss.json: torn or malformed line(s) {bad} before its last ({last})"
    )


def valid_checkpoints(run: Path) -> dict[int, bytes]:
    rd, out = RunDir(str(run)), {}
    for step in rd.checkpoint_steps():
        try:
            rd.read_checkpoint(step)
            out[step] = (run / f"step_{step:06d}.bin").read_bytes()
        except (CheckpointError, FileNotFoundError):
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("room", list(ROOM_LEFT))
def test_a_full_disk_stops_checkpoints_not_training_and_they_resume_when_space_is_freed(
    small_disk, tmp_path, room
):
    run = small_disk / "run"
    cfg = tiny_config(
        tmp_path,
        train__checkpoint_every=EVERY,
        train__max_steps=100_000,
        train__log_every=5,
        retention__keep_last=3,
    )
    log = tmp_path / "trainer.log"
    trainer = start_trainer("--config", cfg, "--run-dir", str(run), "--device", "cpu", log=log)
    try:
        wait_for(lambda: len(valid_checkpoints(run)) >= 2, timeout=300, what="two checkpoints")
        filler = fill(small_disk, ROOM_LEFT[room])
        errors = lambda: log.read_text().count("ERROR: checkpoint ")  # noqa: E731
        wait_for(
            lambda: errors() >= 1 or trainer.poll() is not None, timeout=300, what="a refused checkpoint"
        )
        full_at = progress_step(log)  # .loss.json itself stops growing when not a byte is left
        kept = valid_checkpoints(run)
        assert kept, "no valid checkpoint left after the disk filled"
        newest_kept = max(kept)

        # Two more boundaries pass on the full disk: training goes on, nothing new is published.
        wait_for(
            lambda: errors() >= 3 or trainer.poll() is not None, timeout=300, what="more refused checkpoints"
        )
        assert trainer.poll() is None, f"the trainer exited on a full disk:\n{log.read_text()[-3000:]}"
        assert progress_step(log) >= full_at + 2 * EVERY - 5, "training did not go on"
        assert "No space left on device" in log.read_text()
        assert valid_checkpoints(run) == kept, "the last good checkpoints changed on a full disk"
        assert max(RunDir(str(run)).checkpoint_steps()) == newest_kept
        assert not [p.name for p in run.iterdir() if ".tmp." in p.name], "a temporary file was left behind"
        loss_lines_whole_but_last(run)

        # Space freed: the next boundary publishes a valid checkpoint again.
        stuck_at = progress_step(log)
        filler.unlink()
        wait_for(
            lambda: max(valid_checkpoints(run), default=0) > stuck_at,
            timeout=300,
            what="a checkpoint after freeing",
        )
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    loss_lines_whole_but_last(run)
    history = [e.step for e in read_history(RunDir(str(run)))]
    assert history == list(range(1, history[-1] + 1)), "the loss history has a gap"


@pytest.mark.slow
def test_an_audit_a_full_disk_kept_out_of_the_file_is_written_before_the_trainer_exits(small_disk, tmp_path):
    """The soak's finding (issue 28): the disk fills as an audit is written, space comes back, and the
    trainer is stopped before its next audit. The audit it kept in memory is in .samples.json at exit,
    the same audit an uninterrupted run records at that step."""
    run = small_disk / "run"
    cfg = tiny_config(
        tmp_path, train__checkpoint_every=1000, train__sample_every=10, train__max_steps=100_000
    )
    log = tmp_path / "trainer.log"
    trainer = start_trainer("--config", cfg, "--run-dir", str(run), "--device", "cpu", log=log)

    def refused() -> list[int]:
        return [int(s) for s in re.findall(r"audit of step (\d+) was NOT written", log.read_text())]

    try:
        wait_for(
            lambda: 10 in {a["step"] for a in read_audits(RunDir(str(run)))}, timeout=300, what="audit 10"
        )
        filler = fill(small_disk, 0)
        wait_for(lambda: refused() or trainer.poll() is not None, timeout=300, what="a refused audit")
        filler.unlink()
        trainer.send_signal(signal.SIGTERM)  # before the next audit: only the exit can write it
        assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = log.read_text()
    lost = refused()
    written = {a["step"]: a for a in read_audits(RunDir(str(run)))}
    assert lost and set(lost) <= set(written), f"audits {lost} refused, the file has {sorted(written)}"
    assert f"the sample audits of steps {sorted(set(lost))} are written (late)" in text, text[-3000:]
    ref = tmp_path / "reference"
    andrea("train", "--config", cfg, "--run-dir", str(ref), "--max-steps", str(lost[0]), "--device", "cpu")
    assert written[lost[0]] == {a["step"]: a for a in read_audits(RunDir(str(ref)))}[lost[0]]


# --- an object store that refuses puts for a while ---------------------------------------------------

DENY_PUTS = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Deny", "Action": "s3:PutObject", "Resource": "*"}],
}
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


@pytest.fixture
def s3_with_iam(monkeypatch):
    with store_with_iam(monkeypatch) as clients:
        yield clients


@contextlib.contextmanager
def store_with_iam(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """A moto server of its own that checks IAM policies (from its fourth request on), a user allowed
    everything, its keys in this process and in the trainers it starts (set through `monkeypatch`), and
    a bucket, `refusing`: its IAM and S3 clients, as that user. A policy denying s3:PutObject then makes
    the store refuse every put (single and multipart) for real, with 403."""
    import boto3
    import fsspec.config
    from s3_server import CREDENTIALS, start_s3_server

    with monkeypatch.context() as server_env:  # the server's environment only, not the trainers'
        server_env.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "3")
        server = start_s3_server()
    try:
        boot = dict(endpoint_url=server.endpoint, region_name="us-east-1")
        root = {"aws_access_key_id": "root", "aws_secret_access_key": "root"}
        iam = boto3.client("iam", **boot, **root)
        iam.create_user(UserName="trainer")  # requests 1..3 are unauthenticated
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL))
        creds = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        env = {
            **CREDENTIALS,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "FSSPEC_S3_ENDPOINT_URL": server.endpoint,
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        # Its own s3fs instances here: the options are part of fsspec's instance cache key.
        monkeypatch.setitem(
            fsspec.config.conf,
            "s3",
            {"endpoint_url": server.endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]},
        )
        boto3.client("s3", **boot, **creds).create_bucket(Bucket="refusing")
        yield boto3.client("iam", **boot, **creds), boto3.client("s3", **boot, **creds)
    finally:
        server.stop()


def progress_step(log: Path) -> int:
    """The newest step the trainer reported training (its progress lines), 0 before the first."""
    steps = re.findall(r"step (\d+)/", log.read_text())
    return int(steps[-1]) if steps else 0


@pytest.mark.slow
def test_a_store_refusing_puts_stops_checkpoints_not_training_and_they_resume(s3_with_iam, tmp_path):
    iam, s3 = s3_with_iam
    url = "s3://refusing/run"
    run = RunDir(url)
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__max_steps=100_000, train__log_every=5)
    log = tmp_path / "trainer.log"
    trainer = start_trainer("--config", cfg, "--run-dir", url, "--device", "cpu", log=log)

    def valid() -> dict[int, bytes]:
        out = {}
        for step in run.checkpoint_steps():
            try:
                run.read_checkpoint(step)
                out[step] = run.read_bytes(f"step_{step:06d}.bin")
            except (CheckpointError, FileNotFoundError):
                pass
        return out

    try:
        wait_for(lambda: len(valid()) >= 2, timeout=300, what="two checkpoints on the store")
        iam.put_user_policy(UserName="trainer", PolicyName="deny-puts", PolicyDocument=json.dumps(DENY_PUTS))
        errors = lambda: log.read_text().count("ERROR: checkpoint ")  # noqa: E731
        wait_for(
            lambda: errors() >= 1 or trainer.poll() is not None, timeout=300, what="a refused checkpoint"
        )
        refused_at = progress_step(log)
        kept = valid()
        wait_for(
            lambda: errors() >= 3 or trainer.poll() is not None, timeout=300, what="more refused checkpoints"
        )
        assert trainer.poll() is None, (
            f"the trainer exited when puts were refused:\n{log.read_text()[-3000:]}"
        )
        assert progress_step(log) >= refused_at + 2 * EVERY - 5, "training did not go on"
        assert "PermissionError: Access Denied" in log.read_text()
        assert valid() == kept, "the last good checkpoints changed while puts were refused"
        assert not s3.list_multipart_uploads(Bucket="refusing").get("Uploads"), "an upload was left open"

        stuck_at = progress_step(log)
        iam.delete_user_policy(UserName="trainer", PolicyName="deny-puts")
        wait_for(lambda: max(valid(), default=0) > stuck_at, timeout=300, what="a checkpoint once puts work")
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    loss_lines_whole_but_last_of(run.read_bytes(".loss.json"))
    history = [e.step for e in read_history(run)]
    assert history == list(range(1, history[-1] + 1)), "the loss history on the store has a gap"


@pytest.mark.slow
def test_a_stop_on_a_full_disk_says_what_was_not_written_without_a_traceback(small_disk, tmp_path):
    """SIGTERM while not a byte is left: the last checkpoint cannot be written (exit 1, saying so, the
    newest valid one named) and neither can the loss log's last lines: an ERROR line, not a traceback
    (last session's note: the final flush raised out of the trainer)."""
    run = small_disk / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__max_steps=100_000, train__log_every=5)
    log = tmp_path / "trainer.log"
    trainer = start_trainer("--config", cfg, "--run-dir", str(run), "--device", "cpu", log=log)
    try:
        wait_for(lambda: len(valid_checkpoints(run)) >= 1, timeout=300, what="a checkpoint")
        fill(small_disk, 0)
        wait_for(lambda: "ERROR: checkpoint " in log.read_text(), timeout=300, what="a refused checkpoint")
        kept = valid_checkpoints(run)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert f"the newest checkpoint on disk is step_{max(kept):06d}.bin" in text, text[-2000:]
    assert "its last lines could not be written at exit" in text, text[-2000:]
    assert valid_checkpoints(run) == kept
    loss_lines_whole_but_last(run)


def test_commands_on_a_full_disk_say_so_in_one_line_and_change_nothing(small_disk, tmp_path):
    """The chaos soak's tmpfs, filled for good (fault 894 on, 2026-12-04): `andrea pivot`, `andrea fork`
    and a trainer's start died with a traceback (exit 1) on ENOSPC. Each now says it in one line, exit 1
    (a failure to retry once there is room: systemd restarts a trainer), and the run is as it was."""
    run = small_disk / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=5)
    andrea("train", "--config", cfg, "--run-dir", str(run), "--device", "cpu", "--max-steps", "10")
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    filler = fill(small_disk, 0)
    for argv in (
        ["pivot", str(run), "--policy", "tiny-mix", "--no-restart"],
        ["fork", str(run), "--step", "10", "--branch", "b"],
        ["train", "--run-dir", str(run), "--device", "cpu", "--max-steps", "20"],
    ):
        proc = andrea(*argv, check=False)
        assert proc.returncode == 1, (argv, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and "No space left on device" in proc.stderr, proc.stderr
        assert "free space there, then run the command again" in proc.stderr.splitlines()[-1], proc.stderr
        after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
        # The fork's append opened forks.jsonl before its write failed: an empty file, no record in it.
        assert after == before | ({run / "forks.jsonl": b""} if run / "forks.jsonl" in after else {}), argv
    filler.unlink()
    andrea("train", "--run-dir", str(run), "--device", "cpu", "--max-steps", "20")  # room again: it trains on
    assert (run / "step_000020.bin").is_file()


def test_an_s3_runs_appends_wait_on_a_full_cache_and_land_whole_in_order(small_disk, s3_bucket, monkeypatch):
    """Issue 48 (the S3 soak's cache-full, filled under a running trainer): a run on S3 appends to its
    loss log through a mirror in the cache folder (store.MirroredAppendFile). A full cache made the
    mirror's buffered file keep unwritten bytes the handle did not count, so the retry of the lines
    the loss log kept in memory landed after them (repeated, torn), and what was published from then on
    was the mirror's first N bytes, not the file's: the soak's run lost steps 37-75 of its history, and
    its later bandit states and checkpoints differed from the reference's (11 violations). Now a write
    the cache has no room for keeps its unwritten bytes pending, as the local file does, and the
    published file is every line once, in order, once there is room."""
    import errno

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(small_disk))
    run = RunDir(f"{s3_bucket}/run")
    lines = [b'{"step":%d,"loss":%s}\n' % (i, str(1.0 / (i + 1)).encode()) for i in range(1, 6001)]
    sent, failed = [], 0
    with run.open_append(".loss.json") as f:
        f.write(b"".join(lines[:10]), durable=True)
        sent += lines[:10]
        filler = fill(small_disk, 0, prefix="filler-")
        try:
            for i in range(10, len(lines), 500):  # 500 lines (~20 kB) a write: the last page fills mid-write
                chunk = lines[i : i + 500]
                try:
                    f.write(b"".join(chunk))
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    failed += 1
                sent += chunk
                if failed == 3:
                    break
            assert failed == 3, "the cache never filled"
            with pytest.raises(OSError):
                f.write(b"", durable=True)  # nothing published while the pending bytes have no room
        finally:
            filler.unlink()
        f.write(b"", durable=True)  # room again: what was pending lands first, then it is published
    assert run.read_bytes(".loss.json") == b"".join(sent)
