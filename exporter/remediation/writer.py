"""The writer: executes decisions against the API server and tells them in Events.

It writes rules by deterministic name (a retry after a lost answer meets 409 and adopts instead
of duplicating) and keeps the record of owned rules (:class:`~.rules.OwnedRules`) in step with
what it wrote, through the record's methods. It tells a fault domain's writes in one Event per
domain and kind of change (:meth:`RuleWriter.tell`), not one per DRA device: one GPU failing is
one event to a person, however many MIG devices it spans.

What a rule records (annotations): the device and its fault domain, the scope, tier, reason and
evidence, when it was first seen, whether a GPU reset is required, and the node's boot. A create
and a raise or refresh (new evidence) write the current boot; a step-down leaves it and writes
``reset-required: false`` (the device has been healthy for a hold: its reset was seen), so a
restart under the same boot releases it as the previous process would have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from ..config import TaintMode
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError
from ..k8s.events import micro_time
from ..k8s.taintrules import RuleChange, RuleSpec
from . import names
from .plan import EFFECT_RANK, EVIDENCE_MAX, Action, Decision, OwnedRule, Target
from .ports import EventSink, Key, RuleApi
from .report import Histogram
from .rules import OwnedRules, owned_from_stored

log = structlog.get_logger(__name__)


class NameTaken(Exception):
    """A rule with our deterministic name exists and is not ours: never touch it."""


@dataclass(frozen=True)
class Outcome:
    """One write that happened, for the domain's Event."""

    target: Target
    event: str  # GPUTainted | GPUTaintEscalated | GPUTaintSteppedDown | GPUUntainted | HardwareSwapDetected | ...
    rule: str
    effect_from: str = ""
    effect_to: str = ""
    tier: str = ""
    reason: str = ""
    evidence: str = ""
    why: str = ""


