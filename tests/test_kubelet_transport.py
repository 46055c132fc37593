"""The kubelet client's own HTTP/2 wire (exporter.kubelet.transport) against real peers: grpcio's
server (FakeKubelet), grpcio's own client as the oracle for what an answer decodes to, and raw
sockets for peers that are no gRPC server at all."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from drasim.kubelet import FakeKubelet, claim, container, pod
from exporter.kubelet import api_pb2, api_pb2_grpc
from exporter.kubelet import client as client_module
from exporter.kubelet.client import KubeletError, KubeletUnavailable, PodResourcesClient
from exporter.kubelet.transport import GrpcStatus, TransportError, UnaryConnection


@pytest.fixture
def sock() -> Iterator[str]:
    d = Path(tempfile.mkdtemp(prefix="kt-", dir="/tmp"))  # short: sun_path is 107 bytes
    try:
        yield str(d / "kubelet.sock")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sock: str) -> Iterator[FakeKubelet]:
    with FakeKubelet(sock, qps=None) as k:
        yield k


def grpcio_list(sock: str) -> api_pb2.ListPodResourcesResponse:
    channel = grpc.insecure_channel("unix://" + sock, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    try:
        return api_pb2_grpc.PodResourcesListerStub(channel).List(api_pb2.ListPodResourcesRequest(), timeout=30)
    finally:
        channel.close()


def many_pods(n: int) -> list[api_pb2.PodResources]:
    return [
        pod("ns-ü", f"worker-{i:05d}", [container("main", claims=[claim("ns-ü", f"claim-{i}", [("gpu.nvidia.com", "pool", f"gpu-{i % 8}", None)])])])
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [0, 1, 40, 30000])  # 30,000 pods: ~3 MB, many DATA frames
def test_an_answer_decodes_to_what_grpcio_receives(kubelet: FakeKubelet, sock: str, n: int) -> None:
    kubelet.set_pods(many_pods(n))
    conn = UnaryConnection(sock, 30, 16 * 1024 * 1024)
    try:
        for _ in range(2):  # and again on the same connection
            got = api_pb2.ListPodResourcesResponse.FromString(conn.call("/v1.PodResourcesLister/List", b"", 30))
            assert got == grpcio_list(sock)
            assert len(got.pod_resources) == n
    finally:
        conn.close()


def test_an_error_status_and_its_message_come_through(kubelet: FakeKubelet, sock: str) -> None:
    # grpcio sends an error as a trailers-only answer and percent-encodes its message
    kubelet.fail_next(grpc.StatusCode.PERMISSION_DENIED, details="100% refusé: not you")
    conn = UnaryConnection(sock, 30, 1024)
    try:
        with pytest.raises(GrpcStatus) as info:
            conn.call("/v1.PodResourcesLister/List", b"", 30)
        assert (info.value.code, info.value.name, info.value.message) == (7, "PERMISSION_DENIED", "100% refusé: not you")
        conn.call("/v1.PodResourcesLister/List", b"", 30)  # the connection is still good
        with pytest.raises(GrpcStatus) as info:
            conn.call("/v1.PodResourcesLister/Nope", b"", 30)
        assert info.value.name == "UNIMPLEMENTED"
    finally:
        conn.close()


def test_a_connection_gone_stale_is_replaced_within_the_call(kubelet: FakeKubelet, sock: str) -> None:
    kubelet.set_pods([pod("ns", "p", [])])
    with PodResourcesClient(sock, timeout=10) as c:
        c.list()
        kept = c._conn
        assert kept is not None
        kept._sock.shutdown(socket.SHUT_RDWR)  # as if the server had closed it while idle
        assert c.list().pods == (("ns", "p"),)
        assert c._conn is not kept


def test_an_answer_over_the_limit_is_refused_clearly(kubelet: FakeKubelet, sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kubelet.set_pods(many_pods(50))
    monkeypatch.setattr(client_module, "MAX_RECEIVE_MESSAGE_LENGTH", 1000)
    with PodResourcesClient(sock, timeout=10) as c, pytest.raises(KubeletUnavailable, match="larger than 1000 bytes"):
        c.list()
    monkeypatch.undo()
    with PodResourcesClient(sock, timeout=10) as c:
        assert len(c.list().pods) == 50


class RawServer:
    """A unix socket server that is no gRPC server: it answers every connection with
    ``reply`` (None: reads and never answers) and closes it."""

    def __init__(self, path: str, reply: bytes | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.reply = reply
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                if self.reply is None:
                    self.stop.wait(30)
                else:
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize(
    ("reply", "timeout", "error"),
    [
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", 10.0, "UNAVAILABLE"),  # an HTTP/1 server
        (b"", 10.0, "closed by the server"),  # accepts and hangs up
        (None, 0.3, "no answer within 0.3s"),  # accepts and never answers
    ],
)
def test_a_peer_that_is_no_grpc_server_is_unavailable_not_a_hang(sock: str, reply: bytes | None, timeout: float, error: str) -> None:
    server = RawServer(sock, reply)
    try:
        with PodResourcesClient(sock, timeout=timeout) as c, pytest.raises(KubeletUnavailable, match=error) as info:
            c.list()
        assert sock in str(info.value)
    finally:
        server.close()


def test_transport_errors_are_kubelet_errors_never_raw(sock: str) -> None:
    # UnaryConnection itself: connecting to nothing is a TransportError, not an OSError
    with pytest.raises(TransportError):
        UnaryConnection(sock, 1, 1024)
    assert issubclass(KubeletUnavailable, KubeletError)


def test_an_answer_that_is_no_list_response_is_a_kubelet_error(sock: str) -> None:
    # A real gRPC server whose List answers bytes that are no ListPodResourcesResponse (a
    # truncated varint): the client says so, as a KubeletError, and never raises protobuf's own.
    from concurrent import futures

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {"List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"\x0a\xff", request_deserializer=None, response_serializer=None)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    server.add_insecure_port("unix://" + sock)
    server.start()
    try:
        with PodResourcesClient(sock, timeout=10) as c, pytest.raises(KubeletError, match="could not decode List response") as info:
            c.list()
        assert type(info.value) is KubeletError
    finally:
        server.stop(None)


def test_the_agent_never_imports_grpcio() -> None:
    # grpcio is the simulated kubelet's server; the agent's own process must not load it (its
    # import alone is ~17 MB of RSS). api_pb2_grpc, the generated service stubs, are test-only.
    import subprocess
    import sys

    code = (
        "import sys; import exporter.cli, exporter.wiring, exporter.agent, exporter.kubelet.client; "
        "from exporter.config import Config; from exporter.wiring import build_agent; "
        "build_agent(Config(node_name='n', backend='nvml', kubelet_socket='/nonexistent/kubelet.sock', kubeconfig='', listen_port=0)); "
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.') or m.endswith('_pb2_grpc')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
