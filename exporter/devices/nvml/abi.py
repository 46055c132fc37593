"""NVML's ABI as this backend uses it: return codes, field ids, event bits, GPM metric ids, and
the decoding of a ``nvmlDeviceGetFieldValues`` batch.

The numbers are nvml.h's, spelled out so that older nvidia-ml-py releases (which may lack a
constant) work too. Nothing here calls the library.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from ..model import EventKind

try:  # nvidia-ml-py is a runtime dependency, but a broken install must not break import
    import pynvml
except Exception:  # pragma: no cover - exercised only without nvidia-ml-py
    pynvml = None

__all__ = [
    "DEVICE_FATAL",
    "ERR_ARGUMENT_VERSION_MISMATCH",
    "ERR_DRIVER_NOT_LOADED",
    "ERR_FUNCTION_NOT_FOUND",
    "ERR_GPU_IS_LOST",
    "ERR_GPU_NOT_FOUND",
    "ERR_INVALID_ARGUMENT",
    "ERR_LIB_RM_VERSION_MISMATCH",
    "ERR_NOT_FOUND",
    "ERR_NOT_SUPPORTED",
    "ERR_NO_PERMISSION",
    "ERR_RESET_REQUIRED",
    "ERR_UNINITIALIZED",
    "ERR_UNKNOWN",
    "EVENT_KINDS",
    "EVENT_MASK",
    "EV_DBE",
    "EV_GPU_UNAVAILABLE",
    "EV_MIG_CHANGE",
    "EV_RECOVERY_ACTION",
    "EV_SBE",
    "EV_XID",
    "FIELD_IDS",
    "FIELD_REQUESTS",
    "FI_ECC_DBE_AGG",
    "FI_ECC_DBE_VOL",
    "FI_ECC_SBE_AGG",
    "FI_ECC_SBE_VOL",
    "FI_ENERGY",
    "FI_MEMORY_TEMP",
    "FI_PCIE_REPLAY",
    "FI_POWER_AVERAGE",
    "FI_RECOVERY_ACTION",
    "FI_REMAPPED_COR",
    "FI_REMAPPED_FAILURE",
    "FI_REMAPPED_PENDING",
    "FI_REMAPPED_UNC",
    "FI_RETIRED_DBE",
    "FI_RETIRED_PENDING",
    "FI_RETIRED_SBE",
    "GPM_ANY_TENSOR",
    "GPM_DRAM_BW",
    "GPM_METRICS",
    "GPM_SM_OCCUPANCY",
    "GPM_SM_UTIL",
    "LIBRARY_MISMATCH",
    "NO_INSTANCE",
    "POWER_SCOPE_GPU",
    "SLOW_FIELDS",
    "SUCCESS",
    "THROTTLE_FIELDS",
    "UNSUPPORTED",
    "address",
    "decode_batch",
    "pynvml",
    "ratio",
]

# ---- return codes ------------------------------------------------------------------------------

SUCCESS = 0
ERR_UNINITIALIZED = 1
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_NOT_FOUND = 6
ERR_DRIVER_NOT_LOADED = 9
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
ERR_LIB_RM_VERSION_MISMATCH = 18
ERR_ARGUMENT_VERSION_MISMATCH = 25
ERR_GPU_NOT_FOUND = 28
ERR_UNKNOWN = 999

# "This device cannot do that": remember and stop asking.
UNSUPPORTED = frozenset({ERR_NOT_SUPPORTED, ERR_FUNCTION_NOT_FOUND, ERR_NO_PERMISSION, ERR_ARGUMENT_VERSION_MISMATCH})
# The device (or our handle to it) is unusable: fail the whole reading.
# INVALID_ARGUMENT on a handle we got from NVML means the handle died (MIG reconfiguration).
DEVICE_FATAL = frozenset({
    ERR_GPU_IS_LOST, ERR_UNKNOWN, ERR_RESET_REQUIRED, ERR_INVALID_ARGUMENT, ERR_UNINITIALIZED,
    ERR_DRIVER_NOT_LOADED, ERR_LIB_RM_VERSION_MISMATCH, ERR_GPU_NOT_FOUND,
})  # fmt: skip

# pynvml raises this (not an NVMLError) from unversioned wrappers such as
# nvmlDeviceGetComputeRunningProcesses when the driver lacks the versioned symbol.
LIBRARY_MISMATCH: Any = getattr(pynvml, "NVMLLibraryMismatchError", ()) if pynvml is not None else ()

# ---- field ids (nvmlDeviceGetFieldValues) ----------------------------------------------------

FI_ECC_SBE_VOL, FI_ECC_DBE_VOL, FI_ECC_SBE_AGG, FI_ECC_DBE_AGG = 3, 4, 5, 6
FI_RETIRED_SBE, FI_RETIRED_DBE, FI_RETIRED_PENDING = 29, 30, 31
FI_MEMORY_TEMP = 82
FI_ENERGY = 83  # mJ since driver load
FI_PCIE_REPLAY = 94
FI_REMAPPED_COR, FI_REMAPPED_UNC, FI_REMAPPED_PENDING, FI_REMAPPED_FAILURE = 142, 143, 144, 145
# POWER_AVERAGE is what nvmlDeviceGetPowerUsage returns on Ampere (non-GA100) and newer (1 s
# average, the number dcgm-exporter shows); older GPUs answer NOT_SUPPORTED and we fall back
# to nvmlDeviceGetPowerUsage, which is instantaneous there.
FI_POWER_AVERAGE = 185
POWER_SCOPE_GPU = 0
FI_RECOVERY_ACTION = 230
#: Time the clocks were held down, per reason: (field id, NVML_PERF_POLICY_* for the direct call
#: nvmlDeviceGetViolationStatus, the ``reason`` label). Nanoseconds since the driver loaded. The
#: fields are what NVML 13 points to from the deprecated call; the last two are totals (below
#: application clocks by any limiter, below base clocks), not reasons of their own.
THROTTLE_FIELDS: tuple[tuple[int, int, str], ...] = (
    (74, 0, "power"), (75, 1, "thermal"), (76, 2, "sync_boost"), (77, 3, "board_limit"),
    (78, 4, "low_utilization"), (79, 5, "reliability"), (80, 10, "total_app_clocks"), (81, 11, "total_base_clocks"),
)  # fmt: skip

#: Fields the driver answers slowly, read at most once per ``slow_counter_period_s``; between
#: reads the last value is reported (all are counters, so rate() over them is unchanged).
#: Measured on an H100 (driver 580.159.04, bench/nvml_hardware.py): the total-energy field costs
#: 3.2 ms of CPU per call and the PCIe replay counter 0.13 ms, every other field 2-7 us, so the
#: energy field alone was two thirds of a GPU's read and most of the agent's CPU at 1 s.
#: The throttle-time fields are not measured on hardware yet (bench/nvml_hardware.py times each
#: field of FIELD_REQUESTS): until they are, they are read on the slow schedule too, which costs
#: counters read through rate() over minutes nothing.
SLOW_FIELDS: frozenset[int] = frozenset({FI_ENERGY, FI_PCIE_REPLAY, *(f for f, _, _ in THROTTLE_FIELDS)})

#: (field id, scope id) requested in the one batched call per full GPU
FIELD_REQUESTS: tuple[tuple[int, int], ...] = tuple(
    (fid, POWER_SCOPE_GPU if fid == FI_POWER_AVERAGE else 0)
    for fid in (
        FI_ENERGY, FI_POWER_AVERAGE, FI_MEMORY_TEMP,
        FI_ECC_SBE_VOL, FI_ECC_DBE_VOL, FI_ECC_SBE_AGG, FI_ECC_DBE_AGG,
        FI_RETIRED_SBE, FI_RETIRED_DBE, FI_RETIRED_PENDING,
        FI_REMAPPED_COR, FI_REMAPPED_UNC, FI_REMAPPED_PENDING, FI_REMAPPED_FAILURE,
        FI_PCIE_REPLAY, FI_RECOVERY_ACTION, *(f for f, _, _ in THROTTLE_FIELDS),
    )
)  # fmt: skip
FIELD_IDS: tuple[int, ...] = tuple(f for f, _ in FIELD_REQUESTS)

# ---- GPM metric ids (percent 0..100) -> DeviceReading attribute (ratio 0..1) -------------------

GPM_SM_UTIL, GPM_SM_OCCUPANCY, GPM_ANY_TENSOR, GPM_DRAM_BW = 2, 3, 5, 10
GPM_METRICS: dict[int, str] = {
    GPM_SM_UTIL: "sm_active_ratio",
    GPM_SM_OCCUPANCY: "sm_occupancy_ratio",
    GPM_ANY_TENSOR: "tensor_active_ratio",
    GPM_DRAM_BW: "dram_active_ratio",
}

# ---- event types -------------------------------------------------------------------------------

EV_SBE, EV_DBE, EV_XID = 0x1, 0x2, 0x8
EV_MIG_CHANGE = 0x100
EV_GPU_UNAVAILABLE, EV_RECOVERY_ACTION = 0x4000, 0x8000
EVENT_MASK = EV_SBE | EV_DBE | EV_XID | EV_MIG_CHANGE | EV_GPU_UNAVAILABLE | EV_RECOVERY_ACTION
EVENT_KINDS = {
    EV_XID: EventKind.XID,
    EV_DBE: EventKind.ECC_DBE,
    EV_SBE: EventKind.ECC_SBE,
    EV_GPU_UNAVAILABLE: EventKind.GPU_LOST,
    EV_RECOVERY_ACTION: EventKind.RECOVERY_ACTION,
    EV_MIG_CHANGE: EventKind.MIG_CONFIG_CHANGE,
}
# c_nvmlEventData_t.gpuInstanceId / computeInstanceId when NVML cannot attribute an event
NO_INSTANCE = 0xFFFFFFFF

# ---- small conversions -------------------------------------------------------------------------


def address(handle: Any) -> int:
    """Opaque NVML handles are pointers; their address identifies the device."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def ratio(percent: float | int | None) -> float | None:
    if percent is None:
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


# ---- decoding a field-values batch -------------------------------------------------------------
# pynvml's structures convert bytes on every attribute read in a Python-level __getattribute__,
# which made decoding 16 values cost more than the NVML call itself. The batch is a plain C
# array, so it is read once as bytes and unpacked with the offsets of pynvml's own
# nvmlFieldValue_t (nothing hard-coded): ~2 us instead of ~19 us.

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


def decode_batch(values: Any, count: int) -> list[tuple[int, int | float | None]]:
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
            if ret == SUCCESS:
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
        if ret == SUCCESS:
            fmt = _VALUE_FORMAT.get(struct.unpack_from("@I", buf, base + type_at)[0])
            if fmt is not None:
                (value,) = struct.unpack_from(fmt, buf, base + value_at)
        out.append((ret, value))
    return out
