"""A pure-Python fake of the NVML C library (``libnvidia-ml.so.1``) for nvidia-ml-py.

nvidia-ml-py (``pynvml``) skips loading the shared library when ``pynvml.nvmlLib`` is already
set, and resolves every C symbol lazily with ``getattr(nvmlLib, "<C name>")``. So assigning
:attr:`FakeNvml.lib` there lets *all* of pynvml's real ctypes wrapper code run: the fake's
functions are named like the C symbols, receive the same ctypes objects the C library would
(``byref(...)`` objects, string buffers, structs, opaque handle pointers), write results through
them and return ``nvmlReturn_t`` codes, which pynvml turns into its own exceptions.

Data model: every device holds ``calls``, a map from a *call key* to a sequence of raw results
``{"ret": <nvmlReturn>, "value": <raw NVML value>}``, one per collection cycle (the last one
repeats). A call key is the C symbol name, with selector arguments appended where a function is
asked several questions per cycle: ``nvmlDeviceGetClockInfo:1`` (SM clock),
``nvmlDeviceGetTemperatureV:0``, ``nvmlGpmMetricsGet:2``. A key that is absent answers
NOT_SUPPORTED, like a GPU that lacks the feature. The same format is what
``bench/record_nvml_fixture.py`` records on real hardware (see tests/fixtures/nvml/README.md),
so a recording replays through this fake unchanged; :class:`FakeGpu` is a convenient builder of
those maps for hand-written tests.

Test controls: :meth:`FakeNvml.fail` (per device, per function or ``"*"``, any return code),
:meth:`FakeNvml.remove_function` (symbol missing from the library -> FUNCTION_NOT_FOUND),
:meth:`FakeNvml.hang` (a call blocks until released), :meth:`FakeNvml.queue_event` /
:meth:`FakeNvml.queue_wait_error` (event-set delivery), :meth:`FakeNvml.set_migs` (MIG
reconfiguration: old MIG handles become invalid), call counting per function and per device.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

# nvmlReturn_t values used here (nvml.h; the same numbers pynvml defines)
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
NO_DATA = 21
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999

NO_INSTANCE = 0xFFFFFFFF  # event gpuInstanceId/computeInstanceId for "whole GPU"

GiB = 1024**3
MiB = 1024**2

# NVML_VALUE_TYPE_* -> member of c_nvmlValue_t
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# Field ids the builder fills (nvml.h NVML_FI_DEV_*), with the value type real drivers report.
FI_ECC_SBE_VOL, FI_ECC_DBE_VOL, FI_ECC_SBE_AGG, FI_ECC_DBE_AGG = 3, 4, 5, 6
FI_RETIRED_SBE, FI_RETIRED_DBE, FI_RETIRED_PENDING = 29, 30, 31
FI_MEMORY_TEMP, FI_ENERGY = 82, 83
FI_PCIE_REPLAY = 94
FI_REMAPPED_COR, FI_REMAPPED_UNC, FI_REMAPPED_PENDING, FI_REMAPPED_FAILURE = 142, 143, 144, 145
FI_POWER_AVERAGE, FI_POWER_INSTANT = 185, 186
FI_RECOVERY_ACTION = 230
# NVML_FI_DEV_PERF_POLICY_* (throttle time, ns) -> the NVML_PERF_POLICY_* nvmlDeviceGetViolationStatus takes
FI_PERF_POLICY = {74: 0, 75: 1, 76: 2, 77: 3, 78: 4, 79: 5, 80: 10, 81: 11}
_FIELD_TYPES = {
    FI_ECC_SBE_VOL: 3, FI_ECC_DBE_VOL: 3, FI_ECC_SBE_AGG: 3, FI_ECC_DBE_AGG: 3,
    FI_RETIRED_SBE: 3, FI_RETIRED_DBE: 3, FI_RETIRED_PENDING: 1,
    FI_MEMORY_TEMP: 1, FI_ENERGY: 3, FI_PCIE_REPLAY: 1,
    FI_REMAPPED_COR: 1, FI_REMAPPED_UNC: 1, FI_REMAPPED_PENDING: 1, FI_REMAPPED_FAILURE: 1,
    FI_POWER_AVERAGE: 1, FI_POWER_INSTANT: 1, FI_RECOVERY_ACTION: 1,
}  # fmt: skip

DEFAULT_EVENT_TYPES = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventMigConfigChange
    | pynvml.nvmlEventTypeGpuUnavailableError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)


def ok(value: Any) -> dict:
    return {"ret": SUCCESS, "value": value}


def err(code: int) -> dict:
    return {"ret": code, "value": None}


# --------------------------------------------------------------------------------------------
# Builders: convenient dataclasses that compile into the raw "calls" maps
# --------------------------------------------------------------------------------------------


@dataclass
class FakeMig:
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    profile: str = "1g.10gb"  # appears in the MIG device name "<parent> MIG 1g.10gb"
    gi_profile_id: int = 19
    slice_count: int = 1
    placement_start: int = 0
    placement_size: int = 1
    memory_total: int = 10 * GiB
    memory_used: int = 0
    processes: dict[int, int | None] = field(default_factory=dict)
    gpm: dict[int, float] = field(default_factory=dict)  # GPM metric id -> percent
    slot: int | None = None  # index for nvmlDeviceGetMigDeviceHandleByIndex (default: position)

    def calls(self, parent_name: str) -> dict[str, list[dict]]:
        c: dict[str, list[dict]] = {
            "nvmlDeviceGetUUID": [ok(self.uuid)],
            "nvmlDeviceGetName": [ok(f"{parent_name} MIG {self.profile}")],
            "nvmlDeviceGetGpuInstanceId": [ok(self.gpu_instance_id)],
            "nvmlDeviceGetComputeInstanceId": [ok(self.compute_instance_id)],
            "nvmlDeviceGetMemoryInfo_v2": [ok(_mem_v2(self.memory_total, 0, self.memory_used))],
            "nvmlDeviceGetMemoryInfo": [ok(_mem_v1(self.memory_total, self.memory_used))],
            "nvmlGpuInstanceGetInfo": [
                ok({"id": self.gpu_instance_id, "profileId": self.gi_profile_id,
                    "placement": {"start": self.placement_start, "size": self.placement_size}})
            ],
            "nvmlDeviceGetComputeRunningProcesses_v3": [ok(_procs(self.processes, self.gpu_instance_id, self.compute_instance_id))],
        }  # fmt: skip
        for mid, pct in self.gpm.items():
            c[f"nvmlGpmMetricsGet:{mid}"] = [ok(pct)]
        return c


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:3B:00.0"
    minor: int = 0
    serial: str = "1650123456789"
    memory_total: int = 80 * GiB
    memory_reserved: int = 512 * MiB
    memory_used: int = 1 * GiB
    utilization_gpu: int = 0  # percent
    utilization_memory: int = 0
    power_mw: int = 100_000
    energy_mj: int = 1_000_000
    temperature_c: int = 40
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    clock_event_reasons: int = 0
    # field id -> raw value; None to make that field answer NOT_SUPPORTED. Defaults: no errors.
    fields: dict[int, int | float | None] = field(default_factory=dict)
    gpm_supported: bool = False
    gpm: dict[int, float] = field(default_factory=dict)
    processes: dict[int, int | None] = field(default_factory=dict)
    supported_events: int = DEFAULT_EVENT_TYPES
    mig_mode: bool | None = None  # None: GPU not MIG-capable (NOT_SUPPORTED)
    max_mig_devices: int = 7
    migs: list[FakeMig] = field(default_factory=list)

    def field_values(self) -> dict[int, int | float | None]:
        vals: dict[int, int | float | None] = {
            FI_ECC_SBE_VOL: 0, FI_ECC_DBE_VOL: 0, FI_ECC_SBE_AGG: 0, FI_ECC_DBE_AGG: 0,
            FI_RETIRED_SBE: 0, FI_RETIRED_DBE: 0, FI_RETIRED_PENDING: 0,
            FI_MEMORY_TEMP: self.temperature_c + 5, FI_ENERGY: self.energy_mj, FI_PCIE_REPLAY: 0,
            FI_REMAPPED_COR: 0, FI_REMAPPED_UNC: 0, FI_REMAPPED_PENDING: 0, FI_REMAPPED_FAILURE: 0,
            FI_POWER_AVERAGE: self.power_mw, FI_POWER_INSTANT: self.power_mw, FI_RECOVERY_ACTION: 0,
            **dict.fromkeys(FI_PERF_POLICY, 0),
        }  # fmt: skip
        vals.update(self.fields)
        return vals

    def calls(self) -> dict[str, list[dict]]:
        fv = self.field_values()

        def fld(fid: int) -> dict:
            v = fv.get(fid)
            return ok(v) if v is not None else err(NOT_SUPPORTED)

        c: dict[str, list[dict]] = {
            "nvmlDeviceGetUUID": [ok(self.uuid)],
            "nvmlDeviceGetName": [ok(self.name)],
            "nvmlDeviceGetSerial": [ok(self.serial)],
            "nvmlDeviceGetMinorNumber": [ok(self.minor)],
            "nvmlDeviceGetPciInfo_v3": [ok({"busId": self.pci_bus_id})],
            "nvmlDeviceGetMemoryInfo_v2": [ok(_mem_v2(self.memory_total, self.memory_reserved, self.memory_used))],
            "nvmlDeviceGetMemoryInfo": [ok(_mem_v1(self.memory_total, self.memory_used + self.memory_reserved))],
            "nvmlDeviceGetPowerUsage": [ok(self.power_mw)],
            "nvmlDeviceGetTotalEnergyConsumption": [ok(self.energy_mj)],
            "nvmlDeviceGetTemperatureV:0": [ok(self.temperature_c)],
            "nvmlDeviceGetTemperature:0": [ok(self.temperature_c)],
            "nvmlDeviceGetClockInfo:1": [ok(self.sm_clock_mhz)],
            "nvmlDeviceGetClockInfo:2": [ok(self.mem_clock_mhz)],
            "nvmlDeviceGetCurrentClocksEventReasons": [ok(self.clock_event_reasons)],
            "nvmlDeviceGetCurrentClocksThrottleReasons": [ok(self.clock_event_reasons)],
            "nvmlDeviceGetFieldValues": [ok({str(fid): _fv(fid, v) for fid, v in fv.items()})],
            # direct-call equivalents of the fields (used when the batch call is missing)
            "nvmlDeviceGetTotalEccErrors:0:0": [fld(FI_ECC_SBE_VOL)],
            "nvmlDeviceGetTotalEccErrors:1:0": [fld(FI_ECC_DBE_VOL)],
            "nvmlDeviceGetTotalEccErrors:0:1": [fld(FI_ECC_SBE_AGG)],
            "nvmlDeviceGetTotalEccErrors:1:1": [fld(FI_ECC_DBE_AGG)],
            "nvmlDeviceGetRetiredPages_v2:0": [fld(FI_RETIRED_SBE)],
            "nvmlDeviceGetRetiredPages_v2:1": [fld(FI_RETIRED_DBE)],
            "nvmlDeviceGetRetiredPagesPendingStatus": [fld(FI_RETIRED_PENDING)],
            "nvmlDeviceGetPcieReplayCounter": [fld(FI_PCIE_REPLAY)],
            "nvmlDeviceGetComputeRunningProcesses_v3": [ok(_procs(self.processes))],
            "nvmlDeviceGetSupportedEventTypes": [ok(self.supported_events)],
            "nvmlGpmQueryDeviceSupport": [ok(1 if self.gpm_supported else 0)],
        }  # fmt: skip
        for fid, policy in FI_PERF_POLICY.items():
            c[f"nvmlDeviceGetViolationStatus:{policy}"] = [fld(fid)]
        remap = [fv.get(i) for i in (FI_REMAPPED_COR, FI_REMAPPED_UNC, FI_REMAPPED_PENDING, FI_REMAPPED_FAILURE)]
        c["nvmlDeviceGetRemappedRows"] = [ok(remap) if None not in remap else err(NOT_SUPPORTED)]
        if self.mig_mode is None:
            c["nvmlDeviceGetMigMode"] = [err(NOT_SUPPORTED)]
        else:
            c["nvmlDeviceGetMigMode"] = [ok([int(self.mig_mode), int(self.mig_mode)])]
            c["nvmlDeviceGetMaxMigDeviceCount"] = [ok(self.max_mig_devices)]
        if not self.mig_mode:
            # nvml.h: utilization rates are not supported on MIG-enabled GPUs
            c["nvmlDeviceGetUtilizationRates"] = [ok({"gpu": self.utilization_gpu, "memory": self.utilization_memory})]
        for mid, pct in self.gpm.items():
            c[f"nvmlGpmMetricsGet:{mid}"] = [ok(pct)]
        for m in self.migs:
            c[f"nvmlDeviceGetGpuInstanceProfileInfoByIdV:{m.gi_profile_id}"] = [
                ok({"id": m.gi_profile_id, "sliceCount": m.slice_count,
                    "memorySizeMB": m.memory_total // MiB, "name": f"MIG {m.profile}"})
            ]  # fmt: skip
        return c


def _mem_v2(total: int, reserved: int, used: int) -> dict:
    return {"total": total, "reserved": reserved, "used": used, "free": total - reserved - used}


def _mem_v1(total: int, used: int) -> dict:
    return {"total": total, "used": used, "free": total - used}


def _procs(procs: dict[int, int | None], gi: int = NO_INSTANCE, ci: int = NO_INSTANCE) -> list[dict]:
    return [{"pid": p, "usedGpuMemory": b, "gpuInstanceId": gi, "computeInstanceId": ci} for p, b in procs.items()]


def _fv(fid: int, v: int | float | None) -> dict:
    if v is None:
        return {"ret": NOT_SUPPORTED, "type": 0, "value": 0}
    vtype = 0 if isinstance(v, float) else _FIELD_TYPES.get(fid, 3)
    return {"ret": SUCCESS, "type": vtype, "value": v}


# --------------------------------------------------------------------------------------------
# Runtime objects behind the opaque handles
# --------------------------------------------------------------------------------------------


class _Device:
    """A full GPU or a MIG device as the fake library sees it."""

    def __init__(self, calls: dict[str, list[dict]], parent: _Device | None = None, slot: int = 0) -> None:
        self.calls = calls
        self.parent = parent
        self.slot = slot  # MIG: index under the parent
        self.migs: list[_Device] = []
        self.address = 0
        self.gi_address = 0  # MIG: handle of its GPU instance

    @property
    def uuid(self) -> str:
        return str(self.calls["nvmlDeviceGetUUID"][0]["value"])

    def result(self, key: str, cycle: int) -> dict:
        seq = self.calls.get(key)
        if not seq:
            return err(NOT_SUPPORTED)
        return seq[min(cycle, len(seq) - 1)]

    def scalar(self, key: str, default: Any = None) -> Any:
        r = self.result(key, 0)
        return r["value"] if r["ret"] == SUCCESS else default


@dataclass
class _GpmSample:
    device: _Device | None = None
    seq: int = 0
    cycle: int = 0


@dataclass
class _EventSet:
    registrations: dict[int, int] = field(default_factory=dict)  # device address -> event mask
    queue: list[Any] = field(default_factory=list)  # dict events or int error codes


class Hang:
    """One injected hang: calls matching it block until :meth:`release`."""

    def __init__(self, function: str, uuid: str | None) -> None:
        self.function = function
        self.uuid = uuid
        self.entered = threading.Event()  # set when a call is blocked in it
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait(self) -> None:
        self.entered.set()
        self._released.wait()

    @property
    def released(self) -> bool:
        return self._released.is_set()


class _Symbol:
    """One exported C symbol. An object (not a bound method) so pynvml may set ``restype``."""

    def __init__(self, fake: FakeNvml, name: str, impl: Callable[..., int]) -> None:
        self._fake = fake
        self._name = name
        self._impl = impl
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        self._fake._count(self._name)
        return self._impl(*args)


class FakeNvmlLibrary:
    """The object assigned to ``pynvml.nvmlLib``: attribute lookup = ``dlsym``."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake
        self._symbols: dict[str, _Symbol] = {}

    def __getattr__(self, name: str) -> _Symbol:
        fake = self.__dict__["_fake"]
        if not name.startswith("nvml") or name in fake.missing:
            raise AttributeError(name)
        impl = getattr(fake, name, None)
        if impl is None:
            raise AttributeError(name)
        sym = self._symbols.get(name)
        if sym is None:
            sym = self._symbols[name] = _Symbol(fake, name, impl)
        return sym


