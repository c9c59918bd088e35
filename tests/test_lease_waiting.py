"""Waiting for a lease (issue 23.5, 23.6) and what a failed renewal means (23.2, in one process).

Two "hosts" on this machine as in test_lease.py (ANDREA_TEST_HOST: a host name and a boot id of their
own), on local disk: neither can check the other's pid, so only the lease decides."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import _env, start_trainer, wait_for
from test_retention import fabricated_run

from andrea_core.run import lock
from andrea_core.run.lock import LeaseLost, read_lock
from andrea_core.run.rundir import LOCK, RunDir

HOLDER = (
    "import sys, time; from andrea_core.run import lock; from andrea_core.run.rundir import RunDir; "
    "lease = lock.Lease.take(RunDir(sys.argv[1]), log=lambda m: print(m, flush=True)); "
    "print('holding', lease.generation, flush=True)\n"
    "while lease.lost is None: time.sleep(0.05)\n"
    "print('lost:', lease.lost, flush=True)"
)


def start_holder(url: str, env: dict[str, str]) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True, env=env, cwd=sys.path[0]
    )
    assert holder.stdout.readline().startswith("holding 1"), "the holder did not take the lease"
    return holder


def test_a_stop_while_waiting_for_a_lease_exits_at_once_saying_it_never_started(tmp_path):
    url = str(tmp_path / "run")
    fabricated_run(url, [100])
    lease = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"}
    holder = start_holder(url, _env() | lease | {"ANDREA_TEST_HOST": "host-a"})
    waiter = None
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            log = tmp_path / f"waiter-{sig.name}.log"
            env = _env() | lease | {"ANDREA_TEST_HOST": "host-b", "ANDREA_LEASE_WAIT_S": "120"}
            waiter = start_trainer("--run-dir", url, "--device", "cpu", env=env, log=log)
            wait_for(lambda: "watching whether it renews" in log.read_text(), 120, "the waiter to watch")  # noqa: B023
            t0 = time.monotonic()
            waiter.send_signal(sig)
            assert waiter.wait(timeout=30) == 0, log.read_text()
            took = time.monotonic() - t0
            text = log.read_text()
            assert took < 10, f"{sig.name} ended the wait after {took:.1f}s (the wait is 120 s)"
            said = f"andrea: {sig.name} before the first step: {sig.name} came while waiting for the lease"
            assert said in text, text
            assert "host-a, generation 1): never started, nothing written" in text, text
            assert "resuming" not in text and "Traceback" not in text, text
            assert read_lock(RunDir(url)).host == "host-a" and holder.poll() is None
    finally:
        for p in (holder, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_holder_paused_inside_its_renewal_does_not_block_the_takeover_nor_write_after_it(
    tmp_path, monkeypatch
):
    """The holder renews every 0.2 s; it is SIGSTOPped while its renewal holds the directory's flock
    (ANDREA_TEST_REPLACE_HELD marks that moment). The waiter takes over after ttl plus the flock's
    bounded wait, never blocks; the holder, continued, finds the lock another's and writes nothing."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    held = tmp_path / "flock-held"
    lease = {"ANDREA_LEASE_RENEW_S": "0.2", "ANDREA_LEASE_TTL_S": "0.6"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, run.url],
        stdout=subprocess.PIPE,
        text=True,
        env=_env() | lease | {"ANDREA_TEST_HOST": "host-a", "ANDREA_TEST_REPLACE_HELD": str(held)},
    )
    try:
        assert holder.stdout.readline().startswith("holding 1")
        wait_for(held.exists, 30, "a renewal holding the flock")
        holder.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        for k, v in lease.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("ANDREA_TEST_HOST", "host-b")
        taker = lock.acquire(run, log=lambda m: None)
        took = time.monotonic() - paused
        assert taker.generation == 2 and read_lock(run).host == "host-b"
        assert took < 15, f"the takeover took {took:.1f}s (ttl 0.6 s, flock wait 7 s)"
        after = run.read_bytes(LOCK)
        holder.send_signal(signal.SIGCONT)
        out, _ = holder.communicate(timeout=60)
        assert "lost: " in out and "generation 2" in out, out
        assert run.read_bytes(LOCK) == after, "the continued holder wrote over its taker's lock"
        print(f"takeover {took:.1f}s after the holder was paused inside its renewal")
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()


