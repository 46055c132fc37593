"""A resync: the record of owned rules brought in line with what the cluster holds for this node.

Rules found carrying this agent's labels are adopted (an agent restarted) and what they stand
for goes back into the health engine (:func:`~.state.restore_health`), with the resets proven to
have happened meanwhile; rules gone without this agent deleting them were cleared by a person
and are remembered as such (:meth:`RuleSync.deleted_by_someone`); a sticky label taken off trusts
the device again. The node's kill switch is read in the same step.
"""

from __future__ import annotations

import structlog

from ..clock import Clock
from .boot import BootIdentity
from .plan import OwnedRule
from .ports import HealthSource, Key, KillSwitch, RuleFeed
from .rules import OwnedRules
from .state import AdminMemory, restore_health
from .writer import RuleWriter

log = structlog.get_logger(__name__)


class RuleSync:
    def __init__(
        self, feed: RuleFeed, kill: KillSwitch, record: OwnedRules, health: HealthSource, admin: AdminMemory, boot: BootIdentity,
        clock: Clock,
    ) -> None:
        self.feed, self.kill, self.record, self.health, self.admin, self.boot, self.clock = feed, kill, record, health, admin, boot, clock
        self.kill_switch = False  # the node's label says "disabled"

    def run(self, writer: RuleWriter) -> list[OwnedRule]:
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
            writer.actions["adopt"] += 1
            log.info("rule_adopted", rule=r.name, device=r.device, effect=r.effect, boot_id=r.boot_id or None)
        if sync.adopted:
            # What the rules stand for comes back into the health engine: a fatal rule waits for
            # a GPU reset, as it did before the restart, unless that reset is proven.
            restore_health(self.health, sync.adopted, self.clock, self.boot)
        for r in sync.adopted:
            writer.adopted_event(r, "found carrying this agent's labels (agent restarted)")
            if r.sticky and r.uuid:
                # The failure history died with the previous process; the label is the record,
                # so gpu_healthy agrees with the rule until a person clears it.
                self.health.mark_sticky(r.uuid, f"sticky label on DeviceTaintRule {r.name} (failed too often before the agent restarted); clear by hand")
        return sync.adopted

    def deleted_by_someone(self, key: Key, rule: OwnedRule) -> None:
        """Not recreated without new evidence (remembered across restarts); a sticky device
        counts as cleared by hand."""
        self.admin.noticed(key, rule.reason)
        self._clear_sticky(rule)

    def _clear_sticky(self, rule: OwnedRule) -> None:
        if rule.uuid:
            # (a MIG device's uuid clears the GPU it lives on: the health engine maps it)
            self.health.clear_sticky(rule.uuid)
