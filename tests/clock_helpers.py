"""A clock the test moves by hand: expiry, backoff and hold periods are tested by moving time,
never by waiting for it."""

from __future__ import annotations


class ManualClock:
    """Callable like ``time.time``/``time.monotonic``; ``advance`` is the only way it moves."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
