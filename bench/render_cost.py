"""What the hand-written renderer saves over prometheus_client's ``generate_latest``.

    python bench/render_cost.py [--cycles 60] [--intervals 1 5] [--node dense|8gpu]
    python bench/render_cost.py --billing [--cycles 200] [--intervals 1] [--node dense|8gpu]

The dense node (64 devices, 256 pods, 512 claims: bench/run.py's ``big_scenario``; or its
8-GPU node, 32 pods and 32 claims), the real
agent against the in-process kubelet and Kubernetes API, one cycle after another, simulated time
held still and moved forward by the interval before each cycle (so as many values move between
two cycles as at that interval: more at 5 s than at 1 s). After each cycle the same state is turned into an OpenMetrics body (what Prometheus asks for) two ways,
back to back in this process, CPU time (time.process_time) of each:

* hand: exporter.metrics.render.Renderer, one instance kept across cycles as the agent keeps
  it (a family's header and a series' ``name{labels} `` prefix formatted once, each value per
  render);
* library: prometheus_client's public ``openmetrics.exposition.generate_latest`` over the same
  families, including the ``add_metric`` calls that build its samples (what a collector made of
  plain prometheus_client families pays), since the renderer's row families defer exactly those.

Building the families (the collector's rows) costs both the same and is not counted. Prints p50
and p90 per cycle and the difference as a share of one core at each interval.

``--billing``: what the billing counters (exporter/model/usage.py) cost a cycle, alone, the
thread's CPU (time.thread_time) of each part, over the same snapshots of the node's cycles:
the accountant's update, the billing families (their totals worked out and their rows:
SnapshotCollector._usage) and rendering them with one Renderer kept across cycles (the
bytes joined on a scrape, not counted). Every counter moves each cycle, so this is the
renderer's moved-values path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from agent_process import published  # noqa: E402
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
        states = published(node.agent)
        hand, lib = [], []
        for i in range(cycles + 5):
            node.clock.advance_to(node.clock.now() + interval)
            node.agent.run_cycle()
            state = states[-1]  # the cycle's, published (rendered only on demand)
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


def measure_billing(cycles: int, interval: float, scenario: dict) -> dict:
    from exporter.metrics.render import Renderer
    from exporter.model.usage import UsageAccountant

    node = Node(scenario, interval=3600)
    node.start(serve=False)
    node.clock.pause()
    snaps = []
    try:
        for _ in range(cycles + 5):
            node.clock.advance_to(node.clock.now() + interval)
            snaps.append(node.agent.run_cycle())
    finally:
        node.stop()
    acc, renderer = UsageAccountant(), Renderer()
    parts: dict[str, list[float]] = {"update": [], "families": [], "render": []}
    fams = []
    for i, snap in enumerate(snaps):
        c0 = time.thread_time()
        usage = acc.update(snap)
        c1 = time.thread_time()
        fams = list(renderer.collector._usage(snap.node, usage))
        c2 = time.thread_time()
        renderer.render_families(fams)
        c3 = time.thread_time()
        if i >= 5:  # the first cycles make the plans and format every series: start-up
            for k, t in zip(parts, (c1 - c0, c2 - c1, c3 - c2), strict=True):
                parts[k].append(t)
    series = sum(len(f.samples) for f in fams)
    total = [sum(ts) for ts in zip(*parts.values(), strict=True)]
    out = {"interval_s": interval, "cycles": cycles, "series": series, "total_p50_ms": pct(total, 50) * 1e3, "total_p90_ms": pct(total, 90) * 1e3}
    out.update({f"{k}_p50_ms": pct(v, 50) * 1e3 for k, v in parts.items()})
    out["percent_core"] = pct(total, 50) * 100 / interval
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--intervals", type=float, nargs="+", default=[1.0, 5.0])
    ap.add_argument("--node", choices=["dense", "8gpu"], default="dense")
    ap.add_argument("--billing", action="store_true", help="the billing counters' own cost a cycle (accountant, families, render)")
    a = ap.parse_args()
    configure("json", "error")
    for interval in a.intervals:
        if a.billing:
            r = measure_billing(a.cycles, interval, big_scenario() if a.node == "dense" else eight_gpus())
            r["node"] = a.node
            print(json.dumps(r))
            print(
                f"{a.node} node at {interval:g} s, billing ({r['series']} series) per cycle, thread CPU p50: update {r['update_p50_ms']:.2f} ms, "
                f"families {r['families_p50_ms']:.2f} ms, render {r['render_p50_ms']:.2f} ms; total p50 / p90 {r['total_p50_ms']:.2f} / {r['total_p90_ms']:.2f} ms, "
                f"{r['percent_core']:.3f} % of a core"
            )
            continue
        r = measure(a.cycles, interval, big_scenario() if a.node == "dense" else eight_gpus())
        r["node"] = a.node
        print(json.dumps(r))
        print(
            f"{a.node} node at {interval:g} s, {r['series']} series, OpenMetrics body per cycle (CPU p50 / p90): hand {r['hand_p50_ms']:.1f} / {r['hand_p90_ms']:.1f} ms, "
            f"generate_latest {r['library_p50_ms']:.1f} / {r['library_p90_ms']:.1f} ms; saved {r['saved_percent_core']:.2f} % of a core"
        )


if __name__ == "__main__":
    main()