class RuleWriter:
    def __init__(
        self, node: str, mode: TaintMode, api: RuleApi, events: EventSink, record: OwnedRules, clock: Callable[[], float], hold: float,
        boot_id: str, on_gone: Callable[[Key, OwnedRule], None],
    ) -> None:
        self.node, self.mode, self.api, self.events, self.record = node, mode, api, events, record
        self.clock, self.hold, self.boot_id = clock, hold, boot_id
        self.on_gone = on_gone  # a rule turned out deleted behind our back (an admin cleared it)
        self.actions: Counter[str] = Counter()
        self.latency = Histogram()

    def _labels(self, tier: str, sticky: bool) -> dict[str, str]:
        labels = {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: self.node, names.TIER_LABEL: tier}
        if sticky:
            # Only ever added by the agent; taking it off (or deleting the rule) is the person's
            # "cleared", so patches never remove it.
            labels[names.STICKY_LABEL] = "true"
        return labels

    def _record(self, d: Decision, fresh: bool) -> dict[str, str]:
        """The annotations a write sets about the fault. ``fresh``: new evidence (the boot is
        this one); otherwise a step-down, whose reset has been seen."""
        out = {
            names.REASON_ANNOTATION: d.reason,
            names.EVIDENCE_ANNOTATION: d.evidence[:EVIDENCE_MAX],
            names.TIER_ANNOTATION: d.tier,
            names.RESET_REQUIRED_ANNOTATION: "true" if fresh and d.tier == Tier.FATAL.value else "false",
        }
        if fresh and self.boot_id:
            out[names.BOOT_ID_ANNOTATION] = self.boot_id
        return out

    @staticmethod
    def first_seen(h: DeviceHealth, tier: str) -> float | None:
        times = [c.since for c in h.conditions if c.tier.value == tier]
        return min(times) if times else None

    def ref(self, name: str) -> dict[str, str]:
        return {"apiVersion": self.api.api_version, "kind": "DeviceTaintRule", "name": name}

    # -- writes ------------------------------------------------------------------------------
    def apply(self, t: Target, h: DeviceHealth, rule: OwnedRule | None, d: Decision, now: float, scope: str) -> Outcome | None:
        if d.action in (Action.NOTHING, Action.KEEP):
            if rule is not None and d.action == Action.KEEP and d.calm_since != rule.calm_since:
                self.record.change(rule, calm_since=d.calm_since)
            return None
        if d.action == Action.CREATE:
            return self.create(t, h, d, now, scope)
        if rule is None:
            raise ValueError(f"{d.action!r} without an existing rule")  # decide() changes only a rule it was given
        if d.action == Action.UPDATE:
            return self.update(t, rule, d, now)
        if d.action == Action.REFRESH:
            return self.refresh(t, rule, d, now)
        return self.delete(t, rule, d)

    def create(self, t: Target, h: DeviceHealth, d: Decision, now: float, scope: str) -> Outcome | None:
        name = names.rule_name(self.node, t.driver, t.pool, t.device)
        first = self.first_seen(h, d.tier)
        rule = OwnedRule(
            name=name, driver=t.driver, pool=t.pool, device=t.device, uuid=t.uuid, effect=d.effect, tier=d.tier, reason=d.reason,
            evidence=d.evidence[:EVIDENCE_MAX], sticky=d.sticky, created_at=now, refreshed_at=now, gpu=t.domain, scope=scope,
            first_seen=first, reset_required=d.tier == Tier.FATAL.value, boot_id=self.boot_id,
        )
        if self.mode == TaintMode.DRY_RUN:
            rule.virtual = True
            self.record.put(rule)
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=name, device=t.device, uuid=t.uuid, effect=d.effect, reason=d.reason)
            return None
        annotations = {names.UUID_ANNOTATION: t.uuid, names.GPU_ANNOTATION: t.domain, names.SCOPE_ANNOTATION: scope,
                       names.FIRST_SEEN_ANNOTATION: micro_time(first or self.clock()), **self._record(d, fresh=True)}
        spec = RuleSpec(name, t.driver, t.pool, t.device, names.taint_key(d.tier), names.label_value(d.reason), d.effect,
                        self._labels(d.tier, d.sticky), annotations)
        try:
            created = self.api.create_rule(spec)
            self.actions[Action.CREATE.value] += 1
        except ApiError as e:
            if e.status != 409:
                raise
            existing = self.api.get_rule(name)
            if existing is None or not existing.ours:
                raise NameTaken(name) from None
            adopted = owned_from_stored(existing)
            self.record.put(adopted)
            self.actions["adopt"] += 1
            log.info("rule_adopted_on_conflict", rule=name)
            # Typically our own earlier create whose answer was lost: it never got its Event.
            self.adopted_event(adopted, "it already existed when this agent tried to create it")
            return None
        rule.uid = created.uid
        self.record.put(rule)
        if first is not None:
            self.latency.observe(max(0.0, self.clock() - first))
        log.warning("rule_created", rule=name, device=t.device, uuid=t.uuid, gpu=t.domain, effect=d.effect, tier=d.tier, reason=d.reason, suppressed=d.suppressed or None)
        return Outcome(t, "GPUTainted", name, "", d.effect, d.tier, d.reason, d.evidence)

    def _patch(self, t: Target, rule: OwnedRule, d: Decision, now: float, fresh: bool, **also: object) -> bool:
        """Write ``d``'s effect, tier, reason, evidence and sticky mark onto the rule (one merge
        patch, same name and uid). False when the rule turned out to be gone."""
        annotations = self._record(d, fresh)
        # The sticky label only when newly marking: re-sending it would put back a label a person
        # removed since our last look (a merge patch without it leaves it be).
        change = RuleChange(self._labels(d.tier, d.sticky and not rule.sticky), annotations, names.taint_key(d.tier),
                            names.label_value(d.reason), d.effect)
        try:
            self.api.patch_rule(rule.name, change)
        except ApiError as e:
            if e.status == 404:
                log.warning("rule_deleted_by_someone_else", rule=rule.name, device=rule.device)
                self.record.mark_gone(t.key)
                self.on_gone(t.key, rule)
                return False
            raise
        self.record.change(
            rule, tier=d.tier, reason=d.reason, evidence=d.evidence[:EVIDENCE_MAX], refreshed_at=now, sticky=rule.sticky or d.sticky,
            reset_required=annotations[names.RESET_REQUIRED_ANNOTATION] == "true", boot_id=annotations.get(names.BOOT_ID_ANNOTATION, rule.boot_id), **also,
        )
        return True

    def refresh(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        """Same effect, newer record. Told in an Event when it says something new to a person
        (another reason, the device turned sticky); evidence-only refreshes are not."""
        if rule.virtual:
            self.record.change(rule, reason=d.reason, evidence=d.evidence[:EVIDENCE_MAX], sticky=rule.sticky or d.sticky, refreshed_at=now)
            return None
        old_reason, was_sticky = rule.reason, rule.sticky
        if not self._patch(t, rule, d, now, fresh=True):
            return None
        self.actions[Action.REFRESH.value] += 1
        log.info("rule_refreshed", rule=rule.name, device=t.device, reason=d.reason, sticky=rule.sticky)
        if rule.sticky and not was_sticky:
            return Outcome(t, "GPUTaintSticky", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence)
        if d.reason != old_reason:
            return Outcome(t, "GPUTaintUpdated", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence, why=old_reason or "unknown")
        return None

    def update(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        raising = EFFECT_RANK.get(d.effect, 0) > EFFECT_RANK.get(rule.effect, 0)
        if rule.virtual:
            self.record.change(rule, effect=d.effect, tier=d.tier, calm_since=None, reason=d.reason, evidence=d.evidence[:EVIDENCE_MAX], refreshed_at=now)
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=rule.name, device=t.device, effect=d.effect)
            return None
        old = rule.effect
        if not self._patch(t, rule, d, now, fresh=raising, effect=d.effect, calm_since=None):
            return None
        self.actions[Action.UPDATE.value] += 1
        log.warning("rule_updated", rule=rule.name, device=t.device, effect_from=old, effect_to=d.effect, tier=d.tier)
        return Outcome(t, "GPUTaintEscalated" if raising else "GPUTaintSteppedDown", rule.name, old, d.effect, d.tier, d.reason, d.evidence)

    def delete(self, t: Target, rule: OwnedRule, d: Decision) -> Outcome | None:
        if rule.virtual:
            self.record.forget(t.key)
            self.actions["dry_run"] += 1
            return None
        self.api.delete(rule.name, rule.uid or None)  # (raises: the rule stays on the record, retried next pass)
        self.record.forget(t.key)
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
            note, action, warning = _NOTES[event](what, ident, first, self.hold)
            self.events.record(self.ref(first.rule), event, note, action, warning=warning)

    def adopted_event(self, rule: OwnedRule, how: str) -> None:
        note = f"{rule.driver}/{rule.pool}/{rule.device} ({rule.uuid or 'unknown GPU'}): rule with effect {rule.effect} adopted: {how}"
        self.events.record(self.ref(rule.name), "GPUTaintAdopted", note, "Adopt")

    def node_event(self, reason: str, note: str, action: str, warning: bool) -> None:
        if self.mode != TaintMode.DRY_RUN:
            self.events.record({"apiVersion": "v1", "kind": "Node", "name": self.node}, reason, note, action, warning=warning)


def _untainted(what: str, ident: str, o: Outcome, hold: float) -> tuple[str, str, bool]:
    if o.why == "device_gone":
        return f"{what}{ident} no longer published by this node for {hold:g}s: rule removed", "Untaint", False
    return f"{what}{ident} healthy for {hold:g}s: rule removed", "Untaint", False


# event -> (what, ident, first outcome, hold) -> (note, action, warning)
_NOTES: Mapping[str, Callable[[str, str, Outcome, float], tuple[str, str, bool]]] = {
    "GPUTainted": lambda w, i, o, h: (f"{w}{i} tainted {o.effect_to}: {o.tier} {o.reason}. {o.evidence}", "Taint", True),
    "GPUTaintEscalated": lambda w, i, o, h: (f"{w}{i}: {o.effect_from} -> {o.effect_to} ({o.tier} {o.reason})".strip(), "Taint", True),
    "GPUTaintSteppedDown": lambda w, i, o, h: (f"{w}{i}: {o.effect_from} -> {o.effect_to} ({o.tier} {o.reason})".strip(), "Taint", False),
    "GPUTaintSticky": lambda w, i, o, h: (
        f"{w}{i} failed too often: rule {o.effect_to} stays until a person deletes it or removes its label {names.STICKY_LABEL}", "Taint", True),
    "GPUTaintUpdated": lambda w, i, o, h: (f"{w}{i} still {o.effect_to}: reason {o.why} -> {o.reason}. {o.evidence}", "Taint", False),
    "HardwareSwapDetected": lambda w, i, o, h: (f"{w}: the rule named GPU {o.evidence}, the device is now {o.target.uuid}; rule removed", "Untaint", False),
    "GPUUntainted": _untainted,
}
