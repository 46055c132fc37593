"""The kubelet client's HTTP/2 wire (exporter.kubelet.transport) against framing that grpcio's
server never sends but any HTTP/2 server may: DATA split into tiny or empty frames, padding,
HEADERS with priority fields, header blocks split across CONTINUATION frames, PING, SETTINGS,
WINDOW_UPDATE, PRIORITY and unknown frames in the middle of an answer, HPACK's dynamic table
over many calls, and resets, GOAWAY and hang-ups.

The server here is python-hyper's ``h2`` in server mode: it is the oracle for what a legal
answer looks like (it validates what the client sends, and its HPACK encoder indexes headers
as real servers do). What h2 cannot be asked to send (padded or prioritised HEADERS, a header
block cut at arbitrary bytes, PRIORITY or unknown frames from a server) is made by re-framing
h2's own output or written as raw frames; the HPACK state is never touched by that.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.kubelet import api_pb2
from exporter.kubelet.client import KubeletError, KubeletUnavailable, PodResourcesClient
from exporter.kubelet.transport import GrpcStatus, TransportError, UnaryConnection

# Generous: a call that must succeed gets this long, and a server waiting on the client gives up
# after it; the machine running the suite may be busy. Nothing here waits for a wall-clock window.
TIMEOUT = 10.0
MAX_MESSAGE = 4 * 1024 * 1024
PATH = "/v1.PodResourcesLister/List"
REQUEST = b"\x08\x01"  # any bytes: the server checks that they arrive as one gRPC message
OK_HEADERS: list[tuple[bytes, bytes]] = [(b":status", b"200"), (b"content-type", b"application/grpc")]

# Frame types and flags (RFC 9113, section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 2, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x4, 0x8, 0x20
MAX_FRAME = 16384  # the client's SETTINGS_MAX_FRAME_SIZE unless it says more; nothing here sends more


def grpc_body(message: bytes) -> bytes:
    """A gRPC length-prefixed message: compressed flag 0, 4-byte big-endian length, the bytes."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def frame(ftype: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream_id) + payload


