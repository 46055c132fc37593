"""HTTP endpoints: /metrics (cached bytes), /healthz (alive), /readyz (fresh data).

A scrape never touches a device or the network: it copies out the last rendered exposition,
in the format and encoding the client asked for, all four variants rendered once per cycle.
That keeps scrapes fast and independent of a hung driver or an API outage. The connection
handling and its limits live in web.py; TLS, basic auth and headers come from web_config.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog

from .render import Exposition
from .web import HttpServer, Limits, Request, Response, bind
from .webconfig import ReloadingContext, WebConfig
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
    """bcrypt checks off the event loop, one at a time, at most a quarter of a core.

    A check costs ~70 ms of CPU at cost 10; done on the loop it would stall every client, and
    a flood of wrong passwords would take a core from device reads. Results are cached per
    (user, password digest), like the exporter-toolkit, so a scraper pays once."""

    MAX_PENDING = 8
    CACHE = 256

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-auth")
        self._cache: OrderedDict[tuple[str, bytes], bool] = OrderedDict()
        self._pending = 0
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

    async def allowed(self, header: str | None) -> bool | None:
        """True/False, or None when too many checks are queued (answer 429)."""
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user) or self._dummy
        key = (user, hashlib.sha256(hashed + b"\0" + password.encode()).digest())
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key] and user in self.users and bool(sep)
        if self._pending >= self.MAX_PENDING:
            return None
        self._pending += 1
        try:
            ok = await asyncio.get_running_loop().run_in_executor(self._pool, self._check, hashed, password.encode())
        finally:
            self._pending -= 1
        self._cache[key] = ok
        if len(self._cache) > self.CACHE:
            self._cache.popitem(last=False)
        return ok and user in self.users and bool(sep)


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
        self._exposition: Exposition | None = None  # None until the first cycle is rendered
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
        self._http = HttpServer(sock, self._handle, limits or Limits(), tls=self._tls.current if self._tls else None)
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

    @property
    def published(self) -> bool:
        """Whether there is an exposition to serve."""
        return self._exposition is not None

    def publish(self, exposition: Exposition) -> None:
        self._exposition = exposition

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
        if self._auth is not None:
            ok = await self._auth.allowed(req.headers.get("authorization"))
            if ok is None:
                return Response(429, b"too many authentication attempts in flight\n", [("Content-Type", _TEXT), ("Retry-After", "1")])
            if not ok:
                self._http.client_log("http_unauthorized", peer=req.peer)
                return Response(401, b"unauthorized\n", [("Content-Type", _TEXT), ("WWW-Authenticate", 'Basic realm="dra-gpu-exporter"')])
        if path == "/metrics":
            return self._metrics(req)
        if path == "/static":
            return Response(200, self._static or b"", [("Content-Type", CONTENT_TYPE)])
        return Response(200, _INDEX, [("Content-Type", "text/html; charset=utf-8")])

    def _metrics(self, req: Request) -> Response:
        exp = self._exposition  # one reference read: a consistent body
        if exp is None:
            # Before the first cycle there is nothing true to say: an empty 200 would read as
            # "this node has no GPUs". Prometheus records the target as down.
            return Response(503, b"no metrics yet: the first collection cycle is still running\n", [("Content-Type", _TEXT)])
        om = wants_openmetrics(req.headers.get("accept", ""))
        gz = wants_gzip(req.headers.get("accept-encoding", ""))
        body = (exp.openmetrics_gzipped if gz else exp.openmetrics) if om else (exp.gzipped if gz else exp.body)
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
