"""Polling until a deadline, one home: the project's waits on another process (a flock, a lease, a
file a trainer writes) are a condition looked at every so often until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
