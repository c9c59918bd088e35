"""The run directory's trainer lock, `.trainer.json`, and safe signalling of the trainer it names.

Taking the lock is exclusive: the lock file is created only if absent (RunDir.create_exclusive: link(2)
on local disk, a put with If-None-Match on S3), and a stale lock is replaced only if it is still the
very version that was judged stale (RunDir.replace_if_unchanged: flock + compare on local disk, If-Match
on S3). Of any number of trainers starting at once, exactly one gets the lock. Each takeover raises the
lock's `generation`: the number a lease renewal and a fenced publish can be conditioned on.

A pid alone identifies nothing for long: pids are recycled, and a pid means something only in its own
pid namespace. The lock therefore records the boot id (the kernel), the pid namespace and the process's
kernel start time, and a process counts as "our trainer" only while all of them match. A lock written
under another kernel or in another pid namespace cannot be checked from here: it is neither taken over
nor signalled. The host name is only a hint (a pod rescheduled under a new name on the same kernel and
namespace is checked by its pid all the same).

Before a pid is signalled, it must also be this user's process, an andrea trainer of this very run
(its command line), and show the lock's secret nonce in its environment (andrea_core.signals): a
forged or copied lock can never get another process signalled.

The lock is also a lease (`Lease`), for run directories that several machines share (an object store):
its holder renews it every ANDREA_LEASE_RENEW_S seconds by replacing its own version (conditionally), and
a trainer on another machine, which cannot check the holder's pid, takes it over once it has watched the
same version stay unchanged for the holder's `lease_ttl_s` (its own monotonic clock: no clock of another
machine is trusted), raising `generation`. Every publish of the holder goes through `Lease.check`
(RunDir.fence): a holder that has not confirmed its lease within ttl - renew seconds confirms it first by
a conditional renewal, and one that finds the lock another holder's is fenced: it writes nothing more.
A renewal that merely fails (a full disk, a store refusing puts) loses nothing: publishes wait for the
next renewal that goes through (LeaseUnconfirmed). A holder may be only paused, its publish in flight
past its check: the taker undoes those right before its takeover write (RunDir.abort_writes_in_flight),
so that it cannot land after the takeover. A clean exit leaves the lock `released` (never
deleted), so that `generation` only ever grows.

Whether a trainer holds the run is judged here alone (trainer_liveness); one that cannot be checked
from here is asked to checkpoint or stop through the run directory (send_request, read at each renewal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from andrea_core import faults
from andrea_core.command import trainer_run_dir
from andrea_core.config import ConfigError
from andrea_core.document import Field, check
from andrea_core.poll import awake_clock, poll_until
from andrea_core.run.objstore import ConcurrentWriteError, Version
from andrea_core.run.rundir import LOCK, ReplacePaused, RunDir
from andrea_core.signals import NONCE_ENV, environ_of, process_start_ticks, trainer_nonce


class LockError(RuntimeError):
    """Another trainer holds the run directory."""


class LeaseLost(LockError):
    """Another trainer holds this trainer's lease now (the lock's generation or holder changed): it
    must not write to the run again."""


class LeaseUnconfirmed(OSError):
    """The lease could not be renewed (a full disk, a store refusing puts, a partitioned network): a
    publish is refused as one on a full disk is (training goes on), until a renewal goes through."""


class StoppedWaiting(LockError):
    """A stop signal came while this process waited for another trainer's lease: it never started."""


class NotOurTrainer(PermissionError):
    """The process a lock names is not this run's trainer (or cannot be shown to be): not signalled."""


ALIVE, DEAD, UNKNOWN = "alive", "dead", "cannot be checked"


LEASE_RENEW_ENV = "ANDREA_LEASE_RENEW_S"
LEASE_TTL_ENV = "ANDREA_LEASE_TTL_S"
LEASE_WAIT_ENV = "ANDREA_LEASE_WAIT_S"
DEFAULT_LEASE_RENEW_S, DEFAULT_LEASE_TTL_S = 10.0, 30.0


def _host() -> str:
    return faults.test_host() or socket.gethostname()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    test_host = faults.test_host()
    return f"{boot}/{test_host}" if test_host else boot


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}={raw!r}: expected a finite number of seconds >= 0")
    return value