def parse_frames(raw: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each frame in ``raw``, which holds whole frames."""
    frames, pos = [], 0
    while pos < len(raw):
        length = int.from_bytes(raw[pos : pos + 3], "big")
        ftype, flags = raw[pos + 3], raw[pos + 4]
        stream_id = int.from_bytes(raw[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        frames.append((ftype, flags, stream_id, raw[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(raw), "a partial frame"
    return frames


def header_blocks(raw: bytes) -> list[bytes]:
    """The HPACK blocks in ``raw`` (a server's output, as h2 framed it: no padding or priority)."""
    blocks: list[bytes] = []
    for ftype, flags, _, payload in parse_frames(raw):
        if ftype == HEADERS:
            assert not flags & (PADDED | PRIORITY_FLAG), "only for frames as h2 writes them"
            blocks.append(payload)
        elif ftype == CONTINUATION:
            blocks[-1] += payload
    return blocks


@dataclass(frozen=True)
class HeaderStyle:
    """How to re-frame h2's header blocks: HEADERS padded with ``pad`` bytes (0 is legal: the
    PADDED flag and a zero pad length), carrying priority fields, the block cut into pieces of
    ``fragment`` bytes (HEADERS + CONTINUATION frames; a cut may fall inside an HPACK field)."""

    pad: int | None = None
    priority: bool = False
    fragment: int | None = None


def restyle(raw: bytes, style: HeaderStyle) -> bytes:
    """h2's output with every header block re-framed as ``style`` says; other frames unchanged."""
    out = bytearray()
    block, block_flags = b"", 0
    for ftype, flags, stream_id, payload in parse_frames(raw):
        if ftype == HEADERS:
            assert not flags & (PADDED | PRIORITY_FLAG)  # h2's servers never set them
            block, block_flags = payload, flags & END_STREAM
        elif ftype == CONTINUATION:
            block += payload
        else:
            out += frame(ftype, flags, stream_id, payload)
            continue
        if flags & END_HEADERS:
            out += styled_header_frames(stream_id, block, block_flags, style)
    return bytes(out)


def styled_header_frames(stream_id: int, block: bytes, flags: int, style: HeaderStyle) -> bytes:
    first = b""
    if style.pad is not None:
        flags |= PADDED
        first += bytes([style.pad])
    if style.priority:
        # exclusive, depends on stream 0 (the root), weight 256: advice the client may ignore
        flags |= PRIORITY_FLAG
        first += struct.pack(">IB", 0x80000000, 255)
    size = style.fragment or MAX_FRAME - 256 - 5
    pieces = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
    out = bytearray()
    for i, piece in enumerate(pieces):
        last = END_HEADERS if i == len(pieces) - 1 else 0
        if i == 0:
            out += frame(HEADERS, flags | last, stream_id, first + piece + b"\0" * (style.pad or 0))
        else:
            out += frame(CONTINUATION, last, stream_id, piece)
    return bytes(out)


class ClientSilent(AssertionError):
    """The client did not send what the server waited for."""


Answer = Callable[["Peer", int], None]


class Peer:
    """The server end of one connection: h2 in server mode, its socket, and what the client sent.

    The answer script runs in this connection's thread when a request has arrived whole. The
    helpers queue frames (h2's, re-framed or raw) in order; :meth:`flush` writes them, in
    pieces if asked. Everything written is kept in ``sent``, so tests can check that the
    framing they meant to exercise was really sent."""

    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.sock = sock
        self.server = server
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.out = bytearray()
        self.sent = bytearray()
        self.events: list[h2.events.Event] = []
        self.requests: list[tuple[list[tuple[bytes, bytes]], bytes]] = []  # headers, body
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        self._heads: dict[int, list[tuple[bytes, bytes]]] = {}
        self._bodies: dict[int, bytearray] = {}
        self._complete: list[int] = []  # request streams received whole, not yet answered
        sock.settimeout(TIMEOUT)  # a silent client cannot hang this thread for good

    # --- the connection's thread

    def serve(self) -> None:
        try:
            self.conn.initiate_connection()
            self._take()
            self.flush()
            while True:
                try:
                    if not self._receive():
                        return
                except TimeoutError:
                    continue  # an idle client (between calls); teardown shuts the socket to end this
                while self._complete:
                    self.server.answer(self, self._complete.pop(0))
                self._take()  # h2's own answers: SETTINGS and PING ACKs, WINDOW_UPDATEs
                self.flush()
        except OSError:
            pass  # the client went away, or the teardown shut the socket
        except BaseException as err:  # reported by Server.close(): h2 refused the client's frames, or a script failed
            self.error = err
        finally:
            self.sock.close()

    def _receive(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            return False
        events = self.conn.receive_data(chunk)
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self._heads[ev.stream_id] = list(ev.headers)
                self._bodies[ev.stream_id] = bytearray()
            elif isinstance(ev, h2.events.DataReceived):
                self._bodies[ev.stream_id] += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id in self._heads:
                self.requests.append((self._heads.pop(ev.stream_id), bytes(self._bodies.pop(ev.stream_id))))
                self._complete.append(ev.stream_id)
        with self.changed:
            self.events += events
            self.changed.notify_all()
        return True

    def receive_until(self, wanted: Callable[[h2.events.Event], bool], what: str) -> None:
        """From an answer script: write what is queued, then read until the client sends ``what``."""
        self.flush()
        start = len(self.events)
        deadline = time.monotonic() + TIMEOUT
        while not any(wanted(ev) for ev in self.events[start:]):
            if time.monotonic() > deadline:
                raise ClientSilent(f"the client never sent {what}")
            try:
                if not self._receive():
                    # not a server error: the call's outcome (the test's to check) says why
                    raise ConnectionAbortedError(f"the client closed the connection instead of sending {what}")
            except TimeoutError:
                pass
            self._take()
            self.flush()

    # --- helpers for answer scripts: each queues frames after those queued before

    def _take(self, style: HeaderStyle | None = None) -> None:
        raw = self.conn.data_to_send()
        self.out += restyle(raw, style) if style is not None and raw else raw

    def headers(
        self, stream_id: int, headers: Sequence[tuple[bytes, bytes]] = OK_HEADERS, *, end_stream: bool = False, style: HeaderStyle | None = None
    ) -> None:
        self._take()
        self.conn.send_headers(stream_id, headers, end_stream=end_stream)
        self._take(style)

    def trailers(self, stream_id: int, status: int = 0, extra: Sequence[tuple[bytes, bytes]] = (), style: HeaderStyle | None = None) -> None:
        self.headers(stream_id, [(b"grpc-status", b"%d" % status), *extra], end_stream=True, style=style)

    def data(self, stream_id: int, payload: bytes, *, size: int = MAX_FRAME, pad: int | None = None, end_stream: bool = False) -> None:
        """``payload`` as DATA frames of ``size`` bytes at most, smaller where the client's flow
        control window is (as a real server does: a client that refuses an answer larger than
        its window must see the first part of it)."""
        overhead = 0 if pad is None else pad + 1
        pos = 0
        while True:
            room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size) - overhead
            if room <= 0 and pos < len(payload):
                self.receive_until(lambda ev: isinstance(ev, h2.events.WindowUpdated), "a WINDOW_UPDATE")
                continue
            piece = payload[pos : pos + min(size, room)]
            pos += len(piece)
            self.data_frame(stream_id, piece, pad=pad, end_stream=end_stream and pos == len(payload))
            if pos == len(payload):
                return

    def data_frame(self, stream_id: int, piece: bytes, *, pad: int | None = None, end_stream: bool = False) -> None:
        # Respect the client's flow control whatever windows it chose: if they are short, write
        # what is queued and read its WINDOW_UPDATEs.
        need = len(piece) + (0 if pad is None else pad + 1)
        while min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size) < need:
            if self.conn.max_outbound_frame_size < need:
                raise AssertionError(f"a DATA frame of {need} bytes is more than the client accepts")
            self.receive_until(lambda ev: isinstance(ev, h2.events.WindowUpdated), "a WINDOW_UPDATE")
        self._take()
        self.conn.send_data(stream_id, piece, end_stream=end_stream, pad_length=pad)
        self._take()

    def ping(self, payload: bytes) -> None:
        self._take()
        self.conn.ping(payload)
        self._take()

    def raw(self, data: bytes) -> None:
        """Frames h2 would not send (from a server) or must not know about (a GOAWAY after which
        the answer goes on); h2's state does not change."""
        self._take()
        self.out += data

    def flush(self, sizes: Sequence[int] = ()) -> None:
        """Write what is queued: in writes of ``sizes`` bytes, then the rest at once."""
        self._take()
        data = bytes(self.out)
        self.out.clear()
        if not data:
            return
        with self.changed:
            self.sent += data  # before the write: once the client has it, a test may look
        pos = 0
        for n in sizes:
            if pos >= len(data):
                break
            self.sock.sendall(data[pos : pos + n])
            pos += n
        if pos < len(data):
            self.sock.sendall(data[pos:])

    def hang_up(self) -> None:
        self.flush()
        self.sock.shutdown(socket.SHUT_RDWR)

    # --- for the test's thread

    def wait_for(self, wanted: Callable[[h2.events.Event], bool], what: str, count: int = 1) -> None:
        """Wait until the server's h2 has received ``count`` events that are ``wanted`` (the
        connection's thread records events as they arrive)."""
        with self.changed:
            if not self.changed.wait_for(lambda: sum(map(wanted, self.events)) >= count, TIMEOUT):
                raise AssertionError(f"the client never sent {what}; the server received {self.events}")

    def sent_frames(self) -> list[tuple[int, int, int, bytes]]:
        with self.changed:
            return parse_frames(bytes(self.sent))


class Server:
    """An HTTP/2 server on a unix socket; ``answer(peer, stream_id)`` answers each request."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.dir = Path(tempfile.mkdtemp(prefix="kf-", dir="/tmp"))  # short: sun_path is 107 bytes
        self.path = str(self.dir / "s.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.peers: list[Peer] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            peer = Peer(sock, self)
            self.peers.append(peer)
            thread = threading.Thread(target=peer.serve, daemon=True)
            self.threads.append(thread)
            thread.start()

    @property
    def peer(self) -> Peer:
        assert len(self.peers) == 1, f"{len(self.peers)} connections"
        return self.peers[0]

    def close(self) -> None:
        """Stop everything, then raise the first error of a connection's thread."""
        for s in [self.listener, *(p.sock for p in self.peers)]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
        self.listener.close()
        for thread in self.threads:
            thread.join(TIMEOUT)
        shutil.rmtree(self.dir, ignore_errors=True)
        for peer in self.peers:
            if peer.error is not None:
                raise peer.error

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(answer_with(b"unused"))
    try:
        yield s
    finally:
        s.close()


@contextlib.contextmanager
def connect(server: Server, max_message: int = MAX_MESSAGE) -> Iterator[UnaryConnection]:
    conn = UnaryConnection(server.path, TIMEOUT, max_message)
    try:
        yield conn
    finally:
        conn.close()


def call(conn: UnaryConnection) -> bytes:
    return conn.call(PATH, REQUEST, TIMEOUT)


def answer_with(message: bytes) -> Answer:
    """The plain answer: headers, one DATA frame, trailers, in one write."""

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid)
        peer.data(sid, grpc_body(message))
        peer.trailers(sid)
        peer.flush()

    return answer