def test_a_paused_process_holding_the_directory_flock_does_not_block_a_takeover(tmp_path):
    """Whatever holds the run directory's flock (a renewal, a takeover) and is paused: a trainer whose
    wait for an expired lease ends takes it over within a bounded time, never blocks in flock(2)."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    lease = {"ANDREA_LEASE_RENEW_S": "0.2", "ANDREA_LEASE_TTL_S": "0.6"}
    holder = start_holder(run.url, _env() | lease | {"ANDREA_TEST_HOST": "host-a"})
    flock_code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"
    )
    flocker = subprocess.Popen(
        [sys.executable, "-c", flock_code, run.root], stdout=subprocess.PIPE, text=True
    )
    taker_code = (
        "from andrea_core.run import lock; from andrea_core.run.rundir import RunDir; import sys; "
        "print('generation', lock.acquire(RunDir(sys.argv[1]), log=lambda m: None).generation, flush=True)"
    )
    try:
        assert flocker.stdout.readline() == "held\n"
        flocker.send_signal(signal.SIGSTOP)
        holder.send_signal(signal.SIGSTOP)  # its renewals would block behind the flock as well
        t0 = time.monotonic()
        taker = subprocess.run(
            [sys.executable, "-c", taker_code, run.url],
            env=_env() | lease | {"ANDREA_TEST_HOST": "host-b"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        took = time.monotonic() - t0
        assert taker.stdout == "generation 2\n", taker.stderr
        assert took < 15, took
        holder.send_signal(signal.SIGCONT)
        wait_for(lambda: holder.poll() is not None, 30, "the continued holder to see its lease lost")
        assert read_lock(run).host == "host-b" and read_lock(run).generation == 2
    finally:
        for p in (flocker, holder):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


# --- 23.2 in one process: a failed renewal is not a lost lease --------------------------------------


class FailingWrites:
    """Every replace of the lock fails with `error` while `failing` is set (what a full disk or a
    store refusing puts does to the renewal); reads work."""

    def __init__(self, run: RunDir, error: OSError):
        self.failing, self.error, self.failed = True, error, 0
        self.replace = run.replace_if_unchanged

    def __call__(self, name, data, expect):
        if self.failing:
            self.failed += 1
            raise self.error
        return self.replace(name, data, expect)


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), PermissionError("Access Denied")], ids=["enospc", "403"]
)
def test_a_renewal_that_fails_refuses_publishes_but_never_loses_the_lease(tmp_path, monkeypatch, error):
    from andrea_core.run.lock import LeaseUnconfirmed

    monkeypatch.setenv("ANDREA_LEASE_RENEW_S", "0.2")
    monkeypatch.setenv("ANDREA_LEASE_TTL_S", "0.6")
    run = RunDir(str(tmp_path / "run"))
    logged: list[str] = []
    lease = lock.Lease.take(run, log=logged.append)
    try:
        writes = FailingWrites(run, error)
        monkeypatch.setattr(run, "replace_if_unchanged", writes)
        # Several renewals fail (5, 0.2 s apart), past ttl - renew (0.4 s) since the last that went through.
        wait_for(lambda: writes.failed >= 5, 30, "five failed renewals")
        assert lease.lost is None
        unconfirmed = r"not writing sidecar.json: the lease on .* not been renewed"
        with pytest.raises(LeaseUnconfirmed, match=unconfirmed):
            run.write_json("sidecar.json", {"n": 1})
        assert isinstance(LeaseUnconfirmed("x"), OSError) and not run.exists("sidecar.json")
        assert sum("lease renewal" in m and "failed" in m for m in logged) == 1, logged  # said once
        writes.failing = False
        wait_for(lambda: "renewed again" in " ".join(logged), 10, "a renewal that goes through")
        run.write_json("sidecar.json", {"n": 2})
        assert run.read_json("sidecar.json") == {"n": 2} and lease.lost is None
        assert read_lock(run).generation == 1 and read_lock(run).renewals > 0
        # Another holder now: that, and only that, loses the lease.
        data, version = run.read_versioned(LOCK)
        run.replace_if_unchanged(LOCK, data.replace(b'"generation": 1', b'"generation": 2'), version)
        with pytest.raises(LeaseLost):
            lease.confirm("step_000100.bin")
    finally:
        lease.release()


def test_a_renewal_slowed_past_a_second_but_not_paused_keeps_its_lease(tmp_path, monkeypatch):
    """The 1000-fault soak's fault 64 (2026-12-06, load 15, issue 48): a renewal whose read and rename
    of `.trainer.json` took 1.1 s through a slow filesystem, the trainer never paused, found the flock's
    bound of 1 s exceeded after its rename (ReplacePaused) and stopped a healthy trainer (exit 2). The
    bound is 3 s: a 1.5 s section renews, and the lease holds."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    lease = lock.Lease.take(run, log=lambda m: None)
    try:
        held = tmp_path / "held"
        monkeypatch.setenv("ANDREA_TEST_REPLACE_HELD", str(held))
        monkeypatch.setenv("ANDREA_TEST_REPLACE_HELD_S", "1.5")
        t0 = time.monotonic()
        lease.renew()
        assert held.exists() and time.monotonic() - t0 >= 1.5  # the section did take 1.5 s
        assert lease.lost is None
        assert read_lock(run).renewals == lease.me.renewals >= 1 and read_lock(run).generation == 1
    finally:
        monkeypatch.delenv("ANDREA_TEST_REPLACE_HELD")
        lease.release()


