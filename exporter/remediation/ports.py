"""The seams of the remediator: what it needs from the health engine and from the cluster, as
Protocols. The concrete parts are built in :mod:`exporter.wiring` (the health engine, the
``exporter.k8s`` clients and watches); tests hand the same parts, or plain fakes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from ..devices.model import DeviceEvent
from ..health.model import DeviceHealth, Scope, Tier
from ..k8s.model import ClaimInfo, PodInfo
from ..k8s.nodestate import Deletion
from ..k8s.taintrules import RuleChange, RuleSpec, ServedTaintRules, StoredRule

Key = tuple[str, str, str]
Listener = Callable[[], None]


class HealthSource(Protocol):
    """The health engine (exporter.health.engine.HealthEngine)."""

    def all_health(self) -> dict[str, DeviceHealth]: ...
    def subscribe(self, fn: Callable[[str], None]) -> None: ...
    def restore(self, uuid: str, reason: str, tier: Tier, since: float, evidence: str, reset_required: bool, scope: Scope | None = None) -> None: ...
    def mark_sticky(self, uuid: str, note: str, scope: Scope = Scope.GPU) -> None: ...
    def clear_sticky(self, uuid: str) -> None: ...
    def on_event(self, ev: DeviceEvent) -> None: ...


class RuleApi(Protocol):
    """DeviceTaintRule writes (exporter.k8s.taintrules.TaintRuleClient)."""

    def served(self) -> ServedTaintRules: ...
    @property
    def api_version(self) -> str: ...
    def create_rule(self, spec: RuleSpec) -> StoredRule: ...
    def patch_rule(self, name: str, change: RuleChange) -> None: ...
    def delete(self, name: str, uid: str | None = None) -> None: ...
    def get_rule(self, name: str) -> StoredRule | None: ...


class EventSink(Protocol):
    """Kubernetes Events (exporter.k8s.events.EventRecorder); never raises."""

    def record(self, regarding: Mapping[str, str], reason: str, note: str, action: str, warning: bool = False) -> object: ...


class RuleFeed(Protocol):
    """This node's rules as the cluster holds them (exporter.k8s.feeds)."""

    @property
    def lags(self) -> bool: ...  # a watch: a rule created a moment ago may be missing yet
    def start(self, on_change: Listener) -> None: ...
    def stop(self) -> None: ...
    def current(self) -> list[StoredRule] | None: ...  # None: nothing new to look at


class KillSwitch(Protocol):
    """The node's remediation kill switch (exporter.k8s.feeds)."""

    def start(self, on_change: Listener) -> None: ...
    def stop(self) -> None: ...
    def disabled(self) -> bool | None: ...  # None: not known (yet), keep the last answer


class DeletionStore(Protocol):
    """Where admins' deletions outlive the process (exporter.k8s.nodestate.NodeState)."""

    @property
    def name(self) -> str: ...
    def load(self) -> dict[Key, Deletion]: ...
    def save(self, deleted: dict[Key, Deletion]) -> bool: ...


class PodLookup(Protocol):
    """One pod or claim by name (exporter.k8s.pods.PodFacts): asked only about a pod that stays
    on a NoExecute device past its grace. ``pod`` returns None for a pod that no longer exists
    and raises ApiError otherwise; ``claim`` returns None when it cannot tell."""

    def pod(self, namespace: str, name: str) -> PodInfo | None: ...
    def claim(self, namespace: str, name: str) -> ClaimInfo | None: ...
