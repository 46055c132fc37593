"""A small HTTP/1.1 server on one asyncio event loop, bounded by construction.

Why not http.server: it spends a thread per connection, with no idle or read timeout, and
accepts 100 headers of 64 KiB each; a few thousand idle connections or a few dozen large
headers exhausted the agent's threads, file descriptors and memory. Why not aiohttp: it is
a large dependency whose limits (per-connection buffers, handler tasks, keep-alive) would
still need tuning and checking here; the job is to copy cached bytes out, which asyncio's
streams do in a few hundred lines that this module can bound completely.

The bounds, all in ``Limits``:
- at most ``max_connections`` open connections (kept below the open-file limit). At the
  ceiling, a new connection makes a connection that is waiting for a request give way: the
  oldest that never completed one (an idle or slow-header client: the cheapest to lose, and
  exactly what such an attack consists of), else the oldest idle keep-alive; with none to
  evict, the new one is closed at once;
- a connection must send the first byte of a request within ``idle_timeout`` and the whole
  request head within ``header_timeout`` after that; a response must drain within
  ``write_timeout``; a TLS handshake must finish within ``tls_handshake_timeout``;
- the request head is at most ``max_head_bytes`` bytes and ``max_headers`` lines; request
  bodies are never read (the connection is closed after the answer instead);
- one request at a time per connection, ``max_requests_per_connection`` in all;
- per-connection buffers: reads of ``READ_CHUNK`` bytes into a buffer paused at twice the
  head limit, writes in ``WRITE_CHUNK`` slices each drained before the next;
- the event loop thread's CPU is held to ``cpu_share`` of one core by a governor that makes
  the loop sleep when it has used more, so a flood cannot take the CPU from device reads.
Everything runs on one thread (plus one per probe check and one for bcrypt, see server.py);
memory and threads stay flat whatever clients do.
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

ACCEPT_BATCH = 64
LISTEN_BACKLOG = 4096  # capped by net.core.somaxconn
READ_CHUNK = 16 * 1024
# Responses up to SMALL_BODY (probes, gzipped metrics: what Prometheus asks for) are written
# at once. Larger ones (uncompressed /metrics) are written in WRITE_CHUNK slices by at most
# LARGE_WRITERS connections at a time, so clients that do not read hold at most
# max_connections x SMALL_BODY + LARGE_WRITERS x 2 x WRITE_CHUNK bytes of our memory, until
# the write timeout cuts them off. (64 KiB slices were measurably slower: more loop wake-ups.)
SMALL_BODY = 64 * 1024
WRITE_CHUNK = 256 * 1024
LARGE_WRITERS = 16
SERVER = "dra-gpu-exporter"  # no version: it only helps someone pick an exploit
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


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


class _Conn:
    __slots__ = ("id", "served", "since", "transport", "waiting")

    def __init__(self, cid: int, transport: asyncio.WriteTransport) -> None:
        self.id = cid
        self.transport = transport
        self.waiting = True  # waiting for (or reading) a request head: evictable
        self.since = time.monotonic()
        self.served = 0  # requests answered: a scraper's keep-alive connection gives way last


def effective_connection_limit(wanted: int) -> int:
    """``wanted``, kept well below the open-file limit: the process needs descriptors for its
    own work (device library, gRPC, API watches), and accept() hitting EMFILE stalls the loop."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft - 256 - ACCEPT_BATCH, soft // 2))


