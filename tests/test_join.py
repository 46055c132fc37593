"""The pure join: kubelet allocations x ResourceSlices x claims x devices -> Snapshot.

Examples for each rule, then a property test over random allocations and slices that checks
the join's invariants: each claim exactly once, each allocated device once per container that
holds it, every enumerated device once, and no exception for any input.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit_helpers import gpu

from exporter.devices.model import DeviceIdentity, DeviceReading, ReadError, Vendor
from exporter.health.model import Condition, DeviceHealth, Tier
from exporter.k8s.model import AllocatedDevice, ClaimInfo, SliceDevice
from exporter.kubelet.model import AllocationSource, ContainerAllocation
from exporter.model.join import JoinInputs, JoinMemo, effective_health, join
from exporter.model.snapshot import Snapshot

NV = "gpu.nvidia.com"
AMD = "gpu.amd.com"
NODE = "node-a"


def mig(parent: DeviceIdentity, j: int, start: int) -> DeviceIdentity:
    return DeviceIdentity(
        uuid=f"MIG-{parent.minor}{j}000000-0000-0000-0000-000000000000", vendor=Vendor.NVIDIA, model="H100 MIG 3g.40gb",
        pci_bus_id=parent.pci_bus_id, index=j, minor=parent.minor, parent_uuid=parent.uuid, mig_profile="3g.40gb",
        gi_profile_id=9, placement_start=start, memory_total_bytes=40 * 2**30,
    )


G0, G1, G2, G3 = gpu(0), gpu(1), gpu(2), gpu(3)
M20, M24 = mig(G2, 0, 0), mig(G2, 1, 4)
IDENTS = (G0, G1, G2, M20, M24, G3)


def slice_dev(name: str, **attrs) -> SliceDevice:
    return SliceDevice(driver=NV, pool=NODE, name=name, attributes={f"{NV}/{k}": v for k, v in attrs.items()})


SLICES = {
    d.key: d
    for d in (
        slice_dev("gpu-0", uuid=G0.uuid),
        slice_dev("gpu-1", uuid=G1.uuid),
        slice_dev("gpu-2-mig-3g40gb-9-0", uuid=M20.uuid, parentUUID=G2.uuid, profile="3g.40gb"),
        slice_dev("gpu-2-mig-3g40gb-9-4", uuid=M24.uuid, parentUUID=G2.uuid, profile="3g.40gb"),
        slice_dev("gpu-3", uuid=G3.uuid),
    )
}


def reading(uuid: str, util: float | None = 0.5, mem: int | None = 10 * 2**30, total: int = 80 * 2**30, power: float | None = 300.0) -> DeviceReading:
    return DeviceReading(uuid=uuid, utilization_ratio=util, memory_used_bytes=mem, memory_total_bytes=total, power_watts=power)


def dra(ns: str, pod: str, container: str, claim: str, device: str, driver: str = NV, pool: str = NODE) -> ContainerAllocation:
    return ContainerAllocation(
        namespace=ns, pod=pod, container=container, source=AllocationSource.DRA, driver=driver, pool=pool, device=device,
        claim_namespace=ns, claim_name=claim,
    )


def dp(ns: str, pod: str, container: str, device_id: str, resource: str = "nvidia.com/gpu") -> ContainerAllocation:
    return ContainerAllocation(namespace=ns, pod=pod, container=container, source=AllocationSource.DEVICE_PLUGIN, resource_name=resource, device_id=device_id)


def run(allocations=(), readings=None, health=None, slices=SLICES, claims=None, identities=IDENTS) -> Snapshot:
    if readings is None:
        readings = {i.uuid: reading(i.uuid) for i in identities}
    return join(
        JoinInputs(
            node=NODE, timestamp=1000.0, identities=tuple(identities), readings=readings, health=health or {},
            allocations=tuple(allocations), slices=slices, claims=claims,
        )
    )


def fatal(uuid: str, reason: str = "xid_79") -> DeviceHealth:
    return DeviceHealth(uuid=uuid, conditions=(Condition(uuid=uuid, tier=Tier.FATAL, reason=reason, since=1.0, last_seen=1.0),))


# ------------------------------------------------------------------ examples


def test_every_device_once_even_without_allocations():
    snap = run()
    assert [d.uuid for d in snap.devices] == [i.uuid for i in IDENTS]
    assert snap.allocations == () and snap.claims == ()
    assert snap.device(G3.uuid).up and snap.device("nope") is None


def test_shared_claim_is_one_claim_with_two_pods():
    snap = run([dra("ml", "trainer-a", "main", "shared", "gpu-0"), dra("ml", "trainer-b", "main", "shared", "gpu-0")])
    assert len(snap.allocations) == 2
    assert {(a.pod, a.uuid, a.method) for a in snap.allocations} == {("trainer-a", G0.uuid, "uuid"), ("trainer-b", G0.uuid, "uuid")}
    (c,) = snap.claims
    assert (c.namespace, c.name, c.pods, c.uuids) == ("ml", "shared", ("trainer-a", "trainer-b"), (G0.uuid,))
    assert c.devices == ((NV, NODE, "gpu-0"),)
    # values are the device's, not multiplied by the number of pods
    assert c.utilization == 0.5 and c.memory_used_bytes == 10 * 2**30 and c.power_watts == 300.0


def test_same_device_in_two_containers_is_two_rows_one_claim():
    snap = run([dra("inf", "p", "server", "c", "gpu-2-mig-3g40gb-9-4"), dra("inf", "p", "sidecar", "c", "gpu-2-mig-3g40gb-9-4")])
    assert [(a.container, a.uuid) for a in snap.allocations] == [("server", M24.uuid), ("sidecar", M24.uuid)]
    assert len(snap.claims) == 1 and snap.claims[0].pods == ("p",)


def test_duplicate_kubelet_entries_collapse():
    a = dra("ml", "p", "main", "c", "gpu-1")
    snap = run([a, a])
    assert len(snap.allocations) == 1


def test_claim_over_several_devices_aggregates():
    readings = {i.uuid: reading(i.uuid) for i in IDENTS}
    readings[G0.uuid] = reading(G0.uuid, util=0.2, mem=1000, power=100.0)
    readings[G1.uuid] = reading(G1.uuid, util=0.8, mem=3000, power=500.0)
    snap = run([dra("ml", "p", "main", "big", "gpu-0"), dra("ml", "p", "main", "big", "gpu-1")], readings=readings)
    (c,) = snap.claims
    assert len(c.devices) == 2
    assert c.utilization == 0.5  # mean
    assert c.memory_used_bytes == 4000  # sum
    assert c.memory_total_bytes == 2 * 80 * 2**30
    assert c.power_watts == 600.0
    assert c.healthy


def test_memory_a_claims_devices_share_is_counted_once_per_pool():
    """Devices naming one memory_pool report the same memory (amdsmi 7.0.x: an MI300X's whole
    NPS1 pool on each CPX partition): the claim counts the pool once, read moments apart so the
    largest figure, and adds memory of other devices' own."""
    pool = G0.uuid
    p0 = dataclasses.replace(G0, parent_uuid=pool, memory_pool=pool)
    p1 = dataclasses.replace(G1, parent_uuid=pool, memory_pool=pool)
    readings = {i.uuid: reading(i.uuid) for i in IDENTS}
    readings[p0.uuid] = reading(p0.uuid, mem=40 * 2**30, total=192 * 2**30)
    readings[p1.uuid] = reading(p1.uuid, mem=41 * 2**30, total=192 * 2**30)
    idents = (p0, p1, G2, M20, M24, G3)
    snap = run([dra("ml", "p", "main", "big", "gpu-0"), dra("ml", "p", "main", "big", "gpu-1")], readings=readings, identities=idents)
    (c,) = snap.claims
    assert (c.memory_used_bytes, c.memory_total_bytes) == (41 * 2**30, 192 * 2**30)
    snap = run([dra("ml", "p", "main", "big", d) for d in ("gpu-0", "gpu-1", "gpu-3")], readings=readings, identities=idents)
    (c,) = snap.claims
    assert (c.memory_used_bytes, c.memory_total_bytes) == (51 * 2**30, 272 * 2**30)