def ping_ack(payload: bytes) -> Callable[[h2.events.Event], bool]:
    return lambda ev: isinstance(ev, h2.events.PingAckReceived) and ev.ping_data == payload


def message_of(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


# --- 1. the plain answer, many times on one connection


def test_plain_answers_on_one_connection_through_hpacks_dynamic_table(server: Server) -> None:
    # h2's encoder indexes the headers it sends. A response header with a 300-byte value that
    # changes per call, and a trailer that does too, keep adding entries: after about ten calls
    # the 4 KiB table is full and the oldest entries are evicted, so the client's decoder must
    # evict the same ones to stay in step.
    def answer(peer: Peer, sid: int) -> None:
        n = len(peer.requests)
        peer.headers(sid, [*OK_HEADERS, (b"x-call", b"%d-" % n + b"z" * 300)])
        peer.data(sid, grpc_body(b"answer %d" % n))
        peer.trailers(sid, extra=[(b"x-n", b"%d" % n)])
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        for n in range(1, 21):
            assert call(conn) == b"answer %d" % n
    peer = server.peer
    assert [(dict(h)[b":path"], body) for h, body in peer.requests] == [(PATH.encode(), grpc_body(REQUEST))] * 20
    # The check that this tests the dynamic table: the later header blocks refer to entries that
    # only the earlier blocks define, so a decoder without that state cannot read them.
    blocks = header_blocks(bytes(peer.sent))
    assert len(blocks) == 40
    with pytest.raises(hpack.HPACKDecodingError):
        hpack.Decoder().decode(blocks[-2])
    # ... and that the table evicted: the first calls' x-call entries are gone from it
    kept = [value for name, value in peer.conn.encoder.header_table.dynamic_entries if name == b"x-call"]
    assert 0 < len(kept) < 20


# --- 2. DATA in many small frames, many large frames, many writes


@pytest.mark.parametrize(
    ("size", "frames", "writes"),
    [
        pytest.param(3000, [0, *range(1, 51)], [], id="frames-of-0-to-50-bytes"),
        pytest.param(200_000, [MAX_FRAME], [], id="200KB-in-max-size-frames"),
        pytest.param(200_000, [MAX_FRAME], [1000] * 300, id="200KB-in-1000-byte-writes"),
        pytest.param(300, [7, 1, 0, 30], [1] * 5000, id="byte-by-byte-writes"),
    ],
)
def test_data_split_across_frames_and_writes(server: Server, size: int, frames: list[int], writes: list[int]) -> None:
    message = message_of(size)

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid)
        body, i = grpc_body(message), 0
        for n in cycle_until(frames, len(body)):  # frame sizes in turn, an empty DATA frame where 0
            peer.data_frame(sid, body[i : i + n])
            i += n
        peer.trailers(sid)
        peer.flush(writes)

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
    data_frames = [f for f in server.peer.sent_frames() if f[0] == DATA]
    assert len(data_frames) > 1
    if 0 in frames:
        assert any(not payload for *_, payload in data_frames), "no empty DATA frame was sent"


