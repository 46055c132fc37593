"""allocations x slices x devices -> Snapshot. Pure: no I/O, no clocks, no globals.

Invariants (checked by the property test tests/test_join.py::test_join_invariants):
  * every claim the kubelet reports appears exactly once, however many pods share it;
  * every allocated device appears once per container that holds it;
  * every enumerated device appears once, allocated or not;
  * nothing raises, whatever the inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..devices.model import DeviceIdentity, DeviceReading, Vendor, normalize_pci_bus_id
from ..health.model import DeviceHealth, Scope
from ..k8s.model import ClaimInfo, DeviceKey, PodInfo, SliceDevice
from ..k8s.resolve import (
    AMD_DRIVER,
    NVIDIA_DRIVER,
    PCI_BUS_ID_ATTR,
    DeviceIndex,
    Resolution,
    resolve,
    resolve_device_plugin,
)
from ..kubelet.model import AllocationSource, ContainerAllocation
from .snapshot import AllocationView, ClaimView, DeviceView, PublishedDevice, Snapshot


@dataclass(frozen=True)
class JoinInputs:
    node: str
    timestamp: float  # wall: the stamp that leaves the process
    identities: tuple[DeviceIdentity, ...]
    readings: Mapping[str, DeviceReading]
    health: Mapping[str, DeviceHealth]
    allocations: tuple[ContainerAllocation, ...] = ()
    slices: Mapping[DeviceKey, SliceDevice] | None = None
    claims: Mapping[tuple[str, str], ClaimInfo] | None = None
    pods: tuple[PodInfo, ...] = ()
    pod_labels: Mapping[tuple[str, str], Mapping[str, str]] | None = None
    monotonic: float = 0.0  # the cycle's instant on the monotonic clock: what durations are measured on


def effective_health(uuid: str, parent_uuid: str, health: Mapping[str, DeviceHealth]) -> DeviceHealth:
    """A device's own conditions plus its GPU's GPU-wide ones.

    A MIG instance or partition is only as healthy as the GPU it lives on; but a fault scoped
    to one instance (an instance-scoped XID) is that instance's alone: it never shows on the
    parent or on a sibling. A sticky GPU makes its instances sticky too.
    """
    own = health.get(uuid) or DeviceHealth(uuid=uuid)
    if not parent_uuid or parent_uuid == uuid:
        return own
    parent = health.get(parent_uuid)
    if parent is None:
        return own
    inherited = tuple(c for c in parent.conditions if c.scope == Scope.GPU)
    if not inherited and not parent.sticky:
        return own
    return DeviceHealth(uuid=uuid, conditions=own.conditions + inherited, sticky=own.sticky or parent.sticky)


# (namespace, name, (driver, pool, device) keys, resolved uuids, pods) of one GPU claim
ClaimGroup = tuple[str, str, tuple[DeviceKey, ...], tuple[str, ...], tuple[str, ...]]
# (utilization, memory used, memory total, power, healthy) of a claim's devices
Figures = tuple[float | None, int | None, int | None, float | None, bool]


@dataclass(frozen=True)
class _Structure:
    """What a join derives from who holds what: the allocation rows, the claims' membership and
    the unresolved counts. It changes when pods, claims, slices or devices do, not when readings
    or health do, so JoinMemo keeps it between cycles."""

    rows: tuple[AllocationView, ...]
    claims: tuple[ClaimGroup, ...]  # sorted
    unresolved: dict[str, int]
    published: tuple[PublishedDevice, ...] = ()
    unpublished: dict[str, int] | None = None
    consumed: dict[tuple[str, str, str], float] | None = None  # Snapshot.consumed


class JoinMemo:
    """The last join's structure and the inputs it came from. On a steady node the kubelet,
    claim and slice inputs are equal from cycle to cycle (mostly the very same objects, which
    makes the comparison a pointer check in C), and re-deriving 512 claims' structure was the
    largest share of the dense node's cycle. The join stays a pure function of its inputs: a
    memo only saves recomputing an equal result."""

    __slots__ = ("key", "structure")

    def __init__(self) -> None:
        self.key: tuple[object, ...] | None = None
        self.structure: _Structure | None = None


def join(inp: JoinInputs, memo: JoinMemo | None = None) -> Snapshot:
    slices = inp.slices or {}
    claims = inp.claims or {}
    devices = tuple(
        DeviceView(
            identity=ident,
            reading=inp.readings.get(ident.uuid),
            health=effective_health(ident.uuid, ident.parent_uuid if ident.is_partition else "", inp.health),
        )
        for ident in inp.identities
    )
    key = (inp.allocations, slices, claims, inp.identities)
    if memo is not None and memo.structure is not None and memo.key == key:
        structure = memo.structure
    else:
        structure = _structure(inp.allocations, slices, claims, inp.identities)
        if memo is not None:
            memo.key, memo.structure = key, structure
    by_uuid = {d.uuid: d for d in devices}
    return Snapshot(
        node=inp.node,
        timestamp=inp.timestamp,
        monotonic=inp.monotonic,
        devices=devices,
        allocations=structure.rows,
        claims=_claim_views(structure.claims, by_uuid),
        unresolved=dict(structure.unresolved),
        pod_labels={k: dict(v) for k, v in (inp.pod_labels or {}).items()},
        pod_uids={p.uid: (p.namespace, p.name) for p in inp.pods if p.uid},
        published=structure.published if inp.slices is not None else None,
        unpublished=dict(structure.unpublished or {}) if inp.slices is not None else {},
        consumed=structure.consumed or {},
    )


def _structure(
    allocations: tuple[ContainerAllocation, ...],
    slices: Mapping[DeviceKey, SliceDevice],
    claims: Mapping[tuple[str, str], ClaimInfo],
    identities: tuple[DeviceIdentity, ...],
) -> _Structure:
    index = DeviceIndex(identities)
    # Resolve each distinct device once, not once per container that holds it.
    resolved: dict[tuple[str, str, str, str], Resolution] = {}
    rows: list[AllocationView] = []
    seen_rows: set[AllocationView] = set()
    unresolved: dict[str, set[str]] = defaultdict(set)
    # Drivers whose devices are GPUs this agent reads: the vendor GPU drivers, and any driver
    # with a device that resolved here. A node's other DRA drivers (NICs, NVIDIA's
    # compute-domain channels) allocate devices that are no GPU at all: not "unresolved".
    gpu_drivers = {NVIDIA_DRIVER, AMD_DRIVER}
    consumed: dict[tuple[str, str, str], float] = {}

    for a in allocations:
        if a.source == AllocationSource.DRA:
            key = (a.driver, a.pool, a.device)
            rkey = ("dra",) + key
            if rkey not in resolved:
                claim = claims.get((a.claim_namespace, a.claim_name))
                resolved[rkey] = resolve(key, slices.get(key), claim.device(*key) if claim else None, index)
            res = resolved[rkey]
            dev = slices.get(key)
            if dev is not None and dev.multiple and res.ok and (res.uuid, a.namespace, a.claim_name) not in consumed:
                amount = _consumed(dev, claims.get((a.claim_namespace, a.claim_name)))
                if amount is not None:
                    consumed[(res.uuid, a.namespace, a.claim_name)] = amount
            row = AllocationView(
                driver=a.driver, pool=a.pool, device=a.device, uuid=res.uuid, namespace=a.namespace, pod=a.pod,
                container=a.container, claim=a.claim_name, source="dra", method=res.method,
            )
        else:
            rkey = ("dp", a.resource_name, a.device_id, "")
            if rkey not in resolved:
                resolved[rkey] = resolve_device_plugin(a.resource_name, a.device_id, index)
            res = resolved[rkey]
            row = AllocationView(
                driver=a.resource_name, pool="", device=a.device_id, uuid=res.uuid, namespace=a.namespace, pod=a.pod,
                container=a.container, claim="", source="device-plugin", method=res.method,
            )
        if not res.ok:
            unresolved[row.driver].add(f"{row.pool}/{row.device}")
        elif a.source == AllocationSource.DRA:
            gpu_drivers.add(row.driver)
        if row not in seen_rows:
            seen_rows.add(row)
            rows.append(row)

    # Claim metrics are about GPUs: a NIC in a GPU+NIC claim is not one of its devices, and a
    # claim holding no GPU at all (a compute-domain channel, say) is not exported.
    published = _published(slices, index)
    return _Structure(
        rows=tuple(rows),
        claims=_claim_groups(r for r in rows if r.driver in gpu_drivers),
        unresolved=_unresolved_counts(slices, unresolved, gpu_drivers, _plugin_gpu_resources(rows)),
        published=published,
        unpublished=_unpublished(slices, published, identities),
        consumed=consumed,
    )


def _consumed(dev: SliceDevice, claim: ClaimInfo | None) -> float | None:
    """What a claim consumed of a device several claims share (KEP-5075 consumedCapacity): its
    memory, else the first capacity the slice names that the allocation states; summed over the
    claim's allocations of the device (one per shareID). None when the allocation states none."""
    if claim is None:
        return None
    names = sorted(dev.capacity, key=lambda n: (not n.endswith("/memory"), n))
    allocs = [d.consumed for d in claim.devices if (d.driver, d.pool, d.device) == dev.key]
    name = next((n for n in names if any(n in c for c in allocs)), None)
    return sum(c.get(name, 0.0) for c in allocs) if name is not None else None