def test_mig_claim_uses_sm_activity_and_has_no_power():
    readings = {i.uuid: reading(i.uuid) for i in IDENTS}
    readings[M20.uuid] = DeviceReading(uuid=M20.uuid, utilization_ratio=None, sm_active_ratio=0.3, memory_used_bytes=5, memory_total_bytes=40)
    snap = run([dra("inf", "p", "s", "m", "gpu-2-mig-3g40gb-9-0")], readings=readings)
    (c,) = snap.claims
    assert c.uuids == (M20.uuid,)
    assert c.utilization == 0.3
    assert c.power_watts is None


def test_unreadable_device_is_left_out_of_values_but_not_of_the_claim():
    readings = {i.uuid: reading(i.uuid) for i in IDENTS}
    readings[G1.uuid] = DeviceReading.failed(G1.uuid, ReadError.LOST)
    snap = run([dra("ml", "p", "main", "big", "gpu-0"), dra("ml", "p", "main", "big", "gpu-1")], readings=readings)
    (c,) = snap.claims
    assert len(c.devices) == 2 and c.utilization == 0.5 and c.memory_used_bytes == 10 * 2**30
    assert not snap.device(G1.uuid).up


def test_unhealthy_device_makes_the_claim_unhealthy():
    snap = run([dra("ml", "p", "main", "big", "gpu-0"), dra("ml", "p", "main", "big", "gpu-1"), dra("ml", "q", "main", "ok", "gpu-3")], health={G1.uuid: fatal(G1.uuid)})
    by = {c.name: c for c in snap.claims}
    assert not by["big"].healthy and by["ok"].healthy


