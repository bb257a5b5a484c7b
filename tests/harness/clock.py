"""A clock the test moves by hand, for code that takes `clock: Callable[[], float]`."""

from __future__ import annotations


class FakeClock:
    """`clock()` reads `now` (seconds); a test moves time with `clock.now += s` or `clock.advance(s)`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
