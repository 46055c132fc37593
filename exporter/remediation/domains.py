"""Fault domains: which DRA devices one physical fault takes down.

Faults happen to physical GPUs; DRA devices are what a DeviceTaintRule selects. One GPU is
published as many DRA devices, and all of them go down with it:

* NVIDIA full GPU ``gpu-<minor>`` (``uuid`` attribute ``GPU-...``);
* NVIDIA static MIG devices ``gpu-<minor>-mig-<profile>-<gi>-<start>``: attribute ``uuid``
  (``MIG-...``) and ``parentUUID`` (the GPU);
* NVIDIA DynamicMIG partitions, one per profile and placement (about 26 per H100), published
  next to ``gpu-<minor>`` and drawing on its counter set through ``consumesCounters``: no
  ``uuid`` (the MIG instance exists only once prepared), ``parentUUID`` names the GPU;
* AMD partitions (``type`` ``amdgpu-partition``): the parent GPU through ``parentPciAddr`` /
  ``parentDeviceID`` (before v1.0) or the shared ``resource.kubernetes.io/pciBusID``, told apart
  by card and render index.

Sources: NVIDIA/k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``mig.go`` and
``partitions.go``; ROCm/k8s-gpu-dra-driver's driver-attributes document and
``cmd/gpu-kubeletplugin/deviceinfo.go``. The join (:func:`exporter.model.join.join`) resolves
each published device to the local device (its ``uuid``) and the GPU it lives on, and the
snapshot carries them (``Snapshot.published``); this module only groups. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..model.snapshot import PublishedDevice
from .plan import Target


@dataclass(frozen=True)
class FaultDomain:
    """One physical GPU and every DRA device of this node's slices backed by it."""

    gpu: str  # the physical GPU's uuid: the unit every safety rail counts
    targets: tuple[Target, ...]


def targets(published: Iterable[PublishedDevice]) -> list[Target]:
    """Every published device that resolves to a local device, with its fault domain."""
    return [Target(driver=p.driver, pool=p.pool, device=p.device, uuid=p.uuid, gpu=p.gpu) for p in published if p.uuid]


def group(ts: list[Target]) -> list[FaultDomain]:
    """Targets grouped by physical GPU, in a stable order (by GPU uuid, devices by name)."""
    by: dict[str, list[Target]] = {}
    for t in ts:
        by.setdefault(t.domain, []).append(t)
    return [FaultDomain(gpu=g, targets=tuple(sorted(v, key=lambda t: t.key))) for g, v in sorted(by.items())]
