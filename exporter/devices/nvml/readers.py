"""What one NVML read asks, as a table (:data:`READERS`): each row fills part of a
``DeviceReading`` from one quantity's calls, in base units.

Which rows apply is decided once per device at enumeration (:func:`readers_for`): a MIG device
gets memory, GPM and processes only; power, temperature, clocks and the health counters stay on
the parent because they are physical, device-wide quantities. Order matters: memory first (the
cheapest call doubles as the liveness probe), then the full-GPU rows, GPM, processes.

Everything with a field id rides in ONE ``nvmlDeviceGetFieldValues`` call per full GPU
(:func:`read_counters`); direct calls stand in only when the batch call itself is missing (or
its lock is stuck), and for power and energy when their fields are unsupported: those fields
are newer than the direct calls, so an older driver or GPU answers the call but not the field.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from ..model import DeviceReading, RecoveryAction
from .abi import (
    ERR_GPU_IS_LOST,
    ERR_INVALID_ARGUMENT,
    ERR_UNKNOWN,
    FI_ECC_DBE_AGG,
    FI_ECC_DBE_VOL,
    FI_ECC_SBE_AGG,
    FI_ECC_SBE_VOL,
    FI_ENERGY,
    FI_MEMORY_TEMP,
    FI_PCIE_REPLAY,
    FI_POWER_AVERAGE,
    FI_RECOVERY_ACTION,
    FI_REMAPPED_COR,
    FI_REMAPPED_FAILURE,
    FI_REMAPPED_PENDING,
    FI_REMAPPED_UNC,
    FI_RETIRED_DBE,
    FI_RETIRED_PENDING,
    FI_RETIRED_SBE,
    FIELD_REQUESTS,
    GPM_METRICS,
    SLOW_FIELDS,
    SUCCESS,
    THROTTLE_FIELDS,
    UNSUPPORTED,
    decode_batch,
    pynvml,
    ratio,
)
from .device import CallFailed, Calls, Fallback, NvmlDevice, quiet

log = structlog.get_logger(__name__)

Reader = Callable[[Calls, NvmlDevice, DeviceReading], None]

# DataDog found nvmlDeviceGetFieldValues and the GPM sampling calls not thread safe in practice
# (wrong "unsupported" answers under concurrency), so they are serialised process-wide: NVML is
# one library per process. Trade-off: if one of these calls hangs in the driver while holding
# the lock, every other device would queue behind it. So the lock is held only around those
# calls, and taken with a timeout: a device that cannot get it within ``lock_timeout_s`` falls
# back to the (thread-safe) direct calls, or skips GPM, for that cycle instead of blocking.
BATCH_LOCK = threading.Lock()


# ---- memory ------------------------------------------------------------------------------------


def memory_info(calls: Calls, dev: NvmlDevice) -> Any:
    """Memory info v2 (``used`` excludes driver-reserved memory since R510), else v1."""
    fallbacks = dev.fallbacks.get("memory")
    if fallbacks is None:
        fallbacks = dev.fallbacks["memory"] = []
        v2 = getattr(pynvml, "nvmlMemory_v2", None)
        if v2 is not None:
            fallbacks.append(("memory_v2", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h, version=v2), (dev.handle,)))
        fallbacks.append(("memory_v1", pynvml.nvmlDeviceGetMemoryInfo, (dev.handle,)))
    return calls.first(dev, fallbacks)


def read_memory(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    mem = memory_info(calls, dev)
    if mem is not None:
        r.memory_used_bytes = int(mem.used)
        r.memory_total_bytes = int(mem.total)


# ---- full GPU: utilization, temperature, clocks ------------------------------------------------


def read_utilization(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    util = calls.call(dev, "utilization", pynvml.nvmlDeviceGetUtilizationRates, dev.handle)
    if util is not None:
        r.utilization_ratio = ratio(util.gpu)


def _physical_fallbacks(dev: NvmlDevice) -> None:
    """Temperature and clock-event reasons: the newer call where pynvml has it, else the old."""
    h = dev.handle
    temp_calls: list[Fallback] = []
    if hasattr(pynvml, "nvmlDeviceGetTemperatureV"):
        temp_calls.append(("temperature_v", pynvml.nvmlDeviceGetTemperatureV, (h, pynvml.NVML_TEMPERATURE_GPU)))
    temp_calls.append(("temperature", pynvml.nvmlDeviceGetTemperature, (h, pynvml.NVML_TEMPERATURE_GPU)))
    reason_calls: list[Fallback] = []
    if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons"):
        reason_calls.append(("clock_event_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons, (h,)))
    reason_calls.append(("clock_throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, (h,)))
    dev.fallbacks["temperature"], dev.fallbacks["clock_reasons"] = temp_calls, reason_calls


def _first_of(calls: Calls, dev: NvmlDevice, what: str) -> Any:
    """The first answer of ``what``'s fallback chain (the chains are made on first use)."""
    if what not in dev.fallbacks:
        _physical_fallbacks(dev)
    return calls.first(dev, dev.fallbacks[what])


