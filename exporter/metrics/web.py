"""A small HTTP/1.1 server on one asyncio event loop, bounded by construction.

HTTP/1.1 itself (request heads in, response heads out, keep-alive and pipelining) is python-hyper's
``h11``, a sans-IO state machine: it decides what RFC 9112 says, and this module adds the few
refusals it leaves to the server (below). What this module owns is what no Python server offers:
the connection manager (a ceiling that never drops a request in flight, per-phase timeouts, a
bounded TLS pump) and a CPU governor. Why not http.server: a thread per connection, no idle or
read timeout, 100 headers of 64 KiB each. Why not aiohttp or uvicorn: their per-connection
buffers, handler tasks and keep-alive would still need bounding here, and neither has a ceiling
that keeps a scraper's request when a flood fills it.

The bounds, all in ``Limits``:
- at most ``max_connections`` connections, counting those closed but still draining (kept below
  the open-file limit). At the ceiling a newcomer takes the place of an idle connection: the
  oldest that never sent a byte, else the oldest whose request head has been arriving for over
  ``SLOW_HEAD`` seconds (a slow sender), else the oldest idle keep-alive. A connection whose
  request is in flight (bytes received, in our buffer or the kernel's) is never evicted. With
  nothing to evict, a newcomer that sent a request waits, accepted but without a transport
  (``PARKED_MAX`` of them, then the kernel's queue holds the rest), and keep-alive answers carry
  ``Connection: close`` so slots go round; a newcomer that sent nothing while connections queue
  is closed at once;
- a connection must send the first byte of a request within ``idle_timeout`` and the whole head
  within ``header_timeout`` after that (408); a TLS handshake must finish within
  ``tls_handshake_timeout``; each wait for a response to drain within ``write_timeout``;
- the request head is at most ``max_head_bytes`` (h11's ``max_incomplete_event_size``) and
  ``max_headers`` lines (431); bodies are never read (the connection is closed after the answer);
  a head h11 would accept but RFC 9112 lets a server refuse (bare LF, obs-fold, a repeated
  Content-Length) is refused with 400, because a proxy in front may read it differently;
- one request at a time per connection, ``max_requests_per_connection`` in all;
- per connection at most ``READ_CHUNK`` x 2 bytes read ahead and ``WRITE_CHUNK`` bytes of a
  response buffered (the next slice is written when the last has reached the kernel), so a
  client that does not read holds no more than that, and never a slot another client needs;
- TLS runs through ``ssl.SSLObject`` over memory BIOs (OpenSSL's own buffers, released when
  idle), not asyncio's SSL transport, whose 256 KiB buffer per connection and wait for the
  peer's close_notify kept closed connections' memory alive for seconds;
- the event loop thread's CPU is held to ``cpu_share`` of one core by a governor that makes the
  loop sleep when it has used more, so a flood cannot take the CPU from device reads.
Everything runs on one thread (plus one per probe check and one for bcrypt, see server.py).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import resource
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11
import structlog

from ..text import one_line

log = structlog.get_logger(__name__)

ACCEPT_BATCH = 64
LISTEN_BACKLOG = 4096  # capped by net.core.somaxconn
READ_CHUNK = 16 * 1024
# The most response bytes buffered per connection: a response is written in slices of this size,
# each once the previous one has gone to the kernel. A client that does not read therefore holds
# at most one slice of our memory (plus the kernel's socket buffer, which is not ours), and no
# slot: there is no pool of writers for slow readers to exhaust.
WRITE_CHUNK = 64 * 1024
PARKED_MAX = ACCEPT_BATCH  # accepted, waiting for a connection slot (a socket each, nothing more)
SLOW_HEAD = 1.0  # a request head (or TLS handshake) still arriving after this long is a slow sender's
SERVER = "dra-gpu-exporter"  # no version: it only helps someone pick an exploit

# Connection phases. Only IDLE (nothing received since the connection was made or last answered)
# and a HEAD that has been arriving for over SLOW_HEAD can be evicted.
IDLE, HEAD, BUSY, CLOSING = "idle", "head", "busy", "closing"


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    idle_timeout: float = 5.0  # before the first byte of a request (new or keep-alive)
    header_timeout: float = 5.0  # from the first byte to the end of the request head
    write_timeout: float = 10.0  # for a response to drain to the client
    tls_handshake_timeout: float = 5.0
    max_head_bytes: int = 8192  # request line + headers
    max_headers: int = 64
    max_requests_per_connection: int = 1000
    cpu_share: float = 0.5  # of one core, for the event-loop thread


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    peer: str
    peer_cert: dict[str, Any] | None = None
    peer_ip: str = ""  # the peer's address without the port

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False


Handler = Callable[[Request], Awaitable[Response]]
# A verified client certificate (ssl's getpeercert() form) -> None to accept, else why it is refused.
PeerCheck = Callable[[dict[str, Any]], str | None]


class RateLimitedLog:
    """At most one line per ``every`` seconds per kind of event; the line says how many of that
    kind were not logged since. Client misbehaviour is the client's problem: it must not be
    able to fill the log."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def __call__(self, event: str, **kw: object) -> None:
        now = time.monotonic()
        if now - self._last.get(event, -1e9) < self.every:
            self._dropped[event] = self._dropped.get(event, 0) + 1
            return
        self._last[event] = now
        dropped = self._dropped.pop(event, 0)
        log.warning(event, **kw, **({"similar_not_logged": dropped} if dropped else {}))


