"""Unary gRPC calls over HTTP/2 on a unix socket: the kubelet PodResources client's wire.

Why not grpcio's client: the agent makes one small unary call per interval on a local socket,
and grpcio's event engine keeps a pool of ``clamp(cores, 4, 16)`` worker threads plus a
lifeguard and a timer thread that wake on back-off timers after every call. At a 1 s interval
on the 2-core bench machine they cost ~2 ms of CPU a second, more than the rest of an 8-GPU
cycle, and a GPU node with 64+ cores gets 16 of them; importing grpcio also costs ~17 MB of RSS.
Here the HTTP/2 state machine (framing, HPACK, flow control, SETTINGS and PING answers) is
python-hyper's ``h2``; what is left is the gRPC wire format, which is small:

* request: HEADERS (``POST``, ``:path /<service>/<method>``, ``content-type: application/grpc``,
  ``te: trailers``, ``grpc-timeout``) and one DATA frame holding a length-prefixed message
  (1 byte compressed flag, 4 bytes big-endian length, the protobuf bytes);
* response: HEADERS (``:status 200``), DATA with one length-prefixed message, and trailers
  with ``grpc-status`` (and a percent-encoded ``grpc-message``); or, for an error, a single
  "trailers-only" HEADERS frame carrying ``grpc-status`` itself.

grpcio stays the peer the tests (and the simulated node's kubelet) run: a real gRPC server.
No call runs in a thread of its own: the caller's thread sends, then reads the socket until
the stream ends or the deadline passes.
"""

from __future__ import annotations

import socket
import time
from typing import NoReturn
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

# gRPC status codes (grpc/doc/statuscodes.md) by number, for messages
STATUS_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
    15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}  # fmt: skip
RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED = 8, 14, 4
_RECV = 256 * 1024


