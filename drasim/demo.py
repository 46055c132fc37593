"""``dra-gpu-exporter demo``: the whole product on one laptop.

One process runs a simulated node: GPUs from a scenario, a real gRPC PodResources server on a
temporary unix socket, and an in-process Kubernetes API (real HTTP) holding the node's
ResourceSlice, ResourceClaims, Pods and the DeviceTaintRules the agent writes. The agent is
built by the same wiring as in a cluster (gRPC client, API client over HTTP, remediation); only
the device backend is simulated.

To make the story complete, the demo also plays the part of kube-controller-manager's device
taint eviction controller: a pod whose claim sits on a NoExecute-tainted device is deleted, and
it comes back (as a Deployment's replacement would) once the taint is gone. Like the real one in
1.37, it evicts only for the claims in a pod's ``spec.resourceClaims``: a pod whose device came
through a DRA extended-resource claim (KEP-5004) stays (kubernetes/kubernetes#141290), and the
agent tells of it (``dra_taint_pods_pending_eviction``, a Warning Event on the pod).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from exporter.cli import stop_on_signals
from exporter.config import Config
from exporter.health.engine import HealthPolicy

from . import objects
from .apiserver import FakeApiServer
from .backend import SimClock
from .node import SimulatedNode
from .scenario import PodSpec, Scenario, ScenarioError, bundled_scenarios, find_scenario, load_scenario

if TYPE_CHECKING:
    from exporter.agent import Agent

log = structlog.get_logger(__name__)

# Demo-speed safety and recovery timers, in simulated seconds: long enough to see each state.
DEMO_POLICY = HealthPolicy(clear_hold=30.0, event_quiet=300.0, info_quiet=120.0)
DEMO_HOLD = 60.0


class DemoCluster(SimulatedNode):
    """The simulated node of the demo, plus the part of kube-controller-manager's device taint
    eviction controller: pods come and go on the scenario clock and with the taints."""

    def __init__(self, scenario: Scenario, clock: SimClock, workdir: Path | None = None) -> None:
        # The demo runs for days; the API server keeps only its latest requests (nothing reads them).
        super().__init__(scenario, clock, bookmark_interval=5.0, request_log_size=1000, workdir=workdir)
        self.sc = scenario
        self.evicted: dict[tuple[str, str], float] = {}
        self.stayed: set[tuple[str, str]] = set()  # extended-resource pods on a NoExecute device
        self._live: list[PodSpec] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, *, pods: Iterable[PodSpec] | None = None, start_kubelet: bool = True,
              api_setup: Callable[[FakeApiServer], None] | None = None) -> None:
        """As SimulatedNode.start, except that the scenario clock and the taints decide which pods
        run (``pods`` must be None)."""
        if pods is not None:
            raise ValueError("the demo cluster places its pods itself")
        super().start(pods=[], start_kubelet=start_kubelet, api_setup=api_setup)  # Node and ResourceSlice
        self.sync()
        self._thread = threading.Thread(target=self._loop, name="demo-cluster", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=3)
        super().stop()

    def _tainted_devices(self) -> set[str]:
        out = set()
        for r in self.api.list("resource.k8s.io", "devicetaintrules"):
            spec = r.get("spec") or {}
            if (spec.get("taint") or {}).get("effect") == "NoExecute":
                out.add((spec.get("deviceSelector") or {}).get("device", ""))
        return out

    def sync(self) -> None:
        """Bring kubelet and API objects in line with the scenario clock and the taints."""
        t = self.clock.now()
        tainted = self._tainted_devices()
        live = []
        for p in self.sc.pods:
            if p.start > t or (p.end is not None and t >= p.end):
                continue
            devices = {
                objects.device_name(self.sc, ref)
                for ct in p.containers
                for cn in ct.claims
                for c in self.sc.claims
                if c.namespace == p.namespace and c.name == cn
                for ref in c.devices
            }
            key = (p.namespace, p.name)
            # The controller reads only spec.resourceClaims: the generated extended-resource
            # claim's devices never evict their pod (kubernetes/kubernetes#141290).
            kept = {objects.device_name(self.sc, ref) for ct in p.containers for _res, ref in ct.extended} & tainted
            if kept and key not in self.stayed and not devices & tainted:
                self.stayed.add(key)
                print(f"[sim {_mmss(t)}] pod {p.namespace}/{p.name} stays on {', '.join(sorted(kept))}, tainted "
                      "NoExecute: "
                      "its device came through an extended-resource claim, which NoExecute does not evict", flush=True)
            elif not kept:
                self.stayed.discard(key)
            if devices & tainted:
                if key not in self.evicted:
                    self.evicted[key] = t
                    print(f"[sim {_mmss(t)}] evicted pod {p.namespace}/{p.name}: its claim's device "
                          f"{', '.join(sorted(devices & tainted))} is tainted NoExecute", flush=True)
                continue
            if key in self.evicted:
                del self.evicted[key]
                print(f"[sim {_mmss(t)}] pod {p.namespace}/{p.name} is running again", flush=True)
            live.append(p)
        if [p.name for p in live] == [p.name for p in self._live] and self._live:
            return
        self._live = live
        self.kubelet.set_pods(objects.kubelet_pods(self.sc, live))
        wanted = {(p.namespace, p.name) for p in live}
        for obj in self.api.list("", "pods"):
            m = obj["metadata"]
            if (m["namespace"], m["name"]) not in wanted:
                self.api.delete("", "pods", m["name"], m["namespace"])
        for p in live:
            self.api.apply(objects.pod_object(self.sc, p))
        for c in objects.resource_claims(self.sc, live):
            self.api.apply(c)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sync()
            except Exception:
                log.exception("demo_cluster_sync_failed")


def _mmss(t: float) -> str:
    return f"{int(t // 60):02d}:{int(t % 60):02d}"


def summary_line(agent: Agent, cluster: DemoCluster, hold: float = DEMO_HOLD) -> str:
    snap = agent.snapshot
    if snap is None:
        return "no data yet"
    t = cluster.clock.now()
    down = sum(1 for d in snap.devices if not d.up)
    # Conditions from the health engine itself, not the last cycle's snapshot: a fault's rule
    # is written on the event, before the next cycle shows the condition.
    rem = agent.out.remediation
    rules = rem.report().rules if rem else ()
    health = agent.health.all_health()
    parents = {d.uuid: d.identity.parent_uuid for d in snap.devices if d.identity.is_partition}
    conds = []
    for d in snap.devices:
        h = health.get(d.uuid)
        if h is None or h.worst is None:
            continue  # no conditions
        reasons = {c.reason for c in h.conditions}
        parent = health.get(parents.get(d.uuid, ""))
        if parent is not None and reasons <= {c.reason for c in parent.conditions}:
            continue  # a MIG instance inherits its GPU's conditions: shown once, on the GPU
        conds.append(f"{d.uuid[:12]} {h.worst.value}: {','.join(sorted(reasons))}")
    # A rule outlives its condition by the hold time (hysteresis): say so, rather than show
    # "conditions: none" beside a NoExecute taint.
    names = _device_uuids(cluster.sc)
    for r in rules:
        uuid = names.get(r.device, "")
        h = health.get(uuid) or health.get(parents.get(uuid, ""))
        if uuid and not (h and h.conditions):
            conds.append(f"{uuid[:12]} ({r.device}) recovered, {r.device}={r.effect} held until {hold:g}s healthy")
    taints = ", ".join(f"{r.device}={r.effect}" for r in rules) if rem else "off"
    bad_claims = sum(1 for c in snap.claims if not c.healthy)
    return (
        f"[sim {_mmss(t)}] devices {len(snap.devices)} ({down} down) | pods "
        f"{len({(a.namespace, a.pod) for a in snap.allocations})} | "
        f"claims {len(snap.claims)} ({bad_claims} unhealthy) | conditions: {'; '.join(conds) or 'none'} | taints: "
        f"{taints or 'none'}"
    )


def list_scenarios() -> int:
    """``dra-gpu-exporter demo --list-scenarios``: name and file of each bundled scenario."""
    for name, path in bundled_scenarios().items():
        print(f"{name}\t{path}")
    return 0


def _driver_taints(sc: Scenario) -> str:
    """The banner's line for the taints the simulated driver put in its slice (dra_device_taint_info)."""
    taints = [f"{g.device_name} {k}={v}:{e}" for g in sc.gpus for k, v, e in g.taints]
    return f"  driver taints:  {', '.join(taints)} (in its ResourceSlice: dra_device_taint_info)\n" if taints else ""


