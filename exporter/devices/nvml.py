"""NVIDIA backend on NVML through nvidia-ml-py (``import pynvml``).

What it reads, per cycle and device (units normalised to the model's base units):

* direct calls (no field id exists for them): utilization (not on MIG), memory (``_v2`` ->
  v1), GPU temperature (``TemperatureV`` -> ``GetTemperature``), SM/memory clocks, clock event
  reasons, running compute processes;
* one batched ``nvmlDeviceGetFieldValues`` call for everything that has a field id: energy,
  average power, memory temperature, ECC volatile and aggregate totals, retired pages, remapped
  rows, PCIe replays, GPU recovery action (ids in ``FIELD_REQUESTS``). Each value carries its own
  ``nvmlReturn``; unsupported ids are dropped from later batches. Direct calls are used only
  when the batch call itself is missing (or its lock is stuck, see below), and for power and
  energy when their fields are unsupported: those fields are newer than the direct calls, so an
  older driver or GPU answers the call but not the field;
* GPM (Hopper+): SM active, SM occupancy, tensor active, DRAM active from two samples, the
  previous cycle's and this one's (the first cycle yields ``None``).

MIG: when MIG mode is on, the parent GPU *and* each MIG device are exported. MIG devices get
memory, GPM (``nvmlGpmMigSampleGet(parent, gi)``) and processes; power, temperature, clocks and
health counters stay on the parent because they are physical, device-wide quantities.

Failures: a call a device does not support is remembered per device and not retried until the
next rescan; ``GPU_IS_LOST``/``UNKNOWN`` turn the whole reading into ``DeviceReading.failed``.
Nothing here raises for a device problem. Hangs are the caller's business (DeadlineRunner),
but no lock taken here can be held forever by a stuck call and block other devices.
"""

from __future__ import annotations

import ctypes
import math
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .base import BackendUnavailable, DeviceBackend, EventSink
from .model import (
    DeviceEvent,
    DeviceIdentity,
    DeviceReading,
    EventKind,
    ReadError,
    RecoveryAction,
    Vendor,
    normalize_pci_bus_id,
)

try:  # nvidia-ml-py is a runtime dependency, but a broken install must not break import
    import pynvml
except Exception:  # pragma: no cover - exercised only without nvidia-ml-py
    pynvml = None

log = structlog.get_logger(__name__)

__all__ = ["FIELD_IDS", "FIELD_REQUESTS", "GPM_METRICS", "NvmlBackend", "mig_profile_from_name", "mig_profile_from_size"]

# ---- NVML constants (nvml.h ABI numbers; spelled out so older nvidia-ml-py releases work) ----

_SUCCESS = 0
_ERR_UNINITIALIZED = 1
_ERR_INVALID_ARGUMENT = 2
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_DRIVER_NOT_LOADED = 9
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_RESET_REQUIRED = 16
_ERR_LIB_RM_VERSION_MISMATCH = 18
_ERR_ARGUMENT_VERSION_MISMATCH = 25
_ERR_GPU_NOT_FOUND = 28
_ERR_UNKNOWN = 999

# "This device cannot do that": remember and stop asking.
_UNSUPPORTED = frozenset({_ERR_NOT_SUPPORTED, _ERR_FUNCTION_NOT_FOUND, _ERR_NO_PERMISSION, _ERR_ARGUMENT_VERSION_MISMATCH})
# The device (or our handle to it) is unusable: fail the whole reading.
# INVALID_ARGUMENT on a handle we got from NVML means the handle died (MIG reconfiguration).
_DEVICE_FATAL = frozenset({
    _ERR_GPU_IS_LOST, _ERR_UNKNOWN, _ERR_RESET_REQUIRED, _ERR_INVALID_ARGUMENT, _ERR_UNINITIALIZED,
    _ERR_DRIVER_NOT_LOADED, _ERR_LIB_RM_VERSION_MISMATCH, _ERR_GPU_NOT_FOUND,
})  # fmt: skip

_FI_ECC_SBE_VOL, _FI_ECC_DBE_VOL, _FI_ECC_SBE_AGG, _FI_ECC_DBE_AGG = 3, 4, 5, 6
_FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING = 29, 30, 31
_FI_MEMORY_TEMP = 82
_FI_ENERGY = 83  # mJ since driver load
_FI_PCIE_REPLAY = 94
_FI_REMAPPED_COR, _FI_REMAPPED_UNC, _FI_REMAPPED_PENDING, _FI_REMAPPED_FAILURE = 142, 143, 144, 145
# POWER_AVERAGE is what nvmlDeviceGetPowerUsage returns on Ampere (non-GA100) and newer (1 s
# average, the number dcgm-exporter shows); older GPUs answer NOT_SUPPORTED and we fall back
# to nvmlDeviceGetPowerUsage, which is instantaneous there.
_FI_POWER_AVERAGE = 185
_POWER_SCOPE_GPU = 0
_FI_RECOVERY_ACTION = 230

#: Fields the driver answers slowly, read at most once per ``slow_counter_period_s``; between
#: reads the last value is reported (both are counters, so rate() over them is unchanged).
#: Measured on an H100 (driver 580.159.04, bench/nvml_hardware.py): the total-energy field costs
#: 3.2 ms of CPU per call and the PCIe replay counter 0.13 ms, every other field 2-7 us, so the
#: energy field alone was two thirds of a GPU's read and most of the agent's CPU at 1 s.
SLOW_FIELDS: frozenset[int] = frozenset({_FI_ENERGY, _FI_PCIE_REPLAY})