def _int(x: Any) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


def _addr(ptr: Any) -> int:
    """Address held by a ctypes pointer (an opaque NVML handle)."""
    if ptr is None:
        return 0
    return ctypes.cast(ptr, ctypes.c_void_p).value or 0


def _store_handle(ref: Any, address: int) -> None:
    """Write an opaque handle through ``byref(handle)``."""
    ctypes.c_void_p.from_address(ctypes.addressof(ref._obj)).value = address


# --------------------------------------------------------------------------------------------
# The fake library
# --------------------------------------------------------------------------------------------


class FakeNvml:
    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver_version: str = "550.54.15",
        init_ret: int = SUCCESS,
        raw_devices: list[dict] | None = None,
    ) -> None:
        self.driver_version = driver_version
        self.init_ret = init_ret
        self.cycle = 0
        self.missing: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.device_counts: Counter[tuple[str, str]] = Counter()  # (uuid, function) -> calls
        self.field_requests: dict[str, list[list[int]]] = {}  # uuid -> field ids per call
        self.initialized = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._failures: dict[tuple[str, str], int] = {}
        self._hangs: list[Hang] = []
        # Opaque handles are addresses inside this buffer: stable, unique and non-NULL for the
        # fake's lifetime, so pynvml can pass them around as real pointers.
        self._arena = (ctypes.c_uint8 * (1 << 16))()
        self._next_slot = 1
        self._objects: dict[int, Any] = {}
        self.gpus: list[_Device] = []
        self._gpm_seq = 0
        self._lib = FakeNvmlLibrary(self)
        if gpus:
            for g in gpus:
                self._add_gpu(g.calls(), [(m.slot if m.slot is not None else i, m.calls(g.name)) for i, m in enumerate(g.migs)])
        for d in raw_devices or []:
            self._add_gpu(d["calls"], [(m.get("slot", i), m["calls"]) for i, m in enumerate(d.get("mig_devices", []))])

    @property
    def lib(self) -> FakeNvmlLibrary:
        """The object to assign to ``pynvml.nvmlLib`` (see :func:`installed`)."""
        return self._lib

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_fixture(cls, fixture: dict | str | Path) -> FakeNvml:
        """Build from a recorded/hand-written fixture (see tests/fixtures/nvml/README.md)."""
        if not isinstance(fixture, dict):
            fixture = json.loads(Path(fixture).read_text())
        system = fixture.get("system", {})
        drv = system.get("nvmlSystemGetDriverVersion", ok(""))
        return cls(driver_version=str(drv.get("value") or ""), raw_devices=copy.deepcopy(fixture["devices"]))

    def _new_address(self, obj: Any) -> int:
        with self._lock:
            addr = ctypes.addressof(self._arena) + 16 * self._next_slot
            self._next_slot += 1
            self._objects[addr] = obj
            return addr

    def _add_gpu(self, calls: dict[str, list[dict]], migs: list[tuple[int, dict]]) -> _Device:
        dev = _Device(calls)
        dev.address = self._new_address(dev)
        self.gpus.append(dev)
        self._attach_migs(dev, migs)
        return dev

    def _attach_migs(self, parent: _Device, migs: list[tuple[int, dict]]) -> None:
        for slot, calls in migs:
            m = _Device(calls, parent=parent, slot=slot)
            m.address = self._new_address(m)
            m.gi_address = self._new_address(("gi", m))
            parent.migs.append(m)

    # ---- test controls ---------------------------------------------------------------------

    def device(self, uuid: str) -> _Device:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
            for m in g.migs:
                if m.uuid == uuid:
                    return m
        raise KeyError(uuid)

    def set_result(self, uuid: str, key: str, value: Any = None, ret: int = SUCCESS) -> None:
        """Replace one call key's results on a device (one value for all cycles)."""
        with self._lock:
            self.device(uuid).calls[key] = [{"ret": ret, "value": value}]

    def set_field(self, uuid: str, field_id: int, value: int | float | None) -> None:
        """Change one field id inside the nvmlDeviceGetFieldValues results (None: NOT_SUPPORTED)."""
        with self._lock:
            dev = self.device(uuid)
            seq = dev.calls.setdefault("nvmlDeviceGetFieldValues", [ok({})])
            for entry in seq:
                entry["value"][str(field_id)] = _fv(field_id, value)

    def fail(self, uuid: str, function: str = "*", code: int = GPU_IS_LOST) -> None:
        """Make calls on ``uuid`` return ``code``. ``"*"``: every device call (MIG children of a
        failed GPU fail too, as they do on real hardware)."""
        with self._lock:
            self._failures[(uuid, function)] = code

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def remove_function(self, name: str) -> None:
        """Drop a symbol from the library: pynvml raises NVMLError_FunctionNotFound."""
        with self._lock:
            self.missing.add(name)
            pynvml._nvmlGetFunctionPointer_cache.pop(name, None)

    def hang(self, function: str, uuid: str | None = None) -> Hang:
        h = Hang(function, uuid)
        with self._lock:
            self._hangs.append(h)
        return h

    def release_all(self) -> None:
        with self._lock:
            hangs = list(self._hangs)
        for h in hangs:
            h.release()

    def advance(self, cycles: int = 1) -> None:
        with self._lock:
            self.cycle += cycles

    def set_migs(self, uuid: str, migs: list[FakeMig]) -> None:
        """Reconfigure MIG on a GPU. Handles of the old MIG devices stop working."""
        with self._lock:
            parent = self.device(uuid)
            for m in parent.migs:
                self._objects.pop(m.address, None)
                self._objects.pop(m.gi_address, None)
            parent.migs = []
            name = str(parent.scalar("nvmlDeviceGetName", ""))
            self._attach_migs(parent, [(m.slot if m.slot is not None else i, m.calls(name)) for i, m in enumerate(migs)])
            for m in migs:
                parent.calls[f"nvmlDeviceGetGpuInstanceProfileInfoByIdV:{m.gi_profile_id}"] = [
                    ok({"id": m.gi_profile_id, "sliceCount": m.slice_count,
                        "memorySizeMB": m.memory_total // MiB, "name": f"MIG {m.profile}"})
                ]  # fmt: skip

    def queue_event(
        self,
        uuid: str,
        event_type: int,
        data: int = 0,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> int:
        """Deliver an event to every event set where the (parent) GPU is registered for that
        type. A MIG uuid is delivered on its parent with the instance ids filled in. Returns the
        number of event sets it was queued on."""
        with self._lock:
            dev = self.device(uuid)
            gi = ci = NO_INSTANCE
            if dev.parent is not None:
                gi = int(dev.scalar("nvmlDeviceGetGpuInstanceId", NO_INSTANCE))
                ci = int(dev.scalar("nvmlDeviceGetComputeInstanceId", NO_INSTANCE))
                dev = dev.parent
            if gpu_instance_id is not None:
                gi = gpu_instance_id
            if compute_instance_id is not None:
                ci = compute_instance_id
            n = 0
            for obj in self._objects.values():
                if isinstance(obj, _EventSet) and obj.registrations.get(dev.address, 0) & event_type:
                    obj.queue.append({"device": dev.address, "type": event_type, "data": data, "gi": gi, "ci": ci})
                    n += 1
            self._cond.notify_all()
            return n

    def queue_wait_error(self, code: int) -> None:
        """Make the next nvmlEventSetWait on every event set return ``code``."""
        with self._lock:
            for obj in self._objects.values():
                if isinstance(obj, _EventSet):
                    obj.queue.append(code)
            self._cond.notify_all()

    def event_sets(self) -> list[_EventSet]:
        with self._lock:
            return [o for o in self._objects.values() if isinstance(o, _EventSet)]

    def calls_on(self, uuid: str, function: str) -> int:
        with self._lock:
            return self.device_counts[(uuid, function)]

    # ---- plumbing shared by the C symbols --------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def _dev(self, handle: Any) -> _Device | None:
        with self._lock:
            obj = self._objects.get(_addr(handle))
        return obj if isinstance(obj, _Device) else None

    def _enter(self, name: str, dev: _Device | None) -> int:
        """Common prologue of a device call: init check, counting, hang, failure injection."""
        if dev is None:
            return INVALID_ARGUMENT
        with self._lock:
            if self.initialized <= 0:
                return UNINITIALIZED
            self.device_counts[(dev.uuid, name)] += 1
            hangs = [h for h in self._hangs if h.function == name and h.uuid in (None, dev.uuid) and not h.released]
        for h in hangs:
            h.wait()
        with self._lock:
            for d in (dev, dev.parent):
                if d is None:
                    continue
                for key in ((d.uuid, name), (d.uuid, "*")):
                    if key in self._failures and (d is dev or key[1] == "*"):
                        return self._failures[key]
        return SUCCESS

    def _get(self, name: str, dev: _Device | None, key: str | None = None) -> tuple[int, Any]:
        rc = self._enter(name, dev)
        if rc != SUCCESS:
            return rc, None
        assert dev is not None
        with self._lock:
            r = dev.result(key or name, self.cycle)
        return int(r["ret"]), copy.deepcopy(r["value"])

    def _out_scalar(self, name: str, handle: Any, ref: Any, key: str | None = None) -> int:
        rc, v = self._get(name, self._dev(handle), key)
        if rc == SUCCESS:
            ref._obj.value = int(v)
        return rc

    def _out_string(self, name: str, handle: Any, buf: Any, size: Any) -> int:
        rc, v = self._get(name, self._dev(handle))
        if rc != SUCCESS:
            return rc
        raw = str(v).encode()
        if len(raw) + 1 > _int(size):
            return INSUFFICIENT_SIZE
        buf.value = raw
        return SUCCESS

    # ---- init / system ---------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: Any) -> int:
        if self.init_ret != SUCCESS:
            return self.init_ret
        with self._lock:
            self.initialized += 1
        return SUCCESS

    def nvmlInit_v2(self) -> int:
        return self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> int:
        with self._lock:
            if self.initialized <= 0:
                return UNINITIALIZED
            self.initialized -= 1
            self._cond.notify_all()
        return SUCCESS

    def nvmlErrorString(self, result: Any) -> bytes:
        return f"fake NVML error {_int(result)}".encode()

    def nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        if self.initialized <= 0:
            return UNINITIALIZED
        buf.value = self.driver_version.encode()
        return SUCCESS

    def nvmlDeviceGetCount_v2(self, ref: Any) -> int:
        if self.initialized <= 0:
            return UNINITIALIZED
        ref._obj.value = len(self.gpus)
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        i = _int(index)
        if not 0 <= i < len(self.gpus):
            return INVALID_ARGUMENT
        dev = self.gpus[i]
        rc = self._enter("nvmlDeviceGetHandleByIndex_v2", dev)
        if rc == SUCCESS:
            _store_handle(ref, dev.address)
        return rc

    # ---- identity --------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, h: Any, buf: Any, size: Any) -> int:
        return self._out_string("nvmlDeviceGetUUID", h, buf, size)

    def nvmlDeviceGetName(self, h: Any, buf: Any, size: Any) -> int:
        return self._out_string("nvmlDeviceGetName", h, buf, size)

    def nvmlDeviceGetSerial(self, h: Any, buf: Any, size: Any) -> int:
        return self._out_string("nvmlDeviceGetSerial", h, buf, size)

    def nvmlDeviceGetMinorNumber(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetMinorNumber", h, ref)

    def nvmlDeviceGetIndex(self, h: Any, ref: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceGetIndex", dev)
        if rc == SUCCESS:
            assert dev is not None
            ref._obj.value = dev.slot if dev.parent else self.gpus.index(dev)
        return rc

    def nvmlDeviceGetPciInfo_v3(self, h: Any, ref: Any) -> int:
        rc, v = self._get("nvmlDeviceGetPciInfo_v3", self._dev(h))
        if rc != SUCCESS:
            return rc
        info = ref._obj
        bus_id = str(v["busId"])
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id[-12:].encode()  # legacy form has a 4-digit domain
        for k in ("domain", "bus", "device", "pciDeviceId", "pciSubSystemId"):
            if k in v:
                setattr(info, k, int(v[k]))
        return SUCCESS

    # ---- memory / utilization / power / thermal / clocks -----------------------------------

    def nvmlDeviceGetMemoryInfo_v2(self, h: Any, ref: Any) -> int:
        mem = ref._obj
        if mem.version != pynvml.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        rc, v = self._get("nvmlDeviceGetMemoryInfo_v2", self._dev(h))
        if rc == SUCCESS:
            for k in ("total", "reserved", "free", "used"):
                setattr(mem, k, int(v[k]))
        return rc

    def nvmlDeviceGetMemoryInfo(self, h: Any, ref: Any) -> int:
        rc, v = self._get("nvmlDeviceGetMemoryInfo", self._dev(h))
        if rc == SUCCESS:
            for k in ("total", "free", "used"):
                setattr(ref._obj, k, int(v[k]))
        return rc

    def nvmlDeviceGetUtilizationRates(self, h: Any, ref: Any) -> int:
        rc, v = self._get("nvmlDeviceGetUtilizationRates", self._dev(h))
        if rc == SUCCESS:
            ref._obj.gpu = int(v["gpu"])
            ref._obj.memory = int(v["memory"])
        return rc

    def nvmlDeviceGetPowerUsage(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetPowerUsage", h, ref)

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetTotalEnergyConsumption", h, ref)

    def nvmlDeviceGetTemperatureV(self, h: Any, ref: Any) -> int:
        t = ref._obj
        if t.version != pynvml.nvmlTemperature_v1:
            return ARGUMENT_VERSION_MISMATCH
        rc, v = self._get("nvmlDeviceGetTemperatureV", self._dev(h), f"nvmlDeviceGetTemperatureV:{int(t.sensorType)}")
        if rc == SUCCESS:
            t.temperature = int(v)
        return rc

    def nvmlDeviceGetTemperature(self, h: Any, sensor: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetTemperature", h, ref, f"nvmlDeviceGetTemperature:{_int(sensor)}")

    def nvmlDeviceGetClockInfo(self, h: Any, clock: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetClockInfo", h, ref, f"nvmlDeviceGetClockInfo:{_int(clock)}")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetCurrentClocksEventReasons", h, ref)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetCurrentClocksThrottleReasons", h, ref)

    # ---- field values and their direct equivalents -----------------------------------------

    def nvmlDeviceGetFieldValues(self, h: Any, count: Any, ref: Any) -> int:
        dev = self._dev(h)
        n = _int(count)
        values = ref._obj
        if dev is not None:
            with self._lock:
                self.field_requests.setdefault(dev.uuid, []).append([int(values[i].fieldId) for i in range(n)])
        rc, table = self._get("nvmlDeviceGetFieldValues", dev)
        if rc != SUCCESS:
            return rc
        for i in range(n):
            fv = values[i]
            entry = table.get(str(int(fv.fieldId)))
            fv.timestamp = 1_700_000_000_000_000 + self.cycle
            fv.latencyUsec = 3
            if entry is None:
                fv.nvmlReturn = NOT_SUPPORTED
                continue
            fv.nvmlReturn = int(entry["ret"])
            fv.valueType = int(entry.get("type", 3))
            if fv.nvmlReturn == SUCCESS:
                member = _VALUE_MEMBER[fv.valueType]
                raw = entry["value"]
                setattr(fv.value, member, float(raw) if member == "dVal" else int(raw))
        return SUCCESS

    def nvmlDeviceGetTotalEccErrors(self, h: Any, etype: Any, counter: Any, ref: Any) -> int:
        key = f"nvmlDeviceGetTotalEccErrors:{_int(etype)}:{_int(counter)}"
        return self._out_scalar("nvmlDeviceGetTotalEccErrors", h, ref, key)

    def nvmlDeviceGetRetiredPages_v2(self, h: Any, cause: Any, count_ref: Any, pages: Any = None, times: Any = None) -> int:
        rc, n = self._get("nvmlDeviceGetRetiredPages_v2", self._dev(h), f"nvmlDeviceGetRetiredPages_v2:{_int(cause)}")
        if rc != SUCCESS:
            return rc
        n = int(n)
        if pages is None:
            count_ref._obj.value = n
            return INSUFFICIENT_SIZE if n else SUCCESS
        if count_ref._obj.value < n:
            count_ref._obj.value = n
            return INSUFFICIENT_SIZE
        for i in range(n):
            pages[i] = 0x1000 * (i + 1)
            times[i] = 1_700_000_000 + i
        count_ref._obj.value = n
        return SUCCESS

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetRetiredPagesPendingStatus", h, ref)

    def nvmlDeviceGetRemappedRows(self, h: Any, cor: Any, unc: Any, pending: Any, failure: Any) -> int:
        rc, v = self._get("nvmlDeviceGetRemappedRows", self._dev(h))
        if rc == SUCCESS:
            for ref, x in zip((cor, unc, pending, failure), v, strict=False):
                ref._obj.value = int(x)
        return rc

    def nvmlDeviceGetPcieReplayCounter(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetPcieReplayCounter", h, ref)

    def nvmlDeviceGetViolationStatus(self, h: Any, policy: Any, ref: Any) -> int:
        rc, v = self._get("nvmlDeviceGetViolationStatus", self._dev(h), f"nvmlDeviceGetViolationStatus:{_int(policy)}")
        if rc == SUCCESS:
            ref._obj.referenceTime = 1_700_000_000_000_000 + self.cycle  # CPU timestamp, us
            ref._obj.violationTime = int(v)
        return rc

    # ---- processes -------------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Any, count_ref: Any, procs: Any) -> int:
        rc, items = self._get("nvmlDeviceGetComputeRunningProcesses_v3", self._dev(h))
        if rc != SUCCESS:
            return rc
        n = len(items)
        if procs is None:
            count_ref._obj.value = n
            return INSUFFICIENT_SIZE if n else SUCCESS
        if count_ref._obj.value < n:
            count_ref._obj.value = n
            return INSUFFICIENT_SIZE
        for i, p in enumerate(items):
            procs[i].pid = int(p["pid"])
            used = p.get("usedGpuMemory")
            procs[i].usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else int(used)
            procs[i].gpuInstanceId = int(p.get("gpuInstanceId", NO_INSTANCE))
            procs[i].computeInstanceId = int(p.get("computeInstanceId", NO_INSTANCE))
        count_ref._obj.value = n
        return SUCCESS

    # ---- MIG -------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, h: Any, cur: Any, pending: Any) -> int:
        rc, v = self._get("nvmlDeviceGetMigMode", self._dev(h))
        if rc == SUCCESS:
            cur._obj.value, pending._obj.value = int(v[0]), int(v[1])
        return rc

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetMaxMigDeviceCount", h, ref)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: Any, ref: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", dev)
        if rc != SUCCESS:
            return rc
        assert dev is not None
        if dev.parent is not None:
            return INVALID_ARGUMENT
        i = _int(index)
        if i >= int(dev.scalar("nvmlDeviceGetMaxMigDeviceCount", 0)):
            return INVALID_ARGUMENT
        with self._lock:
            for m in dev.migs:
                if m.slot == i:
                    _store_handle(ref, m.address)
                    return SUCCESS
        return NOT_FOUND

    def nvmlDeviceIsMigDeviceHandle(self, h: Any, ref: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceIsMigDeviceHandle", dev)
        if rc == SUCCESS:
            assert dev is not None
            ref._obj.value = int(dev.parent is not None)
        return rc

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: Any, ref: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", dev)
        if rc == SUCCESS:
            assert dev is not None
            if dev.parent is None:
                return INVALID_ARGUMENT
            _store_handle(ref, dev.parent.address)
        return rc

    def nvmlDeviceGetGpuInstanceId(self, h: Any, ref: Any) -> int:
        dev = self._dev(h)
        if dev is not None and dev.parent is None:
            return INVALID_ARGUMENT
        return self._out_scalar("nvmlDeviceGetGpuInstanceId", h, ref)

    def nvmlDeviceGetComputeInstanceId(self, h: Any, ref: Any) -> int:
        dev = self._dev(h)
        if dev is not None and dev.parent is None:
            return INVALID_ARGUMENT
        return self._out_scalar("nvmlDeviceGetComputeInstanceId", h, ref)

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi_id: Any, ref: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceGetGpuInstanceById", dev)
        if rc != SUCCESS:
            return rc
        assert dev is not None
        gi = _int(gi_id)
        with self._lock:
            for m in dev.migs:
                if int(m.scalar("nvmlDeviceGetGpuInstanceId", -1)) == gi:
                    _store_handle(ref, m.gi_address)
                    return SUCCESS
        return NOT_FOUND

    def nvmlGpuInstanceGetInfo(self, gi_handle: Any, ref: Any) -> int:
        with self._lock:
            obj = self._objects.get(_addr(gi_handle))
        if not (isinstance(obj, tuple) and obj[0] == "gi"):
            return INVALID_ARGUMENT
        mig: _Device = obj[1]
        rc, v = self._get("nvmlGpuInstanceGetInfo", mig)
        if rc == SUCCESS:
            info = ref._obj
            assert mig.parent is not None
            info.device = ctypes.cast(mig.parent.address, pynvml.c_nvmlDevice_t)
            info.id = int(v["id"])
            info.profileId = int(v["profileId"])
            info.placement.start = int(v["placement"]["start"])
            info.placement.size = int(v["placement"]["size"])
        return rc

    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, h: Any, profile_id: Any, ref: Any) -> int:
        info = ref._obj
        if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return ARGUMENT_VERSION_MISMATCH
        pid = _int(profile_id)
        rc, v = self._get("nvmlDeviceGetGpuInstanceProfileInfoByIdV", self._dev(h), f"nvmlDeviceGetGpuInstanceProfileInfoByIdV:{pid}")
        if rc == SUCCESS:
            info.id = int(v.get("id", pid))
            info.sliceCount = int(v.get("sliceCount", 0))
            info.memorySizeMB = int(v.get("memorySizeMB", 0))
            info.name = str(v.get("name", "")).encode()
        return rc

    # ---- GPM -------------------------------------------------------------------------------

    def _gpm_supported(self, dev: _Device) -> bool:
        root = dev.parent or dev
        return bool(root.scalar("nvmlGpmQueryDeviceSupport", 0))

    def nvmlGpmQueryDeviceSupport(self, h: Any, ref: Any) -> int:
        sup = ref._obj
        if sup.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        rc, v = self._get("nvmlGpmQueryDeviceSupport", self._dev(h))
        if rc == SUCCESS:
            sup.isSupportedDevice = int(v)
        return rc

    def nvmlGpmSampleAlloc(self, ref: Any) -> int:
        _store_handle(ref, self._new_address(_GpmSample()))
        return SUCCESS

    def nvmlGpmSampleFree(self, sample: Any) -> int:
        with self._lock:
            obj = self._objects.pop(_addr(sample), None)
        return SUCCESS if isinstance(obj, _GpmSample) else INVALID_ARGUMENT

    def _take_sample(self, name: str, dev: _Device | None, sample: Any) -> int:
        rc = self._enter(name, dev)
        if rc != SUCCESS:
            return rc
        assert dev is not None
        if not self._gpm_supported(dev):
            return NOT_SUPPORTED
        with self._lock:
            s = self._objects.get(_addr(sample))
            if not isinstance(s, _GpmSample):
                return INVALID_ARGUMENT
            self._gpm_seq += 1
            s.device, s.seq, s.cycle = dev, self._gpm_seq, self.cycle
        return SUCCESS

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> int:
        return self._take_sample("nvmlGpmSampleGet", self._dev(h), sample)

    def nvmlGpmMigSampleGet(self, h: Any, gi_id: Any, sample: Any) -> int:
        parent = self._dev(h)
        rc = self._enter("nvmlGpmMigSampleGet", parent)
        if rc != SUCCESS:
            return rc
        assert parent is not None
        gi = _int(gi_id)
        with self._lock:
            mig = next((m for m in parent.migs if int(m.scalar("nvmlDeviceGetGpuInstanceId", -1)) == gi), None)
        if mig is None:
            return NOT_FOUND
        return self._take_sample("nvmlGpmMigSampleGet", mig, sample)

    def nvmlGpmMetricsGet(self, ref: Any) -> int:
        mg = ref._obj
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        with self._lock:
            s1 = self._objects.get(_addr(mg.sample1))
            s2 = self._objects.get(_addr(mg.sample2))
        # Metrics are a difference of two samples of the same device, older one first.
        if not (isinstance(s1, _GpmSample) and isinstance(s2, _GpmSample)):
            return INVALID_ARGUMENT
        if s1.device is None or s1.device is not s2.device or not s1.seq < s2.seq:
            return INVALID_ARGUMENT
        dev = s2.device
        rc = self._enter("nvmlGpmMetricsGet", dev)
        if rc != SUCCESS:
            return rc
        with self._lock:
            for i in range(int(mg.numMetrics)):
                m = mg.metrics[i]
                r = dev.result(f"nvmlGpmMetricsGet:{int(m.metricId)}", s2.cycle)
                if r["ret"] == SUCCESS and r["value"] is None:
                    r = err(NO_DATA)
                m.nvmlReturn = int(r["ret"])
                m.value = float(r["value"]) if r["ret"] == SUCCESS else 0.0
        return SUCCESS

    # ---- events ----------------------------------------------------------------------------

    def nvmlEventSetCreate(self, ref: Any) -> int:
        if self.initialized <= 0:
            return UNINITIALIZED
        _store_handle(ref, self._new_address(_EventSet()))
        return SUCCESS

    def nvmlEventSetFree(self, es: Any) -> int:
        with self._lock:
            obj = self._objects.pop(_addr(es), None)
            self._cond.notify_all()
        return SUCCESS if isinstance(obj, _EventSet) else INVALID_ARGUMENT

    def nvmlDeviceGetSupportedEventTypes(self, h: Any, ref: Any) -> int:
        return self._out_scalar("nvmlDeviceGetSupportedEventTypes", h, ref)

    def nvmlDeviceRegisterEvents(self, h: Any, mask: Any, es: Any) -> int:
        dev = self._dev(h)
        rc = self._enter("nvmlDeviceRegisterEvents", dev)
        if rc != SUCCESS:
            return rc
        assert dev is not None
        types = _int(mask)
        if types & ~int(dev.scalar("nvmlDeviceGetSupportedEventTypes", 0)):
            return NOT_SUPPORTED
        with self._lock:
            s = self._objects.get(_addr(es))
            if not isinstance(s, _EventSet):
                return INVALID_ARGUMENT
            s.registrations[dev.address] = s.registrations.get(dev.address, 0) | types
        return SUCCESS

    def nvmlEventSetWait_v2(self, es: Any, ref: Any, timeout_ms: Any) -> int:
        addr = _addr(es)
        with self._cond:
            s = self._objects.get(addr)
            if not isinstance(s, _EventSet):
                return INVALID_ARGUMENT
            # Like the real call: block up to the timeout, wake up as soon as something arrives.
            self._cond.wait_for(lambda: bool(s.queue) or self._objects.get(addr) is not s, _int(timeout_ms) / 1000.0)
            if not s.queue:
                return TIMEOUT
            item = s.queue.pop(0)
        if isinstance(item, int):
            return item
        data = ref._obj
        data.device = ctypes.cast(item["device"], pynvml.c_nvmlDevice_t)
        data.eventType = item["type"]
        data.eventData = item["data"]
        data.gpuInstanceId = item["gi"]
        data.computeInstanceId = item["ci"]
        return SUCCESS


# --------------------------------------------------------------------------------------------
# Installing into pynvml
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def installed(fake: FakeNvml) -> Iterator[FakeNvml]:
    """Make pynvml use ``fake`` as its NVML library for the duration of the block.

    pynvml keeps three pieces of global state: the library object, a per-name function-pointer
    cache and an init refcount. All three are saved and restored, so tests stay independent.
    Hangs still pending at exit are released so no worker thread stays blocked forever.
    """
    with pynvml.libLoadLock:
        saved = (pynvml.nvmlLib, dict(pynvml._nvmlGetFunctionPointer_cache), pynvml._nvmlLib_refcount)
        pynvml.nvmlLib = fake.lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
    try:
        yield fake
    finally:
        fake.release_all()
        with pynvml.libLoadLock:
            pynvml.nvmlLib, cache, pynvml._nvmlLib_refcount = saved
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlGetFunctionPointer_cache.update(cache)

