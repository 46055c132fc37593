"""AMD compute partitions as amdsmi 7.0.x reports them, end to end: amdsmi's real Python layer
over the fake library (tests/fakes/fake_amdsmi.py, ``mi300x_cpx_amdsmi_7_0``), the node's
ResourceSlice in ROCm/k8s-gpu-dra-driver's v1.x and alpha formats (tests/fakes/amd_dra_slices.py)
parsed by the agent's parser, and the join's claim figures.

amdsmi 7.0.x on an MI300X in CPX + NPS1: 8 processor handles with ONE uuid, the partition
queries answered on the first partition only, the whole 192 GiB pool (total and in use) on
every partition.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
from fakes import fake_amdsmi as fake
from fakes.amd_dra_slices import resource_slice
from fakes.fake_amdsmi import FakeAmdGpu, FakeAmdSmiNode, Status, mi300x_cpx_amdsmi_7_0
from prometheus_client.parser import text_string_to_metric_families

from exporter.devices.amd import AmdSmiBackend, GpuProbe, assign_partitions
from exporter.devices.model import DeviceIdentity, DeviceReading
from exporter.k8s.parse import parse_slice
from exporter.k8s.resolve import DeviceIndex, resolve
from exporter.kubelet.model import AllocationSource, ContainerAllocation
from exporter.metrics.render import Renderer, RenderState
from exporter.model.join import JoinInputs, join
from exporter.model.snapshot import Snapshot

GiB = 1024**3
NODE = "mi300x-node"
AMD = "gpu.amd.com"
CPX_UUID = "5a1b7e3c-0000-1000-8000-0c42a1b2c3d4"  # what 7.0.x reports on all 8 partitions
FULL_UUID = "9d2c4f6a-0000-1000-8000-0c42a1b2c3e5"


@pytest.fixture(scope="module")
def amdsmi_module():
    return fake.import_amdsmi()


@pytest.fixture(autouse=True)
def _detach_fake_node():
    yield
    fake.detach_node()


def mi300x_node() -> tuple[FakeAmdSmiNode, list[FakeAmdGpu]]:
    """One MI300X in SPX (a full GPU) and one in CPX + NPS1, as amdsmi 7.0.x reports them."""
    full = FakeAmdGpu(uuid=FULL_UUID, bdf="0000:05:00.0", card=0, render=127, vram_total=192 * GiB)
    parts = mi300x_cpx_amdsmi_7_0(CPX_UUID, "0000:83:00.0", card=1, render=128)
    return FakeAmdSmiNode([full, *parts]), parts


@pytest.fixture
def node_and_backend(amdsmi_module):
    node, parts = mi300x_node()
    fake.FAKE_LIB.node = node
    b = AmdSmiBackend()
    b.open()
    yield node, parts, b
    b.close()


def by_card(devs: list[DeviceIdentity]) -> dict[int | None, DeviceIdentity]:
    return {d.card_index: d for d in devs}


# ---------------------------------------------------------------------------------- enumeration


def test_every_partition_carries_the_mode_only_the_first_partition_answers(node_and_backend) -> None:
    node, parts, backend = node_and_backend
    devs = [d for d in backend.enumerate() if d.pci_bus_id == "0000:83:00.0"]
    assert len(devs) == 8
    # The fake behaves as 7.0.x: partitions 1..7 were asked and could not answer.
    assert all(node.call_count("amdsmi_get_gpu_compute_partition", p.key) >= 1 for p in parts)
    assert {d.mig_profile for d in devs} == {"CPX"}
    # one uuid from amdsmi, unique identities here; partition 0 stands for the GPU
    first = by_card(devs)[1]
    assert first.uuid == CPX_UUID and not first.is_partition
    assert {d.uuid for d in devs} == {CPX_UUID} | {f"{CPX_UUID}-p{p}" for p in range(1, 8)}
    assert {d.parent_uuid for d in devs} == {CPX_UUID}
    full = next(d for d in backend.enumerate() if d.uuid == FULL_UUID)
    assert (full.mig_profile, full.parent_uuid, full.memory_pool) == ("", "", "")


def test_partitions_in_nps1_share_their_parents_memory_pool(node_and_backend) -> None:
    _node, parts, backend = node_and_backend
    devs = [d for d in backend.enumerate() if d.pci_bus_id == "0000:83:00.0"]
    assert {d.memory_pool for d in devs} == {CPX_UUID}
    assert {d.memory_pool_key for d in devs} == {CPX_UUID}
    parts[0].pool.used = 40 * GiB  # type: ignore[union-attr]
    readings = [backend.read(d) for d in devs]
    # what amdsmi 7.0.x says on each partition: the whole pool
    assert {(r.memory_used_bytes, r.memory_total_bytes) for r in readings} == {(40 * GiB, 192 * GiB)}


@pytest.mark.parametrize(
    ("memory_partition", "totals", "shared"),
    [
        ("NPS1", [192 * GiB] * 8, True),
        ("", [192 * GiB] * 8, True),  # no answer from any partition: NPS1, the only mode with one pool per GPU
        ("NPS4", [48 * GiB] * 8, False),
        ("NPS1", [24 * GiB] * 7 + [None], False),  # a total missing: nothing to prove sharing
        ("NPS1", [96 * GiB, 24 * GiB, 24 * GiB, 48 * GiB], False),  # per-partition VRAM
    ],
)
def test_memory_pool_rule(memory_partition: str, totals: list[int | None], shared: bool) -> None:
    probes = [
        GpuProbe(
            index=i, handle_key=0x100 + i, uuid=f"u{i}", bdf=f"0000:83:00.{i % 8}", memory_total_bytes=t, compute_partition="CPX" if i == 0 else "",
            memory_partition=memory_partition if i == 0 else "", partition_id=i,
        )
        for i, t in enumerate(totals)
    ]
    ids, _ = assign_partitions(probes)
    assert {d.mig_profile for d in ids} == {"CPX"}
    assert [d.memory_pool for d in ids] == (["u0"] * len(ids) if shared else [""] * len(ids))


# ---------------------------------------------------------------------------------- slices


@pytest.mark.parametrize("generation", ["v1", "alpha"])
def test_driver_slices_are_valid_kubernetes_objects(generation: str) -> None:
    node, _parts = mi300x_node()
    kubernetes_validate.validate(resource_slice(NODE, node.gpus, generation=generation), "1.34", strict=True)


@pytest.mark.parametrize("generation", ["v1", "alpha"])
def test_both_driver_generations_resolve_every_device_to_its_partition(node_and_backend, generation: str) -> None:
    node, _parts, backend = node_and_backend
    idents = backend.enumerate()
    index = DeviceIndex(idents)
    slice_devices = parse_slice(resource_slice(NODE, node.gpus, generation=generation), "resource.k8s.io/v1")
    assert len(slice_devices) == 9
    for sd in slice_devices:
        res = resolve(sd.key, sd, None, index)
        card, render = (int(x) for x in sd.name.split("-")[1:3])
        want = next(d for d in idents if (d.card_index, d.render_index) == (card, render))
        assert (res.ok, res.uuid, res.parent_uuid) == (True, want.uuid, want.parent_uuid), (generation, sd.name, res)
        if sd.attr("type") == "amdgpu-partition":
            assert res.mig_profile == "CPX"
            assert sd.attr("partitionProfile") == "cpx_nps1"


# ---------------------------------------------------------------------------------- claim figures


def _snapshot(names: list[str], node: FakeAmdSmiNode, backend: AmdSmiBackend, generation: str = "v1") -> Snapshot:
    idents = tuple(backend.enumerate())
    readings: dict[str, DeviceReading] = {d.uuid: backend.read(d) for d in idents}
    slices = {sd.key: sd for sd in parse_slice(resource_slice(NODE, node.gpus, generation=generation), "resource.k8s.io/v1")}
    allocations = tuple(
        ContainerAllocation(
            namespace="ml", pod="trainer", container="main", source=AllocationSource.DRA, driver=AMD, pool=NODE, device=name,
            claim_namespace="ml", claim_name="two-partitions",
        )
        for name in names
    )
    return join(JoinInputs(node=NODE, timestamp=1.0, identities=idents, readings=readings, health={}, allocations=allocations, slices=slices))


def _claim_on(names: list[str], node: FakeAmdSmiNode, backend: AmdSmiBackend, generation: str = "v1"):
    (claim,) = _snapshot(names, node, backend, generation).claims
    return claim


def test_the_exported_series_carry_the_mode_and_the_pool_once(node_and_backend) -> None:
    """What a scrape shows: gpu_info on all 8 partitions says CPX; the claim's memory is the
    pool's (192 GiB), each partition's own gauges show the pool as amdsmi reports it."""
    node, parts, backend = node_and_backend
    parts[0].pool.used = 40 * GiB  # type: ignore[union-attr]
    snap = _snapshot(["gpu-2-129", "gpu-5-132"], node, backend)
    body = Renderer().render(RenderState(snapshot=snap)).body.decode()
    samples = {f.name: f.samples for f in text_string_to_metric_families(body)}
    profiles = {s.labels["uuid"]: s.labels["mig_profile"] for s in samples["gpu_info"] if s.labels["pci_bus_id"] == "0000:83:00.0"}
    assert len(profiles) == 8 and set(profiles.values()) == {"CPX"}
    (total,) = samples["dra_claim_memory_total_bytes"]
    (used,) = samples["dra_claim_memory_used_bytes"]
    assert (used.value, total.value) == (40 * GiB, 192 * GiB)


@pytest.mark.parametrize("generation", ["v1", "alpha"])
def test_a_claim_on_two_cpx_partitions_counts_the_shared_pool_once(node_and_backend, generation: str) -> None:
    """Issue 24: a claim on two CPX partitions of one MI300X with 40 GiB in use reports 40 GiB
    used and 192 GiB total, not 80 and 384."""
    node, parts, backend = node_and_backend
    parts[0].pool.used = 40 * GiB  # type: ignore[union-attr]
    claim = _claim_on(["gpu-2-129", "gpu-5-132"], node, backend, generation)
    assert len(claim.uuids) == 2
    assert (claim.memory_used_bytes, claim.memory_total_bytes) == (40 * GiB, 192 * GiB)


def test_devices_with_memory_of_their_own_still_add_up(node_and_backend) -> None:
    node, parts, backend = node_and_backend
    parts[0].pool.used = 40 * GiB  # type: ignore[union-attr]
    node.gpu(FULL_UUID).vram_used = 10 * GiB
    claim = _claim_on(["gpu-0-127", "gpu-1-128", "gpu-2-129"], node, backend)
    assert (claim.memory_used_bytes, claim.memory_total_bytes) == (50 * GiB, 384 * GiB)


def test_a_lost_partition_does_not_drop_its_pool_from_the_claim(node_and_backend) -> None:
    node, parts, backend = node_and_backend
    parts[0].pool.used = 40 * GiB  # type: ignore[union-attr]
    node.fail("amdsmi_get_gpu_activity", Status.NOT_FOUND, uuid=parts[1].key)  # partition 1 reads as lost
    claim = _claim_on(["gpu-2-129", "gpu-3-130"], node, backend)
    assert (claim.memory_used_bytes, claim.memory_total_bytes) == (40 * GiB, 192 * GiB)
