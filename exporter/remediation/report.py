"""What the remediator tells the rest of the agent: one frozen report, published by each pass.

The agent reads this instead of reaching into the remediator's attributes; the metrics layer
renders it (``TaintRuleView`` has the fields the renderer reads). Nothing here does I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

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
