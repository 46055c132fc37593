#!/usr/bin/env python3
"""On a node with a real NVIDIA driver: what one NvmlBackend.read costs against the calls it makes.

Usage (from the repository root, on a GPU node; changes nothing on the GPUs):

    python bench/nvml_hardware.py [--reads 300] [--rounds 5] [--out FILE.json]

The backend is opened as the agent opens it (processes and GPM on). For each device, the
library calls one ``read()`` makes are captured once by wrapping the single call site every
reader calls through (``Calls.call``); then "backend" (``read()``) and "raw" (the same pynvml
calls, same arguments, replayed in a tight loop) run in alternating rounds, each keeping its
fastest round, so a noisy neighbour penalises neither side. ``overhead = backend / raw - 1`` is
the Python the backend adds over nvidia-ml-py's own wrappers and the driver. The fake-library
figure in ``bench/run.py nvml`` measures the same thing with no driver work at all (a worst
case); this is the figure on real hardware.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record_nvml_fixture import latency  # bench/ is on sys.path: the script's own folder

from exporter.devices.nvml import FIELD_REQUESTS, NvmlBackend


def capture(backend: NvmlBackend, ident: Any) -> list[tuple[str, Any, tuple, dict]]:
    """The (key, fn, args, kwargs) of every library call one read of ``ident`` makes."""
    seen: list[tuple[str, Any, tuple, dict]] = []
    calls = backend._calls  # the readers' single call site (exporter/devices/nvml/device.py)
    original = calls.call

    def recording(dev: Any, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if key not in dev.unsupported:
            seen.append((key, fn, args, kwargs))
        return original(dev, key, fn, *args, **kwargs)

    calls.call = recording  # type: ignore[method-assign]
    try:
        backend.read(ident)
    finally:
        del calls.call  # back to the class's method
    return seen


def replay(calls: list[tuple[str, Any, tuple, dict]]) -> None:
    for _key, fn, args, kwargs in calls:
        try:
            fn(*args, **kwargs)
        except pynvml.NVMLError:
            pass


def per_call_us(calls: list[tuple[str, Any, tuple, dict]], n: int) -> dict[str, float]:
    """Median latency of each captured call, as the fixture recorder times calls."""
    return {key: latency(fn, args, kwargs, n)["median"] for key, fn, args, kwargs in calls}


def per_field_us(handle: Any, n: int) -> dict[str, float]:
    """Median latency of one FieldValues call per field id: which counter the driver makes slow."""
    return {str(req[0]): latency(pynvml.nvmlDeviceGetFieldValues, (handle, [req]), {}, n)["median"] for req in FIELD_REQUESTS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=300, help="reads per round and side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    backend = NvmlBackend()
    backend.open()
    result: dict[str, Any] = {"python": platform.python_version(), "driver": pynvml.nvmlSystemGetDriverVersion(), "devices": []}
    try:
        devices = backend.enumerate()
        for d in devices:
            for _ in range(3):  # warm: unsupported calls are learnt, GPM gets its first sample
                backend.read(d)
                time.sleep(0.12)
        for d in devices:
            calls = capture(backend, d)
            best = {"backend": float("inf"), "raw": float("inf")}
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                for _ in range(a.reads):
                    backend.read(d)
                best["backend"] = min(best["backend"], (time.perf_counter() - t0) / a.reads * 1e6)
                t0 = time.perf_counter()
                for _ in range(a.reads):
                    replay(calls)
                best["raw"] = min(best["raw"], (time.perf_counter() - t0) / a.reads * 1e6)
            row = {
                "uuid": d.uuid,
                "model": d.model,
                "parent_uuid": d.parent_uuid,
                "calls_per_read": [k for k, *_ in calls],
                "backend_read_us": round(best["backend"], 1),
                "raw_calls_us": round(best["raw"], 1),
                "overhead": round(best["backend"] / best["raw"] - 1, 3),
                "per_call_median_us": per_call_us(calls, 100),
            }
            batch = next((args for key, _fn, args, _kw in calls if key == "field_values"), None)
            if batch is not None:  # full GPUs: the batch's own handle, one field per call
                row["per_field_median_us"] = per_field_us(batch[0], 30)
                print("  FieldValues, one field per call (id: median us):", row["per_field_median_us"])
            result["devices"].append(row)
            print(f"{d.model} {d.uuid}: read {row['backend_read_us']} us, its {len(calls)} raw calls {row['raw_calls_us']} us, overhead {row['overhead'] * 100:.1f}%")
    finally:
        backend.close()
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
