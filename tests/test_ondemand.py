"""Render on demand (``Expositions`` in exporter/metrics/server.py): a cycle's state is rendered
when something asks for its bytes, at most once per cycle, off the HTTP event loop.

Against the real renderer and the real HTTP server on a real socket, and the whole agent on a
simulated node (real kubelet gRPC and API server peers). Where a render must be held in flight
to see who waits for it, the real Renderer is subclassed with a gate that holds ``render`` until
the test opens it; every wait is for a state, bounded by a generous deadline; no timing asserted.
"""

from __future__ import annotations

import gzip
import http.client
import socket
import struct
import threading

import pytest
from kit_helpers import fetch, wait_until
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from drasim.scenario import default_scenario
from exporter.metrics.render import Exposition, Renderer, RenderState
from exporter.metrics.server import Expositions, MetricsServer
from exporter.metrics.web import Limits

PLAIN: dict[str, str] = {}
OM_GZIP = {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}


def cycles_of(body: bytes) -> float:
    fams = text_string_to_metric_families(body.decode())
    return next(s.value for f in fams for s in f.samples if s.name == "dra_gpu_exporter_cycles_total")


def om_cycles(body: bytes) -> float:
    fams = om_families(body.decode())
    return next(s.value for f in fams for s in f.samples if s.name == "dra_gpu_exporter_cycles_total")


def bad_state() -> RenderState:
    """A state the real renderer cannot render (a collector duration that is no number): what a
    renderer bug for one cycle looks like from the outside."""
    return RenderState(cycles=99, collectors={"devices": ("not a number", True)})  # type: ignore[dict-item]


