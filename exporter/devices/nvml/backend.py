"""The NVIDIA backend: lifecycle, and the seams between enumeration, reading and events."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from ..base import BackendUnavailable, DeviceBackend, EventSink, EventThread
from ..model import DeviceIdentity, DeviceReading, ReadError
from .abi import ERR_GPU_IS_LOST, ERR_INVALID_ARGUMENT, ERR_UNKNOWN, pynvml
from .device import CallFailed, Calls, NvmlDevice, quiet
from .enumeration import DeviceRegistry
from .events import NvmlEvents
from .readers import BATCH_LOCK

log = structlog.get_logger(__name__)


class NvmlBackend(DeviceBackend):
    name = "nvml"

    def __init__(
        self,
        *,
        event_wait_ms: int = 1000,
        lock_timeout_s: float = 1.0,
        processes: bool = True,
        gpm: bool = True,
        slow_counter_period_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock_timeout_s = lock_timeout_s
        self._opened = False
        self._registry = DeviceRegistry(gpm=gpm, processes=processes)
        self._calls = Calls(clock=clock, slow_period=slow_counter_period_s, lock_timeout_s=lock_timeout_s)
        self._events: EventThread = EventThread("nvml-events")
        self._nvml_events = NvmlEvents(self._registry, self._events, wait_ms=event_wait_ms,
                                       on_mig_change=self.invalidate)

    # ---- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        if pynvml is None:
            raise BackendUnavailable("nvidia-ml-py (pynvml) is not importable")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise BackendUnavailable(f"NVML library libnvidia-ml.so.1 not found: {exc}") from exc
        except pynvml.NVMLError_DriverNotLoaded as exc:
            raise BackendUnavailable(f"NVIDIA driver is not loaded: {exc}") from exc
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"nvmlInit failed: {exc} (code {getattr(exc, 'value', '?')})") from exc
        except OSError as exc:  # pragma: no cover - pynvml converts load errors, belt and braces
            raise BackendUnavailable(f"cannot load NVML: {exc}") from exc
        self._opened = True
        try:
            self._registry.driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            log.warning("nvml_driver_version_failed", error=str(exc))
        log.info("nvml_opened", driver_version=self._registry.driver_version)

    def close(self) -> None:
        self._nvml_events.close()
        # Every GPM call runs under BATCH_LOCK, so holding it means no sample is in use. If a
        # stuck call holds it, leak the samples rather than free memory the driver may touch.
        if BATCH_LOCK.acquire(timeout=self._lock_timeout_s):
            try:
                for s in self._registry.take_gpm_samples():
                    quiet(pynvml.nvmlGpmSampleFree, s)
            finally:
                BATCH_LOCK.release()
        else:
            log.warning("nvml_gpm_samples_not_freed", reason="a GPM or field-values call is still running")
        self._registry.invalidate()
        if self._opened:
            self._opened = False
            quiet(pynvml.nvmlShutdown)

    def driver_version(self) -> str:
        return self._registry.driver_version

    def invalidate(self) -> None:
        """Forget the device layout; the next enumerate() rescans (handles after a MIG
        reconfiguration are invalid)."""
        self._registry.invalidate()

    # ---- enumeration and events --------------------------------------------------------------

    def enumerate(self) -> list[DeviceIdentity]:
        return self._registry.enumerate()

    def start_events(self, sink: EventSink) -> None:
        self._nvml_events.start(sink)

    # ---- reading -----------------------------------------------------------------------------

    def read(self, device: DeviceIdentity) -> DeviceReading:
        dev = self._registry.get(device.uuid)
        if dev is None:
            return DeviceReading.failed(device.uuid, ReadError.GONE, "device not present in the last enumeration")
        reading = DeviceReading(uuid=dev.identity.uuid)
        calls = self._calls
        try:
            for reader in dev.readers:  # readers.READERS rows that apply to this device
                reader(calls, dev, reading)
        except CallFailed as exc:
            return self._failed(dev, exc.code, str(exc))
        except pynvml.NVMLError as exc:  # a call outside Calls.call (defensive)
            return self._failed(dev, int(getattr(exc, "value", -1)), str(exc))
        except Exception as exc:
            log.exception("nvml_read_crashed", uuid=device.uuid)
            return DeviceReading.failed(device.uuid, ReadError.ERROR, f"{type(exc).__name__}: {exc}")
        if dev.failing:
            log.info("nvml_read_recovered", uuid=device.uuid, after=dev.failing)
            dev.failing = ""
        return reading

    def _failed(self, dev: NvmlDevice, code: int, detail: str) -> DeviceReading:
        uuid = dev.identity.uuid
        if code == ERR_GPU_IS_LOST:
            error = ReadError.LOST
        elif code == ERR_UNKNOWN:
            error = ReadError.UNKNOWN
        else:
            error = ReadError.ERROR
        if code == ERR_INVALID_ARGUMENT and dev.is_mig:
            # MIG handles die with a reconfiguration we may not have been told about.
            self._registry.invalidate()
        if dev.failing != detail:
            log.warning("nvml_read_failed", uuid=uuid, error=error.value, detail=detail)
            dev.failing = detail
        return DeviceReading.failed(uuid, error, detail)
