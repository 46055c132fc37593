"""What the hand-written renderer saves over prometheus_client's ``generate_latest``.

    python bench/render_cost.py [--cycles 60] [--intervals 1 5] [--node dense|8gpu]

The dense node (64 devices, 256 pods, 512 claims: bench/run.py's ``big_scenario``; or its
8-GPU node, 32 pods and 32 claims), the real
agent against the in-process kubelet and Kubernetes API, one cycle after another, simulated time
held still and moved forward by the interval before each cycle (so as many values move between
two cycles as at that interval: more at 5 s than at 1 s). After each cycle the same state is turned into an OpenMetrics body (what Prometheus asks for) two ways,
back to back in this process, CPU time (time.process_time) of each:

* hand: exporter.metrics.render.Renderer, one instance kept across cycles as the agent keeps
  it (formats a series once, re-formats moved values, reuses unchanged families);
* library: prometheus_client's public ``openmetrics.exposition.generate_latest`` over the same
  families, including the ``add_metric`` calls that build its samples (what a collector made of
  plain prometheus_client families pays), since the renderer's row families defer exactly those.

Building the families (the collector's rows) costs both the same and is not counted. Prints p50
and p90 per cycle and the difference as a share of one core at each interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run import Node, big_scenario, eight_gpus, pct  # noqa: E402

from exporter.logs import configure  # noqa: E402


class _Families:
    def __init__(self, fams: list) -> None:
        self.fams = fams

    def collect(self) -> list:
        return self.fams


def measure(cycles: int, interval: float, scenario: dict) -> dict:
    from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

    from exporter.metrics.render import Renderer

    node = Node(scenario, interval=3600)
    node.start(serve=False)
    node.clock.pause()
    try:
        hand_renderer = Renderer()
        hand, lib = [], []
        for i in range(cycles + 5):
            node.clock.advance_to(node.clock.now() + interval)
            node.agent.run_cycle()
            state = node.agent.expositions.state  # the cycle's, published (rendered only on demand)
            hand_renderer.collector.state = state
            fams = list(hand_renderer.collector.collect())
            c0 = time.process_time()
            body = hand_renderer.render_families(fams).openmetrics
            c1 = time.process_time()
            fams = list(hand_renderer.collector.collect())  # fresh families: samples not built yet
            c2 = time.process_time()
            want = om_generate_latest(_Families(fams))
            c3 = time.process_time()
            assert body == want, "the renderer and prometheus_client disagree"
            if i >= 5:  # the first renders format every series: start-up, not the steady cycle
                hand.append(c1 - c0)
                lib.append(c3 - c2)
        series = sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))
    finally:
        node.stop()
    saved = pct(lib, 50) - pct(hand, 50)
    return {
        "interval_s": interval,
        "cycles": cycles,
        "series": series,
        "hand_p50_ms": pct(hand, 50) * 1e3,
        "hand_p90_ms": pct(hand, 90) * 1e3,
        "library_p50_ms": pct(lib, 50) * 1e3,
        "library_p90_ms": pct(lib, 90) * 1e3,
        "saved_percent_core": saved * 100 / interval,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--intervals", type=float, nargs="+", default=[1.0, 5.0])
    ap.add_argument("--node", choices=["dense", "8gpu"], default="dense")
    a = ap.parse_args()
    configure("json", "error")
    for interval in a.intervals:
        r = measure(a.cycles, interval, big_scenario() if a.node == "dense" else eight_gpus())
        r["node"] = a.node
        print(json.dumps(r))
        print(
            f"{a.node} node at {interval:g} s, {r['series']} series, OpenMetrics body per cycle (CPU p50 / p90): hand {r['hand_p50_ms']:.1f} / {r['hand_p90_ms']:.1f} ms, "
            f"generate_latest {r['library_p50_ms']:.1f} / {r['library_p90_ms']:.1f} ms; saved {r['saved_percent_core']:.2f} % of a core"
        )


if __name__ == "__main__":
    main()
