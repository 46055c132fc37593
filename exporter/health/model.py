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


@dataclass(frozen=True)
class Condition:
    uuid: str  # the physical GPU (or whole device) the condition is about
    tier: Tier
    reason: str  # short, stable, label-safe: xid_79, gpu_lost, ecc_uncorrectable_growth, ...
    since: float  # epoch seconds of first evidence
    last_seen: float  # latest evidence: the last event, or when a polled state last (re)appeared
    evidence: str = ""  # human text for Events and annotations
    count: int = 1


@dataclass(frozen=True)
class DeviceHealth:
    uuid: str
    conditions: tuple[Condition, ...] = ()
    sticky: bool = False  # re-failed too often: stays tainted until a person clears it

    @property
    def healthy(self) -> bool:
        return not any(c.tier in (Tier.FATAL, Tier.DEGRADED) for c in self.conditions)

    @property
    def worst(self) -> Tier | None:
        tiers = [c.tier for c in self.conditions]
        return max(tiers, key=lambda t: t.rank) if tiers else None
