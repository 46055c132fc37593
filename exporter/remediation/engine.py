"""The remediator: keeps this node's DeviceTaintRules in line with device health, per fault domain.

A thin loop over parts that each own their state: :mod:`.adoption` brings the record of owned rules
(:mod:`.record`) in line with the cluster after a restart and reads the kill switch; :mod:`.reconcile`
decides every published device's rule (:mod:`.plan`) under the rails' verdict (:mod:`.rails`: settle
window, node-wide test, rate window, cluster budget) and has :mod:`.writer` write and tell them;
:mod:`.evictions` counts the pods still on each NoExecute device; :mod:`.contract` has their types.

It runs on its own thread so API latency never stalls metric collection, woken at once by the health
engine, the rule and node watches and the budget. Targets come from the snapshot the sampler hands it
(``update``); it reads no source. Each pass ends in one frozen ``RemediationReport``: all the agent reads.
"""

from __future__ import annotations

import threading
import time

import structlog

from ..backoff import Backoff
from ..clock import SYSTEM, Clock
from ..k8s.connection import ApiError
from ..k8s.taintrules import TaintRulesUnavailable
from ..model.snapshot import PublishedDevice, Snapshot
from ..reasons import Suppression, TaintMode
from .adoption import AdminMemory, BootIdentity, RuleSync
from .contract import (
    Budget,
    DeletionStore,
    EventSink,
    HealthSource,
    KillSwitch,
    PodLookup,
    RemediationPolicy,
    RemediationReport,
    RuleApi,
    RuleFeed,
    Target,
)
from .evictions import EvictionWatch
from .rails import SafetyRails
from .reconcile import Reconciler, targets
from .record import OwnedRules
from .writer import NO_API_KEY, Notices, Refusals, RuleWriter

__all__ = ["QUIET_PASS", "Remediator"]

log = structlog.get_logger(__name__)

QUIET_PASS = 5.0  # seconds between passes while the node is quiet, at least (see Remediator.update)


