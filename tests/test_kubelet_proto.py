"""The committed PodResources stubs match api.proto, and api.proto matches the kubelet's wire API."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from exporter.kubelet import api_pb2, api_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
KUBELET_DIR = REPO / "exporter" / "kubelet"
STUBS = ("api_pb2.py", "api_pb2_grpc.py", "api_pb2.pyi")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "gen_proto.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def _committed_grpc_tools_version() -> str:
    text = (KUBELET_DIR / "api_pb2_grpc.py").read_text()
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", text, re.MULTILINE)
    assert match, "api_pb2_grpc.py lacks GRPC_GENERATED_VERSION"
    return match.group(1)


def test_committed_descriptor_matches_proto(tmp_path: Path) -> None:
    """Version-independent drift check: the descriptor compiled now equals the committed one."""
    out = tmp_path / "api.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"--descriptor_set_out={out}",
            "exporter/kubelet/api.proto",
        ],
        check=True,
        cwd=REPO,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    # protoc's Python generator drops json_name from the embedded descriptor; so do we.
    for message in fresh.message_type:
        for field in message.field:
            field.ClearField("json_name")
    # serialized_pb is exactly the descriptor embedded in the committed api_pb2.py.
    committed = descriptor_pb2.FileDescriptorProto.FromString(api_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "api.proto changed: run python tools/gen_proto.py"


def test_committed_stubs_are_byte_identical_to_regenerated(regenerated: Path) -> None:
    installed = importlib.metadata.version("grpcio-tools")
    committed = _committed_grpc_tools_version()
    if installed != committed:
        pytest.skip(
            f"stubs were generated with grpcio-tools {committed}, {installed} is installed;"
            " the descriptor check above still guards against drift"
        )
    for name in STUBS:
        assert (regenerated / name).read_bytes() == (KUBELET_DIR / name).read_bytes(), (
            f"{name} differs from a fresh generation: run python tools/gen_proto.py"
        )


def test_grpc_stub_imports_messages_relatively() -> None:
    text = (KUBELET_DIR / "api_pb2_grpc.py").read_text()
    assert "from . import api_pb2 as" in text
    assert "from exporter.kubelet import api_pb2" not in text


def _field(message: str, name: str) -> FieldDescriptor:
    return api_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        ("ListPodResourcesResponse", "pod_resources", 1),
        ("PodResources", "containers", 3),
        ("PodResources", "cpu_ids", 4),
        ("PodResources", "memory", 5),
        ("ContainerResources", "devices", 2),
        ("ContainerResources", "dynamic_resources", 5),
        ("ContainerDevices", "device_ids", 2),
        ("NUMANode", "ID", 1),
        ("DynamicResource", "claim_name", 2),
        ("DynamicResource", "claim_namespace", 3),
        ("DynamicResource", "claim_resources", 4),
        ("ClaimResource", "cdi_devices", 1),
        ("ClaimResource", "driver_name", 2),
        ("ClaimResource", "pool_name", 3),
        ("ClaimResource", "device_name", 4),
        ("ClaimResource", "share_id", 5),
        ("GetPodResourcesRequest", "pod_name", 1),
        ("GetPodResourcesRequest", "pod_namespace", 2),
        ("AllocatableResourcesResponse", "memory", 3),
    ],
)
def test_field_numbers_match_kubelet(message: str, field: str, number: int) -> None:
    assert _field(message, field).number == number


def test_wire_names_and_presence() -> None:
    assert api_pb2.DESCRIPTOR.package == "v1"
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert sorted(m.name for m in service.methods) == ["Get", "GetAllocatableResources", "List"]
    assert _field("ClaimResource", "share_id").has_presence
    assert not _field("ClaimResource", "driver_name").has_presence

    proto = descriptor_pb2.DescriptorProto()
    api_pb2.DynamicResource.DESCRIPTOR.CopyToProto(proto)
    assert [(r.start, r.end) for r in proto.reserved_range] == [(1, 2)]  # class_name tombstone

    # The method paths the kubelet serves, as the generated stub will call them.
    source = Path(api_pb2_grpc.__file__).read_text()
    for method in ("List", "GetAllocatableResources", "Get"):
        assert f"'/v1.PodResourcesLister/{method}'" in source


def test_old_field_one_of_dynamic_resource_is_ignored() -> None:
    """A 1.27-1.30 kubelet still sends class_name=1; decoding must skip it, not fail."""
    # field 1, wire type 2 (length-delimited) "gpu", then claim_name=2 "c"
    legacy = b"\x0a\x03gpu" + b"\x12\x01c"
    msg = api_pb2.DynamicResource.FromString(legacy)
    assert msg.claim_name == "c"
