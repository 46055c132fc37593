"""HTTP endpoints: /metrics (the newest cycle's bytes), /healthz (alive), /readyz (fresh data).

A scrape never touches a device or the network: it gets the exposition of the newest state the
sampler published (:class:`Expositions`), in the format and encoding the client asked for. A
cycle's bytes are made once, by the first request that needs them, on the render thread, never
on the event loop: other connections are served meanwhile, and concurrent scrapes of one cycle
share one render. With a usual 15-30 s scrape of a 1-5 s cycle most cycles are never rendered.
The connection handling and its limits live in web.py; TLS, basic auth and headers come from
webconfig.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import structlog

from ..text import one_line
from .render import Exposition, Form, RenderState
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


Route = Callable[[Request], Awaitable[Response]]


class Renders(Protocol):
    def render(self, state: RenderState) -> Exposition: ...


class Expositions:
    """The per-cycle bytes cache: the sampler publishes each cycle's RenderState (cheap: parts the
    sources made anyway, each immutable or a copy); a request for a cycle other than the cached
    one renders it, once, under a lock (the renderer keeps caches from one render to the next
    and is not thread-safe; concurrent requests for the cycle wait for that one render).

    A render that fails (a bug, for one state) is logged and not retried until the next cycle:
    the last good bytes are served (their ``dra_gpu_exporter_last_collection_timestamp_seconds``
    says how old they are) and ``error`` says why for /readyz; with none, the handler answers 500.
    """

    def __init__(self, renderer: Renders) -> None:
        self._renderer = renderer
        self._lock = threading.Lock()  # one render at a time
        self._state: tuple[int, RenderState] | None = None  # the newest cycle's, numbered
        self._cached: tuple[int, Exposition] | None = None  # the newest good render, its cycle's number
        self._failed = 0  # the number of the newest cycle whose render failed
        self.renders = 0
        self.failures = 0
        self.error: str | None = None  # why the newest cycle could not be rendered; None if it could

    def publish(self, state: RenderState) -> None:
        """The newest cycle's state (the sampler's); rendered when a scrape asks."""
        last = self._state
        self._state = (last[0] + 1 if last is not None else 1, state)  # one reference written: no lock

    @property
    def published(self) -> bool:
        return self._state is not None

    @property
    def rendered(self) -> bool:
        """Whether any cycle was rendered (/readyz: a failing first render)."""
        return self._cached is not None

    def cached(self, form: Form) -> Exposition | None:
        """The newest cycle's exposition if it is made, ``form`` included (no work: the event loop)."""
        state, cached = self._state, self._cached
        if state is not None and cached is not None and cached[0] == state[0] and cached[1].ready(form):
            return cached[1]
        return None

    def exposition(self, form: Form | None = None) -> Exposition | None:
        """The newest cycle's exposition, rendered now if it is not, ``form`` made (blocks: the
        render thread, tests, benchmarks); None if nothing could be rendered yet."""
        with self._lock:
            state = self._state
            if state is not None and (self._cached is None or self._cached[0] != state[0]) and self._failed != state[0]:
                try:
                    self._cached = (state[0], self._renderer.render(state[1]))
                    self.renders += 1
                    self.error = None
                except Exception as e:  # a bug for one state must not take the endpoint down
                    serving = "the previous cycle's metrics" if self._cached else "HTTP 500"
                    log.exception("metrics_render_failed", serving=serving)
                    self._failed = state[0]
                    self.failures += 1
                    self.error = f"metrics render failed: {type(e).__name__}: {one_line(e, 200)}"
            exp = self._cached[1] if self._cached is not None else None
        if exp is not None and form is not None:
            exp.get(form)  # gzipped here, off the event loop (outside the lock)
        return exp


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


