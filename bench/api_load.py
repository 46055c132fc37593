"""API server cost of one agent in a big cluster (issue 13). Not a test: numbers, printed.

    python bench/api_load.py [--nodes 10000] [--rules 1000] [--steady 60]

Fills the HTTP Kubernetes API emulation like a cluster of ``--nodes`` GPU nodes (a Node and one
ResourceSlice of 8 GPUs each) with ``--rules`` DeviceTaintRules of other nodes' agents, then
starts one agent (the production wiring, enforce mode) on a small simulated node of that
cluster and reports:

* start-up: the requests the agent made until it settled, and the bytes of their answers
  (non-watch GETs replayed to size them);
* XID -> first DeviceTaintRule during start-up: an XID 79 injected as the agent starts;
* steady state: non-watch requests per second over ``--steady`` seconds with no fault and no
  allocation change, and that figure for 10,000 agents.

The emulation runs in this process (its own cost is not the agent's); the agent's own RSS is
measured by bench/run.py's soak. One machine, one run: say under which load you ran it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drasim.node import SimulatedNode  # noqa: E402
from drasim.scenario import bundled_scenarios, load_scenario  # noqa: E402
from exporter.config import TaintMode  # noqa: E402
from exporter.devices.model import DeviceEvent, EventKind  # noqa: E402
from exporter.k8s import names  # noqa: E402
from exporter.logs import configure  # noqa: E402


def fill(api, nodes: int, rules: int) -> None:  # type: ignore[no-untyped-def]
    for i in range(nodes):
        node = f"other-{i:05d}"
        api.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        api.apply({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{g}", "attributes": {"uuid": {"string": f"GPU-{i:05d}-{g}"},
                                                                       "productName": {"string": "NVIDIA H100 80GB HBM3"}}} for g in range(8)]},
        })
    for r in range(rules):
        node = f"other-{r % max(nodes, 1):05d}"
        dev = f"gpu-{r // max(nodes, 1) % 8}"
        api.apply({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": names.rule_name(node, "gpu.nvidia.com", node, dev),
                         "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: node, names.TIER_LABEL: "fatal"}},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, "device": dev},
                     "taint": {"key": f"{names.TAINT_DOMAIN}/fatal", "value": "xid_79", "effect": "NoExecute"}},
        })


def answer_bytes(url: str, requests) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for r in requests:
        if r.method != "GET" or r.watch:
            continue
        q = urllib.parse.urlencode(r.query)
        try:
            with urllib.request.urlopen(f"{url}{r.path}{'?' + q if q else ''}", timeout=30) as resp:
                total += len(resp.read())
        except urllib.error.HTTPError as e:  # a 404 (no state ConfigMap yet) is an answer too
            total += len(e.read())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10000)
    ap.add_argument("--rules", type=int, default=1000)
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of steady state to count")
    args = ap.parse_args()
    configure(os.environ.get("BENCH_LOG_LEVEL", "error"))
    sc = load_scenario(bundled_scenarios()["small-node"])
    with SimulatedNode(sc) as node:
        node.start()
        t0 = time.monotonic()
        fill(node.api, args.nodes, args.rules)
        print(f"cluster: {args.nodes} other nodes x 8 GPUs, {args.rules} foreign rules (filled in {time.monotonic() - t0:.0f} s)")
        node.api.clear_requests()
        gpu = node.uuid("gpu0")
        started = time.monotonic()
        agent = node.build_agent(interval=1.0, taint_mode=TaintMode.ENFORCE, taint_settle_seconds=2.0)
        node.backend.inject([DeviceEvent(uuid=gpu, kind=EventKind.XID, code=79, detail="bench")])
        injected = time.monotonic()
        agent.start(serve=False)
        while not node.api.list("resource.k8s.io", "devicetaintrules", label_selector=f"{names.NODE_LABEL}={sc.node}"):
            time.sleep(0.001)
        first_rule = time.monotonic() - injected
        rem = agent.out.remediation
        while not (agent.src.get("slices").watcher.synced and rem is not None and rem.passes > 2 and agent.cycles > 3):
            time.sleep(0.05)
        settle = time.monotonic() - started
        startup = list(node.api.requests)
        size = answer_bytes(node.api.url, startup)
        print(f"start-up: {len([r for r in startup if not r.watch])} requests + {len([r for r in startup if r.watch])} watches, "
              f"{size / 1024:.1f} KiB of answers, settled in {settle:.1f} s")
        print(f"XID 79 injected as the agent starts -> first DeviceTaintRule (NoSchedule fence): {first_rule * 1000:.0f} ms")
        # How much of that is the emulation answering the node's selector-filtered lists (it
        # scans every object; a real API server answers them from its indexed watch cache).
        for what, path in (("slices", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{sc.node}"),
                           ("node", f"/api/v1/nodes?fieldSelector=metadata.name%3D{sc.node}"),
                           ("rules", f"/apis/resource.k8s.io/v1/devicetaintrules?labelSelector={names.NODE_LABEL}%3D{sc.node}")):
            t = time.monotonic()
            with urllib.request.urlopen(node.api.url + path, timeout=60) as resp:
                resp.read()
            print(f"   the emulation answers the node's {what} list in {(time.monotonic() - t) * 1000:.0f} ms")
        node.api.clear_requests()
        time.sleep(args.steady)
        steady = [r for r in node.api.requests if not r.watch]
        rate = len(steady) / args.steady
        print(f"steady state: {len(steady)} non-watch requests in {args.steady:.0f} s = {rate:.4f}/s per agent; "
              f"x 10,000 agents = {rate * 10000:.1f}/s (watch streams: {len([r for r in node.api.requests if r.watch])} re-opened)")
        for r in steady[:10]:
            print("   ", r.method, r.path, r.query)


if __name__ == "__main__":
    main()