def test_a_late_renewal_is_logged_with_its_gap_and_a_lost_lease_says_when_it_last_renewed(
    tmp_path, monkeypatch
):
    """The soak's fault 140 (issue 48): a holder paused 1.54 s at renew 1 s / ttl 3 s, its renewal then slow
    on a loaded machine, lost its lease with nothing in its log saying how near it had come. A renewal
    later than ttl - renew after the last one (the margin the lease promises) says so, with the gap; a
    lost lease says how long ago its last renewal went through. The clock is set back, not slept through (a
    loaded machine's renewal may add a tenth)."""
    monkeypatch.setenv("ANDREA_LEASE_RENEW_S", "1")
    monkeypatch.setenv("ANDREA_LEASE_TTL_S", "3")
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    me, version = lock.acquire_lease(run, log=lambda m: None)
    said: list[str] = []
    lease = lock.Lease(run, me, version, log=said.append)  # not started: renewed by hand below
    late = r"warning: the lease of \S+ was renewed {}s after the last renewal \(due every 1s, ttl 3s\): {} "
    late += r"a trainer waiting on it takes the run over; this process was paused or starved \(SIGSTOP, a "
    late += r"suspend, an overloaded machine, a slow store\)"
    # A taker's first renewal: Lease.take counts the lease from before its wait (for the fence), but the
    # gap a waiter sees runs from the lock's write (the soak's takeovers logged "3.3s" before this).
    lease.confirmed_at -= 5.0
    lease.renew()
    lease.written_at -= 1.9  # within ttl - renew: nothing said
    lease.renew()
    assert said == []
    lease.written_at -= 2.4
    lease.renew()
    short = late.format(r"2\.[45]", r"0\.[56]s short of the ttl, when")
    assert len(said) == 1 and re.fullmatch(short, said[0])
    lease.written_at -= 3.5
    lease.renew()
    assert len(said) == 2 and re.fullmatch(late.format(r"3\.[56]", r"past the ttl: by then"), said[1])
    assert read_lock(run).renewals == 4 and lease.lost is None

    taker = dataclasses.replace(read_lock(run), generation=2, pid=me.pid + 1)
    run.replace_if_unchanged(LOCK, taker.encode(), run.read_versioned(LOCK)[1])
    lease.written_at -= 2.6
    with pytest.raises(LeaseLost) as lost:
        lease.renew()
    lost_at = r"\(generation 1; the lock is generation 2, pid \d+ on \S+; its last renewal went through "
    lost = str(lost.value)
    assert re.search(lost_at + r"2\.[67]s ago, ttl 3s\): it writes nothing more and stops$", lost), lost