def cycle_until(sizes: list[int], total: int) -> Iterator[int]:
    """``sizes`` in turn until they add up to ``total`` (the last one cut short)."""
    done, i = 0, 0
    while done < total:
        n = min(sizes[i % len(sizes)], total - done)
        yield n
        done += n
        i += 1


# --- 3. padding, and priority fields in HEADERS


@pytest.mark.parametrize(
    ("data_pad", "style"),
    [
        pytest.param(0, None, id="data-pad-0"),
        pytest.param(1, None, id="data-pad-1"),
        pytest.param(255, None, id="data-pad-255"),
        pytest.param(None, HeaderStyle(pad=0), id="headers-pad-0"),
        pytest.param(None, HeaderStyle(pad=200), id="headers-pad-200"),
        pytest.param(None, HeaderStyle(priority=True), id="headers-priority"),
        pytest.param(17, HeaderStyle(pad=255, priority=True), id="all-padded-and-headers-prioritised"),
    ],
)
def test_padded_frames_and_headers_with_priority(server: Server, data_pad: int | None, style: HeaderStyle | None) -> None:
    message = message_of(40_000)

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid, style=style)
        peer.data(sid, grpc_body(message), size=MAX_FRAME - 256, pad=data_pad)
        peer.trailers(sid, style=style)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
        assert call(conn) == message  # and the connection is still in step
    frames = server.peer.sent_frames()
    if data_pad is not None:
        assert {f[1] & PADDED for f in frames if f[0] == DATA} == {PADDED}
    if style is not None:
        headers = [f for f in frames if f[0] == HEADERS]
        assert len(headers) == 4
        assert all(f[1] & PADDED for f in headers) == (style.pad is not None)
        assert all(f[1] & PRIORITY_FLAG for f in headers) == style.priority


# --- 4. header blocks split across HEADERS + CONTINUATION


@pytest.mark.parametrize("where", ["headers", "trailers"])
def test_a_header_block_larger_than_a_frame_comes_in_continuation_frames(server: Server, where: str) -> None:
    # h2 splits a block only when it exceeds the frame size: a 20 KB header makes it do so.
    big = [(b"x-big", b"v" * 20_000)]

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid, [*OK_HEADERS, *(big if where == "headers" else [])])
        peer.data(sid, grpc_body(b"after a big block"))
        peer.trailers(sid, extra=big if where == "trailers" else [])
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == b"after a big block"
        # Again: a 20 KB entry never fits the 4 KiB HPACK table, and adding it empties the table
        # (RFC 7541 4.4), which the client's decoder must do too to stay in step.
        assert call(conn) == b"after a big block"
    frames = server.peer.sent_frames()
    assert [f[0] for f in frames].count(CONTINUATION) >= 1, "h2 sent no CONTINUATION frame: this tests nothing"


@pytest.mark.parametrize(
    "style",
    [
        pytest.param(HeaderStyle(fragment=1), id="1-byte-fragments"),
        pytest.param(HeaderStyle(fragment=7), id="7-byte-fragments"),
        pytest.param(HeaderStyle(fragment=3, pad=9, priority=True), id="3-byte-fragments-after-padded-prioritised-headers"),
    ],
)
def test_header_blocks_cut_anywhere_across_continuation_frames(server: Server, style: HeaderStyle) -> None:
    # A cut may fall inside an HPACK field (even inside a Huffman string): the client must join
    # the fragments before decoding. The trailers-only error answer is cut the same way.
    def answer(peer: Peer, sid: int) -> None:
        if len(peer.requests) == 2:
            peer.headers(sid, [*OK_HEADERS, (b"grpc-status", b"5"), (b"grpc-message", b"no%20such%20pod")], end_stream=True, style=style)
        else:
            peer.headers(sid, [*OK_HEADERS, (b"x-request-id", b"%d-abcdefghij" % len(peer.requests))], style=style)
            peer.data(sid, grpc_body(b"cut"))
            peer.trailers(sid, extra=[(b"x-n", b"%d" % len(peer.requests))], style=style)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == b"cut"
        with pytest.raises(GrpcStatus) as info:
            call(conn)
        assert (info.value.code, info.value.message) == (5, "no such pod")
        assert call(conn) == b"cut"
    frames = server.peer.sent_frames()
    assert [f[0] for f in frames].count(CONTINUATION) >= [f[0] for f in frames].count(HEADERS)
    assert all(len(payload) <= (style.fragment or 0) for ftype, _, _, payload in frames if ftype == CONTINUATION)


