"""The writer: executes decisions against the API server and tells them in Events.

It owns the record of the rules that exist (``owned``), writes rules by deterministic name (a
retry after a lost answer meets 409 and adopts instead of duplicating), and tells a fault
domain's writes in one Event per domain and kind of change (:meth:`tell`), not one per DRA
device: one GPU failing is one event to a person, however many MIG devices it spans.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ..config import TaintMode
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError
from ..k8s.events import EventRecorder, micro_time, node_ref
from ..k8s.taintrules import TaintRuleClient
from . import names
from .plan import EFFECT_RANK, EVIDENCE_MAX, Action, Decision, Effect, OwnedRule, Target
from .report import Histogram
from .state import rule_from_object

log = structlog.get_logger(__name__)


class NameTaken(Exception):
    """A rule with our deterministic name exists and is not ours: never touch it."""


@dataclass(frozen=True)
class Outcome:
    """One write that happened, for the domain's Event."""

    target: Target
    event: str  # GPUTainted | GPUTaintEscalated | GPUTaintSteppedDown | GPUUntainted | HardwareSwapDetected
    rule: str
    effect_from: str = ""
    effect_to: str = ""
    tier: str = ""
    reason: str = ""
    evidence: str = ""
    why: str = ""


class RuleWriter:
    def __init__(self, node: str, mode: TaintMode, rules: TaintRuleClient, events: EventRecorder, clock: Callable[[], float], hold: float) -> None:
        self.node = node
        self.mode = mode
        self.rules = rules
        self.events = events
        self.clock = clock
        self.hold = hold
        self.owned: dict[tuple[str, str, str], OwnedRule] = {}
        self.lock = threading.RLock()
        self.actions: Counter[str] = Counter()
        self.latency = Histogram()
        # Rules this agent deleted: a watch may still show them for a moment, and they must not
        # be adopted back (cleared by the engine once the watch no longer shows them).
        self.deleted: set[str] = set()
        self.on_deleted_by_someone: Callable[[tuple[str, str, str], OwnedRule], None] = lambda k, r: None

    # -- the record ------------------------------------------------------------------------
    def rule(self, key: tuple[str, str, str]) -> OwnedRule | None:
        with self.lock:
            return self.owned.get(key)

    def _labels(self, tier: str, sticky: bool) -> dict[str, str]:
        labels = {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: self.node, names.TIER_LABEL: tier}
        if sticky:
            # Only ever added by the agent; taking it off (or deleting the rule) is the person's
            # "cleared", so patches never remove it.
            labels[names.STICKY_LABEL] = "true"
        return labels

    def _annotations(self, t: Target, d: Decision, first_seen: float | None, scope: str) -> dict[str, str]:
        return {
            names.UUID_ANNOTATION: t.uuid,
            names.GPU_ANNOTATION: t.domain,
            names.SCOPE_ANNOTATION: scope,
            names.REASON_ANNOTATION: d.reason,
            names.EVIDENCE_ANNOTATION: d.evidence[:EVIDENCE_MAX],
            names.FIRST_SEEN_ANNOTATION: micro_time(first_seen or self.clock()),
            names.TIER_ANNOTATION: d.tier,
            names.RESET_REQUIRED_ANNOTATION: "true" if d.tier == Tier.FATAL.value else "false",
        }

    @staticmethod
    def first_seen(h: DeviceHealth, tier: str) -> float | None:
        times = [c.since for c in h.conditions if c.tier.value == tier]
        return min(times) if times else None

    def ref(self, name: str) -> dict[str, str]:
        return {"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": name}

    # -- writes ------------------------------------------------------------------------------
    def apply(self, t: Target, h: DeviceHealth, rule: OwnedRule | None, d: Decision, now: float, scope: str) -> Outcome | None:
        if d.action in (Action.NOTHING, Action.KEEP):
            if rule is not None and d.action == Action.KEEP and d.calm_since != rule.calm_since:
                rule.calm_since = d.calm_since
            return None
        if d.action == Action.CREATE:
            return self.create(t, h, d, now, scope)
        if rule is None:
            # plan.decide updates, refreshes and deletes only a rule it was given
            raise ValueError(f"{d.action!r} without an existing rule")
        if d.action == Action.UPDATE:
            return self.update(t, rule, d, now)
        if d.action == Action.REFRESH:
            return self.refresh(t, rule, d, now)
        if d.action == Action.DELETE:
            return self.delete(t, rule, d)
        raise ValueError(f"unknown action {d.action!r}")

    def create(self, t: Target, h: DeviceHealth, d: Decision, now: float, scope: str) -> Outcome | None:
        name = names.rule_name(self.node, t.driver, t.pool, t.device)
        first = self.first_seen(h, d.tier)
        rule = OwnedRule(
            name=name, driver=t.driver, pool=t.pool, device=t.device, uuid=t.uuid, effect=d.effect, tier=d.tier, reason=d.reason,
            evidence=d.evidence[:EVIDENCE_MAX], sticky=d.sticky, created_at=now, refreshed_at=now, gpu=t.domain, scope=scope,
            first_seen=first, reset_required=d.tier == Tier.FATAL.value,
        )
        if self.mode == TaintMode.DRY_RUN:
            rule.virtual = True
            with self.lock:
                self.owned[t.key] = rule
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=name, device=t.device, uuid=t.uuid, effect=d.effect, reason=d.reason)
            return None
        body = self.rules.body(
            name, t.driver, t.pool, t.device, f"{names.TAINT_DOMAIN}/{d.tier}", names.label_value(d.reason), d.effect,
            self._labels(d.tier, d.sticky), self._annotations(t, d, first, scope),
        )
        try:
            created = self.rules.create(body)
            self.actions[Action.CREATE.value] += 1
        except ApiError as e:
            if e.status != 409:
                raise
            existing = self.rules.get(name)
            adopted = rule_from_object(existing) if existing else None
            if existing is None or adopted is None or (existing.get("metadata", {}).get("labels") or {}).get(names.MANAGED_BY) != names.MANAGED_BY_VALUE:
                raise NameTaken(name) from None
            with self.lock:
                self.owned[t.key] = adopted
            self.actions["adopt"] += 1
            log.info("rule_adopted_on_conflict", rule=name)
            # Typically our own earlier create whose answer was lost: it never got its Event.
            self.adopted_event(adopted, "it already existed when this agent tried to create it")
            return None
        rule.uid = (created.get("metadata") or {}).get("uid", "")
        with self.lock:
            self.owned[t.key] = rule
        if first is not None:
            self.latency.observe(max(0.0, self.clock() - first))
        log.warning("rule_created", rule=name, device=t.device, uuid=t.uuid, gpu=t.domain, effect=d.effect, tier=d.tier, reason=d.reason, suppressed=d.suppressed or None)
        return Outcome(t, "GPUTainted", name, "", d.effect, d.tier, d.reason, d.evidence)

    def _patch(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> bool:
        """Write ``d``'s effect, tier, reason, evidence and sticky mark onto the rule (one merge
        patch, same name and uid). False when the rule turned out to be gone."""
        patch = {
            "metadata": {
                # The sticky label only when newly marking: re-sending it would put back a label
                # a person removed since our last look (a merge patch without it leaves it be).
                "labels": self._labels(d.tier, d.sticky and not rule.sticky),
                "annotations": {
                    names.REASON_ANNOTATION: d.reason,
                    names.EVIDENCE_ANNOTATION: d.evidence[:EVIDENCE_MAX],
                    names.TIER_ANNOTATION: d.tier,
                    names.RESET_REQUIRED_ANNOTATION: "true" if d.tier == Tier.FATAL.value else "false",
                },
            },
            "spec": {"taint": {"key": f"{names.TAINT_DOMAIN}/{d.tier}", "value": names.label_value(d.reason), "effect": d.effect}},
        }
        try:
            self.rules.patch(rule.name, patch)
        except ApiError as e:
            if e.status == 404:
                # Deleted behind our back since we last looked: an admin cleared it.
                log.warning("rule_deleted_by_someone_else", rule=rule.name, device=rule.device)
                self.on_deleted_by_someone(t.key, rule)
                return False
            raise
        rule.tier, rule.reason, rule.evidence, rule.refreshed_at = d.tier, d.reason, d.evidence[:EVIDENCE_MAX], now
        rule.sticky = rule.sticky or d.sticky
        rule.reset_required = d.tier == Tier.FATAL.value
        return True

    def refresh(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        """Same effect, newer record. Told in an Event when it says something new to a person
        (another reason, the device turned sticky); evidence-only refreshes are not."""
        if rule.virtual:
            rule.reason, rule.evidence, rule.sticky, rule.refreshed_at = d.reason, d.evidence[:EVIDENCE_MAX], rule.sticky or d.sticky, now
            return None
        old_reason, was_sticky = rule.reason, rule.sticky
        if not self._patch(t, rule, d, now):
            return None
        self.actions[Action.REFRESH.value] += 1
        log.info("rule_refreshed", rule=rule.name, device=t.device, reason=d.reason, sticky=rule.sticky)
        if rule.sticky and not was_sticky:
            return Outcome(t, "GPUTaintSticky", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence)
        if d.reason != old_reason:
            return Outcome(t, "GPUTaintUpdated", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence, why=old_reason or "unknown")
        return None

    def update(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        if rule.virtual:
            rule.effect, rule.tier, rule.calm_since = d.effect, d.tier, None
            rule.reason, rule.evidence, rule.refreshed_at = d.reason, d.evidence[:EVIDENCE_MAX], now
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=rule.name, device=t.device, effect=d.effect)
            return None
        raising = EFFECT_RANK.get(d.effect, 0) > EFFECT_RANK.get(rule.effect, 0)
        old = rule.effect
        if not self._patch(t, rule, d, now):
            return None
        rule.effect, rule.calm_since = d.effect, None
        self.actions[Action.UPDATE.value] += 1
        log.warning("rule_updated", rule=rule.name, device=t.device, effect_from=old, effect_to=d.effect, tier=d.tier)
        return Outcome(t, "GPUTaintEscalated" if raising else "GPUTaintSteppedDown", rule.name, old, d.effect, d.tier, d.reason, d.evidence)

    def delete(self, t: Target, rule: OwnedRule, d: Decision) -> Outcome | None:
        with self.lock:
            self.owned.pop(t.key, None)
        if rule.virtual:
            self.actions["dry_run"] += 1
            return None
        self.rules.delete(rule.name, rule.uid or None)
        self.deleted.add(rule.name)
        self.actions[Action.DELETE.value] += 1
        log.warning("rule_deleted", rule=rule.name, device=t.device, why=d.why)
        event = "HardwareSwapDetected" if d.why == "hardware_swap" else "GPUUntainted"
        return Outcome(t, event, rule.name, rule.effect, "", rule.tier, rule.reason, rule.uuid, d.why)

    # -- Events ------------------------------------------------------------------------------
    def tell(self, outcomes: list[Outcome]) -> None:
        """One Event per fault domain and kind of change, regarding the domain's first rule."""
        by: dict[tuple[str, str], list[Outcome]] = {}
        for o in outcomes:
            by.setdefault((o.target.domain, o.event), []).append(o)
        for (gpu, event), group in by.items():
            group.sort(key=lambda o: o.target.device)
            first = group[0]
            devices = ", ".join(f"{o.target.driver}/{o.target.pool}/{o.target.device}" for o in group)
            what = devices if len(group) == 1 else f"GPU {gpu}: {len(group)} devices ({devices})"
            ident = f" ({first.target.uuid})" if len(group) == 1 else ""
            if event == "GPUTainted":
                note = f"{what}{ident} tainted {first.effect_to}: {first.tier} {first.reason}. {first.evidence}"
                self.events.record(self.ref(first.rule), event, note, "Taint", warning=True)
            elif event in ("GPUTaintEscalated", "GPUTaintSteppedDown"):
                note = f"{what}{ident}: {first.effect_from} -> {first.effect_to} ({first.tier} {first.reason})".strip()
                self.events.record(self.ref(first.rule), event, note, "Taint", warning=event == "GPUTaintEscalated")
            elif event == "GPUTaintSticky":
                note = f"{what}{ident} failed too often: rule {first.effect_to} stays until a person deletes it or removes its label {names.STICKY_LABEL}"
                self.events.record(self.ref(first.rule), event, note, "Taint", warning=True)
            elif event == "GPUTaintUpdated":
                note = f"{what}{ident} still {first.effect_to}: reason {first.why} -> {first.reason}. {first.evidence}"
                self.events.record(self.ref(first.rule), event, note, "Taint")
            elif event == "HardwareSwapDetected":
                note = f"{what}: the rule named GPU {first.evidence}, the device is now {first.target.uuid}; rule removed"
                self.events.record(self.ref(first.rule), event, note, "Untaint")
            else:
                if first.why == "device_gone":
                    note = f"{what}{ident} no longer published by this node for {self.hold:g}s: rule removed"
                else:
                    note = f"{what}{ident} healthy for {self.hold:g}s: rule removed"
                self.events.record(self.ref(first.rule), event, note, "Untaint")

    def adopted_event(self, rule: OwnedRule, how: str) -> None:
        self.events.record(
            self.ref(rule.name),
            "GPUTaintAdopted",
            f"{rule.driver}/{rule.pool}/{rule.device} ({rule.uuid or 'unknown GPU'}): rule with effect {rule.effect} adopted: {how}",
            "Adopt",
        )

    def node_event(self, reason: str, note: str, action: str, warning: bool) -> None:
        if self.mode != TaintMode.DRY_RUN:
            self.events.record(node_ref(self.node), reason, note, action, warning=warning)

    def has_noexecute(self, keys: list[tuple[str, str, str]]) -> bool:
        with self.lock:
            return any((r := self.owned.get(k)) is not None and r.effect == Effect.NO_EXECUTE.value for k in keys)
