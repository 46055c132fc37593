"""Simulated device backend: GPUs from a scenario, with scripted faults.

It behaves like a vendor library where that matters for the rest of the agent: a lost GPU fails
its reads, a hung call really blocks (so the deadline runner is exercised), XIDs arrive on an
event thread at their scheduled time, and MIG parents report no utilization of their own.
Simulated time runs ``time_scale`` times faster than real time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from exporter.devices.base import DeviceBackend, EventSink, EventThread
from exporter.devices.model import (
    DeviceEvent,
    DeviceIdentity,
    DeviceReading,
    EventKind,
    ReadError,
    RecoveryAction,
    Vendor,
)

from .scenario import Fault, GpuSpec, MigSpec, Scenario

log = structlog.get_logger(__name__)

# scripted fault kinds that a vendor library would report as events
_EVENT_KINDS = {
    "xid": EventKind.XID,
    "lost": EventKind.GPU_LOST,
    "reset": EventKind.RESET,
    "recovery_action": EventKind.RECOVERY_ACTION,
    "ecc_uncorrectable": EventKind.ECC_DBE,
}


class SimClock:
    """Simulated seconds since start, running ``scale`` times faster than the wall clock.

    Tests can hold simulated time still (``pause``), move it forward (``advance_to``) and let it
    run again (``resume``): a scripted state then lasts for as long as the test looks at it, on
    any machine, instead of for a window of real time."""

    def __init__(self, scale: float = 1.0, start_offset: float = 0.0) -> None:
        self.scale = scale
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._epoch0 = time.time()
        self._start = start_offset  # the simulated instant of _epoch0
        self._offset = start_offset  # the simulated instant of _t0
        self._paused = False
        self._wall_step = 0.0  # what step_wall moved the wall clock by, in all
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after pause, resume and advance_to (a thread waiting for a simulated
        instant recomputes its wait)."""
        with self._lock:
            self._listeners.append(fn)

    def _changed(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def now(self) -> float:
        with self._lock:
            return self._now()

    def _now(self) -> float:
        if self._paused:
            return self._offset
        return self._offset + (time.monotonic() - self._t0) * self.scale

    def pause(self) -> None:
        """Hold simulated time where it is until ``resume``."""
        with self._lock:
            if not self._paused:
                self._offset, self._paused = self._now(), True
        self._changed()

    def resume(self, scale: float | None = None) -> None:
        """Let simulated time run again, at ``scale`` when given."""
        with self._lock:
            if not self._paused:
                self._offset, self._t0 = self._now(), time.monotonic()
            if scale is not None:
                self.scale = scale
            self._t0, self._paused = time.monotonic(), False
        self._changed()

    def advance_to(self, sim_t: float) -> None:
        """Jump forward to ``sim_t`` (no-op if already later); paused or running as before."""
        with self._lock:
            now = self._now()
            if sim_t > now:
                self._offset += sim_t - now
        self._changed()

    def epoch(self, sim_t: float | None = None) -> float:
        """Wall-clock-like timestamp (seconds since 1970) of a simulated instant."""
        t = self.now() if sim_t is None else sim_t
        return self._epoch0 + (t - self._start)

    def real_seconds(self, sim_seconds: float) -> float:
        return max(0.0, sim_seconds / self.scale)

    # -- exporter.clock.Clock: simulated time is the agent's monotonic clock --------------------
    def monotonic(self) -> float:
        return self.now()

    def wall(self) -> float:
        """The node's wall clock: the simulated instant's epoch stamp plus every ``step_wall``."""
        return self.epoch() + self._wall_step

    def step_wall(self, seconds: float) -> None:
        """Step the node's wall clock by ``seconds`` (NTP, an operator) while monotonic time
        runs on: what the agent measures as a duration must not move."""
        with self._lock:
            self._wall_step += seconds
        self._changed()


@dataclass
class _Energy:
    t: float = 0.0
    joules: float = 0.0


class SimBackend(DeviceBackend):
    name = "sim"

    def __init__(self, scenario: Scenario, clock: SimClock | None = None) -> None:
        self.scenario = scenario
        self.clock = clock or SimClock()
        # The event thread's scaffolding is the vendors' (base.EventThread). No heartbeat: the
        # thread sleeps until the next scripted fault, however far away, which is not a stall.
        self._events: EventThread = EventThread("sim-events", heartbeat=False)
        self._stop = self._events.stop_event  # close() also ends the hangs read() is scripted into
        self._wake = threading.Condition()
        self.clock.on_change(self._clock_changed)
        self._injected: deque[DeviceEvent] = deque()
        self._energy: dict[str, _Energy] = {}
        self._identities: list[DeviceIdentity] = []
        self._by_uuid: dict[str, tuple[GpuSpec, MigSpec | None]] = {}

    # -- DeviceBackend -----------------------------------------------------------------------
    def open(self) -> None:
        ids: list[DeviceIdentity] = []
        for idx, g in enumerate(self.scenario.gpus):
            ids.append(
                DeviceIdentity(
                    uuid=g.uuid,
                    vendor=Vendor.NVIDIA,
                    model=g.model,
                    pci_bus_id=g.pci_bus_id,
                    index=idx,
                    minor=g.minor,
                    driver_version=self.scenario.driver_version,
                    serial=f"SIM{g.minor:09d}",
                    memory_total_bytes=g.memory_bytes,
                )
            )
            self._by_uuid[g.uuid] = (g, None)
            for j, m in enumerate(g.mig):
                ids.append(
                    DeviceIdentity(
                        uuid=m.uuid,
                        vendor=Vendor.NVIDIA,
                        model=f"{g.model} MIG {m.profile}",
                        pci_bus_id=g.pci_bus_id,
                        index=j,
                        minor=g.minor,
                        driver_version=self.scenario.driver_version,
                        parent_uuid=g.uuid,
                        mig_profile=m.profile,
                        gpu_instance_id=m.placement_start + 1,
                        compute_instance_id=0,
                        gi_profile_id=m.gi_profile_id,
                        placement_start=m.placement_start,
                        memory_total_bytes=m.memory_bytes,
                    )
                )
                self._by_uuid[m.uuid] = (g, m)
        self._identities = ids

    def enumerate(self) -> list[DeviceIdentity]:
        return list(self._identities)

    def driver_version(self) -> str:
        return self.scenario.driver_version

    def read(self, device: DeviceIdentity) -> DeviceReading:
        g, mig = self._by_uuid[device.uuid]
        t = self.clock.now()
        active = self._active(g.name, t)
        hang = active.get("hang")
        if hang is not None:
            # Block like a wedged driver call would, until the scripted hang ends or we stop.
            end = hang.until if hang.until is not None else float("inf")
            self._stop.wait(self.clock.real_seconds(end - t) if end != float("inf") else None)
            t = self.clock.now()
            active = self._active(g.name, t)
        if "lost" in active:
            return DeviceReading.failed(device.uuid, ReadError.LOST, "GPU has fallen off the bus (simulated)")

        r = DeviceReading(uuid=device.uuid, timestamp=self.clock.epoch(t))
        r.ecc_uncorrectable_total = self._ecc_uncorrectable(g.name, t)
        r.ecc_correctable_total = int(t // 600)  # a slow trickle, as on real HBM
        if mig is not None:
            util = mig.utilization.at(t)
            r.utilization_ratio = None  # NVML: utilization rates unsupported on MIG
            r.sm_active_ratio = util
            r.memory_total_bytes = mig.memory_bytes
            r.memory_used_bytes = int(mig.memory_bytes * mig.memory_used.at(t))
            return r

        if g.mig:
            # A MIG parent has no utilization of its own in NVML; its activity (and so its power)
            # is the instances' activity weighted by their share of the GPU's memory.
            util = sum(m.utilization.at(t) * m.memory_bytes for m in g.mig) / g.memory_bytes
            r.memory_used_bytes = sum(int(m.memory_bytes * m.memory_used.at(t)) for m in g.mig)
            r.utilization_ratio = None
            r.sm_active_ratio = util
        else:
            util = g.utilization.at(t)
            r.utilization_ratio = util
            r.sm_active_ratio = util * 0.9
            r.tensor_active_ratio = util * 0.6
            r.dram_active_ratio = util * 0.4
            r.memory_used_bytes = int(g.memory_bytes * g.memory_used.at(t))
        r.memory_total_bytes = g.memory_bytes
        power = g.idle_power_watts + (g.power_limit_watts - g.idle_power_watts) * util
        r.power_watts = round(power, 3)
        r.energy_joules = self._integrate_energy(g.uuid, t, power)
        r.temperature_celsius = round(g.temperature_base + 45.0 * util, 1)
        r.memory_temperature_celsius = round(g.temperature_base + 30.0 * util, 1)
        r.sm_clock_hertz = (1155 + 825 * util) * 1e6
        r.memory_clock_hertz = 2619e6
        r.clock_event_reasons = 0x1 if util < 0.05 else 0x0
        # NVML's throttle-time counters: held below target 2 % of the time by power, 10 % by
        # low utilization (stateless, so monotonic in simulated time)
        power_s, idle_s = round(t * 0.02, 3), round(t * 0.1, 3)
        quiet = ("thermal", "sync_boost", "board_limit", "reliability", "total_base_clocks")
        r.throttle_seconds = dict.fromkeys(quiet, 0.0)
        r.throttle_seconds.update(power=power_s, low_utilization=idle_s, total_app_clocks=power_s + idle_s)
        r.pcie_replay_total = 0
        r.retired_pages_total = 0
        r.retired_pages_pending = False
        r.remapped_rows_correctable = 0
        r.remapped_rows_uncorrectable = 0
        r.row_remap_pending = "row_remap_pending" in active
        r.row_remap_failure = "row_remap_failure" in active
        ra = active.get("recovery_action")
        r.recovery_action = RecoveryAction(ra.code) if ra else RecoveryAction.NONE
        return r

    def start_events(self, sink: EventSink) -> None:
        # "From now on" is decided here, not when the thread gets to run: at a high time scale
        # a late thread start would otherwise skip the first events.
        start = self.clock.now()
        pending = deque(f for f in self.scenario.faults if f.kind in _EVENT_KINDS and f.at >= start)
        self._events.start(lambda: self._event_turn(sink, pending))

    def inject(self, events: Iterable[DeviceEvent]) -> None:
        """Queue events for delivery on the event thread, in order, as a vendor library's
        event wait would hand them over: unscripted ones (storms, events for devices this
        backend does not know, events on MIG instances). Delivered once :meth:`start_events`
        has a sink; the caller returns at once."""
        with self._wake:
            self._injected.extend(events)
            self._wake.notify()

    def close(self) -> None:
        self._events.request_stop()
        with self._wake:
            self._wake.notify()
        self._events.join(2.0)

    # -- internals ---------------------------------------------------------------------------
    def _clock_changed(self) -> None:
        """Simulated time was paused, resumed or moved: the event thread recomputes its wait."""
        with self._wake:
            self._wake.notify()

    def _active(self, gpu: str, t: float) -> dict[str, Fault]:
        """Faults in effect on ``gpu`` at simulated time ``t`` (latest of each kind wins).

        A ``reset`` ends every earlier fault on the GPU, as a real reset clears a lost GPU,
        a pending remap and the recovery action.
        """
        out: dict[str, Fault] = {}
        for f in self.scenario.faults:
            if f.gpu != gpu or f.at > t:
                continue
            if f.kind == "reset":
                out.clear()
                continue
            if f.kind == "xid":
                continue
            if f.until is not None and t >= f.until:
                continue
            out[f.kind] = f
        return out

    def _ecc_uncorrectable(self, gpu: str, t: float) -> int:
        """Uncorrectable ECC errors since the GPU's last reset.

        Each ``ecc_uncorrectable`` fault adds ``rate_per_minute`` for every minute it is active;
        at its ``until`` the errors stop but the count stays (an error counter never goes
        back), and only a reset zeroes it, as a reset clears NVML's volatile counters.
        """
        total = 0.0
        for f in self.scenario.faults:  # sorted by time
            if f.gpu != gpu or f.at > t:
                continue
            if f.kind == "reset":
                total = 0.0
            elif f.kind == "ecc_uncorrectable":
                end = t if f.until is None else min(t, f.until)
                total += f.rate_per_minute * (end - f.at) / 60.0
        return int(total)

    def _integrate_energy(self, uuid: str, t: float, watts: float) -> float:
        e = self._energy.setdefault(uuid, _Energy(t=t))
        if t > e.t:
            e.joules += watts * (t - e.t)
            e.t = t
        return round(e.joules, 3)

    def _event_turn(self, sink: EventSink, pending: deque[Fault]) -> None:
        stopping = self._events.stopping
        with self._wake:
            if not self._injected and not stopping():
                # Until the next scripted fault is due (or forever), or until inject() or
                # close() wakes us. Capped: a clock that barely moves would ask for a wait
                # longer than a lock accepts.
                self._wake.wait(min(3600.0,
                                    self.clock.real_seconds(pending[0].at - self.clock.now())) if pending else None)
            batch, self._injected = self._injected, deque()
        while batch and not stopping():
            self._deliver(sink, batch.popleft())  # popped: a delivered event is not kept
        while pending and pending[0].at <= self.clock.now() and not stopping():
            f = pending.popleft()
            uuid = self.scenario.gpu(f.gpu).uuid
            ev = DeviceEvent(uuid=uuid, kind=_EVENT_KINDS[f.kind], code=f.code, timestamp=self.clock.epoch(f.at),
                             detail=f"scripted {f.kind}")
            log.info("sim_event", uuid=uuid, kind=ev.kind.value, code=f.code, sim_t=round(f.at, 1))
            self._deliver(sink, ev)

    @staticmethod
    def _deliver(sink: EventSink, ev: DeviceEvent) -> None:
        try:
            sink(ev)
        except Exception:  # the sink belongs to the health engine; never let it kill us
            log.exception("event_sink_failed", uuid=ev.uuid)
