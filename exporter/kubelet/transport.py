"""Unary gRPC calls over HTTP/2 on a unix socket: the kubelet PodResources client's wire.

Why not grpcio's client: the agent makes one small unary call per interval on a local socket,
and grpcio's event engine keeps a pool of ``clamp(cores, 4, 16)`` worker threads plus a
lifeguard and a timer thread that wake on back-off timers after every call. At a 1 s interval
on the 2-core bench machine they cost ~2 ms of CPU a second, more than the rest of an 8-GPU
cycle, and a GPU node with 64+ cores gets 16 of them; importing grpcio also costs ~17 MB of RSS.

Why not python-hyper's ``h2`` state machine (the previous transport): at a 1 s interval it
cost 0.8-0.9 ms of CPU per call on the bench machine, a quarter of an 8-GPU node's cycle, for
one request and one answer. A unary call on a connection we own needs a small part of HTTP/2
(RFC 9113), written out below in ~150 lines at 0.25 ms per call:

* frames: a 9-byte header (24-bit length, type, flags, 31-bit stream id) and a payload of at
  most 16,384 bytes (we never raise SETTINGS_MAX_FRAME_SIZE); padding stripped from DATA and
  HEADERS; a header block may continue in CONTINUATION frames;
* header blocks are HPACK (RFC 7541), decoded by the ``hpack`` library (it keeps the dynamic
  table the server's encoder indexes into, across calls). Our request headers are encoded here
  as literals that are never added to the table, so the encoder needs no state;
* flow control: our SETTINGS grant every stream a window for a whole maximal answer, and the
  connection a window of 2^31-1 that is topped up as answers consume it: no WINDOW_UPDATE round
  trips mid-answer. A request must fit the server's windows (the List request is 5 bytes);
* the server's SETTINGS and PINGs are acknowledged; WINDOW_UPDATE, PRIORITY and unknown frame
  types are read and dropped; PUSH_PROMISE is refused (push is disabled); RST_STREAM on the
  call's stream ends the call; after GOAWAY the call in flight may still finish if the server
  says it will answer its stream, and the connection takes no new call (the client retries
  once on a new connection).

The gRPC layer on top is small too:

* request: HEADERS (``POST``, ``:path /<service>/<method>``, ``content-type: application/grpc``,
  ``te: trailers``, ``grpc-timeout``) and one DATA frame holding a length-prefixed message
  (1 byte compressed flag, 4 bytes big-endian length, the protobuf bytes);
* response: HEADERS (``:status 200``), DATA with one length-prefixed message, and trailers
  with ``grpc-status`` (and a percent-encoded ``grpc-message``); or, for an error, a single
  "trailers-only" HEADERS frame carrying ``grpc-status`` itself.

Tests hold this against real peers: grpcio's server (the simulated node's kubelet, and grpcio's
own client as the oracle for what an answer decodes to), and an ``h2`` server that sends the
legal framing grpcio never does (padding, CONTINUATION, PING and SETTINGS mid-answer, tiny DATA
frames). No call runs in a thread of its own: the caller's thread sends, then reads the socket
until the stream ends or the deadline passes.
"""

from __future__ import annotations

import socket
import time
from typing import NoReturn
from urllib.parse import unquote

import hpack
import hpack.exceptions

# gRPC status codes (grpc/doc/statuscodes.md) by number, for messages
STATUS_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
    15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}  # fmt: skip
RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED = 8, 14, 4
_RECV = 256 * 1024

# HTTP/2 (RFC 9113 §6): frame types, flags, settings and limits
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
MAX_FRAME = 16384  # the default SETTINGS_MAX_FRAME_SIZE, both ways: we never announce another
MAX_HEADER_BLOCK = 256 * 1024  # a header block (with its CONTINUATIONs) kept before decoding, at most
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


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


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 9-byte header, then the payload."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541 §5.1); ``first`` holds the bits above it."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out, value = bytearray((first | limit,)), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _hpack_str(raw: bytes) -> bytes:
    return _hpack_int(len(raw), 7) + raw  # not Huffman-coded: our few bytes are not worth it


def request_headers(path: str, timeout: float) -> bytes:
    """The HPACK block of a gRPC request (RFC 7541 §6): ``:method POST`` and ``:scheme http``
    from the static table, everything else a literal that is never added to the dynamic table
    (so the server's decoder state does not depend on ours)."""
    # grpc-timeout: at most 8 digits (gRPC over HTTP/2, "Timeout"), in milliseconds
    millis = min(99_999_999, max(1, int(timeout * 1000)))
    return b"".join((
        b"\x83\x86",  # indexed 3 (:method POST), indexed 6 (:scheme http)
        _hpack_int(4, 4) + _hpack_str(path.encode()),  # name index 4: :path
        _hpack_int(1, 4) + _hpack_str(b"localhost"),  # name index 1: :authority
        _hpack_int(31, 4) + _hpack_str(b"application/grpc"),  # name index 31: content-type
        b"\x00" + _hpack_str(b"te") + _hpack_str(b"trailers"),
        b"\x00" + _hpack_str(b"grpc-timeout") + _hpack_str(b"%dm" % millis),
    ))  # fmt: skip