def lease_timing() -> tuple[float, float]:
    """(renew_s, ttl_s) from ANDREA_LEASE_RENEW_S (default 10) and ANDREA_LEASE_TTL_S (default 30)."""
    renew = _seconds(LEASE_RENEW_ENV, DEFAULT_LEASE_RENEW_S)
    ttl = _seconds(LEASE_TTL_ENV, DEFAULT_LEASE_TTL_S)
    if renew <= 0 or ttl < 2 * renew:
        raise ConfigError(
            f"{LEASE_RENEW_ENV}={renew:g}, {LEASE_TTL_ENV}={ttl:g}: the renewal must be > 0 and the expiry "
            "at least twice the renewal (a lease must survive one late renewal)"
        )
    return renew, ttl


def _pid_namespace() -> str | None:
    """This process's pid namespace, e.g. 'pid:[4026531836]' (None where there is no /proc)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class TrainerIdentity:
    pid: int
    host: str
    boot_id: str
    proc_start: int | None
    started_at: float
    run_dir: str
    pid_ns: str | None = None  # None only where this machine has no /proc (old locks: _upgraded)
    nonce: str | None = None  # the trainer process's ANDREA_TRAINER_NONCE (None: cannot be signalled)
    generation: int = 1  # 1 for a fresh lock, one more at each takeover (and at each new holder)
    # The lease (None only while an old lock is read: _upgraded gives it one or refuses it).
    lease_ttl_s: float | None = None  # another machine may take over after watching it this long unchanged
    lease_renew_s: float | None = None
    # Each renewal is a new version of the lock, even within one clock tick; renewed_at is the holder's
    # wall clock, for people (no expiry is computed from it). Neither makes it another holder.
    renewals: int = dataclasses.field(default=0, compare=False)
    renewed_at: float | None = dataclasses.field(default=None, compare=False)
    released: bool = False  # a clean exit: the lock is kept (its generation with it), held by nobody
    # Under torchrun: the job's world size, and the agent whose SIGTERM reaches every rank (`pid` is
    # rank 0, which shares a signal sent to it alone with every rank at the next step).
    world_size: int = 1
    agent_pid: int | None = None
    # The options of its `andrea train` after the subcommand (None: not started from the command line):
    # what a pivot restarts it with (ops.pivot.recorded_train_options), re-parsed, never executed as is.
    train_args: list[str] | None = None

    @classmethod
    def of_this_process(
        cls, run_dir: str, world_size: int = 1, agent_pid: int | None = None
    ) -> TrainerIdentity:
        pid = os.getpid()
        renew, ttl = lease_timing()
        now = time.time()
        return cls(
            pid,
            _host(),
            _boot_id(),
            process_start_ticks(pid),
            now,
            run_dir,
            _pid_namespace(),
            trainer_nonce(),
            world_size=world_size,
            agent_pid=agent_pid,
            lease_ttl_s=ttl,
            lease_renew_s=renew,
            renewed_at=now,
        )

    def holds_same_lease(self, other: TrainerIdentity | None) -> bool:
        """The same holder's same tenure (renewals and released aside)."""
        return other is not None and (
            other.pid,
            other.boot_id,
            other.proc_start,
            other.nonce,
            other.generation,
        ) == (self.pid, self.boot_id, self.proc_start, self.nonce, self.generation)

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    def liveness(self) -> tuple[str, str]:
        """(ALIVE | DEAD | UNKNOWN, why). Only a lock of this kernel and this pid namespace can be
        checked by its pid; the same host name with another boot id is this machine rebooted."""
        if self.released:
            return DEAD, "it was released at a clean exit"
        if self.boot_id != _boot_id():
            if self.host == _host():
                return DEAD, "this machine has rebooted since"
            return UNKNOWN, f"it runs on host {self.host}, another machine"
        if self.pid_ns != _pid_namespace():
            return UNKNOWN, f"it runs in another pid namespace ({self.pid_ns}) of this machine"
        if self.proc_start is not None and process_start_ticks(self.pid) == self.proc_start:
            return ALIVE, "its process runs"
        return DEAD, "its process is gone"

    def is_alive(self) -> bool:
        """True only if this exact process (not a recycled pid) still runs, as seen from here."""
        return self.liveness()[0] == ALIVE

    def why_not_our_trainer(self, pid: int | str | None = None) -> str | None:
        """None if process `pid` (default: self.pid) is this user's andrea trainer of self.run_dir
        showing this lock's nonce; else what is wrong."""
        proc = f"/proc/{self.pid if pid is None else pid}"
        try:
            uid = os.stat(proc).st_uid
            if uid != os.getuid():
                return f"it belongs to uid {uid}, not to this user (uid {os.getuid()})"
            with open(f"{proc}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
            environ = environ_of(self.pid if pid is None else pid)
            cwd = os.readlink(f"{proc}/cwd")
        except OSError as e:
            return f"it cannot be inspected ({e.strerror or e})"
        if not self.nonce:
            return "the lock carries no trainer nonce"
        if not hmac.compare_digest(environ.get(NONCE_ENV, "").encode(), self.nonce.encode()):
            return "it does not carry the lock's trainer nonce"
        run_dir = trainer_run_dir(argv)
        if run_dir is None:
            return "its command line is not `andrea train --run-dir ...`"
        if "://" not in run_dir:
            run_dir = os.path.join(cwd, run_dir)
        try:
            trains = RunDir(run_dir).url
        except Exception as e:  # a command line no RunDir accepts is no trainer of ours either
            return f"its --run-dir {run_dir!r} is not a run directory ({e})"
        if trains != self.run_dir:
            return f"it trains {trains}, not {self.run_dir}"
        return None

    def signal(self, signum: int) -> None:
        """Send `signum`, after checking the pid still belongs to this very trainer: the same process
        (boot id, pid namespace, start time), ours, an andrea trainer of this run with the lock's nonce.
        A pidfd pins the process between the checks and the signal, so a pid recycled meanwhile is
        never hit."""
        pidfd = _pidfd_open(self.pid)
        try:
            state, why = self.liveness()
            if state != ALIVE:
                raise ProcessLookupError(
                    f"trainer pid {self.pid} of {self.run_dir}: {why} (or the pid was reused): not signalling"
                )
            problem = self.why_not_our_trainer()
            if problem is not None:
                raise NotOurTrainer(
                    f"pid {self.pid} named by {self.run_dir}'s {LOCK} is not this run's andrea trainer: "
                    f"{problem}; not signalling it"
                )
            if pidfd is None:
                os.kill(self.pid, signum)
            else:
                signal.pidfd_send_signal(pidfd, signum)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for `pid` (Linux 5.3+), or None where there is none."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise ProcessLookupError(f"trainer pid {pid} is gone: not signalling") from None
    except OSError:
        return None


# The lock's schema: every field's type and bounds (a lock may be forged). Text is printable and short,
# so that whatever prints it (andrea status, an error) cannot be made to emit terminal escapes; times and
# durations are finite and within reach (a ttl of 1e18 s would make a takeover wait forever).
DAY = 86_400.0


def _int(low: float, high: float, null: bool = False) -> Field:
    return Field((int,), null=null, required=False, low=low, high=high)


def _number(low: float, high: float, null: bool = False) -> Field:
    return Field((int, float), null=null, required=False, low=low, high=high)


def _text(null: bool = False) -> Field:
    return Field((str,), null=null, required=False, high=255, printable=True)


LOCK_SCHEMA: dict[str, Field] = {  # every field but run_dir (replaced by _parse); each may be absent
    "pid": _int(1, 2**22),
    "host": _text(),
    "boot_id": _text(),
    "proc_start": _int(0, 2**63, null=True),
    "started_at": _number(0, 1e11),
    "pid_ns": _text(null=True),
    "nonce": _text(null=True),
    "generation": _int(1, 2**63),
    "lease_ttl_s": _number(0, 7 * DAY, null=True),
    "lease_renew_s": _number(0, 7 * DAY, null=True),
    "renewals": _int(0, 2**63),
    "renewed_at": _number(0, 1e11, null=True),
    "released": Field((bool,), required=False),
    "world_size": _int(1, 4096),
    "agent_pid": _int(1, 2**22, null=True),
    # at most 64 words, each text (command.train_options checks them)
    "train_args": Field((list,), null=True, required=False, high=64, items=Field((str,), high=4096)),
}


def _parse(run: RunDir, data: bytes) -> TrainerIdentity:
    """The lock's identity after one schema check of every field (LOCK_SCHEMA), else LockError
    naming the field (its value escaped)."""
    try:
        fields = check(json.loads(data), LOCK_SCHEMA)
        known = {f.name for f in dataclasses.fields(TrainerIdentity)}
        fields = {k: v for k, v in fields.items() if k in known and k != "run_dir"}
        # The lock's location is what it locks, whatever it says: a lock copied from another run
        # must not make that run's trainer look like this one's.
        ident = TrainerIdentity(**fields | {"run_dir": run.url})
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise LockError(f"{run.path(LOCK)}: unreadable lock ({e}); remove it if no trainer runs") from e
    return _upgraded(run, ident)


UNRECORDED_NS = "unrecorded"  # an old lock's pid namespace, of a holder not on this machine: no process's


def _upgraded(run: RunDir, ident: TrainerIdentity) -> TrainerIdentity:
    """The one home of the migration of locks written by older versions (docs/design.md "Locks from
    before leases"), so that no other code has a branch for them. No pid namespace recorded: this
    machine's if its host and boot id are this machine's (what the old reader assumed), else one no
    process here has (cannot be checked from here). No lease: if its holder can be judged here (alive
    or dead by its pid, rebooted, released) it gets the default lease, which no rule reads for a holder
    judged here; if it cannot, LockError: an old trainer elsewhere never renews a lease, so no watch
    could tell it is gone, and it is never taken over."""
    if ident.pid_ns is None and _pid_namespace() is not None:
        here = ident.host == _host() and ident.boot_id == _boot_id()
        ident = dataclasses.replace(ident, pid_ns=_pid_namespace() if here else UNRECORDED_NS)
    if ident.lease_ttl_s is not None:
        return ident
    state, why = ident.liveness()
    if state == UNKNOWN:
        raise LockError(
            f"{run.url} is locked by trainer pid {ident.pid}, which cannot be checked from here: {why}; "
            f"its lock was written before leases, so nothing here can tell when it is gone. Stop it there, "
            f"or if it is gone remove {run.path(LOCK)}"
        )
    return dataclasses.replace(ident, lease_ttl_s=DEFAULT_LEASE_TTL_S, lease_renew_s=DEFAULT_LEASE_RENEW_S)


def read_lock(run: RunDir) -> TrainerIdentity | None:
    data, version = run.read_versioned(LOCK)
    return _parse(run, data) if version.exists else None


# --- asking a trainer through the run directory (one that cannot be signalled from here) ------------

REQUEST = ".trainer-request.json"  # {"format", "request", "generation", "id", "by", "at"}
REQUESTS = ("checkpoint", "stop")  # act as on SIGUSR1 / SIGTERM, at the next step boundary
REQUEST_SCHEMA = {
    "request": Field((str,), choices=REQUESTS),
    "generation": Field((int,)),
    "id": Field((str,), high=64),
}


def send_request(run: RunDir, holder: TrainerIdentity, request: str) -> str:
    """Ask the trainer holding `holder`'s lease to checkpoint or stop: a request file it reads at each
    lease renewal and acts on at its next step boundary, as on SIGUSR1 / SIGTERM. Addressed to that
    lease's generation (a later trainer ignores it). Returns the request's id."""
    if request not in REQUESTS:
        raise ValueError(f"request {request!r}: expected one of {REQUESTS}")
    rid = secrets.token_hex(8)
    doc = {"format": 1, "request": request, "generation": holder.generation, "id": rid}
    run.write_json(REQUEST, doc | {"by": _host(), "at": time.time()})
    return rid


def read_request(run: RunDir, generation: int) -> dict | None:
    """The request addressed to lease `generation`, or None (none, another generation's, or one that
    is not a request: the file is anyone's input, read bounded and checked field by field)."""
    if not run.exists(REQUEST):
        return None
    try:
        doc = check(run.read_json(REQUEST), REQUEST_SCHEMA)
    except (ValueError, ConfigError, OSError):
        return None
    return (
        {k: doc[k] for k in ("request", "generation", "id")} | {"by": str(doc.get("by"))[:100]}
        if doc["generation"] == generation
        else None
    )


def still_holds(run: RunDir, ident: TrainerIdentity) -> bool:
    """Whether the trainer `ident` still holds `run`: alive as checked here, or, where it cannot be
    checked, its lease (unreleased) still the lock's. What a waiter on a trainer elsewhere watches."""
    state, _ = ident.liveness()
    if state != UNKNOWN:
        return state == ALIVE
    now = read_lock(run)
    return ident.holds_same_lease(now) and not now.released


@dataclass(frozen=True)
class Liveness:
    """The one verdict on a run's trainer (trainer_liveness): `state` ALIVE (its process runs, checked
    here), DEAD (gone, rebooted, or released at a clean exit), UNKNOWN (another machine or pid
    namespace: it cannot be checked from here), or None (no lock at all); `why` says how it was told."""

    state: str | None
    holder: TrainerIdentity | None
    why: str


def trainer_liveness(run: RunDir) -> Liveness:
    """Whether `run`'s trainer is alive, dead or cannot be checked from here: the one place that judges
    it, for the pivot, status, the supervisor, gc and fork alike."""
    ident = read_lock(run)
    if ident is None:
        return Liveness(None, None, f"no {LOCK}")
    state, why = ident.liveness()
    return Liveness(state, ident, why)


def live_trainer(run: RunDir) -> TrainerIdentity | None:
    """The trainer that holds `run`, if it is alive as checked from here (trainer_liveness); None if
    no lock, a stale one, or one that cannot be checked from here."""
    verdict = trainer_liveness(run)
    return verdict.holder if verdict.state == ALIVE else None


def lease_said(ident: TrainerIdentity) -> str:
    """How recently a lock's lease was renewed, as its holder's lock says (its clock, not ours)."""
    renewed = ident.renewed_at if ident.renewed_at is not None else ident.started_at
    return (
        f"its lease (generation {ident.generation}, {ident.renewals} renewals, ttl {ident.lease_ttl_s:g}s) "
        f"was last renewed at {time.strftime('%H:%M:%S UTC', time.gmtime(renewed))} by its own clock "
        f"({max(0.0, time.time() - renewed):.0f}s ago by this machine's)"
    )


class TrainerElsewhere(LockError):
    """A trainer that cannot be checked from here holds the run: a command that would move, delete or
    stop anything refuses, touching nothing."""


def require_not_elsewhere(run: RunDir, doing: str) -> Liveness:
    """trainer_liveness, refusing (TrainerElsewhere) a trainer that cannot be checked from here: as
    far as anyone here can tell it is a live trainer elsewhere, renewing its lease, and nothing of the
    run may be moved, deleted or stopped from here. The error names its host, the lease generation and
    how recently its lock says it was renewed."""
    verdict = trainer_liveness(run)
    if verdict.state == UNKNOWN:
        raise elsewhere_error(run, verdict, doing)
    return verdict


def elsewhere_error(run: RunDir, verdict: Liveness, doing: str) -> TrainerElsewhere:
    """The refusal of `doing` under verdict's trainer, which cannot be checked from here (UNKNOWN)."""
    held = verdict.holder
    return TrainerElsewhere(
        f"{run.url}: not {doing}: trainer pid {held.pid} on host {held.host} cannot be checked from "
        f"here ({verdict.why}); {lease_said(held)}. It counts as a live trainer elsewhere: stop it "
        "there first, or run this where it can be checked"
    )


def acquire(
    run: RunDir, log=print, attempts: int = 5, world_size: int = 1, agent_pid: int | None = None
) -> TrainerIdentity:
    """Take the lock for this process, exclusively: refuse a live holder or one that cannot be checked
    from here, take over a dead one's or a released one (only if it is still that same lock when
    replaced), and a lease of another machine once it has expired (`_watch_lease`)."""
    return acquire_lease(run, log, attempts, world_size, agent_pid)[0]


def acquire_lease(
    run: RunDir,
    log=print,
    attempts: int = 5,
    world_size: int = 1,
    agent_pid: int | None = None,
    stopped: Callable[[], str | None] | None = None,
    train_args: list[str] | None = None,
) -> tuple[TrainerIdentity, Version]:
    """`acquire`, also returning the version of the lock it wrote: what the lease renews over.
    `stopped` says whether a stop signal came (its name): a wait for another's lease ends at once."""
    me = TrainerIdentity.of_this_process(run.url, world_size, agent_pid)
    if train_args is not None:
        me = dataclasses.replace(me, train_args=list(train_args))
    for _ in range(attempts):
        try:
            return me, run.create_exclusive(LOCK, me.encode())
        except FileExistsError:
            pass
        data, version = run.read_versioned(LOCK)
        if not version.exists:
            continue  # deleted meanwhile (removed by hand): try to create it again
        held = _parse(run, data)
        state, why = held.liveness()
        if state == ALIVE:
            raise LockError(
                f"{run.url} is in use by trainer pid {held.pid} on {held.host} "
                f"(started {time.ctime(held.started_at)}); stop it first (SIGTERM writes a checkpoint)"
            )
        if state == UNKNOWN:
            version = _watch_lease(run, held, version, log, stopped)
            if version is None:
                continue  # it changed hands (or was released) while we watched: look again
            why = f"its lease was not renewed for {held.lease_ttl_s:g}s"
            # Its publishes in flight are undone before the lock changes hands: the holder may only be
            # paused, and would complete them after the takeover (RunDir.abort_writes_in_flight).
            run.abort_writes_in_flight(held.pid, log)
        me = dataclasses.replace(me, generation=held.generation + 1)
        try:
            written = run.replace_if_unchanged(LOCK, me.encode(), version)
        except ReplacePaused as e:
            raise LockError(f"{run.url}: not taking the lock: {e}; start again") from None
        except ConcurrentWriteError:
            continue  # another process took it over first: look at who holds it now
        if held.released:
            log(f"taking the released lock of {run.url} (generation {me.generation})")
        else:
            log(
                f"taking over the stale lock of dead trainer pid {held.pid} on {held.host} ({why}; "
                f"{run.path(LOCK)}, generation {me.generation})"
            )
        return me, written
    raise LockError(f"{run.url}: the trainer lock kept changing while this process tried to take it")


def _watch_lease(
    run: RunDir, held: TrainerIdentity, version: Version, log, stopped: Callable[[], str | None] | None = None
) -> Version | None:
    """Watch another machine's lease until it has stayed this same version for its ttl (by this
    machine's monotonic clock): then it has expired, and its version is returned to be replaced. A
    renewal seen means its holder lives: refused, unless ANDREA_LEASE_WAIT_S (default 0) says to wait
    that long for it to expire. None if it was released or changed hands meanwhile. A stop signal
    (`stopped`) ends the wait within one poll (StoppedWaiting): nothing was started or written."""
    ttl = held.lease_ttl_s
    wait_s = _seconds(LEASE_WAIT_ENV, 0.0)
    started = seen_at = time.monotonic()
    log(
        f"{run.url} is leased by a trainer on host {held.host} (pid {held.pid}, generation "
        f"{held.generation}); watching whether it renews within its {ttl:g}s lease"
    )
    poll = min(1.0, ttl / 10)
    while True:
        if signal_name := poll_until(stopped or (lambda: None), poll, min(0.05, poll)):
            raise StoppedWaiting(
                f"{signal_name} came while waiting for the lease of {run.url} (held by pid {held.pid} "
                f"on {held.host}, generation {held.generation}): never started, nothing written"
            )
        data, now_version = run.read_versioned(LOCK)
        if not now_version.exists:
            return None
        if now_version.etag != version.etag or now_version.size != version.size:
            now = _parse(run, data)
            if not held.holds_same_lease(now) or now.released:
                return None
            if time.monotonic() - started >= wait_s:
                raise LockError(
                    f"{run.url} is in use by trainer pid {held.pid} on {held.host}: its lease (generation "
                    f"{held.generation}) was renewed {time.monotonic() - seen_at:.1f}s after this process "
                    f"first saw it; it is taken over only once unrenewed for {ttl:g}s. Stop that trainer "
                    f"first, or set {LEASE_WAIT_ENV} to wait for its lease to expire"
                )
            held, version, seen_at = now, now_version, time.monotonic()
            continue
        if time.monotonic() - seen_at >= ttl:
            return version


class Lease:
    """The lock this trainer holds, renewed on a background thread, and the fence its publishes pass.

    `check` is called before every publish (RunDir.fence): free while the last confirmed renewal is
    younger than ttl - renew (a taker waits a whole ttl from when it first sees that version, so the
    holder keeps at least one renewal period of margin); older, it renews first, synchronously. A renewal
    is a conditional replace over the version this lease last wrote (S3 If-Match; local disk flock and
    compare). The lease is lost only when another trainer holds the lock now (its generation or holder
    changed): then every later `check` raises LeaseLost, and the trainer stops at its next step without
    writing. A renewal that fails (a full disk, a store refusing puts, no network) loses nothing: the
    publishes it cannot fence are refused (LeaseUnconfirmed, an OSError, as a full disk's), training goes
    on, and the first renewal that goes through (the lock still ours) makes the next boundary's
    checkpoint possible again."""

    def __init__(
        self, run: RunDir, me: TrainerIdentity, version: Version, log: Callable[[str], None] = print
    ):
        self.run = run
        self.me = me
        self.version = version
        self.log = log
        self.renew_s = me.lease_renew_s or DEFAULT_LEASE_RENEW_S
        self.ttl_s = me.lease_ttl_s or DEFAULT_LEASE_TTL_S
        self.confirmed_at = awake_clock()  # taken before the write that made it ours
        self.written_at = awake_clock()  # after the last write of the lock that went through
        self.lost: str | None = None
        self.failing: str | None = None  # why the renewals fail now (None: the last one went through)
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Called with the lock's run directory after each renewal that goes through (the trainer reads
        # its requests file there: andrea_core.requests).
        self.on_renewal: Callable[[], None] | None = None

    @classmethod
    def take(
        cls,
        run: RunDir,
        log: Callable[[str], None] = print,
        world_size: int = 1,
        agent_pid: int | None = None,
        stopped: Callable[[], str | None] | None = None,
        train_args: list[str] | None = None,
    ) -> Lease:
        """Acquire the lock as a lease, fence `run`'s publishes on it and start renewing it."""
        t0 = awake_clock()
        me, version = acquire_lease(
            run, log=log, world_size=world_size, agent_pid=agent_pid, stopped=stopped, train_args=train_args
        )
        lease = cls(run, me, version, log)
        lease.confirmed_at = t0
        run.fence = lease
        lease.start()
        return lease

    @property
    def generation(self) -> int:
        return self.me.generation

    @property
    def margin_s(self) -> float:
        """ttl - renew: the fence's free window, and how late a renewal may come before a waiter could
        take the run over (design.md "The margin")."""
        return self.ttl_s - self.renew_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._renew_forever, name="andrea-lease", daemon=True)
        self._thread.start()

    def _renew_forever(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception:  # a full disk, a refusing store: said once (renew), tried again next period
                continue
            if self.on_renewal is not None:
                try:
                    self.on_renewal()
                except Exception as e:  # a request that cannot be read is not a reason to stop renewing
                    self.log(f"warning: {type(e).__name__}: {e}")

    def renew(self) -> None:
        """Replace the lock with a renewed copy, only over the version this lease last wrote. Raises
        LeaseLost if another trainer holds the lock now; any other error is a failed renewal."""
        with self._mutex:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            t0 = awake_clock()
            renewed = dataclasses.replace(self.me, renewals=self.me.renewals + 1, renewed_at=time.time())
            try:
                try:
                    self.version = self.run.replace_if_unchanged(LOCK, renewed.encode(), self.version)
                except ReplacePaused as e:
                    self._lose(f"{e}; it stops rather than risk a second writer")
                except ConcurrentWriteError:
                    # Not the version we last wrote. Ours still (a renewal whose reply was lost, or one a
                    # pause made us give up after it was read): renew over it. Anyone else's: lost.
                    data, version = self.run.read_versioned(LOCK)
                    now = _parse(self.run, data) if version.exists else None
                    if not self.me.holds_same_lease(now) or now.released:
                        self._lose(self._why_lost(now))
                    self.version = self.run.replace_if_unchanged(LOCK, renewed.encode(), version)
            except LeaseLost:
                raise
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                if self.failing is None:
                    self.log(
                        f"warning: the lease renewal of {self.run.path(LOCK)} failed ({why}): training goes "
                        "on; nothing is published until a renewal goes through"
                    )
                self.failing = why
                raise
            written = awake_clock()  # at once: a pause after this is not counted as the renewal's lateness
            if self.failing is not None:
                self.log(
                    f"the lease of {self.run.url} is renewed again (generation {self.me.generation}, "
                    f"{t0 - self.confirmed_at:.0f}s after the last renewal that went through)"
                )
                self.failing = None
            elif (gap := written - self.written_at) > self.margin_s:
                margin = self.ttl_s - gap
                self.log(
                    f"warning: the lease of {self.run.url} was renewed {gap:.1f}s after the last renewal "
                    f"(due every {self.renew_s:g}s, ttl {self.ttl_s:g}s): "
                    + (f"{margin:.1f}s short of the ttl, when" if margin > 0 else "past the ttl: by then")
                    + " a trainer waiting on it takes the run over; this process was paused or starved "
                    "(SIGSTOP, a suspend, an overloaded machine, a slow store)"
                )
            self.me, self.confirmed_at, self.written_at = renewed, t0, written

    def _lose(self, why: str) -> None:
        self.lost = why
        self.log(f"ERROR: {self.lost}")
        raise LeaseLost(self.lost)

    def _why_lost(self, now: TrainerIdentity | None) -> str:
        detail = "gone" if now is None else f"generation {now.generation}, pid {now.pid} on {now.host}"
        if now is not None and now.released:
            detail += ", released"
        return (
            f"this trainer (pid {self.me.pid} on {self.me.host}) lost its lease on {self.run.url} "
            f"(generation {self.me.generation}; the lock is {detail}; its last renewal went through "
            f"{awake_clock() - self.written_at:.1f}s ago, ttl {self.ttl_s:g}s): it writes nothing more "
            "and stops"
        )

    def _unconfirmed(self, what: str, e: Exception) -> LeaseUnconfirmed:
        age = awake_clock() - self.confirmed_at
        return LeaseUnconfirmed(
            f"not writing {what or 'to the run'}: the lease on {self.run.url} has not been renewed for "
            f"{age:.0f}s ({type(e).__name__}: {e}); publishing resumes once a renewal goes through"
        )

    def check(self, what: str = "") -> None:
        """The fence before a publish: raise LeaseLost if the lease is another's, LeaseUnconfirmed if it
        is due for renewal and the renewal fails; pass if it is (re)confirmed as ours."""
        if self.lost is not None:
            raise LeaseLost(f"not writing {what}: {self.lost}" if what else self.lost)
        if awake_clock() - self.confirmed_at < self.margin_s:
            return
        self.confirm(what)

    def confirm(self, what: str = "") -> None:
        """The fence before a checkpoint: renew now (a conditional write over our own version)."""
        try:
            self.renew()
        except LeaseLost as e:
            raise LeaseLost(f"not writing {what}: {e}" if what else str(e)) from None
        except Exception as e:  # cannot renew (a full disk, a partitioned network): do not write now
            raise self._unconfirmed(what, e) from e

    def release(self, remove: bool = False) -> None:
        """Stop renewing; unless lost, leave the lock released (its generation kept for the next one).
        `remove`: delete it instead, if it is the first lock of the directory (generation 1) and still
        the version this lease wrote: a run whose creation was refused leaves nothing behind."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.run.fence is self:
            self.run.fence = None
        with self._mutex, contextlib.suppress(OSError, LockError):
            if self.lost is None:
                if remove and self.me.generation == 1 and self.run.read_versioned(LOCK)[1] == self.version:
                    self.run.remove(LOCK)
                else:
                    done = dataclasses.replace(self.me, released=True, renewed_at=time.time())
                    self.version = self.run.replace_if_unchanged(LOCK, done.encode(), self.version)
                self.lost = "released"


def release(run: RunDir, me: TrainerIdentity) -> None:
    """Release a lock taken with `acquire` (no lease thread): it is left released, its generation kept."""
    with contextlib.suppress(OSError, LockError):
        data, version = run.read_versioned(LOCK)
        held = _parse(run, data) if version.exists else None
        if me.holds_same_lease(held) and not held.released:
            done = dataclasses.replace(held, released=True, renewed_at=time.time())
            run.replace_if_unchanged(LOCK, done.encode(), version)
