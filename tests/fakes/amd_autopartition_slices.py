"""ResourceSlices as ROCm/k8s-gpu-dra-driver v1.x publishes them with its AutoPartition feature
gate on: virtual partition devices, and the driver's own NoExecute taints on them.

Read from the driver's source and documentation (its driver attributes document, "Auto-partition
mode"; ``pkg/consts`` ``ValidPartitionConfigs`` and ``MemoryPartitionTaintKey``; the
``SyntheticPartitionDevice.GetDevice`` and ``PartitionState.applyMemoryTaints`` code;
https://github.com/ROCm/k8s-gpu-dra-driver):

* every partitionable GPU is published as one device per valid compute+memory configuration
  (SPX/NPS1, DPX/NPS1, DPX/NPS2, QPX/NPS1, CPX/NPS1, CPX/NPS4), named
  ``gpu-<gpuIndex>-<compute>-<memory>``; ``type`` ``amdgpu`` for SPX, ``amdgpu-partition``
  otherwise; ``computePartition``, ``memoryPartition``, ``gpuIndex``, ``pciAddr``,
  ``productName``, ``deviceID``, ``driverVersion``, ``numaNode`` and the standard
  ``resource.kubernetes.io/pciBusID``; capacities ``partitions`` (a consumable capacity, one per
  request), ``memory``, ``computeUnits``, ``simdUnits``; each consumes the GPU's
  ``gpu-<gpuIndex>-mutex`` counter (``partition-mode``: 1), so one configuration is active per GPU;
* the memory mode is node-wide: once an allocation sets it, every device with another memory mode
  carries the taint ``gpu.amd.com/memory-partition-conflict=<active mode>:NoExecute``: a
  scheduling device, not a health verdict. Taints are dropped when the last partition allocation
  is released.

The counter sets are published in a slice of their own (a slice holds devices or shared counters,
not both, since Kubernetes 1.35); both are ``resource.k8s.io/v1`` objects, valid against the
Kubernetes schema.
"""

from __future__ import annotations

from typing import Any

from .fake_amdsmi import FakeAmdGpu

DRIVER = "gpu.amd.com"
TAINT_KEY = "gpu.amd.com/memory-partition-conflict"
# consts.ValidPartitionConfigs: (compute, memory, partitions)
CONFIGS = (("spx", "nps1", 1), ("dpx", "nps1", 2), ("dpx", "nps2", 2), ("qpx", "nps1", 4), ("cpx", "nps1", 8), ("cpx", "nps4", 8))
CUS, SIMDS = 304, 1216  # an MI300X


def _bdf(gpu: FakeAmdGpu) -> str:
    dom, bus, dev, _fn = gpu.bdf_parts()
    return "%04x:%02x:%02x.0" % (dom, bus, dev)


def _device(index: int, gpu: FakeAmdGpu, compute: str, memory: str, count: int, active_memory: str) -> dict[str, Any]:
    one = {"default": "1", "validValues": ["1"]}
    per = gpu.vram_total // count

    def cap(total: int, share: int) -> dict[str, Any]:
        c: dict[str, Any] = {"value": str(total)}
        if count > 1:
            c["requestPolicy"] = {"default": str(share), "validValues": [str(share)]}
        return c

    dev: dict[str, Any] = {
        "name": f"gpu-{index}-{compute}-{memory}",
        "attributes": {
            "type": {"string": "amdgpu" if compute == "spx" else "amdgpu-partition"},
            "computePartition": {"string": compute},
            "memoryPartition": {"string": memory},
            "gpuIndex": {"int": index},
            "productName": {"string": gpu.market_name.replace(" ", "_")},
            "pciAddr": {"string": _bdf(gpu)},
            "deviceID": {"string": "0x74a1"},
            "driverVersion": {"version": gpu.driver_version},
            "numaNode": {"int": 0},
            "resource.kubernetes.io/pciBusID": {"string": _bdf(gpu)},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:80"},
        },
        "capacity": {
            "partitions": {"value": str(count), **({"requestPolicy": one} if count > 1 else {})},
            "memory": cap(per * count, per),
            "computeUnits": cap(CUS, CUS // count),
            "simdUnits": cap(SIMDS, SIMDS // count),
        },
        "consumesCounters": [{"counterSet": f"gpu-{index}-mutex", "counters": {"partition-mode": {"value": "1"}}}],
    }
    if count > 1:
        dev["allowMultipleAllocations"] = True
    if active_memory and memory != active_memory:
        dev["taints"] = [{"key": TAINT_KEY, "value": active_memory, "effect": "NoExecute", "timeAdded": "2026-08-01T12:00:00Z"}]
    return dev


def autopartition_slices(node: str, gpus: list[FakeAmdGpu], active_memory: str = "nps1") -> list[dict[str, Any]]:
    """The node's two slices (counter sets, devices) for these physical GPUs (sorted by PCI
    address, as the driver numbers them), with the memory mode ``active_memory`` locked by an
    allocation ("" for none: then nothing is tainted NoExecute)."""
    ordered = sorted(gpus, key=_bdf)
    pool = {"name": node, "generation": 1, "resourceSliceCount": 2}
    counters = [{"name": f"gpu-{i}-mutex", "counters": {"partition-mode": {"value": "1"}}} for i in range(len(ordered))]
    devices = [_device(i, g, c, m, n, active_memory) for i, g in enumerate(ordered) for c, m, n in CONFIGS]
    return [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{DRIVER}-counters"},
         "spec": {"driver": DRIVER, "nodeName": node, "pool": pool, "sharedCounters": counters}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{DRIVER}-devices"},
         "spec": {"driver": DRIVER, "nodeName": node, "pool": pool, "devices": devices}},
    ]