#: (field id, scope id) requested in the one batched call per full GPU
FIELD_REQUESTS: tuple[tuple[int, int], ...] = tuple(
    (fid, _POWER_SCOPE_GPU if fid == _FI_POWER_AVERAGE else 0)
    for fid in (
        _FI_ENERGY, _FI_POWER_AVERAGE, _FI_MEMORY_TEMP,
        _FI_ECC_SBE_VOL, _FI_ECC_DBE_VOL, _FI_ECC_SBE_AGG, _FI_ECC_DBE_AGG,
        _FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING,
        _FI_REMAPPED_COR, _FI_REMAPPED_UNC, _FI_REMAPPED_PENDING, _FI_REMAPPED_FAILURE,
        _FI_PCIE_REPLAY, _FI_RECOVERY_ACTION,
    )
)  # fmt: skip
FIELD_IDS: tuple[int, ...] = tuple(f for f, _ in FIELD_REQUESTS)

# GPM metric ids (percent 0..100) -> DeviceReading attribute (ratio 0..1)
_GPM_SM_UTIL, _GPM_SM_OCCUPANCY, _GPM_ANY_TENSOR, _GPM_DRAM_BW = 2, 3, 5, 10
GPM_METRICS: dict[int, str] = {
    _GPM_SM_UTIL: "sm_active_ratio",
    _GPM_SM_OCCUPANCY: "sm_occupancy_ratio",
    _GPM_ANY_TENSOR: "tensor_active_ratio",
    _GPM_DRAM_BW: "dram_active_ratio",
}

_EV_SBE, _EV_DBE, _EV_XID = 0x1, 0x2, 0x8
_EV_MIG_CHANGE = 0x100
_EV_GPU_UNAVAILABLE, _EV_RECOVERY_ACTION = 0x4000, 0x8000
_EVENT_MASK = _EV_SBE | _EV_DBE | _EV_XID | _EV_MIG_CHANGE | _EV_GPU_UNAVAILABLE | _EV_RECOVERY_ACTION
_EVENT_KINDS = {
    _EV_XID: EventKind.XID,
    _EV_DBE: EventKind.ECC_DBE,
    _EV_SBE: EventKind.ECC_SBE,
    _EV_GPU_UNAVAILABLE: EventKind.GPU_LOST,
    _EV_RECOVERY_ACTION: EventKind.RECOVERY_ACTION,
    _EV_MIG_CHANGE: EventKind.MIG_CONFIG_CHANGE,
}
_NO_INSTANCE = 0xFFFFFFFF

# DataDog found nvmlDeviceGetFieldValues and the GPM sampling calls not thread safe in practice
# (wrong "unsupported" answers under concurrency), so they are serialised process-wide: NVML is
# one library per process. Trade-off: if one of these calls hangs in the driver while holding
# the lock, every other device would queue behind it. So the lock is held only around those
# calls, and taken with a timeout: a device that cannot get it within ``lock_timeout_s`` falls
# back to the (thread-safe) direct calls, or skips GPM, for that cycle instead of blocking.
_BATCH_LOCK = threading.Lock()

# pynvml raises this (not an NVMLError) from unversioned wrappers such as
# nvmlDeviceGetComputeRunningProcesses when the driver lacks the versioned symbol.
_LIBRARY_MISMATCH: Any = getattr(pynvml, "NVMLLibraryMismatchError", ()) if pynvml is not None else ()

_MIG_NAME_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")


class _CallFailed(Exception):
    """A device-level failure: the whole reading becomes DeviceReading.failed."""

    def __init__(self, code: int, call: str, message: str) -> None:
        super().__init__(f"{call}: {message}")
        self.code = code
        self.call = call


@dataclass
class _Device:
    """Everything this backend keeps about one enumerated device between cycles."""

    identity: DeviceIdentity
    handle: Any
    parent_handle: Any = None  # MIG: the parent GPU's handle
    gpm_supported: bool = False
    unsupported: set[str] = field(default_factory=set)  # call keys this device does not support
    unsupported_fields: set[int] = field(default_factory=set)
    # The field requests this device answers, rebuilt when a field turns out unsupported:
    # filtering FIELD_REQUESTS on every read was a measurable share of the per-read cost.
    field_requests: list[tuple[int, int]] | None = None
    fast_field_requests: list[tuple[int, int]] | None = None  # field_requests less SLOW_FIELDS
    slow_due: float = 0.0  # monotonic time the slow fields are next asked for
    slow_values: dict[int, int | float] = field(default_factory=dict)  # their last answers
    slow_direct: dict[str, tuple[float, Any]] = field(default_factory=dict)  # key -> (due, value)
    # Equivalent-call fallbacks (newest API first) per quantity, built once per device: the
    # handle never changes for a _Device, so neither do the bound argument tuples.
    fallbacks: dict[str, list[tuple[str, Callable[..., Any], tuple[Any, ...]]]] = field(default_factory=dict)
    gpm_samples: list[Any] = field(default_factory=list)  # two rotating samples
    gpm_prev: int = -1  # index of the sample holding the previous cycle, -1 = none yet
    failing: str = ""  # last failure, so a lost GPU is logged once and not every cycle

    @property
    def is_mig(self) -> bool:
        return bool(self.identity.parent_uuid)


