"""The remediator's contract with the rest of the agent, as plain types: the words every part uses
(:class:`Effect`, :class:`Action`, :class:`Target`), what it is told (:class:`RemediationPolicy`, built
from the flags in :mod:`exporter.wiring`), what it needs (the Protocols at its seams: the health
engine, the cluster, the budget) and what it tells (:class:`RemediationReport`, published by each pass
and rendered by the metrics layer). Nothing here does I/O.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..health.model import DeviceHealth, Scope, Tier
from ..k8s.model import ClaimInfo, DeviceKey, PodInfo
from ..k8s.nodestate import Deletion
from ..k8s.taintrules import ServedTaintRules, TaintRule
from ..reasons import TaintMode

Listener = Callable[[], None]


class Effect(str, enum.Enum):
    """A DeviceTaintRule's taint effect (the API's own spelling)."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


class Action(str, enum.Enum):
    """What the writer does with one device's rule (also the taint_actions_total label)."""

    NOTHING = "nothing"
    CREATE = "create"
    UPDATE = "update"
    REFRESH = "refresh"
    DELETE = "delete"
    KEEP = "keep"


class Verdict(enum.Enum):
    """The safety rails' answer for one fault domain that wants NoExecute (exporter.remediation.rails);
    :func:`~.plan.decide` takes it as it is."""

    ALLOWED = "allowed"  # raise (or keep) NoExecute
    SETTLING = "settling"  # fenced until the settle window ends: not a suppression
    NODE_FAULT = "node_fault"
    RATE_LIMITED = "rate_limit"
    BUDGET_FULL = "budget"
    BUDGET_UNAVAILABLE = "budget_unavailable"


@dataclass(frozen=True)
class Target:
    """A DRA device published by this node's ResourceSlices, resolved to a local device."""

    driver: str
    pool: str
    device: str
    uuid: str  # the local device (a MIG instance's own uuid for MIG devices)
    gpu: str  # the physical GPU it lives on (its own uuid for a full GPU)

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.device)



@dataclass(frozen=True)
class RemediationPolicy:
    """The numbers of the rails and timers; the remediator never sees the whole configuration."""

    node: str
    mode: TaintMode = TaintMode.ENFORCE
    hold: float = 1800.0  # healthy time before a rule steps down one level (--taint-hold-seconds)
    settle: float = 2.0  # a new fatal fault is NoSchedule this long before NoExecute
    node_fault_window: float = 2.0  # failures this close together are judged together
    node_failure_fraction: float = 0.5  # more than this share of the node's GPUs: a node fault
    rate_limit: int = 2  # new NoExecute fault domains per node per rate window
    rate_window: float = 600.0
    interval: float = 5.0  # seconds between passes while something is watched over (at most QUIET_PASS)
    resync: float = 30.0  # seconds between passes while the node is quiet
    refused_retry: float = 300.0  # a write the API server refused is asked again after this
    # a pod still on a NoExecute device this long after the taint (plus its toleration, or its
    # deletion) is looked at and told in a Warning Event (exporter.remediation.evictions)
    eviction_grace: float = 60.0

    @property
    def dry_run(self) -> bool:
        return self.mode == TaintMode.DRY_RUN


# --------------------------------------------------------------------------- seams


class HealthSource(Protocol):
    """The health engine (exporter.health.engine.HealthEngine)."""

    def all_health(self) -> dict[str, DeviceHealth]: ...
    def subscribe(self, fn: Callable[[str], None]) -> None: ...
    def restore(self, uuid: str, reason: str, tier: Tier, since: float, evidence: str, reset_required: bool,
                scope: Scope | None = None) -> None: ...
    def mark_sticky(self, uuid: str, note: str, scope: Scope = Scope.GPU) -> None: ...
    def clear_sticky(self, uuid: str) -> None: ...
    def reset_proven(self, uuid: str, why: str) -> None: ...  # a reset this process did not see, proven


class RuleApi(Protocol):
    """DeviceTaintRule writes (exporter.k8s.taintrules.TaintRuleClient)."""

    def served(self) -> ServedTaintRules: ...
    @property
    def api_version(self) -> str: ...
    def create_rule(self, rule: TaintRule) -> TaintRule: ...
    def patch_rule(self, rule: TaintRule, mark_sticky: bool) -> None: ...
    def delete(self, name: str, uid: str | None = None) -> None: ...
    def get_rule(self, name: str) -> TaintRule | None: ...


