"""Unary gRPC calls over HTTP/2 on a unix socket: the kubelet PodResources client's wire.

Why not grpcio's client: the agent makes one small unary call per interval on a local socket,
and grpcio's event engine keeps a pool of ``clamp(cores, 4, 16)`` worker threads plus a
lifeguard and a timer thread that wake on back-off timers after every call. At a 1 s interval
on the 2-core bench machine they cost ~2 ms of CPU a second, more than the rest of an 8-GPU
cycle, and a GPU node with 64+ cores gets 16 of them; importing grpcio also costs ~17 MB of RSS.

HTTP/2 itself (framing, HPACK and its dynamic table, flow control, SETTINGS and PING answers,
stream states, header validation, CONTINUATION limits) is python-hyper's ``h2``, a sans-IO
state machine: it never touches the socket, so no thread is needed. What is ours is the small
unary-gRPC layer on top (gRPC over HTTP/2, grpc/doc/PROTOCOL-HTTP2.md):

* request: HEADERS (``POST``, ``:path /<service>/<method>``, ``content-type: application/grpc``,
  ``te: trailers``, ``grpc-timeout``) and one DATA frame holding a length-prefixed message
  (1 byte compressed flag, 4 bytes big-endian length, the protobuf bytes);
* response: HEADERS (``:status 200``), DATA with one length-prefixed message, and trailers
  with ``grpc-status`` (and a percent-encoded ``grpc-message``); or, for an error, a single
  "trailers-only" HEADERS frame carrying ``grpc-status`` itself;
* the call's deadline (the socket waits at most what is left of it, and the server is told
  it in ``grpc-timeout``).

And what h2 leaves to its user, decided here:

* a graceful GOAWAY (grpc-go's GracefulStop, a kubelet restart) lets the call in flight finish
  when the server names its stream as one it will still answer; the next call needs a new
  connection. h2 closes its connection state on any GOAWAY and then refuses the rest of the
  answer, so GOAWAY frames are taken out of the byte stream before h2 sees them (a frame's
  first 9 bytes say its length and type, RFC 9113 4.1) and acted on here;
* bounds per call: the answer is refused as soon as its 5-byte prefix declares more than the
  limit; a call takes in at most CALL_FRAMES frames other than DATA frames of 512 bytes or more
  (a flood of empty DATA, PING ACK, SETTINGS or unknown frames ends the call at once instead of
  spinning until the deadline); h2 bounds a header block (64 CONTINUATION frames, a 64 KiB
  decoded header list). So a call reads at most the answer and CALL_FRAMES frames of 16 KiB;
* the stream's window is granted for a whole maximal answer up front (no WINDOW_UPDATE round
  trips mid-answer), and h2 tops the connection's window up as answers are consumed.

Tests hold this against real peers: grpcio's server (the simulated node's kubelet, and grpcio's
own client as the oracle for what an answer decodes to), and an ``h2`` server that sends the
legal framing grpcio never does (padding, CONTINUATION, PING and SETTINGS mid-answer, tiny DATA
frames) and hostile floods. No call runs in a thread of its own: the caller's thread sends,
then reads the socket until the stream ends or the deadline passes.
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
RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL = 8, 14, 4, 13
_RECV = 256 * 1024

# What the byte stream is looked at for before h2 gets it (RFC 9113 4.1, 6): a frame's length
# and type, and the END_HEADERS flag (a GOAWAY inside a header block is h2's to refuse).
_HEADERS, _SETTINGS, _PUSH_PROMISE, _GOAWAY, _CONTINUATION = 1, 4, 5, 7, 9
_END_HEADERS = 0x4
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the default, which we never raise
MAX_WINDOW = 2**31 - 1
# Frames a call takes in that bring little or no answer: all but DATA frames of 512 bytes or
# more. grpcio's server sends 3-8 a call (measured: HEADERS, trailers, a short last DATA frame,
# and on a new connection SETTINGS, their ACK, WINDOW_UPDATE); grpc-go's adds a PING at most. An
# answer in DATA frames under 512 bytes is legal HTTP/2, but no gRPC server writes one.
CALL_FRAMES = 1000
_SMALL_DATA = 512
_GRPC_STATUS_DIGITS = 10  # more is no status code (2^31 has 10 digits); int() of 4,301+ digits raises


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


# Our request headers are constants, valid and lower-case: h2 need not check and normalise them
# on every call. What the server sends is still validated.
_CONFIG = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                    normalize_outbound_headers=False)


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
        conn = h2.connection.H2Connection(_CONFIG)
        # Every stream may receive a whole maximal answer, and a frame more: an answer over the
        # limit is then seen (and refused on its prefix) rather than stalled by flow control.
        window = min(MAX_WINDOW, max_message + 5 + MAX_FRAME)
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={h2.settings.SettingCodes.ENABLE_PUSH: 0,
                            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(
            MAX_WINDOW - 65535
        )  # the connection's, topped up by h2 as answers are consumed
        self._h2 = conn
        self._going_away = False  # the server sent GOAWAY: no new call on this connection
        self._preface_seen = False  # the server's first frame (its SETTINGS) has arrived
        # The frame scan (see _split): bytes held back from h2 (an unfinished frame header, or a
        # GOAWAY not yet whole), and how much of the current frame's payload is still to come.
        self._held = b""
        self._skip = 0
        self._in_block = False  # inside a header block (HEADERS or PUSH_PROMISE without END_HEADERS)
        # This call's stream, whether its answer is complete, and the frames counted against it
        self._stream = 0
        self._ended = False
        self._frames = 0
        self._sendall(conn.data_to_send())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:  # GOAWAY, no error: the polite end. Best effort and never blocking: the peer
                # may be gone, or stuck and not reading.
                self._h2.close_connection()
                self._sock.setblocking(False)
                self._sock.send(self._h2.data_to_send())
            except Exception:
                pass
            self._sock.close()

    def _sendall(self, data: bytes) -> None:
        if not data:
            return
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

    def _protocol_error(self, message: str) -> NoReturn:
        self._fail(f"HTTP/2 protocol error: {message}")

    def call(self, path: str, request: bytes, timeout: float) -> bytearray:
        """The response message of the unary call ``path`` (``/package.Service/Method``).

        Raises GrpcStatus for a non-OK status, TransportError for anything else (the
        connection is then closed)."""
        self._check_open()
        deadline = time.monotonic() + timeout
        conn = self._h2
        # grpc-timeout: at most 8 digits (gRPC over HTTP/2, "Timeout"), in milliseconds
        millis = min(99_999_999, max(1, int(timeout * 1000)))
        try:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [
                (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"localhost"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"%dm" % millis),
            ])  # fmt: skip
            conn.send_data(sid, b"\0" + len(request).to_bytes(4, "big") + request, end_stream=True)
        except h2.exceptions.H2Error as err:  # stream ids exhausted, a request over the server's window
            self._fail(f"HTTP/2: {err}")
        self._stream, self._frames = sid, 0
        self._ended = False
        headers: list[tuple[bytes, bytes]] = []
        trailers: list[tuple[bytes, bytes]] = []
        body = bytearray()
        grpc = False  # the headers said :status 200: the body is gRPC messages
        limit = self.max_message
        sock = self._sock
        sock.settimeout(timeout)  # the request is sent within the call's deadline too
        self._sendall(conn.data_to_send())
        while not self._answered():
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer within {timeout:g}s", timed_out=True)
            sock.settimeout(left)
            try:
                chunk = sock.recv(_RECV)
            except TimeoutError:
                self._fail(f"no answer within {timeout:g}s", timed_out=True)
            except ConnectionResetError as err:
                self._fail(f"connection closed by the server ({err.strerror or err})")
            except OSError as err:
                self._fail(f"receive failed: {err.strerror or err}")
            if not chunk:
                self._fail("connection closed by the server")
            for piece in self._split(chunk):
                if isinstance(piece, tuple):
                    self._goaway(*piece)
                    continue
                for ev in self._events(piece):
                    if self._ended or getattr(ev, "stream_id", sid) != sid:
                        continue  # the answer is complete, or an older stream's late frames
                    if isinstance(ev, h2.events.DataReceived):
                        if ev.data:
                            body += ev.data
                            # The 5-byte prefix of a gRPC answer declares the message's size:
                            # refuse an oversized one at once, not after receiving all of it. (A
                            # 503's text body is no gRPC message: its status is the error.)
                            if len(body) > limit + 5 or (
                                grpc and len(body) >= 5 and int.from_bytes(body[1:5], "big") > limit):
                                self._fail(f"response larger than {limit} bytes")
                        if ev.flow_controlled_length:
                            conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                    elif isinstance(ev, h2.events.ResponseReceived):
                        headers = list(ev.headers or ())  # bytes pairs: header_encoding=None
                        grpc = (b":status", b"200") in headers
                    elif isinstance(ev, h2.events.TrailersReceived):
                        trailers = list(ev.headers or ())
                    elif isinstance(ev, h2.events.StreamEnded):
                        self._ended = True
                    elif isinstance(ev, h2.events.StreamReset):
                        self._fail(f"the server reset the stream (HTTP/2 error {int(ev.error_code or 0)})")
                # h2's answers to what arrived: SETTINGS and PING ACKs, WINDOW_UPDATEs
                self._sendall(conn.data_to_send())
        if self._going_away:
            self.close()  # the call got its answer; the next one needs a new connection
        try:
            return _message(headers, trailers, body, limit)
        except TransportError:
            self.close()  # not a gRPC answer: nothing more to expect of this peer
            raise

    # Methods, not the attributes in call()'s tests: mypy would keep them narrowed to False.
    def _check_open(self) -> None:
        if self.closed:
            raise TransportError("connection closed")
        if self._going_away:
            self._fail("the server is closing the connection (GOAWAY)")

    def _answered(self) -> bool:
        return self._ended

    def _events(self, data: bytes) -> list[h2.events.Event]:
        try:
            return self._h2.receive_data(data)
        except h2.exceptions.H2Error as err:  # ProtocolError and its kind: h2 refused the server's frames
            self._protocol_error(str(err) or type(err).__name__)
        except Exception as err:  # anything else out of h2 on hostile bytes is the peer's fault too
            self._protocol_error(f"unreadable frames ({type(err).__name__}: {err})")

    def _split(self, chunk: bytes) -> list[bytes | tuple[int, int]]:
        """``chunk`` cut into what h2 reads (bytes) and the GOAWAY frames in it ((last stream
        id, error code)), in order; every frame counted against the call's CALL_FRAMES.

        Only frame headers are looked at (a frame's payload passes through to h2 unread), so
        the usual answer is one piece: the chunk itself."""
        data = self._held + chunk if self._held else chunk
        self._held = b""
        size = len(data)
        pos = self._skip  # the rest of a frame whose header came in an earlier chunk
        if pos >= size:
            self._skip = pos - size
            return [data]
        self._skip = 0
        pieces: list[bytes | tuple[int, int]] = []
        start = 0
        while True:
            if size - pos < 9:
                self._held = data[pos:]  # an unfinished frame header: with the next chunk
                break
            length = int.from_bytes(data[pos : pos + 3], "big")
            kind, flags = data[pos + 3], data[pos + 4]
            if not self._preface_seen:
                # The server's connection preface is a SETTINGS frame; anything else (an HTTP/1
                # answer's "HTTP/1.1 4", say) is no HTTP/2 server, told before waiting for more.
                if kind != _SETTINGS or flags & 1 or length % 6:
                    self._fail(f"the server does not speak HTTP/2 (it sent {bytes(data[pos : pos + 9])!r})")
                self._preface_seen = True
            if length > MAX_FRAME:  # h2 would wait for all of it before refusing it
                self._protocol_error(f"a frame of {length} bytes, over the {MAX_FRAME} allowed")
            end = pos + 9 + length
            if kind == _GOAWAY and not self._in_block:
                if end > size:
                    self._held = data[pos:]  # acted on when whole
                    break
                if pos > start:
                    pieces.append(data[start:pos])
                payload = data[pos + 9 : end]
                if length < 8:
                    self._protocol_error("malformed GOAWAY")
                pieces.append((int.from_bytes(payload[:4], "big") & MAX_WINDOW, int.from_bytes(payload[4:8], "big")))
                start = end
            elif kind in (_HEADERS, _PUSH_PROMISE, _CONTINUATION):
                self._in_block = not flags & _END_HEADERS
            if kind or length < _SMALL_DATA:  # not a DATA frame carrying an answer's bytes
                self._frames += 1
                if self._frames > CALL_FRAMES:
                    self._protocol_error(f"more than {CALL_FRAMES} frames that carry little or no answer (a frame "
                                         "flood)")
            if end >= size:
                self._skip = end - size
                pos = size
                break
            pos = end
        if start < pos:
            pieces.append(data if start == 0 and pos == size else data[start:pos])
        return pieces

    def _goaway(self, last_stream: int, code: int) -> None:
        # A graceful shutdown (the kubelet's gRPC server on restart) still answers the streams
        # up to the last id it names: the call in flight may finish; no new one.
        self._going_away = True
        if not self._ended and self._stream > last_stream:
            self._fail(f"the server closed the connection (GOAWAY, HTTP/2 error {code})")


def _message(headers: list[tuple[bytes, bytes]], trailers: list[tuple[bytes, bytes]], body: bytearray,
             max_message: int) -> bytearray:
    """The one response message, after checking the HTTP status and the grpc-status."""
    head = dict(headers)
    http_status = head.get(b":status", b"")
    if http_status != b"200":
        raise TransportError(f"HTTP status {http_status.decode('latin-1') or 'missing'}, not a gRPC answer")
    # A "trailers-only" answer (an error before any message) carries the status in its headers.
    tail = dict(trailers) if trailers else head
    raw = tail.get(b"grpc-status")
    if raw is None:
        raise TransportError("answer without a grpc-status")
    if not raw.isdigit() or len(raw) > _GRPC_STATUS_DIGITS:
        # as grpc-go's client says it: an INTERNAL status, the connection stays usable
        shown = raw[:16].decode("latin-1") + ("..." if len(raw) > 16 else "")
        raise GrpcStatus(INTERNAL, f"malformed grpc-status {shown!r} ({len(raw)} bytes)")
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
    del body[:5]  # in place: an answer of up to 16 MiB is not copied again
    return body