def _published(slices: Mapping[DeviceKey, SliceDevice], index: DeviceIndex) -> tuple[PublishedDevice, ...]:
    """Every device the node's slices publish, resolved to the local device it is and its fault
    domain (the physical GPU it lives on): the remediator's targets."""
    out = []
    for key, dev in sorted(slices.items()):
        res = resolve(key, dev, None, index)
        if not res.ok:
            out.append(PublishedDevice(*key, "", "", dev.taints))
            continue
        ident = index.by_uuid.get(res.uuid)
        # a DynamicMIG partition resolves to its GPU itself (res.uuid == parent_uuid)
        gpu = res.parent_uuid or (ident.physical_uuid if ident is not None else res.uuid)
        out.append(PublishedDevice(*key, res.uuid, gpu, dev.taints))
    return tuple(out)


_VENDOR_DRIVERS = {Vendor.NVIDIA: NVIDIA_DRIVER, Vendor.AMD: AMD_DRIVER}


def _unpublished(
    slices: Mapping[DeviceKey, SliceDevice], published: tuple[PublishedDevice, ...],
    identities: tuple[DeviceIdentity, ...]
) -> dict[str, int]:
    """Per GPU driver, the physical GPUs the library sees that no device of this driver's slices
    lives on (the GPU itself, a MIG device or partition of it): invisible to the scheduler. A
    GPU in MIG mode whose MIG devices are published is published; 0 for a driver with none. A
    device the resolver cannot pin to one partition (AMD's AutoPartition devices of a GPU in CPX)
    still names its GPU by PCI address: that GPU is published."""
    held = {(p.driver, p.gpu) for p in published}
    held |= {(d.driver, normalize_pci_bus_id(pci))
             for d in slices.values() if isinstance(pci := d.attr(PCI_BUS_ID_ATTR), str) and pci}
    seen: dict[tuple[str, str], bool] = {}
    for i in identities:
        if (drv := _VENDOR_DRIVERS.get(i.vendor)) is not None:
            key = (drv, i.physical_uuid)
            seen[key] = seen.get(key, False) or key in held or (drv, normalize_pci_bus_id(i.pci_bus_id)) in held
    missing = [drv for (drv, _), ok in seen.items() if not ok]
    return {drv: missing.count(drv) for drv in sorted({drv for drv, _ in seen})}