class _BasicAuth:
    """bcrypt checks off the event loop, one at a time, results cached, as the exporter-toolkit
    does: a check costs ~70 ms of CPU at cost 10, so done on the loop it would stall every
    client. Successes and failures are cached apart (per user and password digest), so guesses
    cannot push a good credential out and a scraper pays once. Checks take at most a quarter
    of a core (a flood of wrong passwords must not take a core from device reads), and one
    address may have WAITING_PER_ADDRESS checks waiting: each holds a connection slot, and
    without a cap one address's guesses could hold every slot; past it that address (only)
    gets 429. A scraper has one or two waiting."""

    OK_CACHE = 64
    FAILED_CACHE = 256
    WAITING_PER_ADDRESS = 16

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-auth")
        self._cache: dict[bool, OrderedDict[tuple[str, bytes], None]] = {True: OrderedDict(), False: OrderedDict()}
        self._waiting: Counter[str] = Counter()  # address -> checks waiting or running
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
        for ok, cache in self._cache.items():
            if key in cache:
                cache.move_to_end(key)
                return ok and known
        if self._waiting[peer] >= self.WAITING_PER_ADDRESS:
            return None
        self._waiting[peer] += 1
        try:
            ok = await asyncio.wrap_future(self._pool.submit(self._check, hashed, password.encode()))
        finally:
            self._waiting[peer] -= 1
            if not self._waiting[peer]:
                del self._waiting[peer]
        cache = self._cache[ok]
        cache[key] = None
        if len(cache) > (self.OK_CACHE if ok else self.FAILED_CACHE):
            cache.popitem(last=False)
        return ok and known


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
        self.source: Expositions | None = None  # None until the first cycle is published
        # Paths answered behind basic auth; a benchmark may add its own (bench/: a static body).
        self.routes: dict[str, Route] = {"/metrics": self._metrics, "/": self._index}
        self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        self._tls = ReloadingContext(self.web_config.tls) if self.web_config.tls else None
        self._auth = _BasicAuth(self.web_config.basic_auth_users) if self.web_config.basic_auth_users else None
        self._extra_headers = list(self.web_config.headers)
        # Probe callables run on their own thread: one that blocks (a lock held by a stuck
        # sampler) must make its probe fail, not freeze the event loop and every scrape with it.
        # One thread each, so a stuck readiness check does not fail liveness and the reverse.
        self._probe_pools = {p: ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-probe") for p in PROBES}
        self._probe_slots = {
            p: threading.BoundedSemaphore(self.PROBES_QUEUED) for p in PROBES
        }  # submitted, not finished
        sock = bind(host, port)
        self._host = host
        tls = self.web_config.tls
        allowed = tls.client_allowed_sans if tls is not None else ()
        peer_check = (lambda cert: client_san_problem(cert, allowed)) if allowed else None
        self._http = HttpServer(sock, self._handle, limits or Limits(), tls=self._tls.current if self._tls else None,
                                peer_check=peer_check)
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
        """Serve what ``source`` publishes (the agent's: each cycle rendered when asked)."""
        self.source = source

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
        self._render_pool.shutdown(wait=False, cancel_futures=True)
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
        route = self.routes.get(path)
        if route is None and path not in PROBES:
            return Response(404, b"not found\n", [("Content-Type", _TEXT)])
        if req.method not in ("GET", "HEAD"):
            return Response(405, b"method not allowed\n", [("Content-Type", _TEXT), ("Allow", "GET, HEAD")])
        if path in PROBES:
            return await self._probe(self.liveness if path == "/healthz" else self.readiness, path)
        ok = True if self._auth is None else await self._auth.allowed(req.headers.get("authorization"), req.peer_ip)
        if ok is not True:
            if ok is None:
                return Response(429, b"too many credential checks waiting from this address\n",
                                [("Content-Type", _TEXT), ("Retry-After", "1")])
            self._http.client_log("http_unauthorized", peer=req.peer)
            return Response(401, b"unauthorized\n",
                            [("Content-Type", _TEXT), ("WWW-Authenticate", 'Basic realm="dra-gpu-exporter"')])
        assert route is not None  # (not a probe)
        return await route(req)

    async def _index(self, req: Request) -> Response:
        return Response(200, _INDEX, [("Content-Type", "text/html; charset=utf-8")])

    # A render (and gzip) takes milliseconds, a second for a huge node on a starved CPU; past
    # this a scrape is answered 503 rather than holding its connection (never evicted while a
    # request is in flight) for as long as something is wrong with the render thread.
    RENDER_TIMEOUT = 30.0

    async def _metrics(self, req: Request) -> Response:
        src = self.source  # one reference read
        if src is None or not src.published:
            # Before the first cycle there is nothing true to say: an empty 200 would read as
            # "this node has no GPUs". Prometheus records the target as down.
            return Response(503, b"no metrics yet: the first collection cycle is still running\n",
                            [("Content-Type", _TEXT)])
        om = wants_openmetrics(req.headers.get("accept", ""))
        gz = wants_gzip(req.headers.get("accept-encoding", ""))
        form: Form = ("openmetrics_gzipped" if gz else "openmetrics") if om else ("gzipped" if gz else "body")
        exp = src.cached(form)
        if exp is None:
            try:
                job = self._render_pool.submit(src.exposition, form)
            except RuntimeError:  # stopping
                return Response(503, b"stopping\n", [("Content-Type", _TEXT)])
            try:
                # A client that goes away cancels only its own job (if not started): the render
                # is the cache's, whoever asked first.
                exp = await asyncio.wait_for(asyncio.wrap_future(job), self.RENDER_TIMEOUT)
            except TimeoutError:
                log.warning("metrics_render_slow", waited_seconds=self.RENDER_TIMEOUT)
                headers = [("Content-Type", _TEXT), ("Retry-After", "1")]
                return Response(503, b"metrics not rendered in time: retry\n", headers)
            except Exception as e:  # the job itself broke (a render's own failure is caught in it)
                log.warning("metrics_job_failed", error=one_line(e))
        if exp is None:  # every render so far failed (logged, and said in /readyz)
            return Response(500, b"metrics could not be rendered: see the agent's log and /readyz\n",
                            [("Content-Type", _TEXT)])
        body = exp.get(form)  # made already: no work here
        headers = [("Content-Type", OPENMETRICS_CONTENT_TYPE if om else CONTENT_TYPE),
                   ("Vary", "Accept, Accept-Encoding")]
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