def _device_uuids(sc: Scenario) -> dict[str, str]:
    """DRA device name -> UUID for the scenario's GPUs and MIG instances."""
    out = {}
    for g in sc.gpus:
        out[g.device_name] = g.uuid
        for m in g.mig:
            out[g.mig_device_name(m)] = m.uuid
    return out


def run_demo(cfg: Config, stop: threading.Event | None = None) -> int:
    try:
        scenario = load_scenario(find_scenario(cfg.scenario))  # the flag table's default: mixed-node
    except ScenarioError as e:
        print(f"dra-gpu-exporter: error: {e}", file=sys.stderr)
        return 2
    # Signals first: a Ctrl-C while the cluster starts must end in the cleanup below, not in a
    # KeyboardInterrupt traceback that leaves the temporary directory behind.
    waiter = stop or threading.Event()
    if stop is None:
        stop_on_signals(waiter)
    clock = SimClock(cfg.time_scale)
    cluster = DemoCluster(scenario, clock, Path(tempfile.mkdtemp(prefix="dra-demo-")))
    try:
        cluster.start()
        agent = cluster.start_agent(
            cfg, health_policy=DEMO_POLICY, remediation_resync=max(1.0, cfg.interval),
            taint_hold_seconds=min(cfg.taint_hold_seconds, DEMO_HOLD),
        )
        assert agent.server is not None  # start_agent serves by default: the server runs, or it raised
        gpus = len(scenario.gpus)
        migs = sum(len(g.mig) for g in scenario.gpus)
        print(
            f"dra-gpu-exporter demo: scenario {scenario.name!r} on node {scenario.node}: {gpus} GPUs, {migs} MIG "
            "instances, "
            f"{len(scenario.pods)} pods, {len(scenario.claims)} claims, {len(scenario.faults)} scripted faults; time "
            f"x{cfg.time_scale:g}\n"
            f"  metrics:        {agent.server.url}/metrics\n"
            f"  readiness:      {agent.server.url}/readyz\n"
            f"  kubelet socket: {cluster.socket}\n"
            f"  Kubernetes API: {cluster.api.url} (kubeconfig {cluster.kubeconfig})\n"
            f"  taint mode:     {cfg.taint_mode.value}\n"
            f"{_driver_taints(scenario)}"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        period = max(5.0, 60.0 / cfg.time_scale)
        hold = agent.cfg.taint_hold_seconds
        print(summary_line(agent, cluster, hold), flush=True)
        while not waiter.wait(period):
            print(summary_line(agent, cluster, hold), flush=True)
        return 0
    except OSError as e:
        print(f"dra-gpu-exporter: error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        shutil.rmtree(cluster.workdir, ignore_errors=True)
        print("demo stopped; temporary files removed", flush=True)
