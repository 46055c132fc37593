"""The record of the DeviceTaintRules this agent owns: :class:`OwnedRule` (what one rule says, plus this
process's timers for it) and :class:`OwnedRules`, its one owner and lock.

The writer puts, changes and drops rules through it as it writes them; a resync adopts what the
cluster holds into it (:meth:`OwnedRules.sync`); the report reads frozen views of it. Nothing
else holds the dict.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..health.model import Scope
from ..k8s.model import DeviceKey
from ..k8s.names import label_value, taint_key
from ..k8s.taintrules import TaintRule
from .contract import Effect, TaintRuleView

EVIDENCE_MAX = 1024  # characters of evidence kept in the rule's annotation
WATCH_LAG = 10.0  # seconds a rule we created may be missing from a watch's cache without being gone


@dataclass
class OwnedRule:
    name: str
    driver: str
    pool: str
    device: str
    uuid: str
    effect: str
    tier: str
    reason: str = ""
    evidence: str = ""  # as written in the rule's annotation (at most EVIDENCE_MAX characters)
    sticky: bool = False  # carries the sticky label: only a person clears it
    uid: str = ""
    managed: bool = True
    calm_since: float | None = None  # since when the device has wanted less than this rule
    gone_since: float | None = None  # since when this node no longer publishes the device
    created_at: float | None = None
    virtual: bool = False  # dry-run: what would exist; never written, never exported as a rule
    refreshed_at: float | None = None  # when this agent last wrote reason and evidence
    gpu: str = ""  # the fault domain (physical GPU) the rule was written for
    scope: Scope = Scope.GPU  # GPU: a GPU-wide fault; INSTANCE: one MIG instance's own fault
    first_seen: float | None = None  # first evidence, as annotated
    reset_required: bool | None = None  # a fatal fault: only an observed GPU reset clears it; None: not annotated
    boot_id: str = ""  # the node boot the rule's fault was recorded under (annotation); "" when not annotated

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.device)


def owned_from_stored(s: TaintRule) -> OwnedRule:
    return OwnedRule(
        name=s.name, driver=s.driver, pool=s.pool, device=s.device, uuid=s.uuid, effect=s.effect, tier=s.tier,
        reason=s.reason, evidence=s.evidence, sticky=s.sticky, uid=s.uid, managed=s.managed, gpu=s.gpu,
        scope=Scope.INSTANCE if s.scope == Scope.INSTANCE.value else Scope.GPU, first_seen=s.first_seen,
        reset_required=s.reset_required, boot_id=s.boot_id,
    )


def domain_of(rule: OwnedRule) -> str:
    """The fault domain a rule's NoExecute counts against: its physical GPU, or its MIG instance
    (a fatal fault of the instance's own)."""
    return rule.uuid if rule.scope is Scope.INSTANCE or not rule.gpu else rule.gpu


@dataclass
class Sync:
    """What a resync found: rules adopted, rules someone else deleted, sticky labels removed."""

    adopted: list[OwnedRule] = field(default_factory=list)
    gone: list[OwnedRule] = field(default_factory=list)
    unstuck: list[OwnedRule] = field(default_factory=list)


class OwnedRules:
    """The rules this agent owns, by device key: one owner, one lock."""

    def __init__(self) -> None:
        self._rules: dict[DeviceKey, OwnedRule] = {}
        self._lock = threading.RLock()
        # Rules this agent deleted: a watch may still show them for a moment, and they must not
        # be adopted back (forgotten once the view no longer shows them).
        self._deleted: set[str] = set()
        self._synced = False  # a first resync happened: from then on a missing rule is news

    def get(self, key: DeviceKey) -> OwnedRule | None:
        with self._lock:
            return self._rules.get(key)

    def put(self, rule: OwnedRule) -> None:
        with self._lock:
            self._rules[rule.key] = rule

    def calm(self, rule: OwnedRule, since: float | None) -> None:
        """Since when the device has wanted less than the rule (None: it wants what the rule has)."""
        with self._lock:
            rule.calm_since = since

    def unpublished(self, rule: OwnedRule, since: float | None) -> None:
        """Since when this node no longer publishes the rule's device (None: it does)."""
        with self._lock:
            rule.gone_since = since

    def wrote(self, rule: OwnedRule, *, tier: str, reason: str, evidence: str, sticky: bool, at: float,
              effect: str | None = None, reset_required: bool | None = None, boot_id: str | None = None) -> None:
        """What a write put on the rule (a dry-run rule: what it would have put), under the lock:
        views never see half a change. An update (``effect``) starts a new calm period."""
        with self._lock:
            if effect is not None:
                rule.effect, rule.calm_since = effect, None
            rule.tier, rule.reason, rule.evidence = tier, reason, evidence[:EVIDENCE_MAX]
            rule.sticky, rule.refreshed_at = rule.sticky or sticky, at
            if reset_required is not None:
                rule.reset_required = reset_required
            if boot_id is not None:
                rule.boot_id = boot_id

    def forget(self, key: DeviceKey) -> OwnedRule | None:
        """This agent deleted the rule (or a dry-run one went away)."""
        with self._lock:
            rule = self._rules.pop(key, None)
            if rule is not None and not rule.virtual:
                self._deleted.add(rule.name)
            return rule

    def mark_gone(self, key: DeviceKey) -> OwnedRule | None:
        """Someone else deleted the rule."""
        with self._lock:
            return self._rules.pop(key, None)

    def sync(self, found: Iterable[TaintRule], lags: bool, now: float) -> Sync:
        """Bring the record in line with the cluster's rules for this node. ``lags``: the view
        comes from a watch, which may not show a rule created moments ago yet."""
        out = Sync()
        # Only rules carrying this agent's managed-by label: the feeds select by it already, and a
        # rule anyone else wrote (an operator's, a driver's) is never adopted, whatever it selects.
        seen = {r.key: r for r in found if r.pool and r.device and r.ours}
        with self._lock:
            self._deleted &= {r.name for r in seen.values()}  # gone from the view: no longer in doubt
            for key, r in seen.items():
                mine = self._rules.get(key)
                if mine is None:
                    if r.name not in self._deleted:  # (else: deleted by us a moment ago)
                        self._rules[key] = owned_from_stored(r)
                        out.adopted.append(self._rules[key])
                    continue
                if mine.sticky and not r.sticky:
                    out.unstuck.append(mine)  # a person took the sticky label off
                mine.managed, mine.uid, mine.effect, mine.sticky = r.managed, r.uid, r.effect, r.sticky
            for key, mine in list(self._rules.items()):
                fresh = lags and mine.created_at is not None and now - mine.created_at <= WATCH_LAG
                if key not in seen and not mine.virtual and self._synced and not fresh:
                    out.gone.append(self._rules.pop(key))
            self._synced = True
        return out

    def values(self) -> list[OwnedRule]:
        with self._lock:
            return list(self._rules.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._rules)

    def holds_noexecute(self, keys: Sequence[DeviceKey]) -> bool:
        with self._lock:
            return any((r := self._rules.get(k)) is not None and r.effect == Effect.NO_EXECUTE.value for k in keys)

    def noexecute_domains(self) -> set[str]:
        with self._lock:
            return {domain_of(r) for r in self._rules.values() if r.effect == Effect.NO_EXECUTE.value}

    def views(self) -> tuple[TaintRuleView, ...]:
        with self._lock:
            return tuple(
                TaintRuleView(r.driver, r.pool, r.device, r.effect, r.tier, r.uuid, taint_key(r.tier),
                              label_value(r.reason))
                for r in sorted(self._rules.values(), key=lambda r: r.key)
                if not r.virtual
            )