def effective_connection_limit(wanted: int) -> int:
    """``wanted``, kept well below the open-file limit: the process needs descriptors for its
    own work (device library, gRPC, API watches), and accept() hitting EMFILE stalls the loop."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft - 256 - ACCEPT_BATCH - PARKED_MAX, soft // 2))


def bind(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening socket; ``::`` listens on IPv6 and IPv4 (dual stack) where the host allows."""
    try:
        if host in ("::", "") and socket.has_dualstack_ipv6():
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=backlog, reuse_port=False,
                                        dualstack_ipv6=True)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        return socket.create_server(addr, family=family, backlog=backlog)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class _Refused(Exception):
    """A request refused before the handler: answered with ``status`` and closed."""

    def __init__(self, status: int, reason: str, method: str = "GET") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.method = method  # the request's, when its line was read (a HEAD gets no body)


class _TLS:
    """One connection's TLS state: OpenSSL through ssl.SSLObject, bytes in and out by hand."""

    __slots__ = ("done", "error", "incoming", "obj", "outgoing")

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.done = False  # handshake complete
        self.error: BaseException | None = None


class _Conn(asyncio.Protocol):
    """One accepted connection: its transport, read-ahead, TLS state and serving task."""

    __slots__ = (
        "abort_handle", "closing", "eof", "id", "inbuf", "lost", "peer", "peer_ip", "phase", "readable",
        "reading_paused", "served", "since", "sock", "srv", "task", "tls", "transport", "writable",
    )

    def __init__(self, server: HttpServer, cid: int, sock: socket.socket, has_data: bool) -> None:
        self.srv = server
        self.id = cid
        self.sock = sock  # kept to peek at what the kernel holds before evicting
        self.transport: asyncio.Transport | None = None
        self.phase = HEAD if has_data else IDLE
        self.since = time.monotonic()
        self.served = 0
        self.peer = ""
        self.peer_ip = ""
        self.inbuf = bytearray()
        self.eof = False
        self.lost = False
        self.closing = False
        self.reading_paused = False
        # Flow control, as uvicorn's: set when there is something to read (or the end), and
        # while the transport takes writes.
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.tls: _TLS | None = None
        self.task: asyncio.Task[None] | None = None
        self.abort_handle: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream socket's transport always is
        self.transport = transport
        try:
            transport.max_size = READ_CHUNK  # type: ignore[attr-defined]  # bounded reads
        except AttributeError:
            pass
        # Paused as soon as anything is buffered, resumed once all of it reached the kernel: one
        # slice of a response at a time (see WRITE_CHUNK).
        transport.set_write_buffer_limits(high=0)
        self.peer, self.peer_ip = _peer(transport.get_extra_info("peername"))

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            self.phase, self.since = HEAD, time.monotonic()
        tls = self.tls
        if tls is None:
            self.inbuf += data
        else:
            self._tls_in(tls, data)
        if len(self.inbuf) >= READ_CHUNK and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        self.readable.set()

    def eof_received(self) -> bool:
        self.eof = True
        self.readable.set()
        return True  # half-closed: the answer can still be written

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.abort_handle is not None:
            self.abort_handle.cancel()
            self.abort_handle = None
        self.readable.set()
        self.writable.set()
        if self.task is not None and not self.task.done() and not self.closing:
            self.task.cancel()  # the client is gone: stop waiting for a bcrypt check or a probe
        self.tls = None
        self.transport = None
        self.srv._release(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- reading -------------------------------------------------------------------------------
    async def _wait(self) -> None:
        self.readable.clear()
        await self.readable.wait()

    async def _read(self) -> bytes:
        """What has arrived (at least one byte), or b"" at the end of the stream."""
        while not self.inbuf:
            if self.eof or self.lost:
                return b""
            await self._wait()
        data = bytes(self.inbuf)
        self.inbuf.clear()
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return data

    # -- TLS -------------------------------------------------------------------------------------
    def _tls_in(self, tls: _TLS, data: bytes) -> None:
        tls.incoming.write(data)
        try:
            if not tls.done:
                tls.obj.do_handshake()
                tls.done = True
            while chunk := tls.obj.read(READ_CHUNK):
                self.inbuf += chunk
            self.eof = True  # read() returns b"" at a clean end
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            self.eof = True  # the client's close_notify
        except (ssl.SSLError, ValueError) as e:
            tls.error = e
            self.eof = True
        finally:
            self._tls_out(tls)

    def _tls_out(self, tls: _TLS) -> None:
        out = tls.outgoing.read()
        if out and self.transport is not None and not self.lost:
            self.transport.write(out)

    async def _handshake(self, ctx: ssl.SSLContext) -> tuple[bool, dict[str, Any] | None]:
        """Run the TLS handshake (fed by data_received): (whether it succeeded, the client's
        certificate or None). A failure is counted and logged here."""
        srv = self.srv
        tls = self.tls = _TLS(ctx)
        if self.inbuf:  # bytes that arrived before TLS was set up: the ClientHello
            early = bytes(self.inbuf)
            self.inbuf.clear()
            self._tls_in(tls, early)
        try:
            async with asyncio.timeout(srv.limits.tls_handshake_timeout):
                while not tls.done and tls.error is None and not self.eof and not self.lost:
                    await self._wait()
        except TimeoutError:
            srv._timeout("tls_handshake")
            return False, None
        if not tls.done:
            if self.closing:
                return False, None  # evicted, or the server is stopping: not the client's failure
            if tls.error is not None:
                srv.client_log("http_tls_handshake_failed", peer=self.peer, error=_short(tls.error))
            srv.tls_failed += 1
            return False, None
        cert = tls.obj.getpeercert() or None
        if srv.peer_check is not None and (problem := srv.peer_check(cert or {})) is not None:
            # exporter-toolkit refuses such a certificate inside the handshake; OpenSSL through
            # Python's ssl has no hook there, so the connection is closed before a request is read
            srv.client_log("http_client_certificate_refused", peer=self.peer, reason=problem)
            srv.tls_failed += 1
            return False, None
        return True, cert

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, data: bytes | memoryview) -> None:
        if self.lost or self.transport is None:
            raise ConnectionError("connection lost")
        tls = self.tls
        if tls is None:
            self.transport.write(data)
        else:
            tls.obj.write(data)
            self._tls_out(tls)

    async def _drain(self) -> None:
        if not self.writable.is_set():
            try:
                async with asyncio.timeout(self.srv.limits.write_timeout):
                    await self.writable.wait()
            except TimeoutError:
                self.srv._timeout("write")
                if self.transport is not None:
                    self.transport.abort()
                raise ConnectionError("write timed out") from None
        if self.lost:
            raise ConnectionError("connection lost")

    # -- the connection's task -------------------------------------------------------------------
    async def run(self) -> None:
        srv = self.srv
        try:
            try:
                await srv.loop.connect_accepted_socket(lambda: self, sock=self.sock)
            except (OSError, asyncio.CancelledError):
                # evicted or stopped before its transport existed (a transport that did exist
                # holds this same socket object, so closing it again is a no-op)
                self.sock.close()
                return
            peer_cert = None
            if srv.tls is not None:
                ok, peer_cert = await self._handshake(srv.tls())
                if not ok:
                    return
            await self._requests(peer_cert)
        except (ConnectionError, OSError, ssl.SSLError):
            pass  # the client went away: nothing to say
        except asyncio.CancelledError:
            pass  # the connection was lost or evicted, or the server is stopping
        except Exception as e:  # a bug in a handler must not end the server
            srv.client_log("http_handler_error", peer=self.peer, error=_short(e))
        finally:
            self.close()

    async def _requests(self, peer_cert: dict[str, Any] | None) -> None:
        srv, lim = self.srv, self.srv.limits
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_head_bytes)
        for n in range(lim.max_requests_per_connection):
            if n:
                h.start_next_cycle()
            try:
                req = await self._next_request(h, peer_cert)
            except _Refused as r:
                srv.client_log("http_request_rejected", peer=self.peer, reason=r.reason)
                await self._respond(h, Response(r.status, (r.reason + "\n").encode(),
                                                [("Content-Type", "text/plain; charset=utf-8")]), r.method, close=True)
                return
            if req is None:
                return
            self.phase = BUSY
            # No body is ever read: a request that has one (or claims one) ends the connection,
            # since what follows its head is not the next request (and with both Content-Length
            # and Transfer-Encoding, RFC 9112 section 6.1 asks for the close whatever is read).
            close = n == lim.max_requests_per_connection - 1
            if "transfer-encoding" in req.headers or req.headers.get("content-length", "0") != "0":
                close = True
            else:
                try:
                    close = close or not isinstance(h.next_event(), h11.EndOfMessage)
                except h11.RemoteProtocolError:
                    close = True
            resp = await srv.handler(req)
            close = close or resp.close or srv.contended()
            await self._respond(h, resp, req.method, close=close)
            self.served += 1
            if close or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                return

    async def _next_request(self, h: h11.Connection, peer_cert: dict[str, Any] | None) -> Request | None:
        """The next request head, parsed by h11 and checked; None when the client closed or
        went idle. Raises _Refused for a head to refuse."""
        srv, lim = self.srv, self.srv.limits
        head = bytearray(h.trailing_data[0])  # the raw head so far (a pipelined request's start)
        arriving = head or self.inbuf or (self.tls is not None and self.tls.incoming.pending)
        self.phase, self.since = (HEAD if arriving else IDLE), time.monotonic()
        deadline: float | None = srv.loop.time() + lim.header_timeout if head else None
        while True:
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as e:
                if e.error_status_hint == 431:
                    raise _Refused(431, f"request head over {lim.max_head_bytes} bytes") from None
                raise _Refused(e.error_status_hint, _short_text(str(e))) from None
            if isinstance(event, h11.Request):
                break
            if isinstance(event, h11.ConnectionClosed):
                return None
            # NEED_DATA (nothing else can come before a request)
            if deadline is None:
                try:
                    async with asyncio.timeout(lim.idle_timeout):
                        data = await self._read()
                except TimeoutError:
                    srv._timeout("idle")
                    return None
                deadline = srv.loop.time() + lim.header_timeout
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await self._read()
                except TimeoutError:
                    srv._timeout("header")
                    raise _Refused(408, "request head not received in time") from None
            if not data and not head:
                return None  # closed between requests
            head += data
            h.receive_data(data)
        raw = bytes(head[: len(head) - len(h.trailing_data[0])])
        method = event.method.decode("latin-1")  # case-sensitive (RFC 9110 section 9.1): "get" is not GET
        if len(raw) > lim.max_head_bytes:
            raise _Refused(431, f"request head over {lim.max_head_bytes} bytes", method)
        if (problem := head_problem(raw)) is not None:
            raise _Refused(400, problem, method)
        if event.http_version not in (b"1.1", b"1.0"):
            raise _Refused(505, "HTTP/1.0 and HTTP/1.1 only", method)
        if len(event.headers) > lim.max_headers:
            raise _Refused(431, f"more than {lim.max_headers} request headers", method)
        headers: dict[str, str] = {}
        for name, value in event.headers:
            k, v = name.decode("latin-1"), value.decode("latin-1")
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        return Request(
            method, event.target.decode("latin-1"), "HTTP/" + event.http_version.decode("latin-1"),
            headers, self.peer, peer_cert, self.peer_ip,
        )

    async def _respond(self, h: h11.Connection, resp: Response, method: str, close: bool) -> None:
        self.srv._count(resp.status)
        body = resp.body
        headers = [("Server", SERVER), ("Content-Length", str(len(body))), *resp.headers]
        if close:
            headers.append(("Connection", "close"))
        try:
            status = HTTPStatus(resp.status).phrase
        except ValueError:
            status = "Unknown"
        try:
            head = h.send(h11.Response(status_code=resp.status, headers=headers, reason=status.encode()))
            if method == "HEAD" or not body:
                body = b""
            else:
                h.send_with_data_passthrough(h11.Data(data=body))  # h11 checks it against Content-Length
            h.send(h11.EndOfMessage())
        except h11.LocalProtocolError as e:  # a state h11 refuses to answer in: say nothing more
            self.srv.client_log("http_response_refused", peer=self.peer, error=_short(e))
            raise ConnectionError("no response possible") from None
        assert head is not None
        if len(body) <= WRITE_CHUNK:
            self._write(head + body)
            await self._drain()
            return
        self._write(head)
        view = memoryview(body)
        for i in range(0, len(body), WRITE_CHUNK):
            await self._drain()
            self._write(view[i : i + WRITE_CHUNK])
        await self._drain()

    def close(self) -> None:
        """Close from our side: the slot stays taken until the transport has drained what is
        buffered (at most ``write_timeout``, then it is cut), but nothing else is held."""
        if self.closing:
            return
        self.closing = True
        self.phase = CLOSING
        tls, transport = self.tls, self.transport
        self.tls = None
        self.inbuf = bytearray()
        if transport is None or self.lost:
            self.srv._release(self)
            return
        if tls is not None and tls.done:
            try:
                tls.obj.unwrap()  # writes our close_notify; the client's is not waited for
            except (ssl.SSLError, ValueError, OSError):
                pass
            out = tls.outgoing.read()
            if out:
                transport.write(out)
        if transport.get_write_buffer_size():
            self.abort_handle = self.srv.loop.call_later(self.srv.limits.write_timeout, transport.abort)
        transport.close()

    def abort(self) -> None:
        self.closing = True
        self.phase = CLOSING
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # its transport is not made yet: run() closes the socket