def _address(handle: Any) -> int:
    """Opaque NVML handles are pointers; their address identifies the device."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _ratio(percent: float | int | None) -> float | None:
    if percent is None:
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


# Decoding a field-values batch. pynvml's structures convert bytes on every attribute read in a
# Python-level __getattribute__, which made decoding 16 values cost more than the NVML call
# itself. The batch is a plain C array, so it is read once as bytes and unpacked with the
# offsets of pynvml's own nvmlFieldValue_t (nothing hard-coded): ~2 us instead of ~19 us.
_FV_STRUCT: Any = getattr(pynvml, "c_nvmlFieldValue_t", None)
_VALUE_FORMAT = {0: "@d", 1: "@I", 2: "@L", 3: "@Q", 4: "@q", 5: "@i", 6: "@H"}  # NVML_VALUE_TYPE_*


_VALUE_STRUCTS = {k: struct.Struct(f) for k, f in _VALUE_FORMAT.items()}


def _record_struct() -> struct.Struct | None:
    """One c_nvmlFieldValue_t as (valueType, nvmlReturn, the 8 value bytes), or None if the
    layout is not the one expected (then the entries are decoded field by field)."""
    if _FV_STRUCT is None:
        return None
    size = ctypes.sizeof(_FV_STRUCT)
    type_at, ret_at, value_at = _FV_STRUCT.valueType.offset, _FV_STRUCT.nvmlReturn.offset, _FV_STRUCT.value.offset
    if ret_at != type_at + 4 or value_at < ret_at + 4 or size < value_at + 8:
        return None
    rec = struct.Struct(f"={type_at}xII{value_at - ret_at - 4}x8s{size - value_at - 8}x")
    return rec if rec.size == size else None


_FV_RECORD = _record_struct()


def _decode_batch(values: Any, count: int) -> list[tuple[int, int | float | None]]:
    """(nvmlReturn, value) per entry of a c_nvmlFieldValue_t array; value None when the
    return is not success or the value type is unknown.

    Read straight from the array's memory with precompiled structs, one unpack per entry:
    pynvml's per-attribute accessors on the ctypes structs cost more than the library call.
    """
    buf = memoryview(values).cast("B")
    out: list[tuple[int, int | float | None]] = []
    if _FV_RECORD is not None:
        structs = _VALUE_STRUCTS
        for vtype, ret, raw in _FV_RECORD.iter_unpack(buf[: count * _FV_RECORD.size]):
            value = None
            if ret == _SUCCESS:
                st = structs.get(vtype)
                if st is not None:
                    value = st.unpack_from(raw)[0]
            out.append((ret, value))
        return out
    size = ctypes.sizeof(_FV_STRUCT)
    type_at, ret_at, value_at = _FV_STRUCT.valueType.offset, _FV_STRUCT.nvmlReturn.offset, _FV_STRUCT.value.offset
    for i in range(count):
        base = i * size
        (ret,) = struct.unpack_from("@I", buf, base + ret_at)
        value = None
        if ret == _SUCCESS:
            fmt = _VALUE_FORMAT.get(struct.unpack_from("@I", buf, base + type_at)[0])
            if fmt is not None:
                (value,) = struct.unpack_from(fmt, buf, base + value_at)
        out.append((ret, value))
    return out


def mig_profile_from_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` -> ``"1g.5gb"``; also ``"MIG 1c.3g.20gb"``."""
    m = _MIG_NAME_PROFILE.search(name or "")
    return m.group(1) if m else ""


