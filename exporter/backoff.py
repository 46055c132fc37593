"""Capped exponential backoff with jitter, shared by every client that retries: the Kubernetes
watchers and caches, the remediator, and the kubelet client."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Capped exponential backoff with jitter: each delay in [d/2, d] (and not below
    ``min_delay``), d doubling from ``initial`` to ``cap``; a Retry-After wins when longer."""

    def __init__(self, initial: float = 0.5, cap: float = 30.0, rng: Callable[[], float] = random.random,
                 min_delay: float = 0.0) -> None:
        self.initial = initial
        self.cap = cap
        self.min_delay = min_delay  # no delay below this, jitter or not
        self._rng = rng
        self._failures = 0

    def reset(self) -> None:
        self._failures = 0

    @property
    def failures(self) -> int:
        return self._failures

    def next_delay(self, retry_after: float | None = None) -> float:
        base = min(self.cap, self.initial * (2.0 ** min(self._failures, 30)))  # 2.0: int ** int is typed Any
        self._failures += 1
        delay = max(self.min_delay, base * (0.5 + 0.5 * self._rng()))
        if retry_after is not None:
            # the server said how long it needs; don't come back earlier, but don't sleep for
            # an absurd header either
            delay = max(delay, min(retry_after, 300.0))
        return delay
