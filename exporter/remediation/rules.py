"""The record of the rules this agent owns: one owner, one lock.

The writer puts, changes and drops rules through it as it writes them; a resync adopts what the
cluster holds into it (:meth:`OwnedRules.sync`); the report reads frozen views of it. Nothing
else holds the dict.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..k8s.names import label_value, taint_key
from ..k8s.taintrules import StoredRule
from .plan import Effect, OwnedRule
from .report import TaintRuleView

Key = tuple[str, str, str]
WATCH_LAG = 10.0  # seconds a rule we created may be missing from a watch's cache without being gone


def owned_from_stored(s: StoredRule) -> OwnedRule:
    return OwnedRule(
        name=s.name, driver=s.driver, pool=s.pool, device=s.device, uuid=s.uuid, effect=s.effect, tier=s.tier, reason=s.reason,
        evidence=s.evidence, sticky=s.sticky, uid=s.uid, managed=s.managed, gpu=s.gpu, scope=s.scope, first_seen=s.first_seen,
        reset_required=s.reset_required, boot_id=s.boot_id,
    )


def unit_of(rule: OwnedRule) -> str:
    """The unit a rule's NoExecute counts against: its fault domain, or its MIG instance."""
    return rule.uuid if rule.scope == "instance" or not rule.gpu else rule.gpu


@dataclass
class Sync:
    """What a resync found: rules adopted, rules someone else deleted, sticky labels removed."""

    adopted: list[OwnedRule] = field(default_factory=list)
    gone: list[OwnedRule] = field(default_factory=list)
    unstuck: list[OwnedRule] = field(default_factory=list)


class OwnedRules:
    def __init__(self) -> None:
        self._rules: dict[Key, OwnedRule] = {}
        self._lock = threading.RLock()
        # Rules this agent deleted: a watch may still show them for a moment, and they must not
        # be adopted back (forgotten once the view no longer shows them).
        self._deleted: set[str] = set()
        self._synced = False  # a first resync happened: from then on a missing rule is news

    def get(self, key: Key) -> OwnedRule | None:
        with self._lock:
            return self._rules.get(key)

    def put(self, rule: OwnedRule) -> None:
        with self._lock:
            self._rules[rule.key] = rule

    def change(self, rule: OwnedRule, **fields: object) -> None:
        """Set fields of a rule of the record (under the lock: views never see half a change)."""
        with self._lock:
            for name, value in fields.items():
                setattr(rule, name, value)

    def forget(self, key: Key) -> OwnedRule | None:
        """This agent deleted the rule (or a dry-run one went away)."""
        with self._lock:
            rule = self._rules.pop(key, None)
            if rule is not None and not rule.virtual:
                self._deleted.add(rule.name)
            return rule

    def mark_gone(self, key: Key) -> OwnedRule | None:
        """Someone else deleted the rule."""
        with self._lock:
            return self._rules.pop(key, None)

    def sync(self, found: Iterable[StoredRule], lags: bool, now: float) -> Sync:
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

    def holds_noexecute(self, keys: Sequence[Key]) -> bool:
        with self._lock:
            return any((r := self._rules.get(k)) is not None and r.effect == Effect.NO_EXECUTE.value for k in keys)

    def noexecute_units(self) -> set[str]:
        with self._lock:
            return {unit_of(r) for r in self._rules.values() if r.effect == Effect.NO_EXECUTE.value}

    def views(self) -> tuple[TaintRuleView, ...]:
        with self._lock:
            return tuple(
                TaintRuleView(r.driver, r.pool, r.device, r.effect, r.tier, r.uuid, taint_key(r.tier), label_value(r.reason))
                for r in sorted(self._rules.values(), key=lambda r: r.key)
                if not r.virtual
            )
