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
restart under the same boot releases it as the previous process would have. Times here are
monotonic (the health engine's); the first-seen annotation and Events carry wall dates.

It also tells people what the remediator held back: one Warning Event and one count per episode,
and the writes the API server refused.

* :class:`Notices`: a (device, suppression) episode is told once, in a ``HealthRemediationSuppressed``
  Event on the Node, and counted once in ``dra_gpu_exporter_taint_suppressed_total``. The only
  place the counter is counted, and only with a :class:`~exporter.reasons.Suppression`, so the
  metric's documented reasons (from the same enum) are all the reasons it can carry.
* :class:`Refusals`: a write the server refused (401, 403, 422...) or whose name is taken is held
  for the policy's ``refused_retry`` unless the decision changes; each held write is one line of
  ``/readyz`` and fails the remediation collector.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import structlog

from ..clock import Clock, to_wall
from ..health.model import DeviceHealth, Scope, Tier
from ..k8s import names
from ..k8s.connection import ApiError
from ..k8s.model import DeviceKey
from ..k8s.taintrules import TaintRule
from ..reasons import Suppression, TaintMode
from .contract import Action, EventSink, Histogram, RuleApi, Target
from .plan import EFFECT_RANK, Decision
from .record import EVIDENCE_MAX, OwnedRule, OwnedRules, owned_from_stored

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
    why: str = ""  # a deletion's: recovered | hardware_swap | device_gone
    old_reason: str = ""  # GPUTaintUpdated: the reason the rule named before
    old_uuid: str = ""  # HardwareSwapDetected: the GPU the rule was written for


class RuleWriter:
    def __init__(
        self, node: str, mode: TaintMode, api: RuleApi, events: EventSink, record: OwnedRules, clock: Clock,
        hold: float, boot_id: str, on_gone: Callable[[DeviceKey, OwnedRule], None],
    ) -> None:
        self.node, self.mode, self.api, self.events, self.record = node, mode, api, events, record
        self.clock, self.hold, self.boot_id = clock, hold, boot_id
        self.on_gone = on_gone  # a rule turned out deleted behind our back (an admin cleared it)
        self.actions: Counter[str] = Counter()
        self.latency = Histogram()

    def _rule(self, name: str, t: Target, d: Decision, fresh: bool) -> TaintRule:
        """The rule a write leaves: ``d``'s effect, tier, reason and evidence. ``fresh``: new
        evidence (a fatal fault requires a reset; the boot is this one); otherwise a step-down,
        whose reset has been seen."""
        return TaintRule(
            name=name, uid="", driver=t.driver, pool=t.pool, device=t.device, effect=d.effect, ours=True, tier=d.tier,
            reason=d.reason, evidence=d.evidence[:EVIDENCE_MAX], reset_required=fresh and d.tier == Tier.FATAL.value,
            boot_id=self.boot_id if fresh else "", node=self.node)

    @staticmethod
    def first_seen(h: DeviceHealth, tier: str) -> float | None:
        times = [c.since for c in h.conditions if c.tier.value == tier]
        return min(times) if times else None

    def ref(self, name: str) -> dict[str, str]:
        return {"apiVersion": self.api.api_version, "kind": "DeviceTaintRule", "name": name}

    # -- writes ------------------------------------------------------------------------------
    def apply(self, t: Target, h: DeviceHealth, rule: OwnedRule | None, d: Decision, now: float,
              scope: Scope) -> Outcome | None:
        if d.action in (Action.NOTHING, Action.KEEP):
            if rule is not None and d.action == Action.KEEP and d.calm_since != rule.calm_since:
                self.record.calm(rule, d.calm_since)
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

    def create(self, t: Target, h: DeviceHealth, d: Decision, now: float, scope: Scope) -> Outcome | None:
        name = names.rule_name(self.node, t.driver, t.pool, t.device)
        first = self.first_seen(h, d.tier)
        rule = OwnedRule(
            name=name, driver=t.driver, pool=t.pool, device=t.device, uuid=t.uuid, effect=d.effect, tier=d.tier,
            reason=d.reason, evidence=d.evidence[:EVIDENCE_MAX], sticky=d.sticky, created_at=now, refreshed_at=now,
            gpu=t.gpu, scope=scope,
            first_seen=first, reset_required=d.tier == Tier.FATAL.value, boot_id=self.boot_id,
        )
        if self.mode == TaintMode.DRY_RUN:
            rule.virtual = True
            self.record.put(rule)
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=name, device=t.device, uuid=t.uuid, effect=d.effect, reason=d.reason)
            return None
        seen = to_wall(self.clock, now if first is None else first)  # (the date a person reads)
        wanted = replace(self._rule(name, t, d, fresh=True), uuid=t.uuid, gpu=t.gpu, scope=scope.value, sticky=d.sticky,
                         first_seen=seen)
        try:
            created = self.api.create_rule(wanted)
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
            self.latency.observe(max(0.0, self.clock.monotonic() - first))
        log.warning("rule_created", rule=name, device=t.device, uuid=t.uuid, gpu=t.gpu, effect=d.effect, tier=d.tier,
                    reason=d.reason, suppressed=d.suppressed or None)
        return Outcome(t, "GPUTainted", name, "", d.effect, d.tier, d.reason, d.evidence)

    def _patch(self, t: Target, rule: OwnedRule, d: Decision, now: float, fresh: bool, update: bool) -> bool:
        """Write ``d``'s effect, tier, reason, evidence and sticky mark onto the rule (one merge
        patch, same name and uid). False when the rule turned out to be gone."""
        written = self._rule(rule.name, t, d, fresh)
        if not written.boot_id:
            written = replace(written, boot_id=rule.boot_id)  # (a step-down keeps the boot it was recorded under)
        try:
            self.api.patch_rule(written, mark_sticky=d.sticky and not rule.sticky)
        except ApiError as e:
            if e.status == 404:
                log.warning("rule_deleted_by_someone_else", rule=rule.name, device=rule.device)
                self.record.mark_gone(t.key)
                self.on_gone(t.key, rule)
                return False
            raise
        self.record.wrote(rule, tier=d.tier, reason=d.reason, evidence=d.evidence, sticky=d.sticky, at=now,
                          effect=d.effect if update else None,
                          reset_required=written.reset_required, boot_id=written.boot_id)
        return True

    def refresh(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        """Same effect, newer record. Told in an Event when it says something new to a person
        (another reason, the device turned sticky); evidence-only refreshes are not."""
        if rule.virtual:
            self.record.wrote(rule, tier=rule.tier, reason=d.reason, evidence=d.evidence, sticky=d.sticky, at=now)
            return None
        old_reason, was_sticky = rule.reason, rule.sticky
        if not self._patch(t, rule, d, now, fresh=True, update=False):
            return None
        self.actions[Action.REFRESH.value] += 1
        log.info("rule_refreshed", rule=rule.name, device=t.device, reason=d.reason, sticky=rule.sticky)
        if rule.sticky and not was_sticky:
            return Outcome(t, "GPUTaintSticky", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence)
        if d.reason != old_reason:
            return Outcome(t, "GPUTaintUpdated", rule.name, rule.effect, rule.effect, rule.tier, d.reason, d.evidence,
                           old_reason=old_reason or "unknown")
        return None

    def update(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> Outcome | None:
        raising = EFFECT_RANK.get(d.effect, 0) > EFFECT_RANK.get(rule.effect, 0)
        if rule.virtual:
            self.record.wrote(rule, tier=d.tier, reason=d.reason, evidence=d.evidence, sticky=False, at=now,
                              effect=d.effect)
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=rule.name, device=t.device, effect=d.effect)
            return None
        old = rule.effect
        if not self._patch(t, rule, d, now, fresh=raising, update=True):
            return None
        self.actions[Action.UPDATE.value] += 1
        log.warning("rule_updated", rule=rule.name, device=t.device, effect_from=old, effect_to=d.effect, tier=d.tier)
        return Outcome(t, "GPUTaintEscalated" if raising else "GPUTaintSteppedDown", rule.name, old, d.effect, d.tier,
                       d.reason, d.evidence)

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
        return Outcome(t, event, rule.name, rule.effect, "", rule.tier, rule.reason, rule.evidence, d.why,
                       old_uuid=rule.uuid)

    # -- Events ------------------------------------------------------------------------------
    def tell(self, outcomes: list[Outcome]) -> None:
        """One Event per fault domain and kind of change, regarding the domain's first rule."""
        by: dict[tuple[str, str], list[Outcome]] = {}
        for o in outcomes:
            by.setdefault((o.target.gpu, o.event), []).append(o)
        for (gpu, event), group in by.items():
            group.sort(key=lambda o: o.target.device)
            first = group[0]
            devices = ", ".join(f"{o.target.driver}/{o.target.pool}/{o.target.device}" for o in group)
            what = devices if len(group) == 1 else f"GPU {gpu}: {len(group)} devices ({devices})"
            ident = f" ({first.target.uuid})" if len(group) == 1 else ""
            note, action, warning = _NOTES[event](what, ident, first, self.hold)
            self.events.record(self.ref(first.rule), event, note, action, warning=warning)

    def adopted(self, rules: list[OwnedRule]) -> list[OwnedRule]:
        """Rules a resync adopted (an agent restarted): counted and told, here only."""
        for r in rules:
            self.actions["adopt"] += 1
            self.adopted_event(r, "found carrying this agent's labels (agent restarted)")
        return rules

    def adopted_event(self, rule: OwnedRule, how: str) -> None:
        note = (f"{rule.driver}/{rule.pool}/{rule.device} ({rule.uuid or 'unknown GPU'}): rule with effect "
                f"{rule.effect} adopted: {how}")
        self.events.record(self.ref(rule.name), "GPUTaintAdopted", note, "Adopt")

    def tell_suppressed(self, note: str) -> None:
        """What was held back (:class:`Notices`), told on the Node."""
        self.node_event("HealthRemediationSuppressed", note, "Taint", warning=True)

    def node_event(self, reason: str, note: str, action: str, warning: bool) -> None:
        if self.mode != TaintMode.DRY_RUN:
            self.events.record({"apiVersion": "v1", "kind": "Node", "name": self.node}, reason, note, action,
                               warning=warning)


def _untainted(what: str, ident: str, o: Outcome, hold: float) -> tuple[str, str, bool]:
    if o.why == "device_gone":
        return f"{what}{ident} no longer published by this node for {hold:g}s: rule removed", "Untaint", False
    return f"{what}{ident} healthy for {hold:g}s: rule removed", "Untaint", False


# event -> (what, ident, first outcome, hold) -> (note, action, warning)
_NOTES: Mapping[str, Callable[[str, str, Outcome, float], tuple[str, str, bool]]] = {
    "GPUTainted": lambda w, i, o, h: (f"{w}{i} tainted {o.effect_to}: {o.tier} {o.reason}. {o.evidence}", "Taint",
                                      True),
    "GPUTaintEscalated": lambda w, i, o, h: (f"{w}{i}: {o.effect_from} -> {o.effect_to} ({o.tier} {o.reason})".strip(),
                                             "Taint", True),
    "GPUTaintSteppedDown": lambda w, i, o, h: (
        f"{w}{i}: {o.effect_from} -> {o.effect_to} ({o.tier} {o.reason})".strip(), "Taint", False),
    "GPUTaintSticky": lambda w, i, o, h: (
        f"{w}{i} failed too often: rule {o.effect_to} stays until a person deletes it or removes its label "
        f"{names.STICKY_LABEL}", "Taint", True),
    "GPUTaintUpdated": lambda w, i, o, h: (
        f"{w}{i} still {o.effect_to}: reason {o.old_reason} -> {o.reason}. {o.evidence}", "Taint", False),
    "HardwareSwapDetected": lambda w, i, o, h: (
        f"{w}: the rule named GPU {o.old_uuid}, the device is now {o.target.uuid}; rule removed", "Untaint", False),
    "GPUUntainted": _untainted,
}


# --------------------------------------------------------------------------- what was held back
NO_API_KEY = ("api", "", "")  # the cluster-wide "no DeviceTaintRule API"
NODE_KEY = ("node", "", "")  # node-wide episodes
BUDGET_KEY = ("budget", "", "")  # "the budget object cannot be read"
Signature = tuple[str, str, str]  # (action, effect, tier) of a decision


class Notices:
    def __init__(self, tell: Callable[[str], None]) -> None:
        self._tell = tell  # a Warning Event on the Node
        self._told: set[tuple[DeviceKey, str]] = set()
        self.suppressed: Counter[str] = Counter()

    def announce(self, key: DeviceKey, what: Suppression, note: str) -> None:
        what = Suppression(what)  # a stray string fails here, in tests, not in a dashboard
        tag = (key, what.value)
        if tag in self._told:
            return
        self._told.add(tag)
        self.suppressed[what.value] += 1
        log.warning("remediation_suppressed", what=what.value, device=key[2] or None, note=note)
        self._tell(note)

    def over(self, key: DeviceKey, what: Suppression | None = None) -> None:
        """The episode is over (one suppression, or every one of the key): a new one is news."""
        if not self._told:
            return
        if what is not None:
            self._told.discard((key, what.value))
        else:
            self._told = {tag for tag in self._told if tag[0] != key}


class Refusals:
    def __init__(self) -> None:
        self._held: dict[DeviceKey, tuple[Signature, float, str]] = {}

    def __contains__(self, key: DeviceKey) -> bool:
        return key in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, key: DeviceKey, sig: Signature, until: float, line: str) -> None:
        self._held[key] = (sig, until, line)

    def holds(self, key: DeviceKey, sig: Signature, now: float) -> bool:
        """Whether this decision was refused before and is not to be asked again yet; a held
        write whose decision changed, or whose hold is over, is let go."""
        held = self._held.get(key)
        if held is None:
            return False
        if held[0] == sig and now < held[1]:
            return True
        del self._held[key]
        return False

    def clear(self) -> None:
        """Ask every held write again at the next pass."""
        self._held.clear()

    def lines(self) -> tuple[str, ...]:
        return tuple(v[2] for _, v in sorted(self._held.items()))