def head_problem(raw: bytes) -> str | None:
    """What RFC 9112 lets a server refuse and h11 accepts: a bare LF as a line end (section 2.2),
    obs-fold (section 5.2) and a repeated Content-Length, as two fields or as a list in one
    (RFC 9110 section 8.6). h11 itself
    refuses bare CR, NUL, TAB or spaces in a field name and conflicting lengths. A proxy in
    front may read any of these differently from h11, which is how requests are smuggled."""
    lf = raw.count(b"\n")
    if raw.count(b"\r\n") != lf:
        return "bare LF in the request head"
    if raw.count(b"\r") != lf:
        return "bare CR in the request head"
    if b"\n " in raw or b"\n\t" in raw:
        return "obsolete line folding in the request head"
    lower = raw.lower()
    if (at := lower.find(b"\ncontent-length:")) >= 0:
        if lower.find(b"\ncontent-length:", at + 1) >= 0:
            return "more than one Content-Length"
        if not raw[at + 16 : raw.index(b"\r\n", at + 1)].strip(b" \t").isdigit():
            return "Content-Length is not one number"  # "5, 5" is a repeated one, merged
    return None


class HttpServer:
    """Serves ``handler`` on a socket from one event-loop thread."""

    def __init__(self, sock: socket.socket, handler: Handler, limits: Limits = Limits(),
                 tls: Callable[[], ssl.SSLContext] | None = None, peer_check: PeerCheck | None = None) -> None:
        self.sock = sock
        self.handler = handler
        self.limits = limits
        self.max_connections = effective_connection_limit(limits.max_connections)
        self.tls = tls
        self.peer_check = peer_check
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self.client_log = RateLimitedLog()
        self._conns: dict[int, _Conn] = {}
        self._parked: collections.deque[tuple[socket.socket, bool]] = collections.deque()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._behind = False  # the last accept batch was full: connections are queueing
        self._accepting = False
        self._stopping = False
        # The CPU governor ticks (every 20 ms) only while there is something to govern: an idle
        # loop woken 50 times a second was the agent's largest idle cost (~1 % of a core on an
        # H100 node, measured with bench/profile_agent.py).
        self._governing = False
        # counters (read by other threads for self-metrics; ints under the GIL)
        self.refused = 0
        self.evicted = 0
        self.tls_failed = 0
        self.timed_out: dict[str, int] = {}
        self.requests: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def open_server() -> None:
                # Our own accept loop (not loop.create_server): at the ceiling it decides per
                # connection, for the price of accept + peek, before any transport exists. The
                # kernel's queue in front is long (as Go servers make it), so a burst waits there
                # instead of being dropped half-open; ACCEPT_BATCH bounds the descriptors
                # accepted per loop iteration.
                self.sock.setblocking(False)
                self.sock.listen(LISTEN_BACKLOG)
                self._resume_accepting()
                started.set()

            self.loop.run_until_complete(open_server())
            self.loop.run_forever()
            # stopped: close what is left, then the loop
            self._stopping = True
            for c in list(self._conns.values()):
                c.abort()
            while self._parked:
                self._parked.popleft()[0].close()
            for _ in range(5):  # a task's cleanup may start another (not while stopping, but cheap to be sure)
                if not (tasks := asyncio.all_tasks(self.loop)):
                    break
                for t in tasks:
                    t.cancel()
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(asyncio.sleep(0))  # let the transports' closes run
            self.loop.close()

        self._thread = threading.Thread(target=run, name="http", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("HTTP server did not start")

    def stop(self) -> None:
        if self._thread is None:
            self.sock.close()
            return

        def halt() -> None:
            self._pause_accepting()
            self.loop.stop()

        self.loop.call_soon_threadsafe(halt)
        self._thread.join(timeout=5)
        self._thread = None
        self.sock.close()

    @property
    def connections_open(self) -> int:
        return len(self._conns)

    def contended(self) -> bool:
        """Connections are waiting for a slot: a keep-alive connection gives its slot up after
        the answer in hand, so slots go round instead of staying with whoever holds them."""
        return bool(self._parked)

    # -- accepting ---------------------------------------------------------------------------
    def _pause_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            self.loop.remove_reader(self.sock.fileno())

    def _resume_accepting(self) -> None:
        if not self._accepting and not self._stopping:
            self._accepting = True
            self.loop.add_reader(self.sock.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        if not self._governing:
            self._governing = True
            self.loop.call_soon(self._govern, time.thread_time(), time.monotonic())
        n = 0
        for n in range(1, ACCEPT_BATCH + 1):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                n -= 1
                break
            except OSError as e:  # out of descriptors or buffers: pause accepting, do not spin
                self.client_log("http_accept_failed", error=_short(e))
                self._pause_accepting()
                self.loop.call_later(0.1, self._resume_accepting)
                return
            conn.setblocking(False)
            self._place(conn)
            if not self._accepting:
                break  # the waiting line is full: the kernel's queue holds the rest
        self._behind = n >= ACCEPT_BATCH

    def _place(self, conn: socket.socket) -> None:
        if len(self._conns) < self.max_connections and not self._parked:
            self._admit(conn, False)
            return
        has_data = _has_data(conn)
        if not has_data and self._behind:
            # Full, and connections queue in the kernel: one that waited in the queue and still
            # sent nothing is an idle one (a scraper's request would be there by now). Closing it
            # costs microseconds; admitting it would cost a transport, a task and an eviction.
            conn.close()
            self.refused += 1
            return
        victim = self._victim() if len(self._conns) >= self.max_connections else None
        if victim is not None:
            self._evict(victim)
            self._admit(conn, has_data)
        elif len(self._parked) < PARKED_MAX:
            self._parked.append((conn, has_data))
            if len(self._parked) >= PARKED_MAX:
                self._pause_accepting()
        else:  # not reached: accepting pauses when the line is full
            conn.close()
            self.refused += 1

    def _victim(self) -> _Conn | None:
        """The connection to close for a newcomer at the ceiling: idle ones (never used first,
        then slow senders, then idle keep-alive), oldest first; never one with request bytes
        received, in our buffer or still in the kernel's."""
        now = time.monotonic()
        for _ in range(8):
            best: _Conn | None = None
            best_key = (3, 0.0)
            for c in self._conns.values():
                if c.closing:
                    continue
                if c.phase == IDLE:
                    rank = 0 if c.served == 0 else 2
                elif c.phase == HEAD and now - c.since >= SLOW_HEAD:
                    rank = 1
                else:
                    continue
                key = (rank, c.since)
                if key < best_key:
                    best, best_key = c, key
            if best is None:
                return None
            if best.phase == IDLE and _has_data(best.sock):
                best.phase, best.since = HEAD, now  # its request is arriving: not idle
                continue
            return best
        return None

    def _evict(self, victim: _Conn) -> None:
        self._conns.pop(victim.id, None)
        victim.abort()
        self.evicted += 1

    def _admit_parked(self) -> None:
        """Give a waiting newcomer the place of a connection that has become evictable since
        (a slow sender past SLOW_HEAD): run from the governor's tick while any wait."""
        while self._parked and len(self._conns) >= self.max_connections and (victim := self._victim()) is not None:
            self._evict(victim)
            conn, has_data = self._parked.popleft()
            self._admit(conn, has_data)
        if len(self._parked) < PARKED_MAX and not self._stopping:
            self._resume_accepting()

    def _admit(self, conn: socket.socket, has_data: bool) -> None:
        if self._stopping:
            conn.close()
            return
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        c = _Conn(self, next(self._ids), conn, has_data)
        self._conns[c.id] = c
        c.task = self.loop.create_task(c.run())

    def _release(self, c: _Conn) -> None:
        """``c`` is gone (its transport lost, or it never got one): free its slot."""
        if self._conns.pop(c.id, None) is None:
            return
        while self._parked and len(self._conns) < self.max_connections and not self._stopping:
            conn, has_data = self._parked.popleft()
            self._admit(conn, has_data)
        if len(self._parked) < PARKED_MAX and not self._stopping and self._thread is not None:
            self._resume_accepting()

    # -- bounds ------------------------------------------------------------------------------
    def _govern(self, cpu0: float, wall0: float) -> None:
        """Hold the loop thread to ``cpu_share`` of a core: after a busy stretch, sleep (which
        releases the GIL to the device and event threads) until the average is back under."""
        cpu, wall = time.thread_time(), time.monotonic()
        used, share = cpu - cpu0, self.limits.cpu_share
        if share < 1.0 and used > share * (wall - wall0):
            time.sleep(min(0.25, used / share - (wall - wall0)))
            cpu, wall = time.thread_time(), time.monotonic()
        if wall - wall0 > 1.0 or used <= 0:
            cpu0, wall0 = cpu, wall
        if self._stopping:
            self._governing = False
            return
        if self._parked:
            self._admit_parked()
        if not self._conns and not self._behind and not self._parked:
            self._governing = False  # idle: the next accept starts it again
            return
        self.loop.call_later(0.02, self._govern, cpu0, wall0)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # asyncio would log these with a traceback (accept() out of descriptors, a transport
        # error); one rate-limited line is enough, and nothing here may stop the loop.
        exc = context.get("exception")
        self.client_log("http_loop_error", message=context.get("message"), error=repr(exc) if exc else None)

    def _timeout(self, phase: str) -> None:
        self.timed_out[phase] = self.timed_out.get(phase, 0) + 1

    def _count(self, status: int) -> None:
        k = str(status)
        self.requests[k] = self.requests.get(k, 0) + 1


def _has_data(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False  # reset already


def _peer(p: object) -> tuple[str, str]:
    """("host:port" as logged, the host alone) of a peername."""
    if isinstance(p, tuple) and len(p) >= 2:
        host = str(p[0])
        return (f"[{host}]:{p[1]}" if ":" in host else f"{host}:{p[1]}"), host
    return str(p), str(p)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(e, limit=200)}"


def _short_text(s: str) -> str:
    return s if len(s) <= 200 else s[:200] + "..."