def test_mig_instance_inherits_the_parent_gpus_health():
    health = {G2.uuid: fatal(G2.uuid, "gpu_lost")}
    snap = run([dra("inf", "p", "s", "m", "gpu-2-mig-3g40gb-9-0")], health=health)
    inst = snap.device(M20.uuid)
    assert not inst.health.healthy and [c.reason for c in inst.health.conditions] == ["gpu_lost"]
    assert not snap.claims[0].healthy
    # a full GPU does not inherit anything
    assert effective_health(G0.uuid, "", health).healthy


def test_resolution_without_a_slice_falls_back_to_claim_data_then_the_name():
    claims = {("ml", "c"): ClaimInfo("ml", "c", devices=(AllocatedDevice("gpu", NV, NODE, "weird-name", data={"uuid": {"string": G3.uuid}}),))}
    snap = run([dra("ml", "p", "m", "c", "weird-name"), dra("ml", "q", "m", "d", "gpu-1"), dra("ml", "r", "m", "e", "gpu-2-mig-3g40gb-9-4")], slices={}, claims=claims)
    by = {a.pod: a for a in snap.allocations}
    assert (by["p"].uuid, by["p"].method) == (G3.uuid, "claim-data-uuid")
    assert (by["q"].uuid, by["q"].method) == (G1.uuid, "name-minor")
    assert (by["r"].uuid, by["r"].method) == (M24.uuid, "name-mig")


def test_unresolved_devices_are_counted_not_dropped():
    snap = run([dra("ml", "p", "m", "c", "tpu-9", driver="tpu.example.com"), dra("ml", "p", "m", "c", "gpu-99"), dra("ml", "q", "m", "d", "gpu-98")])
    assert {(a.device, a.uuid, a.method) for a in snap.allocations} == {("tpu-9", "", "unresolved"), ("gpu-99", "", "unresolved"), ("gpu-98", "", "unresolved")}
    # the TPU is still in the join table, but it is no GPU this agent failed to find
    assert snap.unresolved == {NV: 2}
    by = {c.name: c for c in snap.claims}
    assert by["c"].uuids == () and by["c"].utilization is None and by["c"].healthy  # unknown is not broken


def test_every_slice_driver_has_an_unresolved_count_zero_included():
    """Regression: with every device resolved the driver had no count at all, so alerts and
    dashboards could not tell "all resolved" from "no data"."""
    amd = SliceDevice(driver="gpu.amd.com", pool=NODE, name="gpu-9-128", attributes={})
    snap = run([dra("ml", "p", "m", "c", "gpu-0"), dra("ml", "q", "m", "d", "gpu-3")], slices={**SLICES, amd.key: amd})
    assert all(a.uuid for a in snap.allocations)
    assert snap.unresolved == {"gpu.amd.com": 0, NV: 0}
    assert run().unresolved == {NV: 0}  # published, nothing allocated: nothing unresolved
    assert run(slices=None).unresolved == {}  # slices unknown: no claim either way
    assert run([dra("ml", "p", "m", "c", "gpu-99")]).unresolved == {NV: 1}


