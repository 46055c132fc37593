"""The real HTTP server, started by the Agent over a simulated node, scraped with urllib.

/metrics (values, node label, gzip, HEAD), /healthz, /readyz telling the truth about a hung
device and a stalled sampler, and `promtool check metrics` finding nothing in the body.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from kit_helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from drasim import objects
from drasim.backend import SimBackend, SimClock
from drasim.kubelet import FakeKubelet
from drasim.scenario import default_scenario, parse_scenario
from exporter import __version__
from exporter.agent import Agent
from exporter.catalog import BY_NAME
from exporter.config import Config
from exporter.devices.model import DeviceIdentity, Vendor
from exporter.k8s.model import SliceDevice
from exporter.kubelet.client import PodResourcesClient
from exporter.kubelet.model import AllocationSource, ContainerAllocation
from exporter.metrics.render import Renderer, RenderState
from exporter.metrics.server import CONTENT_TYPE, MetricsServer
from exporter.model.join import JoinInputs, join
from exporter.wiring import compose

PROMTOOL = shutil.which("promtool")


def fetch(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def samples(body: bytes) -> list:
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def value(body: bytes, name: str, **labels: str) -> float | None:
    hits = [s.value for s in samples(body) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) <= 1, f"{name}{labels} matches {len(hits)} series"
    return hits[0] if hits else None




def config(**kw) -> Config:
    base = dict(listen_host="127.0.0.1", listen_port=0, node_name="node-t", interval=3600.0, call_timeout=1.0)
    base.update(kw)
    return Config(**base)


@contextmanager
def running(agent: Agent):
    agent.start(serve=True)
    try:
        yield agent.server.url
    finally:
        agent.stop()


def sim(scenario, t: float = 0.0) -> SimBackend:
    # a clock that barely moves: the test decides which part of the scenario is in effect
    return SimBackend(scenario, SimClock(scale=1e-6, start_offset=t))


TWO = parse_scenario(
    {"node": "node-t", "gpus": [{"name": "a", "utilization": 0.25, "memory_used": 0.5, "memory": "80Gi"}, {"name": "b", "utilization": 0.75}]},
    "two",
)


# ------------------------------------------------------------------ /metrics


def test_metrics_values_and_every_series_has_node():
    agent = compose(config(), sim(TWO))
    with running(agent) as url:
        status, headers, body = fetch(url + "/metrics")
    assert status == 200
    assert headers["Content-Type"] == CONTENT_TYPE
    assert int(headers["Content-Length"]) == len(body)
    a, b = TWO.gpus
    assert value(body, "gpu_info", uuid=a.uuid, vendor="nvidia", model=a.model, pci_bus_id=a.pci_bus_id, driver_version=TWO.driver_version, parent_uuid="", mig_profile="") == 1
    assert value(body, "gpu_up", uuid=a.uuid) == 1 and value(body, "gpu_up", uuid=b.uuid) == 1
    assert value(body, "gpu_utilization_ratio", uuid=a.uuid) == pytest.approx(0.25)
    assert value(body, "gpu_utilization_ratio", uuid=b.uuid) == pytest.approx(0.75)
    assert value(body, "gpu_memory_used_bytes", uuid=a.uuid) == 40 * 2**30
    assert value(body, "gpu_memory_total_bytes", uuid=a.uuid) == 80 * 2**30
    assert value(body, "gpu_power_watts", uuid=b.uuid) == pytest.approx(70 + 630 * 0.75)
    assert value(body, "gpu_ecc_errors_total", uuid=a.uuid, type="uncorrectable") == 0
    assert value(body, "gpu_healthy", uuid=a.uuid) == 1
    assert value(body, "dra_gpu_exporter_build_info", version=__version__) == 1
    assert value(body, "dra_gpu_exporter_collector_success", collector="devices") == 1
    assert value(body, "dra_gpu_exporter_cycles_total") >= 1
    assert value(body, "dra_gpu_exporter_remediation_active", mode="enforce") == 0  # no Kubernetes API: no rules
    for s in samples(body):
        assert s.labels.get("node") == "node-t", s
    # every family served is in the catalog (docs/metrics.md documents the catalog)
    for fam in text_string_to_metric_families(body.decode()):
        assert fam.name in BY_NAME or fam.name + "_total" in BY_NAME, fam.name


def test_unresolved_devices_is_zero_not_absent_for_each_slice_driver():
    """Alerts and dashboards rely on dra_unresolved_devices existing for every DRA driver of
    the node: 0 while all its allocated devices resolve, absent only while slices are unknown."""
    nv = "gpu.nvidia.com"
    ident = DeviceIdentity(uuid="GPU-00000000-1111-2222-3333-444444444444", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0, minor=0)
    published = {(nv, "node-t", name): SliceDevice(driver=nv, pool="node-t", name=name, attributes=attrs)
                 for name, attrs in (("gpu-0", {f"{nv}/uuid": ident.uuid}), ("odd", {}))}

    def scrape(slices, devices=("gpu-0",)) -> bytes:
        allocations = tuple(
            ContainerAllocation(namespace="ml", pod="p", container="c", source=AllocationSource.DRA, driver=nv, pool="node-t", device=d,
                                claim_namespace="ml", claim_name="claim")
            for d in devices
        )
        snap = join(JoinInputs(node="node-t", timestamp=0.0, identities=(ident,), readings={}, health={}, allocations=allocations, slices=slices))
        return Renderer().render(RenderState(snapshot=snap)).body

    assert value(scrape(published), "dra_unresolved_devices", driver=nv, node="node-t") == 0
    assert value(scrape(published, ()), "dra_unresolved_devices", driver=nv) == 0
    assert value(scrape(published, ("gpu-0", "odd")), "dra_unresolved_devices", driver=nv) == 1
    assert value(scrape(None), "dra_unresolved_devices", driver=nv) is None


def test_excluded_metrics_are_left_out_and_nothing_else_is():
    """--exclude-metrics (a cardinality control): the named families disappear from /metrics,
    counters by their full _total name included, and every other family is still served."""
    from exporter.config import build_parser, resolve

    cfg = resolve(build_parser().parse_args(["--node-name", "node-t", "--exclude-metrics", "gpu_*_clock_hertz,gpu_ecc_errors_total,dra_claim_pods"]))
    assert cfg.exclude_metrics == {"gpu_sm_clock_hertz", "gpu_memory_clock_hertz", "gpu_ecc_errors_total", "dra_claim_pods"}
    families = {}
    for excluded in (frozenset(), cfg.exclude_metrics):
        agent = compose(config(exclude_metrics=excluded), sim(TWO))
        with running(agent) as url:
            _, _, body = fetch(url + "/metrics")
        families[excluded] = {fam.name for fam in text_string_to_metric_families(body.decode())}
    full, trimmed = families[frozenset()], families[cfg.exclude_metrics]
    assert {"gpu_sm_clock_hertz", "gpu_memory_clock_hertz", "gpu_ecc_errors"} <= full  # the parser drops _total
    assert full - trimmed == {"gpu_sm_clock_hertz", "gpu_memory_clock_hertz", "gpu_ecc_errors", "dra_claim_pods"}


def test_gzip_head_healthz_and_404():
    agent = compose(config(), sim(TWO))
    with running(agent) as url:
        _, _, plain = fetch(url + "/metrics")
        status, headers, zipped = fetch(url + "/metrics", {"Accept-Encoding": "gzip, deflate"})
        assert status == 200 and headers.get("Content-Encoding") == "gzip"
        assert gzip.decompress(zipped) == plain  # the same cycle's bytes, compressed once
        status, headers, body = fetch(url + "/metrics", method="HEAD")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(plain)
        status, _, body = fetch(url + "/healthz")
        assert (status, body) == (200, b"ok\n")
        assert fetch(url + "/nothing-here")[0] == 404
        assert fetch(url + "/")[0] == 200


def test_concurrent_scrapes_get_whole_bodies():
    agent = compose(config(interval=0.05), sim(default_scenario()))
    with running(agent) as url:
        bodies: list[bytes] = []
        errors: list[BaseException] = []

        def scrape():
            try:
                for _ in range(5):
                    bodies.append(fetch(url + "/metrics")[2])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=scrape) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors
    assert len(bodies) == 40
    for body in bodies:  # each one complete and parseable, never a half-rendered cycle
        assert value(body, "dra_gpu_exporter_build_info", version=__version__) == 1
        assert len([s for s in samples(body) if s.name == "gpu_info"]) == 7


# ------------------------------------------------------------------ /readyz


def test_ready_after_first_cycle():
    agent = compose(config(), sim(TWO))
    with running(agent) as url:
        status, _, body = fetch(url + "/readyz")
        assert (status, body) == (200, b"ready\n")


def test_hung_device_is_down_others_are_served_and_readyz_names_it():
    sc = parse_scenario(
        {"node": "node-t", "gpus": [{"name": "a", "utilization": 0.4}, {"name": "b", "utilization": 0.6}], "faults": [{"kind": "hang", "gpu": "b", "at": 0}]},
        "hang",
    )
    a, b = sc.gpus
    # --hung-after 0: a call still stuck at its deadline is a hung device at once (unless the
    # agent itself is starved, then a later cycle tells)
    agent = compose(config(call_timeout=0.5, hung_after=0), sim(sc, 1.0))
    with running(agent) as url:
        # more cycles: the stuck lane now fails fast
        wait_until(lambda: (agent.run_cycle(), not agent.health.health(b.uuid).healthy)[1], timeout=60, message="driver_hung")
        _, _, body = fetch(url + "/metrics")
        status, _, ready = fetch(url + "/readyz")
    assert value(body, "gpu_up", uuid=b.uuid) == 0
    assert value(body, "gpu_utilization_ratio", uuid=b.uuid) is None  # no stale values for a hung GPU
    assert value(body, "gpu_up", uuid=a.uuid) == 1
    assert value(body, "gpu_utilization_ratio", uuid=a.uuid) == pytest.approx(0.4)
    assert value(body, "gpu_read_errors_total", uuid=b.uuid, reason="timeout") >= 1
    assert value(body, "gpu_healthy", uuid=b.uuid) == 0
    assert value(body, "dra_gpu_exporter_collector_success", collector="devices") == 1
    # still ready (the other devices are fresh), and the body says which device is stuck
    assert status == 200
    text = ready.decode()
    assert text.startswith("ready (degraded)") and "hung device calls" in text and b.uuid in text


def test_stalled_sampler_makes_readyz_fail_and_recover():
    # interval 0.05 s and call timeout 0.05 s: device data older than 0.2 s is stale
    agent = compose(config(interval=0.05, call_timeout=0.05), sim(TWO))
    with running(agent) as url:
        wait_until(lambda: fetch(url + "/readyz")[0] == 200, message="ready")
        # A sampler stuck inside a cycle (a kubelet or API call that does not return) holds
        # the cycle lock; holding it here stalls the real sampler thread the same way.
        with agent._cycle_lock:
            _status, _, body = wait_until(lambda: (r := fetch(url + "/readyz"))[0] == 503 and r, message="not ready")
            assert b"sampler stalled" in body and b"last successful device collection" in body
            # metrics are still served (the last good cycle), only readiness says they are old
            assert fetch(url + "/metrics")[0] == 200
            assert fetch(url + "/healthz")[0] == 200  # alive: a restart would not help
        wait_until(lambda: fetch(url + "/readyz")[0] == 200, message="ready again")


def test_readiness_before_any_cycle_and_a_broken_probe():
    def broken() -> tuple[bool, str]:
        raise RuntimeError("probe bug")

    agent = compose(config(), sim(TWO))
    ok, reason = agent.readiness()
    assert not ok and reason.startswith("not ready: no successful device collection yet")
    server = MetricsServer("127.0.0.1", 0, broken)
    server.start()
    try:
        status, _, body = fetch(server.url + "/readyz")
        assert status == 503 and body == b"readiness check failed: probe bug\n"
    finally:
        server.stop()


def test_probes_answer_while_the_device_library_is_still_opening():
    """A driver can take many seconds to initialise. The server comes first, so the kubelet's
    probes get answers (alive, not ready) instead of connection refused, and a start that
    then fails releases the port."""

    class SlowToOpen(SimBackend):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.opening, self.release, self.fail = threading.Event(), threading.Event(), False

        def open(self) -> None:
            self.opening.set()
            assert self.release.wait(10)
            if self.fail:
                raise RuntimeError("driver init failed")
            super().open()

    backend = SlowToOpen(TWO, SimClock(scale=1e-6))
    agent = compose(config(), backend)
    starting = threading.Thread(target=agent.start)
    starting.start()
    try:
        assert backend.opening.wait(10)
        url = agent.server.url
        assert fetch(url + "/healthz")[0] == 200
        status, _, body = fetch(url + "/readyz")
        assert status == 503 and b"no successful device collection yet" in body
        status, _, body = fetch(url + "/metrics")  # nothing true to say yet: not an empty 200
        assert status == 503 and b"first collection cycle" in body
    finally:
        backend.release.set()
        starting.join(10)
    try:
        wait_until(lambda: fetch(url + "/readyz")[0] == 200, message="ready after the first cycle")
    finally:
        agent.stop()

    failing = SlowToOpen(TWO, SimClock(scale=1e-6))
    failing.fail = True
    failing.release.set()
    bad = compose(config(), failing)
    with pytest.raises(RuntimeError, match="driver init failed"):
        bad.start()
    assert bad.server is None  # stopped: the port is free again


def test_listen_on_a_taken_port_is_a_clear_error():
    first = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"))
    try:
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{first.port}"):
            MetricsServer("127.0.0.1", first.port, lambda: (True, "ready"))
    finally:
        first.stop()


# ------------------------------------------------------------------ promtool


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's `prometheus` package (CI does)")
@pytest.mark.parametrize("dcgm_compat", [False, True])
def test_promtool_finds_nothing(tmp_path, dcgm_compat):
    """The whole body, with attribution from a real kubelet socket, lints clean."""
    sc = default_scenario()
    sock = str(tmp_path / "kubelet.sock")
    with FakeKubelet(sock, qps=None) as kubelet:
        kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
        cfg = config(node_name=sc.node, dcgm_compat_labels=dcgm_compat, pod_label_allowlist=("app", "team"))
        agent = compose(cfg, sim(sc, 120.0), kubelet=PodResourcesClient(sock))
        with running(agent) as url:
            _, _, body = fetch(url + "/metrics")
    names = {s.name for s in samples(body)}
    assert {"dra_device_allocation_info", "dra_claim_devices", "gpu_utilization_ratio", "dra_pod_labels"} <= names
    assert value(body, "dra_gpu_exporter_collector_success", collector="kubelet") == 1
    if not dcgm_compat:
        # labels are exactly the catalog's (plus node), so the docs/metrics.md reference is the truth
        for fam in text_string_to_metric_families(body.decode()):
            d = BY_NAME.get(fam.name) or BY_NAME.get(fam.name + "_total")
            if fam.name == "dra_pod_labels":
                continue  # label_<key> labels come from --pod-label-allowlist
            for smp in fam.samples:
                extra = {"le"} if smp.name.endswith("_bucket") else set()
                assert set(smp.labels) == {"node", *d.labels} | extra, (smp.name, smp.labels)
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"" and r.stderr == b"", (r.stdout + r.stderr).decode()
