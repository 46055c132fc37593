"""The safety rails, one object over plain data: may this fault domain be raised to NoExecute now?

A fault *domain* is a physical GPU with every DRA device it backs, or one MIG instance with a
fatal fault of its own (``record.domain_of``). Every rail counts domains, never DRA devices:

* the settle window: a new fatal fault is fenced (NoSchedule) for the longer of the settle
  time and the node-fault window, so the node-wide verdict is final before any eviction;
* the node-wide test: more than ``node_failure_fraction`` of the node's GPUs failing within the
  window is a node problem (NoSchedule only);
* the rate window: at most ``rate_limit`` domains raised per ``rate_window`` seconds;
* the cluster budget: a slot is taken when a domain is raised and returned when it no longer
  holds or wants NoExecute; a refused domain waits (the budget says when to ask again).

Lowering is never gated. Apart from the :class:`~.contract.Budget` it is handed, nothing here does
I/O: tests drive it with plain numbers and a :class:`LocalBudget`.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping

import structlog

from ..k8s.connection import ApiError
from .contract import Budget, Listener, RemediationPolicy, Verdict

log = structlog.get_logger(__name__)


class SafetyRails:
    def __init__(self, policy: RemediationPolicy, budget: Budget) -> None:
        self.policy = policy
        self.budget = budget
        self.raised: set[str] = set()  # domains allowed NoExecute (holding a budget slot)
        self.waiting: set[str] = set()  # domains refused a slot that still want one
        self.next_due: float | None = None  # when a settling domain's raise is due
        self.budget_error = ""  # why the budget cannot be read, while it cannot
        self._times: deque[float] = deque()  # when domains were raised (rate window)

    @property
    def budget_exhausted(self) -> bool:
        return bool(self.waiting)

    def _slot(self, domain: str) -> str:
        """The domain's name in the cluster budget (its slot holder)."""
        return f"{self.policy.node}.{domain}"

    def begin(self, now: float, fatal_since: Mapping[str, float], gpus: int, holding: Iterable[str]) -> set[str]:
        """Start a pass: every domain ``holding`` NoExecute (the record's rules) holds its slot;
        returns the GPUs whose fatal fault is part of a node-wide one."""
        p = self.policy
        self.raised.update(holding)  # (an adopted rule's slot, taken by an earlier process)
        while self._times and now - self._times[0] > p.rate_window:
            self._times.popleft()
        self.next_due = None
        return node_wide(fatal_since, gpus, p.node_failure_fraction, p.node_fault_window)

    def check(self, domain: str, *, holds: bool, since: float | None, node_fault: bool, now: float,
              kill_switch: bool) -> Verdict:
        """Whether ``domain`` may hold NoExecute now. ``holds``: one of its devices' rules has it
        already; ``since``: when its fatal fault began. Taken once per domain per pass."""
        p = self.policy
        if domain in self.raised or holds:
            self.raised.add(domain)
            return Verdict.ALLOWED
        if since is not None and settling(since, now, p.settle, p.node_fault_window):
            due = settle_due(since, p.settle, p.node_fault_window)
            self.next_due = due if self.next_due is None else min(self.next_due, due)
            return Verdict.SETTLING
        if node_fault:
            return Verdict.NODE_FAULT
        if len(self._times) >= p.rate_limit:
            return Verdict.RATE_LIMITED
        if kill_switch:
            return Verdict.ALLOWED  # nothing is written; nothing to count
        if not p.dry_run:  # (dry-run decides like enforce, rate limit included, and takes no slot)
            try:
                took = self.budget.take(self._slot(domain))
            except ApiError as e:
                # Fail safe: without the budget object no domain is raised beyond NoSchedule.
                self.budget_error = str(e)
                return Verdict.BUDGET_UNAVAILABLE
            self.budget_error = ""
            if not took:
                self.waiting.add(domain)
                return Verdict.BUDGET_FULL
        self.waiting.discard(domain)
        self.raised.add(domain)
        self._times.append(now)
        return Verdict.ALLOWED

    def return_slots(self, keep: Iterable[str]) -> None:
        """End a pass: domains that neither hold nor want NoExecute (``keep``) return their slot,
        and stop waiting for one. A slot that cannot be returned now is tried next pass."""
        keep = set(keep)
        for domain in sorted(self.waiting - keep):
            self.waiting.discard(domain)
            self.budget.cancel(self._slot(domain))
        for domain in sorted(self.raised - keep):
            self.raised.discard(domain)
            if self.policy.dry_run:
                continue
            try:
                self.budget.release(self._slot(domain))
            except ApiError as e:
                self.raised.add(domain)
                log.warning("budget_release_failed", domain=domain, error=str(e))


# --------------------------------------------------------------------------- the arithmetic, over plain data


def node_wide(fatal_since: Mapping[str, float], gpus: int, fraction: float, window: float) -> set[str]:
    """The GPUs whose fatal fault is part of a node-wide one.

    A GPU's fault is node-wide when, counting the GPUs whose GPU-wide fatal fault began within
    ``window`` seconds of its own (itself included), more than ``fraction`` of the node's
    ``gpus`` physical GPUs failed: "a majority within the window" at the default 0.5. A
    failure minutes after another is judged on its own, so on a 4-GPU node a second GPU
    failing a minute after the first is not a node fault.
    """
    if gpus < 2:
        return set()
    need = max(2, math.floor(fraction * gpus) + 1)  # strictly more than the fraction
    out = set()
    times = sorted(fatal_since.values())
    for gpu, since in fatal_since.items():
        near = sum(1 for t in times if abs(t - since) <= window)
        if near >= need:
            out.add(gpu)
    return out


def settling(fatal_since: float | None, now: float, settle: float, window: float) -> bool:
    """Whether a domain's new fatal fault is still inside its settle window.

    It waits for the longer of the settle time and the node-fault window, so a raise to
    NoExecute is never taken before the node-wide test for it is final."""
    if fatal_since is None:
        return False
    return now - fatal_since < max(settle, window)


def settle_due(fatal_since: float, settle: float, window: float) -> float:
    """When a settling domain's raise is due (for the loop's next wake-up)."""
    return fatal_since + max(settle, window)


class LocalBudget:
    """The :class:`~.contract.Budget` inside one process: for dry-run (which writes nothing) and for an
    agent without a namespace to keep the cluster's ConfigMap in."""

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
