"""What outlives the agent process, and what a restarted agent can prove happened meanwhile.

* The node's boot (:class:`BootIdentity`): a reboot resets every GPU, so a rule whose fault was
  recorded under another boot has had the reset its fatal condition waits for (issue 26). Linux
  gives each boot a random UUID (``/proc/sys/kernel/random/boot_id``, the host's value inside a
  container: the file is not namespaced) and the boot time (``btime`` in ``/proc/stat``). A driver
  reload is not a boot and cannot be proven the same way (docs/health-and-remediation.md).
* A resync (:class:`RuleSync`) brings the record of owned rules in line with the cluster: rules
  found carrying this agent's labels are adopted and what they stand for (tier, reason, evidence,
  first seen, whether a reset is required, the boot) goes back into the health engine
  (:func:`restore_health`), so a restarted agent keeps a fatal rule until a reset is observed
  instead of calling the GPU healthy at once. A reset that happened while the agent was away counts
  as observed when it can be proven (:func:`reset_proven`): the rule was written under another boot
  (or, without that annotation, its fault was first seen before this boot), or it was already
  stepping down because its reset had been observed; the health engine is told of that reset on
  adoption (``HealthSource.reset_proven``). A condition that would ask for more than the rule has
  is not restored at all. Rules gone without this agent deleting them were cleared by a person;
  a sticky label taken off trusts the device again. The node's kill switch is read in the same step.
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
from pathlib import Path

import structlog

from ..clock import Clock, from_wall
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError
from ..k8s.model import DeviceKey
from ..k8s.nodestate import Deletion
from .contract import DeletionStore, HealthSource, KillSwitch, RuleFeed
from .plan import EFFECT_RANK, TIER_EFFECT
from .record import OwnedRule, OwnedRules, domain_of

log = structlog.get_logger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
STAT = Path("/proc/stat")


@dataclass(frozen=True)
class BootIdentity:
    boot_id: str = ""  # "" when unknown: nothing is proven by it
    booted_at: float | None = None  # epoch seconds; None when unknown

    def reset_since(self, boot_id: str, first_seen: float | None) -> bool:
        """Whether a fault recorded under ``boot_id`` (or, unannotated, first seen at
        ``first_seen``) has had a reboot since: another boot, or a fault older than this boot."""
        if boot_id:
            return bool(self.boot_id) and boot_id != self.boot_id
        return first_seen is not None and self.booted_at is not None and first_seen < self.booted_at


def read_boot_identity(boot_id: Path = BOOT_ID, stat: Path = STAT) -> BootIdentity:
    """This node's boot, from procfs; what cannot be read stays unknown (and proves nothing)."""
    ident, booted = "", None
    try:
        ident = boot_id.read_text().strip()
    except OSError as e:
        log.warning("boot_id_unreadable", path=str(boot_id), error=str(e))
    try:
        for line in stat.read_text().splitlines():
            if line.startswith("btime "):
                booted = float(line.split()[1])
                break
    except (OSError, ValueError, IndexError) as e:
        log.warning("boot_time_unreadable", path=str(stat), error=str(e))
    return BootIdentity(ident, booted)


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
        uuid = domain_of(r)
        if not uuid or (uuid, r.reason) in done:
            continue
        proven = reset_proven(r, boot)
        if proven and EFFECT_RANK[TIER_EFFECT[Tier(r.tier)]] > EFFECT_RANK.get(r.effect, 0):
            log.info("rule_released_on_adoption", rule=r.name, uuid=uuid, reason=r.reason, tier=r.tier, effect=r.effect)
            continue
        done.add((uuid, r.reason))
        since = now if r.first_seen is None else min(now, from_wall(clock, r.first_seen))
        health.restore(uuid, r.reason, Tier(r.tier), since, r.evidence, bool(r.reset_required))
        log.info("health_restored_from_rule", rule=r.name, uuid=uuid, reason=r.reason, tier=r.tier,
                 reset_required=r.reset_required, reset_proven=proven)
        if proven:
            reset[uuid] = r.name
    for uuid, name in reset.items():
        health.reset_proven(uuid, f"proven on adoption of {name} (boot {boot.boot_id or 'unknown'})")
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
        self._deleted: dict[DeviceKey, AdminDeletion] = {}
        self._loaded = store is None

    def __contains__(self, key: DeviceKey) -> bool:
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

    def noticed(self, key: DeviceKey, reason: str) -> None:
        self._deleted[key] = AdminDeletion(self.clock.monotonic(), self.clock.wall(), reason)
        self._save()

    def forget(self, key: DeviceKey) -> None:
        if self._deleted.pop(key, None) is not None:
            self._save()

    def since(self, key: DeviceKey, h: DeviceHealth) -> float | None:
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
        # (a deletion read back covers the same state seen again after the restart: only an event is news)
        news = [c for c in h.conditions if not entry.carried or _event_reason(c.reason) or c.reason != entry.reason]
        fresh = [c for c in news if c.last_seen > entry.at]
        return None if fresh else math.inf

    def _save(self) -> None:
        if self._store is None:
            return
        try:
            self._store.save({k: Deletion(v.wall, v.reason) for k, v in self._deleted.items()})
        except ApiError as e:
            # Kept in memory and written on the next change; only a restart meanwhile forgets.
            log.warning("node_state_not_saved", configmap=self._store.name, error=str(e))