def test_other_dra_drivers_on_the_node_are_not_unresolved_gpus():
    """A GPU node's NIC or compute-domain driver publishes and allocates devices too; they are
    no GPU, so they must not raise dra_unresolved_devices (and its alert) forever. A driver
    that is not a vendor GPU driver counts once one of its devices resolves to a local GPU."""
    nic = SliceDevice(driver="sriov.example.com", pool=NODE, name="vf-3", attributes={"resource.kubernetes.io/pciBusID": "0000:3b:00.2"})
    slices = {**SLICES, nic.key: nic}
    snap = run([dra("ml", "p", "m", "c", "gpu-0"), dra("ml", "p", "m", "n", "vf-3", driver="sriov.example.com")], slices=slices)
    assert snap.unresolved == {NV: 0}
    assert ("vf-3", "") in {(a.device, a.uuid) for a in snap.allocations}  # still in the join table
    # claim metrics are about GPUs: the NIC-only claim is not one, and a GPU+NIC claim has one device
    assert [(c.name, c.devices) for c in snap.claims] == [("c", ((NV, NODE, "gpu-0"),))]
    mixed = run([dra("ml", "p", "m", "c", "gpu-0"), dra("ml", "p", "m", "c", "vf-3", driver="sriov.example.com")], slices=slices)
    assert [(c.name, c.devices, c.uuids) for c in mixed.claims] == [("c", ((NV, NODE, "gpu-0"),), (G0.uuid,))]
    # an unknown driver whose devices are local GPUs is a GPU driver: its misses count
    other = "gpu.example.com"
    ok = SliceDevice(driver=other, pool=NODE, name="g0", attributes={f"{other}/uuid": G0.uuid})
    bad = SliceDevice(driver=other, pool=NODE, name="g9", attributes={})
    snap = run([dra("ml", "p", "m", "c", "g0", driver=other), dra("ml", "q", "m", "d", "g9", driver=other)], slices={**SLICES, ok.key: ok, bad.key: bad})
    assert [a.uuid for a in snap.allocations if a.device == "g0"] == [G0.uuid]
    assert snap.unresolved == {NV: 0, other: 1}


def test_slice_uuid_that_is_not_local():
    slices = dict(SLICES)
    slices[(NV, NODE, "gpu-7")] = slice_dev("gpu-7", uuid="GPU-elsewhere")
    snap = run([dra("ml", "p", "m", "c", "gpu-7")], slices=slices)
    a = snap.allocations[0]
    assert (a.uuid, a.method) == ("GPU-elsewhere", "uuid-not-local")
    assert snap.unresolved == {NV: 1}


def test_device_plugin_allocations():
    snap = run([dp("legacy", "a", "m", G3.uuid), dp("legacy", "b", "m", G1.uuid + "::3"), dp("legacy", "c", "m", "0"), dp("legacy", "d", "m", M24.uuid, "nvidia.com/mig-3g.40gb"), dp("legacy", "e", "m", "GPU-gone")])
    by = {a.pod: a for a in snap.allocations}
    assert by["a"].uuid == G3.uuid and by["a"].claim == "" and by["a"].source == "device-plugin" and by["a"].driver == "nvidia.com/gpu"
    assert by["b"].uuid == G1.uuid  # time-slicing replica suffix
    assert by["c"].uuid == G0.uuid and by["c"].method == "device-plugin-index"
    assert by["d"].uuid == M24.uuid
    assert by["e"].uuid == "" and snap.unresolved == {"nvidia.com/gpu": 1, NV: 0}
    assert snap.claims == ()  # device-plugin allocations have no claim


def test_non_gpu_device_plugins_are_not_unresolved_gpus():
    """Issue 15: RDMA, SR-IOV and fuse device plugins on a GPU node hold devices this agent
    never reads; counting them kept dra_unresolved_devices (and its alert) up forever. The
    vendors' GPU resources still count a miss, and so does a renamed GPU resource (a
    time-slicing rename) once one of its devices resolves to a local GPU."""
    snap = run([
        dp("net", "a", "m", "mlx5_0", "rdma/hca_shared_devices_a"),
        dp("net", "b", "m", "0000:3b:00.2", "intel.com/sriov_netdevice"),
        dp("fs", "c", "m", "fuse0", "smarter-devices/fuse"),
        dp("ml", "d", "m", "GPU-gone"),
        dp("ml", "e", "m", "GPU-gone-too", "amd.com/gpu"),
    ])
    assert snap.unresolved == {NV: 0, "nvidia.com/gpu": 1, "amd.com/gpu": 1}
    assert {a.pod for a in snap.allocations} == {"a", "b", "c", "d", "e"}  # still in the join table
    renamed = run([dp("ml", "f", "m", G0.uuid, "nvidia.com/gpu.shared"), dp("ml", "g", "m", "GPU-gone", "nvidia.com/gpu.shared"), dp("x", "h", "m", "gpu-ish", "example.com/gpu-shared")])
    assert renamed.unresolved == {NV: 0, "nvidia.com/gpu.shared": 1}


