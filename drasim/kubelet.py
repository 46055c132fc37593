"""An in-process kubelet PodResources server: a real grpc server on a real unix socket.

Used by the tests and by the `demo` command, so it depends on nothing test-only. It behaves
like the kubelet where our client can tell the difference:
- serves `v1.PodResourcesLister` (List, GetAllocatableResources, Get) on a unix socket;
- one token bucket shared by all RPCs rejects excess calls with RESOURCE_EXHAUSTED
  "rejected by rate limit" (kubelet defaults: 100 qps, burst 10);
- `Get` for an unknown pod fails with UNKNOWN "pod %s in namespace %s not found";
- `restart()` unlinks and re-binds the socket, so it is a new file, as when the
  kubelet restarts.
Faults can be injected with `fail_next()`; every RPC that reaches the server is counted.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent import futures

import grpc
import structlog

from exporter.kubelet import api_pb2, api_pb2_grpc

log = structlog.get_logger(__name__)

KUBELET_QPS = 100.0
KUBELET_BURST = 10

# (driver, pool, device, share_id or None)
ClaimDevice = tuple[str, str, str, str | None]


# -- message builders ----------------------------------------------------------------------


def claim(
    namespace: str, name: str, devices: Iterable[ClaimDevice] = ()
) -> api_pb2.DynamicResource:
    """A DRA claim as the kubelet (1.31+) reports it for one container."""
    resources = []
    for driver, pool, device, share_id in devices:
        cr = api_pb2.ClaimResource(driver_name=driver, pool_name=pool, device_name=device)
        if share_id is not None:
            cr.share_id = share_id
        resources.append(cr)
    return api_pb2.DynamicResource(
        claim_namespace=namespace, claim_name=name, claim_resources=resources
    )


def cdi_only_claim(namespace: str, name: str, cdi_names: Sequence[str]) -> api_pb2.DynamicResource:
    """A DRA claim as kubelets 1.27-1.30 report it: one resource carrying only CDI names."""
    return api_pb2.DynamicResource(
        claim_namespace=namespace,
        claim_name=name,
        claim_resources=[
            api_pb2.ClaimResource(cdi_devices=[api_pb2.CDIDevice(name=n) for n in cdi_names])
        ],
    )


def container(
    name: str,
    devices: Iterable[tuple[str, Sequence[str]]] = (),
    claims: Iterable[api_pb2.DynamicResource] = (),
) -> api_pb2.ContainerResources:
    """A container with device-plugin devices [(resource_name, [ids])] and DRA claims."""
    return api_pb2.ContainerResources(
        name=name,
        devices=[
            api_pb2.ContainerDevices(resource_name=res, device_ids=list(ids))
            for res, ids in devices
        ],
        dynamic_resources=list(claims),
    )


def pod(
    namespace: str, name: str, containers: Iterable[api_pb2.ContainerResources] = ()
) -> api_pb2.PodResources:
    return api_pb2.PodResources(namespace=namespace, name=name, containers=list(containers))


# -- server --------------------------------------------------------------------------------


class _TokenBucket:
    """Same admission rule as golang.org/x/time/rate's Allow(): refill at qps, cap at burst."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps = qps
        self.burst = burst
        self._tokens = float(burst)
        self._last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, owner: FakeKubelet) -> None:
        self._owner = owner

    def List(self, request: api_pb2.ListPodResourcesRequest,
             context: grpc.ServicerContext) -> api_pb2.ListPodResourcesResponse:
        self._owner._admit("List", context)
        return api_pb2.ListPodResourcesResponse(pod_resources=self._owner._pods_now())

    def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocatableResourcesResponse:
        self._owner._admit("GetAllocatableResources", context)
        return api_pb2.AllocatableResourcesResponse(devices=self._owner._allocatable_now())

    def Get(self, request: api_pb2.GetPodResourcesRequest,
            context: grpc.ServicerContext) -> api_pb2.GetPodResourcesResponse:
        self._owner._admit("Get", context)
        for p in self._owner._pods_now():
            if p.name == request.pod_name and p.namespace == request.pod_namespace:
                return api_pb2.GetPodResourcesResponse(pod_resources=p)
        # The kubelet returns a plain Go error here, which grpc-go maps to UNKNOWN.
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )


class FakeKubelet:
    """A PodResources server on `socket_path`; thread-safe; usable as a context manager."""

    def __init__(
        self,
        socket_path: str,
        *,
        qps: float | None = KUBELET_QPS,
        burst: int = KUBELET_BURST,
        max_workers: int = 4,
    ) -> None:
        self.socket_path = socket_path
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._pods: tuple[api_pb2.PodResources, ...] = ()
        self._allocatable: tuple[api_pb2.ContainerDevices, ...] | None = None
        self._bucket: _TokenBucket | None = None
        self._limit: tuple[float, int] | None = None
        self._faults: list[tuple[grpc.StatusCode, str]] = []
        self._calls: Counter[str] = Counter()
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.rate_limit(qps, burst)

    # -- configuration -------------------------------------------------------------------

    def set_pods(self, pods: Iterable[api_pb2.PodResources]) -> None:
        """Replace everything List reports (copied, so later edits by the caller don't leak)."""
        copies = []
        for p in pods:
            c = api_pb2.PodResources()
            c.CopyFrom(p)
            copies.append(c)
        with self._lock:
            self._pods = tuple(copies)

    def set_allocatable(self, devices: Iterable[api_pb2.ContainerDevices] | None) -> None:
        """Devices GetAllocatableResources reports; None = derive from the pods' devices."""
        with self._lock:
            self._allocatable = None if devices is None else tuple(devices)

    def rate_limit(self, qps: float | None, burst: int = KUBELET_BURST) -> None:
        """Configure the shared token bucket; qps=None disables rate limiting."""
        if qps is not None and (qps <= 0 or burst < 1):
            raise ValueError("rate_limit needs qps > 0 and burst >= 1 (or qps=None)")
        with self._lock:
            self._limit = None if qps is None else (qps, burst)
            self._bucket = None if qps is None else _TokenBucket(qps, burst)

    def fail_next(
        self, code: grpc.StatusCode, n: int = 1, details: str = "injected failure"
    ) -> None:
        """Make the next n RPCs (any method) fail with `code`."""
        with self._lock:
            self._faults.extend([(code, details)] * n)

    # -- observation ---------------------------------------------------------------------

    @property
    def calls(self) -> int:
        """RPCs that reached the server (including rejected and failed ones)."""
        with self._lock:
            return sum(self._calls.values())

    def calls_by_method(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)

    def reset_calls(self) -> None:
        with self._lock:
            self._calls.clear()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            return
        # Like the kubelet, take over a stale socket left by a previous instance.
        self._unlink_socket()
        with self._lock:
            # A (re)started kubelet process starts with a full bucket.
            self._bucket = None if self._limit is None else _TokenBucket(*self._limit)
        executor = futures.ThreadPoolExecutor(
            max_workers=self._max_workers, thread_name_prefix="fake-kubelet"
        )
        server = grpc.server(
            executor,
            # grpc-go's default send limit is effectively unlimited; only the client's
            # receive limit bounds a response, which is what we want to exercise.
            options=[("grpc.max_send_message_length", -1)],
        )
        # generated by grpc_tools.protoc without annotations
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]
        try:
            # grpc raises RuntimeError on a failed bind (older releases returned 0).
            port = server.add_insecure_port("unix://" + os.path.abspath(self.socket_path))
        except RuntimeError:
            port = 0
        if port == 0:
            server.stop(None)
            executor.shutdown(wait=False)
            raise OSError(
                f"fake kubelet: cannot listen on unix socket {self.socket_path}"
                " (missing directory, no permission, or path over 107 bytes?)"
            )
        server.start()
        self._server = server
        self._executor = executor
        log.debug("fake_kubelet_started", socket=self.socket_path)

    def stop(self, grace: float | None = None) -> None:
        server, self._server = self._server, None
        executor, self._executor = self._executor, None
        if server is not None:
            server.stop(grace).wait()
        if executor is not None:
            # grpc does not shut down the executor it was given; restarts would leak threads.
            executor.shutdown(wait=True)
        self._unlink_socket()
        log.debug("fake_kubelet_stopped", socket=self.socket_path)

    def restart(self) -> None:
        """Stop, remove the socket, and listen again on the same path (a new socket file)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> FakeKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- used by the servicer ------------------------------------------------------------

    def _admit(self, method: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._calls[method] += 1
            # The kubelet's rate limiter is an interceptor: it runs before any handler.
            limited = self._bucket is not None and not self._bucket.allow()
            fault = None if limited or not self._faults else self._faults.pop(0)
        if limited:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        if fault is not None:
            context.abort(fault[0], fault[1])

    def _pods_now(self) -> tuple[api_pb2.PodResources, ...]:
        with self._lock:
            return self._pods

    def _allocatable_now(self) -> list[api_pb2.ContainerDevices]:
        with self._lock:
            if self._allocatable is not None:
                return list(self._allocatable)
            pods = self._pods
        ids: dict[str, dict[str, None]] = {}
        for p in pods:
            for c in p.containers:
                for d in c.devices:
                    ids.setdefault(d.resource_name, {}).update(dict.fromkeys(d.device_ids))
        return [
            api_pb2.ContainerDevices(resource_name=res, device_ids=list(devs))
            for res, devs in ids.items()
        ]

    def _unlink_socket(self) -> None:
        """Remove our socket file; refuse to delete anything that is not a socket."""
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"fake kubelet: {self.socket_path} exists and is not a socket")
        os.unlink(self.socket_path)
