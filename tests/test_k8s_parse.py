"""Parsers for ResourceSlices, ResourceClaims and Pods across resource.k8s.io versions."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_helpers import tree_paths

from exporter.k8s.model import AllocatedDevice
from exporter.k8s.parse import ParseError, parse_claim, parse_pod, parse_slice, parse_slice_full


def nvidia_slice_v1() -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu.nvidia.com-x7k2p", "resourceVersion": "4711"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "type": {"string": "gpu"},
                        "uuid": {"string": "GPU-aaaa"},
                        "cudaDriverVersion": {"version": "12.8.0"},
                        "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
                        "minor": {"int": 0},
                        "addressingMode": {"string": "HMM"},
                        "ecc": {"bool": True},
                    },
                    "capacity": {"memory": {"value": "80Gi"}},
                },
                {
                    "name": "gpu-1-mig-1g10gb-19-0",
                    "attributes": {
                        "type": {"string": "mig"},
                        "parentUUID": {"string": "GPU-bbbb"},
                        "profile": {"string": "1g.10gb"},
                    },
                    "capacity": {"memory": {"value": "10Gi"}, "multiprocessors": {"value": "14"}},
                },
            ],
        },
    }


def to_v1beta1(obj: dict) -> dict:
    """The same slice in the v1beta1 shape: device fields nested under ``basic``."""
    out = copy.deepcopy(obj)
    out["apiVersion"] = "resource.k8s.io/v1beta1"
    out["spec"]["devices"] = [
        {"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}} for d in obj["spec"]["devices"]
    ]
    return out


# --------------------------------------------------------------------------- slices


@pytest.mark.parametrize("version", ["v1", "v1beta2"])
def test_flat_versions(version):
    obj = nvidia_slice_v1()
    obj["apiVersion"] = f"resource.k8s.io/{version}"
    devs = parse_slice(obj, version)
    assert [d.name for d in devs] == ["gpu-0", "gpu-1-mig-1g10gb-19-0"]
    gpu = devs[0]
    assert gpu.key == ("gpu.nvidia.com", "node-a", "gpu-0")
    assert gpu.attributes == {
        "gpu.nvidia.com/type": "gpu",
        "gpu.nvidia.com/uuid": "GPU-aaaa",
        "gpu.nvidia.com/cudaDriverVersion": "12.8.0",
        "resource.kubernetes.io/pciBusID": "0000:3b:00.0",
        "gpu.nvidia.com/minor": 0,
        "gpu.nvidia.com/addressingMode": "HMM",
        "gpu.nvidia.com/ecc": True,
    }
    assert gpu.attr("uuid") == "GPU-aaaa"
    assert gpu.attr("resource.kubernetes.io/pciBusID") == "0000:3b:00.0"
    assert gpu.capacity == {"gpu.nvidia.com/memory": "80Gi"}
    assert gpu.pool_generation == 3 and gpu.slice_name == "node-a-gpu.nvidia.com-x7k2p"
    assert devs[1].attr("parentUUID") == "GPU-bbbb"


def test_v1beta1_nested_basic_gives_the_same_devices():
    v1 = parse_slice(nvidia_slice_v1(), "v1")
    beta = parse_slice(to_v1beta1(nvidia_slice_v1()), "v1beta1")
    assert [(d.key, d.attributes, d.capacity) for d in beta] == [(d.key, d.attributes, d.capacity) for d in v1]


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
def test_driver_taints_in_nvidias_format_in_every_shape(version):
    """NVIDIA's DRA driver writes key, value (the XID) and effect, and leaves timeAdded to the API
    server, which then sets it; v1beta1 nests the taints under basic like the attributes."""
    obj = nvidia_slice_v1()
    obj["spec"]["devices"][0]["taints"] = [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "2026-11-28T10:00:00Z"},
        {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"},
    ]
    obj["spec"]["devices"][1]["taints"] = [{"key": "gpu.nvidia.com/unmonitored", "effect": "None"}]
    obj = to_v1beta1(obj) if version == "v1beta1" else {**obj, "apiVersion": f"resource.k8s.io/{version}"}
    gpu, mig = parse_slice(obj, version)
    assert [(t.key, t.value, t.effect) for t in gpu.taints] == [("gpu.nvidia.com/xid", "79", "NoSchedule"), ("gpu.nvidia.com/gpu-lost", "", "NoSchedule")]
    assert [(t.key, t.value, t.effect) for t in mig.taints] == [("gpu.nvidia.com/unmonitored", "", "None")]
    # a changed taint is a changed device: the join re-derives what the node publishes
    assert gpu != parse_slice(nvidia_slice_v1(), "v1")[0]


def test_list_items_without_apiversion_use_the_requested_version():
    obj = to_v1beta1(nvidia_slice_v1())
    del obj["apiVersion"]  # items of a list response carry no apiVersion
    assert parse_slice(obj, "resource.k8s.io/v1beta1")[0].attr("uuid") == "GPU-aaaa"
    # interpreted as v1 the nested shape is still recognised (basic without flat fields)
    assert parse_slice(obj, "v1")[0].attr("uuid") == "GPU-aaaa"


def test_slice_header_fields():
    parsed = parse_slice_full(nvidia_slice_v1(), "v1")
    assert (parsed.name, parsed.driver, parsed.pool, parsed.pool_generation) == (
        "node-a-gpu.nvidia.com-x7k2p",
        "gpu.nvidia.com",
        "node-a",
        3,
    )
    assert parsed.node_name == "node-a" and parsed.resource_version == "4711" and parsed.resource_slice_count == 1


def test_list_type_attributes_are_joined_and_unknown_types_skipped():
    obj = nvidia_slice_v1()
    attrs = obj["spec"]["devices"][0]["attributes"]
    attrs["numaNodes"] = {"ints": [0, 1]}
    attrs["flags"] = {"bools": [True, False]}
    attrs["names"] = {"strings": ["a", "b"]}
    attrs["future"] = {"quaternion": "1i"}
    dev = parse_slice(obj, "v1")[0]
    assert dev.attr("numaNodes") == "0,1"
    assert dev.attr("flags") == "true,false"
    assert dev.attr("names") == "a,b"
    assert dev.attr("future") is None


def test_slice_without_devices_is_an_empty_pool():
    obj = nvidia_slice_v1()
    del obj["spec"]["devices"]
    parsed = parse_slice_full(obj, "v1")
    assert parsed.devices == () and parsed.pool_generation == 3


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda o: o.pop("metadata"), "metadata"),
        (lambda o: o["metadata"].pop("name"), "metadata.name"),
        (lambda o: o["spec"].pop("driver"), "spec.driver"),
        (lambda o: o["spec"]["pool"].pop("name"), "spec.pool.name"),
        (lambda o: o["spec"]["pool"].__setitem__("generation", "3"), "spec.pool.generation"),
        (lambda o: o["spec"]["pool"].__setitem__("generation", True), "spec.pool.generation"),
        (lambda o: o["spec"].__setitem__("devices", {"gpu-0": {}}), "spec.devices"),
        (lambda o: o["spec"]["devices"][0].pop("name"), "devices[0].name"),
        (lambda o: o["spec"]["devices"][0]["attributes"].__setitem__("minor", {"int": "0"}), "attributes[minor].int"),
        (lambda o: o["spec"]["devices"][0]["attributes"].__setitem__("uuid", "GPU-aaaa"), "attributes[uuid]"),
        (lambda o: o["spec"]["devices"][0]["capacity"].__setitem__("memory", {"value": None}), "capacity[memory]"),
        (lambda o: o["spec"]["devices"].append({"name": "gpu-0"}), "duplicate"),
    ],
)
def test_malformed_slices_raise_parse_error_naming_the_field(mutate, fragment):
    obj = nvidia_slice_v1()
    mutate(obj)
    with pytest.raises(ParseError) as err:
        parse_slice(obj, "v1")
    assert fragment in str(err.value)


# JSON-ish values: what json.loads can produce
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=json_values, version=st.sampled_from(["v1", "v1beta1", "v1beta2", "v1alpha3", ""]))
def test_random_json_never_raises_anything_but_parse_error(obj, version):
    for fn in (lambda: parse_slice(obj, version), lambda: parse_claim(obj, version), lambda: parse_pod(obj)):
        try:
            fn()
        except ParseError:
            pass


def _replace(obj, path, value):
    if not path:
        return value
    out = copy.deepcopy(obj)
    cur = out
    for step in path[:-1]:
        cur = cur[step]
    cur[path[-1]] = value
    return out


SLICE_PATHS = list(tree_paths(nvidia_slice_v1()))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(SLICE_PATHS), junk=json_values)
def test_corrupting_any_field_of_a_valid_slice_gives_parse_error_or_devices(path, junk):
    obj = _replace(nvidia_slice_v1(), path, junk)
    try:
        devs = parse_slice(obj, "v1")
    except ParseError as exc:
        assert str(exc)
    else:
        assert all(d.driver and d.pool and d.name for d in devs)


_LOWER = "abcdefghijklmnopqrstuvwxyz"
attr_values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda v: ("int", v, v)),
    st.booleans().map(lambda v: ("bool", v, v)),
    st.text(max_size=64).map(lambda v: ("string", v, v)),
    st.tuples(*[st.integers(0, 999)] * 3).map(lambda t: "%d.%d.%d" % t).map(lambda v: ("version", v, v)),
)
attr_names = st.builds(
    lambda domain, ident: domain + ident,
    st.sampled_from(["", "resource.kubernetes.io/", "gpu.nvidia.com/", "example.com/"]),
    st.text(alphabet=_LOWER + "ABCXYZ_0123456789", min_size=1, max_size=16).map(lambda t: "a" + t),
)
dns_label = st.text(alphabet=_LOWER + "0123456789", min_size=1, max_size=12).map(lambda t: "d" + t)
quantities = st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 99999), st.sampled_from(["", "Gi", "Mi", "k"]))


@st.composite
def valid_slices(draw):
    driver = draw(st.sampled_from(["gpu.nvidia.com", "gpu.amd.com", "gpu.example.com"]))
    names = draw(st.lists(dns_label, max_size=6, unique=True))
    devices, expected = [], {}
    for name in names:
        attrs = draw(st.dictionaries(attr_names, attr_values, max_size=5))
        caps = draw(st.dictionaries(attr_names, quantities, max_size=3))
        devices.append(
            {
                "name": name,
                "attributes": {k: {kind: raw} for k, (kind, raw, _) in attrs.items()},
                "capacity": {k: {"value": v} for k, v in caps.items()},
            }
        )
        expected[name] = (
            {(k if "/" in k else f"{driver}/{k}"): py for k, (_, _, py) in attrs.items()},
            {(k if "/" in k else f"{driver}/{k}"): v for k, v in caps.items()},
        )
    gen = draw(st.integers(min_value=0, max_value=2**40))
    obj = {
        "metadata": {"name": draw(dns_label)},
        "spec": {"driver": driver, "nodeName": "n", "pool": {"name": "n", "generation": gen}, "devices": devices},
    }
    return obj, expected, gen


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(case=valid_slices(), version=st.sampled_from(["v1", "v1beta2", "v1beta1"]))
def test_random_valid_slices_round_trip(case, version):
    obj, expected, gen = case
    if version == "v1beta1":
        obj = to_v1beta1(obj)
    devs = parse_slice(obj, version)
    assert {d.name: (d.attributes, d.capacity) for d in devs} == expected
    assert all(d.pool_generation == gen for d in devs)


# --------------------------------------------------------------------------- claims


def claim_obj() -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu", "namespace": "ml", "uid": "c-1"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpus", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"},
                        {
                            "request": "gpus",
                            "driver": "gpu.nvidia.com",
                            "pool": "node-a",
                            "device": "gpu-1",
                            "adminAccess": True,
                        },
                        {
                            "request": "shared/small",
                            "driver": "gpu.example.com",
                            "pool": "node-a",
                            "device": "gpu-2",
                            "shareID": "s-1",
                        },
                    ]
                }
            },
            "devices": [
                {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1", "data": {"uuid": {"string": "GPU-b"}}},
                # same device, different share: must not be joined to the result with shareID s-1
                {"driver": "gpu.example.com", "pool": "node-a", "device": "gpu-2", "shareID": "s-0", "data": {"x": 1}},
                {"driver": "gpu.example.com", "pool": "node-a", "device": "gpu-2", "shareID": "s-1", "data": {"uuid": "u2"}},
            ],
            "reservedFor": [
                {"resource": "pods", "name": "trainer-0", "uid": "p-0"},
                {"apiGroup": "example.com", "resource": "jobs", "name": "j", "uid": "j-0"},
                {"resource": "pods", "name": "trainer-1", "uid": "p-1"},
            ],
        },
    }


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
def test_claim_results_joined_with_status_data(version):
    info = parse_claim(claim_obj(), version)
    assert (info.namespace, info.name, info.uid) == ("ml", "train-gpu", "c-1")
    assert info.devices == (
        AllocatedDevice(request="gpus", driver="gpu.nvidia.com", pool="node-a", device="gpu-0"),
        AllocatedDevice(request="gpus", driver="gpu.nvidia.com", pool="node-a", device="gpu-1", admin_access=True),
        AllocatedDevice(request="shared/small", driver="gpu.example.com", pool="node-a", device="gpu-2", share_id="s-1"),
    )
    assert info.devices[0].data == {}
    assert info.devices[1].data == {"uuid": {"string": "GPU-b"}}
    assert info.devices[2].data == {"uuid": "u2"}
    assert info.reserved_for == ("trainer-0", "trainer-1")


@pytest.mark.parametrize("shape", ["v1", "v1beta1"])
def test_consumable_capacity_device_and_consumed_capacity(shape):
    """KEP-5075: allowMultipleAllocations on the device (under ``basic`` in v1beta1), and each
    result's consumedCapacity as numbers under the driver-qualified capacity names."""
    sl = nvidia_slice_v1()
    sl["spec"]["devices"][0]["allowMultipleAllocations"] = True
    policy = {"default": "80Gi", "validRange": {"min": "1Mi", "step": "1Mi"}}
    sl["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] = policy
    gpu0, mig = parse_slice(to_v1beta1(sl) if shape == "v1beta1" else sl, shape)
    assert gpu0.multiple and not mig.multiple and gpu0.capacity == {"gpu.nvidia.com/memory": "80Gi"}
    obj = claim_obj()
    consumed = {"memory": "20Gi", "example.com/cores": "1500m"}
    obj["status"]["allocation"]["devices"]["results"][2]["consumedCapacity"] = consumed
    info = parse_claim(obj, "v1")
    assert info.devices[2].consumed == {"gpu.example.com/memory": 20 * 2**30, "example.com/cores": 1.5}
    assert info.devices[0].consumed == {}
    obj["status"]["allocation"]["devices"]["results"][2]["consumedCapacity"] = {"memory": "lots"}
    with pytest.raises(ParseError, match=r"consumedCapacity\[memory\]"):
        parse_claim(obj, "v1")


def test_unallocated_claim_has_no_devices():
    obj = claim_obj()
    del obj["status"]
    info = parse_claim(obj, "v1")
    assert info.devices == () and info.reserved_for == ()


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda o: o["metadata"].pop("namespace"), "metadata.namespace"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].pop("device"), "results[0].device"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][1].__setitem__("adminAccess", "yes"), "adminAccess"),
        (lambda o: o["status"].__setitem__("reservedFor", "trainer-0"), "reservedFor"),
        (lambda o: o["status"]["devices"][0].pop("pool"), "status.devices[0].pool"),
    ],
)
def test_malformed_claims(mutate, fragment):
    obj = claim_obj()
    mutate(obj)
    with pytest.raises(ParseError) as err:
        parse_claim(obj, "v1")
    assert fragment in str(err.value)


