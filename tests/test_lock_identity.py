"""The trainer lock (issue 14.2, 14.3) and who may be signalled (issue 17.2): exclusive acquisition
raced by real processes on local disk and on the moto S3 server, identities across pid namespaces,
and forged locks that must never get a process signalled."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import _env, last_logged_step, library_run, start_trainer, wait_for
from s3_server import ThrottledLink

from andrea_core.run import lock
from andrea_core.run.lock import LockError, NotOurTrainer, TrainerIdentity, live_trainer, read_lock
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import LOCK, RunDir
from tests.tiny import tiny_config

PROCESSES, TRIALS = 6, 30

RACER = textwrap.dedent(
    """
    import json, os, sys
    from andrea_core.run import lock
    from andrea_core.run.rundir import RunDir
    base, ready, go, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    def barrier():  # blocked in read(2) until the test has heard every racer's ready: no spinning
        os.write(ready, b"r")
        assert os.read(go, 1) == b"g"

    results = []
    for t in range(trials):
        barrier()  # all start together
        try:
            lock.acquire(RunDir(f"{base}/trial{t}"), log=lambda m: None)
            results.append("won")
        except lock.LockError as e:
            results.append("lost")
        except Exception as e:
            results.append(f"error {type(e).__name__}: {e}")
    # Alive until every racer is done: a winner that exited would leave the last round a dead
    # trainer's lock, which a racer still looking takes over (a second "won" of the test's making).
    barrier()
    print(json.dumps(results), flush=True)
    """
)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def stale_identity(run: RunDir, pid: int) -> TrainerIdentity:
    """A lock of `run` naming a dead trainer: `pid`, a dead process's (dead_pid)."""
    me = TrainerIdentity.of_this_process(run.url)
    return replace(me, pid=pid, proc_start=12345, nonce=None)


def race(base: str, tmp_path: Path, stale: bool, env: dict[str, str]) -> list[list[str]]:
    """TRIALS rounds of PROCESSES processes calling lock.acquire on one run at the same moment; every
    process stays alive until all rounds are over, so a winner's lock is never stale. Returns, per
    round, what each process got."""
    if stale:  # each round starts from the lock of a dead trainer: the takeover is raced
        dead = dead_pid()  # one process gone for every round's lock (a start each cost ~0.1-1 s)
        for t in range(TRIALS):
            run = RunDir(f"{base}/trial{t}")
            run.makedirs()
            run.write_atomic(LOCK, stale_identity(run, dead).encode())
    # The barrier of each round: every racer writes a byte to `ready` and blocks reading its own `go`
    # pipe; once all have written, the test writes each of them its byte at once (one pipe a racer: a
    # fast racer cannot take a slow one's byte of the same round).
    ready_r, ready_w = os.pipe()
    gos = [os.pipe() for _ in range(PROCESSES)]
    procs: list[subprocess.Popen] = []
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, base, str(ready_w), str(go_r), str(TRIALS)],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                pass_fds=(ready_w, go_r),
            )
            for go_r, _ in gos
        ]
        os.close(ready_w)
        ready_w = -1
        for _ in range(TRIALS + 1):  # each round's start, then the last: every racer done
            heard, deadline = 0, time.monotonic() + 600
            while heard < PROCESSES:
                # Every second (not a spin): a racer that exited before the last round fails the test.
                if select.select([ready_r], [], [], 1.0)[0]:
                    heard += len(os.read(ready_r, PROCESSES - heard))
                early = [p.returncode for p in procs if p.poll() is not None]
                assert not early and time.monotonic() < deadline, f"racers exited early: {early}"
            for _, go_w in gos:
                os.write(go_w, b"g")
        outcomes = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fd in [ready_r, ready_w, *(fd for pair in gos for fd in pair)]:
            if fd >= 0:
                os.close(fd)
    return [[o[t] for o in outcomes] for t in range(TRIALS)]


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_exactly_one_of_many_racing_trainers_gets_the_lock(kind, stale, tmp_path, s3_server, s3_bucket):
    base = str(tmp_path / "runs") if kind == "local" else f"{s3_bucket}/runs"
    env, link = _env(), None
    if kind == "s3":  # the racers reach the store over a slow link: each request takes tens of ms
        link = ThrottledLink(s3_server.port, rate=20_000)
        env.update(s3_server.env(link.endpoint))
    try:
        rounds = race(base, tmp_path, stale, env)
    finally:
        if link is not None:
            link.close()
    errors = [r for rnd in rounds for r in rnd if r.startswith("error")]
    assert not errors, errors[:3]
    winners = [rnd.count("won") for rnd in rounds]
    assert winners == [1] * TRIALS, f"winners per round: {winners}"
    if stale:  # the winner's takeover raised the generation
        assert {read_lock(RunDir(f"{base}/trial{t}")).generation for t in range(TRIALS)} == {2}


