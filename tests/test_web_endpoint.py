"""The HTTP server's protocol and bounds, against the real server on a real socket.

HEAD/404/405, content negotiation (OpenMetrics, gzip incl. q=0), keep-alive, no version in
Server, IPv6 and dual stack, the connection ceiling with eviction, timeouts that close idle
and slow connections, oversized heads refused, and the self-metrics that count all of it.
Every wait is for an event (a close, a status), bounded by a generous deadline; no timing is
asserted.
"""

from __future__ import annotations

import gzip
import http.client
import shutil
import socket
import subprocess

import pytest
from kit_helpers import publish, wait_until
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from exporter.devices.model import DeviceIdentity, DeviceReading, Vendor
from exporter.metrics.render import Renderer, RenderState
from exporter.metrics.server import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE, MetricsServer, wants_gzip, wants_openmetrics
from exporter.metrics.web import Limits
from exporter.model.join import JoinInputs, join

PROMTOOL = shutil.which("promtool")
UUID = "GPU-00000000-1111-2222-3333-444444444444"


def exposition(server: MetricsServer | None = None):
    ident = DeviceIdentity(uuid=UUID, vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0, minor=0)
    reading = DeviceReading(uuid=UUID, ok=True, utilization_ratio=0.5, memory_used_bytes=1.0, energy_joules=12.5, ecc_correctable_total=3)
    snap = join(JoinInputs(node="node-t", timestamp=0.0, identities=(ident,), readings={UUID: reading}, health={}, allocations=(), slices=None))
    return Renderer().render(RenderState(snapshot=snap, cycles=3, http=server.stats() if server else None))




@pytest.fixture
def server():
    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), limits=Limits(max_connections=16, idle_timeout=1.0, header_timeout=1.0))
    publish(s, exposition())
    s.start()
    try:
        yield s
    finally:
        s.stop()


def request(s: MetricsServer, method: str = "GET", path: str = "/metrics", headers: dict | None = None, host: str = "127.0.0.1"):
    c = http.client.HTTPConnection(host, s.port, timeout=20)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def closed_by_server(sock: socket.socket, timeout: float = 60.0) -> bytes:
    """Wait until the server closes ``sock`` (EOF or reset); return what it sent first."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


# ------------------------------------------------------------------ negotiation


def test_accept_and_accept_encoding_parsing():
    prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    assert wants_openmetrics(prom)
    assert not wants_openmetrics("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5")
    assert not wants_openmetrics("*/*") and not wants_openmetrics("")
    assert not wants_openmetrics("application/openmetrics-text;q=0")
    assert wants_gzip("gzip") and wants_gzip("deflate, gzip;q=0.5") and wants_gzip("*")
    assert not wants_gzip("gzip;q=0") and not wants_gzip("identity") and not wants_gzip("*, gzip;q=0") and not wants_gzip("")


def test_formats_head_404_405_and_headers(server):
    exp = server.source.exposition()
    status, h, body = request(server)
    assert (status, h["Content-Type"], body) == (200, CONTENT_TYPE, exp.body)
    assert h["Server"] == "dra-gpu-exporter"  # no Python, no version
    status, h, body = request(server, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert (status, h["Content-Type"], body) == (200, OPENMETRICS_CONTENT_TYPE, exp.openmetrics)
    assert body.endswith(b"# EOF\n")
    status, h, body = request(server, headers={"Accept": "application/openmetrics-text", "Accept-Encoding": "gzip"})
    assert h["Content-Encoding"] == "gzip" and gzip.decompress(body) == exp.openmetrics
    status, h, body = request(server, headers={"Accept-Encoding": "gzip;q=0, deflate"})
    assert "Content-Encoding" not in h and body == exp.body
    status, h, body = request(server, "HEAD")
    assert status == 200 and body == b"" and int(h["Content-Length"]) == len(exp.body)
    assert request(server, path="/nothing")[0] == 404
    assert request(server, "POST", "/nothing")[0] == 404
    status, h, _ = request(server, "POST", "/metrics", headers={"Content-Length": "0"})
    assert status == 405 and h["Allow"] == "GET, HEAD"
    assert request(server, "DELETE", "/healthz")[0] == 405
    assert request(server, path="/metrics?x=1")[0] == 200
    assert request(server, path="/")[0] == 200


def test_both_formats_parse_and_pass_promtool(server):
    """The same cycle in both formats: prometheus_client's parsers accept each, with the same
    samples (OpenMetrics names counters without _total in the family, as the library does)."""
    publish(server, exposition(server))
    exp = server.source.exposition()
    text = {(s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(exp.body.decode()) for s in f.samples}
    om = {(s.name, tuple(sorted(s.labels.items())), s.value) for f in om_families(exp.openmetrics.decode()) for s in f.samples}
    assert ("gpu_ecc_errors_total", (("node", "node-t"), ("type", "correctable"), ("uuid", UUID)), 3.0) in om
    assert ("dra_gpu_exporter_http_connection_limit", (("node", "node-t"),), 16.0) in om
    assert {x for x in text if not x[0].endswith("_created")} == {x for x in om if not x[0].endswith("_created")}
    # promtool check metrics (Debian's 2.42) reads the text format only: it lints that one;
    # the OpenMetrics body is checked by the parser above and by a real Prometheus, which asks
    # for OpenMetrics first (test_web_tls.py)
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=exp.body, capture_output=True, timeout=60)
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), (r.stdout + r.stderr).decode()


def test_keep_alive_and_http10(server):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    for _ in range(5):  # one connection, several requests
        c.request("GET", "/healthz")
        r = c.getresponse()
        assert (r.status, r.read()) == (200, b"ok\n")
    c.close()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    reply = closed_by_server(s)  # HTTP/1.0 without keep-alive: answered, then closed
    # h11 answers in its own version, as RFC 9110 section 6.2 asks (the highest the server
    # speaks with the request's major version); the client reads it as 1.0 all the same
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b"\r\n\r\nok\n")
    assert b"\r\nConnection: close\r\n" in reply
    s.close()


def test_probes_tell_liveness_and_readiness():
    state = {"alive": (True, "ok"), "ready": (False, "not ready: first cycle")}
    s = MetricsServer("127.0.0.1", 0, lambda: state["ready"], liveness=lambda: state["alive"])
    s.start()
    try:
        assert request(s, path="/healthz")[::2] == (200, b"ok\n")
        assert request(s, path="/readyz")[::2] == (503, b"not ready: first cycle\n")
        state["alive"] = (False, "sampler stuck: no cycle completed for 31s")
        assert request(s, path="/healthz")[::2] == (503, b"sampler stuck: no cycle completed for 31s\n")
        state["alive"] = None  # a broken probe (not a tuple) says so
        status, _, body = request(s, path="/healthz")
        assert status == 503 and body.startswith(b"liveness check failed")
        assert request(s, path="/metrics")[0] == 503  # nothing rendered yet
    finally:
        s.stop()


def test_ipv6_and_dual_stack():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        s = MetricsServer("::", 0, lambda: (True, "ready"))
    except OSError as e:
        pytest.skip(f"cannot bind [::]: {e}")
    publish(s, exposition())
    s.start()
    try:
        assert s.url == f"http://[::1]:{s.port}"
        assert request(s, host="::1")[0] == 200
        if socket.has_dualstack_ipv6():
            assert request(s, host="127.0.0.1")[0] == 200  # the same socket takes IPv4
    finally:
        s.stop()


# ------------------------------------------------------------------ bounds


def test_malformed_and_oversized_heads_are_refused(server):
    # (an HTTP/1.1 request without Host is itself a 400, RFC 9112 section 3.2: the oversized
    # ones carry one so that their size is what is refused; tests/test_web_http11.py has the rest)
    cases = [
        (b"GARBAGE\r\n\r\n", b" 400 "),
        (b"GET /metrics HTTP/2.0\r\n\r\n", b" 505 "),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b" 400 "),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", b" 431 "),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100)) + b"\r\n", b" 431 "),
    ]
    for raw, expect in cases:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        try:
            s.sendall(raw)
        except OSError:
            pass  # the server may close before taking all of an oversized head
        reply = closed_by_server(s)
        s.close()
        assert expect in reply.split(b"\r\n", 1)[0], (raw[:40], reply[:80])
    assert request(server)[0] == 200  # and the server is fine


def test_idle_and_slow_connections_are_closed_and_counted(server):
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    assert closed_by_server(idle) == b""
    assert closed_by_server(slow).startswith(b"HTTP/1.1 408 ")
    idle.close()
    slow.close()
    wait_until(lambda: server.stats().timed_out.get("idle", 0) >= 1 and server.stats().timed_out.get("header", 0) >= 1, message="timeouts counted")
    assert server.stats().connections_open == 0 or wait_until(lambda: server.stats().connections_open == 0, message="no connection left")


def test_ceiling_evicts_idle_connections_and_scrapes_still_work(server):
    """Three times the ceiling in idle connections: the oldest idle ones give way, the open
    count never passes the ceiling, and a scrape arriving last is served."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(48)]
    try:
        wait_until(lambda: server.stats().evicted >= 48 - 16, message="evictions")
        assert server.stats().connections_open <= 16
        assert request(server)[0] == 200
        assert request(server, path="/readyz")[0] == 200
    finally:
        for s in socks:
            s.close()
    st = server.stats()
    assert st.connection_limit == 16 and st.requests.get("200", 0) >= 2