# --------------------------------------------------------------------------- pods


def test_pod_with_claims():
    pod = {
        "metadata": {"name": "trainer-0", "namespace": "ml", "uid": "p-0"},
        "spec": {
            "nodeName": "node-a",
            "resourceClaims": [
                {"name": "shared", "resourceClaimName": "team-gpu"},
                {"name": "own", "resourceClaimTemplateName": "one-gpu"},
            ],
        },
        "status": {
            "phase": "Running",
            "resourceClaimStatuses": [
                {"name": "own", "resourceClaimName": "trainer-0-own-x8q"},
                {"name": "skipped", "resourceClaimName": None},
            ],
            "extendedResourceClaimStatus": {"resourceClaimName": "trainer-0-extended-resources-abc"},
        },
    }
    info = parse_pod(pod)
    assert (info.namespace, info.name, info.uid, info.node_name, info.phase) == (
        "ml",
        "trainer-0",
        "p-0",
        "node-a",
        "Running",
    )
    assert info.claims == ("team-gpu", "trainer-0-own-x8q", "trainer-0-extended-resources-abc")


def test_malformed_pod():
    with pytest.raises(ParseError, match=r"metadata.name"):
        parse_pod({"metadata": {"namespace": "x"}})
    with pytest.raises(ParseError, match="resourceClaims"):
        parse_pod({"metadata": {"name": "p", "namespace": "x"}, "spec": {"resourceClaims": [1]}})