def read_temperature(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    temp = _first_of(calls, dev, "temperature")
    if temp is not None:
        r.temperature_celsius = float(temp)


def read_clocks(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    h = dev.handle
    sm = calls.call(dev, "clock_sm", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
    if sm is not None:
        r.sm_clock_hertz = float(sm) * 1e6
    memclk = calls.call(dev, "clock_mem", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
    if memclk is not None:
        r.memory_clock_hertz = float(memclk) * 1e6


def read_clock_reasons(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    reasons = _first_of(calls, dev, "clock_reasons")
    if reasons is not None:
        r.clock_event_reasons = int(reasons)


# ---- full GPU: the batched counters ------------------------------------------------------------


def field_values(calls: Calls, dev: NvmlDevice) -> dict[int, int | float] | None:
    """One nvmlDeviceGetFieldValues call. None: no batch this cycle (call missing, or the
    lock is held by a stuck call), use the direct calls instead."""
    if "field_values" in dev.unsupported:
        return None
    if dev.field_requests is None or dev.fast_field_requests is None:
        dev.field_requests = [f for f in FIELD_REQUESTS if f[0] not in dev.unsupported_fields]
        dev.fast_field_requests = [f for f in dev.field_requests if f[0] not in SLOW_FIELDS]
    now = calls.clock()
    slow_due = now >= dev.slow_due
    fields = dev.field_requests if slow_due else dev.fast_field_requests
    if not fields:
        return dict(dev.slow_values)
    if not BATCH_LOCK.acquire(timeout=calls.lock_timeout_s):
        log.warning("nvml_field_values_lock_busy", uuid=dev.identity.uuid, fallback="direct calls")
        return None
    try:
        values = calls.call(dev, "field_values", pynvml.nvmlDeviceGetFieldValues, dev.handle, fields)
    finally:
        BATCH_LOCK.release()
    if values is None:
        return None if "field_values" in dev.unsupported else {}
    out: dict[int, int | float] = {}
    # NVML fills the array in request order, so the id comes from the request.
    for (fid, _scope), (ret, decoded) in zip(fields, decode_batch(values, len(fields)), strict=False):
        if ret == SUCCESS:
            if decoded is not None:
                out[fid] = decoded
        elif ret in UNSUPPORTED or ret == ERR_INVALID_ARGUMENT:
            # per value, INVALID_ARGUMENT means "this driver does not know this field id"
            dev.unsupported_fields.add(fid)
            dev.field_requests = dev.fast_field_requests = None
            log.info("nvml_field_unsupported", uuid=dev.identity.uuid, field_id=fid, ret=ret)
        elif ret in (ERR_GPU_IS_LOST, ERR_UNKNOWN):
            raise CallFailed(ret, f"field {fid}", str(pynvml.NVMLError(ret)))
        else:
            log.debug("nvml_field_transient_error", uuid=dev.identity.uuid, field_id=fid, ret=ret)
    if slow_due:
        dev.slow_due = now + calls.slow_period
        dev.slow_values = {fid: out[fid] for fid in SLOW_FIELDS if fid in out}
    else:
        for fid, value in dev.slow_values.items():
            out.setdefault(fid, value)
    return out


def read_counters(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    h = dev.handle
    fv = field_values(calls, dev)
    direct = fv is None
    fv = fv or {}

    def field_or_direct(fid: int, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        if fid in fv:
            return fv[fid]
        if direct or fid in dev.unsupported_fields:
            return calls.slow_call(dev, key, fn, *args) if fid in SLOW_FIELDS else calls.call(dev, key, fn, *args)
        return None

    energy = field_or_direct(FI_ENERGY, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
    if energy is not None:
        r.energy_joules = float(energy) / 1000.0
    power = field_or_direct(FI_POWER_AVERAGE, "power", pynvml.nvmlDeviceGetPowerUsage, h)
    if power is not None:
        r.power_watts = float(power) / 1000.0
    if FI_MEMORY_TEMP in fv:
        r.memory_temperature_celsius = float(fv[FI_MEMORY_TEMP])
    if FI_RECOVERY_ACTION in fv:
        try:
            r.recovery_action = RecoveryAction(int(fv[FI_RECOVERY_ACTION]))
        except ValueError:
            log.warning("nvml_unknown_recovery_action", uuid=dev.identity.uuid, value=fv[FI_RECOVERY_ACTION])
    for fid, policy, reason in THROTTLE_FIELDS:
        ns = field_or_direct(fid, f"violation_{policy}", _violation_ns, h, policy)
        if ns is not None:
            r.throttle_seconds[reason] = float(ns) / 1e9

    if direct:
        read_counters_direct(calls, dev, r)
        return
    # ECC: volatile counts (since driver load, move immediately) preferred; aggregate
    # (lifetime, inforom) where volatile is not reported.
    sbe = fv.get(FI_ECC_SBE_VOL, fv.get(FI_ECC_SBE_AGG))
    dbe = fv.get(FI_ECC_DBE_VOL, fv.get(FI_ECC_DBE_AGG))
    r.ecc_correctable_total = None if sbe is None else int(sbe)
    r.ecc_uncorrectable_total = None if dbe is None else int(dbe)
    retired = [fv[f] for f in (FI_RETIRED_SBE, FI_RETIRED_DBE) if f in fv]
    if retired:
        r.retired_pages_total = int(sum(retired))
    if FI_RETIRED_PENDING in fv:
        r.retired_pages_pending = bool(fv[FI_RETIRED_PENDING])
    if FI_REMAPPED_COR in fv:
        r.remapped_rows_correctable = int(fv[FI_REMAPPED_COR])
    if FI_REMAPPED_UNC in fv:
        r.remapped_rows_uncorrectable = int(fv[FI_REMAPPED_UNC])
    if FI_REMAPPED_PENDING in fv:
        r.row_remap_pending = bool(fv[FI_REMAPPED_PENDING])
    if FI_REMAPPED_FAILURE in fv:
        r.row_remap_failure = bool(fv[FI_REMAPPED_FAILURE])
    if FI_PCIE_REPLAY in fv:
        r.pcie_replay_total = int(fv[FI_PCIE_REPLAY])


def _violation_ns(handle: Any, policy: int) -> int:
    """nvmlDeviceGetViolationStatus's throttle time (ns); the call is deprecated for the fields."""
    return int(pynvml.nvmlDeviceGetViolationStatus(handle, policy).violationTime)


def read_counters_direct(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    """The same counters one call each, for drivers without nvmlDeviceGetFieldValues."""
    h = dev.handle

    def ecc(kind: int) -> int | None:
        for counter, name in ((pynvml.NVML_VOLATILE_ECC, "vol"), (pynvml.NVML_AGGREGATE_ECC, "agg")):
            v = calls.call(dev, f"ecc_{kind}_{name}", pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter)
            if v is not None:
                return int(v)
        return None

    r.ecc_correctable_total = ecc(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)
    r.ecc_uncorrectable_total = ecc(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
    pages = [
        calls.call(dev, f"retired_pages_{cause}", pynvml.nvmlDeviceGetRetiredPages_v2, h, cause)
        for cause in (0, 1)  # multiple single-bit errors, double-bit error
    ]
    if any(p is not None for p in pages):
        r.retired_pages_total = sum(len(p) for p in pages if p is not None)
    pending = calls.call(dev, "retired_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    if pending is not None:
        r.retired_pages_pending = bool(pending)
    rows = calls.call(dev, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
    if rows is not None:
        cor, unc, pend, fail = rows
        r.remapped_rows_correctable, r.remapped_rows_uncorrectable = int(cor), int(unc)
        r.row_remap_pending, r.row_remap_failure = bool(pend), bool(fail)
    replay = calls.slow_call(dev, "pcie_replay", pynvml.nvmlDeviceGetPcieReplayCounter, h)
    if replay is not None:
        r.pcie_replay_total = int(replay)


# ---- GPM (Hopper+) -----------------------------------------------------------------------------


def read_gpm(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    """SM active, SM occupancy, tensor active, DRAM active from two samples, the previous
    cycle's and this one's (the first cycle yields None). MIG devices sample their GPU instance
    through the parent (``nvmlGpmMigSampleGet``)."""
    if "gpm" in dev.unsupported:
        return
    gi = dev.identity.gpu_instance_id
    use_mig_sample = dev.is_mig and gi is not None and hasattr(pynvml, "nvmlGpmMigSampleGet")
    if not BATCH_LOCK.acquire(timeout=calls.lock_timeout_s):
        log.warning("nvml_gpm_lock_busy", uuid=dev.identity.uuid)
        return
    try:
        _gpm_cycle(calls, dev, r, use_mig_sample)
    except CallFailed as exc:
        if exc.code != ERR_INVALID_ARGUMENT:
            raise
        # e.g. a baseline sample from before a reset/reconfiguration: start a new baseline
        # rather than failing the whole reading over a derived metric.
        log.info("nvml_gpm_baseline_reset", uuid=dev.identity.uuid, error=str(exc))
        dev.gpm_prev = -1
    finally:
        BATCH_LOCK.release()


def _gpm_cycle(calls: Calls, dev: NvmlDevice, r: DeviceReading, use_mig_sample: bool) -> None:
    """Take this cycle's sample and, with the previous one, compute the metrics.
    Called with BATCH_LOCK held."""
    if not dev.gpm_samples:
        samples = [calls.call(dev, "gpm", pynvml.nvmlGpmSampleAlloc) for _ in range(2)]
        if None in samples:
            for s in samples:
                if s is not None:
                    quiet(pynvml.nvmlGpmSampleFree, s)
            return
        dev.gpm_samples, dev.gpm_prev = samples, -1
    cur = 0 if dev.gpm_prev != 0 else 1
    sample = dev.gpm_samples[cur]
    if use_mig_sample:
        got = calls.call(dev, "gpm", pynvml.nvmlGpmMigSampleGet, dev.parent_handle, dev.identity.gpu_instance_id,
                         sample)
    else:
        got = calls.call(dev, "gpm", pynvml.nvmlGpmSampleGet, dev.handle, sample)
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
        if calls.call(dev, "gpm_metrics", pynvml.nvmlGpmMetricsGet, mg) is not None:
            for i, attr in enumerate(GPM_METRICS.values()):
                if int(mg.metrics[i].nvmlReturn) == SUCCESS:
                    setattr(r, attr, ratio(mg.metrics[i].value))
    dev.gpm_prev = cur


# ---- processes ---------------------------------------------------------------------------------


def process_map(procs: list[Any]) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for p in procs:
        pid, used = int(p.pid), p.usedGpuMemory
        prev = out.get(pid)
        if prev is not None and used is not None:
            out[pid] = prev + int(used)  # same pid listed per compute instance
        elif pid not in out or used is not None:
            out[pid] = None if used is None else int(used)
    return out


def read_processes(calls: Calls, dev: NvmlDevice, r: DeviceReading) -> None:
    procs = calls.call(dev, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, dev.handle)
    if procs:
        r.processes = process_map(procs)


# ---- the table ---------------------------------------------------------------------------------

# Which devices a row applies to.
ALL = "all"
FULL_GPU = "full_gpu"  # not MIG devices: physical quantities stay on the parent
GPM = "gpm"  # devices whose GPU supports GPM (and GPM not switched off)
PROCESSES = "processes"  # when per-process reading is on

#: (quantity, devices it applies to, reader), in the order a read makes its calls
READERS: tuple[tuple[str, str, Reader], ...] = (
    ("memory", ALL, read_memory),
    ("utilization", FULL_GPU, read_utilization),  # unsupported on MIG-enabled GPUs anyway
    ("temperature", FULL_GPU, read_temperature),
    ("clocks", FULL_GPU, read_clocks),
    ("clock_reasons", FULL_GPU, read_clock_reasons),
    ("counters", FULL_GPU, read_counters),
    ("gpm", GPM, read_gpm),
    ("processes", PROCESSES, read_processes),
)


def readers_for(dev: NvmlDevice, *, processes: bool) -> tuple[Reader, ...]:
    """The rows of READERS that apply to ``dev``, decided once when it is enumerated."""
    applies = {ALL: True, FULL_GPU: not dev.is_mig, GPM: dev.gpm_supported, PROCESSES: processes}
    return tuple(reader for _quantity, scope, reader in READERS if applies[scope])
