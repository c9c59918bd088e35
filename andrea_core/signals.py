"""Trainer signals (contract): handlers only set flags; the trainer acts on them at step boundaries.

Installed as early as possible (before torch is imported) so that a SIGTERM during start-up, such as
a Prefect cancellation of a flow run that just launched the trainer, still ends in a clean exit 0.

Who may be signalled: a trainer process carries a secret nonce in its environment from its exec on
(`ANDREA_TRAINER_NONCE`, tagged with its pid so that one inherited from a parent does not count) and
writes it into the run's lock. /proc/PID/environ shows the environment a process was exec'd with, to
its own user only, so a lock's pid is signalled only if that process shows the lock's nonce
(run/lock.py). Standard library only: this module runs before any heavy import.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys

NONCE_ENV = "ANDREA_TRAINER_NONCE"
TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def environ_of(pid: int | str) -> dict[str, str]:
    """The environment process `pid` was exec'd with (raises OSError if it cannot be read: another
    user's process, or no /proc)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


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


def trainer_nonce() -> str | None:
    """This process's own trainer nonce, as /proc shows it to others; None if it has none."""
    try:
        value = environ_of("self").get(NONCE_ENV, "")
    except OSError:
        return None
    pid, _, secret = value.partition(":")
    return value if pid == str(os.getpid()) and len(secret) >= 32 else None


def nonce_environment(pid: int) -> dict[str, str]:
    """os.environ plus a fresh nonce for the process `pid` is about to become by exec."""
    return {**os.environ, NONCE_ENV: f"{pid}:{secrets.token_hex(16)}"}


def become_trainer_process() -> TrainerSignals:
    """The first thing a trainer process does. Blocks the trainer signals, re-execs itself (same pid,
    same argv) with a nonce in its environment if it has none, installs the handlers, then unblocks:
    a signal that came meanwhile was held pending across the exec and is delivered to the handler now,
    never to the default action."""
    signal.pthread_sigmask(signal.SIG_BLOCK, TRAINER_SIGNALS)
    exec_once = not os.environ.get(NONCE_ENV, "").startswith(f"{os.getpid()}:")  # never loop on exec
    if trainer_nonce() is None and exec_once and os.path.exists("/proc/self/environ"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, nonce_environment(os.getpid()))
    flags = install()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TRAINER_SIGNALS)
    return flags


class TrainerSignals:
    def __init__(self) -> None:
        self.stop: str | None = None  # "SIGTERM" / "SIGINT": checkpoint the step in flight, exit 0
        self.checkpoint = False  # SIGUSR1: checkpoint the step in flight, train on

    def _on_stop(self, signum, frame) -> None:
        self.stop = signal.Signals(signum).name

    def _on_checkpoint(self, signum, frame) -> None:
        self.checkpoint = True


_installed: TrainerSignals | None = None


def install() -> TrainerSignals:
    """Install the handlers once per process and return the flags they set."""
    global _installed
    if _installed is None:
        _installed = TrainerSignals()
        signal.signal(signal.SIGTERM, _installed._on_stop)
        signal.signal(signal.SIGINT, _installed._on_stop)
        signal.signal(signal.SIGUSR1, _installed._on_checkpoint)
    return _installed


def settle() -> None:
    """The trainer's end is decided (its last checkpoint written, its lease released, its status
    chosen): the trainer signals are ignored from now on. A stop that comes now has nothing left to
    stop, and Python's finalization would put the default action back under the handlers: a SIGTERM
    in those last tenths of a second (a unit stopped as the run completes, a flow run cancelled as it
    ends) killed a trainer that had exited cleanly, status -15 in place of 0."""
    for signum in TRAINER_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def uninstall() -> None:
    """Restore the default handlers (for in-process use such as tests and benchmarks)."""
    global _installed
    if _installed is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        _installed = None
