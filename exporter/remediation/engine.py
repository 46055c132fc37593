"""The remediator: keeps this node's DeviceTaintRules in line with device health, per fault domain.

A thin loop over small parts, each with one job:

* :mod:`.domains` groups this node's published DRA devices into fault domains (one per
  physical GPU: the full GPU, its static MIG devices, its DynamicMIG partitions, AMD partitions);
* :mod:`.plan` decides, as pure functions over plain data, what each device's rule should be
  and which fault domains may be raised to NoExecute (settle window, node-wide test, rate
  limit, cluster budget: every rail counts domains, never DRA devices);
* :mod:`.writer` writes the rules and tells each domain's writes in one Event;
* :mod:`.state` reads back what rules stand for and remembers admins' deletions;
* the cluster budget (:class:`exporter.k8s.budget.ClusterBudget`) is taken when a domain is
  raised to NoExecute and returned when it steps down or is untainted.

It runs on its own thread so API latency never stalls metric collection, and is woken at once
by the health engine. A new fatal fault is fenced at once (NoSchedule: nothing new lands on
the domain; this is the detection-to-taint latency) and raised to NoExecute once its settle
window has passed, unless the node-wide test tripped within it. Lowering is never gated.

Everything held back is counted once per episode under a :class:`~.reasons.Suppression` and told
in one Warning Event. A write the API server refuses (401, 403, 422...) is held for
``REFUSED_RETRY``, fails the remediation collector and is listed in ``/readyz``'s body.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from ..backoff import Backoff
from ..config import Config, TaintMode
from ..devices.model import DeviceIdentity
from ..health.engine import HealthEngine
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError, get_json
from ..k8s.events import EventRecorder
from ..k8s.model import SliceDevice
from ..k8s.resolve import DeviceIndex
from ..k8s.taintrules import TaintRuleClient, TaintRulesUnavailable
from ..model.join import effective_health
from ..model.snapshot import Snapshot
from ..reasons import Suppression
from . import domains, names
from .budget import Budget, LocalBudget
from .plan import ADMIN_DELETED, Action, Decision, Effect, OwnedRule, Safety, Target, decide, node_wide, settle_due, settling, wanted
from .report import Histogram, RemediationReport, TaintRuleView
from .state import AdminDeletion, NodeState, restore_health, rule_from_object
from .writer import NameTaken, Outcome, RuleWriter

log = structlog.get_logger(__name__)

REFUSED_RETRY = 300.0  # seconds before a refused write is tried again, unless the decision changes
QUIET_PASS = 5.0  # seconds between passes while the node is quiet, at least (see Remediator.update)
NO_API_KEY = ("api", "", "")  # announcement key of the cluster-wide "no DeviceTaintRule API"
NODE_KEY = ("node", "", "")  # announcement key of node-wide episodes
BUDGET_KEY = ("budget", "", "")  # announcement key of "the budget object cannot be read"


class Remediator:
    def __init__(
        self,
        cfg: Config,
        client: Any,
        health: HealthEngine,
        slices: Any,
        clock: Callable[[], float] = time.time,
        resync: float = 30.0,
        rules: TaintRuleClient | None = None,
        events: EventRecorder | None = None,
        budget: Budget | None = None,
        node_state: NodeState | None = None,
        owned_rules: Any = None,  # OwnedRuleWatch, or a factory taking the served version; None: list every ``resync`` s
        node_watch: Any = None,  # exporter.k8s.watch.NodeWatch; None: GET the Node every ``resync`` s
    ) -> None:
        self.cfg = cfg
        self.node = cfg.node_name
        self.mode = cfg.taint_mode
        self.client = client
        self.health = health
        self.slices = slices
        self.clock = clock
        self.resync = resync
        self.rules = rules or TaintRuleClient(client)
        self.events = events or EventRecorder(client, self.node)
        self.writer = RuleWriter(self.node, self.mode, self.rules, self.events, clock, cfg.taint_hold_seconds)
        self.writer.on_deleted_by_someone = self._deleted_by_someone
        self.budget: Budget = budget if budget is not None else LocalBudget(cfg.taint_budget_max)
        self.node_state = node_state
        # The rule watch needs the served DeviceTaintRule version, known after discovery: a
        # factory is called then (see _ensure_watches).
        self._owned_rules_factory = owned_rules if callable(owned_rules) and not hasattr(owned_rules, "objects") else None
        self.owned_rules = None if self._owned_rules_factory is not None else owned_rules
        self.node_watch = node_watch
        self._started = False
        self.suppressed: Counter[str] = Counter()
        self.budget_exhausted = False
        self.last_error: str | None = None
        self.ok = False
        self.passes = 0  # good passes of the remediator thread (for tests and debugging)
        self.api_served: bool | None = None  # a DeviceTaintRule version is served; None: not known yet
        self._adopted = False
        self._last_resync = -math.inf
        self._kill_switch = False
        self._noexecute_times: deque[float] = deque()  # when a fault domain was raised (rate limit)
        self._raised: set[str] = set()  # units (fault domains, or instances) allowed NoExecute
        self._admin_deleted: dict[tuple[str, str, str], AdminDeletion] = {}
        self._admin_loaded = node_state is None
        # Writes the server refused (4xx) or whose name is taken: key -> ((action, effect, tier),
        # when to ask again, what was said). A new decision for the device is asked at once.
        self._refused: dict[tuple[str, str, str], tuple[tuple[str, str, str], float, str]] = {}
        self._announced: set[tuple[tuple[str, str, str], str]] = set()  # (key, suppression) already told
        self._pending: dict[str, list[Outcome]] = {}  # a domain's writes not yet told (pass failed midway)
        self._plugin_notified: dict[str, str] = {}
        self._index = DeviceIndex(())
        self._identities: tuple[DeviceIdentity, ...] = ()
        # (slice devices, the index, their targets) of the last resolution
        self._targets_memo: tuple[Mapping[tuple[str, str, str], SliceDevice], DeviceIndex, tuple[Target, ...]] | None = None
        self._next_due: float | None = None  # clock time a settling domain's raise is due
        self._wake = threading.Condition()
        self._dirty = True
        self._quiet = False  # the last pass ended with nothing to watch over (see update)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._retry_at = 0.0
        self._backoff = Backoff(0.5, 30.0)  # between failed passes; a 429's Retry-After is honoured
        health.subscribe(lambda uuid: self.poke())
        for w in (owned_rules, node_watch):
            if w is not None and hasattr(w, "on_change"):
                w.on_change = self.poke

    # -- compatibility views -------------------------------------------------------------------
    @property
    def owned(self) -> dict[tuple[str, str, str], OwnedRule]:
        return self.writer.owned

    @property
    def actions(self) -> Counter[str]:
        return self.writer.actions

    @property
    def latency(self) -> Histogram:
        return self.writer.latency

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        for w in (self.owned_rules, self.node_watch):
            if w is not None and hasattr(w, "start"):
                w.start()
        self._thread = threading.Thread(target=self._loop, name="remediation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.poke()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for w in (self.owned_rules, self.node_watch):
            if w is not None and hasattr(w, "stop"):
                w.stop()

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

        Quiet (the last pass found every device healthy and holds no rule, nothing pending,
        refused, settling or raised): a pass would decide NOTHING for every device, whatever
        the readings or the slices say. What can end the quiet wakes the thread itself: a
        health change (the health engine's subscription), a rule or the kill switch (the
        watches' on_change); without watches, the thread's own pass every ``resync`` seconds
        lists them. At a 1 s interval a pass per cycle was a tenth of an 8-GPU node's CPU."""
        ids = tuple(d.identity for d in snap.devices)
        if ids != self._identities:
            with self._lock:
                self._identities = ids
                self._index = DeviceIndex(ids)
            self.poke()
        elif not self._quiet:
            self.poke()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                backoff_left = self._retry_at - time.monotonic()
                if backoff_left > 0:
                    # After a failed pass: retry when the backoff ends, and keep any poke that
                    # arrives meanwhile pending (dirty stays set).
                    self._wake.wait(timeout=backoff_left)
                    continue
                if not self._dirty:
                    # quiet: only rules and the kill switch can change it, and without their
                    # watches a pass lists them every ``resync`` seconds (30): no sooner
                    wait = max(QUIET_PASS, self.resync) if self._quiet else min(self.cfg.interval, QUIET_PASS)
                    if self._next_due is not None:
                        # a settling domain's raise is due then, not at the next interval
                        wait = max(0.0, min(wait, self._next_due - self.clock() + 0.01))
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
                delay = self._backoff.next_delay(getattr(e, "retry_after", None))
                log.warning("remediation_pass_failed", error=str(e), retry_in=round(delay, 2))
                with self._wake:
                    self._retry_at = time.monotonic() + delay
                    self._dirty = True  # the failed work is still to do
            except Exception as e:
                self.ok, self.last_error = False, str(e)
                log.exception("remediation_pass_crashed")

    # -- state from the cluster ----------------------------------------------------------------
    def _owned_objects(self) -> list[dict[str, Any]] | None:
        """This node's rules: from the watch (no request) or, without one, a node-scoped list
        every ``resync`` seconds. None: nothing new to look at."""
        if self.owned_rules is not None:
            if not getattr(self.owned_rules, "synced", False):
                return None
            return list(self.owned_rules.objects().values())
        if time.monotonic() - self._last_resync < self.resync:
            return None
        return self.rules.list_owned(self.node)

    def _kill_switch_now(self) -> bool:
        if self.node_watch is not None:
            if not getattr(self.node_watch, "synced", False):
                return self._kill_switch
            watched: str = (self.node_watch.labels() or {}).get(names.KILL_SWITCH_LABEL, "")  # label values are strings
            return watched.lower() == "disabled"
        if time.monotonic() - self._last_resync < self.resync:
            return self._kill_switch
        try:
            node = get_json(self.client, f"/api/v1/nodes/{self.node}", timeout=(3.0, 5.0))
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        switch: str = ((node.get("metadata") or {}).get("labels") or {}).get(names.KILL_SWITCH_LABEL, "")  # label values are strings
        return switch.lower() == "disabled"

    def _resync(self) -> None:
        if self.mode == TaintMode.DRY_RUN:
            return
        if not self._admin_loaded and self.node_state is not None:
            self._admin_deleted.update(self.node_state.load())
            self._admin_loaded = True
        objs = self._owned_objects()
        self._kill_switch = self._kill_switch_now()
        if objs is None:
            return
        found: dict[tuple[str, str, str], OwnedRule] = {}
        for obj in objs:
            r = rule_from_object(obj)
            if r is not None and r.pool and r.device:
                found[r.key] = r
        adopted: list[OwnedRule] = []
        with self.writer.lock:
            owned = self.writer.owned
            names_seen = {r.name for r in found.values()}
            self.writer.deleted &= names_seen  # gone from the view: no longer in doubt
            for key, r in found.items():
                mine = owned.get(key)
                if mine is None:
                    if r.name in self.writer.deleted:
                        continue  # deleted by us a moment ago; the watch has not caught up
                    self.actions["adopt"] += 1
                    log.info("rule_adopted", rule=r.name, device=r.device, effect=r.effect)
                    owned[key] = r
                    adopted.append(r)
                else:
                    if mine.sticky and not r.sticky:
                        # A person took the sticky label off: the device is trusted again
                        # and the rule steps down like any other once the device is healthy.
                        log.warning("sticky_label_removed", rule=mine.name, device=mine.device)
                        self._clear_sticky(mine)
                    mine.managed, mine.uid, mine.effect, mine.sticky = r.managed, r.uid, r.effect, r.sticky
            for key, mine in list(owned.items()):
                if key not in found and not mine.virtual and self._adopted and self._seen_by_watch(mine):
                    # Gone without us deleting it: an admin cleared it. Respect that.
                    log.warning("rule_deleted_by_someone_else", rule=mine.name, device=mine.device)
                    self._deleted_by_someone(key, mine)
        if adopted:
            # What the rules stand for comes back into the health engine: a fatal rule waits
            # for a GPU reset, as it did before the restart.
            restore_health(self.health, adopted, self.clock())
        for r in adopted:
            if r.effect == Effect.NO_EXECUTE.value:
                self._raised.add(self._unit_of_rule(r))
            self.writer.adopted_event(r, "found carrying this agent's labels (agent restarted)")
            if r.sticky and r.uuid:
                # The failure history died with the previous process; the label is the
                # record, so gpu_healthy agrees with the rule until a person clears it.
                self.health.mark_sticky(r.uuid, f"sticky label on DeviceTaintRule {r.name} (failed too often before the agent restarted); clear by hand")
        self._adopted = True
        self._last_resync = time.monotonic()

    def _ensure_watches(self) -> None:
        if self._owned_rules_factory is None or self.mode == TaintMode.DRY_RUN:
            return
        self.owned_rules = self._owned_rules_factory(self.rules.served().version)
        self._owned_rules_factory = None
        if hasattr(self.owned_rules, "on_change"):
            self.owned_rules.on_change = self.poke
        if self._started and hasattr(self.owned_rules, "start"):
            self.owned_rules.start()

    def _seen_by_watch(self, rule: OwnedRule) -> bool:
        """With a watch, a rule we created moments ago may not be in its cache yet: only a rule
        older than a few seconds that the synced cache lacks was deleted by someone."""
        if self.owned_rules is None:
            return True
        return rule.created_at is None or self.clock() - rule.created_at > 10.0

    @staticmethod
    def _unit_of_rule(r: OwnedRule) -> str:
        return r.uuid if r.scope == "instance" or not r.gpu else r.gpu

    @property
    def active(self) -> bool:
        """Whether a fault on this node gets a DeviceTaintRule now: a writing mode, the API
        served, the node's kill switch off."""
        return self.mode in (TaintMode.SHADOW, TaintMode.ENFORCE) and self.api_served is True and not self._kill_switch

    def _deleted_by_someone(self, key: tuple[str, str, str], rule: OwnedRule) -> None:
        """Not recreated without new evidence (remembered across restarts); a sticky device
        counts as cleared by hand."""
        with self.writer.lock:
            self.writer.owned.pop(key, None)
        self._admin_deleted[key] = AdminDeletion(self.clock(), rule.reason)
        self._save_admin_deleted()
        self._clear_sticky(rule)

    def _save_admin_deleted(self) -> None:
        if self.node_state is None:
            return
        try:
            self.node_state.save(self._admin_deleted)
        except ApiError as e:
            # Kept in memory and written on the next change; only a restart meanwhile forgets.
            log.warning("node_state_not_saved", configmap=self.node_state.name, error=str(e))

    def _clear_sticky(self, rule: OwnedRule) -> None:
        if rule.uuid:
            # (a MIG device's uuid clears the GPU it lives on: the health engine maps it)
            self.health.clear_sticky(rule.uuid)

    # -- one pass ------------------------------------------------------------------------------
    def targets(self) -> list[Target]:
        devices = self.slices.devices() if self.slices is not None else {}
        with self._lock:
            index = self._index
        memo = self._targets_memo
        if memo is not None and memo[1] is index and memo[0] == devices:
            # Slices and devices unchanged since the last pass (the usual case): resolving
            # every published device again was a fifth of the dense node's cycle.
            return list(memo[2])
        ts = domains.targets(devices, index)
        self._targets_memo = (devices, index, tuple(ts))
        return ts

    def reconcile(self) -> None:
        with self._wake:
            # This pass answers every request made so far: it reads health, slices and rules
            # after this point. A request made from here on asks for another pass.
            self._dirty = False
        self._quiet = False  # until this pass has gone through to the end
        if self.mode == TaintMode.OFF:
            self._quiet = True  # nothing to do, ever
            return
        try:
            supports_none = True if self.mode == TaintMode.DRY_RUN else self.rules.served().supports_none
            self.api_served = True if self.mode != TaintMode.DRY_RUN else self.api_served
            self._ensure_watches()
            self._resync()
        except TaintRulesUnavailable as e:
            self.api_served = False
            # Not a failure of this agent but what the cluster offers (the API is off by default
            # before 1.37): told once per agent start in an Event, a warning and the no_api
            # suppression. Every pass looks again (discovery is cached).
            self._announce_once(NO_API_KEY, Suppression.NO_API, f"GPU faults on this node get no DeviceTaintRule: {e}. Health is reported in metrics only.")
            return
        self._announced.discard((NO_API_KEY, Suppression.NO_API.value))  # served again: a later loss is news
        now = self.clock()
        health = self.health.all_health()
        targets = self.targets()
        physical = [i for i in self._identities if not i.is_partition]
        # GPU-wide fatal faults by physical GPU (an instance's own faults are on the instance)
        fatal_since: dict[str, float] = {}
        for i in physical:
            h = health.get(i.uuid)
            times = [c.since for c in (h.conditions if h else ()) if c.tier == Tier.FATAL]
            if times:
                fatal_since[i.uuid] = min(times)
        window = self.cfg.node_fault_window
        nodewide = node_wide(fatal_since, len(physical), self.cfg.node_failure_fraction, window)
        if nodewide:
            self._announce_once(NODE_KEY, Suppression.NODE_FAULT, f"{len(nodewide)} of {len(physical)} GPUs failed within {window:g}s of each other: treating it as a node problem, NoSchedule only")
        else:
            self._announced.discard((NODE_KEY, Suppression.NODE_FAULT.value))  # the episode is over
        while self._noexecute_times and now - self._noexecute_times[0] > self.cfg.taint_rate_window:
            self._noexecute_times.popleft()
        self._next_due = None

        covered: set[str] = set()
        for dom in domains.group(targets):
            outcomes = self._pending.pop(dom.gpu, [])
            try:
                self._reconcile_domain(dom, health, fatal_since, nodewide, supports_none, now, covered, outcomes)
            except BaseException:
                self._pending[dom.gpu] = outcomes  # told once the rest of the domain is written
                raise
            if outcomes and self.mode != TaintMode.DRY_RUN:
                self.writer.tell(outcomes)
        self._retire_unpublished(now)
        self._release_budget(targets)
        if getattr(self.slices, "synced", True):
            # Before the first slice list every GPU would look device-plugin managed.
            self._device_plugin_notices(health, covered)
        with self.writer.lock:
            holds_rules = bool(self.writer.owned)
        self._quiet = not (
            holds_rules or self._refused or self._pending or self._raised or self._next_due is not None or any(h.conditions for h in health.values())
        )

    def _unit_safety(
        self, unit: str, keys: list[tuple[str, str, str]], since: float | None, node_fault: bool, supports_none: bool, now: float
    ) -> tuple[Safety, bool]:
        """The safety state for every device of one unit (a fault domain, or one MIG instance
        with a fault of its own), and whether the unit may hold NoExecute. Taken once per unit:
        one GPU failing is one unit of the rate limit, the node-wide test and the budget."""
        base = dict(kill_switch=self._kill_switch, supports_none=supports_none)
        if unit in self._raised or self.writer.has_noexecute(keys):
            self._raised.add(unit)
            return Safety(**base), True
        if since is not None and settling(since, now, self.cfg.taint_settle_seconds, self.cfg.node_fault_window):
            due = settle_due(since, self.cfg.taint_settle_seconds, self.cfg.node_fault_window)
            self._next_due = due if self._next_due is None else min(self._next_due, due)
            return Safety(settling=True, **base), False
        if node_fault:
            return Safety(node_fault=True, **base), False
        if len(self._noexecute_times) >= self.cfg.taint_rate_limit:
            return Safety(rate_ok=False, **base), False
        if self._kill_switch:
            return Safety(**base), True  # nothing is written; nothing to count
        if self.mode == TaintMode.DRY_RUN:
            # decides like enforce (rate limit included) but takes no budget: it writes nothing
            self._raised.add(unit)
            self._noexecute_times.append(now)
            return Safety(**base), True
        try:
            took = self.budget.take(self._holder(unit))
        except ApiError as e:
            # Fail safe: without the budget object no domain is raised beyond NoSchedule.
            self._announce_once(BUDGET_KEY, Suppression.BUDGET_UNAVAILABLE, f"the cluster NoExecute budget cannot be read or updated ({e}): new faults get NoSchedule only")
            return Safety(budget_unavailable=True, **base), False
        self._announced.discard((BUDGET_KEY, Suppression.BUDGET_UNAVAILABLE.value))
        if not took:
            self.budget_exhausted = True
            return Safety(budget_ok=False, **base), False
        self.budget_exhausted = False
        self._raised.add(unit)
        self._noexecute_times.append(now)
        return Safety(**base), True

    def _holder(self, unit: str) -> str:
        return f"{self.node}.{unit}"

    def _reconcile_domain(
        self,
        dom: domains.FaultDomain,
        health: dict[str, DeviceHealth],
        fatal_since: dict[str, float],
        nodewide: set[str],
        supports_none: bool,
        now: float,
        covered: set[str],
        outcomes: list[Outcome],
    ) -> None:
        gpu_fatal = dom.gpu in fatal_since
        # every device's effective health: its own conditions plus its GPU's GPU-wide ones
        hs = {t.key: effective_health(t.uuid, t.gpu if t.gpu != t.uuid else "", health) for t in dom.targets}
        units: dict[str, list[Target]] = {}
        for t in dom.targets:
            covered.add(t.uuid)
            covered.add(t.domain)
            units.setdefault(dom.gpu if gpu_fatal or t.uuid == dom.gpu else t.uuid, []).append(t)
        for unit, ts in units.items():
            keys = [t.key for t in ts]
            wants_ne = any(wanted(hs[t.key], self.mode, supports_none)[0] == Effect.NO_EXECUTE.value for t in ts)
            if unit == dom.gpu:
                since = fatal_since.get(dom.gpu)
            else:  # an instance's own fatal fault
                own = health.get(ts[0].uuid)
                times = [c.since for c in (own.conditions if own else ()) if c.tier == Tier.FATAL]
                since = min(times) if times else None
            if wants_ne:
                safety, _ = self._unit_safety(unit, keys, since, unit in nodewide, supports_none, now)
            else:
                safety = Safety(kill_switch=self._kill_switch, supports_none=supports_none)
            scope = "gpu" if unit == dom.gpu else "instance"
            for t in ts:
                self._decide_and_apply(t, hs[t.key], safety, supports_none, now, scope, outcomes)

    def _decide_and_apply(self, t: Target, h: DeviceHealth, safety: Safety, supports_none: bool, now: float, scope: str, outcomes: list[Outcome]) -> None:
        rule = self.writer.rule(t.key)
        if rule is None and not h.conditions and t.key not in self._refused and t.key not in self._admin_deleted:
            # The steady state of nearly every device: healthy, no rule, nothing refused or
            # deleted by an admin. plan.decide says NOTHING, unsuppressed, and the writer has
            # nothing to do; a pass over a healthy dense node was mostly this.
            if self._announced:
                self._announced = {tag for tag in self._announced if tag[0] != t.key}
            return
        d = decide(t, h, rule, self.mode, safety, self.cfg.taint_hold_seconds, now, self._admin_deleted_at(t.key, h))
        held = self._refused.get(t.key)
        if held is not None:
            if held[0] == (d.action, d.effect, d.tier) and now < held[1]:
                return  # refused before; asking again on every pass would only be refused again
            del self._refused[t.key]
        what = _suppression(d.suppressed)
        if what is not None and what != Suppression.NODE_FAULT and d.action in (Action.CREATE, Action.UPDATE, Action.REFRESH, Action.NOTHING, Action.KEEP):
            self._announce_once(t.key, what, f"{t.device}: {what.value.replace('_', ' ')} limits remediation of {h.worst.value if h.worst else 'healthy'} device {t.uuid}")
        try:
            out = self.writer.apply(t, h, rule, d, now, scope)
        except ApiError as e:
            if e.retryable:
                raise  # outage: the whole pass is retried with backoff
            # The server refused this one write (admission policy, validation, authorization):
            # report it (collector, /readyz, alert) and go on, or one bad device would block
            # every device sorted after it on every pass.
            log.error("remediation_write_rejected", device=t.device, action=d.action.value if isinstance(d.action, Action) else d.action, status=e.status, error=str(e), retry_in=REFUSED_RETRY)
            self._announce_once(t.key, Suppression.API_REJECTED, f"{t.device}: the API server refused to {_v(d.action)} its DeviceTaintRule: {e}")
            self._refused[t.key] = ((d.action, d.effect, d.tier), now + REFUSED_RETRY, f"{t.device}: {_v(d.action)} refused ({e.status}): {str(e)[:200]}")
            return
        except NameTaken as e:
            log.error("rule_name_taken", rule=str(e), device=t.device, retry_in=REFUSED_RETRY)
            self._refused[t.key] = ((d.action, d.effect, d.tier), now + REFUSED_RETRY, f"{t.device}: rule name {e} taken by an object that is not this agent's")
            self._announce_once(t.key, Suppression.NAME_CONFLICT, f"{t.device}: a DeviceTaintRule named {e} exists and is not this agent's; left alone, so {t.uuid} is not tainted")
            return
        if out is not None:
            outcomes.append(out)
            if d.action == Action.CREATE and self._admin_deleted.pop(t.key, None) is not None:
                self._save_admin_deleted()
        if not d.suppressed and self._announced:
            # Applied without any limit: this device's suppression episode (if any) is over.
            self._announced = {tag for tag in self._announced if tag[0] != t.key}

    def _admin_deleted_at(self, key: tuple[str, str, str], h: DeviceHealth) -> float | None:
        """When an admin's deletion of this device's rule was noticed, for :func:`decide` (which
        recreates the rule only on evidence newer than that). A deletion read back from the
        ConfigMap covers a *state* that is still there after a restart (a lost GPU, a failed
        row remap): the new process sees it "again" but it is the same evidence, so it counts
        as old for as long as it lasts. Once the device is clean the deletion is forgotten."""
        entry = self._admin_deleted.get(key)
        if entry is None:
            return None
        if not h.conditions:
            del self._admin_deleted[key]
            self._save_admin_deleted()
            return None
        fresh = [
            c for c in h.conditions
            if c.last_seen > entry.at and (not entry.carried or _event_reason(c.reason) or c.reason != entry.reason)
        ]
        return None if fresh else math.inf

    def _release_budget(self, targets: list[Target]) -> None:
        """Units no longer holding NoExecute give their budget slot back."""
        with self.writer.lock:
            ne_units = {self._unit_of_rule(r) for r in self.writer.owned.values() if r.effect == Effect.NO_EXECUTE.value}
        for unit in list(self._raised):
            if unit in ne_units:
                continue
            if any(t.domain == unit or t.uuid == unit for t in targets) and self._unit_wants_noexecute(unit, targets):
                continue  # raised this pass, write pending or refused: keep the slot
            self._raised.discard(unit)
            if self.mode == TaintMode.DRY_RUN:
                continue
            try:
                self.budget.release(self._holder(unit))
            except ApiError as e:
                self._raised.add(unit)  # try again next pass
                log.warning("budget_release_failed", unit=unit, error=str(e))
        if isinstance(self.budget, LocalBudget):
            # (the cluster-wide budgets say "full" only when a take is refused: see _unit_safety)
            self.budget_exhausted = len(self.budget.held()) >= self.budget.capacity

    def _unit_wants_noexecute(self, unit: str, targets: list[Target]) -> bool:
        health = self.health.all_health()
        for t in targets:
            if t.domain == unit or t.uuid == unit:
                h = effective_health(t.uuid, t.gpu if t.gpu != t.uuid else "", health)
                if wanted(h, self.mode, True)[0] == Effect.NO_EXECUTE.value:
                    return True
        return False

    def _retire_unpublished(self, now: float) -> None:
        """Rules for devices this node no longer publishes (MIG layout changed, driver gone)
        select nothing and would otherwise be orphaned forever; they go after the hold."""
        if self.slices is None or not getattr(self.slices, "synced", True):
            return
        published = set(self.slices.devices())
        with self.writer.lock:
            owned = list(self.writer.owned.items())
        outcomes: list[Outcome] = []
        for key, rule in owned:
            if key in published or not rule.managed:
                rule.gone_since = None
                continue
            if rule.gone_since is None:
                rule.gone_since = now
            if now - rule.gone_since < self.cfg.taint_hold_seconds or self._kill_switch:
                continue
            t = Target(driver=rule.driver, pool=rule.pool, device=rule.device, uuid=rule.uuid, gpu=rule.gpu)
            try:
                out = self.writer.delete(t, rule, Decision(Action.DELETE, why="device_gone"))
            except ApiError as e:
                if e.retryable:
                    raise
                log.error("remediation_write_rejected", device=rule.device, action="delete", error=str(e))
                continue
            if out is not None:
                outcomes.append(out)
        if outcomes:
            self.writer.tell(outcomes)

    def _announce_once(self, key: tuple[str, str, str], what: Suppression, note: str) -> None:
        """One Warning Event and one counter increment per (device, suppression) episode.

        The only place ``suppressed`` is counted, and only with a :class:`Suppression`, so the
        metric's documented reasons (from the same enum) are all the reasons it can carry."""
        what = Suppression(what)  # a stray string fails here, in tests, not in a dashboard
        tag = (key, what.value)
        if tag in self._announced:
            return
        self._announced.add(tag)
        self.suppressed[what.value] += 1
        log.warning("remediation_suppressed", what=what.value, device=key[2] or None, note=note)
        self.writer.node_event("HealthRemediationSuppressed", note, "Taint", warning=True)

    def _device_plugin_notices(self, health: dict[str, DeviceHealth], covered: set[str]) -> None:
        """GPUs no DRA device maps to (device-plugin GPUs) get Events but no rule: nothing can
        select them."""
        for ident in self._identities:
            if ident.is_partition or ident.uuid in covered:
                continue
            h = health.get(ident.uuid)
            state = h.worst.value if h is not None and h.worst is not None else ""
            prev = self._plugin_notified.get(ident.uuid)
            self._plugin_notified[ident.uuid] = state
            if prev == state or (prev is None and not state):
                continue  # no change, or healthy from the start: nothing to tell
            why = f": {h.conditions[0].reason}" if state and h is not None else ""
            note = f"GPU {ident.uuid} ({ident.pci_bus_id}) is {state or 'healthy again'}{why}; not DRA-managed, so no DeviceTaintRule can select it"
            self.writer.node_event("GPUUnhealthy" if state else "GPUHealthy", note, "Observe", warning=bool(state))

    # -- outputs -------------------------------------------------------------------------------
    def rule_views(self) -> tuple[TaintRuleView, ...]:
        with self.writer.lock:
            return tuple(
                TaintRuleView(driver=r.driver, pool=r.pool, device=r.device, effect=r.effect, tier=r.tier)
                for r in sorted(self.writer.owned.values(), key=lambda r: r.key)
                if not r.virtual
            )

    def refused(self) -> tuple[str, ...]:
        """Writes the API server refuses right now, one line each (for /readyz and the collector)."""
        return tuple(v[2] for _, v in sorted(self._refused.items()))

    def report(self) -> RemediationReport:
        return RemediationReport(
            mode=self.mode.value,
            active=self.active,
            ok=self.ok or self.last_error is None,
            error=self.last_error or "",
            refused=self.refused(),
            rules=self.rule_views(),
            actions=dict(self.actions),
            suppressed=dict(self.suppressed),
            budget_exhausted=self.budget_exhausted,
            latency=self.latency,
        )


def _event_reason(reason: str) -> bool:
    """Conditions opened by an event (new evidence each time) rather than a polled state."""
    return reason.startswith("xid_") or reason in ("ecc_double_bit", "gpu_lost_event", "ras_error")


def _v(action: Any) -> str:
    return action.value if isinstance(action, Action) else str(action)


def _suppression(value: str) -> Suppression | None:
    """The Suppression a decision carries, if any ("" and ADMIN_DELETED are none). Anything
    else must be a Suppression: a stray string raises here, in tests, not in a dashboard."""
    if not value or value == ADMIN_DELETED:
        return None
    return Suppression(value)
