"""Health vocabulary shared by the health engine, the join and remediation."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(str, enum.Enum):
    FATAL = "fatal"  # device unusable or data at risk -> NoExecute
    DEGRADED = "degraded"  # needs a reset soon / unreliable -> NoSchedule
    INFORMATIONAL = "informational"  # application-level or benign -> visible only (effect None)

    @property
    def rank(self) -> int:
        return {Tier.INFORMATIONAL: 0, Tier.DEGRADED: 1, Tier.FATAL: 2}[self]


class Scope(str, enum.Enum):
    """The unit a fault takes down (see docs/health-and-remediation.md, "Fault scope")."""

    GPU = "gpu"  # the physical GPU: every MIG instance / partition on it is affected
    INSTANCE = "instance"  # one MIG instance only: its siblings and the parent stay healthy


@dataclass(frozen=True)
class Condition:
    # The device the fault is scoped to: the physical GPU's uuid for a GPU-wide fault, the MIG
    # instance's own uuid for an instance-scoped one (``scope`` says which).
    uuid: str
    tier: Tier
    reason: str  # short, stable, label-safe: xid_79, gpu_lost, ecc_uncorrectable_growth, ...
    since: float  # first evidence: a monotonic instant (exporter/clock.py), to_wall where it leaves
    last_seen: float  # latest evidence: the last event, or when a polled state last (re)appeared
    evidence: str = ""  # human text for Events and annotations
    count: int = 1
    scope: Scope = Scope.GPU
    # Clears only after a reset of the GPU has been observed (fatal device events, and fatal
    # conditions restored from a DeviceTaintRule that recorded it); level conditions clear
    # when the state has been clean for the clear hold.
    reset_required: bool = False


# A reading that stopped moving while the device reports activity (a frozen energy counter, profiling
# ratios stuck at 0 on a busy GPU): a fact about the telemetry, not a fault of the GPU.
READING_STUCK = "reading_stuck"


@dataclass(frozen=True)
class DeviceHealth:
    uuid: str
    conditions: tuple[Condition, ...] = ()
    sticky: bool = False  # re-failed too often: stays tainted until a person clears it
    # Conditions about the device's *readings*, not the device (reading_stuck): exported like the
    # others (gpu_health_condition), never acted on. Kept out of ``conditions`` on purpose: every
    # consumer of those (healthy, worst, remediation's plan, the rule records) treats a condition
    # as a fault of the GPU, and a frozen counter on a working GPU is no reason to taint it or to
    # call its claims unhealthy.
    advisories: tuple[Condition, ...] = ()

    @property
    def healthy(self) -> bool:
        return not any(c.tier in (Tier.FATAL, Tier.DEGRADED) for c in self.conditions)

    @property
    def worst(self) -> Tier | None:
        tiers = [c.tier for c in self.conditions]
        return max(tiers, key=lambda t: t.rank) if tiers else None