# --- 5-7. control frames in the middle of an answer


@pytest.mark.parametrize("wait_for_ack", [False, True], ids=["answer-goes-on", "answer-waits-for-the-ack"])
def test_a_ping_mid_answer_is_acknowledged_with_its_payload(server: Server, wait_for_ack: bool) -> None:
    # With wait_for_ack the server holds the rest of the answer until the ACK arrives: a client
    # that sent its answers only after the call would never get its message.
    payload = b"\x00\xffping\x01\x80"
    message = message_of(5000)

    def answer(peer: Peer, sid: int) -> None:
        body = grpc_body(message)
        peer.headers(sid)
        peer.data(sid, body[:3])  # inside the 5-byte prefix
        peer.ping(payload)
        if wait_for_ack:
            peer.receive_until(ping_ack(payload), "the PING ACK")
        peer.data(sid, body[3:])
        peer.trailers(sid)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
        server.peer.wait_for(ping_ack(payload), "a PING ACK with the PING's payload")
        assert call(conn) == message


@pytest.mark.parametrize(
    "new_settings",
    [
        pytest.param({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 10}, id="max-concurrent-streams"),
        pytest.param({}, id="empty"),
        pytest.param(
            {
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
            },
            id="several",
        ),
    ],
)
def test_settings_mid_answer_are_acknowledged(server: Server, new_settings: dict[h2.settings.SettingCodes | int, int]) -> None:
    message = message_of(20_000)

    def answer(peer: Peer, sid: int) -> None:
        body = grpc_body(message)
        peer.headers(sid)
        peer.data(sid, body[:1000])
        if len(peer.requests) == 1:
            peer.conn.update_settings(new_settings)
        peer.data(sid, body[1000:])
        peer.trailers(sid)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
        # h2 sent its initial SETTINGS too: the second ACK is the one for the frame mid-answer
        peer = server.peer
        peer.wait_for(lambda ev: isinstance(ev, h2.events.SettingsAcknowledged), "a second SETTINGS ACK", count=2)
        assert sum(f[0] == SETTINGS and not f[1] & 1 for f in peer.sent_frames()) == 2
        assert call(conn) == message  # the new settings are in force now


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param("window-update-connection", id="window-update-connection"),
        pytest.param("window-update-stream", id="window-update-stream"),
        pytest.param("priority-this-stream", id="priority-this-stream"),
        pytest.param("priority-idle-stream", id="priority-idle-stream"),
        pytest.param("unknown-frame-type", id="unknown-frame-type"),
    ],
)
def test_window_update_priority_and_unknown_frames_mid_answer_are_ignored(server: Server, extra: str) -> None:
    message = message_of(3000)

    def answer(peer: Peer, sid: int) -> None:
        body = grpc_body(message)
        peer.headers(sid)
        peer.data(sid, body[:2])
        if extra == "window-update-connection":
            peer.conn.increment_flow_control_window(100_000)
        elif extra == "window-update-stream":
            peer.conn.increment_flow_control_window(100_000, stream_id=sid)
        elif extra == "priority-this-stream":
            peer.raw(frame(PRIORITY, 0, sid, struct.pack(">IB", 0, 31)))  # h2 lets no server send PRIORITY
        elif extra == "priority-idle-stream":
            peer.raw(frame(PRIORITY, 0, sid + 100, struct.pack(">IB", sid, 7)))
        else:  # RFC 9113 4.1: implementations MUST ignore frames of unknown types
            peer.raw(frame(0xFA, 0xFF, 0, b"extension"))
            peer.raw(frame(0xFB, 0x01, sid, b""))
        peer.data(sid, body[2:])
        peer.trailers(sid)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
        assert call(conn) == message
    wanted = {"priority-this-stream": PRIORITY, "priority-idle-stream": PRIORITY, "unknown-frame-type": 0xFA}.get(extra, WINDOW_UPDATE)
    assert any(f[0] == wanted for f in server.peer.sent_frames())


# --- 8. an error status


def test_a_trailers_only_error_is_a_grpc_status_and_the_connection_stays_usable(server: Server) -> None:
    def answer(peer: Peer, sid: int) -> None:
        if len(peer.requests) == 1:
            peer.headers(sid, [*OK_HEADERS, (b"grpc-status", b"7"), (b"grpc-message", b"100%25 refus%C3%A9")], end_stream=True)
        else:
            peer.headers(sid)
            peer.data(sid, grpc_body(b"fine now"))
            peer.trailers(sid)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        with pytest.raises(GrpcStatus) as info:
            call(conn)
        assert (info.value.code, info.value.name, info.value.message) == (7, "PERMISSION_DENIED", "100% refusé")
        assert call(conn) == b"fine now"
    assert [f[0] for f in server.peer.sent_frames()].count(HEADERS) == 3  # the error was one HEADERS frame


