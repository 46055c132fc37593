"""The demo's status line (issue 15): it never shows ``conditions: none`` beside a NoExecute
taint. A rule outlives its condition by the hold time (hysteresis), so after a GPU recovers
the line must say why the taint is still there.

The demo's own pieces run in-process (the simulated cluster with its real gRPC kubelet and
HTTP API, the agent built by the product's wiring) so the test can ask for the line at the
moment that matters instead of waiting for the demo's next periodic print."""

from __future__ import annotations

import re

from kit_helpers import wait_until

from drasim.backend import SimClock
from drasim.demo import DEMO_POLICY, DemoCluster, summary_line
from drasim.scenario import parse_scenario
from exporter.config import TaintMode

SCENARIO = """
name: one-fault
node: status-node
gpus:
  - {name: gpu0, model: NVIDIA H100 80GB HBM3, memory: 80Gi}
  - {name: gpu1, model: NVIDIA H100 80GB HBM3, memory: 80Gi}
claims:
  - {namespace: ml, name: train, devices: [gpu1]}
pods:
  - {namespace: ml, name: trainer, containers: [{name: main, claims: [train]}]}
faults:
  - {kind: xid, gpu: gpu1, at: 20s, code: 79}
  - {kind: lost, gpu: gpu1, at: 20s, until: 40s}
  - {kind: reset, gpu: gpu1, at: 40s}
"""

HOLD = 120.0  # simulated seconds a recovered GPU keeps its rule


def test_status_line_explains_a_taint_held_after_recovery(tmp_path):
    import yaml

    sc = parse_scenario(yaml.safe_load(SCENARIO))
    clock = SimClock(20.0)
    cluster = DemoCluster(sc, clock, tmp_path)
    try:
        cluster.start()
        agent = cluster.start_agent(
            interval=0.2, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=HOLD, health_policy=DEMO_POLICY, remediation_resync=0.5,
        )
        lines: list[str] = []

        def line_with(pattern: str) -> str | None:
            line = summary_line(agent, cluster, HOLD)
            lines.append(line)
            return line if re.search(pattern, line) else None

        during = wait_until(lambda: line_with(r"taints: .*gpu-1=NoExecute"), 120, interval=0.05, message="the NoExecute rule")
        assert "conditions: none" not in during and "xid_79" in during, during
        held = wait_until(lambda: line_with(r"recovered"), 120, interval=0.05, message="the GPU to recover while its rule is held")
        assert "gpu-1=NoExecute" in held or "gpu-1=" in held, held
        assert "conditions: none" not in held and f"gpu-1=NoExecute held until {HOLD:g}s healthy" in held, held
        # invariant over every line seen: a NoExecute taint never sits beside "conditions: none"
        assert not [x for x in lines if "conditions: none" in x and "NoExecute" in x], lines
    finally:
        cluster.stop()  # the agent first, then the kubelet and the API server
