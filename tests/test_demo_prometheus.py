"""Issue: the demo is the whole product. Run `dra-gpu-exporter demo` as a subprocess, scrape it
with a real Prometheus server, and check through Prometheus' HTTP API that device, claim and
taint series arrive, and that the scripted XID 79 shows up as gpu_healthy == 0 and a NoExecute
dra_device_taint_rule series for exactly the faulty device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kit_helpers import fetch, free_port, stop_process, wait_until
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, start_prometheus

from drasim.scenario import default_scenario

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS_REASON), pytest.mark.slow]

# The scripted fault lasts a few real seconds (x20: XID 79 at sim 60 s = 3 s in, reset at sim
# 180 s = 9 s in). Nothing here depends on seeing it live: Prometheus starts first and scrapes
# the demo from its first moment, and the checks ask Prometheus what it *recorded* over the
# run (``*_over_time`` over a window longer than the test), so they hold however late they run
# on a busy machine. Only the final state (recovered) is checked as the current value.
WINDOW = "[30m]"


@pytest.fixture
def port():
    return free_port()


@pytest.fixture
def prom(port, tmp_path):
    with start_prometheus([f"127.0.0.1:{port}"], tmp_path, scrape_interval="500ms") as server:
        yield server


@pytest.fixture
def demo(prom, port):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}", "--time-scale", "20", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        wait_until(lambda: fetch(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200, 60, interval=0.1,
                   message="demo /readyz", ignore=(OSError,))
        yield proc
    finally:
        stop_process(proc, timeout=15)


def test_prometheus_sees_devices_claims_and_the_fault(prom, demo):
    proc = demo
    prom.wait_for_targets_up(timeout=60)
    up = prom.wait_for_query("gpu_up", timeout=60)
    assert len(up) == 7  # 5 GPUs + 2 MIG instances
    shared = prom.wait_for_query('dra_claim_pods{namespace="ml",claim="shared-gpu"}', timeout=60)
    assert len(shared) == 1 and shared[0]["value"][1] == "2"  # one series for a claim two pods share
    assert len(prom.wait_for_query('dra_device_allocation_info{claim="shared-gpu"}', timeout=60)) == 2
    assert prom.wait_for_query('dra_device_allocation_info{driver="nvidia.com/gpu",claim=""}', timeout=60), "device-plugin pod attributed"

    # The fault: gpu-1 falls off the bus; exactly that device gets a NoExecute rule.
    unhealthy = prom.wait_for_query(f"min_over_time(gpu_healthy{WINDOW}) == 0", timeout=60)
    faulty = {r["metric"]["uuid"] for r in unhealthy}
    assert len(faulty) == 1
    taints = prom.wait_for_query(f'max_over_time(dra_device_taint_rule{{effect="NoExecute"}}{WINDOW})', timeout=60)
    assert {r["metric"]["device"] for r in taints} == {"gpu-1"}
    # The unhealthy GPU is the scenario's gpu1, published as DRA device gpu-1.
    assert faulty == {default_scenario().gpu("gpu1").uuid}
    assert prom.wait_for_query(f'max_over_time(gpu_health_condition{{reason="xid_79",tier="fatal"}}{WINDOW})', timeout=60)

    # Recovery: after the reset the rule steps down and goes away (a lasting state: checked live).
    wait_until(lambda: not prom.query("dra_device_taint_rule") and prom.query("min(gpu_healthy) == 1"), 120, interval=0.2,
               message="taint removed after recovery", ignore=(Exception,))
    assert proc.poll() is None, "demo still running until we stop it"
