"""ResourceSlices as ROCm/k8s-gpu-dra-driver publishes them, for the GPUs of a fake amdsmi node.

Two generations, read from the driver's source (``cmd/gpu-kubeletplugin/deviceinfo.go`` and
``discovery.go``, ``pkg/amdgpu/amdgpu.go``, ``pkg/consts/consts.go``;
https://github.com/ROCm/k8s-gpu-dra-driver/blob/main/docs/driver-attributes.md):

* **v1.x** (v1.0.0, 2026-05): device names ``gpu-<card>-<render>``; ``type`` ``amdgpu`` (a full
  GPU) or ``amdgpu-partition`` (a GPU in DPX/CPX...: every partition, the first included, since
  the driver reads the mode from the PCI device's ``current_compute_partition``);
  ``partitionProfile`` ``<compute>_<memory>`` in lower case (``cpx_nps1``, omitted on a GPU
  that cannot be partitioned); ``productName`` with spaces as ``_``; ``numaNode``;
  ``driverVersion`` (semver) and ``driverVersionFull``; ``deviceID``; the standard
  ``resource.kubernetes.io/pciBusID`` of the *parent* GPU, the same on all its partitions, and
  ``resource.kubernetes.io/pcieRoot``; no uuid. Capacities ``memory``, ``computeUnits``,
  ``simdUnits``.
* **alpha** (the October 2025 snapshot): the same names and ``type``; ``pciAddr`` on a full
  GPU, ``parentPciAddr`` on a partition, ``cardIndex`` / ``renderIndex`` as ints, ``family``,
  ``driverSrcVersion``; no standard ``pciBusID``.

Both are ``resource.k8s.io/v1`` objects, valid against the Kubernetes schema (the tests check).
"""

from __future__ import annotations

from typing import Any

from .fake_amdsmi import FakeAmdGpu

DRIVER = "gpu.amd.com"
GiB = 1024**3


def _parent_bdf(gpu: FakeAmdGpu) -> str:
    dom, bus, dev, _fn = gpu.bdf_parts()
    return "%04x:%02x:%02x.0" % (dom, bus, dev)


def _partitioned(gpu: FakeAmdGpu) -> bool:
    return gpu.compute_partition.lower() not in ("", "spx")


def _device_v1(gpu: FakeAmdGpu, memory_bytes: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "type": {"string": "amdgpu-partition" if _partitioned(gpu) else "amdgpu"},
        "productName": {"string": gpu.market_name.replace(" ", "_")},
        "numaNode": {"int": 0},
        "driverVersion": {"version": gpu.driver_version},
        "driverVersionFull": {"string": gpu.driver_version},
        "deviceID": {"string": "0x74a1"},
        "partitionProfile": {"string": f"{gpu.compute_partition.lower()}_{gpu.memory_partition.lower()}"},
        "resource.kubernetes.io/pciBusID": {"string": _parent_bdf(gpu)},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:80"},
    }
    return {
        "name": f"gpu-{gpu.card}-{gpu.render}",
        "attributes": attrs,
        "capacity": {"memory": {"value": str(memory_bytes)}, "computeUnits": {"value": "38"}, "simdUnits": {"value": "152"}},
    }


def _device_alpha(gpu: FakeAmdGpu, memory_bytes: int) -> dict[str, Any]:
    partitioned = _partitioned(gpu)
    attrs: dict[str, Any] = {
        "type": {"string": "amdgpu-partition" if partitioned else "amdgpu"},
        ("parentPciAddr" if partitioned else "pciAddr"): {"string": _parent_bdf(gpu)},
        "cardIndex": {"int": gpu.card},
        "renderIndex": {"int": gpu.render},
        ("parentDeviceID" if partitioned else "deviceID"): {"string": "0x74a1"},
        "family": {"string": "AI"},
        "productName": {"string": gpu.market_name.replace(" ", "_")},
        "driverVersion": {"version": gpu.driver_version},
        "driverSrcVersion": {"string": "2C6A4D1D2E5B7B0A9C4E1F3"},
        "partitionProfile": {"string": f"{gpu.compute_partition.lower()}_{gpu.memory_partition.lower()}"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:80"},
    }
    return {
        "name": f"gpu-{gpu.card}-{gpu.render}",
        "attributes": attrs,
        "capacity": {"memory": {"value": str(memory_bytes)}, "computeUnits": {"value": "38"}, "simdUnits": {"value": "152"}},
    }


def resource_slice(node: str, gpus: list[FakeAmdGpu], *, generation: str = "v1", partition_memory: int = 24 * GiB) -> dict[str, Any]:
    """The node's one ResourceSlice for these processor handles (``generation`` "v1" or
    "alpha"). A partition's ``memory`` capacity is what the driver reads from KFD's topology
    for it (``partition_memory``); a full GPU's its VRAM."""
    make = _device_v1 if generation == "v1" else _device_alpha
    devices = [make(g, partition_memory if _partitioned(g) else g.vram_total) for g in gpus if g.card is not None and g.render is not None]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-7xk2p"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
