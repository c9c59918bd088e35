"""The run directory's trainer lock, `.trainer.json`, and safe signalling of the trainer it names.

A pid alone identifies nothing for long: pids are recycled. The lock therefore records the process's
kernel start time and the boot id, and a process counts as "our trainer" only while all three match.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import asdict, dataclass

from andrea_core.rundir import LOCK, RunDir


class LockError(RuntimeError):
    """Another trainer holds the run directory."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


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
            world_size,
            agent_pid,
        )

    def is_alive(self) -> bool:
        """True only if this exact process (not a recycled pid) still runs on this host."""
        if self.host != socket.gethostname() or self.boot_id != _boot_id():
            return False
        return self.proc_start is not None and process_start_ticks(self.pid) == self.proc_start

    def signal(self, signum: int) -> None:
        """Send `signum`, after checking the pid still belongs to this trainer."""
        if not self.is_alive():
            raise ProcessLookupError(
                f"trainer pid {self.pid} of {self.run_dir} is gone (or the pid was reused): not signalling"
            )
        os.kill(self.pid, signum)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)


def read_lock(run: RunDir) -> TrainerIdentity | None:
    if not run.exists(LOCK):
        return None
    try:
        return TrainerIdentity(**run.read_json(LOCK))
    except (ValueError, TypeError) as e:
        raise LockError(f"{run.path(LOCK)}: unreadable lock ({e}); remove it if no trainer runs") from e


def live_trainer(run: RunDir) -> TrainerIdentity | None:
    """The trainer that holds `run`, if it is alive; None if no lock or a stale one."""
    ident = read_lock(run)
    return ident if ident is not None and ident.is_alive() else None


def acquire(run: RunDir, log=print, world_size: int = 1, agent_pid: int | None = None) -> TrainerIdentity:
    """Take the lock for this process: refuse a live holder, take over a dead one's."""
    held = read_lock(run)
    if held is not None:
        if held.is_alive():
            raise LockError(
                f"{run.url} is in use by trainer pid {held.pid} on {held.host} "
                f"(started {time.ctime(held.started_at)}); stop it first (SIGTERM writes a checkpoint)"
            )
        # Another host, or this host name under another boot id (another machine of the same name, or
        # this one before a reboot): its pid means nothing here, so its trainer may be alive.
        if held.host != socket.gethostname() or held.boot_id != _boot_id():
            boot = "" if held.host != socket.gethostname() else f", boot id {held.boot_id}, not this boot's"
            raise LockError(
                f"{run.url} is locked by a trainer on host {held.host} (pid {held.pid}{boot}) that cannot "
                f"be checked from here; if it is gone, remove {run.path(LOCK)}"
            )
        log(f"taking over the stale lock of dead trainer pid {held.pid} ({run.path(LOCK)})")
    me = TrainerIdentity.of_this_process(run.url, world_size, agent_pid)
    run.write_json(LOCK, asdict(me))
    # Two trainers racing past the check both write: only the one whose lock survived proceeds.
    if read_lock(run) != me:
        raise LockError(f"{run.url}: lost the race for the trainer lock to another process")
    return me


def release(run: RunDir, me: TrainerIdentity) -> None:
    try:
        if read_lock(run) == me:
            run.remove(LOCK)
    except (OSError, LockError):
        pass