class GrpcStatus(Exception):
    """The server answered the call with a non-OK grpc-status; the connection stays usable."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{STATUS_NAMES.get(code, str(code))}: {message}")

    @property
    def name(self) -> str:
        return STATUS_NAMES.get(self.code, f"status {self.code}")


class TransportError(Exception):
    """The connection failed (refused, reset, closed, timed out, not HTTP/2 or not gRPC): it is
    closed and must be made anew. ``timed_out``: the deadline passed before the answer."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class UnaryConnection:
    """One HTTP/2 connection to a unix socket; :meth:`call` runs one unary call at a time.

    Not thread-safe: the caller serialises calls (PodResourcesClient holds its lock)."""

    def __init__(self, path: str, timeout: float, max_message: int) -> None:
        self.max_message = max_message
        self.closed = False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except TimeoutError:
            sock.close()
            raise TransportError(f"no connection within {timeout:g}s", timed_out=True) from None
        except OSError as err:
            sock.close()
            raise TransportError(f"cannot connect: {err.strerror or err}") from None
        self._sock = sock
        # Our request headers are constants, valid and lower-case: h2 need not check and normalise
        # them on every call. What the server sends is still validated.
        config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False)
        conn = h2.connection.H2Connection(config)
        # Window for a whole maximal answer up front: no WINDOW_UPDATE round trips mid-message.
        window = max_message + 5
        conn.local_settings = h2.settings.Settings(client=True, initial_values={h2.settings.SettingCodes.ENABLE_PUSH: 0, h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: min(window, 2**31 - 1)})
        conn.initiate_connection()
        conn.increment_flow_control_window(min(window, 2**31 - 1 - 65535))
        self._conn = conn
        self._send()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._conn.close_connection()
                self._sock.sendall(self._conn.data_to_send())
            except Exception:  # best effort: the peer may be gone
                pass
            self._sock.close()

    def _send(self) -> None:
        data = self._conn.data_to_send()
        if data:
            try:
                self._sock.sendall(data)
            except TimeoutError:
                self._fail("the socket accepted no data before the deadline", timed_out=True)
            except (BrokenPipeError, ConnectionResetError) as err:
                self._fail(f"connection closed by the server ({err.strerror or err})")
            except OSError as err:
                self._fail(f"send failed: {err.strerror or err}")

    def _fail(self, message: str, *, timed_out: bool = False) -> NoReturn:
        self.close()
        raise TransportError(message, timed_out=timed_out)

    def call(self, path: str, request: bytes, timeout: float) -> bytes:
        """The response message of the unary call ``path`` (``/package.Service/Method``).

        Raises GrpcStatus for a non-OK status, TransportError for anything else (the
        connection is then closed)."""
        if self.closed:
            raise TransportError("connection closed")
        deadline = time.monotonic() + timeout
        conn = self._conn
        try:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [
                (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"localhost"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"%dm" % max(1, int(timeout * 1000))),
            ])  # fmt: skip
            conn.send_data(sid, b"\0" + len(request).to_bytes(4, "big") + request, end_stream=True)
        except h2.exceptions.H2Error as err:  # e.g. stream ids exhausted, or the peer said GOAWAY
            self._fail(f"HTTP/2: {err}")
        self._send()
        headers: list[tuple[bytes, bytes]] = []
        trailers: list[tuple[bytes, bytes]] = []
        body = bytearray()
        ended = False
        while not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer within {timeout:g}s", timed_out=True)
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(_RECV)
            except TimeoutError:
                self._fail(f"no answer within {timeout:g}s", timed_out=True)
            except ConnectionResetError as err:
                self._fail(f"connection closed by the server ({err.strerror or err})")
            except OSError as err:
                self._fail(f"receive failed: {err.strerror or err}")
            if not chunk:
                self._fail("connection closed by the server")
            try:
                events = conn.receive_data(chunk)
            except h2.exceptions.H2Error as err:
                self._fail(f"HTTP/2 protocol error: {err}")
            for ev in events:
                if getattr(ev, "stream_id", sid) != sid:
                    continue  # an older stream's late frames (none expected: calls are serial)
                if isinstance(ev, h2.events.ResponseReceived):
                    headers = list(ev.headers or ())  # bytes: header_encoding=None
                elif isinstance(ev, h2.events.TrailersReceived):
                    trailers = list(ev.headers or ())
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data or b""
                    if len(body) > self.max_message + 5:
                        self._fail(f"response larger than {self.max_message} bytes")
                    if ev.flow_controlled_length:
                        conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, h2.events.StreamEnded):
                    ended = True
                elif isinstance(ev, h2.events.StreamReset):
                    self._fail(f"the server reset the stream (HTTP/2 error {ev.error_code})")
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self._fail(f"the server closed the connection (GOAWAY, HTTP/2 error {ev.error_code})")
            self._send()  # acknowledgements, SETTINGS and PING answers h2 queued
        return _message(headers, trailers, body, self.max_message)


def _message(headers: list[tuple[bytes, bytes]], trailers: list[tuple[bytes, bytes]], body: bytearray, max_message: int) -> bytes:
    """The one response message, after checking the HTTP status and the grpc-status."""
    head = dict(headers)
    http_status = head.get(b":status", b"")
    if http_status != b"200":
        raise TransportError(f"HTTP status {http_status.decode('latin-1') or 'missing'}, not a gRPC answer")
    # A "trailers-only" answer (an error before any message) carries the status in its headers.
    tail = dict(trailers) if trailers else head
    raw = tail.get(b"grpc-status")
    if raw is None or not raw.isdigit():
        raise TransportError("answer without a grpc-status")
    code = int(raw)
    if code != 0:
        raise GrpcStatus(code, unquote(tail.get(b"grpc-message", b"").decode("utf-8", "replace")))
    if len(body) < 5:
        raise TransportError("answer without a message")
    if body[0] != 0:
        raise TransportError("compressed message: none was asked for")
    size = int.from_bytes(body[1:5], "big")
    if size > max_message:
        raise TransportError(f"response larger than {max_message} bytes")
    if len(body) != 5 + size:
        raise TransportError(f"message length {size} does not match the {len(body) - 5} bytes received")
    return bytes(body[5:])