# --- 9-11. answers that are failures


def rst_stream(peer: Peer, sid: int) -> None:
    peer.headers(sid)
    peer.data(sid, grpc_body(b"never whole")[:8])
    peer.conn.reset_stream(sid, 7)  # REFUSED_STREAM


def goaway(peer: Peer, sid: int) -> None:
    # Last stream 0: the call's stream was not processed. Raw, so h2 (which would refuse to send
    # anything after its own GOAWAY) keeps reading the client; the socket stays open, so only
    # the GOAWAY can end the call.
    peer.raw(frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0) + b"shutting down"))


def hang_up_mid_answer(peer: Peer, sid: int) -> None:
    peer.headers(sid)
    peer.data(sid, grpc_body(b"never whole")[:8])
    peer.hang_up()


def http_503(peer: Peer, sid: int) -> None:
    # what a proxy in front of a dead backend answers: no gRPC at all
    peer.headers(sid, [(b":status", b"503"), (b"content-type", b"text/plain")])
    peer.data(sid, b"upstream connect error", end_stream=True)


def declared(size: int, payload: bytes) -> Answer:
    """A good-looking answer whose 5-byte prefix declares ``size`` bytes and whose DATA is ``payload``."""

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid)
        peer.data(sid, b"\0" + size.to_bytes(4, "big") + payload)
        peer.trailers(sid)

    return answer


def goaway_inside_a_header_block(peer: Peer, sid: int) -> None:
    # RFC 9113 6.10: nothing may come between HEADERS and its CONTINUATION; a GOAWAY there is
    # h2's protocol error to raise, not a shutdown to honour.
    peer.raw(frame(HEADERS, 0, sid, b"\x88") + frame(GOAWAY, 0, 0, struct.pack(">II", 2**31 - 1, 0)) + frame(CONTINUATION, END_HEADERS, sid, b""))


def cut_prefix(peer: Peer, sid: int) -> None:
    peer.headers(sid)
    peer.data(sid, b"\0\0\0")  # the stream ends inside the 5-byte prefix
    peer.trailers(sid)


@pytest.mark.parametrize(
    ("answer", "max_message", "error"),
    [
        pytest.param(rst_stream, MAX_MESSAGE, "reset", id="rst-stream"),
        pytest.param(goaway, MAX_MESSAGE, "GOAWAY", id="goaway"),
        pytest.param(goaway_inside_a_header_block, MAX_MESSAGE, "protocol error", id="goaway-inside-a-header-block"),
        pytest.param(hang_up_mid_answer, MAX_MESSAGE, "closed by the server", id="hang-up"),
        pytest.param(http_503, MAX_MESSAGE, "HTTP status 503", id="http-503"),
        pytest.param(declared(5000, b"x" * 5000), 1000, "larger than 1000 bytes", id="larger-than-max-sent"),
        pytest.param(declared(5000, b""), 1000, "larger than 1000 bytes", id="larger-than-max-declared-only"),
        pytest.param(declared(100, b"x" * 40), MAX_MESSAGE, None, id="fewer-bytes-than-declared"),
        pytest.param(declared(100, b"x" * 140), MAX_MESSAGE, None, id="more-bytes-than-declared"),
        pytest.param(cut_prefix, MAX_MESSAGE, None, id="ends-inside-the-prefix"),
    ],
)
def test_a_failed_answer_is_a_transport_error(server: Server, answer: Answer, max_message: int, error: str | None) -> None:
    def answer_and_flush(peer: Peer, sid: int) -> None:
        answer(peer, sid)
        peer.flush()

    server.answer = answer_and_flush
    with connect(server, max_message) as conn, pytest.raises(TransportError, match=error) as info:
        call(conn)
    assert not info.value.timed_out


@pytest.mark.parametrize("where", ["mid-answer", "after-the-answer-in-the-same-write", "mid-answer-written-byte-by-byte"])
def test_a_graceful_goaway_lets_the_call_in_flight_finish(server: Server, where: str) -> None:
    # A server shutting down gracefully (grpc-go's GracefulStop, as the kubelet does on restart)
    # sends GOAWAY with a last stream id at or above the streams it will still answer, then
    # answers them (RFC 9113 6.8). The call in flight gets its message; the next call must not
    # open a stream on the connection (this server, whose h2 never saw the raw GOAWAY, would
    # answer it).
    message = message_of(1000)

    def answer(peer: Peer, sid: int) -> None:
        body = grpc_body(message)
        peer.headers(sid)
        peer.data(sid, body[:10])
        if where.startswith("mid-answer"):
            peer.raw(frame(GOAWAY, 0, 0, struct.pack(">II", 2**31 - 1, 0) + b"graceful"))
        peer.data(sid, body[10:])
        peer.trailers(sid)
        if not where.startswith("mid-answer"):
            peer.raw(frame(GOAWAY, 0, 0, struct.pack(">II", sid, 0)))
        # byte by byte: the GOAWAY, taken out before h2 sees the bytes, arrives in pieces
        peer.flush([1] * 2000 if where.endswith("byte-by-byte") else [])

    server.answer = answer
    with connect(server) as conn:
        assert call(conn) == message
        with pytest.raises(TransportError):
            call(conn)