@pytest.mark.slow
@pytest.mark.parametrize("fresh", [True, False], ids=["new-run", "resume"])
def test_exactly_one_of_many_real_trainers_started_together_trains(fresh, tmp_path, tmp_path_factory):
    """The same race between real `andrea train` processes started at once on one run directory (a
    new one, created by whichever wins, or one to resume): one trains, every other exits 2 naming the
    winner, and the winner's run is whole."""
    run = RunDir(str(tmp_path / "run"))
    if fresh:
        cfg = tiny_config(tmp_path, train__checkpoint_every=5)
    else:  # the library's andrea-tiny at step 5 (conftest.library_run), its own config given again
        library_run(tmp_path_factory, tmp_path / "run", 5)
        cfg = tiny_config(tmp_path)
        assert run.checkpoint_steps() == [5] and last_logged_step(run) == 5
    # Paced so that the winner still trains when the last of the others looks at the lock.
    args = ["--config", cfg, "--run-dir", run.url, "--max-steps", "100000", "--pace", "0.1"]
    logs = [tmp_path / f"trainer-{i}.log" for i in range(3)]
    procs = [start_trainer(*args, log=log) for log in logs]
    try:
        losers: list[subprocess.Popen] = []
        deadline = time.monotonic() + 600
        while len(losers) < len(procs) - 1 and time.monotonic() < deadline:
            done = [p for p in procs if p.poll() is not None and p not in losers]
            if any(p.returncode != 2 for p in done):
                break
            losers += done
            time.sleep(0.1)
        winner = [p for p in procs if p not in losers]
        assert len(winner) == 1 and winner[0].poll() is None, [p.poll() for p in procs]
        (winner,) = winner
        ident = wait_for(lambda: live_trainer(run), timeout=600, what="the winner's lock")
        assert ident.pid == winner.pid
        for p in losers:
            text = logs[procs.index(p)].read_text()
            assert f"andrea: error: {run.url} is in use by trainer pid {winner.pid}" in text, text
        start = 5 if not fresh else 0
        wait_for(lambda: last_logged_step(run) >= start + 3, timeout=600, what="the winner's steps")
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=600) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    steps = [e.step for e in read_history(run)]
    assert steps == list(range(1, steps[-1] + 1)) and run.checkpoint_steps()[-1] == steps[-1] > start + 3


def test_a_lock_create_whose_reply_is_lost_is_still_ours(s3_bucket, monkeypatch):
    from tests.test_object_store import drop_first_reply

    run = RunDir(f"{s3_bucket}/run")
    answers = drop_first_reply(run.fs, monkeypatch, lambda kw: kw["Key"].endswith("/" + LOCK))
    me = lock.acquire(run, log=lambda m: None)
    assert len(answers) == 1 and "pre-conditions" in answers[0]  # the retry was refused: ours committed
    assert read_lock(run) == me and me.generation == 1
    lock.release(run, me)
    released = read_lock(run)  # left released, not deleted: the generation lives on for the next holder
    assert released.released and released.generation == 1 and not released.is_alive()


# --- 14.3: identity across pid namespaces and host names ---------------------------------------------


