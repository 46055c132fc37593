"""NVML events on the backend's event thread (:class:`NvmlEvents`).

One event set; XID, double/single-bit ECC, GPU-unavailable, recovery-action and MIG-change
events registered per full GPU (intersected with the types each supports);
``nvmlEventSetWait_v2(event_wait_ms)`` per turn of the thread base.EventThread runs. NVML
delivers a MIG device's XID on its parent with the GPU/compute instance ids, which map it to
the MIG device (:meth:`NvmlEvents.event_uuid`); a MIG change marks the layout stale before the
sink hears of it. A failed wait probes every GPU with ``nvmlDeviceGetUUID`` and reports
``GPU_LOST`` once per failing GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from ..base import EventSink, EventThread
from ..model import DeviceEvent, EventKind
from .abi import ERR_NOT_SUPPORTED, EVENT_KINDS, EVENT_MASK, NO_INSTANCE, address, pynvml
from .device import quiet
from .enumeration import DeviceRegistry

log = structlog.get_logger(__name__)


class NvmlEvents:
    def __init__(self, registry: DeviceRegistry, thread: EventThread, *, wait_ms: int,
                 on_mig_change: Callable[[], None]) -> None:
        self._registry = registry
        self._thread = thread
        self._wait_ms = wait_ms
        self._on_mig_change = on_mig_change
        self._event_set: Any = None
        self._handles: dict[int, str] = {}  # handle address -> full GPU uuid
        self._lost_reported: set[str] = set()

    def start(self, sink: EventSink) -> None:
        if self._thread.started:
            return
        self._registry.enumerate()
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("nvml_events_unavailable", error=str(exc))
            return
        registered: dict[int, str] = {}
        for d in self._registry.full_gpus():
            uuid = d.identity.uuid
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
            except pynvml.NVMLError as exc:
                log.warning("nvml_event_types_unavailable", uuid=uuid, error=str(exc))
                continue
            mask = EVENT_MASK & supported
            if not mask:
                log.info("nvml_events_not_supported", uuid=uuid)
                continue
            try:
                pynvml.nvmlDeviceRegisterEvents(d.handle, mask, es)
            except pynvml.NVMLError as exc:
                # NOT_SUPPORTED leaves the set usable (nvml.h); anything else is logged loudly,
                # the device is then only watched by polling.
                level = log.info if exc.value == ERR_NOT_SUPPORTED else log.error
                level("nvml_event_register_failed", uuid=uuid, mask=hex(mask), error=str(exc))
                continue
            registered[address(d.handle)] = uuid
        self._event_set = es
        self._handles = registered
        handles = dict(registered)
        self._thread.start(lambda: self._turn(es, sink, handles))
        log.info("nvml_events_started", devices=len(registered))

    def close(self) -> None:
        ended = self._thread.stop(self._wait_ms / 1000.0 + 2.0)
        if self._event_set is not None and ended:
            # Free only once the waiter has left: freeing a set another thread waits on is a
            # use-after-free in the C library.
            quiet(pynvml.nvmlEventSetFree, self._event_set)
            self._event_set = None

    # ---- the thread ----------------------------------------------------------------------------

    def _turn(self, es: Any, sink: EventSink, registered: dict[int, str]) -> None:
        try:
            data = pynvml.nvmlEventSetWait_v2(es, self._wait_ms)
        except pynvml.NVMLError_Timeout:
            return
        except pynvml.NVMLError as exc:
            # nvml.h: the wait returns GPU_IS_LOST when a GPU fell off the bus, without
            # saying which. Probe every registered GPU to find out.
            log.error("nvml_event_wait_failed", error=str(exc), code=getattr(exc, "value", None))
            self._probe_lost(sink)
            # Back off so a persistent error does not spin; returns at once on close().
            self._thread.wait(min(self._wait_ms / 1000.0, 1.0))
            return
        except Exception:
            log.exception("nvml_event_loop_error")
            self._thread.wait(1.0)
            return
        try:
            self._dispatch(data, sink, registered)
        except Exception:
            log.exception("nvml_event_dispatch_failed")

    def _dispatch(self, data: Any, sink: EventSink, registered: dict[int, str]) -> None:
        etype, code = int(data.eventType), int(data.eventData)
        parent = registered.get(address(data.device))
        if parent is None:
            log.warning("nvml_event_unknown_device", event_type=hex(etype), data=code)
            return
        uuid = self.event_uuid(parent, int(data.gpuInstanceId), int(data.computeInstanceId))
        for bit, kind in EVENT_KINDS.items():
            if not etype & bit:
                continue
            if kind is EventKind.MIG_CONFIG_CHANGE:
                self._on_mig_change()  # before the sink hears of it: its next enumerate() rescans
                uuid = parent
            # debug: a storm is thousands of events; the health engine logs what is news
            log.debug("nvml_event", uuid=uuid, kind=kind.value, code=code)
            _emit(sink, DeviceEvent(uuid=uuid, kind=kind,
                                    code=code if kind in (EventKind.XID, EventKind.RECOVERY_ACTION) else 0))

    def event_uuid(self, parent: str, gi: int, ci: int) -> str:
        """MIG events carry the GPU/compute instance ids; map them to the MIG device.

        ``c_nvmlEventData_t.gpuInstanceId``/``computeInstanceId`` are set only for an XID NVML
        can attribute to an instance (``0xFFFFFFFF`` otherwise): (parent, GI, CI) -> that MIG
        device; a valid GI without a valid CI -> the GI's only MIG device, or the GPU when the
        GI has several (the fault cannot be pinned on one compute instance)."""
        if gi == NO_INSTANCE:
            return parent
        migs = self._registry.migs_of(parent, gi)
        if not migs:
            return parent
        exact = [m for m in migs if m.compute_instance_id == ci]
        if exact:
            return exact[0].uuid
        return migs[0].uuid if len(migs) == 1 else parent

    def _probe_lost(self, sink: EventSink) -> None:
        for _address, uuid in list(self._handles.items()):
            dev = self._registry.get(uuid)
            if dev is None:
                continue
            try:
                pynvml.nvmlDeviceGetUUID(dev.handle)
            except pynvml.NVMLError as exc:
                if uuid in self._lost_reported:
                    continue
                self._lost_reported.add(uuid)
                log.error("nvml_gpu_lost", uuid=uuid, error=str(exc))
                _emit(sink, DeviceEvent(uuid=uuid, kind=EventKind.GPU_LOST, detail=str(exc)))
            else:
                self._lost_reported.discard(uuid)


def _emit(sink: EventSink, event: DeviceEvent) -> None:
    try:
        sink(event)
    except Exception:
        log.exception("nvml_event_sink_failed", uuid=event.uuid, kind=event.kind.value)
