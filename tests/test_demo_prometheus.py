"""Issue: the demo is the whole product. Run `dra-gpu-exporter demo` as a subprocess, scrape it
with a real Prometheus server, and check through Prometheus' HTTP API that device, claim and
taint series arrive, and that the scripted XID 79 shows up as gpu_healthy == 0 and a NoExecute
dra_device_taint_rule series for exactly the faulty device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from drasim.scenario import default_scenario
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, free_port, http_get, start_prometheus, stop_process, wait_until

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS_REASON), pytest.mark.slow]


@pytest.fixture
def demo():
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # x20: the XID 79 (sim 60 s) comes 3 s in, the GPU is reset at sim 180 s (9 s in).
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}", "--time-scale", "20", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/readyz", timeout=1)[0] == 200, 30, what="demo /readyz")
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_process(proc, timeout=15)


def test_prometheus_sees_devices_claims_and_the_fault(demo, tmp_path):
    target, proc = demo
    with start_prometheus([target], tmp_path, scrape_interval="500ms") as prom:
        prom.wait_for_targets_up(timeout=30)
        up = prom.wait_for_query("gpu_up", timeout=30)
        assert len(up) == 7  # 5 GPUs + 2 MIG instances
        shared = prom.wait_for_query('dra_claim_pods{namespace="ml",claim="shared-gpu"}', timeout=15)
        assert len(shared) == 1 and shared[0]["value"][1] == "2"  # one series for a claim two pods share
        assert len(prom.query('dra_device_allocation_info{claim="shared-gpu"}')) == 2
        assert prom.query('dra_device_allocation_info{driver="nvidia.com/gpu",claim=""}'), "device-plugin pod attributed"

        # The fault: gpu-1 falls off the bus; exactly that device gets a NoExecute rule.
        unhealthy = prom.wait_for_query("gpu_healthy == 0", timeout=30)
        faulty = {r["metric"]["uuid"] for r in unhealthy}
        assert len(faulty) == 1
        taints = prom.wait_for_query('dra_device_taint_rule{effect="NoExecute"}', timeout=30)
        assert {r["metric"]["device"] for r in taints} == {"gpu-1"}
        # The unhealthy GPU is the scenario's gpu1, published as DRA device gpu-1.
        assert faulty == {default_scenario().gpu("gpu1").uuid}
        assert prom.query('gpu_health_condition{reason="xid_79",tier="fatal"}')

        # Recovery: after the reset the rule steps down and goes away.
        wait_until(lambda: not prom.query("dra_device_taint_rule") and prom.query("min(gpu_healthy) == 1"), 60, what="taint removed after recovery")
    assert proc.poll() is None, "demo still running until we stop it"
