"""reading_stuck (issue 23, item 4): a reading that stops moving while the device reports
activity is a condition to see, not zeros to believe, and never a taint.

The health engine's rules on a fake clock; remediation's plan given only that condition; then the
whole agent: nvidia-ml-py's real ctypes path against the fake NVML library, the repository's
Kubernetes API emulation over HTTP, the agent built by the production wiring in enforce mode. A
GPU whose energy counter is frozen while it draws power gets a degraded reading_stuck series on
/metrics and no DeviceTaintRule, while an XID 79 on its neighbour gets one (so a remediation pass
did see the stuck GPU and wrote nothing for it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pynvml
import pytest
from clock_helpers import ManualClock
from fakes.fake_nvml import FI_ENERGY, FakeGpu, FakeNvml, installed
from k8s_helpers import publish_scenario, running_apiserver, wait_until, write_kubeconfig
from kit_helpers import scrape_samples

from drasim import objects
from drasim.kubelet import FakeKubelet
from drasim.scenario import parse_scenario
from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceIdentity, DeviceReading, ReadError, Vendor
from exporter.devices.nvml import NvmlBackend
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.health.model import READING_STUCK, Tier
from exporter.remediation.contract import Action, Target
from exporter.remediation.plan import Safety, decide
from exporter.wiring import build_agent

T0 = 1_750_000_000.0
G = DeviceIdentity(uuid="GPU-00000000-0000-0000-0000-000000000001", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0)
POLICY = HealthPolicy(stuck_after=300.0, stuck_busy_utilization=0.5)


def reading(energy: float | None = 1000.0, power: float | None = 300.0, util: float | None = 0.9, sm: float | None = 0.8, **kw) -> DeviceReading:
    return DeviceReading(uuid=G.uuid, energy_joules=energy, power_watts=power, utilization_ratio=util, sm_active_ratio=sm, **kw)


def engine() -> tuple[ManualClock, HealthEngine]:
    clock = ManualClock(T0)
    return clock, HealthEngine(clock, POLICY)


def stuck(h: HealthEngine) -> list[str]:
    health = h.health(G.uuid)
    assert health.healthy and health.worst is None and not health.conditions  # never a fault of the GPU
    return [c.evidence for c in health.advisories if c.reason == READING_STUCK and c.tier == Tier.DEGRADED]


def test_energy_flat_under_power_for_the_while_is_stuck_and_clears_when_it_moves():
    clock, h = engine()
    h.observe([G], {G.uuid: reading()})
    clock.advance(299)
    h.observe([G], {G.uuid: reading()})
    assert stuck(h) == []
    clock.advance(1)
    h.observe([G], {G.uuid: reading()})
    (evidence,) = stuck(h)
    assert "energy counter stuck at 1000 J for 300s while drawing 300 W" == evidence
    clock.advance(10)
    h.observe([G], {G.uuid: reading(energy=1003.0)})
    assert stuck(h) == []


def test_idle_unsupported_or_unreadable_is_not_stuck():
    clock, h = engine()
    for r in (reading(power=0.0), reading(power=None), reading(energy=None)):
        h.observe([G], {G.uuid: r})
        clock.advance(400)
        h.observe([G], {G.uuid: r})
        assert stuck(h) == []
    # power dropped to 0 for one reading: the streak starts again
    h.observe([G], {G.uuid: reading()})
    clock.advance(200)
    h.observe([G], {G.uuid: reading(power=0.0)})
    clock.advance(200)
    h.observe([G], {G.uuid: reading()})
    assert stuck(h) == []
    # a failed read ends a stuck verdict (no reading, no verdict); a late one changes nothing
    clock.advance(300)
    h.observe([G], {G.uuid: reading()})
    assert stuck(h)
    h.observe([G], {G.uuid: DeviceReading.failed(G.uuid, ReadError.LATE)})
    assert stuck(h)
    h.observe([G], {G.uuid: DeviceReading.failed(G.uuid, ReadError.ERROR)})
    assert stuck(h) == []


def test_profiling_ratios_at_zero_while_busy_are_stuck():
    clock, h = engine()
    zeros = dict(sm=0.0, sm_occupancy_ratio=0.0, tensor_active_ratio=0.0, dram_active_ratio=0.0)
    h.observe([G], {G.uuid: reading(energy=None, **zeros)})
    clock.advance(300)
    h.observe([G], {G.uuid: reading(energy=None, **zeros)})
    assert stuck(h) == ["profiling ratios at exactly 0 for 300s while utilization is 90%"]
    # one ratio alive: a workload without tensor work is not a frozen stream
    h.observe([G], {G.uuid: reading(energy=None, **{**zeros, "sm": 0.4})})
    assert stuck(h) == []
    # zeros on an idle GPU are just idle
    h.observe([G], {G.uuid: reading(energy=None, util=0.1, **zeros)})
    clock.advance(600)
    h.observe([G], {G.uuid: reading(energy=None, util=0.1, **zeros)})
    assert stuck(h) == []


def test_both_readings_stuck_make_one_condition_naming_both():
    clock, h = engine()
    h.observe([G], {G.uuid: reading(sm=0.0)})
    clock.advance(300)
    h.observe([G], {G.uuid: reading(sm=0.0)})
    (evidence,) = stuck(h)
    assert evidence.startswith("energy counter stuck") and "; profiling ratios at exactly 0" in evidence


def test_the_check_can_be_turned_off():
    clock = ManualClock(T0)
    h = HealthEngine(clock, HealthPolicy(stuck_after=0))
    h.observe([G], {G.uuid: reading()})
    clock.advance(10_000)
    h.observe([G], {G.uuid: reading()})
    assert stuck(h) == []


@pytest.mark.parametrize("mode", [TaintMode.ENFORCE, TaintMode.SHADOW, TaintMode.DRY_RUN])
def test_remediation_plans_nothing_for_a_stuck_reading(mode):
    clock, h = engine()
    h.observe([G], {G.uuid: reading()})
    clock.advance(300)
    h.observe([G], {G.uuid: reading()})
    health = h.health(G.uuid)
    assert health.advisories
    target = Target(driver="gpu.nvidia.com", pool="node", device="gpu-0", uuid=G.uuid, gpu=G.uuid)
    d = decide(target, health, None, mode, Safety(), hold=1800.0, now=clock())
    assert d.action == Action.NOTHING


# --- the whole agent --------------------------------------------------------------------------

SCENARIO = {
    "node": "stuck-node",
    "gpus": [{"name": "gpu0", "model": "NVIDIA H100 80GB HBM3"}, {"name": "gpu1", "model": "NVIDIA H100 80GB HBM3"}],
    "claims": [{"namespace": "ml", "name": "frozen", "devices": ["gpu0"]}, {"namespace": "ml", "name": "fine", "devices": ["gpu1"]}],
    "pods": [
        {"namespace": "ml", "name": "a", "containers": [{"name": "main", "claims": ["frozen"]}]},
        {"namespace": "ml", "name": "b", "containers": [{"name": "main", "claims": ["fine"]}]},
    ],
}


def test_a_frozen_energy_counter_under_power_is_reading_stuck_and_no_rule_is_written():
    sc = parse_scenario(SCENARIO, "stuck")
    g0, g1 = sc.gpu("gpu0"), sc.gpu("gpu1")

    def fake_gpu(g, minor: int) -> FakeGpu:
        # 400 W drawn all along; the energy counter stays where it is unless the test moves it
        return FakeGpu(g.uuid, pci_bus_id="00000000:" + g.pci_bus_id.split(":", 1)[1].upper(), minor=minor, power_mw=400_000, energy_mj=5_000_000)

    fake = FakeNvml([fake_gpu(g0, 0), fake_gpu(g1, 1)])
    clock = ManualClock(T0)
    tmp = Path(tempfile.mkdtemp(prefix="dra-stuck-"))
    kubelet = FakeKubelet(str(tmp / "kubelet.sock"), qps=None)
    kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
    kubelet.start()
    agent = None
    try:
        with running_apiserver("1.37", bookmark_interval=0.2) as api, installed(fake):
            publish_scenario(api, sc)
            cfg = Config(
                listen_host="127.0.0.1", listen_port=0, node_name=sc.node, kubelet_socket=kubelet.socket_path,
                kubeconfig=str(write_kubeconfig(tmp / "kubeconfig", api.url)), backend="nvml", interval=3600.0,
                call_timeout=1.0, taint_mode=TaintMode.ENFORCE,
            )
            # the energy counter is read every cycle (not once per 10 s) so that gpu1's can move
            backend = NvmlBackend(event_wait_ms=50, lock_timeout_s=0.2, slow_counter_period_s=0.0)
            agent = build_agent(cfg, backend=backend, clock=clock, health_policy=HealthPolicy(stuck_after=600.0), remediation_resync=0.2)
            agent.start()
            wait_until(lambda: agent.src.get("slices").watcher.synced, timeout=30, message="ResourceSlices listed")
            agent.run_cycle()  # the claims are known from here (the first cycle may have come before the slices)
            for step in range(1, 8):  # 700 s of cycles: gpu1's counter moves, gpu0's does not
                clock.advance(100)
                fake.set_field(g1.uuid, FI_ENERGY, 5_000_000 + step * 40_000_000)
                agent.run_cycle()
            m = scrape_samples(agent.server.url)
            conds = {(lab["uuid"], lab["tier"], lab["reason"]) for lab, _ in m["gpu_health_condition"]}
            assert conds == {(g0.uuid, "degraded", "reading_stuck")}
            healthy = {lab["uuid"]: v for lab, v in m["gpu_healthy"]}
            assert healthy == {g0.uuid: 1.0, g1.uuid: 1.0}  # a frozen counter is no failed GPU
            assert {lab["claim"]: v for lab, v in m["dra_claim_healthy"]} == {"frozen": 1.0, "fine": 1.0}
            # the billing counters integrate what the counters say: nothing for the frozen one
            energy = {lab["claim"]: v for lab, v in m["dra_claim_energy_joules_total"]}
            assert energy == {"frozen": 0.0, "fine": 7 * 40_000.0}

            # A remediation pass that sees the stuck GPU: gpu1 fails (XID 79) and gets its rule.
            fake.queue_event(g1.uuid, pynvml.nvmlEventTypeXidCriticalError, data=79)

            def rules() -> list[dict]:
                return api.list("resource.k8s.io", "devicetaintrules")

            wait_until(lambda: any(r["spec"]["deviceSelector"]["device"] == "gpu-1" for r in rules()), timeout=60, message="gpu1's DeviceTaintRule")
            agent.run_cycle()
            assert [r["spec"]["deviceSelector"]["device"] for r in rules()] == ["gpu-1"]
            assert {r.device for r in agent.out.remediation.report().rules} == {"gpu-1"}
            assert agent.health.health(g0.uuid).advisories  # still stuck, still no rule
    finally:
        if agent is not None:
            agent.stop()
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)