def bind(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening socket; ``::`` listens on IPv6 and IPv4 (dual stack) where the host allows."""
    try:
        if host in ("::", "") and socket.has_dualstack_ipv6():
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=backlog, reuse_port=False, dualstack_ipv6=True)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        return socket.create_server(addr, family=family, backlog=backlog)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class _Protocol(asyncio.StreamReaderProtocol):
    def __init__(self, server: HttpServer) -> None:
        self._srv = server
        reader = asyncio.StreamReader(limit=server.limits.max_head_bytes, loop=server.loop)
        super().__init__(reader, server._serve_conn, loop=server.loop)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream socket's transport always is
        # Before any task exists: a connection over the ceiling costs an accept and a close.
        if not self._srv._admit(transport):
            transport.abort()
            return
        try:
            transport.max_size = READ_CHUNK  # type: ignore[attr-defined]  # bounded reads
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AttributeError, OSError):
            pass
        super().connection_made(transport)


class HttpServer:
    """Serves ``handler`` on a socket from one event-loop thread."""

    def __init__(self, sock: socket.socket, handler: Handler, limits: Limits = Limits(), tls: Callable[[], ssl.SSLContext] | None = None) -> None:
        self.sock = sock
        self.handler = handler
        self.limits = limits
        self.max_connections = effective_connection_limit(limits.max_connections)
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self.client_log = RateLimitedLog()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._behind = False  # the last accept batch was full: connections are queueing
        # The CPU governor ticks (every 20 ms) only while there is something to govern: an idle
        # loop woken 50 times a second was the agent's largest idle cost (~1 % of a core on an
        # H100 node, measured with bench/profile_agent.py).
        self._governing = False
        self._large_writers = asyncio.Semaphore(LARGE_WRITERS)
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
                # Our own accept loop (not loop.create_server): at the ceiling it can refuse a
                # connection for the price of accept + peek + close, before any transport exists.
                # The kernel's queue in front is long (as Go servers make it), so a burst waits
                # there instead of being dropped half-open; ACCEPT_BATCH bounds the descriptors
                # accepted per loop iteration.
                self.sock.setblocking(False)
                self.sock.listen(LISTEN_BACKLOG)
                self.loop.add_reader(self.sock.fileno(), self._on_accept)
                started.set()

            self.loop.run_until_complete(open_server())
            self.loop.run_forever()
            # stopped: close what is left, then the loop
            for c in list(self._conns.values()):
                c.transport.abort()
            tasks = asyncio.all_tasks(self.loop)
            for t in tasks:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
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
            self.loop.remove_reader(self.sock.fileno())
            self.loop.stop()

        self.loop.call_soon_threadsafe(halt)
        self._thread.join(timeout=5)
        self._thread = None
        self.sock.close()

    @property
    def connections_open(self) -> int:
        return len(self._conns)

    # -- bounds ------------------------------------------------------------------------------
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
                fd = self.sock.fileno()
                self.loop.remove_reader(fd)
                self.loop.call_later(0.1, self.loop.add_reader, fd, self._on_accept)
                return
            conn.setblocking(False)
            if self._behind and len(self._conns) >= self.max_connections and not _has_data(conn):
                # Behind (the kernel queue is not empty) and full: a connection that waited in
                # the queue and still sent nothing is an idle one; a scraper's request would be
                # there by now. Closing it here costs microseconds; admitting it would cost a
                # transport, a task and an eviction, and the queue would never drain.
                conn.close()
                self.refused += 1
                continue
            self.loop.create_task(self._connect(conn))
        self._behind = n >= ACCEPT_BATCH

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: _Protocol(self), sock=conn)
        except OSError:
            conn.close()

    def _admit(self, transport: asyncio.WriteTransport) -> bool:
        if len(self._conns) >= self.max_connections:
            waiting = [c for c in self._conns.values() if c.waiting]
            if not waiting:
                self.refused += 1
                self.client_log("http_connection_refused", reason=f"{self.max_connections} connections open, none idle")
                return False
            # connections that never completed a request first (what an idle or slow-header
            # attack consists of), oldest first; a scraper's keep-alive connection only when
            # nothing else is left
            oldest = min(waiting, key=lambda c: (c.served > 0, c.since))
            self._conns.pop(oldest.id, None)
            oldest.transport.abort()
            self.evicted += 1
        cid = next(self._ids)
        self._conns[cid] = _Conn(cid, transport)
        transport._dge_id = cid  # type: ignore[attr-defined]
        return True

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
        if not self._conns and not self._behind:
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

    # -- connections -------------------------------------------------------------------------
    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = getattr(writer.transport, "_dge_id", None)
        conn = self._conns.get(cid) if cid is not None else None
        peer = _peer(writer)
        try:
            if conn is None:  # evicted before its task ran
                return
            peer_cert = None
            if self.tls is not None:
                try:
                    await writer.start_tls(self.tls(), ssl_handshake_timeout=self.limits.tls_handshake_timeout)
                except TimeoutError:
                    self._timeout("tls_handshake")
                    return
                except (ssl.SSLError, OSError, ConnectionError) as e:
                    self.client_log("http_tls_handshake_failed", peer=peer, error=_short(e))
                    self._count_tls_failure()
                    return
                peer_cert = writer.get_extra_info("peercert")
                conn.transport = writer.transport
            writer.transport.set_write_buffer_limits(high=WRITE_CHUNK)
            await self._requests(conn, reader, writer, peer, peer_cert)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away: nothing to say
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in a handler must not end the server
            self.client_log("http_handler_error", peer=peer, error=_short(e))
        finally:
            if cid is not None:
                self._conns.pop(cid, None)
            # close() flushes what is still buffered; a client that never reads would keep it
            # open forever, so it is cut off after the write timeout whatever happens
            transport = writer.transport
            writer.close()
            self.loop.call_later(self.limits.write_timeout, transport.abort)

    def _count_tls_failure(self) -> None:
        self.tls_failed += 1

    async def _requests(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, peer_cert: dict[str, Any] | None) -> None:
        lim = self.limits
        for n in range(lim.max_requests_per_connection):
            conn.waiting, conn.since = True, time.monotonic()
            try:
                first = await asyncio.wait_for(reader.read(1), lim.idle_timeout)
            except TimeoutError:
                self._timeout("idle")
                return
            if not first:
                return  # closed by the client
            try:
                rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), lim.header_timeout)
            except TimeoutError:
                self._timeout("header")
                await self._answer(writer, Response(408, b"request head not received in time\n", close=True), "GET")
                return
            except asyncio.LimitOverrunError:
                self.client_log("http_request_rejected", peer=peer, reason=f"request head over {lim.max_head_bytes} bytes")
                await self._answer(writer, Response(431, b"request head too large\n", close=True), "GET")
                return
            conn.waiting = False
            req, problem = self._parse(first + rest, peer, peer_cert)
            if req is None:
                self.client_log("http_request_rejected", peer=peer, reason=problem.body.decode().strip())
                await self._answer(writer, problem, "GET")
                return
            close = _wants_close(req) or n == lim.max_requests_per_connection - 1
            if req.headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in req.headers:
                close = True  # bodies are never read; what follows the head is not a request
            resp = await self.handler(req)
            await self._answer(writer, resp, req.method, close=close or resp.close, version=req.version)
            conn.served += 1
            if close or resp.close:
                return

    def _parse(self, head: bytes, peer: str, peer_cert: dict[str, Any] | None) -> tuple[Request | None, Response]:
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
            return None, Response(400, b"malformed request line\n", close=True)
        method, target, version = (p.decode("latin-1") for p in parts)
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            return None, Response(505 if version.startswith("HTTP/") else 400, b"HTTP/1.0 and HTTP/1.1 only\n", close=True)
        if len(lines) - 1 > self.limits.max_headers:
            return None, Response(431, b"too many request headers\n", close=True)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name.strip() != name or b" " in name:
                return None, Response(400, b"malformed header line\n", close=True)
            k, v = name.decode("latin-1").lower(), value.strip().decode("latin-1")
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        return Request(method.upper(), target, version, headers, peer, peer_cert), Response(200)

    async def _answer(self, writer: asyncio.StreamWriter, resp: Response, method: str, close: bool = True, version: str = "HTTP/1.1") -> None:
        self._count(resp.status)
        body = resp.body
        lines = [f"{version if version == 'HTTP/1.0' else 'HTTP/1.1'} {resp.status} {_REASONS.get(resp.status, 'Unknown')}", f"Server: {SERVER}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in resp.headers]
        if close:
            lines.append("Connection: close")
        elif version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if method == "HEAD":
            body = b""
        try:
            if len(body) <= SMALL_BODY:
                writer.write(head + body)
                await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
            else:
                await asyncio.wait_for(self._large_writers.acquire(), self.limits.write_timeout)
                try:
                    writer.write(head)
                    view = memoryview(body)
                    for i in range(0, len(body), WRITE_CHUNK):
                        writer.write(view[i : i + WRITE_CHUNK])
                        await asyncio.wait_for(writer.drain(), self.limits.write_timeout)
                finally:
                    self._large_writers.release()
        except TimeoutError:
            self._timeout("write")
            writer.transport.abort()
            raise ConnectionError("write timed out") from None


def _has_data(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False  # reset already


def _wants_close(req: Request) -> bool:
    tokens = {t.strip().lower() for t in req.headers.get("connection", "").split(",")}
    if req.version == "HTTP/1.0":
        return "keep-alive" not in tokens
    return "close" in tokens


def _peer(writer: asyncio.StreamWriter) -> str:
    p = writer.get_extra_info("peername")
    if isinstance(p, tuple) and len(p) >= 2:
        return f"[{p[0]}]:{p[1]}" if ":" in str(p[0]) else f"{p[0]}:{p[1]}"
    return str(p)


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= 200 else s[:200] + "..."
