"""Synchronous client for the kubelet PodResources v1 API over its unix socket.

The sampler thread calls `PodResourcesClient.list()` once per interval. The client never
raises anything but the three exceptions below, so one bad kubelet answer cannot take the
sampler down, and it protects the kubelet from being hammered:

- the connection (HTTP/2 on the unix socket, :mod:`exporter.kubelet.transport`) is made
  lazily and made anew when the socket file is replaced (a kubelet restart unlinks and
  re-binds it), after UNAVAILABLE or any connection failure; a call that fails on a connection
  kept from an earlier call is tried once more on a new one (List is idempotent, and a server
  may close an idle connection);
- after RESOURCE_EXHAUSTED (the kubelet's token bucket, 100 qps / burst 10, shared by all
  podresources clients on the node) it backs off exponentially with jitter, 0.1 s to 5 s, and
  during the backoff `list()` fails fast without touching the socket;
- one deadline (`timeout`) covers the whole of `list()`: connecting, the call, its one retry,
  and decoding and converting the answer, which are bounded too (:mod:`exporter.kubelet.decode`).
"""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import Callable

import structlog

from exporter.backoff import Backoff
from exporter.constants import KUBELET_SOCKET
from exporter.kubelet import api_pb2
from exporter.kubelet.convert import DeadlinePassed
from exporter.kubelet.decode import AnswerMalformed, AnswerRefused, decode
from exporter.kubelet.model import PodResourcesSnapshot
from exporter.kubelet.transport import (
    DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    GrpcStatus,
    TransportError,
    UnaryConnection,
)

log = structlog.get_logger(__name__)

# Kubernetes' own PodResources clients use 16 MiB; grpc's default of 4 MiB is too small for
# nodes with many pods, and the kubelet itself sets no send limit.
MAX_RECEIVE_MESSAGE_LENGTH = 16 * 1024 * 1024
LIST_METHOD = "/v1.PodResourcesLister/List"
_LIST_REQUEST = api_pb2.ListPodResourcesRequest().SerializeToString()
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# sockaddr_un.sun_path is 108 bytes on Linux including the terminating NUL.
_MAX_UNIX_PATH = 107


class KubeletError(Exception):
    """The PodResources call failed; base class of the more specific errors below."""

    def __init__(self, socket_path: str, message: str) -> None:
        super().__init__(f"kubelet podresources {socket_path}: {message}")
        self.socket_path = socket_path


class KubeletUnavailable(KubeletError):
    """The kubelet cannot be reached: socket missing, connection refused, or deadline."""


class KubeletRateLimited(KubeletError):
    """The kubelet rejected the call by rate limit, or we are still backing off from that."""

    def __init__(self, socket_path: str, message: str, retry_after: float) -> None:
        super().__init__(socket_path, f"{message} (retry in {retry_after:.2f}s)")
        self.retry_after = retry_after


# (st_dev, st_ino, st_ctime_ns) of the socket file the channel was made for. The inode alone
# is not enough: filesystems hand a freed inode number straight to the next new file, so a
# re-bound socket often keeps its number; the change time tells the two files apart.
_FileId = tuple[int, int, int]