# Device-plugin resources that are GPUs by name. Others on a GPU node (RDMA, SR-IOV NICs,
# fuse, ...) hold devices this agent never reads: they are not "unresolved" GPUs.
_GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-", "amd.com/gpu")


def _plugin_gpu_resources(rows: Iterable[AllocationView]) -> set[str]:
    """Device-plugin resources that hold GPUs: the vendors' GPU resource names, and any
    resource (a renamed or time-sliced one) with a device that resolved to a local GPU."""
    return {
        r.driver
        for r in rows
        if r.source == "device-plugin" and (r.driver.startswith(_GPU_RESOURCE_PREFIXES) or r.uuid)
    }


def _unresolved_counts(
    slices: Mapping[DeviceKey, SliceDevice], unresolved: Mapping[str, set[str]], gpu_drivers: set[str],
    plugin_resources: set[str]
) -> dict[str, int]:
    """Unresolved GPUs per driver (device-plugin resources are GPU resources by construction),
    with 0 for every GPU driver this node's slices publish: alerts and dashboards can then tell
    "all resolved" from "not known" (no slices listed)."""
    counts = dict.fromkeys((key[0] for key in slices if key[0] in gpu_drivers), 0)
    counts.update((drv, len(devs)) for drv, devs in unresolved.items() if drv in gpu_drivers or drv in plugin_resources)
    return dict(sorted(counts.items()))