class Remediator:
    def __init__(
        self,
        policy: RemediationPolicy,
        health: HealthSource,
        rules: RuleApi,
        events: EventSink,
        feed: RuleFeed,
        kill_switch: KillSwitch,
        budget: Budget,
        *,
        node_state: DeletionStore | None = None,
        boot: BootIdentity | None = None,
        clock: Clock = SYSTEM,
        pods: PodLookup | None = None,  # reads a pod that outstays its eviction (evictions.py)
    ) -> None:
        self.policy, self.health, self.rules, self.feed = policy, health, rules, feed
        self.kill, self.budget, self.clock = kill_switch, budget, clock
        self.boot = boot or BootIdentity()
        self.record = OwnedRules()
        self.admin = AdminMemory(node_state, clock)
        self.sync = RuleSync(feed, kill_switch, self.record, health, self.admin, self.boot, clock)
        self.writer = RuleWriter(policy.node, policy.mode, rules, events, self.record, clock, policy.hold,
                                 self.boot.boot_id, self.sync.deleted_by_someone)
        self.notices = Notices(self.writer.tell_suppressed)
        self.refusals = Refusals()
        self.rails = SafetyRails(policy, budget)
        self.reconciler = Reconciler(policy, self.record, self.rails, self.writer, self.notices, self.refusals,
                                     self.admin)
        self.evictions = EvictionWatch(pods, events, self.writer.ref, policy.eviction_grace, clock)
        self.ok = False
        self.last_error: str | None = None
        self.passes = 0  # good passes of the remediator thread (for tests and debugging)
        self.api_served: bool | None = None  # a DeviceTaintRule version is served; None: not known yet
        self._snap: Snapshot | None = None
        self._published: tuple[PublishedDevice, ...] | None = None  # the last known published devices
        self._targets: tuple[tuple[PublishedDevice, ...] | None, list[Target]] = (None, [])
        self._wake, self._dirty = threading.Condition(), True
        self._quiet = False  # the last pass ended with nothing to watch over (see update)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the snapshot handed in and the published report
        self._report = RemediationReport(mode=policy.mode.value)
        # between failed passes; a 429's Retry-After is honoured
        self._retry_at, self._backoff = 0.0, Backoff(0.5, 30.0)
        health.subscribe(lambda uuid: self.poke())
        budget.subscribe(self.poke)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.feed.start(self.poke)
        self.kill.start(self.poke)
        self._thread = threading.Thread(target=self._loop, name="remediation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.poke()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.feed.stop()
        self.kill.stop()
        self.budget.close()

    @property
    def quiet(self) -> bool:
        """The last pass ended with nothing to watch over: cycles do not ask for passes."""
        return self._quiet

    @property
    def pass_pending(self) -> bool:
        """A pass has been asked for (by a cycle, a health change or a watch) and not run yet."""
        return self._dirty

    def poke(self) -> None:
        with self._wake:
            self._dirty = True
            self._wake.notify()

    def update(self, snap: Snapshot) -> None:
        """The sampler's new snapshot: a pass is due, unless the node is quiet.

        Quiet (the last pass found every device healthy and holds no rule, nothing pending, refused,
        settling, raised or waiting): a pass would decide NOTHING for every device, whatever the
        readings or the slices say. What can end the quiet wakes the thread itself: a health change
        (the health engine's subscription), a rule, the kill switch or the budget (their watches).
        At a 1 s interval a pass per cycle was a tenth of an 8-GPU node's CPU. New devices always ask."""
        with self._lock:
            old, self._snap = self._snap, snap
        if not self._quiet or old is None or [d.identity for d in old.devices] != [d.identity for d in snap.devices]:
            self.poke()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                backoff_left = self._retry_at - time.monotonic()
                if backoff_left > 0:
                    # After a failed pass: retry when the backoff ends; a poke meanwhile stays pending.
                    self._wake.wait(timeout=backoff_left)
                    continue
                if not self._dirty:
                    wait = max(QUIET_PASS, self.policy.resync) if self._quiet else min(self.policy.interval, QUIET_PASS)
                    if self.rails.next_due is not None:  # a settling domain's raise is due then
                        wait = max(0.0, min(wait, self.rails.next_due - self.clock.monotonic() + 0.01))
                    self._wake.wait(timeout=wait)
            if self._stop.is_set():
                return
            try:
                self.reconcile()
                self.ok, self.last_error = True, None
                self._backoff.reset()
                self.passes += 1
            except (ApiError, TaintRulesUnavailable) as e:
                self.ok, self.last_error = False, str(e)
                delay = self._backoff.next_delay(e.retry_after if isinstance(e, ApiError) else None)
                log.warning("remediation_pass_failed", error=str(e), retry_in=round(delay, 2))
                with self._wake:
                    self._retry_at = time.monotonic() + delay
                    self._dirty = True  # the failed work is still to do
            except Exception as e:
                self.ok, self.last_error = False, str(e)
                log.exception("remediation_pass_crashed")
            self._publish()

    # -- one pass ------------------------------------------------------------------------------
    def reconcile(self) -> None:
        with self._wake:
            # This pass answers every request made so far: it reads health, the snapshot and the
            # rules after this point. A request made from here on asks for another pass.
            self._dirty = False
        self._quiet = False  # until this pass has gone through to the end
        p = self.policy
        if p.mode == TaintMode.OFF:
            self._quiet = True  # nothing to do, ever
            return
        try:
            supports_none = True if p.dry_run else self.rules.served().supports_none
            if not p.dry_run:  # (dry-run asks the API nothing)
                self.api_served = True
                self.writer.adopted(self.sync.run())
        except TaintRulesUnavailable as e:
            self.api_served = False
            # Not a failure of this agent but what the cluster offers (the API is off by default
            # before 1.37): told once per agent start; every pass looks again (discovery is cached).
            note = f"GPU faults on this node get no DeviceTaintRule: {e}. Health is reported in metrics only."
            self.notices.announce(NO_API_KEY, Suppression.NO_API, note)
            self._publish()
            return
        self.notices.over(NO_API_KEY, Suppression.NO_API)  # served again: a later loss is news
        with self._lock:
            snap = self._snap
        if snap is not None and snap.published is not None:
            self._published = snap.published  # (while the slices are not listed, the last known ones)
        published = self._published
        gpus = [d.identity for d in snap.devices if not d.identity.is_partition] if snap is not None else []
        now, health = self.clock.monotonic(), self.health.all_health()
        keys = frozenset(d.key for d in published) if published is not None else None
        if self._targets[0] is not published:  # (the join keeps the same tuple while slices stand still)
            self._targets = (published, targets(published or ()))
        self.reconciler.run(self._targets[1], gpus, keys, health, now, supports_none, self.sync.kill_switch)
        self.evictions.run(self.record.values(), snap.allocations if snap is not None else (), now)
        self._quiet = not (
            len(self.record) or self.refusals or self.reconciler.pending or self.rails.raised or self.rails.waiting
            or self.rails.next_due is not None or any(h.conditions for h in health.values())
        )
        self._publish()

    # -- outputs -------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether a fault on this node gets a DeviceTaintRule now: a writing mode, the API
        served, the node's kill switch off."""
        writing = self.policy.mode in (TaintMode.SHADOW, TaintMode.ENFORCE)
        return writing and self.api_served is True and not self.sync.kill_switch

    def _publish(self) -> None:
        """Take the report on the remediation thread, between writes: every part of it is of the
        same moment, and the sampler never reads state the pass is changing."""
        report = RemediationReport(
            mode=self.policy.mode.value,
            active=self.active,
            ok=self.ok or self.last_error is None,
            error=self.last_error or "",
            refused=self.refusals.lines(),
            rules=self.record.views(),
            actions=dict(self.writer.actions),
            suppressed=dict(self.notices.suppressed),
            budget_exhausted=self.rails.budget_exhausted,
            latency=self.writer.latency.snapshot(),
            pending_eviction=self.evictions.pending,
        )
        with self._lock:
            self._report = report

    def report(self) -> RemediationReport:
        with self._lock:
            return self._report
