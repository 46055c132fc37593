"""Evidence that holds, and probes that tell the truth, on the whole agent.

The agent reads GPUs through NvmlBackend and nvidia-ml-py's real ctypes path against the fake
NVML library. A starved agent (CPU-bound threads in its own process, a slow GIL hand-over and an
HTTP flood against its own port) must blame itself, not the GPUs; a device call that truly
hangs must still become ``driver_hung``. Liveness fails only for a stuck sampler or event
thread. Every wait is for a state, bounded by a generous deadline; nothing is timed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pynvml
from clock_helpers import ManualClock
from fakes.fake_nvml import FakeNvml, installed
from kit_helpers import wait_until
from test_nvml_backend import GPU0, GPU1, idle_gpu

from exporter.agent import Agent
from exporter.config import Config
from exporter.devices.nvml import NvmlBackend
from exporter.health.model import Tier
from exporter.health.starvation import StarvationMonitor, read_throttled_seconds
from exporter.wiring import compose


def fetch(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@contextlib.contextmanager
def nvml_agent(serve: bool = True, **cfg_kw) -> Iterator[tuple[FakeNvml, Agent]]:
    # two healthy GPUs (busy_gpu's fixture fields say "reset pending", a real condition)
    fake = FakeNvml([idle_gpu(GPU0, pci_bus_id="00000000:3B:00.0", minor=0, serial="1650923000001"), idle_gpu()])
    with installed(fake):
        backend = NvmlBackend(event_wait_ms=50, lock_timeout_s=0.2)
        kw = dict(listen_host="127.0.0.1", listen_port=0, node_name="n1", interval=0.05, call_timeout=0.2, hung_after=1.0)
        kw.update(cfg_kw)
        agent = compose(Config(**kw), backend)
        agent.start(serve=serve)
        try:
            yield fake, agent
        finally:
            fake.release_all()
            agent.stop()


def conditions(agent: Agent) -> dict[str, set[str]]:
    return {u: {c.reason for c in h.conditions} for u, h in agent.health.all_health().items() if h.conditions}


@contextlib.contextmanager
def starving(url: str) -> Iterator[None]:
    """CPU-bound threads in the agent's own process, a slow GIL hand-over, and an HTTP flood
    against its own port."""
    stop = threading.Event()

    def burn() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(10_000):
                x += 1

    def flood() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                fetch(url + "/metrics", timeout=5)

    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # each busy thread holds the GIL 50 ms before handing it on
    threads = [threading.Thread(target=burn, daemon=True) for _ in range(12)] + [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        sys.setswitchinterval(old_switch)


# ------------------------------------------------------------------ the monitor itself


def test_cgroup_cpu_stat_v2_and_v1(tmp_path: Path):
    v2 = tmp_path / "v2"
    v2.write_text("usage_usec 1000\nuser_usec 600\nsystem_usec 400\nnr_periods 50\nnr_throttled 7\nthrottled_usec 250000\n")
    assert read_throttled_seconds(str(v2)) == (7, 0.25)
    v1 = tmp_path / "v1"
    v1.write_text("nr_periods 50\nnr_throttled 3\nthrottled_time 2000000000\n")
    assert read_throttled_seconds(str(v1)) == (3, 2.0)
    assert read_throttled_seconds(str(tmp_path / "missing")) is None
    (tmp_path / "junk").write_text("garbage\n")
    assert read_throttled_seconds(str(tmp_path / "junk")) is None


def test_throttling_lag_and_unstarted_calls_make_the_agent_starved_for_a_window(tmp_path: Path):
    clock = ManualClock(100.0)
    stat = tmp_path / "cpu.stat"
    stat.write_text("nr_periods 10\nnr_throttled 0\nthrottled_usec 0\n")
    m = StarvationMonitor(threshold=1.0, window=10.0, cpu_stat=str(stat), clock=clock)
    m.note_throttling()
    clock.advance(1.0)
    stat.write_text("nr_periods 20\nnr_throttled 1\nthrottled_usec 10000\n")  # 1 % of the second: noise
    m.note_throttling()
    assert not m.state().starved
    clock.advance(1.0)
    stat.write_text("nr_periods 30\nnr_throttled 9\nthrottled_usec 510000\n")  # half the second
    m.note_throttling()
    st = m.state()
    assert st.starved and "throttled" in st.reason
    clock.advance(10.1)
    assert not m.state().starved  # the window has passed with no new signal

    m.note_lag("the sampler", 0.5)  # below the threshold: recorded, not starvation
    st = m.state()
    assert not st.starved and st.lag_seconds == 0.5
    m.note_lag("the sampler", 1.5)
    assert m.state().starved and m.state().lag_seconds == 1.5
    clock.advance(10.1)
    assert m.state() == m.state() and not m.state().starved and m.state().lag_seconds == 0.0
    m.note_unstarted("GPU-x")
    assert m.state().starved and "GPU-x" in m.state().reason


# ------------------------------------------------------------------ starvation vs a hang


def test_a_starved_agent_blames_itself_not_the_gpus():
    # --hung-after 1 s: without telling starvation apart, a call slowed past a second by the
    # starving threads would become driver_hung (fatal) on a healthy GPU.
    with nvml_agent() as (_fake, agent):
        url = agent.server.url
        wait_until(lambda: agent.cycles >= 3, timeout=30, message="first cycles")
        assert conditions(agent) == {}
        unhealthy: list[str] = []
        agent.health.subscribe(lambda u: unhealthy.append(u) if not agent.health.health(u).healthy else None)

        with starving(url):
            # starved, and device reads really missed their deadline meanwhile
            wait_until(lambda: agent.starvation.state().starved, timeout=60, message="the agent to notice it is starved")
            wait_until(lambda: any(r == "late" for (_, r) in agent.health.counters()[1]), timeout=120, message="a late device read")
            _ok, reason = agent.readiness()
            assert "agent starved of CPU" in reason
            assert agent.liveness()[0]  # starving is no reason for a restart
        cycles = agent.cycles
        wait_until(lambda: agent.cycles >= cycles + 3, timeout=60, message="cycles after the load")

        status, body = fetch(url + "/metrics")
        assert status == 200
        text = body.decode()
        assert 'dra_gpu_exporter_starved{node="n1"}' in text
        read_errors = agent.health.counters()[1]
        assert not [k for k in read_errors if k[1] == "timeout"], read_errors
        assert unhealthy == [] and conditions(agent) == {}, conditions(agent)
        assert agent.health.health(GPU0).healthy and agent.health.health(GPU1).healthy


def test_a_call_that_truly_hangs_becomes_driver_hung():
    with nvml_agent() as (fake, agent):
        wait_until(lambda: agent.cycles >= 2, timeout=30, message="first cycles")
        hang = fake.hang("nvmlDeviceGetUtilizationRates", uuid=GPU0)
        wait_until(lambda: "driver_hung" in conditions(agent).get(GPU0, set()), timeout=120, message="driver_hung on GPU0")
        (c,) = [c for c in agent.health.health(GPU0).conditions if c.reason == "driver_hung"]
        assert c.tier is Tier.FATAL and "hung after 1s" in c.evidence
        assert agent.health.health(GPU1).healthy
        assert "hung device calls" in agent.readiness()[1]
        hang.release()


def test_a_hang_younger_than_hung_after_is_only_late():
    with nvml_agent(hung_after=3600) as (fake, agent):
        wait_until(lambda: agent.cycles >= 2, timeout=30, message="first cycles")
        fake.hang("nvmlDeviceGetUtilizationRates", uuid=GPU0)
        wait_until(lambda: agent.health.counters()[1].get((GPU0, "late"), 0) >= 3, timeout=60, message="late reads of GPU0")
        assert agent.health.health(GPU0).healthy
        assert "slow device calls" in agent.readiness()[1]


# ------------------------------------------------------------------ liveness


def test_liveness_fails_for_a_stuck_sampler_and_recovers():
    with nvml_agent() as (_fake, agent):
        agent.LIVENESS_FLOOR = 0.5
        url = agent.server.url
        wait_until(lambda: fetch(url + "/healthz")[0] == 200, timeout=30, message="alive")
        with agent._cycle_lock:  # a sampler stuck inside a cycle
            _status, body = wait_until(lambda: (r := fetch(url + "/healthz"))[0] == 503 and r, timeout=60, message="not alive")
            assert b"sampler stuck" in body
        wait_until(lambda: fetch(url + "/healthz")[0] == 200, timeout=60, message="alive again")


def test_liveness_fails_for_a_stuck_event_thread_and_recovers():
    with nvml_agent() as (fake, agent):
        agent.EVENT_STALL = 0.5
        url = agent.server.url
        wait_until(lambda: fetch(url + "/healthz")[0] == 200, timeout=30, message="alive")
        gate = threading.Event()
        agent.health.subscribe(lambda u: gate.wait(60))  # the event thread delivers into this
        fake.queue_event(GPU1, pynvml.nvmlEventTypeXidCriticalError, data=13)
        _status, body = wait_until(lambda: (r := fetch(url + "/healthz"))[0] == 503 and r, timeout=60, message="not alive")
        assert b"event thread stuck" in body
        gate.set()
        wait_until(lambda: fetch(url + "/healthz")[0] == 200, timeout=60, message="alive again")


def test_a_starved_agent_with_remediation_on_writes_no_rule(tmp_path: Path):
    """The whole chain, enforce mode: the node's ResourceSlice in NVIDIA's format in the API
    emulation, pods holding the GPUs, the remediator running. Starving the agent taints nothing."""
    from fakes.fake_nvml import FakeGpu
    from k8s_helpers import publish_scenario, running_apiserver, write_kubeconfig

    from drasim import objects
    from drasim.kubelet import FakeKubelet
    from drasim.scenario import parse_scenario
    from exporter.config import TaintMode
    from exporter.wiring import build_agent

    sc = parse_scenario({
        "node": "starved-node",
        "gpus": [{"name": "gpu0"}, {"name": "gpu1"}],
        "claims": [{"namespace": "a", "name": "c0", "devices": ["gpu0"]}, {"namespace": "a", "name": "c1", "devices": ["gpu1"]}],
        "pods": [{"namespace": "a", "name": "p0", "containers": [{"name": "m", "claims": ["c0"]}]},
                 {"namespace": "a", "name": "p1", "containers": [{"name": "m", "claims": ["c1"]}]}],
    }, "starved")  # fmt: skip
    fake = FakeNvml([FakeGpu(g.uuid, pci_bus_id=g.pci_bus_id, minor=i, serial=f"16509230000{i}") for i, g in enumerate(sc.gpus)])
    sock = tempfile_socket()
    kubelet = FakeKubelet(sock, qps=None)
    kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
    kubelet.start()
    agent = None
    try:
        with running_apiserver("1.37", bookmark_interval=0.2) as api, installed(fake):
            publish_scenario(api, sc)
            cfg = Config(
                listen_host="127.0.0.1", listen_port=0, node_name=sc.node, kubelet_socket=sock,
                kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", api.url)), backend="nvml", interval=0.05,
                call_timeout=0.2, hung_after=1.0, taint_mode=TaintMode.ENFORCE,
            )
            agent = build_agent(cfg, backend=NvmlBackend(event_wait_ms=50, lock_timeout_s=0.2), remediation_resync=0.2)
            agent.start()
            wait_until(lambda: agent.src.get("slices").watcher.synced and agent.snapshot is not None and len(agent.snapshot.claims) == 2, timeout=60, message="slices and claims joined")
            assert conditions(agent) == {}
            with starving(agent.server.url):
                wait_until(lambda: agent.starvation.state().starved, timeout=60, message="the agent to notice it is starved")
                wait_until(lambda: any(r == "late" for (_, r) in agent.health.counters()[1]), timeout=120, message="a late device read")
            cycles = agent.cycles
            wait_until(lambda: agent.cycles >= cycles + 5, timeout=60, message="cycles after the load")
            assert conditions(agent) == {}
            assert api.list("resource.k8s.io", "devicetaintrules") == []
            assert all(c.healthy for c in agent.snapshot.claims)
    finally:
        if agent is not None:
            agent.stop()
        kubelet.stop()


def tempfile_socket() -> str:
    import tempfile

    return str(Path(tempfile.mkdtemp(prefix="dra-starve-")) / "kubelet.sock")  # short: unix socket path limit
