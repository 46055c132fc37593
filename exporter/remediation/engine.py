"""The remediator: keeps this node's DeviceTaintRules in line with device health.

It runs on its own thread so API latency and outages never stall metric collection, and it is
woken at once by the health engine when a device's health changes (an XID event reaches a rule
in milliseconds, not at the next collection cycle). Each pass:

1. (re)reads the rules it owns (label-selected), the node's kill switch and the cluster-wide
   NoExecute count, at most every ``resync`` seconds;
2. maps every ResourceSlice device of this node to a local GPU and asks
   :func:`exporter.remediation.plan.decide` what to do;
3. executes the decisions, emitting an Event for each, retrying failed writes on the next pass.

Everything held back is counted once per episode under a :class:`~.reasons.Suppression` and told
in one Warning Event, including a cluster that serves no DeviceTaintRule API at all.

A person clears a sticky device by deleting its rule (or removing the rule's sticky label): the
next resync notices and clears the health engine's sticky state of the physical GPU.

Rule names are deterministic per (node, driver, pool, device), so a retry after a timeout can
never create a duplicate: the server answers 409 and the existing rule is adopted.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from ..backoff import Backoff
from ..config import Config, TaintMode
from ..health.engine import HealthEngine
from ..health.model import DeviceHealth, Tier
from ..k8s.connection import ApiError, get_json
from ..k8s.events import EventRecorder, micro_time, node_ref
from ..k8s.resolve import DeviceIndex, resolve
from ..k8s.taintrules import TaintRuleClient, TaintRulesUnavailable
from ..metrics.render import TaintRuleView
from ..model.join import effective_health
from ..model.snapshot import Snapshot
from . import names
from .plan import ADMIN_DELETED, EFFECT_RANK, EVIDENCE_MAX, Decision, OwnedRule, Safety, Target, decide
from .reasons import Suppression

log = structlog.get_logger(__name__)

REFUSED_RETRY = 300.0  # seconds before a refused write is tried again, unless the decision changes
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
NO_API_KEY = ("api", "", "")  # announcement key of the cluster-wide "no DeviceTaintRule API"
NODE_KEY = ("node", "", "")  # announcement key of node-wide episodes


class NameTaken(Exception):
    """A rule with our deterministic name exists and is not ours: never touch it."""


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self.samples: deque[float] = deque(maxlen=10000)  # for bench/ percentiles

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1
        self.samples.append(v)


def _rule_from_object(obj: dict) -> OwnedRule | None:
    try:
        meta = obj["metadata"]
        sel = obj["spec"]["deviceSelector"]
        taint = obj["spec"]["taint"]
        labels = meta.get("labels") or {}
        ann = meta.get("annotations") or {}
        return OwnedRule(
            name=meta["name"],
            driver=sel.get("driver", ""),
            pool=sel.get("pool", ""),
            device=sel.get("device", ""),
            uuid=ann.get(names.UUID_ANNOTATION, ""),
            effect=taint.get("effect", "None"),
            tier=labels.get(names.TIER_LABEL, ""),
            reason=ann.get(names.REASON_ANNOTATION, ""),
            evidence=ann.get(names.EVIDENCE_ANNOTATION, ""),
            sticky=labels.get(names.STICKY_LABEL, "").lower() == "true",
            uid=meta.get("uid", ""),
            managed=ann.get(names.UNMANAGED_ANNOTATION, "true").lower() != "false",
        )
    except (KeyError, TypeError, AttributeError):
        return None


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
        self.owned: dict[tuple[str, str, str], OwnedRule] = {}
        self.actions: Counter[str] = Counter()
        self.suppressed: Counter[str] = Counter()
        self.latency = Histogram()
        self.budget_exhausted = False
        self.last_error: str | None = None
        self.ok = False
        self._adopted = False
        self._last_resync = -math.inf
        self._kill_switch = False
        self.api_served: bool | None = None  # a DeviceTaintRule version is served; None: not known yet
        self._cluster_noexecute = 0
        self._cluster_gpus: int | None = None
        self._cluster_gpus_at = -math.inf
        self._noexecute_times: deque[float] = deque()
        self._admin_deleted: dict[tuple[str, str, str], float] = {}
        # Writes the server refused (4xx) or whose name is taken: (action, effect, tier) -> when
        # to ask again. A new decision for the device is asked at once.
        self.passes = 0  # good passes of the remediator thread (for tests and debugging)
        self._refused: dict[tuple[str, str, str], tuple[tuple[str, str, str], float]] = {}
        self._announced: set[tuple[tuple[str, str, str], str]] = set()  # (key, suppression) already told in an Event
        self._plugin_notified: dict[str, str] = {}
        self._index = DeviceIndex(())
        self._identities: tuple = ()
        self._wake = threading.Condition()
        self._dirty = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._retry_at = 0.0
        self._backoff = Backoff(0.5, 30.0)  # between failed passes; a 429's Retry-After is honoured
        health.subscribe(lambda uuid: self.poke())

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="remediation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.poke()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def poke(self) -> None:
        with self._wake:
            self._dirty = True
            self._wake.notify()

    def update(self, snap: Snapshot) -> None:
        ids = tuple(d.identity for d in snap.devices)
        if ids != self._identities:
            with self._lock:
                self._identities = ids
                self._index = DeviceIndex(ids)
        self.poke()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                backoff_left = self._retry_at - time.monotonic()
                if backoff_left > 0:
                    # After a failed pass: retry when the backoff ends, not at the next interval,
                    # and keep any poke that arrives meanwhile pending (dirty stays set).
                    self._wake.wait(timeout=backoff_left)
                    continue
                if not self._dirty:
                    self._wake.wait(timeout=min(self.cfg.interval, 5.0))
                self._dirty = False
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
    def _resync(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_resync < self.resync:
            return
        if self.mode != TaintMode.DRY_RUN:
            found = {}
            adopted: list[OwnedRule] = []
            for obj in self.rules.list_owned(self.node):
                r = _rule_from_object(obj)
                if r is not None and r.pool and r.device:
                    found[r.key] = r
            with self._lock:
                for key, r in found.items():
                    mine = self.owned.get(key)
                    if mine is None:
                        self.actions["adopt"] += 1
                        log.info("rule_adopted", rule=r.name, device=r.device, effect=r.effect)
                        self.owned[key] = r
                        adopted.append(r)
                    else:
                        if mine.sticky and not r.sticky:
                            # A person took the sticky label off: the device is trusted again
                            # and the rule steps down like any other once the device is healthy.
                            log.warning("sticky_label_removed", rule=mine.name, device=mine.device)
                            self._clear_sticky(mine)
                        mine.managed, mine.uid, mine.effect, mine.sticky = r.managed, r.uid, r.effect, r.sticky
                for key, mine in list(self.owned.items()):
                    if key not in found and not mine.virtual and self._adopted:
                        # Gone without us deleting it: an admin cleared it. Respect that.
                        log.warning("rule_deleted_by_someone_else", rule=mine.name, device=mine.device)
                        self._deleted_by_someone(key, mine)
            for r in adopted:
                self._adopted_event(r, "found carrying this agent's labels (agent restarted)")
                if r.sticky and r.uuid:
                    # The failure history died with the previous process; the label is the
                    # record, so gpu_healthy agrees with the rule until a person clears it.
                    self.health.mark_sticky(r.uuid, f"sticky label on DeviceTaintRule {r.name} (failed too often before the agent restarted); clear by hand")
            self._adopted = True
            cluster = self.rules.list_owned(None)
            self._cluster_noexecute = sum(1 for o in cluster if (o.get("spec") or {}).get("taint", {}).get("effect") == "NoExecute")
            self._kill_switch = self._node_kill_switch()
            self._count_cluster_gpus()
        self._last_resync = now

    @property
    def active(self) -> bool:
        """Whether a fault on this node gets a DeviceTaintRule now: a writing mode, the API
        served, the node's kill switch off."""
        return self.mode in (TaintMode.SHADOW, TaintMode.ENFORCE) and self.api_served is True and not self._kill_switch

    def _deleted_by_someone(self, key: tuple[str, str, str], rule: OwnedRule) -> None:
        """Not recreated without new evidence; a sticky device counts as cleared by hand."""
        with self._lock:
            self.owned.pop(key, None)
        self._admin_deleted[key] = self.clock()
        self._clear_sticky(rule)

    def _clear_sticky(self, rule: OwnedRule) -> None:
        if rule.uuid:
            # (a MIG device's uuid clears the GPU it lives on: the health engine maps it)
            self.health.clear_sticky(rule.uuid)

    def _node_kill_switch(self) -> bool:
        try:
            node = get_json(self.client, f"/api/v1/nodes/{self.node}", timeout=(3.0, 5.0))
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        value = ((node.get("metadata") or {}).get("labels") or {}).get(names.KILL_SWITCH_LABEL, "")
        return value.lower() == "disabled"

    def _count_cluster_gpus(self) -> None:
        """Cluster GPU count for the budget, from all ResourceSlices, every 10 minutes."""
        if time.monotonic() - self._cluster_gpus_at < 600:
            return
        try:
            version = self.slices.api_version if getattr(self.slices, "api_version", None) else "v1"
            total, cont = 0, None
            while True:
                q = {"limit": 500, **({"continue": cont} if cont else {})}
                out = get_json(self.client, f"/apis/resource.k8s.io/{version}/resourceslices", q, timeout=(3.0, 10.0))
                for s in out.get("items") or []:
                    spec = s.get("spec") or {}
                    if spec.get("driver") in ("gpu.nvidia.com", "gpu.amd.com", "gpu.intel.com"):
                        total += len(spec.get("devices") or [])
                cont = (out.get("metadata") or {}).get("continue")
                if not cont:
                    break
            self._cluster_gpus = total
        except ApiError as e:
            log.warning("cluster_gpu_count_failed", error=str(e))
        self._cluster_gpus_at = time.monotonic()

    def budget(self) -> int:
        cap = self.cfg.taint_budget_max
        if self._cluster_gpus is None:
            return cap
        return min(cap, max(1, math.floor(self.cfg.taint_budget_fraction * self._cluster_gpus)))

    # -- one pass ------------------------------------------------------------------------------
    def targets(self) -> list[Target]:
        devices = self.slices.devices() if self.slices is not None else {}
        with self._lock:
            index = self._index
        out = []
        for key, dev in sorted(devices.items()):
            res = resolve(key, dev, None, index)
            if res.ok:
                out.append(Target(driver=key[0], pool=key[1], device=key[2], uuid=res.uuid))
        return out

    def reconcile(self) -> None:
        if self.mode == TaintMode.OFF:
            return
        try:
            self._resync()
            supports_none = True if self.mode == TaintMode.DRY_RUN else self.rules.served().supports_none
            self.api_served = True if self.mode != TaintMode.DRY_RUN else self.api_served
        except TaintRulesUnavailable as e:
            self.api_served = False
            # Not a failure of this agent but what the cluster offers (the API is off by default before
            # 1.37): told once per agent start in an Event, a warning and the no_api
            # suppression, not as a failing collector on every node. Every pass looks again
            # (discovery is cached), so enabling the API later is picked up.
            self._announce_once(NO_API_KEY, Suppression.NO_API, f"GPU faults on this node get no DeviceTaintRule: {e}. Health is reported in metrics only.")
            return
        self._announced.discard((NO_API_KEY, Suppression.NO_API.value))  # served again: a later loss is news
        now = self.clock()
        health = self.health.all_health()
        parents = {i.uuid: i.parent_uuid for i in self._identities if i.is_partition}
        targets = self.targets()
        physical = [i for i in self._identities if not i.is_partition]
        fatal = [i for i in physical if (health.get(i.uuid) or DeviceHealth(i.uuid)).worst == Tier.FATAL]
        node_fault = len(physical) >= 2 and len(fatal) >= max(2, math.ceil(self.cfg.node_failure_fraction * len(physical)))
        window = self.cfg.taint_rate_window
        while self._noexecute_times and now - self._noexecute_times[0] > window:
            self._noexecute_times.popleft()
        budget = self.budget()
        self.budget_exhausted = self._cluster_noexecute >= budget
        if node_fault:
            self._announce_once(NODE_KEY, Suppression.NODE_FAULT, f"{len(fatal)} of {len(physical)} GPUs failed at once: treating it as a node problem, NoSchedule only")
        else:
            self._announced.discard((NODE_KEY, Suppression.NODE_FAULT.value))  # the episode is over

        covered: set[str] = set()
        for t in targets:
            covered.add(t.uuid)
            covered.add(parents.get(t.uuid, ""))
            h = effective_health(t.uuid, parents.get(t.uuid, ""), health)
            with self._lock:
                rule = self.owned.get(t.key)
            safety = Safety(
                kill_switch=self._kill_switch,
                rate_ok=len(self._noexecute_times) < self.cfg.taint_rate_limit,
                budget_ok=self._cluster_noexecute < budget,
                node_fault=node_fault,
                supports_none=supports_none,
            )
            d = decide(t, h, rule, self.mode, safety, self.cfg.taint_hold_seconds, now, self._admin_deleted.get(t.key))
            held = self._refused.get(t.key)
            if held is not None:
                if held[0] == (d.action, d.effect, d.tier) and now < held[1]:
                    continue  # refused before; asking again on every pass would only be refused again
                del self._refused[t.key]
            try:
                self._apply(t, h, rule, d, now)
            except ApiError as e:
                if e.retryable:
                    raise  # outage: the whole pass is retried with backoff
                # The server refused this one write (admission policy, validation, a changed
                # precondition): report it and go on, or one bad device would block every
                # device sorted after it on every pass.
                log.error("remediation_write_rejected", device=t.device, action=d.action, error=str(e), retry_in=REFUSED_RETRY)
                self._announce_once(t.key, Suppression.API_REJECTED, f"{t.device}: the API server refused to {d.action} its DeviceTaintRule: {e}")
                self._refused[t.key] = ((d.action, d.effect, d.tier), now + REFUSED_RETRY)
            except NameTaken as e:
                log.error("rule_name_taken", rule=str(e), device=t.device, retry_in=REFUSED_RETRY)
                self._refused[t.key] = ((d.action, d.effect, d.tier), now + REFUSED_RETRY)
                self._announce_once(t.key, Suppression.NAME_CONFLICT, f"{t.device}: a DeviceTaintRule named {e} exists and is not this agent's; left alone, so {t.uuid} is not tainted")
        self._retire_unpublished(now)
        if getattr(self.slices, "synced", True):
            # Before the first slice list every GPU would look device-plugin managed.
            self._device_plugin_notices(health, covered)

    def _retire_unpublished(self, now: float) -> None:
        """Rules for devices this node no longer publishes (MIG layout changed, driver gone)
        select nothing and would otherwise be orphaned forever; they go after the hold."""
        if self.slices is None or not getattr(self.slices, "synced", True):
            return
        published = set(self.slices.devices())
        with self._lock:
            owned = list(self.owned.items())
        for key, rule in owned:
            if key in published or not rule.managed:
                rule.gone_since = None
                continue
            if rule.gone_since is None:
                rule.gone_since = now
            if now - rule.gone_since < self.cfg.taint_hold_seconds or self._kill_switch:
                continue
            t = Target(driver=rule.driver, pool=rule.pool, device=rule.device, uuid=rule.uuid)
            try:
                self._delete(t, rule, Decision("delete", why="device_gone"))
            except ApiError as e:
                if e.retryable:
                    raise
                log.error("remediation_write_rejected", device=rule.device, action="delete", error=str(e))

    def _apply(self, t: Target, h: DeviceHealth, rule: OwnedRule | None, d: Decision, now: float) -> None:
        # node_fault is told once for the node (in reconcile), not once per device; an admin's
        # deletion is respected silently (ADMIN_DELETED is no Suppression).
        what = _suppression(d.suppressed)
        if what is not None and what != Suppression.NODE_FAULT and d.action in ("create", "update", "refresh", "nothing", "keep"):
            self._announce_once(t.key, what, f"{t.device}: {what.value.replace('_', ' ')} limits remediation of {h.worst.value if h.worst else 'healthy'} device {t.uuid}")
        if d.action in ("nothing", "keep"):
            if rule is not None and d.calm_since != rule.calm_since and d.action == "keep":
                rule.calm_since = d.calm_since
        elif d.action == "create":
            self._create(t, h, d, now)
        elif d.action == "update":
            self._update(t, rule, d, now)
        elif d.action == "refresh":
            self._refresh(t, rule, d, now)
        elif d.action == "delete":
            self._delete(t, rule, d)
        if not d.suppressed and self._announced:
            # Applied without any limit: this device's suppression episode (if any) is over and
            # a new one gets a new Event. (Not before the write: a write the server keeps
            # refusing must not be announced again on every pass.)
            self._announced = {tag for tag in self._announced if tag[0] != t.key}

    def _labels(self, tier: str, sticky: bool) -> dict:
        labels = {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: self.node, names.TIER_LABEL: tier}
        if sticky:
            # Only ever added by the agent; taking it off (or deleting the rule) is the person's
            # "cleared" (see _resync), so patches never remove it.
            labels[names.STICKY_LABEL] = "true"
        return labels

    def _annotations(self, t: Target, d: Decision, first_seen: float | None) -> dict:
        return {
            names.UUID_ANNOTATION: t.uuid,
            names.REASON_ANNOTATION: d.reason,
            names.EVIDENCE_ANNOTATION: d.evidence[:EVIDENCE_MAX],
            names.FIRST_SEEN_ANNOTATION: micro_time(first_seen or self.clock()),
        }

    def _first_seen(self, h: DeviceHealth, tier: str) -> float | None:
        times = [c.since for c in h.conditions if c.tier.value == tier]
        return min(times) if times else None

    def _create(self, t: Target, h: DeviceHealth, d: Decision, now: float) -> None:
        name = names.rule_name(self.node, t.driver, t.pool, t.device)
        key = f"{names.TAINT_DOMAIN}/{d.tier}"
        first = self._first_seen(h, d.tier)
        rule = OwnedRule(
            name=name, driver=t.driver, pool=t.pool, device=t.device, uuid=t.uuid, effect=d.effect, tier=d.tier, reason=d.reason,
            evidence=d.evidence[:EVIDENCE_MAX], sticky=d.sticky, created_at=now, refreshed_at=now,
        )
        if self.mode == TaintMode.DRY_RUN:
            rule.virtual = True
            with self._lock:
                self.owned[t.key] = rule
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=name, device=t.device, uuid=t.uuid, effect=d.effect, reason=d.reason)
            return
        body = self.rules.body(name, t.driver, t.pool, t.device, key, names.label_value(d.reason), d.effect, self._labels(d.tier, d.sticky), self._annotations(t, d, first))
        try:
            created = self.rules.create(body)
            self.actions["create"] += 1
        except ApiError as e:
            if e.status != 409:
                raise
            existing = self.rules.get(name)
            adopted = _rule_from_object(existing) if existing else None
            if adopted is None or (existing.get("metadata", {}).get("labels") or {}).get(names.MANAGED_BY) != names.MANAGED_BY_VALUE:
                raise NameTaken(name) from None
            with self._lock:
                self.owned[t.key] = adopted
            self.actions["adopt"] += 1
            log.info("rule_adopted_on_conflict", rule=name)
            # Typically our own earlier create whose answer was lost: it never got its Event.
            self._adopted_event(adopted, "it already existed when this agent tried to create it")
            self.poke()  # its effect may differ from what we want: next pass updates it
            return
        rule.uid = (created.get("metadata") or {}).get("uid", "")
        with self._lock:
            self.owned[t.key] = rule
        self._admin_deleted.pop(t.key, None)
        if d.effect == "NoExecute":
            self._noexecute_times.append(now)
            self._cluster_noexecute += 1
        if first is not None:
            self.latency.observe(max(0.0, self.clock() - first))
        log.warning("rule_created", rule=name, device=t.device, uuid=t.uuid, effect=d.effect, tier=d.tier, reason=d.reason, suppressed=d.suppressed or None)
        self.events.record(
            {"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": name},
            "GPUTainted",
            f"{t.driver}/{t.pool}/{t.device} ({t.uuid}) tainted {d.effect}: {d.tier} {d.reason}. {d.evidence}",
            "Taint",
            warning=True,
        )

    def _patch(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> bool:
        """Write ``d``'s effect, tier, reason, evidence and sticky mark onto the rule (one merge
        patch, same name and uid). False when the rule turned out to be gone."""
        patch = {
            "metadata": {
                # The sticky label only when newly marking: re-sending it would put back a label
                # a person removed since our last list (a merge patch without it leaves it be).
                "labels": self._labels(d.tier, d.sticky and not rule.sticky),
                "annotations": {names.REASON_ANNOTATION: d.reason, names.EVIDENCE_ANNOTATION: d.evidence[:EVIDENCE_MAX]},
            },
            "spec": {"taint": {"key": f"{names.TAINT_DOMAIN}/{d.tier}", "value": names.label_value(d.reason), "effect": d.effect}},
        }
        try:
            self.rules.patch(rule.name, patch)
        except ApiError as e:
            if e.status == 404:
                # Deleted behind our back since the last resync: an admin cleared it.
                log.warning("rule_deleted_by_someone_else", rule=rule.name, device=rule.device)
                self._deleted_by_someone(t.key, rule)
                return False
            raise
        rule.tier, rule.reason, rule.evidence, rule.refreshed_at = d.tier, d.reason, d.evidence[:EVIDENCE_MAX], now
        rule.sticky = rule.sticky or d.sticky
        return True

    def _refresh(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> None:
        """Same effect, newer record. Told in an Event when it says something new to a person
        (another reason, the device turned sticky); evidence-only refreshes are not."""
        if rule.virtual:
            rule.reason, rule.evidence, rule.sticky, rule.refreshed_at = d.reason, d.evidence[:EVIDENCE_MAX], rule.sticky or d.sticky, now
            return
        old_reason, was_sticky = rule.reason, rule.sticky
        if not self._patch(t, rule, d, now):
            return
        self.actions["refresh"] += 1
        log.info("rule_refreshed", rule=rule.name, device=t.device, reason=d.reason, sticky=rule.sticky)
        ref = {"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": rule.name}
        if rule.sticky and not was_sticky:
            self.events.record(ref, "GPUTaintSticky", f"{t.device} ({t.uuid}) failed too often: rule {rule.effect} stays until a person deletes it or removes its label {names.STICKY_LABEL}", "Taint", warning=True)
        elif d.reason != old_reason:
            self.events.record(ref, "GPUTaintUpdated", f"{t.device} ({t.uuid}) still {rule.effect}: reason {old_reason or 'unknown'} -> {d.reason}. {d.evidence}", "Taint")

    def _update(self, t: Target, rule: OwnedRule, d: Decision, now: float) -> None:
        if rule.virtual:
            rule.effect, rule.tier, rule.calm_since = d.effect, d.tier, None
            rule.reason, rule.evidence, rule.refreshed_at = d.reason, d.evidence[:EVIDENCE_MAX], now
            self.actions["dry_run"] += 1
            log.warning("taint_dry_run", rule=rule.name, device=t.device, effect=d.effect)
            return
        raising = EFFECT_RANK.get(d.effect, 0) > EFFECT_RANK.get(rule.effect, 0)
        old = rule.effect
        if not self._patch(t, rule, d, now):
            return
        rule.effect, rule.calm_since = d.effect, None
        self.actions["update"] += 1
        if d.effect == "NoExecute" and old != "NoExecute":
            self._noexecute_times.append(now)
            self._cluster_noexecute += 1
        elif old == "NoExecute" and d.effect != "NoExecute":
            self._cluster_noexecute = max(0, self._cluster_noexecute - 1)
        reason = "GPUTaintEscalated" if raising else "GPUTaintSteppedDown"
        log.warning("rule_updated", rule=rule.name, device=t.device, effect_from=old, effect_to=d.effect, tier=d.tier)
        self.events.record({"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": rule.name}, reason, f"{t.device} ({t.uuid}): {old} -> {d.effect} ({d.tier} {d.reason})".strip(), "Taint", warning=raising)

    def _delete(self, t: Target, rule: OwnedRule, d: Decision) -> None:
        with self._lock:
            self.owned.pop(t.key, None)
        if rule.virtual:
            self.actions["dry_run"] += 1
            return
        self.rules.delete(rule.name, rule.uid or None)
        self.actions["delete"] += 1
        if rule.effect == "NoExecute":
            self._cluster_noexecute = max(0, self._cluster_noexecute - 1)
        reason = "HardwareSwapDetected" if d.why == "hardware_swap" else "GPUUntainted"
        if d.why == "hardware_swap":
            note = f"{t.device}: the rule named GPU {rule.uuid}, the device is now {t.uuid}; rule removed"
        elif d.why == "device_gone":
            note = f"{t.device} ({t.uuid}) no longer published by this node for {self.cfg.taint_hold_seconds:g}s: rule removed"
        else:
            note = f"{t.device} ({t.uuid}) healthy for {self.cfg.taint_hold_seconds:g}s: rule removed"
        log.warning("rule_deleted", rule=rule.name, device=t.device, why=d.why)
        self.events.record({"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": rule.name}, reason, note, "Untaint")

    def _adopted_event(self, rule: OwnedRule, how: str) -> None:
        self.events.record(
            {"apiVersion": self.rules.api_version, "kind": "DeviceTaintRule", "name": rule.name},
            "GPUTaintAdopted",
            f"{rule.driver}/{rule.pool}/{rule.device} ({rule.uuid or 'unknown GPU'}): rule with effect {rule.effect} adopted: {how}",
            "Adopt",
        )

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
        if self.mode != TaintMode.DRY_RUN:
            self.events.record(node_ref(self.node), "HealthRemediationSuppressed", note, "Taint", warning=True)

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
            note = f"GPU {ident.uuid} ({ident.pci_bus_id}) is {state or 'healthy again'}" + (f": {h.conditions[0].reason}" if state else "") + "; not DRA-managed, so no DeviceTaintRule can select it"
            if self.mode != TaintMode.DRY_RUN:
                self.events.record(node_ref(self.node), "GPUUnhealthy" if state else "GPUHealthy", note, "Observe", warning=bool(state))

    # -- outputs -------------------------------------------------------------------------------
    def rule_views(self) -> tuple[TaintRuleView, ...]:
        with self._lock:
            return tuple(
                TaintRuleView(driver=r.driver, pool=r.pool, device=r.device, effect=r.effect, tier=r.tier)
                for r in sorted(self.owned.values(), key=lambda r: r.key)
                if not r.virtual
            )


def _suppression(value: str) -> Suppression | None:
    """The Suppression a decision carries, if any ("" and ADMIN_DELETED are none). Anything
    else must be a Suppression: a stray string raises here, in tests, not in a dashboard."""
    if not value or value == ADMIN_DELETED:
        return None
    return Suppression(value)
