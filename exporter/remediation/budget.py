"""The cluster NoExecute budget as the remediator sees it: take a slot when a fault domain is
raised to NoExecute, give it back when the domain steps down or is untainted.

The cluster-wide implementation is :class:`exporter.k8s.budget.ClusterBudget` (one ConfigMap,
resourceVersion-guarded updates, read through a watch only while a slot is wanted).
:class:`LocalBudget` is the same contract inside one process: for dry-run (which writes
nothing) and for an agent without a namespace to keep the object in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

Listener = Callable[[], None]


class Budget(Protocol):
    def take(self, holder: str) -> bool: ...  # False when full; idempotent for a holder; ApiError when unreadable
    def release(self, holder: str) -> None: ...
    def cancel(self, holder: str) -> None: ...  # a refused holder no longer wants a slot (asks nothing)
    def held(self, prefix: str | None = None) -> set[str]: ...
    def subscribe(self, listener: Listener) -> None: ...  # called when a refused take may succeed now
    def close(self) -> None: ...


class LocalBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def take(self, holder: str) -> bool:
        with self._lock:
            if holder in self._held:
                return True
            if len(self._held) >= self.capacity:
                return False
            self._held.add(holder)
            return True

    def release(self, holder: str) -> None:
        with self._lock:
            freed = holder in self._held
            self._held.discard(holder)
        if freed:
            for fn in list(self._listeners):
                fn()

    def cancel(self, holder: str) -> None:
        """(Nothing is kept for a refused holder.)"""

    def held(self, prefix: str | None = None) -> set[str]:
        with self._lock:
            return {h for h in self._held if prefix is None or h.startswith(prefix)}

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def close(self) -> None:
        """(Nothing to close.)"""
