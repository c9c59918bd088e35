"""A lease holder paused in the middle of a publish never completes it after its lease was taken over.

The S3 soak found it (issue 28, violation (5) at fault 7): a trainer stopped mid-upload for 8.9 s (ttl
3 s) finished its put of step_000270.bin after a second trainer had taken the run over, and the store
committed it. S3 cannot make a put conditional on another object (the lock), so a fenced publish is an
upload that a taker can abort (objstore.s3_put, store.LocalStore.put) and the taker aborts them right
before its takeover write (RunDir.abort_writes_in_flight).

Two "hosts" on this machine (ANDREA_TEST_HOST, as in tests/test_lease.py): host-a, a real process, holds
the lease and publishes a file; it is held mid-write longer than its ttl (its network link to the store
paused, or SIGSTOP); host-b, this process, takes the run over; host-a goes on, and its publish fails: the
store never holds its bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, _env, wait_for
from s3_server import ThrottledLink

from andrea_core.run import lock
from andrea_core.run.lock import LeaseLost, read_lock
from andrea_core.run.rundir import RunDir

FAST_LEASE = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"}
MiB = 2**20

# host-a: take the lease, then publish `size` bytes of b"A" as `name`; with a gate file, the second half
# of the bytes waits for it (the test stops this process there).
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from andrea_core.run import lock
    from andrea_core.run.rundir import RunDir
    url, name, size, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    run = RunDir(url)
    lease = lock.Lease.take(run, log=lambda m: print(m, flush=True))
    print("leased", flush=True)

    def body():
        yield b"A" * (size // 2)
        print("mid-write", flush=True)
        while gate and not os.path.exists(gate):
            time.sleep(0.01)
        yield b"A" * (size - size // 2)

    try:
        run.write_atomic(name, body())
        print("published", flush=True)
    except Exception as e:
        print(f"refused: {type(e).__name__}: {e}", flush=True)
    finally:
        lease.release()  # as the trainer does: no renewal frozen mid-write at exit
    """
)


