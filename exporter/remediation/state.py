"""What the remediator must not forget across restarts, and what it can prove happened meanwhile.

* A rule records what it stands for in its annotations (tier, reason, evidence, first seen,
  whether a GPU reset is required, the fault domain, the scope, the node boot); on adoption
  :func:`restore_health` hands the conditions back to the health engine, so a restarted agent keeps
  a fatal rule until a reset is observed instead of calling the GPU healthy at once.
* A reset that happened while the agent was away counts as observed when it can be proven
  (:func:`reset_proven`): the rule was written under another boot of the node (or, without that
  annotation, its fault was first seen before this boot), or the rule was already stepping down
  because its reset had been observed. The health engine is told of that reset on adoption (a
  reset event now: the clear time counts from the adoption, at most the agent's start-up later
  than the boot), so the condition clears after its clear time and the rule steps down after its
  holds. A condition that would ask for more than the rule has is not restored at all.
* An admin's deletion of a rule (:class:`AdminMemory`) is remembered in the per-node state
  ConfigMap: a restarted agent does not undo it without new evidence.

Time: a date read back (a rule's first-seen, a deletion's) becomes a monotonic instant once, as
it is read (``from_wall``), never later than it can be (now; a deletion: this process's start),
whatever a step of the wall clock while the agent was down did (docs/health-and-remediation.md, "Time").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from ..clock import Clock, from_wall
from ..devices.model import DeviceEvent, EventKind
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError
from ..k8s.nodestate import Deletion
from .boot import BootIdentity
from .plan import EFFECT_RANK, TIER_EFFECT, OwnedRule
from .ports import DeletionStore, HealthSource, Key
from .rules import unit_of

log = structlog.get_logger(__name__)


def reset_proven(rule: OwnedRule, boot: BootIdentity) -> bool:
    """Whether the GPU behind an adopted rule has been reset since the rule's fault was seen."""
    if boot.reset_since(rule.boot_id, rule.first_seen):
        return True  # the node rebooted since: a reboot resets every GPU
    # A fatal rule written "reset-required: false" was stepping down: its reset was observed.
    return rule.tier == Tier.FATAL.value and rule.reset_required is False


def restore_health(health: HealthSource, rules: Sequence[OwnedRule], clock: Clock, boot: BootIdentity) -> int:
    """Re-create, in the health engine, the conditions adopted rules stand for (one per device
    and reason), then book the resets proven to have happened meanwhile, so those conditions
    clear after the clear time. A proven reset whose condition would ask for more than the rule
    has (a fatal fault only fenced, or a rule already stepping down) is not restored at all: the
    reset is over, and a reset GPU is not newly evicted. Returns how many were restored.

    The first-seen date becomes a monotonic instant here, once; never later than now (a date
    ahead of the clock is a step backwards while the agent was down: the fault counts as new)."""
    now = clock.monotonic()
    done: set[tuple[str, str]] = set()
    reset: dict[str, str] = {}
    for r in rules:
        if not r.reason or r.tier not in {t.value for t in Tier} or r.sticky:
            continue  # (a sticky rule comes back through mark_sticky: its label is the record)
        uuid = unit_of(r)
        if not uuid or (uuid, r.reason) in done:
            continue
        proven = reset_proven(r, boot)
        if proven and EFFECT_RANK[TIER_EFFECT[Tier(r.tier)]] > EFFECT_RANK.get(r.effect, 0):
            log.info("rule_released_on_adoption", rule=r.name, uuid=uuid, reason=r.reason, tier=r.tier, effect=r.effect)
            continue
        done.add((uuid, r.reason))
        since = now if r.first_seen is None else min(now, from_wall(clock, r.first_seen))
        health.restore(uuid, r.reason, Tier(r.tier), since, r.evidence, bool(r.reset_required))
        log.info("health_restored_from_rule", rule=r.name, uuid=uuid, reason=r.reason, tier=r.tier, reset_required=r.reset_required, reset_proven=proven)
        if proven:
            reset[uuid] = r.name
    for uuid, name in reset.items():
        log.warning("gpu_reset_proven", uuid=uuid, rule=name, boot_id=boot.boot_id or None)
        health.on_event(DeviceEvent(uuid=uuid, kind=EventKind.RESET, detail=f"proven on adoption of {name}"))
    return len(done)


@dataclass(frozen=True)
class AdminDeletion:
    at: float  # when the agent noticed the deletion: a monotonic instant
    wall: float  # the same as a date, as stored in the ConfigMap
    reason: str = ""  # the condition the deleted rule stood for
    carried: bool = False  # read back from the ConfigMap: noticed by an earlier process


def _event_reason(reason: str) -> bool:
    """Conditions opened by an event (new evidence each time) rather than a polled state."""
    return reason.startswith("xid_") or reason in ("ecc_double_bit", "gpu_lost_event", "ras_error")


class AdminMemory:
    """Rules an admin deleted, by device key: not recreated without new evidence. Loaded once
    from the store, written only when the set changes."""

    def __init__(self, store: DeletionStore | None, clock: Clock) -> None:
        self._store, self.clock = store, clock
        self._started = clock.monotonic()  # a deletion read back happened before this process
        self._deleted: dict[Key, AdminDeletion] = {}
        self._loaded = store is None

    def __contains__(self, key: Key) -> bool:
        return key in self._deleted

    def load_once(self) -> None:
        """Raises ApiError when the store cannot be read (the pass is retried)."""
        if not self._loaded and self._store is not None:
            # Noticed by an earlier process, so before this one started, whatever a step of the
            # wall clock while the agent was down makes its date say.
            for k, v in self._store.load().items():
                at = min(self._started, from_wall(self.clock, v.at))
                self._deleted[k] = AdminDeletion(at, v.at, v.reason, carried=True)
            self._loaded = True

    def noticed(self, key: Key, reason: str) -> None:
        self._deleted[key] = AdminDeletion(self.clock.monotonic(), self.clock.wall(), reason)
        self._save()

    def forget(self, key: Key) -> None:
        if self._deleted.pop(key, None) is not None:
            self._save()

    def since(self, key: Key, h: DeviceHealth) -> float | None:
        """When an admin's deletion of this device's rule was noticed, for ``plan.decide`` (which
        recreates the rule only on evidence newer than that). A deletion read back from the
        store covers a *state* that is still there after a restart (a lost GPU, a failed row
        remap): the new process sees it "again" but it is the same evidence, so it counts as
        old for as long as it lasts. Once the device is clean the deletion is forgotten."""
        entry = self._deleted.get(key)
        if entry is None:
            return None
        if not h.conditions:
            self.forget(key)
            return None
        fresh = [c for c in h.conditions if c.last_seen > entry.at and (not entry.carried or _event_reason(c.reason) or c.reason != entry.reason)]
        return None if fresh else math.inf

    def _save(self) -> None:
        if self._store is None:
            return
        try:
            self._store.save({k: Deletion(v.wall, v.reason) for k, v in self._deleted.items()})
        except ApiError as e:
            # Kept in memory and written on the next change; only a restart meanwhile forgets.
            log.warning("node_state_not_saved", configmap=self._store.name, error=str(e))