class _Call:
    """What has arrived so far for the call's stream."""

    __slots__ = ("body", "ended", "grpc", "headers", "stream", "trailers")

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.grpc = False  # the headers said :status 200: the body is gRPC messages
        self.trailers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.ended = False


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
        self._decoder = hpack.Decoder()
        self._buf = bytearray()  # received bytes not yet parsed into frames
        self._out: list[bytes] = []  # frames to send: acknowledgements, window updates
        self._block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments) of an unfinished header block
        self._preface_seen = False  # the server's first frame (its SETTINGS) has arrived
        self._next_stream = 1
        self._call: _Call | None = None
        self._going_away = False  # the server sent GOAWAY: no new call on this connection
        # The server's flow-control windows for what we send (our requests).
        self._send_window = DEFAULT_WINDOW
        self._stream_window = DEFAULT_WINDOW
        self._headers: dict[tuple[str, float], bytes] = {}  # request header blocks, by (path, timeout)
        # Every stream may receive a whole maximal answer, and a frame more: an answer over the
        # limit is then seen (and refused) rather than stalled by flow control.
        stream_window = min(MAX_WINDOW, max_message + 5 + MAX_FRAME)
        settings = SETTINGS_ENABLE_PUSH.to_bytes(2, "big") + (0).to_bytes(4, "big")
        settings += SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + stream_window.to_bytes(4, "big")
        self._recv_consumed = 0  # connection-window bytes received since the last top-up
        self._sendall(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:  # GOAWAY, no error (the server started no stream): the polite end. Best effort and
                # never blocking: the peer may be gone, or stuck and not reading.
                self._sock.setblocking(False)
                self._sock.send(frame(GOAWAY, 0, 0, bytes(8)))
            except OSError:
                pass
            self._sock.close()

    def _sendall(self, data: bytes) -> None:
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

    def call(self, path: str, request: bytes, timeout: float) -> bytes:
        """The response message of the unary call ``path`` (``/package.Service/Method``).

        Raises GrpcStatus for a non-OK status, TransportError for anything else (the
        connection is then closed)."""
        self._check_open()
        deadline = time.monotonic() + timeout
        stream = self._next_stream
        if stream > MAX_WINDOW:  # 2^30 calls on one connection: a new one takes over
            self._fail("HTTP/2 stream ids exhausted")
        message = b"\0" + len(request).to_bytes(4, "big") + request
        if len(message) > min(MAX_FRAME, self._send_window, self._stream_window):
            self._fail(f"request of {len(request)} bytes larger than one frame or the server's flow-control window")
        self._next_stream += 2
        block = self._headers.get((path, timeout))
        if block is None:
            if len(self._headers) > 16:  # a caller varying its timeout: keep a few
                self._headers.clear()
            block = self._headers[(path, timeout)] = request_headers(path, timeout)
        call = self._call = _Call(stream)
        self._send_window -= len(message)
        self._sock.settimeout(timeout)  # the request is sent within the call's deadline too
        self._sendall(frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, message))
        sock = self._sock
        while not call.ended:
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
            self._buf += chunk
            self._frames()
            if self._out:  # acknowledgements and window updates the frames asked for
                out, self._out = b"".join(self._out), []
                self._sendall(out)
        self._call = None
        if self._going_away:
            self.close()  # the call got its answer; the next one needs a new connection
        try:
            return _message(call.headers or [], call.trailers, call.body, self.max_message)
        except TransportError:
            self.close()  # not a gRPC answer: nothing more to expect of this peer
            raise

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError("connection closed")
        if self._going_away:
            self._fail("the server is closing the connection (GOAWAY)")

    def _frames(self) -> None:
        """Handle every complete frame in the buffer."""
        buf, pos, size = self._buf, 0, len(self._buf)
        while size - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5 : pos + 9], "big") & MAX_WINDOW
            if not self._preface_seen:
                # The server's connection preface is a SETTINGS frame; anything else (an HTTP/1
                # answer's "HTTP/1.1 4", say) is no HTTP/2 server, told before waiting for more.
                if kind != SETTINGS or flags & ACK or stream or length % 6:
                    self._fail(f"the server does not speak HTTP/2 (it sent {bytes(buf[pos : pos + 9])!r})")
                self._preface_seen = True
            if length > MAX_FRAME:
                self._protocol_error(f"a frame of {length} bytes, over the {MAX_FRAME} allowed")
            end = pos + 9 + length
            if end > size:
                break
            payload = bytes(buf[pos + 9 : end])
            pos = end
            self._frame(kind, flags, stream, payload)
        del buf[:pos]
        if self._recv_consumed > MAX_WINDOW // 2:  # top the connection window up again
            self._out.append(frame(WINDOW_UPDATE, 0, 0, self._recv_consumed.to_bytes(4, "big")))
            self._recv_consumed = 0

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self._block is not None and (kind != CONTINUATION or stream != self._block[0]):
            self._protocol_error("a header block was interrupted by another frame")
        call = self._call
        # Frames for a stream that has ended (a grpc-go server may reset it, with NO_ERROR, right
        # after the trailers: RFC 9113 8.1) or for an older stream change nothing for the call.
        ours = call is not None and stream == call.stream and not call.ended
        if kind == DATA:
            if not stream:
                self._protocol_error("DATA on stream 0")
            self._recv_consumed += len(payload)  # padding included: all of it counts
            data = self._unpad(flags, payload)
            if ours:
                assert call is not None
                body = call.body
                body += data
                # The 5-byte prefix of a gRPC answer declares the message's size: refuse an
                # oversized one at once, not after receiving all of it. (A 503's text body is
                # no gRPC message: its status is the error, told by _message.)
                if len(body) > self.max_message + 5 or (call.grpc and len(body) >= 5 and int.from_bytes(body[1:5], "big") > self.max_message):
                    self._fail(f"response larger than {self.max_message} bytes")
                if flags & END_STREAM:
                    call.ended = True
        elif kind == HEADERS:
            if not stream:
                self._protocol_error("HEADERS on stream 0")
            fragment = self._unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                fragment = fragment[5:]  # stream dependency and weight: not ours to use
            self._block = (stream, flags, bytearray(fragment))
            if flags & END_HEADERS:
                self._end_block()
        elif kind == CONTINUATION:
            if self._block is None:
                self._protocol_error("CONTINUATION without a header block")
            self._block[2].extend(payload)
            if len(self._block[2]) > MAX_HEADER_BLOCK:  # endless CONTINUATIONs: memory, not headers
                self._protocol_error(f"a header block larger than {MAX_HEADER_BLOCK} bytes")
            if flags & END_HEADERS:
                self._end_block()
        elif kind == SETTINGS:
            if stream or (flags & ACK and payload) or len(payload) % 6:
                self._protocol_error("malformed SETTINGS")
            if not flags & ACK:
                for i in range(0, len(payload), 6):
                    if int.from_bytes(payload[i : i + 2], "big") == SETTINGS_INITIAL_WINDOW_SIZE:
                        value = int.from_bytes(payload[i + 2 : i + 6], "big")
                        if value > MAX_WINDOW:
                            self._protocol_error("flow-control window over 2^31-1")
                        self._stream_window = value
                self._out.append(frame(SETTINGS, ACK, 0))
        elif kind == PING:
            if stream or len(payload) != 8:
                self._protocol_error("malformed PING")
            if not flags & ACK:
                self._out.append(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                self._protocol_error("malformed WINDOW_UPDATE")
            if not stream:
                self._send_window = min(MAX_WINDOW, self._send_window + (int.from_bytes(payload, "big") & MAX_WINDOW))
        elif kind == RST_STREAM:
            if ours:
                self._fail(f"the server reset the stream (HTTP/2 error {int.from_bytes(payload[:4], 'big')})")
        elif kind == GOAWAY:
            if len(payload) < 8:
                self._protocol_error("malformed GOAWAY")
            # A graceful shutdown (the kubelet's gRPC server on restart) still answers the
            # streams up to the last id it names: the call in flight may finish; no new one.
            self._going_away = True
            if call is not None and not call.ended and call.stream > int.from_bytes(payload[:4], "big") & MAX_WINDOW:
                self._fail(f"the server closed the connection (GOAWAY, HTTP/2 error {int.from_bytes(payload[4:8], 'big')})")
        elif kind == PUSH_PROMISE:
            self._protocol_error("PUSH_PROMISE, though push is disabled")
        # PRIORITY and frame types this version of HTTP/2 does not know: read and dropped (§5.5)

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            self._protocol_error("padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _end_block(self) -> None:
        """A complete header block: decoded whatever its stream (the HPACK table is the
        connection's), kept when it is the call's."""
        assert self._block is not None
        stream, flags, block = self._block
        self._block = None
        try:
            headers = self._decoder.decode(bytes(block), raw=True)
        except hpack.exceptions.HPACKError as err:
            self._protocol_error(f"undecodable header block ({err})")
        call = self._call
        if call is None or stream != call.stream or call.ended:
            return
        if call.headers is None:
            call.headers = list(headers)  # raw=True: (bytes, bytes) pairs
            call.grpc = (b":status", b"200") in call.headers
        else:
            call.trailers = list(headers)
        if flags & END_STREAM:
            call.ended = True


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
