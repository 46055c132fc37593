"""Per-device health: readings and events in, conditions out.

Two kinds of evidence:

* **Levels**, polled every cycle from readings: a lost or hung GPU, a recovery action asked by
  the driver, a row-remap failure or pending remap, growing uncorrectable ECC. A level
  condition holds while the state holds and clears only after the state has been clean for
  ``clear_hold`` seconds (hysteresis, so a flapping device does not flap its taint).
* **Events**, pushed by the device library (XIDs, double-bit ECC, GPU lost). A fatal event
  holds until a reset of the GPU has been observed and it has then been quiet for
  ``clear_hold``; a degraded one until it has been quiet for ``event_quiet``; an informational
  one expires after ``info_quiet``.

Scope: a fault is booked on the unit it takes down. Most faults are physical: an event on a MIG
instance is a fact about its GPU, and the GPU's conditions show on all its instances. An XID
that NVML attributes to one MIG instance and that is not GPU-wide by nature
(:func:`exporter.health.xid.xid_scope`) is booked, counted and escalated on that instance
alone (``Scope.INSTANCE``): its siblings and the parent stay healthy.

Repeats escalate: the same informational XID ``info_repeat`` times within ``repeat_window`` on
one device becomes degraded, a degraded condition seen ``degraded_repeat`` times becomes fatal.
Only the latest ``max(info_repeat, degraded_repeat)`` times of a reason are kept: that is all
escalation needs, so an XID storm costs no memory per event.
A GPU that goes unhealthy again ``sticky_after`` times within ``sticky_window`` is *sticky*: it
stays unhealthy until a person clears it (:meth:`HealthEngine.clear_sticky`).

Every time here, a condition's ``since`` and ``last_seen`` included, is the injected clock's
monotonic time (exporter/clock.py): a wall-clock step moves no hold or window. The demo runs
that clock faster than real time, and tests move it by hand, so no test sleeps.

Logs: an event that opens a condition or changes its tier is logged; repeats of a known
condition are counted and logged as one summary line per device at most every
``HealthEngine.repeat_log_interval`` seconds, so a storm of events is not a storm of log lines.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from ..clock import Clock
from ..devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, ReadError, RecoveryAction
from .model import Condition, DeviceHealth, Scope, Tier
from .stuck import StuckReadings
from .xid import classify_xid, xid_scope

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class HealthPolicy:
    clear_hold: float = 120.0
    event_quiet: float = 1800.0
    info_quiet: float = 600.0
    repeat_window: float = 86400.0
    info_repeat: int = 3
    degraded_repeat: int = 3
    sticky_after: int = 3
    sticky_window: float = 7 * 86400.0
    ecc_growth_tier: Tier = Tier.FATAL
    # reading_stuck: a reading that stops moving for this long while the device reports activity
    # (the energy counter flat while power > 0; every profiling ratio at exactly 0 while
    # utilization is at least ``stuck_busy_utilization``). 0 turns the check off. Ten minutes is
    # far beyond any legitimate flat stretch: NVML's energy counter moves by the watt-second and
    # is re-read every 10 s (exporter/devices/nvml/abi.py SLOW_FIELDS), so a busy GPU's counter that
    # stands still for minutes is frozen, not idle.
    stuck_after: float = 600.0
    stuck_busy_utilization: float = 0.5


@dataclass
class _EventCond:
    cond: Condition
    reset_seen: bool = False
    # Restored from a DeviceTaintRule for a polled state (gpu_lost, driver_hung, ...): clears
    # like a level, once the device has read clean for ``clear_hold`` after the restore.
    level: bool = False


@dataclass
class _DeviceState:
    levels: dict[str, Condition] = field(default_factory=dict)
    level_clean_since: dict[str, float] = field(default_factory=dict)
    events: dict[str, _EventCond] = field(default_factory=dict)
    history: dict[str, deque[float]] = field(default_factory=dict)  # reason -> latest times, capped
    quiet: Counter[str] = field(default_factory=Counter)  # repeats not logged yet, by reason
    quiet_since: float | None = None  # when the first of them came
    last_ecc_unc: int | None = None
    last_ok: bool | None = None
    last_error: ReadError | None = None  # why the previous reading failed
    was_healthy: bool = True
    failures: deque[float] = field(default_factory=deque)  # times the device went unhealthy
    sticky: bool = False
    sticky_note: str = ""  # why, when not from this process's failure history (see mark_sticky)
    sticky_instance: bool = False  # marked sticky as an instance-scoped fact (stays on the instance)
    last_reset: float | None = None
    ok_since: float | None = None  # first of the current run of successful readings
    stuck: StuckReadings = field(default_factory=StuckReadings)  # reading_stuck evidence (stuck.py)


Listener = Callable[[str], None]


class HealthEngine:
    repeat_log_interval = 60.0  # seconds between summary lines for one device's repeated events

    def __init__(self, clock: Clock, policy: HealthPolicy | None = None) -> None:
        self.clock = clock
        self.policy = policy or HealthPolicy()
        # Escalation only asks "were there N within the window?": the latest N times answer it.
        self._history_len = max(1, self.policy.info_repeat, self.policy.degraded_repeat)
        self._lock = threading.RLock()
        self._state: dict[str, _DeviceState] = defaultdict(_DeviceState)
        self._parents: dict[str, str] = {}
        self.xid_counts: Counter[tuple[str, int]] = Counter()
        self.read_errors: Counter[tuple[str, str]] = Counter()
        self._listeners: list[Listener] = []

    # -- wiring ------------------------------------------------------------------------------
    def subscribe(self, fn: Listener) -> None:
        """``fn(uuid)`` is called (outside the lock) whenever a device's health may have changed."""
        self._listeners.append(fn)

    def _notify(self, uuids: Iterable[str]) -> None:
        for u in uuids:
            for fn in self._listeners:
                try:
                    fn(u)
                except Exception:
                    log.exception("health_listener_failed", uuid=u)

    def set_topology(self, identities: Iterable[DeviceIdentity]) -> None:
        moved: list[str] = []
        with self._lock:
            self._parents = {i.uuid: i.parent_uuid for i in identities if i.is_partition}
            # A sticky mark made before the topology was known sits on an instance; it is a
            # fact about the GPU (and clearing the GPU must clear it).
            for child, parent in self._parents.items():
                st = self._state.get(child)
                if st is not None and st.sticky and not st.sticky_instance:
                    st.sticky = False
                    gpu = self._state[parent]
                    if not gpu.sticky:
                        gpu.sticky, gpu.sticky_note = True, st.sticky_note
                    moved.append(parent)
        if moved:
            self._notify(moved)

    def _physical(self, uuid: str) -> str:
        """Faults are physical: an event on a MIG instance is a fact about its GPU."""
        return self._parents.get(uuid, uuid)

    def _target(self, ev: DeviceEvent) -> tuple[str, Scope]:
        """The device an event is booked on. Only an XID can be instance-scoped: NVML attributes
        nothing else to a GPU/compute instance (nvmlEventData_t), and a reset, a lost GPU, a
        double-bit ECC error or a recovery action is about the GPU."""
        parent = self._parents.get(ev.uuid)
        if parent is not None and ev.kind == EventKind.XID and xid_scope(ev.code) == Scope.INSTANCE:
            return ev.uuid, Scope.INSTANCE
        return self._physical(ev.uuid), Scope.GPU

    def _children(self, uuid: str) -> list[str]:
        return [c for c, p in self._parents.items() if p == uuid]

    # -- evidence ----------------------------------------------------------------------------
    def on_event(self, ev: DeviceEvent) -> None:
        """Called from a backend's event thread."""
        now = self.clock.monotonic()
        reason, tier = "", None
        with self._lock:
            uuid, scope = self._target(ev)
            st = self._state[uuid]
            if ev.kind == EventKind.XID:
                self.xid_counts[(uuid, ev.code)] += 1
                reason = f"xid_{ev.code}"
                tier = self._event_condition(st, uuid, reason, classify_xid(ev.code), now,
                                             f"XID {ev.code} {ev.detail}".strip(), scope)
            elif ev.kind == EventKind.ECC_DBE:
                reason = "ecc_double_bit"
                tier = self._event_condition(st, uuid, reason, Tier.FATAL, now,
                                             "double-bit (uncorrectable) ECC error event")
            elif ev.kind == EventKind.GPU_LOST:
                reason = "gpu_lost_event"
                tier = self._event_condition(st, uuid, reason, Tier.FATAL, now, ev.detail or "GPU unavailable event")
            elif ev.kind == EventKind.RECOVERY_ACTION:
                ra = _recovery_tier(ev.code)
                if ra is not None:
                    reason = f"recovery_action_{_ra_name(ev.code)}"
                    tier = self._event_condition(st, uuid, reason, ra, now, f"driver asks for {_ra_name(ev.code)}")
            elif ev.kind == EventKind.RAS:
                reason = "ras_error"
                tier = self._event_condition(st, uuid, reason, Tier.DEGRADED, now, ev.detail or "RAS error event")
            elif ev.kind == EventKind.RESET:
                self._reset_gpu(uuid, now)
            self._update_transitions(uuid, st, now)
            # News (a new condition, a new tier, a reset) is logged at once; a repeat of what is
            # already known only counts towards the device's next summary line.
            news = tier is not None or ev.kind == EventKind.RESET
            summary = None
            if not news:
                st.quiet[reason or ev.kind.value] += 1
                if st.quiet_since is None:
                    st.quiet_since = now
                summary = self._take_summary(uuid, st, now)
        if news:
            extra = {"instance": ev.uuid} if ev.uuid != uuid else {}
            if scope == Scope.INSTANCE:
                extra["scope"] = scope.value
            log.info("device_event", uuid=uuid, kind=ev.kind.value, code=ev.code, reason=reason or None,
                     tier=tier.value if tier else None, **extra)
        if summary:
            log.info("device_events_repeated", **summary)
        self._notify([uuid])

    def _take_summary(self, uuid: str, st: _DeviceState, now: float) -> dict[str, Any] | None:
        """The device's summary line of repeated events, when one is due (and forget them)."""
        if not st.quiet or st.quiet_since is None or now - st.quiet_since < self.repeat_log_interval:
            return None
        out = {"uuid": uuid, "events": sum(st.quiet.values()), "by_reason": dict(st.quiet),
               "seconds": round(now - st.quiet_since, 1)}
        st.quiet = Counter()
        st.quiet_since = None
        return out

    def observe(self, identities: Iterable[DeviceIdentity], readings: Mapping[str, DeviceReading]) -> None:
        """Called once per cycle with the cycle's readings (full GPUs and instances)."""
        now = self.clock.monotonic()
        changed: list[str] = []
        summaries: list[dict[str, Any]] = []
        with self._lock:
            for uuid, st in self._state.items():  # repeats that have been quiet long enough to tell
                if st.quiet:
                    s = self._take_summary(uuid, st, now)
                    if s:
                        summaries.append(s)
            for ident in identities:
                if ident.is_partition:
                    # Physical state lives on the parent; an instance only has instance-scoped
                    # event conditions, which age with time (a recovery counts for stickiness).
                    ist = self._state.get(ident.uuid)
                    if ist is not None:
                        was_healthy = ist.was_healthy
                        self._update_transitions(ident.uuid, ist, now)
                        if ist.was_healthy != was_healthy:
                            changed.append(ident.uuid)
                    continue
                r = readings.get(ident.uuid)
                if r is None:
                    continue
                st = self._state[ident.uuid]
                before = self._health_locked(ident.uuid, now)
                self._observe_reading(ident.uuid, st, r, now)
                self._update_transitions(ident.uuid, st, now)
                if self._health_locked(ident.uuid, now) != before:
                    changed.append(ident.uuid)
        for s in summaries:
            log.info("device_events_repeated", **s)
        if changed:
            self._notify(changed)

    def _observe_reading(self, uuid: str, st: _DeviceState, r: DeviceReading, now: float) -> None:
        levels: dict[str, tuple[Tier, str]] = {}
        if not r.ok:
            self.read_errors[(uuid, (r.error or ReadError.ERROR).value)] += 1
            if r.error == ReadError.LATE:
                # No news about the device either way: its conditions neither start nor clear.
                return
            if r.error == ReadError.LOST:
                levels["gpu_lost"] = (Tier.FATAL, r.error_detail or "GPU is lost")
            elif r.error == ReadError.TIMEOUT:
                levels["driver_hung"] = (Tier.FATAL, r.error_detail or "driver call did not return")
            elif r.error == ReadError.UNKNOWN:
                levels["driver_error"] = (Tier.DEGRADED, r.error_detail or "driver returned an unknown error")
            # No reading, no verdict on the readings: a stuck streak starts again when they come back.
            st.stuck.forget(uuid)
        else:
            st.stuck.observe(uuid, r, now, self.policy.stuck_after, self.policy.stuck_busy_utilization)
            if st.last_ok is False and st.last_error in (ReadError.LOST, ReadError.GONE):
                # A lost device answers again: only a reset, reload or re-seat brings it back.
                # A hung or erroring call that returns later is no such evidence: it must not
                # release a fatal condition that waits for a reset.
                self._reset_gpu(uuid, now)
            ra = r.recovery_action
            tier = _recovery_tier(int(ra)) if ra is not None else None
            if ra is not None and tier is not None:
                levels[f"recovery_action_{_ra_name(int(ra))}"] = (tier, f"driver asks for {_ra_name(int(ra))}")
            if r.row_remap_failure:
                levels["row_remap_failure"] = (Tier.FATAL, "row remapping failed: no spare rows")
            if r.row_remap_pending:
                levels["row_remap_pending"] = (Tier.DEGRADED, "row remap pending: reset needed")
            if r.retired_pages_pending:
                levels["retired_pages_pending"] = (Tier.DEGRADED, "page retirement pending: reset needed")
            if r.ecc_uncorrectable_total is not None:
                if st.last_ecc_unc is not None and r.ecc_uncorrectable_total > st.last_ecc_unc:
                    grew = r.ecc_uncorrectable_total - st.last_ecc_unc
                    self._event_condition(st, uuid, "ecc_uncorrectable_growth", self.policy.ecc_growth_tier, now,
                                          f"uncorrectable ECC errors grew by {grew} to {r.ecc_uncorrectable_total}")
                st.last_ecc_unc = r.ecc_uncorrectable_total
        if r.ok and st.ok_since is None:
            st.ok_since = now
        elif not r.ok:
            st.ok_since = None
        st.last_ok = r.ok
        st.last_error = r.error if not r.ok else None

        for reason, (tier, evidence) in levels.items():
            old = st.levels.get(reason)
            restored = st.events.get(reason)
            if old is None and restored is not None and restored.level:
                # Seen again after a restart: the polled state takes over the restored record,
                # keeping when it was first seen.
                del st.events[reason]
                st.levels[reason] = replace(restored.cond, tier=max(tier, restored.cond.tier, key=lambda t: t.rank),
                                            evidence=evidence)
            elif old is None:
                st.levels[reason] = Condition(uuid=uuid, tier=tier, reason=reason, since=now, last_seen=now,
                                              evidence=evidence)
            elif reason in st.level_clean_since:
                # Back during the hold: a new occurrence, i.e. new evidence.
                st.levels[reason] = replace(old, tier=tier, last_seen=now, evidence=evidence, count=old.count + 1)
            else:
                # Still there: the same occurrence. last_seen stays at its start so that "new
                # evidence since an admin removed the rule" means a new occurrence, not one more poll.
                st.levels[reason] = replace(old, tier=tier, evidence=evidence)
            st.level_clean_since.pop(reason, None)
        for reason in list(st.levels):
            if reason in levels:
                continue
            clean = st.level_clean_since.setdefault(reason, now)
            if now - clean >= self.policy.clear_hold:
                del st.levels[reason]
                del st.level_clean_since[reason]
                log.info("condition_cleared", uuid=uuid, reason=reason)

    def _reset_gpu(self, uuid: str, now: float) -> None:
        """A GPU reset resets every MIG instance on it: instance-scoped conditions waiting for a
        reset see it too."""
        self._observe_reset(self._state[uuid], now)
        for child in self._children(uuid):
            st = self._state.get(child)
            if st is not None:
                self._observe_reset(st, now)

    def _observe_reset(self, st: _DeviceState, now: float) -> None:
        st.last_reset = now
        for ec in st.events.values():
            ec.reset_seen = True
        st.last_ecc_unc = None  # counters restart after a reset

    def _event_condition(self, st: _DeviceState, uuid: str, reason: str, tier: Tier, now: float, evidence: str,
                         scope: Scope = Scope.GPU) -> Tier | None:
        """Record one occurrence; return the condition's tier if it is news (a new condition, a
        new tier, the first since a reset), None for a repeat of what was known."""
        hist = st.history.get(reason)
        if hist is None:
            hist = st.history[reason] = deque(maxlen=self._history_len)
        while hist and now - hist[0] > self.policy.repeat_window:
            hist.popleft()
        more = len(hist) == hist.maxlen  # the oldest is pushed out while still in the window
        hist.append(now)
        times = f"{'over ' if more else ''}{len(hist)}x"
        if tier == Tier.INFORMATIONAL and len(hist) >= self.policy.info_repeat:
            tier, evidence = Tier.DEGRADED, f"{evidence} (repeated {times} in {self.policy.repeat_window / 3600:g}h)"
        elif tier == Tier.DEGRADED and len(hist) >= self.policy.degraded_repeat:
            tier, evidence = Tier.FATAL, f"{evidence} (repeated {times} in {self.policy.repeat_window / 3600:g}h)"
        old = st.events.get(reason)
        if old is not None and old.cond.tier.rank > tier.rank:
            tier = old.cond.tier  # never de-escalate on a repeat
        # A fatal event means the device needs a reset: it holds until one is observed.
        reset = tier == Tier.FATAL or (old is not None and old.cond.reset_required)
        cond = (
            replace(old.cond, tier=tier, last_seen=now, evidence=evidence, count=old.cond.count + 1,
                    reset_required=reset)
            if old
            else Condition(uuid=uuid, tier=tier, reason=reason, since=now, last_seen=now, evidence=evidence,
                           scope=scope, reset_required=reset)
        )
        st.events[reason] = _EventCond(cond=cond, reset_seen=False)
        # A repeat after a reset is news too: it re-arms a condition that was about to clear.
        return tier if old is None or old.cond.tier != tier or old.reset_seen else None

    def _expire_events(self, st: _DeviceState, now: float) -> None:
        p = self.policy
        for reason, ec in list(st.events.items()):
            quiet = now - ec.cond.last_seen
            t = ec.cond.tier
            if ec.level:
                done = st.ok_since is not None and now - max(st.ok_since, ec.cond.last_seen) >= p.clear_hold
            elif t == Tier.FATAL or ec.cond.reset_required:
                done = (ec.reset_seen and st.last_reset is not None and now - st.last_reset >= p.clear_hold
                        and st.last_reset >= ec.cond.last_seen)
            elif t == Tier.DEGRADED:
                done = quiet >= p.event_quiet or (
                    ec.reset_seen and st.last_reset is not None and now - st.last_reset >= p.clear_hold)
            else:
                done = quiet >= p.info_quiet
            if done:
                del st.events[reason]
                log.info("condition_cleared", uuid=ec.cond.uuid, reason=reason)

    def _update_transitions(self, uuid: str, st: _DeviceState, now: float) -> None:
        healthy = self._health_locked(uuid, now).healthy
        if st.was_healthy and not healthy:
            st.failures.append(now)
            while st.failures and now - st.failures[0] > self.policy.sticky_window:
                st.failures.popleft()
            if len(st.failures) >= self.policy.sticky_after and not st.sticky:
                st.sticky = True
                log.warning("device_sticky", uuid=uuid, failures=len(st.failures))
        st.was_healthy = healthy

    # -- results -----------------------------------------------------------------------------
    def _health_locked(self, uuid: str, now: float) -> DeviceHealth:
        st = self._state.get(uuid)
        if st is None:
            return DeviceHealth(uuid=uuid)
        self._expire_events(st, now)
        conds = list(st.levels.values()) + [ec.cond for ec in st.events.values()]
        if st.sticky and not any(c.tier != Tier.INFORMATIONAL for c in conds):
            first = min(st.failures) if st.failures else now
            evidence = (f"failed {len(st.failures)} times within {self.policy.sticky_window / 86400:g} days; clear by "
                        "hand")
            if st.sticky_note and len(st.failures) < self.policy.sticky_after:
                evidence = st.sticky_note
            scope = Scope.INSTANCE if uuid in self._parents else Scope.GPU
            conds.append(Condition(uuid=uuid, tier=Tier.FATAL, reason="repeated_failures", since=first, last_seen=now,
                                   evidence=evidence, count=len(st.failures), scope=scope))
        conds.sort(key=lambda c: (-c.tier.rank, c.reason))
        return DeviceHealth(uuid=uuid, conditions=tuple(conds), sticky=st.sticky, advisories=st.stuck.advisories())

    def counters(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, str], int]]:
        """Copies of the XID and read-error counters, taken under the lock (the event thread
        writes them)."""
        with self._lock:
            return dict(self.xid_counts), dict(self.read_errors)

    def health(self, uuid: str) -> DeviceHealth:
        with self._lock:
            return self._health_locked(uuid, self.clock.monotonic())

    def all_health(self) -> dict[str, DeviceHealth]:
        with self._lock:
            now = self.clock.monotonic()
            return {u: self._health_locked(u, now) for u in list(self._state)}

    def last_reset(self, uuid: str) -> float | None:
        with self._lock:
            st = self._state.get(uuid)
            return st.last_reset if st else None

    def mark_sticky(self, uuid: str, note: str, scope: Scope = Scope.GPU) -> None:
        """Sticky without this process having seen the failures: the failure history lives
        in memory, so after a restart the sticky label on the device's DeviceTaintRule is the
        record. ``note`` becomes the condition's evidence. A MIG instance marks its GPU, unless
        ``scope`` is ``Scope.INSTANCE`` (the instance failed too often on its own)."""
        with self._lock:
            instance = scope == Scope.INSTANCE
            uuid = uuid if instance else self._physical(uuid)
            st = self._state[uuid]
            if st.sticky:
                return
            st.sticky, st.sticky_note, st.sticky_instance = True, note, instance
            log.warning("device_sticky", uuid=uuid, note=note)
        self._notify([uuid])

    def restore(self, uuid: str, reason: str, tier: Tier, since: float, evidence: str, reset_required: bool,
                scope: Scope | None = None) -> None:
        """Re-create a condition read back from a DeviceTaintRule after a restart.

        ``uuid`` is the device the rule is about. ``scope`` None: an instance's uuid restores an
        instance-scoped condition when the topology knows it as an instance (else it is booked
        on the GPU, as the GPU's own rule would). ``reset_required``: the condition holds until
        a reset of the GPU is observed after the restore, then the usual ``clear_hold``; without
        it a polled state (gpu_lost, driver_hung, ...) clears once the device has read clean for
        ``clear_hold``, and an event condition ages as a fresh one would. Evidence seen again
        merges with the restored condition (keeping the earlier ``since``)."""
        with self._lock:
            now = self.clock.monotonic()
            if scope is None:
                on_instance = reason.startswith("xid_") and xid_scope(_xid_code(reason)) == Scope.INSTANCE
                scope = Scope.INSTANCE if uuid in self._parents and on_instance else Scope.GPU
            target = uuid if scope == Scope.INSTANCE else self._physical(uuid)
            st = self._state[target]
            old_level = st.levels.get(reason)
            old = st.events.get(reason)
            if old_level is not None:
                # The state is already observed again: it keeps the restored start and tier.
                st.levels[reason] = replace(old_level, since=min(since, old_level.since),
                                            tier=max(tier, old_level.tier, key=lambda t: t.rank))
            else:
                cond = Condition(uuid=target, tier=tier, reason=reason, since=since, last_seen=now, evidence=evidence,
                                 scope=scope, reset_required=reset_required)
                if old is not None:
                    cond = replace(
                        old.cond,
                        tier=max(tier, old.cond.tier, key=lambda t: t.rank),
                        since=min(since, old.cond.since),
                        reset_required=reset_required or old.cond.reset_required,
                    )
                st.events[reason] = _EventCond(cond=cond, reset_seen=False,
                                               level=not reset_required and _is_level(reason))
            self._update_transitions(target, st, now)
        log.info("condition_restored", uuid=target, reason=reason, tier=tier.value, scope=scope.value,
                 reset_required=reset_required)
        self._notify([target])

    def reset_proven(self, uuid: str, why: str) -> None:
        """A reset of the GPU that this process did not see but the remediator proved (the node
        rebooted since a rule's fault was recorded): booked as a reset observed now, so conditions
        waiting for one clear after their clear time, counted from now."""
        with self._lock:
            now = self.clock.monotonic()
            uuid = self._physical(uuid)
            self._reset_gpu(uuid, now)
            self._update_transitions(uuid, self._state[uuid], now)
        log.warning("gpu_reset_proven", uuid=uuid, why=why)
        self._notify([uuid])

    def clear_sticky(self, uuid: str) -> None:
        """A person cleared the device. A MIG instance's uuid clears its GPU (and anything
        left on the instance itself)."""
        with self._lock:
            uuids = list(dict.fromkeys((uuid, self._physical(uuid))))
            for u in uuids:
                st = self._state.get(u)
                if st is not None and st.sticky:
                    st.sticky = False
                    st.sticky_note = ""
                    st.sticky_instance = False
                    st.failures.clear()
                    log.info("sticky_cleared", uuid=u)
        self._notify(uuids)


# Conditions that come from polled state (see _observe_reading), as opposed to events.
LEVEL_REASONS = frozenset({"gpu_lost", "driver_hung", "driver_error", "row_remap_failure", "row_remap_pending",
                           "retired_pages_pending"})


def _is_level(reason: str) -> bool:
    return reason in LEVEL_REASONS or reason.startswith("recovery_action_")


def _xid_code(reason: str) -> int:
    try:
        return int(reason.removeprefix("xid_"))
    except ValueError:
        return -1


def _ra_name(code: int) -> str:
    try:
        return RecoveryAction(code).name.lower()
    except ValueError:
        return f"unknown_{code}"


def _recovery_tier(code: int) -> Tier | None:
    if code == RecoveryAction.NONE:
        return None
    if code in (RecoveryAction.GPU_RESET, RecoveryAction.DRAIN_AND_RESET, RecoveryAction.NODE_REBOOT):
        return Tier.FATAL
    return Tier.DEGRADED
