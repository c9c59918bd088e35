"""The lock as a lease on shared storage (issue 12.3): renewed by its holder, taken over by another host
once it has gone unrenewed for its ttl, and fencing every publish of a holder that lost it.

Two "hosts" on this one machine: ANDREA_TEST_HOST gives a process a host name and a boot id of its own
(tests only), so that neither can check the other's pid and only the lease decides."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, _env, andrea, start_trainer, wait_for

from andrea_core.config import ConfigError
from andrea_core.run import lock
from andrea_core.run.lock import LeaseLost, LockError, read_lock
from andrea_core.run.objstore import ConcurrentWriteError
from andrea_core.run.rundir import LOCK, RunDir
from andrea_core.run.samples import read_audits
from tests.tiny import tiny_config

FAST_LEASE = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"}


def test_a_released_lock_keeps_its_generation(tmp_path):
    """Fencing needs a counter that only grows: a clean exit leaves the lock released, not deleted."""
    run = RunDir(str(tmp_path / "run"))
    first = lock.acquire(run, log=lambda m: None)
    lock.release(run, first)
    left = read_lock(run)
    assert left.released and left.generation == 1 and not left.is_alive()
    logged: list[str] = []
    second = lock.acquire(run, log=logged.append)
    assert second.generation == 2 and "taking the released lock" in logged[0]
    lease = lock.Lease(run, second, run.read_versioned(LOCK)[1], log=lambda m: None)
    lease.release()
    assert read_lock(run).generation == 2 and read_lock(run).released


def test_lease_timing_is_checked():
    env = {**os.environ, "ANDREA_LEASE_RENEW_S": "10", "ANDREA_LEASE_TTL_S": "15"}
    code = "from andrea_core.run import lock; lock.lease_timing()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert "ANDREA_LEASE_RENEW_S=10, ANDREA_LEASE_TTL_S=15" in proc.stderr
    assert "at least twice the renewal" in proc.stderr


def test_a_lease_is_refused_while_renewed_taken_over_once_expired_and_the_loser_is_fenced(
    s3_bucket, monkeypatch
):
    """In one process, on the moto S3 server: host-a holds a lease, host-b watches it."""
    for k, v in FAST_LEASE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ANDREA_TEST_HOST", "host-a")
    run_a = RunDir(f"{s3_bucket}/run")
    a = lock.Lease.take(run_a, log=lambda m: None)
    run_a.write_json("sidecar.json", {"by": "a"})  # the holder publishes through its fence

    monkeypatch.setenv("ANDREA_TEST_HOST", "host-b")
    run_b = RunDir(f"{s3_bucket}/run")
    renewals = read_lock(run_b).renewals
    with pytest.raises(LockError, match=r"in use by trainer pid \d+ on host-a: its lease \(generation 1\)"):
        lock.acquire(run_b, log=lambda m: None)  # a renewal is seen within one renewal period
    # Counted in host-a's renewals, not seconds: refused at the first one seen (a watch of a whole ttl
    # would see three), however slow the machine.
    assert read_lock(run_b).renewals - renewals <= 2, "refused as soon as a renewal was seen"

    # host-a stops renewing (a paused VM): host-b takes over after watching it unrenewed for its ttl.
    a._stop.set()
    a._thread.join()
    last_renewed = read_lock(run_b)
    logged: list[str] = []
    t0 = time.monotonic()
    b = lock.Lease.take(run_b, log=logged.append)
    waited = time.monotonic() - t0
    # Never before the ttl (a lower bound no load can break), and over the lease host-a last renewed.
    assert b.generation == 2 and waited >= 3, waited
    assert last_renewed.generation == 1 and last_renewed.host == "host-a"
    assert "its lease was not renewed for 3s" in logged[-1] and "generation 2" in logged[-1]

    # host-a wakes up: its lease is older than ttl - renew, so its next publish renews first, which fails.
    before = run_a.read_bytes("sidecar.json")
    with pytest.raises(LeaseLost, match=r"not writing sidecar.json: .*lost its lease .*generation 2"):
        run_a.write_json("sidecar.json", {"by": "a, after losing its lease"})
    with pytest.raises(LeaseLost):
        run_a.remove("sidecar.json")
    assert run_a.read_bytes("sidecar.json") == before
    a.release()  # a lost lease is not released over its taker's
    assert read_lock(run_b) == b.me
    b.release()
    assert read_lock(run_b).released and read_lock(run_b).generation == 2


# --- two real trainers on one s3:// run ------------------------------------------------------------


def host_env(host: str, **extra: str) -> dict[str, str]:
    return _env() | FAST_LEASE | {"ANDREA_TEST_HOST": host} | extra


def published(run: RunDir) -> dict[str, tuple[int, str]]:
    """Every object of the run as the store holds it: name -> (size, ETag)."""
    found = run.fs.find(run.root, detail=True)
    return {p.removeprefix(run.root + "/"): (d["size"], d.get("ETag")) for p, d in found.items()}


@pytest.mark.slow
def test_two_hosts_on_one_s3_run_the_second_takes_over_an_expired_lease_and_the_paused_first_writes_nothing(
    s3_bucket, tmp_path
):
    url = f"{s3_bucket}/run"
    run = RunDir(url)
    cfg = tiny_config(tmp_path, train__checkpoint_every=50, train__log_every=1000)
    args = ["--run-dir", url, "--device", "cpu", "--pace", "0.05"]
    a = start_trainer(
        "--config", cfg, *args, "--max-steps", "100000", env=host_env("host-a"), log=tmp_path / "a.log"
    )
    b_wait = None
    try:
        wait_for(lambda: run.checkpoint_steps(), timeout=300, what="host-a's first checkpoint")
        held = read_lock(run)
        assert held.host == "host-a" and held.generation == 1

        # While host-a's lease lives, host-b refuses at once...
        refused = andrea(
            "train", *args, "--max-steps", "100000", env=host_env("host-b"), timeout=300, check=False
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "on host-a: its lease (generation 1) was renewed" in refused.stderr
        # ... or, told to wait, waits (host-a renews all the while) ...
        b_wait = start_trainer(*args, "--max-steps", "1", env=host_env("host-b", ANDREA_LEASE_WAIT_S="600"),
                               log=tmp_path / "b.log")  # fmt: skip
        wait_for(lambda: "watching whether it renews" in (tmp_path / "b.log").read_text(), timeout=300)
        renewals = read_lock(run).renewals
        wait_for(lambda: read_lock(run).renewals >= renewals + 3, timeout=60, what="three renewals by host-a")
        assert b_wait.poll() is None and read_lock(run).generation == 1 and read_lock(run).host == "host-a"

        # ... until host-a is paused past its lease, between two checkpoints (a paused VM).
        newest = run.checkpoint_steps()[-1]
        wait_for(lambda: run.checkpoint_steps()[-1] > newest, timeout=120, what="host-a's next checkpoint")
        boundary = run.checkpoint_steps()[-1]
        # The boundary's last publish is its audit (after the checkpoint, every checkpoint has one): once
        # .samples.json names the step, the next publish is 50 steps of >= 50 ms away.
        wait_for(lambda: boundary in [s["step"] for s in read_audits(run)], timeout=120, what="its audit")
        a.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        taken = wait_for(lambda: read_lock(run).generation == 2, timeout=120, what="host-b's takeover")
        took_s = time.monotonic() - stopped
        assert taken and read_lock(run).host == "host-b"
        # host-b (max_steps 1: nothing to train) took the lease with no manual step, and released it.
        assert b_wait.wait(timeout=300) == 0, (tmp_path / "b.log").read_text()
        b_log = (tmp_path / "b.log").read_text()
        assert "taking over the stale lock of dead trainer" in b_log and "not renewed for 3s" in b_log
        assert read_lock(run).released and read_lock(run).generation == 2
        before = published(run)

        a.send_signal(signal.SIGCONT)
        assert a.wait(timeout=300) == 2, (tmp_path / "a.log").read_text()
        a_log = (tmp_path / "a.log").read_text()
        assert "lost its lease" in a_log and "generation 2" in a_log
        assert published(run) == before, "the paused trainer published nothing after the takeover"
        print(f"takeover {took_s:.1f}s after host-a was paused (renew 1 s, ttl 3 s)")

        # The run goes on from host-a's newest checkpoint under generation 3: the counter only grows.
        newest = run.checkpoint_steps()[-1]
        andrea("train", *args, "--max-steps", str(newest + 10), env=host_env("host-b"), timeout=300)
        assert run.checkpoint_steps()[-1] == newest + 10
        left = json.loads(run.read_bytes(LOCK))
        assert left["released"] and left["generation"] == 3
    finally:
        for p in (a, b_wait):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


def test_memory_compare_and_put_is_exact_and_a_lost_lease_publishes_nothing(tmp_path):
    """memory:// lives in this one process: its compare-and-put holds one lock of the process, so a
    replace over a stale version is refused even when the sizes match (the check compared sizes once),
    of threads racing to create the lock exactly one wins, and a lost lease publishes nothing."""
    import threading

    run = RunDir(f"memory://{tmp_path.name}/run")
    results: list[str] = []

    def create(i: int) -> None:
        try:
            run.create_exclusive("race.json", f"{i:02d}".encode())
            results.append("won")
        except FileExistsError:
            results.append("lost")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 15 + ["won"]
    _, seen = run.read_versioned("race.json")
    run.replace_if_unchanged("race.json", b"zz", seen)  # same size, other bytes
    with pytest.raises(ConcurrentWriteError, match="changed since this process read it"):
        run.replace_if_unchanged("race.json", b"yy", seen)
    assert run.read_bytes("race.json") == b"zz"

    lease = lock.Lease.take(run, log=lambda m: None)
    try:
        run.write_json("sidecar.json", {"n": 1})
        taker = replace_lock(run, lease.me, host="host-b", generation=2)
        with pytest.raises(LeaseLost):
            lease.confirm("sidecar.json")
        with pytest.raises(LeaseLost):
            run.write_json("sidecar.json", {"n": 2})
        assert run.read_json("sidecar.json") == {"n": 1} and read_lock(run) == taker
    finally:
        lease.release()
    assert read_lock(run) == taker, "a lost lease is never released over its taker's lock"


def test_a_holder_suspended_past_its_ttl_renews_before_it_publishes_and_finds_itself_taken_over(tmp_path):
    """A suspended machine's monotonic clock stops; its lease's age is measured on CLOCK_BOOTTIME,
    which does not (issue 48's finding): woken after the ttl, the holder's fence renews first, finds
    the taker's lock and publishes nothing. Measured on CLOCK_MONOTONIC it would have published on the
    fast path until its next renewal."""
    from andrea_core import poll
    from andrea_core.poll import awake_clock

    if sys.platform == "linux":  # the clock that counts a suspend (a VM never suspended: equal to monotonic)
        assert poll._AWAKE_CLOCK == time.CLOCK_BOOTTIME
    run = RunDir(f"memory://{tmp_path.name}/run")
    lease = lock.Lease.take(run, log=lambda m: None)
    try:
        run.write_json("sidecar.json", {"n": 1})
        taker = replace_lock(run, lease.me, host="host-b", generation=2)
        # What the awake clock shows after a suspend of one ttl: the last confirmation is a ttl old.
        lease.confirmed_at = awake_clock() - lease.ttl_s
        with pytest.raises(LeaseLost, match="lost its lease"):
            run.write_json("sidecar.json", {"n": 2})
        assert run.read_json("sidecar.json") == {"n": 1} and read_lock(run) == taker
    finally:
        lease.release()


def test_a_run_directory_on_an_untested_store_is_refused_naming_it():
    for url in ("gcs://bucket/run", "gs://bucket/run", "az://container/run", "abfs://container/run"):
        with pytest.raises(ConfigError, match=r"cannot live on .*supported: a local path, file://, s3://"):
            RunDir(url)


def replace_lock(run: RunDir, held: lock.TrainerIdentity, **changes) -> lock.TrainerIdentity:
    from dataclasses import replace

    taker = replace(held, **changes)
    run.replace_if_unchanged(LOCK, taker.encode(), run.read_versioned(LOCK)[1])
    return taker