class PodResourcesClient:
    """List the kubelet's pod resources; thread-safe, synchronous.

    `clock` and `rng` exist so the backoff can be driven deterministically (tests, sims);
    production code leaves them at their defaults.
    """

    def __init__(
        self,
        socket_path: str = KUBELET_SOCKET,
        timeout: float = 5.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._conn: UnaryConnection | None = None
        self._conn_file: _FileId | None = None
        self._conn_used = False  # the connection has answered a call before
        # After RESOURCE_EXHAUSTED: always within [BACKOFF_MIN_S, BACKOFF_MAX_S].
        self._backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, rng=self._rng.random, min_delay=BACKOFF_MIN_S)
        self._backoff_until = 0.0
        self._last_skipped = 0
        self._last: tuple[bytearray,
                          PodResourcesSnapshot] | None = None  # the last List answer's bytes and its conversion

    # -- public -------------------------------------------------------------------------

    def list(self) -> PodResourcesSnapshot:
        """One List call. Raises KubeletUnavailable, KubeletRateLimited or KubeletError."""
        with self._lock:
            now = self._clock()
            if now < self._backoff_until:
                raise KubeletRateLimited(
                    self.socket_path, "backing off after rate limit", self._backoff_until - now
                )
            # A deadline of its own, not self._clock: that one drives the backoff (tests fake it).
            deadline = time.monotonic() + self.timeout
            data = self._call(deadline)
            self._backoff.reset()
            self._backoff_until = 0.0
            last = self._last
            if last is not None and last[0] == data:
                # Pods and their devices rarely change between two Lists: an answer byte for
                # byte the same as the last is neither decoded nor converted again, and the
                # unchanged snapshot lets the join keep its structure (JoinMemo).
                return last[1]
            try:
                snap = decode(data, deadline)
            except AnswerMalformed as err:  # (the cycle's collector logs it, once)
                raise KubeletError(
                    self.socket_path, f"could not decode List response ({len(data)} bytes): {err}"
                ) from None
            except AnswerRefused as err:
                raise KubeletError(self.socket_path, f"List response ({len(data)} bytes) refused: {err}") from None
            except DeadlinePassed:
                raise KubeletUnavailable(
                    self.socket_path, f"List response ({len(data)} bytes) not decoded within {self.timeout:g}s"
                ) from None
            except Exception as err:  # a converter bug must not kill the sampler thread
                log.exception("kubelet_response_unreadable", socket=self.socket_path)
                raise KubeletError(self.socket_path, f"could not interpret List response: {err!r}") from err
            if snap.skipped_entries != self._last_skipped:
                # Logged on change only: the same old kubelet would otherwise log every interval.
                log.warning(
                    "kubelet_allocations_skipped",
                    socket=self.socket_path,
                    skipped=snap.skipped_entries,
                    reason="claim resources without driver/pool/device (kubelet < 1.31)"
                    " or empty device ids",
                )
                self._last_skipped = snap.skipped_entries
            self._last = (data, snap)
            return snap

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _call(self, deadline: float) -> bytearray:
        """The List answer's bytes, on the kept connection or a new one, by ``deadline``."""
        for attempt in (1, 2):
            reused = False
            try:
                conn = self._ensure_connection(deadline)  # connecting can fail like a call (TransportError)
                reused = self._conn_used
                data = conn.call(LIST_METHOD, _LIST_REQUEST, self._left(deadline))
            except GrpcStatus as err:
                self._conn_used = True
                raise self._translate(err) from None
            except TransportError as err:
                self._drop()
                if reused and attempt == 1 and not err.timed_out:
                    continue  # the kept connection had gone stale: once more, on a new one
                if err.timed_out:
                    raise KubeletUnavailable(self.socket_path, f"no answer within {self.timeout:g}s") from None
                raise KubeletUnavailable(self.socket_path, f"UNAVAILABLE: {err}") from None
            self._conn_used = True
            return data
        raise AssertionError("unreachable")  # pragma: no cover

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"no answer within {self.timeout:g}s", timed_out=True)
        return left

    def _ensure_connection(self, deadline: float) -> UnaryConnection:
        path = self.socket_path
        if len(os.fsencode(os.path.abspath(path))) > _MAX_UNIX_PATH:
            raise KubeletError(path, f"socket path longer than {_MAX_UNIX_PATH} bytes")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._drop()
            raise KubeletUnavailable(path, "socket does not exist") from None
        except OSError as err:
            self._drop()
            raise KubeletUnavailable(path, f"cannot stat socket: {err.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            self._drop()
            raise KubeletUnavailable(path, "path exists but is not a unix socket")

        file_id = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if self._conn is not None and self._conn.closed:
            self._drop()  # the server went away after answering (a graceful GOAWAY)
        if self._conn is not None and file_id != self._conn_file:
            log.info("kubelet_socket_replaced", socket=path)
            self._drop()
        if self._conn is None:
            self._conn = UnaryConnection(path, self._left(deadline), MAX_RECEIVE_MESSAGE_LENGTH)
            self._conn_file = file_id
            self._conn_used = False
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._conn_file = None
        self._conn_used = False

    def _translate(self, err: GrpcStatus) -> KubeletError:
        path, details = self.socket_path, err.message
        if err.code == RESOURCE_EXHAUSTED:
            delay = self._next_backoff()
            log.warning("kubelet_rate_limited", socket=path, details=details, backoff_s=delay)
            return KubeletRateLimited(path, f"RESOURCE_EXHAUSTED: {details}", delay)
        if err.code == UNAVAILABLE:
            # A new connection is made at once when the kubelet is back.
            self._drop()
            return KubeletUnavailable(path, f"UNAVAILABLE: {details}")
        if err.code == DEADLINE_EXCEEDED:
            return KubeletUnavailable(path, f"no answer within {self.timeout:g}s")
        return KubeletError(path, f"{err.name}: {details}")

    def _next_backoff(self) -> float:
        delay = self._backoff.next_delay()
        self._backoff_until = self._clock() + delay
        return delay