@pytest.mark.parametrize("status", [0, 8])  # an answer, and a trailers-only RESOURCE_EXHAUSTED
def test_a_reset_after_a_complete_answer_changes_nothing(server: Server, status: int) -> None:
    # grpc-go resets a stream whose request it had not read to the end when it writes the
    # status (RFC 9113 8.1 allows it), trailers and RST_STREAM(NO_ERROR) in one write: the
    # answer is whole and stands (a rate limit must stay a rate limit, not "unavailable").
    message = message_of(100)

    def answer(peer: Peer, sid: int) -> None:
        if status:
            peer.headers(sid, [*OK_HEADERS, (b"grpc-status", b"%d" % status), (b"grpc-message", b"slow down")], end_stream=True)
        else:
            peer.headers(sid)
            peer.data(sid, grpc_body(message))
            peer.trailers(sid)
        peer.raw(frame(RST_STREAM, 0, sid, struct.pack(">I", 0)))
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        for _ in range(2):
            if status:
                with pytest.raises(GrpcStatus, match="RESOURCE_EXHAUSTED: slow down"):
                    call(conn)
            else:
                assert call(conn) == message


def test_a_header_block_that_never_ends_is_refused_before_it_fills_memory(server: Server) -> None:
    # HEADERS without END_HEADERS, then CONTINUATION frames without end: refused once the block
    # passes h2's cap (64 CONTINUATION frames), long before the deadline; the server then hangs on.
    def answer(peer: Peer, sid: int) -> None:
        peer.raw(frame(HEADERS, 0, sid, b"\x88"))  # :status 200, and more to come
        for _ in range(64):  # 1 MiB
            peer.raw(frame(CONTINUATION, 0, sid, b"\x00" * MAX_FRAME))
        peer.flush()

    server.answer = answer
    with connect(server) as conn, pytest.raises(TransportError, match=r"(?i)too many continuation frames") as info:
        conn.call(PATH, REQUEST, 60)  # without the cap: "no answer within 60s"
    assert not info.value.timed_out


def test_the_kubelet_client_moves_to_a_new_connection_after_a_graceful_goaway(server: Server) -> None:
    # The same through PodResourcesClient: the List after a graceful GOAWAY is made on a new
    # connection at once, without a failed call in between.
    listed = api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(name="p", namespace="ns")]).SerializeToString()

    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid)
        peer.data(sid, grpc_body(listed))
        peer.trailers(sid)
        peer.raw(frame(GOAWAY, 0, 0, struct.pack(">II", sid, 0)))
        peer.flush()

    server.answer = answer
    with PodResourcesClient(server.path, timeout=TIMEOUT) as client:
        assert client.list().pods == (("ns", "p"),)
        assert client.list().pods == (("ns", "p"),)
    assert [len(p.requests) for p in server.peers] == [1, 1]


# --- 12. hostile peers: frame floods, a status no integer parser should be handed

# Each flood frame for the call's stream ``sid``; sent 200,000 times after the response's
# HEADERS (CONTINUATION: after HEADERS without END_HEADERS), then the server waits.
FLOODS: dict[str, Callable[[int], bytes]] = {
    "empty-data": lambda sid: frame(DATA, 0, sid, b""),
    "one-byte-data": lambda sid: frame(DATA, 0, sid, b"x"),
    "padding-only-data": lambda sid: frame(DATA, PADDED, sid, b"\x00"),
    "ping-ack": lambda sid: frame(PING, 1, 0, bytes(8)),
    "ping": lambda sid: frame(PING, 0, 0, bytes(8)),
    "settings": lambda sid: frame(SETTINGS, 0, 0, b""),
    "settings-ack": lambda sid: frame(SETTINGS, 1, 0, b""),
    "window-update": lambda sid: frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)),
    "priority": lambda sid: frame(PRIORITY, 0, sid, struct.pack(">IB", 0, 15)),
    "unknown": lambda sid: frame(0xFA, 0, 0, b""),
    "empty-continuation": lambda sid: frame(CONTINUATION, 0, sid, b""),
}


def flood(kind: str, count: int = 200_000) -> Answer:
    def answer(peer: Peer, sid: int) -> None:
        if kind == "empty-continuation":
            peer.raw(frame(HEADERS, 0, sid, b"\x88"))  # :status 200, and more to come
        else:
            peer.headers(sid)
            if kind.endswith("data"):
                peer.raw(frame(DATA, 0, sid, grpc_body(bytes(1000))[:5]))  # a prefix that promises 1,000 bytes
        peer.raw(FLOODS[kind](sid) * count)
        peer.flush()  # the client hangs up mid-write once it has had enough: the script ends here

    return answer


