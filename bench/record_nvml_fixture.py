#!/usr/bin/env python3
"""Record an NVML fixture on a real NVIDIA machine, for replay in tests/test_nvml_backend.py.

Usage (on a node with the NVIDIA driver, from the repository root):

    python bench/record_nvml_fixture.py --out tests/fixtures/nvml/<gpu>-<driver>.json \\
        [--cycles 3] [--interval 1.0] [--latency-calls 200] [--keep-serials]

What it writes (format ``dra-gpu-exporter/nvml-fixture/v1``, see tests/fixtures/nvml/README.md):
every raw NVML answer the NvmlBackend asks for, per device, as ``{"ret": nvmlReturn, "value":
raw value in NVML's units}``; one entry per cycle for values that change, one for static ones.
Errors are recorded as their return code (a NOT_SUPPORTED answer is as much a fact about the
hardware as a value). It also measures, per device and call, min/median/p99 latency in
microseconds over ``--latency-calls`` calls, and the backend's whole ``read()`` per device, so
the "Python overhead over raw library calls" target can be checked on that machine.

Only pynvml is used to talk to the driver; nothing is changed on the GPUs. Serial numbers are
replaced unless ``--keep-serials`` is given. Replaying needs no GPU: any ``*.json`` in
tests/fixtures/nvml/ is picked up by the replay test automatically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exporter.devices.nvml import FIELD_REQUESTS, GPM_METRICS, NvmlBackend
from exporter.devices.nvml.abi import THROTTLE_FIELDS

FORMAT = "dra-gpu-exporter/nvml-fixture/v1"
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _s(v: Any) -> Any:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def result(fn: Callable[..., Any], *args: Any, convert: Callable[[Any], Any] = lambda v: v, **kw: Any) -> dict:
    """One raw answer: the converted value, or the NVML return code."""
    try:
        return {"ret": 0, "value": convert(fn(*args, **kw))}
    except pynvml.NVMLError as exc:
        return {"ret": int(exc.value), "value": None}
    except pynvml.NVMLLibraryMismatchError:
        return {"ret": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "value": None}


# ---- converters: ctypes results -> the JSON shapes the fake library understands -------------


def mem_v2(m: Any) -> dict:
    return {"total": int(m.total), "reserved": int(m.reserved), "free": int(m.free), "used": int(m.used)}


def mem_v1(m: Any) -> dict:
    return {"total": int(m.total), "free": int(m.free), "used": int(m.used)}


def pci(p: Any) -> dict:
    return {"busId": _s(p.busId), "domain": int(p.domain), "bus": int(p.bus), "device": int(p.device),
            "pciDeviceId": int(p.pciDeviceId), "pciSubSystemId": int(p.pciSubSystemId)}  # fmt: skip


def util(u: Any) -> dict:
    return {"gpu": int(u.gpu), "memory": int(u.memory)}


def procs(ps: list[Any]) -> list[dict]:
    return [{"pid": int(p.pid), "usedGpuMemory": p.usedGpuMemory, "gpuInstanceId": int(p.gpuInstanceId),
             "computeInstanceId": int(p.computeInstanceId)} for p in ps]  # fmt: skip


def field_values(values: Any) -> dict:
    out = {}
    for v in values:
        ret, vtype = int(v.nvmlReturn), int(v.valueType)
        member = _VALUE_MEMBER.get(vtype)
        raw = getattr(v.value, member) if ret == 0 and member else 0
        out[str(int(v.fieldId))] = {"ret": ret, "type": vtype, "value": raw, "latency_us": int(v.latencyUsec)}
    return out


def gi_info(info: Any) -> dict:
    return {"id": int(info.id), "profileId": int(info.profileId),
            "placement": {"start": int(info.placement.start), "size": int(info.placement.size)}}  # fmt: skip


def profile_info(info: Any) -> dict:
    return {"id": int(info.id), "sliceCount": int(info.sliceCount), "memorySizeMB": int(info.memorySizeMB), "name": _s(info.name)}


# ---- what to record --------------------------------------------------------------------------


def gpu_cycle_calls(h: Any) -> dict[str, tuple[Callable[..., Any], tuple, dict, Callable[[Any], Any]]]:
    """call key -> (function, args, kwargs, converter) for everything read every cycle."""
    calls = {
        "nvmlDeviceGetMemoryInfo_v2": (pynvml.nvmlDeviceGetMemoryInfo, (h,), {"version": pynvml.nvmlMemory_v2}, mem_v2),
        "nvmlDeviceGetMemoryInfo": (pynvml.nvmlDeviceGetMemoryInfo, (h,), {}, mem_v1),
        "nvmlDeviceGetUtilizationRates": (pynvml.nvmlDeviceGetUtilizationRates, (h,), {}, util),
        "nvmlDeviceGetPowerUsage": (pynvml.nvmlDeviceGetPowerUsage, (h,), {}, int),
        "nvmlDeviceGetTotalEnergyConsumption": (pynvml.nvmlDeviceGetTotalEnergyConsumption, (h,), {}, int),
        "nvmlDeviceGetTemperatureV:0": (pynvml.nvmlDeviceGetTemperatureV, (h, 0), {}, int),
        "nvmlDeviceGetTemperature:0": (pynvml.nvmlDeviceGetTemperature, (h, 0), {}, int),
        "nvmlDeviceGetClockInfo:1": (pynvml.nvmlDeviceGetClockInfo, (h, pynvml.NVML_CLOCK_SM), {}, int),
        "nvmlDeviceGetClockInfo:2": (pynvml.nvmlDeviceGetClockInfo, (h, pynvml.NVML_CLOCK_MEM), {}, int),
        "nvmlDeviceGetCurrentClocksEventReasons": (pynvml.nvmlDeviceGetCurrentClocksEventReasons, (h,), {}, int),
        "nvmlDeviceGetCurrentClocksThrottleReasons": (pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, (h,), {}, int),
        "nvmlDeviceGetFieldValues": (pynvml.nvmlDeviceGetFieldValues, (h, list(FIELD_REQUESTS)), {}, field_values),
        "nvmlDeviceGetComputeRunningProcesses_v3": (pynvml.nvmlDeviceGetComputeRunningProcesses_v3, (h,), {}, procs),
        "nvmlDeviceGetRetiredPagesPendingStatus": (pynvml.nvmlDeviceGetRetiredPagesPendingStatus, (h,), {}, int),
        "nvmlDeviceGetRemappedRows": (pynvml.nvmlDeviceGetRemappedRows, (h,), {}, list),
        "nvmlDeviceGetPcieReplayCounter": (pynvml.nvmlDeviceGetPcieReplayCounter, (h,), {}, int),
    }
    for etype in (0, 1):
        for counter in (0, 1):
            calls[f"nvmlDeviceGetTotalEccErrors:{etype}:{counter}"] = (pynvml.nvmlDeviceGetTotalEccErrors, (h, etype, counter), {}, int)
    for cause in (0, 1):
        calls[f"nvmlDeviceGetRetiredPages_v2:{cause}"] = (pynvml.nvmlDeviceGetRetiredPages_v2, (h, cause), {}, len)
    for _fid, policy, _reason in THROTTLE_FIELDS:
        violation = (pynvml.nvmlDeviceGetViolationStatus, (h, policy), {}, lambda v: int(v.violationTime))
        calls[f"nvmlDeviceGetViolationStatus:{policy}"] = violation
    return calls


def mig_cycle_calls(mh: Any) -> dict[str, tuple[Callable[..., Any], tuple, dict, Callable[[Any], Any]]]:
    return {
        "nvmlDeviceGetMemoryInfo_v2": (pynvml.nvmlDeviceGetMemoryInfo, (mh,), {"version": pynvml.nvmlMemory_v2}, mem_v2),
        "nvmlDeviceGetMemoryInfo": (pynvml.nvmlDeviceGetMemoryInfo, (mh,), {}, mem_v1),
        "nvmlDeviceGetComputeRunningProcesses_v3": (pynvml.nvmlDeviceGetComputeRunningProcesses_v3, (mh,), {}, procs),
    }


class GpmRecorder:
    """Two rotating samples per device, like the backend; records metrics per cycle."""

    def __init__(self, take: Callable[[Any], Any]) -> None:
        self.take = take
        self.samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        self.prev = -1

    def cycle(self, calls: dict[str, list[dict]]) -> None:
        cur = 0 if self.prev != 0 else 1
        try:
            self.take(self.samples[cur])
        except pynvml.NVMLError as exc:
            for mid in GPM_METRICS:
                calls.setdefault(f"nvmlGpmMetricsGet:{mid}", []).append({"ret": int(exc.value), "value": None})
            return
        if self.prev < 0:
            for mid in GPM_METRICS:  # first cycle: no interval yet, never asked by the backend
                calls.setdefault(f"nvmlGpmMetricsGet:{mid}", []).append({"ret": 0, "value": None})
        else:
            mg = pynvml.c_nvmlGpmMetricsGet_t()
            mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(GPM_METRICS)
            mg.sample1, mg.sample2 = self.samples[self.prev], self.samples[cur]
            for i, mid in enumerate(GPM_METRICS):
                mg.metrics[i].metricId = mid
            try:
                pynvml.nvmlGpmMetricsGet(mg)
                for i, mid in enumerate(GPM_METRICS):
                    ret = int(mg.metrics[i].nvmlReturn)
                    calls.setdefault(f"nvmlGpmMetricsGet:{mid}", []).append({"ret": ret, "value": float(mg.metrics[i].value) if ret == 0 else None})
            except pynvml.NVMLError as exc:
                for mid in GPM_METRICS:
                    calls.setdefault(f"nvmlGpmMetricsGet:{mid}", []).append({"ret": int(exc.value), "value": None})
        self.prev = cur

    def free(self) -> None:
        for s in self.samples:
            try:
                pynvml.nvmlGpmSampleFree(s)
            except pynvml.NVMLError:
                pass


def latency(fn: Callable[..., Any], args: tuple, kw: dict, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        try:
            fn(*args, **kw)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError):
            pass
        times.append((time.perf_counter_ns() - t0) / 1000.0)
    times.sort()
    return {"n": n, "min": round(times[0], 2), "median": round(statistics.median(times), 2),
            "p99": round(times[min(n - 1, int(n * 0.99))], 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between cycles (GPM needs > 0.1)")
    ap.add_argument("--latency-calls", type=int, default=200)
    ap.add_argument("--keep-serials", action="store_true", help="do not redact board serial numbers")
    args = ap.parse_args(argv)

    pynvml.nvmlInit()
    try:
        doc = record(args)
    finally:
        pynvml.nvmlShutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {len(doc['devices'])} GPUs, {doc['cycles']} cycles")
    return 0


def record(args: argparse.Namespace) -> dict:
    system = {
        "nvmlSystemGetDriverVersion": result(pynvml.nvmlSystemGetDriverVersion, convert=_s),
        "nvmlSystemGetNVMLVersion": result(pynvml.nvmlSystemGetNVMLVersion, convert=_s),
    }
    devices: list[dict] = []
    handles: list[tuple[Any, dict, list[tuple[Any, dict]]]] = []
    gpms: list[tuple[GpmRecorder, dict]] = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        calls: dict[str, list[dict]] = {
            "nvmlDeviceGetUUID": [result(pynvml.nvmlDeviceGetUUID, h, convert=_s)],
            "nvmlDeviceGetName": [result(pynvml.nvmlDeviceGetName, h, convert=_s)],
            "nvmlDeviceGetSerial": [result(pynvml.nvmlDeviceGetSerial, h, convert=_s)],
            "nvmlDeviceGetMinorNumber": [result(pynvml.nvmlDeviceGetMinorNumber, h)],
            "nvmlDeviceGetPciInfo_v3": [result(pynvml.nvmlDeviceGetPciInfo_v3, h, convert=pci)],
            "nvmlDeviceGetMigMode": [result(pynvml.nvmlDeviceGetMigMode, h, convert=list)],
            "nvmlDeviceGetMaxMigDeviceCount": [result(pynvml.nvmlDeviceGetMaxMigDeviceCount, h)],
            "nvmlDeviceGetSupportedEventTypes": [result(pynvml.nvmlDeviceGetSupportedEventTypes, h)],
            "nvmlGpmQueryDeviceSupport": [result(pynvml.nvmlGpmQueryDeviceSupport, h, convert=lambda s: int(s.isSupportedDevice))],
        }
        if not args.keep_serials and calls["nvmlDeviceGetSerial"][0]["ret"] == 0:
            calls["nvmlDeviceGetSerial"][0]["value"] = f"redacted-{i}"
        gpm_ok = calls["nvmlGpmQueryDeviceSupport"][0]["value"] == 1
        migs: list[tuple[Any, dict]] = []
        mig_docs: list[dict] = []
        if calls["nvmlDeviceGetMigMode"][0]["value"] and calls["nvmlDeviceGetMigMode"][0]["value"][0] == 1:
            for slot in range(calls["nvmlDeviceGetMaxMigDeviceCount"][0]["value"] or 0):
                try:
                    mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
                except pynvml.NVMLError:
                    continue
                mc: dict[str, list[dict]] = {
                    "nvmlDeviceGetUUID": [result(pynvml.nvmlDeviceGetUUID, mh, convert=_s)],
                    "nvmlDeviceGetName": [result(pynvml.nvmlDeviceGetName, mh, convert=_s)],
                    "nvmlDeviceGetGpuInstanceId": [result(pynvml.nvmlDeviceGetGpuInstanceId, mh)],
                    "nvmlDeviceGetComputeInstanceId": [result(pynvml.nvmlDeviceGetComputeInstanceId, mh)],
                }
                gi = mc["nvmlDeviceGetGpuInstanceId"][0]["value"]
                if gi is not None:
                    info = result(lambda: pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(h, gi)), convert=gi_info)  # noqa: B023 - called in this iteration
                    mc["nvmlGpuInstanceGetInfo"] = [info]
                    if info["ret"] == 0:
                        pid = info["value"]["profileId"]
                        calls[f"nvmlDeviceGetGpuInstanceProfileInfoByIdV:{pid}"] = [
                            result(pynvml.nvmlDeviceGetGpuInstanceProfileInfoById, h, pid, convert=profile_info)
                        ]
                    if gpm_ok:
                        gpms.append((GpmRecorder(lambda s, h=h, gi=gi: pynvml.nvmlGpmMigSampleGet(h, gi, s)), mc))
                migs.append((mh, mc))
                mig_docs.append({"slot": slot, "calls": mc, "latency_us": {}})
        if gpm_ok:
            gpms.append((GpmRecorder(lambda s, h=h: pynvml.nvmlGpmSampleGet(h, s)), calls))
        dev = {"calls": calls, "mig_devices": mig_docs, "latency_us": {}}
        devices.append(dev)
        handles.append((h, dev, migs))

    for cycle in range(args.cycles):
        if cycle:
            time.sleep(args.interval)  # GPM needs > 100 ms between samples; counters need time to move
        for h, dev, migs in handles:
            for key, (fn, a, kw, conv) in gpu_cycle_calls(h).items():
                dev["calls"].setdefault(key, []).append(result(fn, *a, convert=conv, **kw))
            for mh, mc in migs:
                for key, (fn, a, kw, conv) in mig_cycle_calls(mh).items():
                    mc.setdefault(key, []).append(result(fn, *a, convert=conv, **kw))
        for rec, calls in gpms:
            rec.cycle(calls)
    for rec, _ in gpms:
        rec.free()

    # latencies: raw calls, then the backend's read() of the same device for comparison
    for h, dev, migs in handles:
        for key, (fn, a, kw, _) in gpu_cycle_calls(h).items():
            dev["latency_us"][key] = latency(fn, a, kw, args.latency_calls)
        for (mh, _mc), md in zip(migs, dev["mig_devices"], strict=True):
            for key, (fn, a, kw, _) in mig_cycle_calls(mh).items():
                md["latency_us"][key] = latency(fn, a, kw, args.latency_calls)
    backend = NvmlBackend()
    backend.open()
    try:
        idents = {d.uuid: d for d in backend.enumerate()}
        for dev in devices:
            for d in [dev, *dev["mig_devices"]]:
                ident = idents.get(d["calls"]["nvmlDeviceGetUUID"][0]["value"])
                if ident is not None:
                    d["latency_us"]["backend.read"] = latency(backend.read, (ident,), {}, args.latency_calls)
    finally:
        backend.close()

    return {
        "format": FORMAT,
        "source": f"recorded on hardware by bench/record_nvml_fixture.py at {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}",
        "recorded": {
            "pynvml": getattr(pynvml, "__version__", None) or _pkg_version(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cycles": args.cycles,
            "interval_s": args.interval,
            "latency_calls": args.latency_calls,
        },
        "cycles": args.cycles,
        "system": system,
        "devices": devices,
    }


def _pkg_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