def test_a_lock_held_in_another_pid_namespace_is_refused_not_taken_over(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.decode().strip()}")
    run = RunDir(str(tmp_path / "run"))
    holder_code = (
        "from andrea_core.run import lock; from andrea_core.run.rundir import RunDir; import time; "
        # A live trainer there renews its lease: that, not its pid, is what this namespace can see.
        f"me = lock.Lease.take(RunDir({run.url!r})).me; print(me.pid, me.pid_ns, flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", holder_code],
        stdout=subprocess.PIPE,
        text=True,
        env=_env() | {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"},
    )
    try:
        pid_inside, ns_inside = holder.stdout.readline().split()
        assert ns_inside != os.readlink("/proc/self/ns/pid")
        before = read_lock(run)
        logged: list[str] = []
        renewed = r"in use by trainer pid \d+ .*its lease \(generation 1\) was renewed"
        with pytest.raises(LockError, match=renewed):
            lock.acquire(run, log=logged.append)
        assert "watching whether it renews within its 3s lease" in logged[0]
        assert read_lock(run) == before and before.generation == 1  # not taken over
        assert live_trainer(run) is None  # nothing from here signals pid {pid_inside} of that namespace
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_a_renamed_host_on_the_same_kernel_and_namespace_is_checked_by_its_pid(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    me = TrainerIdentity.of_this_process(run.url)
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        # A pod replaced under a new host name: same kernel (boot id), same pid namespace.
        live = replace(me, pid=sleeper.pid, proc_start=lock.process_start_ticks(sleeper.pid), host="pod-a")
        run.write_atomic(LOCK, live.encode())
        with pytest.raises(LockError, match=f"in use by trainer pid {sleeper.pid} on pod-a"):
            lock.acquire(run, log=lambda m: None)
    finally:
        sleeper.kill()
        sleeper.wait()
    run.write_atomic(LOCK, replace(live, pid=dead_pid()).encode())
    logged: list[str] = []
    taken = lock.acquire(run, log=logged.append)
    assert "taking over the stale lock of dead trainer" in logged[0] and taken.generation == 2
    # Another machine (another boot id under another name) still cannot be checked from here; a lock
    # without a lease (written before leases) is never taken over from it.
    other = replace(live, boot_id="another-kernel", host="pod-b", lease_ttl_s=None, lease_renew_s=None)
    run.write_atomic(LOCK, other.encode())
    with pytest.raises(LockError, match="cannot be checked from here: it runs on host pod-b"):
        lock.acquire(run, log=lambda m: None)


def old_lock(run: RunDir, pid: int, **changes) -> bytes:
    """A lock as a version before leases and pid namespaces wrote it: no lease, no pid_ns fields."""
    me = TrainerIdentity.of_this_process(run.url)
    doc = {k: v for k, v in asdict(me).items() if not k.startswith("lease_") and k != "pid_ns"}
    doc |= {"pid": pid, "proc_start": lock.process_start_ticks(pid) or 12345, "nonce": None, **changes}
    run.write_atomic(LOCK, json.dumps(doc).encode())
    return run.read_bytes(LOCK)


def test_a_lock_from_before_leases_is_migrated_as_it_is_read_and_judged_by_the_same_rules(tmp_path):
    """lock._upgraded, the one home of the migration (docs/design.md "Locks from older versions"): an
    old lock of a live process here is in use; of a dead one, taken over (generation + 1) under the
    same rules as any lock; of another machine, refused wherever it is read, naming the file and the
    remedy, its bytes unchanged: an old trainer never renews a lease, so nothing can tell it is gone."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        held = old_lock(run, sleeper.pid)
        upgraded = read_lock(run)
        assert upgraded.pid_ns == os.readlink("/proc/self/ns/pid") and upgraded.lease_ttl_s is not None
        with pytest.raises(LockError, match=f"in use by trainer pid {sleeper.pid} on {socket.gethostname()}"):
            lock.acquire(run, log=lambda m: None)
        assert run.read_bytes(LOCK) == held and live_trainer(run).pid == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
    logged: list[str] = []
    taken = lock.acquire(run, log=logged.append)
    assert f"taking over the stale lock of dead trainer pid {sleeper.pid}" in logged[0]
    assert taken.generation == 2 and json.loads(run.read_bytes(LOCK))["lease_ttl_s"] is not None
    held = old_lock(run, 4242, host="gpu-box-7", boot_id="another-kernel")
    why = (
        rf"{run.url} is locked by trainer pid 4242, which cannot be checked from here: it runs on host "
        rf"gpu-box-7, another machine; its lock was written before leases, .* if it is gone remove "
        rf"{run.path(LOCK)}$"
    )
    for reader in (read_lock, lock.trainer_liveness, lambda r: lock.acquire(r, log=lambda m: None)):
        with pytest.raises(LockError, match=why):
            reader(run)
    assert run.read_bytes(LOCK) == held
    # The same kernel under another host name, no pid namespace recorded: not this machine's namespace.
    old_lock(run, os.getpid(), host="pod-b")
    with pytest.raises(LockError, match="another pid namespace \\(unrecorded\\) of this machine"):
        read_lock(run)


# --- 17.2: a forged lock gets no process signalled -------------------------------------------------


def forged_lock_naming(run: RunDir, pid: int, nonce: str | None = "0" * 40) -> TrainerIdentity:
    """What an attacker can write: every public fact about a live process of ours, and some nonce."""
    me = TrainerIdentity.of_this_process(run.url)
    ident = replace(me, pid=pid, proc_start=lock.process_start_ticks(pid), nonce=nonce)
    run.makedirs()
    run.write_atomic(LOCK, ident.encode())
    return ident


@pytest.mark.parametrize("victim", ["sleep", "bash"])
def test_a_forged_lock_naming_a_live_process_of_ours_gets_it_no_signal(victim, tmp_path):
    run = RunDir(str(tmp_path / "run"))
    # `bash -c "sleep 600"` would exec sleep in bash's place: a second command keeps bash itself alive.
    argv = ["sleep", "600"] if victim == "sleep" else ["bash", "-c", "sleep 600; exit 0"]
    proc = subprocess.Popen(argv)
    try:
        comm = Path(f"/proc/{proc.pid}/comm")
        wait_for(lambda: comm.read_text().strip() in ("sleep", "bash"), what="the victim's exec")
        assert comm.read_text().strip() == victim  # the process signals would reach is that program
        forged_lock_naming(run, proc.pid)
        ident = live_trainer(run)
        assert ident is not None and ident.pid == proc.pid  # it looks alive: pid, boot id, start time
        for send in (ident.stop, lambda: ident.signal(signal.SIGUSR1)):
            with pytest.raises(NotOurTrainer, match="is not this run's andrea trainer"):
                send()
        from andrea_core.ops.supervise import require_live_trainer

        with pytest.raises(NotOurTrainer, match="does not carry the lock's trainer nonce"):
            require_live_trainer(run).signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None, "the forged lock's process was signalled"
    finally:
        proc.kill()
        proc.wait()


def test_the_pivot_tasks_refuse_a_forged_lock(tmp_path):
    from prefect.logging import disable_run_logger

    from tasks.trainer import signal_trainer, stop_trainer

    run = RunDir(str(tmp_path / "run"))
    proc = subprocess.Popen(["sleep", "600"])
    try:
        forged_lock_naming(run, proc.pid)
        with disable_run_logger():
            for call in (lambda: stop_trainer.fn(run.url, 5), lambda: signal_trainer.fn(run.url, "SIGUSR1")):
                with pytest.raises(NotOurTrainer):
                    call()
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_real_trainer_is_signalled_and_a_copy_of_its_lock_elsewhere_is_not(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    trainer = start_trainer("--config", tiny_config(tmp_path), "--run-dir", run.url, "--pace", "0.05")
    try:
        ident = wait_for(lambda: live_trainer(run), timeout=120, what="the trainer's lock")
        assert ident.pid == trainer.pid and ident.nonce and ident.nonce.startswith(f"{trainer.pid}:")
        # The same lock, copied into another run directory, names the same live trainer: refused.
        other = RunDir(str(tmp_path / "other"))
        other.makedirs()
        other.write_atomic(LOCK, run.read_bytes(LOCK))
        with pytest.raises(NotOurTrainer, match=f"it trains {run.url}, not {other.url}"):
            live_trainer(other).stop()
        # A lock naming the trainer with another nonce: refused.
        fake = RunDir(str(tmp_path / "fake"))
        forged_lock_naming(fake, trainer.pid)
        with pytest.raises(NotOurTrainer, match="does not carry the lock's trainer nonce"):
            live_trainer(fake).stop()
        assert trainer.poll() is None
        ident.stop()  # the real one, through its own lock
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_lock_file_records_the_identity(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    me = lock.acquire(run, log=lambda m: None)
    recorded = json.loads(Path(run.path(LOCK)).read_text())
    assert recorded == asdict(me)
    assert recorded["pid_ns"] == os.readlink("/proc/self/ns/pid") and recorded["host"] == socket.gethostname()
    assert recorded["generation"] == 1