@pytest.mark.parametrize("kind", sorted(FLOODS))
def test_a_flood_of_frames_that_bring_no_answer_ends_the_call_early(server: Server, kind: str) -> None:
    # The deadline is long: the call must end on the count of frames, not spin through the
    # flood and then wait (without the cap: "no answer within 30s"). h2 would cut a header
    # block at 64 CONTINUATION frames, but the count sees the whole chunk first.
    server.answer = flood(kind)
    with connect(server) as conn, pytest.raises(TransportError, match="more than 1000 frames that carry little or no answer") as info:
        conn.call(PATH, REQUEST, 30)
    assert not info.value.timed_out


def test_after_a_flood_the_kubelet_client_answers_from_a_new_connection(server: Server) -> None:
    flooding = flood("ping-ack")
    listed = api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(name="p", namespace="ns")]).SerializeToString()

    def answer(peer: Peer, sid: int) -> None:
        if peer is server.peers[0]:
            flooding(peer, sid)
        else:
            answer_with(listed)(peer, sid)

    server.answer = answer
    with PodResourcesClient(server.path, timeout=30) as client:
        with pytest.raises(KubeletUnavailable, match="frame flood"):
            client.list()
        assert client.list().pods == (("ns", "p"),)
    assert len(server.peers) == 2


@pytest.mark.parametrize(
    "status",
    [pytest.param(b"1" * 5000, id="5000-digits"), pytest.param(b"0" * 11, id="11-zeros"), pytest.param(b"ok", id="not-a-number"), pytest.param(b"-1", id="negative")],
)
def test_a_malformed_grpc_status_is_internal_and_a_kubelet_error(server: Server, status: bytes) -> None:
    # int() of more than 4,300 digits raises ValueError (Python's limit on int/str conversion):
    # it escaped list(). grpc-go's client calls a malformed status INTERNAL; so do we.
    def answer(peer: Peer, sid: int) -> None:
        if len(peer.requests) % 2:
            peer.headers(sid, [*OK_HEADERS, (b"grpc-status", status)], end_stream=True)
        else:
            answer_with(api_pb2.ListPodResourcesResponse().SerializeToString())(peer, sid)
        peer.flush()

    server.answer = answer
    with connect(server) as conn:
        with pytest.raises(GrpcStatus, match="malformed grpc-status") as status_info:
            call(conn)
        assert status_info.value.name == "INTERNAL"
        call(conn)  # the connection is still good
    with PodResourcesClient(server.path, timeout=TIMEOUT) as client:
        with pytest.raises(KubeletError, match="INTERNAL: malformed grpc-status") as info:
            client.list()
        assert type(info.value) is KubeletError
        assert client.list().pods == ()


# --- 13. any legal framing of an answer


@dataclass
class Framing:
    message: bytes
    pieces: list[bytes]  # the DATA frames' payloads, in order (some may be empty)
    pads: list[int | None]  # each DATA frame's padding
    pings: dict[int, bytes] = field(default_factory=dict)  # before DATA frame i, a PING with these 8 bytes
    writes: list[int] = field(default_factory=list)  # sizes of the first socket writes
    style: HeaderStyle = HeaderStyle()


@st.composite
def framings(draw: st.DrawFn) -> Framing:
    message = message_of(draw(st.integers(0, 70_000)), draw(st.integers(0, 2**32 - 1)))
    body = grpc_body(message)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=30)))  # repeated cuts: empty frames
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        size = MAX_FRAME - 256  # room for padding
        pieces += [body[i : min(i + size, end)] for i in range(start, end, size)] or [b""]
    pads = draw(st.lists(st.none() | st.integers(0, 255), min_size=len(pieces), max_size=len(pieces)))
    payloads = draw(st.lists(st.binary(min_size=8, max_size=8), unique=True, max_size=4))
    pings = {draw(st.integers(0, len(pieces))): p for p in payloads}
    writes = draw(st.lists(st.integers(1, 20_000), max_size=40))
    style = HeaderStyle(pad=draw(st.none() | st.integers(0, 255)), priority=draw(st.booleans()), fragment=draw(st.none() | st.integers(1, 64)))
    return Framing(message, pieces, pads, pings, writes, style)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(framings())
def test_any_legal_framing_of_an_answer_returns_the_message(f: Framing) -> None:
    def answer(peer: Peer, sid: int) -> None:
        peer.headers(sid, style=f.style)
        for i, (piece, pad) in enumerate(zip(f.pieces, f.pads, strict=True)):
            if i in f.pings:
                peer.ping(f.pings[i])
            peer.data_frame(sid, piece, pad=pad)
        if len(f.pieces) in f.pings:
            peer.ping(f.pings[len(f.pieces)])
        peer.trailers(sid, style=f.style)
        peer.flush(f.writes)

    # A server of its own for each example: nothing carries over from one to the next.
    with Server(answer) as server, connect(server) as conn:
        assert call(conn) == f.message
        for payload in f.pings.values():
            server.peer.wait_for(ping_ack(payload), f"a PING ACK with {payload!r}")
