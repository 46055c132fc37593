"""HTTP endpoints: /metrics (the newest cycle's bytes), /healthz (alive), /readyz (fresh data).

A scrape never touches a device or the network: it gets the exposition of the newest state the
sampler published, in the format and encoding the client asked for. The bytes are made at most
once per cycle and form, by the first request that needs them, on the render thread, never on
the event loop (ondemand.py): other connections are served meanwhile, and concurrent scrapes of
one cycle share one render. That keeps scrapes fast and independent of a hung driver or an API
outage. The connection handling and its limits live in web.py; TLS, basic auth and headers
come from web_config.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import structlog

from ..text import one_line
from .ondemand import Fixed
from .render import Exposition, Form
from .web import HttpServer, Limits, Request, Response, bind
from .webconfig import ReloadingContext, WebConfig, client_san_problem
from .webstats import HttpStats

log = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
Probe = Callable[[], tuple[bool, str]]
Readiness = Probe
PROBES = ("/healthz", "/readyz")  # answered without basic auth: the kubelet's probes carry none

_INDEX = b"""<html><head><title>dra-gpu-exporter</title></head><body>
<h1>dra-gpu-exporter</h1><ul>
<li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li><li><a href="/readyz">/readyz</a></li>
</ul></body></html>
"""
_TEXT = "text/plain; charset=utf-8"


class Expositions(Protocol):
    """Where /metrics gets its bytes: exporter.metrics.ondemand.OnDemand (the agent's), or Fixed."""

    @property
    def published(self) -> bool: ...
    def request(self, form: Form | None = None) -> Future[Exposition | None]: ...


def _qvalues(header: str) -> list[tuple[str, float]]:
    """``a;q=0.5, b`` -> [(a, 0.5), (b, 1.0)]; parameters other than q are dropped."""
    out = []
    for part in header.split(","):
        items = [p.strip() for p in part.split(";")]
        if not items[0]:
            continue
        q = 1.0
        for p in items[1:]:
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        out.append((items[0].lower(), q))
    return out


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics when the client rates it above the text format (Prometheus asks for
    OpenMetrics first); ties and plain ``*/*`` get the text format."""
    om = text = 0.0
    for media, q in _qvalues(accept):
        if media == "application/openmetrics-text":
            om = max(om, q)
        elif media in ("text/plain", "text/*", "*/*"):
            text = max(text, q)
    return om > 0 and om > text


def wants_gzip(accept_encoding: str) -> bool:
    """RFC 9110: ``gzip;q=0`` refuses gzip; ``*`` stands for any coding not named."""
    named = dict(_qvalues(accept_encoding))
    if "gzip" in named:
        return named["gzip"] > 0
    return named.get("*", 0) > 0


class _Job:
    __slots__ = ("fut", "hashed", "password", "peer")

    def __init__(self, peer: str, hashed: bytes, password: bytes, fut: asyncio.Future[bool]) -> None:
        self.peer, self.hashed, self.password, self.fut = peer, hashed, password, fut


class _BasicAuth:
    """bcrypt checks off the event loop, one at a time, at most a quarter of a core, taken in
    turn per client address; failures from one address are answered ever more slowly.

    A check costs ~70 ms of CPU at cost 10; done on the loop it would stall every client, and
    a flood of wrong passwords would take a core from device reads. Results are cached per
    (user, password digest), like the exporter-toolkit, so a scraper pays once; successes and
    failures in separate caches, so guesses cannot push a good credential out.

    Checks wait their turn (the exporter-toolkit also lets requests wait) in one line per client
    address, served round-robin: a guesser with many connections gets one turn in each round
    like everyone else, and a valid credential from elsewhere waits for one check per other
    address, never behind the guesser's line and never refused for it. One address may have
    WAITING_PER_ADDRESS checks waiting (see there). After
    FREE_FAILURES failures from one address within FAILURE_WINDOW, each further failure is
    answered only after a delay that doubles up to MAX_DELAY (a connection is held, nothing
    is computed), so one address's guesses per connection slow down."""

    OK_CACHE = 64
    FAILED_CACHE = 256
    FREE_FAILURES = 3
    FAILURE_WINDOW = 60.0
    FIRST_DELAY = 0.25
    MAX_DELAY = 4.0  # under a common 5-10 s scrape timeout: a mistyped password still reads as 401
    PEERS = 4096  # addresses whose recent failures are remembered
    # Checks one address may have waiting. Each holds a connection slot until its turn, and turns
    # come at ~3 a second: without a cap one address's guesses could hold every slot, and
    # everyone else (Prometheus included, credential cached or not) would wait in the kernel's
    # queue for minutes. Past it, that address (only) gets 429. A scraper has one or two waiting.
    WAITING_PER_ADDRESS = 16

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-auth")
        self._ok: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._failed: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._waiting: OrderedDict[str, deque[_Job]] = OrderedDict()  # per address, in turn order
        self._running = False
        self._checking: tuple[str, deque[_Job]] | None = None  # the address checked now, and its line
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (count, last)
        self.checks = 0  # bcrypt checks run
        self.throttled = 0  # failures answered late
        import bcrypt

        # An unknown user is checked against this hash, so timing does not tell which user
        # names exist.
        self._dummy = bcrypt.hashpw(b"unknown user", bcrypt.gensalt(10))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check(self, hashed: bytes, password: bytes) -> bool:
        import bcrypt

        t0 = time.thread_time()
        try:
            ok = bcrypt.checkpw(password, hashed)
        except ValueError:
            ok = False
        time.sleep(3 * (time.thread_time() - t0))  # at most 25% of a core on bcrypt
        return ok

    async def allowed(self, header: str | None, peer: str = "") -> bool | None:
        """Whether the credential is valid; None when ``peer`` already has WAITING_PER_ADDRESS
        checks waiting (answer 429)."""
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        known = user in self.users and bool(sep)
        hashed = self.users.get(user) or self._dummy
        key = (user, hashlib.sha256(hashed + b"\0" + password.encode()).digest())
        if key in self._ok:
            self._ok.move_to_end(key)
            return known
        if key in self._failed:
            self._failed.move_to_end(key)
            ok = False
        else:
            line = self._checking[1] if self._checking is not None and self._checking[0] == peer else self._waiting.get(peer, ())
            if len(line) >= self.WAITING_PER_ADDRESS:
                return None
            ok = await self._queue(peer, hashed, password.encode())
            cache = self._ok if ok else self._failed
            cache[key] = None
            if len(cache) > (self.OK_CACHE if ok else self.FAILED_CACHE):
                cache.popitem(last=False)
        if ok and known:
            self._failures.pop(peer, None)
            return True
        await self._throttle(peer)
        return False

    async def _queue(self, peer: str, hashed: bytes, password: bytes) -> bool:
        loop = asyncio.get_running_loop()
        job = _Job(peer, hashed, password, loop.create_future())
        self._line(peer).append(job)
        self._next(loop)
        try:
            return await job.fut
        except asyncio.CancelledError:  # the client went away: its turn is not taken
            q = self._checking[1] if self._checking is not None and self._checking[0] == peer else self._waiting.get(peer)
            if q is not None and job in q:
                q.remove(job)
                if not q and self._waiting.get(peer) is q:
                    del self._waiting[peer]
            raise

    def _line(self, peer: str) -> deque[_Job]:
        """``peer``'s waiting jobs: the address being checked now waits out of the rotation
        until its check ends, then goes to the back, behind addresses that arrived meanwhile."""
        if self._checking is not None and self._checking[0] == peer:
            return self._checking[1]
        return self._waiting.setdefault(peer, deque())

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the next check, if none is running: the first waiting job of the address
        whose turn it is; that address goes to the back of the line."""
        while not self._running and self._waiting:
            peer, q = self._waiting.popitem(last=False)
            job = q.popleft()
            if job.fut.done():
                if q:
                    self._waiting[peer] = q
                continue
            try:
                work = self._pool.submit(self._check, job.hashed, job.password)
            except RuntimeError:  # stopping
                job.fut.set_result(False)
                continue
            self._running = True
            self._checking = (peer, q)
            self.checks += 1

            def finished(w: Future[bool], job: _Job = job) -> None:
                try:
                    loop.call_soon_threadsafe(self._finished, loop, job, w)
                except RuntimeError:
                    pass  # the loop is closed: the server stopped

            work.add_done_callback(finished)

    def _finished(self, loop: asyncio.AbstractEventLoop, job: _Job, work: Future[bool]) -> None:
        self._running = False
        if self._checking is not None:
            peer, q = self._checking
            self._checking = None
            if q:
                self._waiting[peer] = q  # to the back of the line
        if not job.fut.done():
            ok = False if work.cancelled() or work.exception() is not None else work.result()
            job.fut.set_result(ok)
        self._next(loop)

    async def _throttle(self, peer: str) -> None:
        now = time.monotonic()
        count, last = self._failures.pop(peer, (0, now))
        count = 1 if now - last > self.FAILURE_WINDOW else count + 1
        self._failures[peer] = (count, now)
        if len(self._failures) > self.PEERS:
            self._failures.popitem(last=False)
        if count > self.FREE_FAILURES:
            self.throttled += 1
            await asyncio.sleep(min(self.MAX_DELAY, self.FIRST_DELAY * 2 ** (count - self.FREE_FAILURES - 1)))


class MetricsServer:
    def __init__(
        self,
        host: str,
        port: int,
        readiness: Probe,
        *,
        liveness: Probe | None = None,
        web_config: WebConfig | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.readiness = readiness
        self.liveness = liveness
        self.web_config = web_config or WebConfig()
        self._source: Expositions | None = None  # None until the first cycle is published
        self._static: bytes | None = None  # for the benchmark's static-body baseline
        self._tls = ReloadingContext(self.web_config.tls) if self.web_config.tls else None
        self._auth = _BasicAuth(self.web_config.basic_auth_users) if self.web_config.basic_auth_users else None
        self._extra_headers = list(self.web_config.headers)
        # Probe callables run on their own thread: one that blocks (a lock held by a stuck
        # sampler) must make its probe fail, not freeze the event loop and every scrape with it.
        # One thread each, so a stuck readiness check does not fail liveness and the reverse.
        self._probe_pools = {p: ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-probe") for p in PROBES}
        self._probe_slots = {p: threading.BoundedSemaphore(self.PROBES_QUEUED) for p in PROBES}  # submitted, not finished
        sock = bind(host, port)
        self._host = host
        tls = self.web_config.tls
        allowed = tls.client_allowed_sans if tls is not None else ()
        peer_check = (lambda cert: client_san_problem(cert, allowed)) if allowed else None
        self._http = HttpServer(sock, self._handle, limits or Limits(), tls=self._tls.current if self._tls else None, peer_check=peer_check)
        self._started = False

    # -- public ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._http.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self._host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    def serve_from(self, source: Expositions) -> None:
        """Serve what ``source`` publishes (the agent's OnDemand: rendered when asked)."""
        self._source = source

    def publish(self, exposition: Exposition) -> None:
        """Serve these bytes until told otherwise (tests; the agent serves from its OnDemand)."""
        self._source = Fixed(exposition)

    def current(self, timeout: float | None = 30.0) -> Exposition | None:
        """What /metrics serves now, rendered if it is not yet (blocks: tests and benchmarks,
        never the event loop)."""
        src = self._source
        return src.request().result(timeout) if src is not None else None

    def serve_static(self, body: bytes) -> None:
        """Serve ``body`` at /static (benchmark baseline: same server, no rendering)."""
        self._static = body

    def stats(self) -> HttpStats:
        h = self._http
        return HttpStats(
            connections_open=h.connections_open,
            connection_limit=h.max_connections,
            refused=h.refused,
            evicted=h.evicted,
            tls_failed=h.tls_failed,
            timed_out=dict(h.timed_out),
            requests=dict(h.requests),
        )

    def start(self) -> None:
        self._http.start()
        self._started = True
        lim = self._http.limits
        log.info(
            "http_listening",
            url=self.url,
            tls=self._tls is not None,
            basic_auth=self._auth is not None,
            max_connections=self._http.max_connections,
            idle_timeout=lim.idle_timeout,
            header_timeout=lim.header_timeout,
        )

    def stop(self) -> None:
        self._http.stop()
        for pool in self._probe_pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        if self._auth is not None:
            self._auth.close()

    # -- requests ----------------------------------------------------------------------------
    async def _handle(self, req: Request) -> Response:
        resp = await self._route(req)
        resp.headers.extend(self._extra_headers)
        return resp

    async def _route(self, req: Request) -> Response:
        path = req.path
        known = path in ("/metrics", "/healthz", "/readyz", "/") or (path == "/static" and self._static is not None)
        if not known:
            return Response(404, b"not found\n", [("Content-Type", _TEXT)])
        if req.method not in ("GET", "HEAD"):
            return Response(405, b"method not allowed\n", [("Content-Type", _TEXT), ("Allow", "GET, HEAD")])
        if path in PROBES:
            return await self._probe(self.liveness if path == "/healthz" else self.readiness, path)
        if self._auth is not None and (ok := await self._auth.allowed(req.headers.get("authorization"), req.peer_ip)) is not True:
            if ok is None:
                return Response(429, b"too many credential checks waiting from this address\n", [("Content-Type", _TEXT), ("Retry-After", "1")])
            self._http.client_log("http_unauthorized", peer=req.peer)
            return Response(401, b"unauthorized\n", [("Content-Type", _TEXT), ("WWW-Authenticate", 'Basic realm="dra-gpu-exporter"')])
        if path == "/metrics":
            return await self._metrics(req)
        if path == "/static":
            return Response(200, self._static or b"", [("Content-Type", CONTENT_TYPE)])
        return Response(200, _INDEX, [("Content-Type", "text/html; charset=utf-8")])

    # A render (and gzip) takes milliseconds, a second for a huge node on a starved CPU; past
    # this a scrape is answered 503 rather than holding its connection (never evicted while a
    # request is in flight) for as long as something is wrong with the render thread.
    RENDER_TIMEOUT = 30.0

    async def _metrics(self, req: Request) -> Response:
        src = self._source  # one reference read
        if src is None or not src.published:
            # Before the first cycle there is nothing true to say: an empty 200 would read as
            # "this node has no GPUs". Prometheus records the target as down.
            return Response(503, b"no metrics yet: the first collection cycle is still running\n", [("Content-Type", _TEXT)])
        om = wants_openmetrics(req.headers.get("accept", ""))
        gz = wants_gzip(req.headers.get("accept-encoding", ""))
        form: Form = ("openmetrics_gzipped" if gz else "openmetrics") if om else ("gzipped" if gz else "body")
        try:
            job = src.request(form)
        except RuntimeError:  # stopping
            return Response(503, b"stopping\n", [("Content-Type", _TEXT)])
        try:
            # Shielded: a client that goes away must not cancel the render other scrapes share.
            exp = job.result() if job.done() else await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), self.RENDER_TIMEOUT)
        except TimeoutError:
            log.warning("metrics_render_slow", waited_seconds=self.RENDER_TIMEOUT)
            return Response(503, b"metrics not rendered in time: retry\n", [("Content-Type", _TEXT), ("Retry-After", "1")])
        except Exception as e:  # the job itself broke (a render's own failure is caught in it)
            log.warning("metrics_job_failed", error=one_line(e))
            exp = None
        if exp is None:  # every render so far failed (logged, and said in /readyz)
            return Response(500, b"metrics could not be rendered: see the agent's log and /readyz\n", [("Content-Type", _TEXT)])
        body = exp.get(form)  # made by the job: no work here
        headers = [("Content-Type", OPENMETRICS_CONTENT_TYPE if om else CONTENT_TYPE), ("Vary", "Accept, Accept-Encoding")]
        if gz:
            headers.append(("Content-Encoding", "gzip"))
        return Response(200, body, headers)

    PROBE_TIMEOUT = 2.0
    PROBES_QUEUED = 4

    async def _probe(self, probe: Probe | None, path: str) -> Response:
        what = "readiness" if path == "/readyz" else "liveness"
        if probe is None:
            ok, reason = True, "ok"
        elif not (slots := self._probe_slots[path]).acquire(blocking=False):
            ok, reason = False, f"{what} check did not answer: {self.PROBES_QUEUED} earlier checks still running"
        else:
            try:
                job = self._probe_pools[path].submit(probe)
            except RuntimeError:  # stopping
                slots.release()
                return Response(503, b"stopping\n", [("Content-Type", _TEXT)])
            job.add_done_callback(lambda _: slots.release())  # when it really ends
            try:
                ok, reason = await asyncio.wait_for(asyncio.wrap_future(job), self.PROBE_TIMEOUT)
            except TimeoutError:
                ok, reason = False, f"{what} check did not answer within {self.PROBE_TIMEOUT:.0f}s"
            except Exception as e:  # a broken probe must say so, not crash the server
                ok, reason = False, f"{what} check failed: {e}"
        return Response(200 if ok else 503, (reason.rstrip() + "\n").encode(), [("Content-Type", _TEXT)])


__all__ = ["CONTENT_TYPE", "OPENMETRICS_CONTENT_TYPE", "Limits", "MetricsServer", "wants_gzip", "wants_openmetrics"]