def start_holder(url: str, name: str, size: int, gate: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, name, str(size), gate],
        env=_env() | FAST_LEASE | {"ANDREA_TEST_HOST": "host-a"} | env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_line(proc: subprocess.Popen, want: str, seen: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if line.startswith(want):
            return
    raise AssertionError(f"host-a never said {want!r}:\n" + "\n".join(seen))


def take_over(url: str, monkeypatch) -> tuple[lock.Lease, list[str], float]:
    """host-b takes the run over (it waits out host-a's ttl); its log and how long it waited."""
    for k, v in FAST_LEASE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ANDREA_TEST_HOST", "host-b")
    logged: list[str] = []
    t0 = time.monotonic()
    lease = lock.Lease.take(RunDir(url), log=logged.append)
    return lease, logged, time.monotonic() - t0


def finish(proc: subprocess.Popen, seen: list[str]) -> str:
    out, _ = proc.communicate(timeout=120)
    return "\n".join(seen) + "\n" + out


def test_a_holder_whose_link_to_the_store_is_held_mid_upload_publishes_nothing_after_the_takeover(
    s3_server, s3_bucket, monkeypatch
):
    """host-a reaches the store through a slow link (2 MB/s): 3 MiB take 1.5 s. A third of the way in,
    the link is held (a partitioned network): host-a's upload and its renewals stay in flight. host-b
    takes the run over after the 3 s ttl; then the link is released and host-a's bytes reach the store."""
    url, name = f"{s3_bucket}/run", "step_000270.bin"
    link = ThrottledLink(s3_server.port, rate=2 * MiB)
    holder = start_holder(url, name, 3 * MiB, "", s3_server.env(link.endpoint))
    seen: list[str] = []
    try:
        wait_line(holder, "leased", seen)
        base = link.sent
        wait_for(lambda: link.sent > base + MiB, timeout=60, what="a third of host-a's upload")
        link.pause()
        b, logged, waited = take_over(url, monkeypatch)
        assert waited >= 3 and b.generation == 2
        link.resume()
        out = finish(holder, seen)
    finally:
        link.resume()
        if holder.poll() is None:
            holder.kill()
        link.close()
    assert "published" not in out.splitlines(), out
    run = RunDir(url)
    assert not run.exists(name), "the store holds nothing host-a published after the takeover"
    assert "refused: ConcurrentWriteError" in out and "its upload was aborted before it completed" in out, out
    assert any(f"(of trainer pid {holder.pid}, whose lease is being taken over)" in m for m in logged), logged
    bucket = s3_bucket.removeprefix("s3://")
    assert s3_server.client().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert read_lock(run).generation == 2 and read_lock(run).host == "host-b"
    # host-b, the holder now, publishes the same name as usual.
    run.fence = b
    run.write_atomic(name, b"B" * 100)
    assert run.read_bytes(name) == b"B" * 100
    b.release()


def test_a_holder_stopped_mid_write_on_local_disk_publishes_nothing_after_the_takeover(tmp_path, monkeypatch):
    """host-a writes half of the file into its temporary file and is stopped there (SIGSTOP); host-b
    takes the run over after the ttl and removes that temporary file; host-a, continued, fails its
    rename."""
    url, name, gate = str(tmp_path / "run"), "step_000270.bin", tmp_path / "gate"
    holder = start_holder(url, name, 3 * MiB, str(gate), {})
    seen: list[str] = []
    try:
        wait_line(holder, "mid-write", seen)
        holder.send_signal(signal.SIGSTOP)
        b, logged, waited = take_over(url, monkeypatch)
        assert waited >= 3 and b.generation == 2
        gate.touch()
        holder.send_signal(signal.SIGCONT)
        out = finish(holder, seen)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
    # host-b stops renewing first: a renewal of its own is a temporary file beside the lock while it runs
    # (CI listed one, `..trainer.json.tmp.PID.RANDOM`, between its write and its rename).
    b.release()
    run = RunDir(url)
    assert sorted(run.listdir()) == [".trainer.json"], "no file of host-a's, not even its temporary one"
    assert "published" not in out.splitlines(), out
    assert (
        "refused: ConcurrentWriteError" in out and "its temporary file was removed before the rename" in out
    )
    removed = [m for m in logged if f"a write in flight of trainer pid {holder.pid}" in m]
    assert len(removed) == 1 and f"/.{name}.tmp.{holder.pid}." in removed[0], logged


@pytest.mark.parametrize("size", [0, 100, 6 * MiB], ids=["empty", "small", "over-a-minimum-part"])
def test_a_fenced_publish_on_s3_is_an_upload_that_can_be_aborted(s3_server, s3_bucket, size, monkeypatch):
    """Whatever its size, the holder's publish is a multipart upload (an S3 ETag of a multipart object
    ends in -N, the number of parts: one here, s3fs's parts are 50 MiB), its bytes exact; and a holder
    whose lease was lost leaves neither an object nor an upload behind."""
    for k, v in FAST_LEASE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ANDREA_TEST_HOST", "host-a")
    run = RunDir(f"{s3_bucket}/run")
    a = lock.Lease.take(run, log=lambda m: None)
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    run.write_atomic("file.bin", data)
    assert run.read_bytes("file.bin") == data
    etag = run.fs.info(run.path("file.bin"))["ETag"].strip('"')
    assert etag.endswith("-1"), etag

    a._stop.set()  # host-a stops renewing (a paused VM) ...
    a._thread.join()
    b, _, _ = take_over(run.url, monkeypatch)  # ... and host-b takes the run over
    with pytest.raises(LeaseLost, match="not writing other.bin"):
        run.write_atomic("other.bin", data)
    assert not run.exists("other.bin")
    bucket = s3_bucket.removeprefix("s3://")
    assert s3_server.client().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    b.release()


@pytest.mark.parametrize("holder_pid", ["other", "same-as-ours"])
def test_a_taker_removes_the_temporary_files_of_the_holder_it_replaces_and_only_those(tmp_path, holder_pid):
    """On local disk, the holder's writes in flight are its temporary files, named with the pid its lock
    records (in its own namespace: the same number as this process's in two containers, pid 1 in each).
    Another writer's temporary file, and every published file, are left as they are."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    pid = os.getpid() if holder_pid == "same-as-ours" else os.getpid() + 1
    holders = [f".step_000270.bin.tmp.{pid}.{'a' * 16}", f".samples.json.tmp.{pid}.{'b' * 16}"]
    others = [f".step_000270.bin.tmp.{pid + 7}.{'c' * 16}", "step_000260.bin", ".samples.json"]
    for name in holders + others:
        (tmp_path / "run" / name).write_bytes(b"x")
    logged: list[str] = []
    assert sorted(run.abort_writes_in_flight(pid, logged.append)) == sorted(holders)
    assert sorted(run.listdir()) == sorted(others)
    said = f"a write in flight of trainer pid {pid}, whose lease is being taken over"
    assert len(logged) == 2 and all(said in m for m in logged), logged


def test_an_upload_found_gone_is_ours_if_the_store_holds_our_bytes_else_aborted(s3_server, s3_bucket):
    """NoSuchUpload is the taker's abort, or the SDK's retry of a complete that went through and whose
    reply was lost. A conditional publish (its SHA-256 known) that finds the store holding exactly its
    bytes adopts that version, as after a refused precondition; otherwise it was aborted: nothing is
    taken for published that is not."""
    import asyncio
    import hashlib

    from andrea_core.run import objstore
    from andrea_core.run.objstore import ConcurrentWriteError

    fs = RunDir(f"{s3_bucket}/run").fs
    bucket, key = s3_bucket.removeprefix("s3://"), "run/.loss.json"
    path = f"{bucket}/{key}"
    data = b'{"step": 1}\n'
    client = s3_server.client()
    upload = client.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    part = client.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)
    done = client.call_s3(
        "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )  # fmt: skip
    with pytest.raises(OSError) as gone:  # the store's own answer for an upload that is no more
        client.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=b"x")
    assert objstore._is_aborted_upload(gone.value), gone.value

    def failed(sha256: bytes):
        return asyncio.run_coroutine_threadsafe(
            objstore._failed(fs, path, upload, gone.value, len(data), sha256), fs.loop
        ).result(60)

    assert failed(hashlib.sha256(data).digest()) == objstore.Version(len(data), done["ETag"])
    with pytest.raises(ConcurrentWriteError, match="its upload was aborted before it completed"):
        failed(hashlib.sha256(b"other bytes").digest())