def test_missing_readings_and_empty_inputs():
    snap = run([dra("ml", "p", "m", "c", "gpu-0")], readings={})
    assert not snap.device(G0.uuid).up and snap.device(G0.uuid).utilization is None
    assert snap.claims[0].utilization is None and snap.claims[0].memory_used_bytes is None
    empty = join(JoinInputs(node="n", timestamp=0.0, identities=(), readings={}, health={}))
    assert empty.devices == () and empty.claims == ()


# ------------------------------------------------------------------ properties

DEVICE_NAMES = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-9", "gpu-2-mig-3g40gb-9-0", "gpu-2-mig-3g40gb-9-4", "gpu-2-mig-1g10gb-19-6", "", "weird", "gpu-x-mig-y"]
DRIVERS = [NV, NV, NV, "gpu.amd.com", "other.example.com", ""]
DP_IDS = [G0.uuid, G1.uuid + "::2", M20.uuid, "0", "2:1", "7", "", "GPU-unknown", "0000:18:00.0", "::", "a:b:c"]
NAMESPACES = ["ml", "inf", ""]
PODS = ["p0", "p1", "p2", "p3"]
CONTAINERS = ["main", "side"]
CLAIMS = ["c0", "c1", "c2", "c3", ""]

dra_alloc = st.builds(
    lambda ns, pod, ct, claim, drv, dev, pool: dra(ns, pod, ct, claim, dev, driver=drv, pool=pool),
    st.sampled_from(NAMESPACES), st.sampled_from(PODS), st.sampled_from(CONTAINERS), st.sampled_from(CLAIMS),
    st.sampled_from(DRIVERS), st.sampled_from(DEVICE_NAMES), st.sampled_from([NODE, NODE, "other-pool", ""]),
)
dp_alloc = st.builds(
    lambda ns, pod, ct, dev, res: dp(ns, pod, ct, dev, res),
    st.sampled_from(NAMESPACES), st.sampled_from(PODS), st.sampled_from(CONTAINERS), st.sampled_from(DP_IDS),
    st.sampled_from(["nvidia.com/gpu", "nvidia.com/mig-3g.40gb", "amd.com/gpu", "example.com/x"]),
)
attr_values = st.one_of(
    st.sampled_from([G0.uuid, G1.uuid, M20.uuid, M24.uuid, G3.uuid, "GPU-elsewhere", "", "0000:1b:00.0", "0000:18:00.0"]),
    st.integers(-1, 5), st.booleans(),
)
slice_device = st.builds(
    lambda drv, name, attrs: SliceDevice(driver=drv, pool=NODE, name=name, attributes={(k if "/" in k else f"{drv}/{k}"): v for k, v in attrs.items()}),
    st.sampled_from(DRIVERS),
    st.sampled_from(DEVICE_NAMES),
    st.dictionaries(st.sampled_from(["uuid", "parentUUID", "profile", "minor", "pcieBusID", "resource.kubernetes.io/pciBusID", "type", "cardIndex", "renderIndex"]), attr_values, max_size=4),
)
reading_st = st.one_of(
    st.none(),
    st.builds(lambda e: DeviceReading.failed("x", e), st.sampled_from(list(ReadError))),
    st.builds(
        lambda u, sm, m, t, p: DeviceReading(uuid="x", utilization_ratio=u, sm_active_ratio=sm, memory_used_bytes=m, memory_total_bytes=t, power_watts=p),
        st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.integers(0, 2**40)),
        st.one_of(st.none(), st.integers(0, 2**40)), st.one_of(st.none(), st.floats(0, 1000)),
    ),
)
health_st = st.one_of(
    st.none(),
    st.builds(
        lambda tier, sticky: (tier, sticky),
        st.sampled_from(list(Tier)), st.booleans(),
    ),
)


def _row_key(a) -> tuple:
    return (a.source, a.driver, a.pool, a.device, a.namespace, a.pod, a.container, a.claim)


