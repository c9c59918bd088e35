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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass

from andrea_core.objstore import ConcurrentWriteError
from andrea_core.rundir import LOCK, RunDir
from andrea_core.signals import NONCE_ENV, environ_of, trainer_nonce


class LockError(RuntimeError):
    """Another trainer holds the run directory."""


class NotOurTrainer(PermissionError):
    """The process a lock names is not this run's trainer (or cannot be shown to be): not signalled."""


ALIVE, DEAD, UNKNOWN = "alive", "dead", "cannot be checked"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str | None:
    """This process's pid namespace, e.g. 'pid:[4026531836]' (None where there is no /proc)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks since boot, or None if there is no such process
    (or only its zombie: an exited trainer whose parent has not reaped it yet is gone all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses: split after its closing parenthesis.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass(frozen=True)
class TrainerIdentity:
    pid: int
    host: str
    boot_id: str
    proc_start: int | None
    started_at: float
    run_dir: str
    pid_ns: str | None = None  # None: a lock written before pid namespaces were recorded
    nonce: str | None = None  # the trainer process's ANDREA_TRAINER_NONCE (None: cannot be signalled)
    generation: int = 1  # 1 for a fresh lock, one more at each takeover
    # Under torchrun: the job's world size, and the agent whose SIGTERM reaches every rank (`pid` is
    # rank 0, which shares a signal sent to it alone with every rank at the next step).
    world_size: int = 1
    agent_pid: int | None = None

    @classmethod
    def of_this_process(
        cls, run_dir: str, world_size: int = 1, agent_pid: int | None = None
    ) -> TrainerIdentity:
        pid = os.getpid()
        return cls(
            pid,
            socket.gethostname(),
            _boot_id(),
            process_start_ticks(pid),
            time.time(),
            run_dir,
            _pid_namespace(),
            trainer_nonce(),
            world_size=world_size,
            agent_pid=agent_pid,
        )

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    def liveness(self) -> tuple[str, str]:
        """(ALIVE | DEAD | UNKNOWN, why). Only a lock of this kernel and this pid namespace can be
        checked by its pid; the same host name with another boot id is this machine rebooted."""
        if self.boot_id != _boot_id():
            if self.host == socket.gethostname():
                return DEAD, "this machine has rebooted since"
            return UNKNOWN, f"it runs on host {self.host}, another machine"
        if self.pid_ns is None:  # an older lock: only the host name says whether it is this machine's
            if self.host != socket.gethostname():
                return UNKNOWN, f"it runs on host {self.host}"
        elif self.pid_ns != _pid_namespace():
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
        run_dir = _trainer_run_dir(argv)
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


def _trainer_run_dir(argv: list[str]) -> str | None:
    """The --run-dir of an `andrea train` / `python -m andrea_core train` command line, else None."""
    is_andrea = any(
        a == "andrea_core" or os.path.basename(a) == "andrea" or a.endswith("andrea_core/__main__.py")
        for a in argv
    )
    if not is_andrea or "train" not in argv:
        return None
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


def _parse(run: RunDir, data: bytes) -> TrainerIdentity:
    try:
        fields = json.loads(data)
        known = {f.name for f in dataclasses.fields(TrainerIdentity)}
        # The lock's location is what it locks, whatever it says: a lock copied from another run
        # must not make that run's trainer look like this one's.
        return TrainerIdentity(**{k: v for k, v in fields.items() if k in known} | {"run_dir": run.url})
    except (ValueError, TypeError, AttributeError) as e:
        raise LockError(f"{run.path(LOCK)}: unreadable lock ({e}); remove it if no trainer runs") from e


def read_lock(run: RunDir) -> TrainerIdentity | None:
    data, version = run.read_versioned(LOCK)
    return _parse(run, data) if version.exists else None


def live_trainer(run: RunDir) -> TrainerIdentity | None:
    """The trainer that holds `run`, if it is alive; None if no lock or a stale one."""
    ident = read_lock(run)
    return ident if ident is not None and ident.is_alive() else None


def acquire(
    run: RunDir, log=print, attempts: int = 5, world_size: int = 1, agent_pid: int | None = None
) -> TrainerIdentity:
    """Take the lock for this process, exclusively: refuse a live holder or one that cannot be checked
    from here, take over a dead one's (only if it is still that same lock when replaced)."""
    me = TrainerIdentity.of_this_process(run.url, world_size, agent_pid)
    for _ in range(attempts):
        try:
            run.create_exclusive(LOCK, me.encode())
            return me
        except FileExistsError:
            pass
        data, version = run.read_versioned(LOCK)
        if not version.exists:
            continue  # released meanwhile: try to create it again
        held = _parse(run, data)
        state, why = held.liveness()
        if state == ALIVE:
            raise LockError(
                f"{run.url} is in use by trainer pid {held.pid} on {held.host} "
                f"(started {time.ctime(held.started_at)}); stop it first (SIGTERM writes a checkpoint)"
            )
        if state == UNKNOWN:
            raise LockError(
                f"{run.url} is locked by a trainer on host {held.host} (pid {held.pid}) that cannot be "
                f"checked from here: {why}; if it is gone, remove {run.path(LOCK)}"
            )
        me = dataclasses.replace(me, generation=held.generation + 1)
        try:
            run.replace_if_unchanged(LOCK, me.encode(), version)
        except ConcurrentWriteError:
            continue  # another process took it over first: look at who holds it now
        log(f"taking over the stale lock of dead trainer pid {held.pid} ({why}; {run.path(LOCK)})")
        return me
    raise LockError(f"{run.url}: the trainer lock kept changing while this process tried to take it")


def release(run: RunDir, me: TrainerIdentity) -> None:
    with contextlib.suppress(OSError, LockError):
        if read_lock(run) == me:
            run.remove(LOCK)
