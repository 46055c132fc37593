"""PodResourcesClient against FakeKubelet: a real grpc server on a real unix socket."""

from __future__ import annotations

import random
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from clock_helpers import ManualClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drasim.kubelet import FakeKubelet, cdi_only_claim, claim, container, pod
from exporter.kubelet import api_pb2, api_pb2_grpc
from exporter.kubelet.client import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    KubeletError,
    KubeletRateLimited,
    KubeletUnavailable,
    PodResourcesClient,
)
from exporter.kubelet.convert import to_snapshot
from exporter.kubelet.decode import decode
from exporter.kubelet.model import AllocationSource, ContainerAllocation

T = TypeVar("T")

GPU_A = "GPU-8f2e5a44-1c3b-4d7e-9a0f-2b6c8d1e3f50"
GPU_B = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG_1 = "MIG-5d0c6f62-8a2b-5c2e-9f1d-7e3a4b5c6d70"
DRIVER = "gpu.nvidia.com"
POOL = "node-a"


def eventually(fn: Callable[[], T], timeout: float = 15.0) -> T:
    """Call fn until it stops raising KubeletError; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except KubeletError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.02)  # polling interval of a bounded wait, not a synchronisation sleep


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 107-byte sun_path limit; /tmp is short.
    d = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sock(sock_dir: Path) -> str:
    return str(sock_dir / "kubelet.sock")


@pytest.fixture
def kubelet(sock: str) -> Iterator[FakeKubelet]:
    with FakeKubelet(sock) as k:
        yield k


@pytest.fixture
def client(sock: str) -> Iterator[PodResourcesClient]:
    # Generous: one deadline covers a List's call and its decode (96,000 rows in one test), and
    # the machine running the suite may be busy. No test here waits for it to pass.
    with PodResourcesClient(sock, timeout=30.0) as c:
        yield c


def dra_row(ns: str, p: str, c: str, device: str, claim_ns: str, claim_name: str, share: str = ""):
    return ContainerAllocation(
        namespace=ns,
        pod=p,
        container=c,
        source=AllocationSource.DRA,
        driver=DRIVER,
        pool=POOL,
        device=device,
        claim_namespace=claim_ns,
        claim_name=claim_name,
        share_id=share,
    )


def plugin_row(ns: str, p: str, c: str, resource: str, device_id: str):
    return ContainerAllocation(
        namespace=ns,
        pod=p,
        container=c,
        source=AllocationSource.DEVICE_PLUGIN,
        resource_name=resource,
        device_id=device_id,
    )


# -- mapping ---------------------------------------------------------------------------------


def test_shared_claim_is_reported_for_both_pods(kubelet: FakeKubelet, client: PodResourcesClient):
    shared = claim("ml", "single-gpu", [(DRIVER, POOL, "gpu-0", None)])
    kubelet.set_pods(
        [
            pod("ml", "pod1", [container("main", claims=[shared])]),
            pod("ml", "pod2", [container("main", claims=[shared])]),
        ]
    )
    snap = client.list()
    assert snap.allocations == (
        dra_row("ml", "pod1", "main", "gpu-0", "ml", "single-gpu"),
        dra_row("ml", "pod2", "main", "gpu-0", "ml", "single-gpu"),
    )
    assert snap.pods == (("ml", "pod1"), ("ml", "pod2"))
    assert snap.skipped_entries == 0


def test_device_plugin_gpu_mig_and_amd(kubelet: FakeKubelet, client: PodResourcesClient):
    kubelet.set_pods(
        [
            pod("a", "full", [container("c", devices=[("nvidia.com/gpu", [GPU_A, GPU_B])])]),
            pod("a", "mig", [container("c", devices=[("nvidia.com/mig-1g.10gb", [MIG_1])])]),
            pod("b", "rocm", [container("c", devices=[("amd.com/gpu", ["0000:c1:00.0"])])]),
        ]
    )
    assert set(client.list().allocations) == {
        plugin_row("a", "full", "c", "nvidia.com/gpu", GPU_A),
        plugin_row("a", "full", "c", "nvidia.com/gpu", GPU_B),
        plugin_row("a", "mig", "c", "nvidia.com/mig-1g.10gb", MIG_1),
        plugin_row("b", "rocm", "c", "amd.com/gpu", "0000:c1:00.0"),
    }


def test_share_id_presence_and_absence(kubelet: FakeKubelet, client: PodResourcesClient):
    kubelet.set_pods(
        [
            pod(
                "ns",
                "p",
                [
                    container(
                        "c",
                        claims=[
                            claim(
                                "ns",
                                "shared-capacity",
                                [(DRIVER, POOL, "gpu-0", "a1b2"), (DRIVER, POOL, "gpu-1", None)],
                            )
                        ],
                    )
                ],
            )
        ]
    )
    assert client.list().allocations == (
        dra_row("ns", "p", "c", "gpu-0", "ns", "shared-capacity", share="a1b2"),
        dra_row("ns", "p", "c", "gpu-1", "ns", "shared-capacity"),
    )


def test_sidecar_container_is_an_ordinary_row(kubelet: FakeKubelet, client: PodResourcesClient):
    # The kubelet lists restartable init containers next to regular ones.
    gpu = claim("ns", "gpu", [(DRIVER, POOL, "gpu-3", None)])
    kubelet.set_pods(
        [pod("ns", "p", [container("app", claims=[gpu]), container("log-shipper", claims=[gpu])])]
    )
    assert [a.container for a in client.list().allocations] == ["app", "log-shipper"]


def test_pre_131_claim_without_device_triple_is_skipped_and_counted(
    kubelet: FakeKubelet, client: PodResourcesClient
):
    kubelet.set_pods(
        [
            pod(
                "ns",
                "p",
                [
                    container(
                        "c",
                        claims=[
                            cdi_only_claim("ns", "old", ["nvidia.com/gpu=gpu0"]),
                            claim("ns", "new", [(DRIVER, POOL, "gpu-1", None)]),
                        ],
                    )
                ],
            )
        ]
    )
    snap = client.list()
    assert snap.allocations == (dra_row("ns", "p", "c", "gpu-1", "ns", "new"),)
    assert snap.skipped_entries == 1


def test_exact_duplicates_collapse_and_order_is_kept():
    c = container(
        "c",
        devices=[("nvidia.com/gpu", [GPU_A, GPU_A])],
        claims=[claim("ns", "x", [(DRIVER, POOL, "gpu-0", None)] * 2)],
    )
    resp = api_pb2.ListPodResourcesResponse(pod_resources=[pod("ns", "p", [c]), pod("ns", "p", [c])])
    snap = to_snapshot(resp)
    assert snap.allocations == (
        plugin_row("ns", "p", "c", "nvidia.com/gpu", GPU_A),
        dra_row("ns", "p", "c", "gpu-0", "ns", "x"),
    )
    assert snap.pods == (("ns", "p"),)


def test_set_pods_copies_its_input(kubelet: FakeKubelet, client: PodResourcesClient):
    p = pod("ns", "p", [container("c", devices=[("nvidia.com/gpu", [GPU_A])])])
    kubelet.set_pods([p])
    p.name = "renamed"
    assert client.list().pods == (("ns", "p"),)


def test_an_unchanged_list_is_not_converted_again_and_a_changed_one_is(kubelet: FakeKubelet, client: PodResourcesClient):
    shared = claim("ml", "single-gpu", [(DRIVER, POOL, "gpu-0", None)])
    kubelet.set_pods([pod("ml", "pod1", [container("main", claims=[shared])])])
    first = client.list()
    assert client.list() is first  # equal answer: the same snapshot object (the join keeps its structure)
    kubelet.set_pods([pod("ml", "pod1", [container("main", claims=[shared])]), pod("ml", "pod2", [container("main", claims=[shared])])])
    changed = client.list()
    assert changed is not first and changed.pods == (("ml", "pod1"), ("ml", "pod2"))
    kubelet.set_pods([pod("ml", "pod1", [container("main", claims=[shared])])])
    assert client.list().pods == (("ml", "pod1"),)


# -- availability ----------------------------------------------------------------------------


def test_missing_socket_is_unavailable_with_path(sock: str, client: PodResourcesClient):
    with pytest.raises(KubeletUnavailable, match="does not exist") as info:
        client.list()
    assert sock in str(info.value)
    assert info.value.socket_path == sock


def test_stale_socket_is_unavailable_then_recovers(sock: str, client: PodResourcesClient):
    # A crashed kubelet leaves its socket file behind; nobody accepts on it.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stale.bind(sock)
        with pytest.raises(KubeletUnavailable) as info:
            client.list()
        assert sock in str(info.value)
    finally:
        stale.close()
    kubelet = FakeKubelet(sock)  # takes over the stale file, as the kubelet does
    kubelet.start()
    try:
        kubelet.set_pods([pod("ns", "back", [])])
        # start() returns with the socket listening. The very next call must succeed: the
        # client must not reuse a channel that sits in grpc's reconnect backoff.
        assert client.list().pods == (("ns", "back"),)
    finally:
        kubelet.stop()


def test_client_recovers_after_kubelet_restart(kubelet: FakeKubelet, client: PodResourcesClient):
    kubelet.set_pods([pod("ns", "before", [])])
    assert client.list().pods == (("ns", "before"),)

    kubelet.restart()
    kubelet.set_pods([pod("ns", "after", [])])
    assert eventually(client.list).pods == (("ns", "after"),)


def test_client_reports_outage_and_recovers(kubelet: FakeKubelet, client: PodResourcesClient):
    kubelet.set_pods([pod("ns", "p", [])])
    client.list()
    kubelet.stop()
    with pytest.raises(KubeletUnavailable):
        client.list()
    kubelet.start()
    assert eventually(client.list).pods == (("ns", "p"),)


def test_injected_unavailable_and_other_errors(kubelet: FakeKubelet, client: PodResourcesClient):
    kubelet.fail_next(grpc.StatusCode.UNAVAILABLE, details="kubelet busy")
    with pytest.raises(KubeletUnavailable, match="kubelet busy"):
        client.list()
    kubelet.fail_next(grpc.StatusCode.INTERNAL, details="boom")
    with pytest.raises(KubeletError, match="INTERNAL: boom") as info:
        client.list()
    assert type(info.value) is KubeletError
    assert client.list().allocations == ()


def test_close_then_list_reconnects(kubelet: FakeKubelet, client: PodResourcesClient):
    client.list()
    client.close()
    assert client.list().pods == ()


def test_overlong_socket_path_is_a_clear_error(sock_dir: Path):
    path = str(sock_dir / ("x" * 120))
    with PodResourcesClient(path) as c, pytest.raises(KubeletError, match="longer than"):
        c.list()


# -- rate limiting ---------------------------------------------------------------------------


def test_rate_limit_backs_off_without_calling(sock: str, kubelet: FakeKubelet):
    clock = ManualClock()
    client = PodResourcesClient(sock, clock=clock, rng=random.Random(7))
    try:
        kubelet.rate_limit(None)
        client.list()
        kubelet.fail_next(grpc.StatusCode.RESOURCE_EXHAUSTED, details="rejected by rate limit")
        with pytest.raises(KubeletRateLimited, match="rejected by rate limit") as first:
            client.list()
        assert BACKOFF_MIN_S <= first.value.retry_after <= BACKOFF_MAX_S
        assert sock in str(first.value)
        calls = kubelet.calls

        # While backing off, list() fails fast and the kubelet sees nothing.
        for _ in range(20):
            with pytest.raises(KubeletRateLimited, match="backing off"):
                client.list()
        assert kubelet.calls == calls

        clock.advance(first.value.retry_after)
        assert client.list().pods == ()
        assert kubelet.calls == calls + 1
    finally:
        client.close()


def test_backoff_grows_is_capped_and_resets_on_success(sock: str, kubelet: FakeKubelet):
    clock = ManualClock()
    client = PodResourcesClient(sock, clock=clock, rng=random.Random(1))
    try:
        kubelet.rate_limit(None)
        kubelet.fail_next(grpc.StatusCode.RESOURCE_EXHAUSTED, n=12)
        delays = []
        for _ in range(12):
            with pytest.raises(KubeletRateLimited) as info:
                client.list()
            delays.append(info.value.retry_after)
            clock.advance(info.value.retry_after)
        assert all(BACKOFF_MIN_S <= d <= BACKOFF_MAX_S for d in delays)
        assert delays[0] == pytest.approx(BACKOFF_MIN_S)
        assert min(delays[-4:]) >= BACKOFF_MAX_S / 2  # reached the cap region
        assert kubelet.calls == 12

        client.list()  # success resets the backoff
        kubelet.fail_next(grpc.StatusCode.RESOURCE_EXHAUSTED)
        with pytest.raises(KubeletRateLimited) as info:
            client.list()
        assert info.value.retry_after == pytest.approx(BACKOFF_MIN_S)
    finally:
        client.close()


def test_fake_kubelet_token_bucket_rejects_like_the_kubelet(sock: str):
    # Refill of one token per 1000 s: the third call in a row is rejected, deterministically.
    with FakeKubelet(sock, qps=0.001, burst=2) as k:
        channel = grpc.insecure_channel("unix://" + sock)
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            stub.List(api_pb2.ListPodResourcesRequest(), timeout=5)
            # The bucket is shared by all methods, as the kubelet's interceptor is.
            stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=5)
            with pytest.raises(grpc.RpcError) as info:
                stub.List(api_pb2.ListPodResourcesRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info.value.details() == "rejected by rate limit"
            assert k.calls_by_method() == {"List": 2, "GetAllocatableResources": 1}
        finally:
            channel.close()


def test_client_maps_real_rate_limit(sock: str):
    with FakeKubelet(sock, qps=0.001, burst=1), PodResourcesClient(sock) as c:
        c.list()
        with pytest.raises(KubeletRateLimited):
            c.list()


def test_restart_replaces_socket_and_refills_bucket(sock: str):
    clock = ManualClock()
    with FakeKubelet(sock, qps=0.001, burst=1) as k, PodResourcesClient(sock, clock=clock) as c:
        c.list()
        with pytest.raises(KubeletRateLimited):
            c.list()
        k.restart()
        # A new kubelet process starts with a full bucket.
        clock.advance(BACKOFF_MAX_S)
        assert eventually(c.list).pods == ()


def test_fake_kubelet_bind_failure_is_a_clear_error(sock_dir: Path):
    with pytest.raises(OSError, match="cannot listen"):
        FakeKubelet(str(sock_dir / "missing-dir" / "kubelet.sock")).start()


# -- the other RPCs of the fake --------------------------------------------------------------


def test_fake_get_and_allocatable(kubelet: FakeKubelet, sock: str):
    kubelet.set_pods(
        [
            pod("ns", "p", [container("c", devices=[("nvidia.com/gpu", [GPU_A])])]),
            pod("ns", "q", [container("c", devices=[("nvidia.com/gpu", [GPU_B, GPU_A])])]),
        ]
    )
    channel = grpc.insecure_channel("unix://" + sock)
    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    try:
        got = stub.Get(api_pb2.GetPodResourcesRequest(pod_name="q", pod_namespace="ns"), timeout=5)
        assert got.pod_resources.name == "q"
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(api_pb2.GetPodResourcesRequest(pod_name="nope", pod_namespace="ns"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert info.value.details() == "pod nope in namespace ns not found"

        alloc = stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=5)
        assert [(d.resource_name, list(d.device_ids)) for d in alloc.devices] == [
            ("nvidia.com/gpu", [GPU_A, GPU_B])
        ]
    finally:
        channel.close()


# -- message size ----------------------------------------------------------------------------


def _uuid(i: int, j: int) -> str:
    return f"GPU-{i:08x}-{j:04x}-4000-8000-000000000000"  # the 40-character NVML UUID shape


def test_response_over_4_mib_is_received(kubelet: FakeKubelet, client: PodResourcesClient, sock: str):
    n_pods, per_pod = 8000, 12
    pods = [
        pod(
            "inference",
            f"worker-{i:05d}",
            [container("server", devices=[("nvidia.com/gpu", [_uuid(i, j) for j in range(per_pod)])])],
        )
        for i in range(n_pods)
    ]
    kubelet.set_pods(pods)
    size = api_pb2.ListPodResourcesResponse(pod_resources=pods).ByteSize()
    assert size > 4 * 1024 * 1024

    # Precondition: grpc's default 4 MiB receive limit would reject this response.
    channel = grpc.insecure_channel("unix://" + sock)
    try:
        with pytest.raises(grpc.RpcError) as info:
            api_pb2_grpc.PodResourcesListerStub(channel).List(
                api_pb2.ListPodResourcesRequest(), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()

    snap = client.list()
    assert len(snap.pods) == n_pods
    assert len(snap.allocations) == n_pods * per_pod


# -- property --------------------------------------------------------------------------------

_names = st.sampled_from(["a", "b", "c"])  # small alphabets make duplicates likely
_share = st.one_of(st.none(), st.sampled_from(["", "s1", "s2"]))
_claim_dev = st.tuples(
    st.sampled_from(["", DRIVER, "gpu.amd.com"]),
    st.sampled_from(["", POOL]),
    st.sampled_from(["", "gpu-0", "gpu-1"]),
    _share,
)
_claims = st.builds(claim, _names, _names, st.lists(_claim_dev, max_size=3))
_devices = st.tuples(
    st.sampled_from(["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu"]),
    st.lists(st.sampled_from(["", GPU_A, GPU_B, MIG_1]), max_size=3),
)
_containers = st.builds(
    container,
    _names,
    st.lists(_devices, max_size=2),
    st.lists(st.one_of(_claims, st.builds(cdi_only_claim, _names, _names, st.lists(_names))), max_size=2),
)
_pods = st.builds(pod, _names, _names, st.lists(_containers, max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_pods, max_size=5))
def test_random_responses_convert_to_unique_rows(pods):
    wire = api_pb2.ListPodResourcesResponse(pod_resources=pods).SerializeToString()
    snap = to_snapshot(api_pb2.ListPodResourcesResponse.FromString(wire))
    assert decode(wire) == snap  # the client's path: census, the view of the fields read, conversion

    # Oracle, computed independently of the converter's loop structure.
    expected = set()
    skipped = 0
    for p in pods:
        for c in p.containers:
            for d in c.devices:
                for i in d.device_ids:
                    if i:
                        expected.add(plugin_row(p.namespace, p.name, c.name, d.resource_name, i))
                    else:
                        skipped += 1
            for dyn in c.dynamic_resources:
                for r in dyn.claim_resources:
                    if r.driver_name and r.pool_name and r.device_name:
                        expected.add(
                            ContainerAllocation(
                                namespace=p.namespace,
                                pod=p.name,
                                container=c.name,
                                source=AllocationSource.DRA,
                                driver=r.driver_name,
                                pool=r.pool_name,
                                device=r.device_name,
                                claim_namespace=dyn.claim_namespace,
                                claim_name=dyn.claim_name,
                                share_id=r.share_id,
                            )
                        )
                    else:
                        skipped += 1

    assert len(snap.allocations) == len(set(snap.allocations))
    assert set(snap.allocations) == expected
    assert snap.skipped_entries == skipped
    assert set(snap.pods) == {(p.namespace, p.name) for p in pods}
    assert len(snap.pods) == len(set(snap.pods))
