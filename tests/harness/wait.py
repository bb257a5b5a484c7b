"""One way for a test to wait for something to happen: poll a predicate until it holds or time runs out.

`wait_for(predicate, timeout=10.0, interval=0.05, what="...")` returns the predicate's first truthy
value (so a poll can hand back what it found) and fails with `WaitTimeout`, an `AssertionError`
naming `what` and the timeout, when it never holds. A sleep that waits for something to happen is
this poll; a sleep that makes time pass (a rate window, a backoff) stays a sleep or a `FakeClock`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The predicate did not hold within the timeout."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str | Callable[[], object] = "condition",
) -> T:
    """Poll `predicate` every `interval` s until it returns a truthy value (returned); `what` says what
    was awaited in the failure message (a callable is asked at failure time, e.g. for a server log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise WaitTimeout(f"not reached within {timeout} s: {described}")
        time.sleep(interval)