class EventSink(Protocol):
    """Kubernetes Events (exporter.k8s.events.EventRecorder); never raises."""

    def record(self, regarding: Mapping[str, str], reason: str, note: str, action: str,
               warning: bool = False) -> object: ...


class RuleFeed(Protocol):
    """This node's rules as the cluster holds them (exporter.k8s.feeds)."""

    @property
    def lags(self) -> bool: ...  # a watch: a rule created a moment ago may be missing yet
    def start(self, on_change: Listener) -> None: ...
    def stop(self) -> None: ...
    def current(self) -> list[TaintRule] | None: ...  # None: nothing new to look at


class KillSwitch(Protocol):
    """The node's remediation kill switch (exporter.k8s.feeds)."""

    def start(self, on_change: Listener) -> None: ...
    def stop(self) -> None: ...
    def disabled(self) -> bool | None: ...  # None: not known (yet), keep the last answer


class DeletionStore(Protocol):
    """Where admins' deletions outlive the process (exporter.k8s.nodestate.NodeState)."""

    @property
    def name(self) -> str: ...
    def load(self) -> dict[DeviceKey, Deletion]: ...
    def save(self, deleted: dict[DeviceKey, Deletion]) -> bool: ...


class PodLookup(Protocol):
    """One pod or claim by name (exporter.k8s.pods.PodFacts): asked only about a pod that stays
    on a NoExecute device past its grace. ``pod`` returns None for a pod that no longer exists
    and raises ApiError otherwise; ``claim`` returns None when it cannot tell."""

    def pod(self, namespace: str, name: str) -> PodInfo | None: ...
    def claim(self, namespace: str, name: str) -> ClaimInfo | None: ...


class Budget(Protocol):
    """The cluster NoExecute budget (exporter.k8s.budget.ClusterBudget; :class:`~.rails.LocalBudget` in one
    process): a slot taken when a fault domain is raised to NoExecute, returned when it no longer holds it."""

    def take(self, holder: str) -> bool: ...  # False when full; idempotent for a holder; ApiError when unreadable
    def release(self, holder: str) -> None: ...
    def cancel(self, holder: str) -> None: ...  # a refused holder no longer wants a slot (asks nothing)
    def held(self, prefix: str | None = None) -> set[str]: ...
    def subscribe(self, listener: Listener) -> None: ...  # called when a refused take may succeed now
    def close(self) -> None: ...


# --------------------------------------------------------------------------- the report

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class TaintRuleView:
    driver: str
    pool: str
    device: str
    effect: str
    tier: str
    uuid: str = ""  # the local device the rule was written for
    key: str = ""  # the taint as written: gpu-health.dra-gpu-exporter.io/<tier>
    value: str = ""  # the reason, squeezed into a label value


@dataclass(frozen=True)
class PendingEvictionView:
    """A NoExecute rule this agent owns and how many pods still hold its device
    (``dra_taint_pods_pending_eviction``)."""

    rule: str
    driver: str
    pool: str
    device: str
    pods: int


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram's counts at one moment (what a report carries: never the live one)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS) + 1)  # the last one: above every bucket
    sum: float = 0.0
    count: int = 0


@dataclass
class Histogram:
    """Detection-to-taint latency, written by the remediation thread only."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.sum, self.count)


@dataclass(frozen=True)
class RemediationReport:
    """The remediator's state for metrics and probes, as of its last pass."""

    mode: str = "off"
    active: bool = False  # a fault on this node gets a DeviceTaintRule now
    ok: bool = True  # the last pass completed
    error: str = ""  # why the last pass failed, or what the API server refused
    refused: tuple[str, ...] = ()  # "device: verb refused (status): message", one per held write
    rules: tuple[TaintRuleView, ...] = ()
    actions: Mapping[str, int] = field(default_factory=dict)
    suppressed: Mapping[str, int] = field(default_factory=dict)
    budget_exhausted: bool | None = None
    latency: HistogramSnapshot | None = None
    pending_eviction: tuple[PendingEvictionView, ...] = ()  # one per NoExecute rule, 0 pods included

    @property
    def healthy(self) -> bool:
        """The remediation collector's success: the pass ran and no write is being refused."""
        return self.ok and not self.refused

    @property
    def problem(self) -> str:
        if self.refused:
            return "DeviceTaintRule writes refused by the API server: " + "; ".join(self.refused)
        return self.error