def test_request_bodies_are_not_read_and_the_connection_closes(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nGET /")
    reply = closed_by_server(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 405 ") and b"Connection: close" in reply


def test_a_scrapers_keep_alive_connection_outlives_an_idle_connection_flood():
    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), limits=Limits(max_connections=16, idle_timeout=120.0, header_timeout=120.0))
    publish(s, exposition())
    s.start()
    scraper = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    socks = []
    try:
        scraper.request("GET", "/metrics")
        assert scraper.getresponse().read() == s.source.exposition().body
        socks = [socket.create_connection(("127.0.0.1", s.port), timeout=20) for _ in range(64)]
        wait_until(lambda: s.stats().evicted >= 64 - 15, message="the flood evicting its own idle connections")
        scraper.request("GET", "/metrics")  # the same connection: it was not the one to go
        r = scraper.getresponse()
        assert (r.status, r.read()) == (200, s.source.exposition().body)
    finally:
        scraper.close()
        for x in socks:
            x.close()
        s.stop()


def test_a_probe_that_blocks_fails_itself_and_nothing_else():
    """A liveness check stuck on a lock (a wedged sampler) answers 503 after the probe timeout;
    /metrics and /readyz keep being served meanwhile."""
    import threading

    gate = threading.Event()

    def stuck() -> tuple[bool, str]:
        gate.wait(60)
        return True, "ok"

    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), liveness=stuck)
    publish(s, exposition())
    s.start()
    try:
        status, _, body = request(s, path="/healthz")
        assert status == 503 and b"did not answer" in body
        assert request(s)[0] == 200
        assert request(s, path="/readyz")[0] == 200  # its own thread: not queued behind liveness
        for _ in range(6):  # more than the queue: answered at once as busy, never piling up
            assert request(s, path="/healthz")[0] == 503
    finally:
        gate.set()
        s.stop()
