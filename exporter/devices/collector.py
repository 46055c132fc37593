"""The devices collector: a backend's enumeration and reads, each under a deadline.

What a cycle's device data means lives here, beside the backends: which calls missed their
deadline, and whether a missed deadline is evidence against the device (a call truly stuck for
``--hung-after`` while the agent got CPU: ``timeout``, which the health engine turns into
``driver_hung``) or not (the agent starved, the call never started: ``late``, no verdict).
The collector also starts the backend: open, the first enumeration handed to the health
engine (an instance's XID counts against its GPU from the very first event), then the event
thread delivering into it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from ..collect import Collector, Gathered, Slot
from .base import DeviceBackend
from .deadline import CallHung, DeadlineRunner
from .model import DeviceEvent, DeviceIdentity, DeviceReading, ReadError

log = structlog.get_logger(__name__)

__all__ = ["DEVICES", "DeviceCollector", "DeviceScan"]


@dataclass(frozen=True)
class DeviceScan:
    """The devices enumerated and their readings (a failed read is a failed DeviceReading)."""

    identities: tuple[DeviceIdentity, ...]
    readings: Mapping[str, DeviceReading]


DEVICES: Slot[DeviceScan] = Slot("devices")


class HealthSink(Protocol):
    """Where device events go (exporter.health.engine.HealthEngine)."""

    def set_topology(self, identities: Iterable[DeviceIdentity]) -> None: ...
    def on_event(self, ev: DeviceEvent) -> None: ...


class Starvation(Protocol):
    """The agent's own CPU starvation (exporter.health.starvation.StarvationMonitor)."""

    def note_unstarted(self, lane: str) -> None: ...
    def state(self) -> StarvedState: ...


class StarvedState(Protocol):
    @property
    def starved(self) -> bool: ...
    @property
    def reason(self) -> str: ...


class DeviceCollector(Collector[DeviceScan]):
    """Enumerate, then read every device on the backend under ``call_timeout`` each."""

    # A failed enumeration tells nothing about single GPUs: the last scan stands for as long
    # as it fails (the collector reports the failure; /readyz goes unready past three intervals).
    keep_for = float("inf")

    def __init__(self, backend: DeviceBackend, health: HealthSink, starvation: Starvation, *, call_timeout: float,
                 hung_after: float) -> None:
        super().__init__(DEVICES)
        self.backend = backend
        self._health = health
        self._starvation = starvation
        self.call_timeout = call_timeout
        self.hung_after = hung_after
        self.runner = DeadlineRunner()
        self._identities: tuple[DeviceIdentity, ...] = ()
        self._readings: Mapping[str, DeviceReading] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.backend.open()
        # The health engine must know which MIG instance lives on which GPU before the first
        # event can arrive: an instance's XID counts against its GPU. The first cycle would
        # tell it, but events start now. Same deadline lane as the cycle's enumerate; on any
        # failure the first cycle reports it and sets the topology.
        try:
            self._health.set_topology(self.runner.call("enumerate", self.backend.enumerate, self.call_timeout))
        except Exception as e:
            log.warning("early_enumerate_failed", error=str(e))
        self.backend.start_events(self._health.on_event)

    def stop(self) -> None:
        self.backend.close()
        self.runner.close()

    @property
    def count(self) -> int:
        """Devices enumerated by the last successful enumeration."""
        return len(self._identities)

    def heartbeat(self) -> float | None:
        """The event thread's latest turn (``time.monotonic()``), None without one: liveness."""
        return self.backend.event_heartbeat()

    def problems(self) -> list[str]:
        hung = self.runner.hung_lanes()
        if not hung:
            return []
        out = []
        stuck = {k: self.runner.running_for(k) for k in hung}
        long = {k: v for k, v in hung.items() if (stuck[k] or 0.0) >= self.hung_after}
        slow = {k: v for k, v in hung.items() if k not in long}
        if long:
            out.append("hung device calls: " + ", ".join(f"{k} ({v:.0f}s)" for k, v in sorted(long.items())))
        if slow:
            out.append(
                f"slow device calls (hung after {self.hung_after:g}s): "
                + ", ".join(f"{k} ({v:.0f}s)" for k, v in sorted(slow.items()))
            )
        return out

    # -- one cycle ---------------------------------------------------------------------------
    def collect(self, found: Gathered) -> DeviceScan:
        backend = self.backend
        try:
            idents = tuple(self.runner.call("enumerate", backend.enumerate, self.call_timeout))
        except CallHung as e:
            if e.running_for is None:
                self._starvation.note_unstarted("enumerate")
            raise
        if [i.uuid for i in idents] != [i.uuid for i in self._identities]:
            gone = {i.uuid for i in self._identities} - {i.uuid for i in idents}
            for u in gone:
                self.runner.retire(u)
            log.info("devices_enumerated", count=len(idents), gone=sorted(gone))
            self._identities = idents
        readings: dict[str, DeviceReading] = {}
        # Devices are read one after another, each under its own deadline, on one shared worker
        # until one hangs: that device then keeps a lane of its own, which fails fast while its
        # call is stuck, so a hung device costs one deadline, and only its own reads.
        results = self.runner.call_each([(i.uuid, functools.partial(backend.read, i)) for i in idents],
                                        self.call_timeout)
        for ident, res in zip(idents, results, strict=True):
            if isinstance(res, CallHung):
                readings[ident.uuid] = self._missed_deadline(ident.uuid, res)
            elif isinstance(res, Exception):  # a backend bug on one device must not cost the others
                log.error("device_read_failed", uuid=ident.uuid, exc_info=res)
                readings[ident.uuid] = DeviceReading.failed(ident.uuid, ReadError.ERROR, str(res))
            elif isinstance(res, BaseException):
                raise res
            else:
                readings[ident.uuid] = res
        for ident in idents:
            r = readings[ident.uuid]
            prev = self._readings.get(ident.uuid)
            if not r.ok and (prev is None or prev.ok or prev.error != r.error):
                log.warning("device_unreadable", uuid=ident.uuid, error=r.error.value if r.error else "",
                            detail=r.error_detail)
            elif r.ok and prev is not None and not prev.ok:
                log.info("device_readable_again", uuid=ident.uuid)
        self._readings = readings
        return DeviceScan(idents, readings)

    def _missed_deadline(self, uuid: str, e: CallHung) -> DeviceReading:
        """A read that missed its deadline: evidence against the device only when the call has
        been running on its lane for ``--hung-after`` while the agent itself got CPU; else the
        reading is ``late`` (no data, no condition)."""
        if e.running_for is None:
            self._starvation.note_unstarted(uuid)
        hung_after = self.hung_after
        starved = self._starvation.state()
        if e.running_for is not None and e.running_for >= hung_after and not starved.starved:
            return DeviceReading.failed(uuid, ReadError.TIMEOUT,
                                        f"{e}; stuck for {e.running_for:.1f}s (hung after {hung_after:g}s)")
        if starved.starved:
            why = f"the agent is starved of CPU ({starved.reason})"
        elif e.running_for is None:
            why = "the call never started"
        else:
            why = f"stuck for {e.running_for:.1f}s, driver_hung after {hung_after:g}s"
        return DeviceReading.failed(uuid, ReadError.LATE, f"{e}: {why}")
