"""What the kubelet says is allocated: one row per (pod, container, device).

PodResources reports two kinds of allocation. Device-plugin devices are identified by the
plugin's device id (NVIDIA: the GPU or MIG UUID; AMD: a PCI bus id or UUID). DRA devices are
identified by (driver, pool, device), the triple that ResourceSlices publish; the claim that
holds them comes along. CDI names are deliberately not kept: the kubelet appends them per
driver, so they accumulate across a claim's devices and identify nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AllocationSource(str, enum.Enum):
    DRA = "dra"
    DEVICE_PLUGIN = "device-plugin"


@dataclass(frozen=True, slots=True)  # slots: a node's answer may hold tens of thousands of rows
class ContainerAllocation:
    namespace: str
    pod: str
    container: str
    source: AllocationSource
    # device plugin
    resource_name: str = ""  # e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu
    device_id: str = ""  # plugin device id (NVIDIA: GPU-/MIG- UUID)
    # DRA
    driver: str = ""
    pool: str = ""
    device: str = ""
    claim_namespace: str = ""
    claim_name: str = ""
    share_id: str = ""  # consumable-capacity share (1.35+), empty when absent


@dataclass(frozen=True)
class PodResourcesSnapshot:
    """The result of one successful List call."""

    allocations: tuple[ContainerAllocation, ...]
    pods: tuple[tuple[str, str], ...]  # (namespace, pod) of every pod the kubelet listed
    # Allocation entries that identify no device and were left out: DRA claim resources
    # without driver/pool/device (kubelets 1.27-1.30 send only CDI names) and empty
    # device-plugin ids. Reported so the gap is visible instead of silently shrinking.
    skipped_entries: int = 0
