"""DRA device and device-plugin id -> local device resolution."""

from __future__ import annotations

import pytest

from exporter.devices.model import DeviceIdentity, Vendor
from exporter.k8s.model import AllocatedDevice, SliceDevice
from exporter.k8s.resolve import DeviceIndex, Resolution, parse_mig_name, resolve, resolve_device_plugin

NV = "gpu.nvidia.com"
AMD = "gpu.amd.com"

GPU0 = DeviceIdentity(uuid="GPU-0000", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:3b:00.0", index=0, minor=0)
GPU1 = DeviceIdentity(uuid="GPU-1111", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:5e:00.0", index=1, minor=3)
MIG1 = DeviceIdentity(
    uuid="MIG-aaaa",
    vendor=Vendor.NVIDIA,
    model="H100",
    pci_bus_id="0000:5e:00.0",
    index=0,
    parent_uuid="GPU-1111",
    mig_profile="1g.10gb",
    gi_profile_id=19,
    placement_start=4,
)
MIG2 = DeviceIdentity(
    uuid="MIG-bbbb",
    vendor=Vendor.NVIDIA,
    model="H100",
    pci_bus_id="0000:5e:00.0",
    index=1,
    parent_uuid="GPU-1111",
    mig_profile="3g.40gb",
    gi_profile_id=9,
    placement_start=0,
)
AMD_FULL = DeviceIdentity(
    uuid="amd-full", vendor=Vendor.AMD, model="MI300X", pci_bus_id="0000:19:00.0", index=0, card_index=1, render_index=128
)
AMD_P0 = DeviceIdentity(
    uuid="amd-p0",
    vendor=Vendor.AMD,
    model="MI300X",
    pci_bus_id="0000:9a:00.0",
    index=1,
    parent_uuid="amd-parent",
    card_index=2,
    render_index=129,
)
AMD_P1 = DeviceIdentity(
    uuid="amd-p1",
    vendor=Vendor.AMD,
    model="MI300X",
    pci_bus_id="0000:9a:00.0",
    index=2,
    parent_uuid="amd-parent",
    card_index=3,
    render_index=130,
)
OTHER = DeviceIdentity(uuid="GPU-example", vendor=Vendor.NVIDIA, model="x", pci_bus_id="0000:01:00.0", index=7, minor=7)

INDEX = DeviceIndex([GPU0, GPU1, MIG1, MIG2, AMD_FULL, AMD_P0, AMD_P1, OTHER])


def sdev(driver: str, name: str, **attrs) -> SliceDevice:
    qualified = {(k if "/" in k else f"{driver}/{k}"): v for k, v in attrs.items()}
    return SliceDevice(driver=driver, pool="node-a", name=name, attributes=qualified)


def run(driver, name, slice_dev=None, allocated=None, index=INDEX) -> Resolution:
    return resolve((driver, "node-a", name), slice_dev, allocated, index)


# --------------------------------------------------------------------------- NVIDIA


def test_full_gpu_by_uuid():
    r = run(NV, "gpu-0", sdev(NV, "gpu-0", type="gpu", uuid="GPU-0000"))
    assert r == Resolution(uuid="GPU-0000", parent_uuid="", mig_profile="", method="uuid", ok=True)


@pytest.mark.parametrize(
    "attr", ["resource.kubernetes.io/pciBusID", "pcieBusID"]  # v25.12+ standard attribute, older driver
)
def test_full_gpu_by_pci_when_uuid_missing(attr):
    r = run(NV, "gpu-3", sdev(NV, "gpu-3", type="gpu", **{attr: "0000:5E:00.0"}))
    assert (r.uuid, r.method, r.ok) == ("GPU-1111", "pci", True)


def test_full_gpu_by_minor_name_when_no_attributes():
    # the NVIDIA driver names devices after the minor number, not the NVML index
    r = run(NV, "gpu-3", sdev(NV, "gpu-3", type="gpu"))
    assert (r.uuid, r.method) == ("GPU-1111", "name-minor")


def test_static_mig_by_uuid():
    r = run(NV, "gpu-3-mig-1g10gb-19-4", sdev(NV, "gpu-3-mig-1g10gb-19-4", type="mig", uuid="MIG-aaaa", parentUUID="GPU-1111", profile="1g.10gb"))
    assert r == Resolution(uuid="MIG-aaaa", parent_uuid="GPU-1111", mig_profile="1g.10gb", method="uuid", ok=True)


def test_dynamic_mig_new_name_scheme_finds_the_local_instance():
    dev = sdev(NV, "gpu-3-mig-3g40gb-9-0", type="mig", parentUUID="GPU-1111", profile="3g.40gb")
    r = run(NV, dev.name, dev)
    assert r == Resolution(uuid="MIG-bbbb", parent_uuid="GPU-1111", mig_profile="3g.40gb", method="mig-placement", ok=True)


def test_dynamic_mig_old_name_scheme():
    # gpu-<minor>-mig-<giProfileId>-<start>-<size>: the generic regex would misread it
    dev = sdev(NV, "gpu-3-mig-19-4-1", type="mig", parentUUID="GPU-1111", profile="1g.10gb")
    r = run(NV, dev.name, dev)
    assert (r.uuid, r.parent_uuid, r.method) == ("MIG-aaaa", "GPU-1111", "mig-placement")


def test_dynamic_mig_without_local_instance_reports_the_parent():
    dev = sdev(NV, "gpu-3-mig-2g20gb-14-2", type="mig", parentUUID="GPU-1111", profile="2g.20gb")
    r = run(NV, dev.name, dev)
    assert r == Resolution(uuid="GPU-1111", parent_uuid="GPU-1111", mig_profile="2g.20gb", method="dynamic-mig-parent", ok=True)


def test_dynamic_mig_parent_found_by_minor_when_parent_uuid_is_not_local():
    dev = sdev(NV, "gpu-0-mig-1g10gb-19-0", type="mig", parentUUID="GPU-elsewhere", profile="1g.10gb")
    r = run(NV, dev.name, dev)
    assert (r.uuid, r.method) == ("GPU-0000", "dynamic-mig-parent")


def test_mig_never_resolves_to_its_parent_by_bdf():
    # a MIG device carries the parent's BDF; with neither uuid nor a parsable name it must not
    # pretend to be the full GPU through the pci lookup
    dev = sdev(NV, "weird", type="mig", parentUUID="GPU-nowhere", **{"resource.kubernetes.io/pciBusID": "0000:5e:00.0"})
    assert run(NV, "weird", dev).ok is False


def test_parse_mig_name_schemes():
    assert parse_mig_name("gpu-0-mig-1g10gb-19-0") == parse_mig_name("gpu-0-mig-19-0-1").__class__(0, 19, 0, "1g10gb")
    old = parse_mig_name("gpu-0-mig-19-0-1")
    assert (old.minor, old.gi_profile_id, old.placement_start) == (0, 19, 0)
    assert parse_mig_name("gpu-0") is None


def test_uuid_not_on_this_node():
    r = run(NV, "gpu-9", sdev(NV, "gpu-9", type="gpu", uuid="GPU-ffff"))
    assert r == Resolution(uuid="GPU-ffff", method="uuid-not-local", ok=False)
    # the name would match local minor 0, but the slice said which GPU it means
    r = run(NV, "gpu-0", sdev(NV, "gpu-0", type="gpu", uuid="GPU-ffff"))
    assert r == Resolution(uuid="GPU-ffff", method="uuid-not-local", ok=False)


# --------------------------------------------------------------------------- AMD


def test_amd_full_gpu_by_pci():
    dev = sdev(AMD, "gpu-1-128", type="amdgpu", **{"resource.kubernetes.io/pciBusID": "0000:19:00.0"})
    r = run(AMD, dev.name, dev)
    assert (r.uuid, r.ok) == ("amd-full", True)
    assert r.method == "pci-card-render"


def test_amd_partitions_sharing_a_bdf_are_told_apart_by_card_and_render():
    p0 = sdev(AMD, "gpu-2-129", type="amdgpu-partition", **{"resource.kubernetes.io/pciBusID": "0000:9a:00.0"})
    p1 = sdev(AMD, "gpu-3-130", type="amdgpu-partition", parentPciAddr="0000:9A:00.0")
    r0, r1 = run(AMD, p0.name, p0), run(AMD, p1.name, p1)
    assert (r0.uuid, r0.parent_uuid, r0.method) == ("amd-p0", "amd-parent", "pci-card-render")
    assert (r1.uuid, r1.parent_uuid) == ("amd-p1", "amd-parent")


def test_amd_unknown_partition_is_not_mapped_to_the_bdf():
    dev = sdev(AMD, "gpu-9-200", type="amdgpu-partition", **{"resource.kubernetes.io/pciBusID": "0000:19:00.0"})
    assert run(AMD, dev.name, dev).ok is False


def test_amd_legacy_pciaddr_without_card_render_in_name():
    dev = sdev(AMD, "gpu-0-cpx-nps4", type="amdgpu", pciAddr="0000:19:00.0")
    r = run(AMD, dev.name, dev)
    assert (r.uuid, r.method) == ("amd-full", "pci")


# --------------------------------------------------------------------------- other drivers


def test_unknown_driver_with_uuid():
    r = run("gpu.example.com", "gpu-0", sdev("gpu.example.com", "gpu-0", uuid="GPU-example"))
    assert (r.uuid, r.method, r.ok) == ("GPU-example", "uuid", True)


def test_unknown_driver_by_standard_pci_attribute():
    dev = sdev("gpu.intel.com", "0000-01-00-0-0x56c0", **{"resource.kubernetes.io/pciBusID": "0000:01:00.0"})
    assert run("gpu.intel.com", dev.name, dev).uuid == "GPU-example"


def test_unknown_driver_unresolvable():
    r = run("fpga.example.com", "fpga-0", sdev("fpga.example.com", "fpga-0", model="x"))
    assert r == Resolution(uuid="", method="unresolved", ok=False)


# --------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("data", [{"uuid": {"string": "GPU-0000"}}, {"uuid": "GPU-0000"}])
def test_claim_status_data_when_slice_device_is_gone(data):
    alloc = AllocatedDevice(request="r", driver="gpu.example.com", pool="node-a", device="gpu-x", data=data)
    r = run("gpu.example.com", "gpu-x", None, alloc)
    assert (r.uuid, r.method, r.ok) == ("GPU-0000", "claim-data-uuid", True)


def test_claim_data_beats_a_non_local_slice_uuid():
    alloc = AllocatedDevice(request="r", driver=NV, pool="node-a", device="gpu-9", data={"uuid": "GPU-1111"})
    r = run(NV, "gpu-9", sdev(NV, "gpu-9", uuid="GPU-ffff"), alloc)
    assert (r.uuid, r.method) == ("GPU-1111", "claim-data-uuid")


def test_name_heuristics_without_slice_or_data():
    assert run(NV, "gpu-0").uuid == "GPU-0000"
    assert run(NV, "gpu-3-mig-1g10gb-19-4").uuid == "MIG-aaaa"
    assert run(AMD, "gpu-3-130").uuid == "amd-p1"
    assert run(NV, "gpu-42") == Resolution(uuid="", method="unresolved", ok=False)


def test_empty_index_resolves_nothing_locally():
    empty = DeviceIndex([])
    assert run(NV, "gpu-0", sdev(NV, "gpu-0", uuid="GPU-0000"), index=empty).ok is False
    assert run(NV, "gpu-0", index=empty).method == "unresolved"


# --------------------------------------------------------------------------- device plugin


@pytest.mark.parametrize(
    "resource, dev_id, uuid, method",
    [
        ("nvidia.com/gpu", "GPU-0000", "GPU-0000", "device-plugin-uuid"),
        ("nvidia.com/gpu", "GPU-1111::3", "GPU-1111", "device-plugin-uuid"),  # time-slicing replica
        ("nvidia.com/gpu", "1", "GPU-1111", "device-plugin-index"),  # deviceIDStrategy=index
        ("nvidia.com/mig-1g.10gb", "MIG-aaaa", "MIG-aaaa", "device-plugin-uuid"),
        ("nvidia.com/mig-3g.40gb", "1:1", "MIG-bbbb", "device-plugin-index"),
        ("amd.com/gpu", "amd-full", "amd-full", "device-plugin-uuid"),
        ("amd.com/gpu", "0000:19:00.0", "amd-full", "device-plugin-pci"),
        ("example.com/accel", "0000:01:00.0", "GPU-example", "device-plugin-pci"),
    ],
)
def test_device_plugin(resource, dev_id, uuid, method):
    r = resolve_device_plugin(resource, dev_id, INDEX)
    assert (r.uuid, r.method, r.ok) == (uuid, method, True)


@pytest.mark.parametrize("resource, dev_id", [("nvidia.com/gpu", "GPU-nope"), ("nvidia.com/gpu", "9"), ("amd.com/gpu", ""), ("x/y", "0000:ff:00.0")])
def test_device_plugin_unresolved(resource, dev_id):
    assert resolve_device_plugin(resource, dev_id, INDEX) == Resolution(uuid="", method="unresolved", ok=False)
