"""Run directories on any fsspec filesystem, against a real local S3 server (moto, own process)."""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import fsspec.config
import numpy as np
import pytest
from conftest import TINY, andrea, flock_held_elsewhere, library_run, start_trainer, wait_for

from andrea_core import cli
from andrea_core.checkpoint import checkpoint_name, decode, step_from_name
from andrea_core.config import load_run_config
from andrea_core.faults import REPLACE_HELD as TEST_HOLD_ENV
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.ops.pivot import pivot_run_directory
from andrea_core.run.lineage import fork_records
from andrea_core.run.loss_log import LossWriter, canonical, parse_lines, read_history
from andrea_core.run.objstore import ConcurrentWriteError
from andrea_core.run.rundir import FORKS, LOCK, LOSS_LOG, RunDir
from andrea_core.train.trainer import Trainer
from tests.tiny import tiny_config as tiny_config_file

MiB = 2**20


def run_urls(tmp_path: Path, s3_bucket: str) -> dict[str, str]:
    return {
        "path": str(tmp_path / "run"),
        "file": f"file://{tmp_path}/run",
        "memory": f"memory://{tmp_path.name}/run",
        "s3": f"{s3_bucket}/runs/run",
    }


def uploads_in_progress(s3_server, bucket_url: str) -> list[str]:
    bucket = bucket_url.removeprefix("s3://").split("/")[0]
    listing = s3_server.client().call_s3("list_multipart_uploads", Bucket=bucket)
    return [u["Key"] for u in listing.get("Uploads", [])]


@pytest.fixture
def small_parts(monkeypatch):
    """Make s3fs (and so RunDir) upload in 5 MiB parts, S3's minimum, instead of 50 MiB."""
    monkeypatch.setitem(fsspec.config.conf.setdefault("s3", {}), "default_block_size", 5 * MiB)


@pytest.mark.parametrize("kind", ["path", "file", "memory", "s3"])
def test_write_atomic_and_append_on_every_filesystem(kind, tmp_path, s3_bucket):
    run = RunDir(run_urls(tmp_path, s3_bucket)[kind])
    run.makedirs()
    floats = np.arange(1000, dtype="<f4")
    run.write_atomic("step_000001.bin", [b"header!!", memoryview(floats)])  # float views count floats
    assert run.read_bytes("step_000001.bin") == b"header!!" + floats.tobytes()
    run.write_atomic("step_000001.bin", b"replaced")
    assert run.read_bytes("step_000001.bin") == b"replaced"
    assert run.listdir() == ["step_000001.bin"]  # no temporary left behind
    run.append(FORKS, b"one\n", durable=True)
    run.append(FORKS, b"two\n", durable=True)
    assert run.read_bytes(FORKS) == b"one\ntwo\n"
    assert RunDir(run.url).read_bytes(FORKS) == b"one\ntwo\n"  # the canonical URL names the same place


