"""The kubelet's List answer is decoded within bounds and the call's deadline (issue 25).

A kubelet (or anything that can bind the socket path) answering millions of pods, device ids
or CPU ids inside the 16 MiB the transport accepts must cost the agent a refusal, not hundreds
of MiB: the census (exporter.kubelet.decode) counts before protobuf decodes. The end-to-end
test serves such answers from a real gRPC server (grpcio) and measures the client's peak
memory in a process of its own; the others hold each bound at its edge.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import unknown_fields
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasim.kubelet import claim, container, pod
from exporter.kubelet import api_pb2, decode
from exporter.kubelet.client import KubeletError, KubeletUnavailable, PodResourcesClient
from exporter.kubelet.convert import DeadlinePassed, to_snapshot
from exporter.kubelet.decode import AnswerRefused, census

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return bytes(out + bytes((low,)))
        out.append(low | 0x80)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def one_pod(ctr: bytes = b"", pod_extra: bytes = b"") -> bytes:
    """A ListPodResourcesResponse with one pod (name p, namespace n) and one container ``ctr``
    (its fields after the name), as wire bytes built by hand: no protobuf object of the size
    of the hostile answers is ever made here."""
    return field(1, field(1, b"p") + field(2, b"n") + field(3, field(1, b"c") + ctr) + pod_extra)


# The three answers of the issue, each within the transport's 16 MiB
EMPTY_PODS = b"\x0a\x00" * 8_000_000
DEVICE_IDS = one_pod(field(2, field(1, b"nvidia.com/gpu") + b"".join(field(2, b"GPU-%d" % i) for i in range(10)) * 200_000))
CPU_IDS = one_pod(field(3, b"\x01" * 16_000_000))
GOOD = api_pb2.ListPodResourcesResponse(pod_resources=[pod("ns", "ok", [container("main", devices=[("nvidia.com/gpu", ["GPU-a"])])])]).SerializeToString()


class RawKubelet:
    """A real gRPC server (grpcio) whose List answers the given bytes, one answer per call."""

    def __init__(self, path: str, answers: list[bytes]) -> None:
        self.answers = answers
        self.lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {"List": grpc.unary_unary_rpc_method_handler(self._list, request_deserializer=None, response_serializer=None)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler], options=[("grpc.max_send_message_length", -1)])
        self.server.add_insecure_port("unix://" + path)
        self.server.start()

    def _list(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            return self.answers.pop(0)

    def close(self) -> None:
        self.server.stop(None)


@pytest.fixture
def sock() -> Iterator[str]:
    d = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp"))  # short: sun_path is 107 bytes
    try:
        yield str(d / "kubelet.sock")
    finally:
        shutil.rmtree(d, ignore_errors=True)


# The client's side, in a process of its own so that its peak memory is its own: for each case
# a List that must fail, then one that must succeed (the server answers a good List next).
CLIENT = textwrap.dedent(
    """
    import json, sys
    from exporter.kubelet.client import KubeletError, PodResourcesClient

    def kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    def reset_peak():
        try:  # Linux 4.0+: VmHWM starts again from VmRSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # then VmHWM - VmRSS before the call over-states the growth: still an upper bound

    client = PodResourcesClient(sys.argv[1], timeout=60)
    client.list()  # warm: imports, the connection, one decode
    out = []
    for _ in range(int(sys.argv[2])):
        reset_peak()
        before = kib("VmRSS")
        try:
            client.list()
            error = None
        except KubeletError as err:
            error = [type(err).__name__, str(err)]
        except Exception as err:  # the test says which type escaped
            error = ["not a KubeletError: " + type(err).__name__, str(err)]
        growth = kib("VmHWM") - before
        out.append({"error": error, "growth_kib": growth, "next": [list(p) for p in client.list().pods]})
    print(json.dumps(out))
    """
)


def test_answers_of_millions_of_pods_device_ids_or_cpu_ids_are_refused_in_bounded_memory(sock: str) -> None:
    cases = [("8 M empty pods", EMPTY_PODS, "more than 10000 pods"), ("2 M device ids", DEVICE_IDS, "more than 100000 allocated devices"), ("16 M packed CPU ids", CPU_IDS, "more than 100000 CPU ids")]
    assert all(len(data) < 16 * MIB for _, data, _ in cases)  # within what the transport takes
    server = RawKubelet(sock, [GOOD] + [answer for _, data, _ in cases for answer in (data, GOOD)])
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", CLIENT, sock, str(len(cases))], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    finally:
        server.close()
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (name, _, bound), r in zip(cases, results, strict=True):
        # A KubeletError that names the bound: refused on the count, not at the deadline (60 s)
        assert r["error"] is not None and r["error"][0] == "KubeletError", (name, r["error"])
        assert bound in r["error"][1], (name, r["error"])
        # The 16 MiB answer itself is part of the growth: the decode adds little to it.
        assert r["growth_kib"] < 64 * 1024, f"{name}: peak memory grew by {r['growth_kib'] / 1024:.0f} MiB"
        assert r["next"] == [["ns", "ok"]], name  # the next call, on a good answer, works


def test_cpu_ids_are_kept_as_bytes_not_decoded() -> None:
    # Under the bound, CPU ids (and memory, topology, CDI names) are never expanded by protobuf:
    # the view keeps them as unknown bytes. The full message type would hold each one as an int64.
    data = one_pod(field(3, b"\x01" * 90_000))
    view = decode._View.FromString(data)
    ctr = view.pod_resources[0].containers[0]
    assert not hasattr(ctr, "cpu_ids")
    assert [(f.field_number, len(f.data)) for f in unknown_fields.UnknownFieldSet(ctr)] == [(3, 90_000)]  # one field, its bytes
    assert census(data).cpu_ids == 90_000


def claim_devices(n: int) -> bytes:
    return field(5, field(2, b"claim") + field(3, b"ns") + b"".join(field(4, field(2, b"d") + field(3, b"p") + field(4, b"g%d" % i)) for i in range(n)))


def device_ids(n: int) -> bytes:
    return field(2, field(1, b"r") + b"".join(field(2, b"id%d" % i) for i in range(n)))


@pytest.mark.parametrize(
    ("bound", "answer", "counted"),
    [
        pytest.param("MAX_PODS", lambda n: b"\x0a\x00" * n, "pods", id="pods"),
        pytest.param("MAX_ROWS", lambda n: one_pod(device_ids(n)), "rows", id="rows-device-ids"),
        pytest.param("MAX_ROWS", lambda n: one_pod(claim_devices(n)), "rows", id="rows-claim-devices"),
        pytest.param("MAX_ROWS", lambda n: one_pod(device_ids(n // 2) + claim_devices(n - n // 2)), "rows", id="rows-both"),
        pytest.param("MAX_ITEMS", lambda n: field(1, field(3, b"") * (n - 1)), "items", id="items-containers"),
        pytest.param("MAX_CPU_IDS", lambda n: one_pod(field(3, b"\x81\x01" * (n // 2) + b"\x05" * (n - n // 2))), "cpu_ids", id="cpu-ids-packed"),
        pytest.param("MAX_CPU_IDS", lambda n: one_pod(b"\x18\x07" * n), "cpu_ids", id="cpu-ids-unpacked"),
        pytest.param("MAX_CPU_IDS", lambda n: one_pod(pod_extra=field(4, b"\x02" * n)), "cpu_ids", id="pod-level-cpu-ids"),
        pytest.param("MAX_FIELDS", lambda n: one_pod(b"\x20\x01" * (n - 5)), "fields", id="fields"),
    ],
)
def test_each_bound_takes_its_value_and_refuses_one_more(monkeypatch: pytest.MonkeyPatch, bound: str, answer: Callable[[int], bytes], counted: str) -> None:
    limit = 3000  # small: the real values are the same code
    monkeypatch.setattr(decode, bound, limit)
    at = census(answer(limit))
    assert getattr(at, counted) == limit
    with pytest.raises(AnswerRefused, match=f"more than {limit} "):
        census(answer(limit + 1))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x0a\xff", id="truncated-length"),
        pytest.param(b"\x0a\x05\x0a\x00", id="field-past-the-end"),
        pytest.param(field(1, b"\x08\x80"), id="truncated-varint"),
        pytest.param(field(1, b"\x09\x00\x00"), id="truncated-fixed64"),
        pytest.param(b"\x0b\x0c", id="group"),
        pytest.param(b"\x0e", id="wire-type-6"),
        pytest.param(b"\x08" + b"\xff" * 11, id="varint-over-64-bits"),
    ],
)
def test_a_broken_wire_format_is_refused_by_the_census(data: bytes) -> None:
    with pytest.raises(decode.AnswerMalformed, match="not a ListPodResourcesResponse"):
        decode.decode(data)


def test_the_view_decodes_every_field_the_conversion_reads() -> None:
    # Everything the API has, set: the view's snapshot is the full message's.
    full = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                name="p",
                namespace="ns",
                cpu_ids=[4, 5],
                memory=[api_pb2.ContainerMemory(memory_type="memory", size=1 << 30, topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=1)]))],
                containers=[
                    api_pb2.ContainerResources(
                        name="c",
                        cpu_ids=[1, 2, 300],
                        memory=[api_pb2.ContainerMemory(memory_type="hugepages-1Gi", size=2)],
                        devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-a", "GPU-b"], topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=0)]))],
                        dynamic_resources=[claim("ns", "cl", [("gpu.nvidia.com", "pool", "gpu-0", "share"), ("gpu.nvidia.com", "pool", "gpu-1", None)])],
                    )
                ],
            )
        ]
    )
    full.pod_resources[0].containers[0].dynamic_resources[0].claim_resources[0].cdi_devices.add(name="nvidia.com/gpu=gpu-0")
    wire = full.SerializeToString()
    snap = decode.decode(wire)
    assert snap == to_snapshot(full)
    assert len(snap.allocations) == 4 and {a.share_id for a in snap.allocations} == {"", "share"}


def test_decoding_runs_under_the_deadline() -> None:
    data = one_pod(b"\x20\x01" * 5000)  # enough fields for the census to look at the clock
    with pytest.raises(DeadlinePassed):
        decode.decode(data, time.monotonic() - 1)
    with pytest.raises(DeadlinePassed):  # the conversion looks too, before each pod
        to_snapshot(api_pb2.ListPodResourcesResponse.FromString(GOOD), time.monotonic() - 1)
    assert decode.decode(data, time.monotonic() + 60).pods == (("n", "p"),)


def test_a_decode_past_the_deadline_is_unavailable_through_the_client(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The List's deadline covers the decode: a decode that finds it past (here: made to) is a
    # KubeletUnavailable with the deadline in its message, and the next List decodes again.
    server = RawKubelet(sock, [GOOD, GOOD])
    real = decode.decode
    try:
        with PodResourcesClient(sock, timeout=30) as client:
            monkeypatch.setattr("exporter.kubelet.client.decode", lambda data, deadline: real(data, deadline - 3600))
            with pytest.raises(KubeletUnavailable, match="not decoded within 30s"):
                client.list()
            monkeypatch.undo()
            assert client.list().pods == (("ns", "ok"),)
    finally:
        server.close()


def test_an_answer_over_a_bound_is_a_kubelet_error_and_the_client_recovers(sock: str) -> None:
    server = RawKubelet(sock, [b"\x0a\x00" * 10_001, GOOD])
    try:
        with PodResourcesClient(sock, timeout=30) as client:
            with pytest.raises(KubeletError, match=r"List response \(20002 bytes\) refused: more than 10000 pods in one answer") as info:
                client.list()
            assert type(info.value) is KubeletError
            assert client.list().pods == (("ns", "ok"),)
    finally:
        server.close()


# --- any bytes: a snapshot or one refusal, and the view agrees with the full messages

_text = st.sampled_from(["", "a", "ns", "gpu-0", "nvidia.com/gpu", "ü"])
_topology = st.builds(api_pb2.TopologyInfo, nodes=st.lists(st.builds(api_pb2.NUMANode, ID=st.integers(-2, 3)), max_size=2))
_memory = st.builds(api_pb2.ContainerMemory, memory_type=_text, size=st.integers(0, 2**64 - 1), topology=_topology)
_claim_resource = st.builds(
    api_pb2.ClaimResource,
    cdi_devices=st.lists(st.builds(api_pb2.CDIDevice, name=_text), max_size=2),
    driver_name=_text,
    pool_name=_text,
    device_name=_text,
    share_id=st.none() | _text,
)
_container = st.builds(
    api_pb2.ContainerResources,
    name=_text,
    devices=st.lists(st.builds(api_pb2.ContainerDevices, resource_name=_text, device_ids=st.lists(_text, max_size=3), topology=_topology), max_size=2),
    cpu_ids=st.lists(st.integers(-1, 300), max_size=4),
    memory=st.lists(_memory, max_size=2),
    dynamic_resources=st.lists(st.builds(api_pb2.DynamicResource, claim_name=_text, claim_namespace=_text, claim_resources=st.lists(_claim_resource, max_size=2)), max_size=2),
)
_answers = st.builds(
    api_pb2.ListPodResourcesResponse,
    pod_resources=st.lists(
        st.builds(api_pb2.PodResources, name=_text, namespace=_text, containers=st.lists(_container, max_size=2), cpu_ids=st.lists(st.integers(0, 300), max_size=3), memory=st.lists(_memory, max_size=1)),
        max_size=3,
    ),
)


@st.composite
def wires(draw: st.DrawFn) -> bytes:
    """A valid answer's bytes, often broken: cut, a byte changed, bytes inserted; or any bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    wire = bytearray(draw(_answers).SerializeToString())
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(wire)))
        how = draw(st.sampled_from(["cut", "change", "insert"]))
        if how == "cut":
            del wire[at:]
        elif how == "change" and at < len(wire):
            wire[at] = draw(st.integers(0, 255))
        elif how == "insert":
            wire[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(wire)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire=wires())
def test_any_bytes_are_a_snapshot_or_one_refusal(wire: bytes) -> None:
    try:
        snap = decode.decode(wire)
    except AnswerRefused as err:
        assert str(err)
        return
    try:
        full = api_pb2.ListPodResourcesResponse.FromString(wire)
    except Exception:
        return  # broken only in what the view does not read (a CDI name's UTF-8, say): the view may take it
    assert snap == to_snapshot(full)