class RuleSync:
    def __init__(
        self, feed: RuleFeed, kill: KillSwitch, record: OwnedRules, health: HealthSource, admin: AdminMemory,
        boot: BootIdentity, clock: Clock,
    ) -> None:
        self.feed, self.kill, self.record, self.health = feed, kill, record, health
        self.admin, self.boot, self.clock = admin, boot, clock
        self.kill_switch = False  # the node's label says "disabled"

    def run(self) -> list[OwnedRule]:
        """One resync; returns the rules adopted. Raises ApiError or TaintRulesUnavailable."""
        self.admin.load_once()
        found = self.feed.current()
        disabled = self.kill.disabled()
        if disabled is not None:
            self.kill_switch = disabled
        if found is None:
            return []
        sync = self.record.sync(found, self.feed.lags, self.clock.monotonic())
        for r in sync.unstuck:
            # A person took the sticky label off: the device is trusted again, and the rule
            # steps down like any other once the device is healthy.
            log.warning("sticky_label_removed", rule=r.name, device=r.device)
            self._clear_sticky(r)
        for r in sync.gone:
            log.warning("rule_deleted_by_someone_else", rule=r.name, device=r.device)
            self.deleted_by_someone(r.key, r)
        for r in sync.adopted:
            log.info("rule_adopted", rule=r.name, device=r.device, effect=r.effect, boot_id=r.boot_id or None)
        if sync.adopted:
            # What the rules stand for comes back into the health engine: a fatal rule waits for
            # a GPU reset, as it did before the restart, unless that reset is proven.
            restore_health(self.health, sync.adopted, self.clock, self.boot)
        for r in sync.adopted:
            if r.sticky and r.uuid:
                # The failure history died with the previous process; the label is the record,
                # so gpu_healthy agrees with the rule until a person clears it.
                why = "failed too often before the agent restarted"
                self.health.mark_sticky(r.uuid, f"sticky label on DeviceTaintRule {r.name} ({why}); clear by hand")
        return sync.adopted

    def deleted_by_someone(self, key: DeviceKey, rule: OwnedRule) -> None:
        """Not recreated without new evidence (remembered across restarts); a sticky device
        counts as cleared by hand."""
        self.admin.noticed(key, rule.reason)
        self._clear_sticky(rule)

    def _clear_sticky(self, rule: OwnedRule) -> None:
        if rule.uuid:
            # (a MIG device's uuid clears the GPU it lives on: the health engine maps it)
            self.health.clear_sticky(rule.uuid)
