"""A clock the test moves by hand: expiry, backoff and hold periods are tested by moving time,
never by waiting for it."""

from __future__ import annotations


class ManualClock:
    """Callable like ``time.time``/``time.monotonic``, and an ``exporter.clock.Clock``:
    ``advance`` moves both of its clocks, ``step_wall`` only the wall clock (an NTP step)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self.wall_step = 0.0

    def __call__(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + self.wall_step

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def step_wall(self, seconds: float) -> None:
        self.wall_step += seconds
