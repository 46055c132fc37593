"""HTTP endpoints: /metrics (cached bytes), /healthz (alive), /readyz (fresh data).

A scrape never touches a device or the network: it copies out the last rendered exposition.
That keeps scrapes fast and independent of a hung driver or an API outage.
"""

from __future__ import annotations

import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import structlog

from .render import Exposition

log = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Readiness = Callable[[], tuple[bool, str]]

_INDEX = b"""<html><head><title>dra-gpu-exporter</title></head><body>
<h1>dra-gpu-exporter</h1><ul>
<li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li><li><a href="/readyz">/readyz</a></li>
</ul></body></html>
"""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class MetricsServer:
    def __init__(self, host: str, port: int, readiness: Readiness, *, liveness: Readiness | None = None) -> None:
        self.readiness = readiness
        self.liveness = liveness  # interim until team endpoint's server lands: /healthz from it
        self._exposition: Exposition | None = None  # None until the first cycle is rendered
        self._static: bytes | None = None  # for the benchmark's static-body baseline
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "dra-gpu-exporter"

            def log_message(self, fmt: str, *args: object) -> None:  # access logs would drown ours
                pass

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", encoding: str | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if encoding:
                    self.send_header("Content-Encoding", encoding)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    exp = owner._exposition  # one reference read: a consistent body
                    if exp is None:
                        # Before the first cycle there is nothing true to say: an empty 200 would
                        # read as "this node has no GPUs". Prometheus records the target as down.
                        self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"no metrics yet: the first collection cycle is still running\n")
                    elif "gzip" in (self.headers.get("Accept-Encoding") or ""):
                        self._send(200, exp.gzipped, CONTENT_TYPE, "gzip")
                    else:
                        self._send(200, exp.body, CONTENT_TYPE)
                elif path == "/healthz":
                    try:
                        ok, reason = owner.liveness() if owner.liveness is not None else (True, "ok")
                    except Exception as e:  # a broken probe must say so, not crash the server
                        ok, reason = False, f"liveness check failed: {e}"
                    self._send(200 if ok else HTTPStatus.SERVICE_UNAVAILABLE, (reason.rstrip() + "\n").encode())
                elif path == "/readyz":
                    try:
                        ok, reason = owner.readiness()
                    except Exception as e:  # a broken probe must say so, not crash the server
                        ok, reason = False, f"readiness check failed: {e}"
                    self._send(200 if ok else HTTPStatus.SERVICE_UNAVAILABLE, (reason.rstrip() + "\n").encode())
                elif path == "/static" and owner._static is not None:
                    self._send(200, owner._static, CONTENT_TYPE)
                elif path == "/":
                    self._send(200, _INDEX, "text/html; charset=utf-8")
                else:
                    self._send(404, b"not found\n")

        try:
            self._httpd = _Server((host, port), Handler)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.port}"

    @property
    def published(self) -> bool:
        """Whether there is an exposition to serve."""
        return self._exposition is not None

    def publish(self, exposition: Exposition) -> None:
        self._exposition = exposition

    def serve_static(self, body: bytes) -> None:
        """Serve ``body`` at /static (benchmark baseline: same server, no rendering)."""
        self._static = body

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="http", daemon=True)
        self._thread.start()
        log.info("http_listening", url=self.url)

    def stop(self) -> None:
        # shutdown() waits for serve_forever() to notice; on a server that was never started
        # it would wait forever.
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()