def _input_key(a: ContainerAllocation) -> tuple:
    if a.source == AllocationSource.DRA:
        return ("dra", a.driver, a.pool, a.device, a.namespace, a.pod, a.container, a.claim_name)
    return ("device-plugin", a.resource_name, "", a.device_id, a.namespace, a.pod, a.container, "")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    allocations=st.lists(st.one_of(dra_alloc, dp_alloc), max_size=25),
    slices=st.lists(slice_device, max_size=8),
    use_good_slices=st.booleans(),
    n_identities=st.integers(0, len(IDENTS)),
    readings=st.lists(reading_st, min_size=len(IDENTS), max_size=len(IDENTS)),
    healths=st.lists(health_st, min_size=len(IDENTS), max_size=len(IDENTS)),
    claim_data=st.dictionaries(st.sampled_from(CLAIMS), st.sampled_from(DEVICE_NAMES), max_size=3),
)
def test_join_invariants(allocations, slices, use_good_slices, n_identities, readings, healths, claim_data):
    identities = IDENTS[:n_identities]
    slice_map = dict(SLICES) if use_good_slices else {}
    for s in slices:
        slice_map[s.key] = s
    read_map = {}
    for ident, r in zip(identities, readings, strict=False):  # the first n_identities readings
        if r is not None:
            r.uuid = ident.uuid
            read_map[ident.uuid] = r
    health = {}
    for ident, h in zip(IDENTS, healths, strict=True):
        if h is not None:
            tier, sticky = h
            health[ident.uuid] = DeviceHealth(ident.uuid, (Condition(ident.uuid, tier, "r", 1.0, 1.0),), sticky=sticky)
    claims = {
        (ns, name): ClaimInfo(ns, name, devices=(AllocatedDevice("gpu", NV, NODE, dev, data={"uuid": G1.uuid}),))
        for name, dev in claim_data.items()
        for ns in NAMESPACES
    }
    inp = JoinInputs(
        node=NODE, timestamp=1.0, identities=identities, readings=read_map, health=health,
        allocations=tuple(allocations), slices=slice_map, claims=claims,
    )
    snap = join(inp)  # no exception escapes, whatever the input

    # every enumerated device once, in enumeration order
    assert [d.uuid for d in snap.devices] == [i.uuid for i in identities]

    # each allocated device once per container that holds it (through each claim)
    rows = Counter(_row_key(a) for a in snap.allocations)
    assert all(n == 1 for n in rows.values())
    assert set(rows) == {_input_key(a) for a in allocations}

    # each claim the kubelet reported with a GPU exactly once; GPUs: the vendor GPU drivers' devices,
    # and those of any driver with a device that resolved to a local GPU
    gpu_drivers = {NV, AMD} | {a.driver for a in snap.allocations if a.source == "dra" and a.method not in ("unresolved", "uuid-not-local")}
    gpu_allocs = [a for a in allocations if a.source == AllocationSource.DRA and a.claim_name and a.driver in gpu_drivers]
    reported = {(a.claim_namespace, a.claim_name) for a in gpu_allocs}
    got = [(c.namespace, c.name) for c in snap.claims]
    assert sorted(got) == sorted(reported) and len(got) == len(set(got))
    for c in snap.claims:
        mine = [a for a in gpu_allocs if (a.claim_namespace, a.claim_name) == (c.namespace, c.name)]
        assert set(c.devices) == {(a.driver, a.pool, a.device) for a in mine}
        assert set(c.pods) == {a.pod for a in mine}
        assert c.utilization is None or 0.0 <= c.utilization <= 1.0
        assert set(c.uuids) <= {a.uuid for a in snap.allocations if a.claim == c.name and a.namespace == c.namespace}
        local = [snap.device(u) for u in c.uuids if snap.device(u) is not None]
        assert c.healthy == all(d.health.healthy for d in local)

    # a row with a local uuid points at an enumerated device
    local_uuids = {i.uuid for i in identities}
    for a in snap.allocations:
        if a.method not in ("unresolved", "uuid-not-local"):
            assert a.uuid in local_uuids, a
    # the unresolved counts add up to the distinct unresolved devices
    assert sum(snap.unresolved.values()) <= len({(a.driver, a.pool, a.device) for a in snap.allocations})

    # pure: the same inputs give the same snapshot
    again = join(inp)
    assert again.allocations == snap.allocations and again.claims == snap.claims

    # a memo only saves work: primed with other allocations, then kept across a cycle whose
    # readings and health moved, it gives exactly what a fresh join gives
    memo = JoinMemo()
    join(dataclasses.replace(inp, allocations=tuple(allocations[:1])), memo)
    assert join(inp, memo) == snap
    kept = memo.structure
    moved = dataclasses.replace(
        inp,
        readings={u: DeviceReading(uuid=u, utilization_ratio=0.25, memory_used_bytes=7, power_watts=1.5) for u in read_map},
        health={u: DeviceHealth(u, (Condition(u, Tier.FATAL, "r", 1.0, 1.0),)) for u in list(read_map)[:1]},
    )
    assert join(moved, memo) == join(moved)
    assert memo.structure is kept  # same pods, claims, slices and devices: structure reused
