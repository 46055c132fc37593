"""The one clock seam: monotonic time for every duration, wall time only for stamps.

Every interval, window, hold, grace, backoff, retention and integration in the agent is measured
on ``Clock.monotonic``: NTP stepping the node's clock (a VM after live migration or suspend,
``chronyc makestep``, an operator fixing the date) moves none of them. ``Clock.wall`` is read
only for what leaves the process or must outlive it: rule annotations, Events, the budget's
slots, ``timeAdded``, the last-collection stamp, the boot comparison. A wall stamp read back
(an adopted rule's first-seen, a budget slot) is turned into a monotonic instant once, when it
is read (``from_wall``), so a step after that moves nothing.

The kubelet and node_exporter keep their timers the same way. Tests and the simulated node pass
a clock whose wall time they can step while monotonic time runs on.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock no wall-clock step moves; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since 1970 as the node believes now: for stamps that leave the process."""
        ...


class SystemClock:
    """The process's clocks: ``time.monotonic`` and ``time.time``."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    @staticmethod
    def wall() -> float:
        return time.time()


SYSTEM: Clock = SystemClock()


def from_wall(clock: Clock, stamp: float) -> float:
    """The monotonic instant of wall stamp ``stamp``, as the two clocks relate now.

    Read once, where the stamp enters the process; a wall step after that moves nothing."""
    return clock.monotonic() - (clock.wall() - stamp)


def to_wall(clock: Clock, instant: float) -> float:
    """The wall stamp of monotonic ``instant``, as the two clocks relate now (for what leaves)."""
    return clock.wall() - (clock.monotonic() - instant)