def test_large_checkpoint_is_streamed_as_one_multipart_upload(s3_bucket, s3_server, small_parts):
    run = RunDir(f"{s3_bucket}/run")
    floats = np.random.default_rng(0).random(3 * MiB // 4 * 4, dtype=np.float32)  # 12 MiB
    run.write_atomic("step_000100.bin", [b"12345678", memoryview(floats)])
    assert run.read_bytes("step_000100.bin") == b"12345678" + floats.tobytes()
    # An S3 ETag "<md5>-N" is the mark of an N-part upload: 12 MiB + 8 B in 5 MiB parts, the last
    # part taking the remainder (never under S3's minimum).
    assert run.fs.info(run.path("step_000100.bin"))["ETag"].strip('"').endswith("-2")
    assert uploads_in_progress(s3_server, s3_bucket) == []


def test_failed_multipart_upload_is_aborted_and_publishes_nothing(s3_bucket, s3_server, small_parts):
    run = RunDir(f"{s3_bucket}/run")
    run.write_atomic("step_000100.bin", b"the previous, complete version")
    chunk = np.ones(4 * MiB // 4, dtype=np.float32)

    def snapshot_that_fails():  # the writer fails after two parts have gone up
        for _ in range(4):
            yield memoryview(chunk)
        raise RuntimeError("snapshot failed mid-checkpoint")

    with pytest.raises(RuntimeError, match="snapshot failed"):
        run.write_atomic("step_000100.bin", snapshot_that_fails())
    assert run.read_bytes("step_000100.bin") == b"the previous, complete version"
    assert uploads_in_progress(s3_server, s3_bucket) == []  # aborted: no stored, billed parts


def test_discard_incomplete_writes_aborts_only_this_runs_uploads(s3_bucket, s3_server):
    client = s3_server.client()
    bucket = s3_bucket.removeprefix("s3://")
    for key in ("run/step_000200.bin", "run-fork100-a/step_000200.bin"):
        client.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    logged = []
    assert RunDir(f"{s3_bucket}/run").discard_incomplete_writes(logged.append) == ["run/step_000200.bin"]
    assert uploads_in_progress(s3_server, s3_bucket) == ["run-fork100-a/step_000200.bin"]
    assert "run/step_000200.bin" in logged[0]


def no_such_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above every pid this kernel hands out


def test_local_discard_incomplete_writes_removes_dead_temporaries(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / f".step_000200.bin.tmp.{no_such_pid()}").write_bytes(b"half a checkpoint")
    (tmp_path / "step_000100.bin").write_bytes(b"kept")
    assert run.discard_incomplete_writes(lambda m: None) == [f".step_000200.bin.tmp.{no_such_pid()}"]
    assert run.listdir() == ["step_000100.bin"]


def test_discard_keeps_a_temporary_whose_writer_lives_here_or_holds_its_flock(tmp_path):
    """A temporary is a dead writer's only once its flock is free and its pid is gone: one named by a
    pid that means nothing here (another pid namespace) but flocked by a live process is kept, as is
    one of a live pid that has not taken its flock yet (between its create and its flock)."""
    run = RunDir(tmp_path)
    elsewhere = tmp_path / f".policy.yaml.tmp.{no_such_pid()}.0123456789abcdef"
    elsewhere.write_bytes(b"name: half-wr")
    live = subprocess.Popen(["sleep", "600"])
    unlocked = tmp_path / f".pivot.json.tmp.{live.pid}.fedcba9876543210"
    unlocked.write_bytes(b"{")
    try:
        with flock_held_elsewhere(elsewhere):
            assert run.discard_incomplete_writes(lambda m: None) == []
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted([elsewhere.name, unlocked.name])
    finally:
        live.kill()
        live.wait()
    assert sorted(run.discard_incomplete_writes(lambda m: None)) == sorted([elsewhere.name, unlocked.name])
    assert run.listdir() == []


REPLACE_LOCK = """
import sys
from andrea_core.run.rundir import LOCK, RunDir
run = RunDir(sys.argv[1])
data, version = run.read_versioned(LOCK)
run.replace_if_unchanged(LOCK, b'{"theirs": 2}', version)
"""


def test_a_lock_holders_discard_leaves_another_processs_write_in_flight_alone(tmp_path):
    """The race CI met (a trainer of three started at once on a new run died with ENOENT renaming its
    `.trainer.json` temporary): the process holding the lock clears dead writers' temporaries while
    another process, whole and alive, is between writing its temporary and renaming it. Its write must
    go through."""
    run = RunDir(tmp_path / "run")
    run.create_exclusive(LOCK, b'{"ours": 1}')
    held = tmp_path / "held"
    writer = subprocess.Popen(
        [sys.executable, "-c", REPLACE_LOCK, run.url],
        env={**os.environ, TEST_HOLD_ENV: str(held)},  # it pauses with its temporary written
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(held.exists, timeout=60, what="the other writer's temporary")
    (temporary,) = [n for n in run.listdir() if ".tmp." in n]  # the write in flight to race with
    with open(run.path(temporary), "rb") as f, pytest.raises(BlockingIOError):
        fcntl.flock(
            f, fcntl.LOCK_EX | fcntl.LOCK_NB
        )  # its writer holds its flock (seen from any pid namespace)
    assert run.discard_incomplete_writes(lambda m: None) == []
    assert writer.wait(timeout=60) == 0, writer.stderr.read()
    assert run.read_bytes(LOCK) == b'{"theirs": 2}'
    assert run.listdir() == [LOCK]


def line(step: int, segment: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step,
        "lr": 1e-3,
        "arm": "a",
        "tokens": 8,
        "segment": segment,
        "time": 0,
    }


def test_an_s3_run_file_is_read_in_one_bounded_get_and_one_over_its_bound_is_refused_unread(
    s3_bucket, s3_server, monkeypatch
):
    """A sidecar (and the lock, read with its version) is one GET whose answer names the object's size
    before its body is read (Content-Range): over the bound it is refused, naming file, size and
    bound, its body left unread (the slow relay took a chunk or two of its 3 MiB off the server); an
    empty one is b""."""
    from s3_server import ThrottledLink

    from andrea_core.config import ConfigError

    writer = RunDir(f"{s3_bucket}/run")
    writer.write_text(FORKS, "x" * 3 * MiB)
    writer.write_text(LOCK, "y" * 3 * MiB)  # a forged lock: its renewal read it whole before
    writer.write_text("empty.json", "")
    link = ThrottledLink(s3_server.port, rate=100_000)  # 3 MiB would take 30 s
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", link.endpoint)
    monkeypatch.setitem(fsspec.config.conf.setdefault("s3", {}), "endpoint_url", link.endpoint)
    try:
        run = RunDir(f"{s3_bucket}/run")
        assert run.fs.endpoint_url == link.endpoint
        monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", "1000")
        received = link.received
        for read in (lambda: run.read_bytes(FORKS), lambda: run.read_versioned(LOCK)):
            name = FORKS if received == link.received else LOCK
            with pytest.raises(ConfigError, match=rf"{name}: {3 * MiB} bytes, more than the limit of 1000"):
                read()
        assert link.received - received < MiB, "the refused bodies were not read"
        assert run.read_bytes("empty.json") == b"" and run.read_versioned("empty.json")[0] == b""
        monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", str(4 * MiB))
        assert writer.read_versioned(LOCK)[0] == b"y" * 3 * MiB  # under it: whole (directly, not slowly)
    finally:
        link.close()


def record_s3_calls(run: RunDir, monkeypatch, arg: str) -> list[str]:
    """ "METHOD VALUE" of each request the run's s3fs makes from now on (VALUE: its argument `arg`, e.g.
    Range), in order; s3fs shares its instance, so the recorder is undone after the test."""
    calls: list[str] = []
    call_s3 = run.fs._call_s3

    async def recorded(method, *args, **kwargs):
        calls.append(f"{method} {kwargs.get(arg, '')}".strip())
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(run.fs, "_call_s3", recorded)
    return calls


def test_an_s3_checkpoint_is_read_in_two_gets_and_the_vectors_get_the_readers_verdicts(
    s3_bucket, monkeypatch
):
    """The hand-made vectors (tests/test_checkpoint.py's EXPECTED), each in a run folder on moto: the
    reader gives each the verdict it gives the bytes. A checkpoint is two GETs (its header, whose
    answer names the size, then the rest pinned to the header's ETag), no HEAD; one whose size is not
    the one its header promises (3 MiB claiming 10 parameters here) is refused after the header alone;
    one replaced between the two GETs is refused as not one version."""
    from test_checkpoint import EXPECTED, VECTORS

    from andrea_core.checkpoint import CheckpointError

    run = RunDir(f"{s3_bucket}/vectors")
    call_s3 = run.fs._call_s3
    calls = record_s3_calls(run, monkeypatch, "Range")
    for rel, problem in EXPECTED.items():
        data = (VECTORS / rel).read_bytes()
        folder, _, name = rel.rpartition("/")
        run.write_atomic(rel, data)
        calls.clear()
        if problem is None:
            ckpt = run.read_checkpoint(step_from_name(name), folder=folder)
            assert (ckpt.step, ckpt.weights.tobytes()) == (42, decode(data, name).weights.tobytes())
        else:
            with pytest.raises(CheckpointError) as err:
                run.read_checkpoint(step_from_name(name), folder=folder)
            assert problem in str(err.value) and err.value.name == run.path(rel), (rel, err.value)
        whole = "required" in (problem or "") or len(data) <= 8  # refused by its header, or all header
        rest = [] if whole else [f"get_object bytes=8-{len(data) - 1}"]
        assert calls == ["get_object bytes=0-7", *rest], (rel, calls)

    huge = (VECTORS / "step_000042.bin").read_bytes()[:8] + b"\0" * (3 * MiB)
    run.write_atomic("step_000042.bin", huge)
    calls.clear()
    with pytest.raises(CheckpointError, match=rf"{3 * MiB + 8} bytes where 8 \+ 12\*10 = 128 are required"):
        run.read_checkpoint(42)
    assert calls == ["get_object bytes=0-7"]

    good = (VECTORS / "step_000042.bin").read_bytes()
    run.write_atomic("step_000042.bin", good)

    async def replaced_after_the_header(method, *args, **kwargs):
        if kwargs.get("Range") != "bytes=0-7":  # another writer's put, between the two GETs
            again = good[:8] + bytes(reversed(good[8:]))
            await call_s3("put_object", Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=again)
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(run.fs, "_call_s3", replaced_after_the_header)
    with pytest.raises(CheckpointError) as err:
        run.read_checkpoint(42)
    assert str(err.value) == f"{run.path('step_000042.bin')}: replaced while it was read"


def test_an_s3_listing_is_one_request_a_thousand_names_and_a_missing_folder_one_request(
    s3_bucket, monkeypatch
):
    """RunDir.listdir on S3 (objstore.s3_list): a folder's objects and subfolders by name, a thousand a
    request (1,002 here: two pages); a folder not there yet (the archive of a run never pivoted, listed
    at every checkpoint) is [] in one request, where s3fs's ls listed the parent as well."""
    run = RunDir(f"{s3_bucket}/run")
    names = [f"f{i:04d}" for i in range(1001)]
    run.fs.pipe({run.path(n): b"x" for n in names} | {run.path("archive/phase_001_step_000100/a"): b"y"})
    run.write_text("archive/note.txt", "z")
    calls = record_s3_calls(run, monkeypatch, "Prefix")
    assert run.listdir() == sorted([*names, "archive"])
    assert calls == ["list_objects_v2 run/"] * 2
    calls.clear()
    assert run.listdir("archive") == ["note.txt", "phase_001_step_000100"]
    assert run.listdir("archive/none") == [] and run.listdir("f0001/x") == []
    assert calls == [
        "list_objects_v2 run/archive/",
        "list_objects_v2 run/archive/none/",
        "list_objects_v2 run/f0001/x/",
    ]


def test_the_tail_of_an_s3_log_is_one_suffix_range_get(s3_bucket):
    """`andrea status` reads the loss log's end (loss_log.read_recent over RunDir.read_tail): on S3 one
    GET of a suffix range, whose Content-Range says where the bytes start (no HEAD for the size)."""
    from andrea_core.run.loss_log import read_recent

    run = RunDir(f"{s3_bucket}/run")
    lines = [json.dumps({"step": s, "loss": 3.0, "segment": 1 + s // 50, "time": 1000.0 + s, "tokens": 64})
             for s in range(1, 121)]  # fmt: skip
    data = "".join(line + "\n" for line in lines).encode()
    run.write_atomic(LOSS_LOG, data)
    run.write_atomic("empty.json", b"")
    assert run.read_tail(LOSS_LOG, 100) == (data[-100:], len(data) - 100)
    assert run.read_tail(LOSS_LOG, len(data) + 5) == (data, 0)
    assert run.read_tail("empty.json", 10) == (b"", 0)
    with pytest.raises(FileNotFoundError):
        run.read_tail("missing.json", 10)
    recent = read_recent(run, 5.0, chunk=64)
    assert [(e.step, e.segment) for e in recent] == [(s, 3) for s in range(115, 121)]


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_loss_log_without_append_is_mirrored_and_published_at_durable_flushes(
    kind, tmp_path, s3_bucket, monkeypatch
):
    run = RunDir(run_urls(tmp_path, s3_bucket)[kind])
    run.makedirs()
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "machine-a"))
    writer = LossWriter(run)
    published = []
    for step in range(1, 8):
        writer.log(step, 1.0 / step, 1e-3, "a", 8, 0.0)
        writer.flush()  # every step: into the local mirror only
        assert run.exists(LOSS_LOG) == bool(published)
        if step % 3 == 0:  # a checkpoint: published whole, in one put
            writer.flush(durable=True)
            published.append(run.read_bytes(LOSS_LOG))
            assert writer._file.path.read_bytes() == published[-1]
            assert writer._file.path.is_relative_to(tmp_path / "machine-a")
    assert [s for s in (e["step"] for e in parse_lines(published[-1])[0])] == list(range(1, 7))
    # The process dies here: step 7 was only in machine A's mirror. Machine B knows only the URL.
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "machine-b"))
    resumed = LossWriter(run)
    assert resumed.segment == 2
    resumed.log(7, 0.5, 1e-3, "a", 8, 0.0)
    resumed.close()  # at exit: published, and the mirror is no longer needed
    published.append(run.read_bytes(LOSS_LOG))
    assert not resumed._file.path.exists()
    assert b'"step":7,' in writer._file.path.read_bytes()  # the crashed mirror: the unpublished tail
    for earlier, later in zip(published, published[1:], strict=False):
        assert later.startswith(earlier) and len(later) > len(earlier)
    assert [(e.step, e.segment) for e in read_history(run)] == [(s, 1) for s in range(1, 7)] + [(7, 2)]


def test_published_log_is_never_replaced_over_a_version_it_did_not_see(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    run = RunDir(f"{s3_bucket}/run")
    writer = LossWriter(run)
    writer.log(1, 1.0, 1e-3, "a", 8, 0.0)
    writer.flush(durable=True)
    foreign = json.dumps(line(1, 9)).encode() + b"\n"
    run.write_atomic(LOSS_LOG, foreign)  # someone else replaced it
    writer.log(2, 0.5, 1e-3, "a", 8, 0.0)
    with pytest.raises(ConcurrentWriteError, match="changed since this process read it"):
        writer.flush(durable=True)
    assert run.read_bytes(LOSS_LOG) == foreign  # nothing lost, nothing clobbered


def test_a_multipart_publish_is_never_made_over_a_version_it_did_not_see(tmp_path, s3_bucket, monkeypatch):
    """Over twice a part's size an append-only file is published as a multipart upload, its If-Match on
    the complete (objstore.s3_put): S3 refuses it over another version, and so must the tests' server
    (tests/moto_s3.py; moto alone completes it, replacing the foreign version). Nothing lost, nothing
    clobbered, no upload left pending."""
    from andrea_core.run.objstore import S3_MIN_PART

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    run = RunDir(f"{s3_bucket}/run")
    monkeypatch.setattr(run.fs, "default_block_size", S3_MIN_PART)
    bucket = s3_bucket.removeprefix("s3://")
    f = run.open_append(LOSS_LOG)
    big = b"".join(b"%09d" % i + b"x" * 1014 + b"\n" for i in range(11 * 1024))  # 11 MiB: two parts
    f.write(big, durable=True)
    assert run.read_bytes(LOSS_LOG) == big
    assert run.fs.info(f"{s3_bucket}/run/{LOSS_LOG}")["ETag"].strip('"').endswith("-2")  # multipart
    f.write(b"more\n", durable=True)  # over the version it made itself: fine
    assert run.read_bytes(LOSS_LOG) == big + b"more\n"
    foreign = b"someone else's\n"
    run.write_atomic(LOSS_LOG, foreign)
    f.write(b"and more\n")
    with pytest.raises(ConcurrentWriteError, match="changed since this process read it"):
        f.publish()
    assert run.read_bytes(LOSS_LOG) == foreign
    pending = run.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert pending == []
    f.close()


def test_a_long_append_only_file_is_extended_on_s3_by_sending_only_its_new_tail(
    tmp_path, s3_bucket, s3_server, monkeypatch
):
    """Past a part's worth, publishing an append-only file makes the store copy the published prefix
    (UploadPartCopy of exactly that version) and sends the tail alone: the object becomes a two-part
    upload (ETag "-2") after a 5-byte append that a whole put would have sent as one 6 MiB part
    (ETag without "-": one put under the 50 MiB part size). The bytes are exactly the mirror's at each
    publish; over a version it did not see, it is refused as a whole put is, and nothing is left."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    run = RunDir(f"{s3_bucket}/run")
    bucket = s3_bucket.removeprefix("s3://")
    etag = lambda: run.fs.info(f"{s3_bucket}/run/{LOSS_LOG}")["ETag"].strip('"')  # noqa: E731
    f = run.open_append(LOSS_LOG)
    head = b"".join(b"%09d" % i + b"y" * 1014 + b"\n" for i in range(6 * 1024))  # 6 MiB
    f.write(head, durable=True)
    assert run.read_bytes(LOSS_LOG) == head and "-" not in etag()  # one put: nothing to copy yet
    f.write(b"more\n", durable=True)
    assert run.read_bytes(LOSS_LOG) == head + b"more\n" and etag().endswith("-2")  # copy + the tail
    f.write(b"and more\n", durable=True)
    assert run.read_bytes(LOSS_LOG) == head + b"more\nand more\n" and etag().endswith("-2")
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "elsewhere"))
    with RunDir(run.url).open_append(LOSS_LOG) as other:  # a writer elsewhere extends it meanwhile
        other.write(b"theirs\n", durable=True)
    f.write(b"mine\n")
    with pytest.raises(ConcurrentWriteError, match="changed since this process read it"):
        f.publish()
    assert run.read_bytes(LOSS_LOG) == head + b"more\nand more\ntheirs\n"  # nothing lost or clobbered
    assert s3_server.client().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    f.close()


def test_an_extension_whose_complete_reply_is_lost_is_still_ours(tmp_path, s3_bucket, monkeypatch):
    """The store completed the extension, its reply was lost and the SDK's identical retry got another
    answer: the writer reads back its own bytes, adopts that version and goes on from it."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    run = RunDir(f"{s3_bucket}/run")
    f = run.open_append(LOSS_LOG)
    head = b"".join(b"%09d" % i + b"z" * 1014 + b"\n" for i in range(6 * 1024))  # 6 MiB
    f.write(head, durable=True)
    real = run.fs._call_s3
    answers: list[str] = []

    async def call_s3(method, *args, **kwargs):
        if method == "complete_multipart_upload" and not answers:
            await real(method, *args, **kwargs)  # committed; the reply is lost on the way back
            try:
                r = await real(method, *args, **kwargs)
            except Exception as e:
                answers.append(type(e.__cause__ or e).__name__)
                raise
            answers.append("ok")
            return r
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(run.fs, "_call_s3", call_s3)
    f.write(b"more\n", durable=True)
    f.write(b"again\n", durable=True)
    assert answers == ["ok"], answers  # moto: a retried complete of a completed upload is idempotent
    assert run.read_bytes(LOSS_LOG) == head + b"more\nagain\n"
    f.close()


def tiny_config(**train):
    overrides = {f"train.{k}": v for k, v in {"checkpoint_every": 10, "log_every": 10, **train}.items()}
    return load_run_config(TINY).with_overrides(overrides)


@pytest.mark.parametrize("kind", ["path", "file", "memory", "s3"])
def test_trainer_cli_fork_and_pivot_on_every_filesystem(kind, tmp_path, s3_bucket, capsys):
    url = run_urls(tmp_path, s3_bucket)[kind]
    logged: list[str] = []
    assert Trainer(url, tiny_config(), max_steps=20, device="cpu", log=logged.append).train().step == 20
    run = RunDir(url)
    assert run.checkpoint_steps() == [10, 20]
    assert [e.step for e in read_history(run)] == list(range(1, 21))

    (branch_url,) = fork(url, [BranchSpec("a")], step=10)
    assert branch_url == f"{run.url}-fork10-a"
    assert RunDir(branch_url).read_bytes(checkpoint_name(10)) == run.read_bytes(checkpoint_name(10))
    assert [r["step"] for r in fork_records(run)] == [10]

    pivot_run_directory(run, 20, Path(TINY).parent.joinpath("policies", "default.yaml").read_text())
    assert run.listdir("archive") == ["phase_001_step_000020"]

    result = Trainer(url, None, max_steps=30, device="cpu", log=logged.append).train()
    assert result.step == 30 and f"resuming {run.url} from step_000020.bin" in logged
    capsys.readouterr()  # the trainers' progress lines
    assert cli.main(["loss", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_step"] == 30
    assert cli.main(["inspect", f"{run.url}/{checkpoint_name(30)}"]) == 0
    assert "VALID" in capsys.readouterr().out
    assert cli.main(["lineage", url]) == 0
    tree = capsys.readouterr().out
    assert "fork at step 10: a" in tree and "phase 2  steps 20..30 (current)  policy default" in tree


def test_resume_elsewhere_warns_naming_each_environment_difference(s3_bucket, capsys):
    url = f"{s3_bucket}/run"
    logged: list[str] = []
    Trainer(url, tiny_config(), max_steps=10, device="cpu", log=logged.append).train()
    run = RunDir(url)
    record = run.read_text("run.yaml")
    here = yaml_env(record)
    run.write_text("run.yaml", record.replace(f"cpu: {here['cpu']}", "cpu: Imaginary CPU 9000"))
    logged.clear()
    Trainer(url, None, max_steps=20, device="cpu", log=logged.append).train()
    warnings = [m for m in logged if m.startswith("warning:")]
    assert warnings == [
        f"warning: cpu is {here['cpu']!r} here but the run was created with 'Imaginary CPU 9000': "
        "resumed CPU results will match the original only to rounding, not bit for bit"
    ]
    assert f"resuming {run.url} from step_000010.bin" in logged


def yaml_env(run_yaml: str) -> dict:
    import yaml

    return yaml.safe_load(run_yaml)["environment"]


def s3_versions(client, url: str, name: str) -> list[bytes]:
    """Every version ever published of a file in a versioned bucket, oldest first."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    key = f"{prefix}/{name}"
    listing = client.call_s3("list_object_versions", Bucket=bucket, Prefix=key)
    versions = [v for v in listing.get("Versions", []) if v["Key"] == key][::-1]  # listed newest first
    out = []
    for v in versions:
        obj = client.call_s3("get_object", Bucket=bucket, Key=key, VersionId=v["VersionId"])
        out.append(_read_body(client, obj))
    return out


def _read_body(client, obj) -> bytes:
    async def read():
        async with obj["Body"] as body:
            return await body.read()

    return fsspec.asyn.sync(client.loop, read)


def wait_for_line(log: Path, text: str) -> None:
    wait_for(lambda: log.exists() and text in log.read_text(), timeout=600, what=f"{text!r} in {log.name}")


def history_of(url: str) -> list[tuple]:
    return [(e.step, e.loss, e.lr, e.arm, e.tokens) for e in read_history(RunDir(url))]


@pytest.mark.slow
def test_bit_exact_resume_with_the_run_directory_on_s3(
    s3_bucket, s3_server, tmp_path, monkeypatch, tmp_path_factory
):
    """A ran uninterrupted; B is SIGTERM'd, restarted, SIGKILLed after a checkpoint, and finished on
    "another machine" (a fresh run cache, only the URL). Final checkpoints byte-identical, canonical
    loss histories equal, and every version .loss.json ever had on the store a prefix of the next.
    Both on one-thread andrea-tiny (A: the library's run of 300 steps, built once a session): at two
    threads, which spin-wait on each other on a loaded 2-core machine, the test took 88 s and the
    session's tiny_reference 144 s here; now 23 s, A's build in it."""
    client = s3_server.client()
    client.call_s3(
        "put_bucket_versioning",
        Bucket=s3_bucket.removeprefix("s3://"),
        VersioningConfiguration={"Status": "Enabled"},
    )
    a = str(library_run(tmp_path_factory, tmp_path / "a", 300, "--device", "cpu"))  # on local disk
    b = f"{s3_bucket}/b"

    def steps_of_b() -> list[int]:
        return RunDir(b).checkpoint_steps()

    args = ("--run-dir", b, "--max-steps", "300", "--device", "cpu", "--pace", "0.02")
    first = start_trainer("--config", tiny_config_file(tmp_path), *args, log=tmp_path / "b1.log")
    wait_for_line(tmp_path / "b1.log", "step 150/300")
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 0
    (stopped_at,) = set(steps_of_b()) - {100}
    assert 150 <= stopped_at < 200

    second = start_trainer(*args, log=tmp_path / "b2.log")
    wait_for_line(tmp_path / "b2.log", "step 250/300")  # steps past 200 reached only the local mirror
    second.kill()
    second.wait()
    assert steps_of_b() == [100, stopped_at, 200]
    published = parse_lines(RunDir(b).read_bytes(LOSS_LOG))[0]
    # Published at checkpoint 200 (a background writer may publish a few steps more); what the trainer
    # logged after that, up to step 250 and beyond, lived only in the mirror and died with it.
    assert 200 <= published[-1]["step"] < 250

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "another-machine"))
    third = andrea("train", "--run-dir", b, "--max-steps", "300", "--device", "cpu", timeout=900)
    assert f"resuming {b} from step_000200.bin" in third.stdout + third.stderr
    assert "warning:" not in third.stdout + third.stderr

    assert RunDir(a).read_bytes(checkpoint_name(300)) == RunDir(b).read_bytes(checkpoint_name(300))
    assert history_of(a) == history_of(b)
    assert [e.step for e in read_history(RunDir(b))] == list(range(1, 301))

    versions = s3_versions(client, b, LOSS_LOG)
    for earlier, later in zip(versions, versions[1:], strict=False):
        assert later.startswith(earlier) and len(later) > len(earlier)
    # Every checkpoint published the log: a version ends at or just past each checkpoint's step
    # (past: an asynchronous writer publishes while the next steps are logged), before the next one.
    ends = [parse_lines(v)[0][-1]["step"] for v in versions]
    checkpoints = [100, stopped_at, 200, 300]
    for step, following in zip(checkpoints, [*checkpoints[1:], 301], strict=True):
        assert any(step <= end < following for end in ends), (step, ends)
    segments = canonical(parse_lines(versions[-1])[0])
    assert {e.segment for e in segments} == {1, 2, 3}


def bigger_model_config(tmp_path: Path) -> str:
    """andrea-tiny widened to 0.67M parameters: an 8 MiB checkpoint, uploaded in two 5 MiB parts (at
    the test's 2 MiB/s, each checkpoint is 4 s on the wire: the kill lands in its first part). Its steps
    are small (2 rows of 32 tokens: an eighth of andrea-tiny's) on one thread (tests/tiny.py): the
    size of the checkpoint is what the test needs, and a step of 8 x 64 tokens at this width on two
    threads took 2-3 s here, most of the test. (It was 1.7M parameters, a 20 MiB checkpoint in four
    parts: 55 s of a loaded machine's wall time, most of it the checkpoints' bytes through the slow
    link and moto; a multipart upload in flight needs two parts, not four.)"""
    import yaml

    doc = yaml.safe_load(Path(TINY).read_text())
    doc["model"].update(n_embd=160, n_head=4, block_size=32)
    doc["train"].update(checkpoint_every=10, log_every=10, batch_size=2, num_threads=1)
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.slow
def test_sigkill_during_checkpoint_upload_leaves_no_torn_checkpoint(
    s3_bucket, s3_server, tmp_path, monkeypatch
):
    """A trainer killed while its checkpoint is being uploaded (over a slow link, so the upload is
    in flight for seconds) leaves nothing under that step_*.bin name; the next start aborts the
    orphaned upload and resumes from the previous checkpoint."""
    from s3_server import ThrottledLink

    url = f"{s3_bucket}/run"
    link = ThrottledLink(s3_server.port, rate=2 * MiB)
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", link.endpoint)
    monkeypatch.setenv("FSSPEC_S3_DEFAULT_BLOCK_SIZE", str(5 * MiB))
    config = bigger_model_config(tmp_path)
    trainer = start_trainer(
        "--config",
        config,
        "--run-dir",
        url,
        "--max-steps",
        "30",
        "--device",
        "cpu",
        log=tmp_path / "killed.log",
    )
    key = f"{url.removeprefix('s3://').partition('/')[2]}/{checkpoint_name(20)}"
    try:
        wait_for(
            lambda: key in uploads_in_progress(s3_server, s3_bucket),
            timeout=300,
            what="the upload of step_000020.bin to start",
            every=0.25,  # a listing request to the server the upload goes to: not every 20 ms
        )
        # Its first part on the wire: 1 MiB more through the link (half a second at its rate), not a sleep.
        started = link.sent
        wait_for(lambda: link.sent >= started + MiB, timeout=300, what="1 MiB of step_000020.bin sent")
        trainer.kill()
    finally:
        trainer.wait()
        link.close()
    run = RunDir(url)
    # The kill did land mid-upload. A trainer that trained on to step 30 behind the slow upload (a
    # loaded machine's CI, 2026-12-07) was uploading step 30's .state.json too: the next start aborts both.
    assert key in uploads_in_progress(s3_server, s3_bucket)
    assert run.checkpoint_steps() == [10]  # nothing under the final name of the one in flight
    decode(run.read_bytes(checkpoint_name(10)), checkpoint_name(10))

    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3_server.endpoint)
    resumed = andrea("train", "--run-dir", url, "--max-steps", "30", "--device", "cpu", timeout=900)
    out = resumed.stdout + resumed.stderr
    assert f"aborted an unfinished upload of {url}/{checkpoint_name(20)} (its writer died)" in out
    assert f"resuming {url} from step_000010.bin" in out
    assert run.checkpoint_steps() == [10, 20, 30]
    for step in (10, 20, 30):
        decode(run.read_bytes(checkpoint_name(step)), checkpoint_name(step))
    assert uploads_in_progress(s3_server, s3_bucket) == []


MIRROR_WRITER = """
import sys, time
from andrea_core.run.rundir import RunDir
f = RunDir(sys.argv[1]).open_append(".loss.json")
f.write(b'{"step": 1}\\n')
print(f.path, flush=True)
time.sleep(600)
"""


def test_a_crashed_writers_mirror_is_removed_by_the_next_open_and_a_live_ones_never(
    tmp_path, s3_bucket, monkeypatch
):
    """Real writer processes on one machine's cache: a SIGKILLed one's mirror (its pid gone, its flock
    free) is removed by the next open of the file; a live one's, one whose flock a live process holds
    under a pid that is free here (a writer of another pid namespace), a live one's that takes no flock
    (an older andrea), and a planted symlink are not."""
    import fcntl
    import os
    import subprocess
    import sys

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    url = f"{s3_bucket}/run"
    RunDir(url).write_atomic("run.yaml", b"name: x\n")

    def writer() -> tuple[subprocess.Popen, Path]:
        proc = subprocess.Popen(
            [sys.executable, "-c", MIRROR_WRITER, url],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        return proc, Path(proc.stdout.readline().strip())

    live, live_mirror = writer()
    crashed, crashed_mirror = writer()  # (its open removes no mirror: the only other one's writer lives)
    crashed.kill()
    crashed.wait()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid free here, as another namespace's writer's pid is
    elsewhere = crashed_mirror.with_name(f".loss.json.{gone.pid}")
    elsewhere.write_bytes(b'{"step": 1}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX);"
         " print(flush=True); time.sleep(600)", str(elsewhere)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    holder.stdout.readline()
    older = subprocess.Popen(  # a live writer that takes no flock (an older andrea): its pid lives
        [sys.executable, "-c", "import os,sys,time; f=open(f'{sys.argv[1]}.{os.getpid()}', 'ab');"
         " print(f.name, flush=True); time.sleep(600)", str(crashed_mirror.parent / ".loss.json")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    older_mirror = Path(older.stdout.readline().strip())
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the cache's")
    link = crashed_mirror.with_name(".loss.json.999999999")
    link.symlink_to(outside)
    try:
        assert crashed_mirror.exists() and live_mirror.exists()
        with RunDir(url).open_append(".loss.json") as mine:
            assert mine.path.exists()
            assert not crashed_mirror.exists(), "a crashed writer's mirror was kept"
            assert live_mirror.exists() and elsewhere.exists() and older_mirror.exists(), (
                "a live one's removed"
            )
            assert link.is_symlink() and outside.read_bytes() == b"not the cache's"
        assert not mine.path.exists()  # a clean close removes its own
        with pytest.raises(BlockingIOError):  # the live writer still holds its mirror's flock
            fcntl.flock(open(live_mirror), fcntl.LOCK_EX | fcntl.LOCK_NB)
        live.kill()
        live.wait()
        for proc in (holder, older):
            proc.kill()
            proc.wait()
        RunDir(url).open_append(".loss.json").close()
        left = sorted(p.name for p in crashed_mirror.parent.iterdir())
        assert left == [link.name], left  # both writers gone: only the link is left, not followed
    finally:
        for proc in (crashed, live, holder, older):
            if proc.poll() is None:
                proc.kill()


# --- issue 43.10 (review): a lying object store -------------------------------------------------------------


class LyingStore(http.server.ThreadingHTTPServer):
    """Answers every GET 206 "bytes 0-99/100" (or, for a suffix range, the same lie) with a 300 MiB body,
    and counts what it managed to send."""

    BODY = 300 * MiB

    def __init__(self):
        self.sent = 0
        self.gets = 0
        super().__init__(("127.0.0.1", 0), LyingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class LyingHandler(http.server.BaseHTTPRequestHandler):
    server: LyingStore

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.gets += 1
        self.send_response(206)
        self.send_header("Content-Range", "bytes 0-99/100")
        self.send_header("Content-Length", str(LyingStore.BODY))
        self.send_header("ETag", '"lie"')
        self.end_headers()
        chunk = b"\0" * MiB
        try:
            for _ in range(LyingStore.BODY // MiB):
                self.wfile.write(chunk)
                self.server.sent += len(chunk)
        except OSError:  # the reader hung up: what it refused is not sent
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def lying_store(monkeypatch):
    server = LyingStore()
    monkeypatch.setitem(fsspec.config.conf.setdefault("s3", {}), "endpoint_url", server.endpoint)
    monkeypatch.setitem(fsspec.config.conf["s3"], "key", "k")
    monkeypatch.setitem(fsspec.config.conf["s3"], "secret", "s")
    monkeypatch.setitem(fsspec.config.conf["s3"], "skip_instance_cache", True)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield server
    server.shutdown()
    server.server_close()


def test_a_lying_store_is_read_no_further_than_the_bound(lying_store):
    """read_bounded, read_tail and read_checkpoint each count the body as it arrives: the lie (100
    bytes announced, 300 MiB sent) is refused after at most the bound and a chunk, not read whole."""
    run = RunDir("s3://bucket/run")
    with pytest.raises(OSError, match=r"s3://bucket/run/run.yaml: the store sent more than the 100 bytes"):
        run.read_bounded("run.yaml")
    with pytest.raises(OSError, match=r"s3://bucket/run/.loss.json: the store sent more than the 4096 bytes"):
        run.read_tail(LOSS_LOG, 4096)
    with pytest.raises(Exception, match=r"step_000100.bin.*the store sent more than the 8 bytes"):
        run.read_checkpoint(100)
    assert lying_store.gets == 3
    # What the server pushed before the reader hung up is what the sockets' buffers took: far from the
    # 3 x 300 MiB the old reader took in (and held: 675 MiB peak RSS for one read).
    assert lying_store.sent < 3 * 64 * MiB, lying_store.sent


# --- issue 43.7 (review): the loss log's mirror in a cache shared by two pid namespaces ---------------------


def test_a_mirror_of_another_writer_with_our_pid_is_never_truncated(tmp_path, monkeypatch):
    """Two processes with one pid (two pid namespaces) sharing one cache folder: the mirror `NAME.<pid>`
    of the one that opened first is its own, held under its flock; the second opens its own beside it
    and never truncates the first's (opened with O_TRUNC, it lost the first's unpublished tail)."""
    import fcntl

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    run = RunDir(f"memory://{tmp_path.name}/run")
    run.makedirs()
    theirs = run.cache_path(f"{LOSS_LOG}.{os.getpid()}")
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b'{"step": 1, "unpublished": "theirs"}\n')
    with open(theirs, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its writer lives (in its own pid namespace)
        writer = LossWriter(run, warn=lambda m: None)
        writer.log(1, 2.0, 1e-3, "a", 8, 0.0)
        writer.flush()
        assert theirs.read_bytes() == b'{"step": 1, "unpublished": "theirs"}\n'
        assert writer._file.path != theirs and writer._file.path.name == f"{LOSS_LOG}.{os.getpid()}.1"
        writer.close()
    assert theirs.exists() and not writer._file.path.exists()
    assert b'"loss":2.0' in run.read_bytes(LOSS_LOG)


# --- issue 14.1 (review): a conditional put whose reply is lost ---------------------------------------------


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
    cfg = load_run_config(tiny_config_file(tmp_path, train__checkpoint_every=10, retention__keep_last=None))
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


# --- issue 18.2 (review): every pending multipart upload is aborted, not the first page ---------------------


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


def test_a_checksummed_checkpoint_written_and_read_on_s3(s3_bucket, small_parts):
    """The trainer's writer (Checkpointer) streams a 12 MiB checkpoint to S3 as one multipart upload,
    checksummed as it goes: the object is exactly encode()'s bytes, trailer included, and reads back
    with that CRC-32; the same object with one bit flipped on the store is refused by the bounded
    reader, naming it and its checksum, and the previous checkpoint is the newest valid one."""
    import struct
    import zlib

    import torch

    from andrea_core.checkpoint import encode, snapshot
    from andrea_core.train.checkpoint_writer import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)  # 1,048,576 parameters: 12 MiB of state
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).square().mean().backward()
    optimizer.step()
    n = 1024 * 1024
    run = RunDir(f"{s3_bucket}/run")
    writer = Checkpointer(run, model, optimizer, log=lambda _: None)
    for step in (1, 2):
        writer.save(step)
        assert writer.wait().error is None
    expected = encode(2, snapshot(model, optimizer).numpy())
    data = run.fs.cat_file(run.path(checkpoint_name(2)))
    assert data == expected and len(data) == 8 + 12 * n + 8
    assert struct.unpack("<3sBI", data[-8:]) == (b"ANC", 1, zlib.crc32(data[:-8]))
    assert run.fs.info(run.path(checkpoint_name(2)))["ETag"].strip('"').endswith("-2")  # two parts
    assert run.read_checkpoint(2, n).checksum == zlib.crc32(data[:-8])

    flipped = bytearray(data)
    flipped[8 + 4 * n + 4 * 12345] ^= 0x01  # one bit of Adam's m
    run.fs.pipe_file(run.path(checkpoint_name(2)), bytes(flipped))
    warned: list[str] = []
    assert RunDir(run.url).newest_valid_checkpoint(n, warn=warned.append).step == 1
    refused = f"refusing checkpoint {run.path(checkpoint_name(2))}: checksum does not match"
    assert warned[0].startswith(refused)
