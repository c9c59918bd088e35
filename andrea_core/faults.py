"""Faults injected by the tests, from one place: every `ANDREA_TEST_*` variable a product module
honours is read here, and nothing else in the product reads one.

A hook makes a fault happen (a pause, a host of another name, a planted file opened as the test planted
it); it never switches a safety check off in the product path: the product always takes its safe
route first, and the hook only acts where that route stops. Never set in production.
"""

from __future__ import annotations

import os
import signal
import time

PREFIX = "ANDREA_TEST_"
# ANDREA_TEST_HOST=NAME: this process is a machine of that name (its host name, and a boot id of its
# own), so that two processes of one test machine see each other as two hosts (run/lock.py).
HOST = PREFIX + "HOST"
# ANDREA_TEST_REPLACE_HELD=PATH: a compare-and-replace on local disk creates PATH once it holds the
# folder's flock, then holds it for half its bound (run/store.py, _DirectoryLock), or for
# ANDREA_TEST_REPLACE_HELD_S seconds (a slow filesystem on a loaded machine).
REPLACE_HELD = PREFIX + "REPLACE_HELD"
REPLACE_HELD_S = PREFIX + "REPLACE_HELD_S"
# ANDREA_TEST_FIXED_TEMP_NAMES=1: a temporary file is named `.NAME.tmp.PID` (no random part), and what
# a test planted at that name (a link to /dev/full, a file under a read lease, a folder) is opened as
# planted once the safe create (O_EXCL | O_NOFOLLOW) has refused it (run/store.py, _create_temp).
FIXED_TEMP_NAMES = PREFIX + "FIXED_TEMP_NAMES"

# The hooks of the modules above run/:
STARTUP_DELAY = PREFIX + "STARTUP_DELAY"  # cli: hold start-up this many seconds, handlers installed
PIVOT_KILL_AFTER = PREFIX + "PIVOT_KILL_AFTER"  # ops/pivot: SIGKILL this process after the named step
FORK_KILL_AFTER = PREFIX + "FORK_KILL_AFTER"  # ops/fork: die right after writing BRANCH/FILE
GUARD_NAN_AT = PREFIX + "GUARD_NAN_AT"  # train/guard: the batches at these data positions poison a step
GUARD_SIGNAL = PREFIX + "GUARD_SIGNAL"  # train/guard: POINT:SIGNAL, this process signals itself there
GUARD_LR_TIMES = PREFIX + "GUARD_LR_TIMES"  # train/guard: F@S, the learning rate times F after step S
GUARD_NOISE = PREFIX + "GUARD_NOISE"  # train/guard: oscillate@S or drift@S:L, corrupted targets after S


def value(name: str) -> str | None:
    """The hook's setting (`name` is the whole variable name, ANDREA_TEST_...), None when unset or empty."""
    if not name.startswith(PREFIX):
        raise ValueError(f"{name}: a test hook's name starts with {PREFIX}")
    return os.environ.get(name) or None


def die_at(hook: str, point: str) -> None:
    """This process dies by SIGKILL right here when hook `hook` names `point`, as a machine losing its
    power or a worker killed outright would (PIVOT_KILL_AFTER, FORK_KILL_AFTER). Unset: no effect."""
    if value(hook) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def startup_delay() -> float:
    """STARTUP_DELAY's seconds (0 when unset)."""
    return float(value(STARTUP_DELAY) or 0)


def test_host() -> str | None:
    """The host name ANDREA_TEST_HOST gives this process, or None."""
    return value(HOST)


def hold_replace(hold_s: float) -> None:
    """ANDREA_TEST_REPLACE_HELD: say (by creating the file it names) that the flock is held, then hold it
    (`hold_s`, or ANDREA_TEST_REPLACE_HELD_S)."""
    held = value(REPLACE_HELD)
    if held:
        with open(held, "a"):
            pass
        time.sleep(float(value(REPLACE_HELD_S) or hold_s))


def fixed_temp_names() -> bool:
    return value(FIXED_TEMP_NAMES) is not None


def open_planted(dfd: int, name: str, mode: int) -> int:
    """The fd of what a test planted at temporary name `name` in folder `dfd`, opened as the writer
    opened it before temporary names were unguessable (write-only, truncated, following a link): the
    fault the test planted (ENOSPC from /dev/full, a read lease that holds the open, EISDIR)."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode, dir_fd=dfd)