def mig_profile_from_size(slice_count: int, memory_mb: int) -> str:
    """Approximate NVIDIA's profile name from GI profile info when no name is available.

    NVIDIA names round the instance's memory up to whole GB (1g.5gb = 4864 MB, 1g.10gb =
    9856 MB); this is a fallback only, the device or profile name is preferred.
    """
    if slice_count <= 0 or memory_mb <= 0:
        return ""
    return f"{slice_count}g.{math.ceil(memory_mb / 1024)}gb"


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
        self._event_wait_ms = event_wait_ms
        self._slow_period = slow_counter_period_s
        self._clock = clock
        self._lock_timeout_s = lock_timeout_s
        self._read_processes = processes
        self._use_gpm = gpm
        self._opened = False
        self._driver_version = ""
        self._lock = threading.RLock()  # guards the maps below (never held across NVML calls)
        self._scan_lock = threading.Lock()  # one rescan at a time
        self._devices: dict[str, _Device] = {}
        self._order: list[str] = []
        self._gpu_identity: dict[str, DeviceIdentity] = {}  # full GPUs: identity read once
        self._stale = True
        self._retired_samples: list[Any] = []  # GPM samples of vanished devices, freed at close
        self._stop = threading.Event()
        self._event_thread: threading.Thread | None = None
        self._event_set: Any = None
        self._event_handles: dict[int, str] = {}  # handle address -> full GPU uuid
        self._lost_reported: set[str] = set()

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
        self._stop.clear()
        try:
            self._driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            log.warning("nvml_driver_version_failed", error=str(exc))
        log.info("nvml_opened", driver_version=self._driver_version)

    def close(self) -> None:
        self._stop.set()
        thread, self._event_thread = self._event_thread, None
        if thread is not None:
            thread.join(timeout=self._event_wait_ms / 1000.0 + 2.0)
        if self._event_set is not None and (thread is None or not thread.is_alive()):
            # Free only once the waiter has left: freeing a set another thread waits on is a
            # use-after-free in the C library.
            self._quiet(pynvml.nvmlEventSetFree, self._event_set)
            self._event_set = None
        # Every GPM call runs under _BATCH_LOCK, so holding it means no sample is in use. If a
        # stuck call holds it, leak the samples rather than free memory the driver may touch.
        if _BATCH_LOCK.acquire(timeout=self._lock_timeout_s):
            try:
                with self._lock:
                    samples = [s for d in self._devices.values() for s in d.gpm_samples] + self._retired_samples
                    self._retired_samples = []
                    for d in self._devices.values():
                        d.gpm_samples, d.gpm_prev = [], -1
                for s in samples:
                    self._quiet(pynvml.nvmlGpmSampleFree, s)
            finally:
                _BATCH_LOCK.release()
        else:
            log.warning("nvml_gpm_samples_not_freed", reason="a GPM or field-values call is still running")
        self._stale = True
        if self._opened:
            self._opened = False
            self._quiet(pynvml.nvmlShutdown)

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            log.debug("nvml_teardown_call_failed", call=getattr(fn, "__name__", "?"), error=str(exc))

    def driver_version(self) -> str:
        return self._driver_version

    def invalidate(self) -> None:
        """Forget the device layout; the next enumerate() rescans (handles after a MIG
        reconfiguration are invalid)."""
        self._stale = True

    # ---- enumeration -------------------------------------------------------------------------

    def enumerate(self) -> list[DeviceIdentity]:
        with self._scan_lock:
            if self._stale:
                self._rescan()
            with self._lock:
                return [self._devices[u].identity for u in self._order]

    def _rescan(self) -> None:
        # Cleared first: a MIG change event arriving during the scan marks it stale again.
        self._stale = False
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.error("nvml_device_count_failed", error=str(exc))
            self._stale = True
            return
        with self._lock:
            old = dict(self._devices)
            old_by_index = {d.identity.index: d for d in old.values() if not d.is_mig}
        devices: dict[str, _Device] = {}
        order: list[str] = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = str(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                prev = old_by_index.get(index)
                log.warning("nvml_device_handle_failed", index=index, error=str(exc), known_uuid=prev and prev.identity.uuid)
                if prev is not None:
                    # Keep a GPU we knew: its reads will report it lost instead of it vanishing.
                    devices[prev.identity.uuid] = prev
                    order.append(prev.identity.uuid)
                    for u, d in old.items():
                        if d.identity.parent_uuid == prev.identity.uuid:
                            devices[u] = d
                            order.append(u)
                continue
            gpu = self._gpu_device(index, handle, uuid, old.get(uuid))
            devices[uuid] = gpu
            order.append(uuid)
            for mig in self._mig_devices(gpu, old):
                devices[mig.identity.uuid] = mig
                order.append(mig.identity.uuid)
        with self._lock:
            for u, d in old.items():
                if devices.get(u) is not d:
                    self._retired_samples.extend(d.gpm_samples)
                    d.gpm_samples = []
            self._devices = devices
            self._order = order
        log.info("nvml_enumerated", devices=len(order), gpus=count)

    def _gpu_device(self, index: int, handle: Any, uuid: str, old: _Device | None) -> _Device:
        ident = self._gpu_identity.get(uuid)
        if ident is None:
            ident = self._gpu_identity[uuid] = self._read_gpu_identity(index, handle, uuid)
        gpm = self._gpm_support(handle)
        dev = _Device(identity=ident, handle=handle, gpm_supported=gpm)
        if old is not None and old.handle is not None and _address(old.handle) == _address(handle):
            # Same GPU, same handle: keep its GPM baseline; support is re-learnt after a rescan
            # because MIG mode changes what the parent supports.
            dev.gpm_samples, dev.gpm_prev = old.gpm_samples, old.gpm_prev
            old.gpm_samples = []
        return dev

    def _read_gpu_identity(self, index: int, handle: Any, uuid: str) -> DeviceIdentity:
        def best(fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                log.info("nvml_identity_field_unavailable", uuid=uuid, call=fn.__name__, error=str(exc))
                return default

        name = best(pynvml.nvmlDeviceGetName, handle, default="")
        pci = best(pynvml.nvmlDeviceGetPciInfo, handle)
        bus_id = pci.busId.decode() if pci is not None and isinstance(pci.busId, bytes) else str(getattr(pci, "busId", "") or "")
        mem = self._memory_info(handle, uuid, None)
        return DeviceIdentity(
            uuid=uuid,
            vendor=Vendor.NVIDIA,
            model=str(name),
            pci_bus_id=normalize_pci_bus_id(bus_id),
            index=index,
            minor=best(pynvml.nvmlDeviceGetMinorNumber, handle),
            driver_version=self._driver_version,
            serial=str(best(pynvml.nvmlDeviceGetSerial, handle, default="") or ""),
            memory_total_bytes=int(mem.total) if mem is not None else None,
        )

    def _gpm_support(self, handle: Any) -> bool:
        if not self._use_gpm or not hasattr(pynvml, "nvmlGpmQueryDeviceSupport"):
            return False
        try:
            return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except pynvml.NVMLError:
            return False

    def _mig_devices(self, gpu: _Device, old: dict[str, _Device]) -> list[_Device]:
        h, parent = gpu.handle, gpu.identity
        try:
            if pynvml.nvmlDeviceGetMigMode(h)[0] != 1:  # NVML_DEVICE_MIG_ENABLE
                return []
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(h)
        except pynvml.NVMLError as exc:
            if exc.value not in _UNSUPPORTED:
                log.warning("nvml_mig_mode_failed", uuid=parent.uuid, error=str(exc))
            return []
        out: list[_Device] = []
        for slot in range(slots):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except pynvml.NVMLError as exc:
                if exc.value not in (_ERR_NOT_FOUND, _ERR_INVALID_ARGUMENT):
                    log.warning("nvml_mig_handle_failed", uuid=parent.uuid, slot=slot, error=str(exc))
                continue
            try:
                ident = self._read_mig_identity(parent, h, mh, slot)
            except pynvml.NVMLError as exc:
                log.warning("nvml_mig_identity_failed", uuid=parent.uuid, slot=slot, error=str(exc))
                continue
            dev = _Device(identity=ident, handle=mh, parent_handle=h, gpm_supported=gpu.gpm_supported)
            prev = old.get(ident.uuid)
            if prev is not None and _address(prev.handle) == _address(mh):
                dev.gpm_samples, dev.gpm_prev = prev.gpm_samples, prev.gpm_prev
                prev.gpm_samples = []
            out.append(dev)
        return out

    def _read_mig_identity(self, parent: DeviceIdentity, h: Any, mh: Any, slot: int) -> DeviceIdentity:
        uuid = str(pynvml.nvmlDeviceGetUUID(mh))

        def best(fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                log.info("nvml_mig_field_unavailable", uuid=uuid, call=getattr(fn, "__name__", "?"), error=str(exc))
                return None

        name = best(pynvml.nvmlDeviceGetName, mh) or ""
        gi_id = best(pynvml.nvmlDeviceGetGpuInstanceId, mh)
        ci_id = best(pynvml.nvmlDeviceGetComputeInstanceId, mh)
        profile = mig_profile_from_name(str(name))
        gi_profile_id = placement = None
        if gi_id is not None:
            # Needs privileges on real systems; identity stays valid without it.
            gi = best(pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id)
            info = best(pynvml.nvmlGpuInstanceGetInfo, gi) if gi is not None else None
            if info is not None:
                gi_profile_id, placement = int(info.profileId), int(info.placement.start)
        if not profile and gi_profile_id is not None and hasattr(pynvml, "nvmlDeviceGetGpuInstanceProfileInfoById"):
            pinfo = best(pynvml.nvmlDeviceGetGpuInstanceProfileInfoById, h, gi_profile_id)
            if pinfo is not None:
                pname = pinfo.name.decode() if isinstance(pinfo.name, bytes) else str(pinfo.name)
                profile = mig_profile_from_name(pname) or mig_profile_from_size(int(pinfo.sliceCount), int(pinfo.memorySizeMB))
        mem = self._memory_info(mh, uuid, None)
        return DeviceIdentity(
            uuid=uuid,
            vendor=Vendor.NVIDIA,
            model=parent.model,
            pci_bus_id=parent.pci_bus_id,
            index=slot,
            minor=None,
            driver_version=self._driver_version,
            parent_uuid=parent.uuid,
            mig_profile=profile,
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            gi_profile_id=gi_profile_id,
            placement_start=placement,
            memory_total_bytes=int(mem.total) if mem is not None else None,
        )

    # ---- reading -----------------------------------------------------------------------------

    def read(self, device: DeviceIdentity) -> DeviceReading:
        with self._lock:
            dev = self._devices.get(device.uuid)
        if dev is None:
            return DeviceReading.failed(device.uuid, ReadError.GONE, "device not present in the last enumeration")
        try:
            reading = self._read(dev)
        except _CallFailed as exc:
            return self._failed(dev, exc.code, str(exc))
        except pynvml.NVMLError as exc:  # a call outside _call (defensive)
            return self._failed(dev, int(getattr(exc, "value", -1)), str(exc))
        except Exception as exc:
            log.exception("nvml_read_crashed", uuid=device.uuid)
            return DeviceReading.failed(device.uuid, ReadError.ERROR, f"{type(exc).__name__}: {exc}")
        if dev.failing:
            log.info("nvml_read_recovered", uuid=device.uuid, after=dev.failing)
            dev.failing = ""
        return reading

    def _failed(self, dev: _Device, code: int, detail: str) -> DeviceReading:
        uuid = dev.identity.uuid
        if code == _ERR_GPU_IS_LOST:
            error = ReadError.LOST
        elif code == _ERR_UNKNOWN:
            error = ReadError.UNKNOWN
        else:
            error = ReadError.ERROR
        if code == _ERR_INVALID_ARGUMENT and dev.is_mig:
            # MIG handles die with a reconfiguration we may not have been told about.
            self._stale = True
        if dev.failing != detail:
            log.warning("nvml_read_failed", uuid=uuid, error=error.value, detail=detail)
            dev.failing = detail
        return DeviceReading.failed(uuid, error, detail)

    def _call(self, dev: _Device, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One NVML call for one reading field. Returns None when the field is unavailable;
        raises _CallFailed when the device as a whole is."""
        if key in dev.unsupported:
            return None
        try:
            return fn(*args, **kwargs)
        except pynvml.NVMLError as exc:
            code = int(getattr(exc, "value", -1))
            if code in _UNSUPPORTED:
                dev.unsupported.add(key)
                log.info("nvml_call_unsupported", uuid=dev.identity.uuid, call=key, error=str(exc))
                return None
            if code in _DEVICE_FATAL:
                raise _CallFailed(code, key, str(exc)) from exc
            log.debug("nvml_call_transient_error", uuid=dev.identity.uuid, call=key, error=str(exc))
            return None
        except _LIBRARY_MISMATCH as exc:  # unversioned wrapper whose C symbol is missing
            dev.unsupported.add(key)
            log.info("nvml_call_unsupported", uuid=dev.identity.uuid, call=key, error=str(exc))
            return None

    def _first(self, dev: _Device, calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]]) -> Any:
        """The first of several equivalent calls this device supports (newest API first)."""
        for key, fn, args in calls:
            if key in dev.unsupported:
                continue
            value = self._call(dev, key, fn, *args)
            if value is not None or key not in dev.unsupported:
                return value
        return None

    def _memory_info(self, handle: Any, uuid: str, dev: _Device | None) -> Any:
        """Memory info v2 (``used`` excludes driver-reserved memory since R510), else v1."""
        if dev is not None:
            calls = dev.fallbacks.get("memory")
            if calls is None:
                calls = dev.fallbacks["memory"] = []
                v2 = getattr(pynvml, "nvmlMemory_v2", None)
                if v2 is not None:
                    calls.append(("memory_v2", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=v2), (handle,)))
                calls.append(("memory_v1", pynvml.nvmlDeviceGetMemoryInfo, (handle,)))
            return self._first(dev, calls)
        for version in (getattr(pynvml, "nvmlMemory_v2", None), None):
            try:
                return pynvml.nvmlDeviceGetMemoryInfo(handle, version=version) if version else pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError as exc:
                log.debug("nvml_memory_info_failed", uuid=uuid, v2=bool(version), error=str(exc))
        return None

    def _read(self, dev: _Device) -> DeviceReading:
        h = dev.handle
        r = DeviceReading(uuid=dev.identity.uuid)

        mem = self._memory_info(h, dev.identity.uuid, dev)
        if mem is not None:
            r.memory_used_bytes = int(mem.used)
            r.memory_total_bytes = int(mem.total)

        if not dev.is_mig:
            util = self._call(dev, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                r.utilization_ratio = _ratio(util.gpu)
            self._read_physical(dev, r)
            self._read_counters(dev, r)

        if dev.gpm_supported:
            self._read_gpm(dev, r)
        if self._read_processes:
            procs = self._call(dev, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, h)
            if procs:
                r.processes = self._process_map(procs)
        return r

    def _read_physical(self, dev: _Device, r: DeviceReading) -> None:
        h = dev.handle
        if "temperature" not in dev.fallbacks:
            temp_calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = []
            if hasattr(pynvml, "nvmlDeviceGetTemperatureV"):
                temp_calls.append(("temperature_v", pynvml.nvmlDeviceGetTemperatureV, (h, pynvml.NVML_TEMPERATURE_GPU)))
            temp_calls.append(("temperature", pynvml.nvmlDeviceGetTemperature, (h, pynvml.NVML_TEMPERATURE_GPU)))
            reason_calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = []
            if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons"):
                reason_calls.append(("clock_event_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons, (h,)))
            reason_calls.append(("clock_throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, (h,)))
            dev.fallbacks["temperature"], dev.fallbacks["clock_reasons"] = temp_calls, reason_calls
        temp = self._first(dev, dev.fallbacks["temperature"])
        if temp is not None:
            r.temperature_celsius = float(temp)
        sm = self._call(dev, "clock_sm", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        if sm is not None:
            r.sm_clock_hertz = float(sm) * 1e6
        memclk = self._call(dev, "clock_mem", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        if memclk is not None:
            r.memory_clock_hertz = float(memclk) * 1e6
        reasons = self._first(dev, dev.fallbacks["clock_reasons"])
        if reasons is not None:
            r.clock_event_reasons = int(reasons)

    # -- batched counters --

    def _field_values(self, dev: _Device) -> dict[int, int | float] | None:
        """One nvmlDeviceGetFieldValues call. None: no batch this cycle (call missing, or the
        lock is held by a stuck call), use the direct calls instead."""
        if "field_values" in dev.unsupported:
            return None
        if dev.field_requests is None or dev.fast_field_requests is None:
            dev.field_requests = [f for f in FIELD_REQUESTS if f[0] not in dev.unsupported_fields]
            dev.fast_field_requests = [f for f in dev.field_requests if f[0] not in SLOW_FIELDS]
        now = self._clock()
        slow_due = now >= dev.slow_due
        fields = dev.field_requests if slow_due else dev.fast_field_requests
        if not fields:
            return dict(dev.slow_values)
        if not _BATCH_LOCK.acquire(timeout=self._lock_timeout_s):
            log.warning("nvml_field_values_lock_busy", uuid=dev.identity.uuid, fallback="direct calls")
            return None
        try:
            values = self._call(dev, "field_values", pynvml.nvmlDeviceGetFieldValues, dev.handle, fields)
        finally:
            _BATCH_LOCK.release()
        if values is None:
            return None if "field_values" in dev.unsupported else {}
        out: dict[int, int | float] = {}
        # NVML fills the array in request order, so the id comes from the request.
        for (fid, _scope), (ret, decoded) in zip(fields, _decode_batch(values, len(fields)), strict=False):
            if ret == _SUCCESS:
                if decoded is not None:
                    out[fid] = decoded
            elif ret in _UNSUPPORTED or ret == _ERR_INVALID_ARGUMENT:
                # per value, INVALID_ARGUMENT means "this driver does not know this field id"
                dev.unsupported_fields.add(fid)
                dev.field_requests = dev.fast_field_requests = None
                log.info("nvml_field_unsupported", uuid=dev.identity.uuid, field_id=fid, ret=ret)
            elif ret in (_ERR_GPU_IS_LOST, _ERR_UNKNOWN):
                raise _CallFailed(ret, f"field {fid}", str(pynvml.NVMLError(ret)))
            else:
                log.debug("nvml_field_transient_error", uuid=dev.identity.uuid, field_id=fid, ret=ret)
        if slow_due:
            dev.slow_due = now + self._slow_period
            dev.slow_values = {fid: out[fid] for fid in SLOW_FIELDS if fid in out}
        else:
            for fid, value in dev.slow_values.items():
                out.setdefault(fid, value)
        return out

    def _read_counters(self, dev: _Device, r: DeviceReading) -> None:
        h = dev.handle
        fv = self._field_values(dev)
        direct = fv is None
        fv = fv or {}

        def field_or_direct(fid: int, key: str, fn: Callable[..., Any], *args: Any) -> Any:
            if fid in fv:
                return fv[fid]
            if direct or fid in dev.unsupported_fields:
                return self._slow_call(dev, key, fn, *args) if fid in SLOW_FIELDS else self._call(dev, key, fn, *args)
            return None

        energy = field_or_direct(_FI_ENERGY, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
        if energy is not None:
            r.energy_joules = float(energy) / 1000.0
        power = field_or_direct(_FI_POWER_AVERAGE, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            r.power_watts = float(power) / 1000.0
        if _FI_MEMORY_TEMP in fv:
            r.memory_temperature_celsius = float(fv[_FI_MEMORY_TEMP])
        if _FI_RECOVERY_ACTION in fv:
            try:
                r.recovery_action = RecoveryAction(int(fv[_FI_RECOVERY_ACTION]))
            except ValueError:
                log.warning("nvml_unknown_recovery_action", uuid=dev.identity.uuid, value=fv[_FI_RECOVERY_ACTION])

        if direct:
            self._read_counters_direct(dev, r)
            return
        # ECC: volatile counts (since driver load, move immediately) preferred; aggregate
        # (lifetime, inforom) where volatile is not reported.
        sbe = fv.get(_FI_ECC_SBE_VOL, fv.get(_FI_ECC_SBE_AGG))
        dbe = fv.get(_FI_ECC_DBE_VOL, fv.get(_FI_ECC_DBE_AGG))
        r.ecc_correctable_total = None if sbe is None else int(sbe)
        r.ecc_uncorrectable_total = None if dbe is None else int(dbe)
        retired = [fv[f] for f in (_FI_RETIRED_SBE, _FI_RETIRED_DBE) if f in fv]
        if retired:
            r.retired_pages_total = int(sum(retired))
        if _FI_RETIRED_PENDING in fv:
            r.retired_pages_pending = bool(fv[_FI_RETIRED_PENDING])
        if _FI_REMAPPED_COR in fv:
            r.remapped_rows_correctable = int(fv[_FI_REMAPPED_COR])
        if _FI_REMAPPED_UNC in fv:
            r.remapped_rows_uncorrectable = int(fv[_FI_REMAPPED_UNC])
        if _FI_REMAPPED_PENDING in fv:
            r.row_remap_pending = bool(fv[_FI_REMAPPED_PENDING])
        if _FI_REMAPPED_FAILURE in fv:
            r.row_remap_failure = bool(fv[_FI_REMAPPED_FAILURE])
        if _FI_PCIE_REPLAY in fv:
            r.pcie_replay_total = int(fv[_FI_PCIE_REPLAY])

    def _slow_call(self, dev: _Device, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A SLOW_FIELDS quantity read by its own call (the direct equivalents are as slow as the
        fields): asked once per period, the last answer reported in between."""
        now = self._clock()
        due, value = dev.slow_direct.get(key, (0.0, None))
        if now >= due:
            value = self._call(dev, key, fn, *args)
            dev.slow_direct[key] = (now + self._slow_period, value)
        return value

    def _read_counters_direct(self, dev: _Device, r: DeviceReading) -> None:
        """The same counters one call each, for drivers without nvmlDeviceGetFieldValues."""
        h = dev.handle

        def ecc(kind: int) -> int | None:
            for counter, name in ((pynvml.NVML_VOLATILE_ECC, "vol"), (pynvml.NVML_AGGREGATE_ECC, "agg")):
                v = self._call(dev, f"ecc_{kind}_{name}", pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter)
                if v is not None:
                    return int(v)
            return None

        r.ecc_correctable_total = ecc(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)
        r.ecc_uncorrectable_total = ecc(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        pages = [
            self._call(dev, f"retired_pages_{cause}", pynvml.nvmlDeviceGetRetiredPages_v2, h, cause)
            for cause in (0, 1)  # multiple single-bit errors, double-bit error
        ]
        if any(p is not None for p in pages):
            r.retired_pages_total = sum(len(p) for p in pages if p is not None)
        pending = self._call(dev, "retired_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        if pending is not None:
            r.retired_pages_pending = bool(pending)
        rows = self._call(dev, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            cor, unc, pend, fail = rows
            r.remapped_rows_correctable, r.remapped_rows_uncorrectable = int(cor), int(unc)
            r.row_remap_pending, r.row_remap_failure = bool(pend), bool(fail)
        replay = self._slow_call(dev, "pcie_replay", pynvml.nvmlDeviceGetPcieReplayCounter, h)
        if replay is not None:
            r.pcie_replay_total = int(replay)

    # -- GPM --

    def _read_gpm(self, dev: _Device, r: DeviceReading) -> None:
        if "gpm" in dev.unsupported:
            return
        gi = dev.identity.gpu_instance_id
        use_mig_sample = dev.is_mig and gi is not None and hasattr(pynvml, "nvmlGpmMigSampleGet")
        if not _BATCH_LOCK.acquire(timeout=self._lock_timeout_s):
            log.warning("nvml_gpm_lock_busy", uuid=dev.identity.uuid)
            return
        try:
            self._gpm_cycle(dev, r, use_mig_sample)
        except _CallFailed as exc:
            if exc.code != _ERR_INVALID_ARGUMENT:
                raise
            # e.g. a baseline sample from before a reset/reconfiguration: start a new baseline
            # rather than failing the whole reading over a derived metric.
            log.info("nvml_gpm_baseline_reset", uuid=dev.identity.uuid, error=str(exc))
            dev.gpm_prev = -1
        finally:
            _BATCH_LOCK.release()

    def _gpm_cycle(self, dev: _Device, r: DeviceReading, use_mig_sample: bool) -> None:
        """Take this cycle's sample and, with the previous one, compute the metrics.
        Called with _BATCH_LOCK held."""
        if not dev.gpm_samples:
            samples = [self._call(dev, "gpm", pynvml.nvmlGpmSampleAlloc) for _ in range(2)]
            if None in samples:
                for s in samples:
                    if s is not None:
                        self._quiet(pynvml.nvmlGpmSampleFree, s)
                return
            dev.gpm_samples, dev.gpm_prev = samples, -1
        cur = 0 if dev.gpm_prev != 0 else 1
        sample = dev.gpm_samples[cur]
        if use_mig_sample:
            got = self._call(dev, "gpm", pynvml.nvmlGpmMigSampleGet, dev.parent_handle, dev.identity.gpu_instance_id, sample)
        else:
            got = self._call(dev, "gpm", pynvml.nvmlGpmSampleGet, dev.handle, sample)
        if got is None:
            return  # keep the previous baseline
        if dev.gpm_prev >= 0:
            mg = pynvml.c_nvmlGpmMetricsGet_t()
            mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(GPM_METRICS)
            mg.sample1 = dev.gpm_samples[dev.gpm_prev]
            mg.sample2 = sample
            for i, mid in enumerate(GPM_METRICS):
                mg.metrics[i].metricId = mid
            if self._call(dev, "gpm_metrics", pynvml.nvmlGpmMetricsGet, mg) is not None:
                for i, attr in enumerate(GPM_METRICS.values()):
                    if int(mg.metrics[i].nvmlReturn) == _SUCCESS:
                        setattr(r, attr, _ratio(mg.metrics[i].value))
        dev.gpm_prev = cur

    @staticmethod
    def _process_map(procs: list[Any]) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for p in procs:
            pid, used = int(p.pid), p.usedGpuMemory
            prev = out.get(pid)
            if prev is not None and used is not None:
                out[pid] = prev + int(used)  # same pid listed per compute instance
            elif pid not in out or used is not None:
                out[pid] = None if used is None else int(used)
        return out

    # ---- events ------------------------------------------------------------------------------

    def start_events(self, sink: EventSink) -> None:
        if self._event_thread is not None:
            return
        self.enumerate()
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("nvml_events_unavailable", error=str(exc))
            return
        with self._lock:
            gpus = [d for d in self._devices.values() if not d.is_mig]
        registered: dict[int, str] = {}
        for d in gpus:
            uuid = d.identity.uuid
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
            except pynvml.NVMLError as exc:
                log.warning("nvml_event_types_unavailable", uuid=uuid, error=str(exc))
                continue
            mask = _EVENT_MASK & supported
            if not mask:
                log.info("nvml_events_not_supported", uuid=uuid)
                continue
            try:
                pynvml.nvmlDeviceRegisterEvents(d.handle, mask, es)
            except pynvml.NVMLError as exc:
                # NOT_SUPPORTED leaves the set usable (nvml.h); anything else is logged loudly,
                # the device is then only watched by polling.
                level = log.info if exc.value == _ERR_NOT_SUPPORTED else log.error
                level("nvml_event_register_failed", uuid=uuid, mask=hex(mask), error=str(exc))
                continue
            registered[_address(d.handle)] = uuid
        self._event_set = es
        self._event_handles = registered
        self._stop.clear()
        t = threading.Thread(target=self._event_loop, args=(es, sink, dict(registered)), name="nvml-events", daemon=True)
        self._event_thread = t
        t.start()
        log.info("nvml_events_started", devices=len(registered))

    def event_heartbeat(self) -> float | None:
        """The event thread's latest turn round its loop (None: no event thread running)."""
        t = self._event_thread
        if t is None or self._stop.is_set():
            return None
        return getattr(self, "_event_beat", None)

    def _event_loop(self, es: Any, sink: EventSink, registered: dict[int, str]) -> None:
        while not self._stop.is_set():
            self._event_beat = time.monotonic()  # liveness: the loop still turns
            try:
                data = pynvml.nvmlEventSetWait_v2(es, self._event_wait_ms)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as exc:
                # nvml.h: the wait returns GPU_IS_LOST when a GPU fell off the bus, without
                # saying which. Probe every registered GPU to find out.
                log.error("nvml_event_wait_failed", error=str(exc), code=getattr(exc, "value", None))
                self._probe_lost(sink)
                # Back off so a persistent error does not spin; returns at once on close().
                self._stop.wait(min(self._event_wait_ms / 1000.0, 1.0))
                continue
            except Exception:
                log.exception("nvml_event_loop_error")
                self._stop.wait(1.0)
                continue
            try:
                self._dispatch(data, sink, registered)
            except Exception:
                log.exception("nvml_event_dispatch_failed")
        log.info("nvml_events_stopped")

    def _dispatch(self, data: Any, sink: EventSink, registered: dict[int, str]) -> None:
        etype, code = int(data.eventType), int(data.eventData)
        parent = registered.get(_address(data.device))
        if parent is None:
            log.warning("nvml_event_unknown_device", event_type=hex(etype), data=code)
            return
        uuid = self._event_uuid(parent, int(data.gpuInstanceId), int(data.computeInstanceId))
        for bit, kind in _EVENT_KINDS.items():
            if not etype & bit:
                continue
            if kind is EventKind.MIG_CONFIG_CHANGE:
                self.invalidate()  # before the sink hears of it: its next enumerate() rescans
                uuid = parent
            # debug: a storm is thousands of events; the health engine logs what is news
            log.debug("nvml_event", uuid=uuid, kind=kind.value, code=code)
            self._emit(sink, DeviceEvent(uuid=uuid, kind=kind, code=code if kind in (EventKind.XID, EventKind.RECOVERY_ACTION) else 0))

    def _event_uuid(self, parent: str, gi: int, ci: int) -> str:
        """MIG events carry the GPU/compute instance ids; map them to the MIG device."""
        if gi == _NO_INSTANCE:
            return parent
        with self._lock:
            migs = [d.identity for d in self._devices.values() if d.identity.parent_uuid == parent and d.identity.gpu_instance_id == gi]
        if not migs:
            return parent
        exact = [m for m in migs if m.compute_instance_id == ci]
        if exact:
            return exact[0].uuid
        # No valid compute instance: the GPU instance's only MIG device if it has one; with
        # several compute instances the fault cannot be pinned on one, so it stays on the GPU.
        return migs[0].uuid if len(migs) == 1 else parent

    def _probe_lost(self, sink: EventSink) -> None:
        for _address, uuid in list(self._event_handles.items()):
            with self._lock:
                dev = self._devices.get(uuid)
            if dev is None:
                continue
            try:
                pynvml.nvmlDeviceGetUUID(dev.handle)
            except pynvml.NVMLError as exc:
                if uuid in self._lost_reported:
                    continue
                self._lost_reported.add(uuid)
                log.error("nvml_gpu_lost", uuid=uuid, error=str(exc))
                self._emit(sink, DeviceEvent(uuid=uuid, kind=EventKind.GPU_LOST, detail=str(exc)))
            else:
                self._lost_reported.discard(uuid)

    @staticmethod
    def _emit(sink: EventSink, event: DeviceEvent) -> None:
        try:
            sink(event)
        except Exception:
            log.exception("nvml_event_sink_failed", uuid=event.uuid, kind=event.kind.value)