def _claim_groups(rows: Iterable[AllocationView]) -> tuple[ClaimGroup, ...]:
    groups: dict[tuple[str, str], list[AllocationView]] = defaultdict(list)
    for r in rows:
        if r.source == "dra" and r.claim:
            groups[(r.namespace, r.claim)].append(r)
    return tuple(
        (
            ns,
            name,
            tuple(sorted({(m.driver, m.pool, m.device) for m in members})),
            tuple(sorted({m.uuid for m in members if m.uuid})),
            tuple(sorted({m.pod for m in members})),
        )
        for (ns, name), members in sorted(groups.items())
    )


def _claim_views(
    groups: tuple[ClaimGroup, ...], by_uuid: Mapping[str, DeviceView]
) -> tuple[ClaimView, ...]:
    # Claims holding the same devices have the same figures: a dense node's 512 claims share
    # a few dozen device sets, so each set is aggregated once per cycle.
    figures: dict[tuple[str, ...], Figures] = {}
    out = []
    make = ClaimView._make
    for group in groups:
        uuids = group[3]
        f = figures.get(uuids)
        if f is None:
            f = figures[uuids] = _figures(uuids, by_uuid)
        out.append(make(group + f))
    return tuple(out)


def _figures(uuids: tuple[str, ...], by_uuid: Mapping[str, DeviceView]) -> Figures:
    """(utilization, memory used, memory total, power, healthy) of a claim on these devices."""
    views = [by_uuid[u] for u in uuids if u in by_uuid]
    utils = [u for u in (v.utilization for v in views) if u is not None]
    # Memory is counted once per pool: devices sharing one (an AMD GPU's partitions in NPS1,
    # each reporting the whole pool) would otherwise multiply it. Members of a pool report the
    # same figures, read moments apart: the largest is taken.
    mem_used: dict[str, int] = {}
    mem_total: dict[str, int] = {}
    for v in views:
        r = v.reading
        if not v.up or r is None:
            continue
        pool = v.identity.memory_pool_key
        if r.memory_used_bytes is not None:
            mem_used[pool] = max(r.memory_used_bytes, mem_used.get(pool, 0))
        if r.memory_total_bytes is not None:
            mem_total[pool] = max(r.memory_total_bytes, mem_total.get(pool, 0))
    # Power is a property of the physical GPU: MIG instances have none of their own.
    power = [
        v.reading.power_watts
        for v in views
        if v.up and v.reading is not None and v.reading.power_watts is not None and not v.identity.is_partition
    ]
    return (
        (sum(utils) / len(utils)) if utils else None,
        sum(mem_used.values()) if mem_used else None,
        sum(mem_total.values()) if mem_total else None,
        sum(power) if power else None,
        # A device we could not resolve or read counts as unhealthy only through its health;
        # unknown is not broken. A lost GPU has a health condition, so it shows here.
        all(v.health.healthy for v in views),
    )