class GatedRenderer(Renderer):
    """The real renderer, holding each render until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def render(self, state: RenderState) -> Exposition:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().render(state)


@pytest.fixture
def served():
    """(server, Expositions, renderer): the server serving an Expositions over a gated renderer (gate open)."""
    renderer = GatedRenderer()
    renderer.gate.set()
    od = Expositions(renderer)
    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), limits=Limits(max_connections=32, idle_timeout=30.0, header_timeout=30.0))
    s.serve_from(od)
    s.start()
    try:
        yield s, od, renderer
    finally:
        renderer.gate.set()
        s.stop()


def get(s: MetricsServer, headers: dict[str, str] = PLAIN, path: str = "/metrics") -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    try:
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def busy(s: MetricsServer) -> int:
    """Connections whose request the handler is answering (waiting for the render)."""
    return sum(1 for c in list(s._http._conns.values()) if c.phase == "busy")


# ------------------------------------------------------------------ on demand, at most once per cycle


def test_a_published_state_is_rendered_only_when_asked_and_once(served):
    s, od, renderer = served
    assert get(s)[0] == 503  # nothing published: nothing true to say yet
    for n in range(1, 6):
        od.publish(RenderState(cycles=n))
    assert od.published and renderer.calls == 0 and od.renders == 0  # five cycles, nobody asked
    status, _, body = get(s)
    assert status == 200 and cycles_of(body) == 5  # the newest state, rendered for this scrape
    assert renderer.calls == 1
    for _ in range(3):  # the same cycle again, in every form: no second render
        assert cycles_of(get(s)[2]) == 5
        assert get(s, OM_GZIP)[0] == 200
    assert renderer.calls == 1 and od.renders == 1


def test_a_scrape_after_a_cycle_gets_that_cycles_values():
    """The whole agent, cycles driven by hand, read back over HTTP: each scrape shows the cycle
    just run, and a cycle nobody scrapes is never rendered."""
    from test_agent_isolation import simulated_node

    with simulated_node(default_scenario()) as node:
        agent = node.agent
        assert agent.expositions.renders == 0  # start() ran the first cycle; nobody scraped it
        for _ in range(5):
            agent.run_cycle()
            status, body = fetch(agent.server.url + "/metrics")
            assert status == 200 and cycles_of(body) == agent.cycles
        renders = agent.expositions.renders
        for _ in range(4):  # nobody scrapes any more: none of these is rendered
            agent.run_cycle()
        assert agent.expositions.renders == renders
        status, body = fetch(agent.server.url + "/metrics")
        assert status == 200 and cycles_of(body) == agent.cycles
        assert fetch(agent.server.url + "/readyz") == (200, b"ready\n")


# ------------------------------------------------------------------ sharing, and off the event loop


def test_concurrent_scrapes_share_one_render_and_other_requests_go_on(served):
    s, od, renderer = served
    od.publish(RenderState(cycles=1))
    assert get(s)[0] == 200  # a first cycle rendered
    od.publish(RenderState(cycles=2))
    renderer.gate.clear()
    renderer.entered.clear()
    results: list[tuple[int, dict[str, str], bytes]] = []
    lock = threading.Lock()

    def scrape(headers: dict[str, str]) -> None:
        r = get(s, headers)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=scrape, args=(h,)) for h in [PLAIN] * 4 + [OM_GZIP] * 4]
    for t in threads:
        t.start()
    assert renderer.entered.wait(60)
    wait_until(lambda: busy(s) == 8, timeout=60, message="eight scrapes waiting for the render")
    # the render holds no one else up: the event loop answers while it is in flight
    assert get(s, path="/healthz")[:1] == (200,)
    assert od.cached("body") is None  # the new cycle is not served before it is rendered
    renderer.gate.set()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(r[0] == 200 for r in results)
    exp = od.exposition()
    assert exp is not None
    plain = [r[2] for r in results if "Content-Encoding" not in r[1]]
    zipped = [gzip.decompress(r[2]) for r in results if r[1].get("Content-Encoding") == "gzip"]
    assert plain == [exp.body] * 4 and zipped == [exp.openmetrics] * 4 and cycles_of(exp.body) == 2
    assert renderer.calls == 2 and od.renders == 2  # the first cycle's, and one for the eight scrapes


def test_a_scraper_that_leaves_does_not_cancel_the_render_others_wait_for(served):
    s, od, renderer = served
    od.publish(RenderState(cycles=1))
    assert get(s)[0] == 200
    od.publish(RenderState(cycles=2))
    renderer.gate.clear()
    renderer.entered.clear()
    out: dict[str, tuple[int, dict[str, str], bytes]] = {}
    first = threading.Thread(target=lambda: out.setdefault("plain", get(s)))
    first.start()  # its job renders (held at the gate)
    assert renderer.entered.wait(60)
    # Two scrapes of another form wait behind the render.
    leaver = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    leaver.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\nAccept-Encoding: gzip\r\n\r\n")
    stayer = threading.Thread(target=lambda: out.setdefault("gzip", get(s, OM_GZIP)))
    stayer.start()
    wait_until(lambda: busy(s) == 3, timeout=60, message="three scrapes waiting")
    # gone (a reset: a client that only half-closes still gets its answer): the server cancels its handler
    leaver.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    leaver.close()
    wait_until(lambda: busy(s) == 2, timeout=60, message="the leaver's connection closed")
    renderer.gate.set()
    first.join(60)
    stayer.join(60)
    assert out["plain"][0] == 200 and out["gzip"][0] == 200 and om_cycles(gzip.decompress(out["gzip"][2])) == 2


# ------------------------------------------------------------------ a failed render


def test_a_failed_render_is_isolated(served):
    s, od, _ = served
    od.publish(bad_state())
    with capture_logs() as logs:
        status, _, body = get(s)
        assert (status, body) == (500, b"metrics could not be rendered: see the agent's log and /readyz\n")
        assert get(s, OM_GZIP)[0] == 500  # the same state is not rendered again
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["metrics_render_failed"]
    assert od.failures == 1 and not od.rendered and od.error is not None and od.error.startswith("metrics render failed: ValueError")
    assert get(s, path="/healthz")[0] == 200  # the endpoint lives on
    od.publish(RenderState(cycles=5))
    good = get(s)[2]
    assert cycles_of(good) == 5 and od.error is None
    od.publish(bad_state())
    assert get(s) == get(s) and get(s)[2] == good  # the last good exposition, served again
    status, _, body = get(s, OM_GZIP)  # a form of it not made yet: made, the bad state not retried
    assert status == 200 and om_cycles(gzip.decompress(body)) == 5
    assert od.failures == 2 and od.rendered
    od.publish(RenderState(cycles=7))
    assert cycles_of(get(s)[2]) == 7 and od.error is None


def test_a_failed_render_shows_in_readyz_and_the_next_cycle_recovers():
    from test_agent_isolation import simulated_node

    with simulated_node(default_scenario()) as node:
        agent = node.agent
        status, good = fetch(agent.server.url + "/metrics")
        assert status == 200
        agent.expositions.publish(bad_state())  # as if the renderer broke on this cycle's state
        assert fetch(agent.server.url + "/metrics") == (200, good)  # the last good cycle's bytes
        status, why = fetch(agent.server.url + "/readyz")
        assert status == 200 and why.decode().startswith("ready (degraded)\n")
        assert "metrics render failed: ValueError" in why.decode() and "serving the last metrics rendered" in why.decode()
        agent.run_cycle()
        status, body = fetch(agent.server.url + "/metrics")
        assert status == 200 and cycles_of(body) == agent.cycles
        assert fetch(agent.server.url + "/readyz") == (200, b"ready\n")
