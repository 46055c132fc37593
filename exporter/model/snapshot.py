"""The joined view of one node at one instant: devices, who holds them, and how they are doing.

Built by :func:`exporter.model.join.join` from the three sources; read by the metrics renderer
and the remediation engine. Immutable, so a renderer can work on it while the next is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..collect import Slot
from ..devices.model import DeviceIdentity, DeviceReading
from ..health.model import DeviceHealth
from ..k8s.model import DeviceTaint


@dataclass(frozen=True)
class DeviceView:
    identity: DeviceIdentity
    reading: DeviceReading | None  # None before the first read
    health: DeviceHealth

    @property
    def uuid(self) -> str:
        return self.identity.uuid

    @property
    def up(self) -> bool:
        return self.reading is not None and self.reading.ok

    @property
    def utilization(self) -> float | None:
        """Utilization as the claim metrics use it.

        NVML has no utilization rate for MIG instances (and MIG parents); there the best
        equivalent is GPM's SM activity, which DCGM itself recommends for MIG.
        """
        r = self.reading
        if r is None or not r.ok:
            return None
        return r.utilization_ratio if r.utilization_ratio is not None else r.sm_active_ratio


@dataclass(frozen=True)
class AllocationView:
    """One row of the join table: a device held by a container (through a claim or a plugin)."""

    driver: str  # DRA driver, or the device-plugin resource name
    pool: str  # "" for device-plugin allocations
    device: str  # DRA device name, or the device-plugin device id
    uuid: str  # resolved physical device; "" when unresolvable
    namespace: str
    pod: str
    container: str
    claim: str  # "" for device-plugin allocations
    source: str  # "dra" | "device-plugin"
    method: str  # how uuid was resolved (attribute, claim-status, minor, ...)


class ClaimView(NamedTuple):
    """One claim's devices, pods and figures. A named tuple, not a frozen dataclass: a dense
    node's join makes 512 of them every cycle, and a tuple is built in a quarter of the time."""

    namespace: str
    name: str
    devices: tuple[tuple[str, str, str], ...]  # (driver, pool, device)
    uuids: tuple[str, ...]  # resolved devices
    pods: tuple[str, ...]
    utilization: float | None  # mean over devices with a reading
    memory_used_bytes: int | None  # sum over memory pools (a shared pool counts once)
    memory_total_bytes: int | None
    power_watts: float | None  # sum over full GPUs (power is per physical GPU)
    healthy: bool


class PublishedDevice(NamedTuple):
    """A DRA device this node's ResourceSlices publish, resolved: the local device it is
    (``uuid``, "" when it resolves to none here) and the physical GPU it lives on (``gpu``, its
    fault domain). What the remediator taints; ``taints``: what its driver put on it in the slice
    (never this agent's evidence, never its rules: exported as ``dra_device_taint_info``)."""

    driver: str
    pool: str
    device: str
    uuid: str
    gpu: str
    taints: tuple[DeviceTaint, ...] = ()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.device)


class ReportedDevice(NamedTuple):
    """A DRA device of this node with the health the kubelet reports for it (KEP-4680, from its
    pods' status: exporter/k8s/podhealth.py); ``uuid`` is the local device it resolves to, "" for none."""

    driver: str
    pool: str
    device: str
    uuid: str
    health: str  # Healthy | Unhealthy | Unknown


@dataclass(frozen=True)
class Snapshot:
    node: str
    timestamp: float  # wall clock: for stamps that leave the process
    devices: tuple[DeviceView, ...] = ()
    allocations: tuple[AllocationView, ...] = ()
    claims: tuple[ClaimView, ...] = ()
    unresolved: dict[str, int] = field(default_factory=dict)  # driver -> devices we could not resolve
    pod_labels: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    pod_uids: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (namespace, pod)
    # this node's published DRA devices, sorted by key; None while the slices are not listed
    published: tuple[PublishedDevice, ...] | None = None
    monotonic: float = 0.0  # the cycle's instant on the agent's monotonic clock (exporter/clock.py)
    # (uuid, namespace, claim) -> what the claim consumed of a device several claims share, where
    # its allocation states it (KEP-5075 consumedCapacity; bytes of memory for NVIDIA's)
    consumed: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # the kubelet's health per device, sorted by key; None unless --kubelet-device-health (series absent)
    reported: tuple[ReportedDevice, ...] | None = None
    # GPU driver -> physical GPUs the device library sees and no slice of this node publishes
    # (a GPU counts as published when any device of that driver lives on it); empty while the
    # slices are not listed
    unpublished: dict[str, int] = field(default_factory=dict)

    def unpublished_notes(self) -> list[str]:
        """/readyz's lines for unpublished GPUs: the scheduler cannot allocate them."""
        return [f"{n} GPU(s) seen by the device library but published by no {drv} ResourceSlice of this node "
                "(is the DRA driver's kubelet plugin running?)" for drv, n in self.unpublished.items() if n]

    def device(self, uuid: str) -> DeviceView | None:
        for d in self.devices:
            if d.uuid == uuid:
                return d
        return None


#: the cycle's joined snapshot, for the collectors that run after the join (per-process memory)
SNAPSHOT: Slot[Snapshot] = Slot("snapshot")
