"""Polling until a deadline, one home: the project's waits on another process (a flock, a lease, a
file a trainer writes) are a condition looked at every so often until it holds or time runs out. And
the clock a holder measures its own lease on (`awake_clock`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# CLOCK_BOOTTIME counts the time a machine spends suspended; CLOCK_MONOTONIC stops then (Linux).
_AWAKE_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def awake_clock() -> float:
    """Seconds on a clock that keeps running while the machine is suspended (CLOCK_BOOTTIME; the
    monotonic clock where there is none). A holder's lease ages on it as the other hosts see it age:
    after a suspend past the ttl the holder renews (and finds itself taken over) before it publishes."""
    if _AWAKE_CLOCK is None:
        return time.monotonic()
    return time.clock_gettime(_AWAKE_CLOCK)


def poll_until(done: Callable[[], T], seconds: float, interval: float) -> T | None:
    """The first truthy value of `done()`, looked at once at least and then every `interval` seconds
    until `seconds` have passed (by the monotonic clock); None if it never came."""
    deadline = time.monotonic() + seconds
    while True:
        if value := done():
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(interval, left))
