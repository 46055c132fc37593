"""A fault storm against the cluster budget costs O(1) requests per agent (issue 26).

60 agents (one GPU each) whose GPUs fail within one second, against a budget of 8 fault domains:
the slots and the NoExecute rules never exceed 8; every agent's requests for the budget object
over the storm and the minute after it stay few (mean <= 5, max <= 12) and stop altogether while
nothing changes; when one slot is freed, one waiting agent raises. And a budget object missing for
ten minutes, with a fault waiting, is asked for at most once a minute.

Real parts: the HTTP API emulation (its request log says which agent asked: each agent has its
own token), one HTTP client, health engine, remediator and ``ClusterBudget`` per agent, all built
by the production wiring. Time is a ManualClock shared by the health engines and remediators: a
"minute" is passes at 5 s steps of that clock (the remediator's own cadence while a fault is
open), so the test takes seconds; the budget's watches and their random turns run in real time.
Each round of passes runs the agents concurrently, as separate processes would.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clock_helpers import ManualClock
from k8s_helpers import running_apiserver, wait_until, write_kubeconfig

from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, RecoveryAction, Vendor
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.k8s.budget import BUDGET_NAME, ClusterBudget
from exporter.k8s.connection import connect
from exporter.k8s.parse import parse_slice
from exporter.model.join import JoinInputs, join
from exporter.remediation.adoption import BootIdentity
from exporter.wiring import build_remediator

AGENTS = 60
BUDGET = 8
NS = "dra-gpu-exporter"
T0 = 1_750_000_000.0
HOLD = 60.0
POLICY = HealthPolicy(clear_hold=10.0)
STEP = 5.0  # seconds of the ManualClock between passes once the storm is over
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"


class Agent:
    def __init__(self, server, tmp: Path, i: int, clock: ManualClock) -> None:
        self.node = f"gpu-node-{i:03d}"
        self.user = f"agent-{i:03d}"
        self.ident = DeviceIdentity(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0, minor=0)
        sl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{self.node}-gpu"},
              "spec": {"driver": "gpu.nvidia.com", "nodeName": self.node, "pool": {"name": self.node, "generation": 1, "resourceSliceCount": 1},
                       "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": self.ident.uuid}}}]}}
        server.apply(sl)
        server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node}})
        api = connect(str(write_kubeconfig(tmp / f"kubeconfig-{i}", server.url, token=self.user)))
        self.clock = clock
        self.health = HealthEngine(clock, POLICY)
        self.health.set_topology([self.ident])
        cfg = Config(node_name=self.node, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=HOLD, interval=STEP)
        # Rules listed and the Node read once (resync: an hour): what is counted is the budget.
        self.rem = build_remediator(cfg, api, self.health, clock, 3600.0, watch=False, budget=ClusterBudget(api, NS, clock=clock),
                                    node_state=False, boot=BootIdentity("boot-1", T0 - 86400))
        self.rem.update(join(JoinInputs(node=self.node, timestamp=T0, identities=(self.ident,), readings={}, health={},
                                        slices={d.key: d for d in parse_slice(sl, "v1")})))
        self.rem.rules.served()  # discovery, as a running agent has done long before

    def xid(self) -> None:
        self.health.on_event(DeviceEvent(uuid=self.ident.uuid, kind=EventKind.XID, code=79, detail="storm"))

    def recover(self) -> None:
        self.health.on_event(DeviceEvent(uuid=self.ident.uuid, kind=EventKind.RESET))

    def clean(self) -> None:
        self.health.observe([self.ident], {self.ident.uuid: DeviceReading(uuid=self.ident.uuid, recovery_action=RecoveryAction.NONE, ecc_uncorrectable_total=0)})


def budget_requests(server, user: str | None = None, since: int = 0) -> list:
    """Requests for the budget object: its path, or a list/watch of it by name."""
    out = []
    for r in server.requests[since:]:
        named = r.path == CM_PATH and f"metadata.name={BUDGET_NAME}" in r.query.get("fieldSelector", "")
        if (r.path == f"{CM_PATH}/{BUDGET_NAME}" or named) and (user is None or r.user == user):
            out.append(r)
    return out


def noexecute(server) -> set[str]:
    return {r["spec"]["deviceSelector"]["pool"] for r in server.list("resource.k8s.io", "devicetaintrules") if r["spec"]["taint"]["effect"] == "NoExecute"}


def slots(server) -> set[str]:
    data = (server.get("", "configmaps", BUDGET_NAME, namespace=NS) or {}).get("data") or {}
    return {k for k in data if "." in k}


class Watcher:
    """Samples the cluster while the storm runs: the most slots and NoExecute rules ever seen."""

    def __init__(self, server) -> None:
        self.server, self.most_slots, self.most_ne = server, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def look(self) -> None:
        self.most_slots = max(self.most_slots, len(slots(self.server)))
        self.most_ne = max(self.most_ne, len(noexecute(self.server)))

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.look()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.look()


def test_a_storm_of_60_faults_against_a_budget_of_8_costs_each_agent_a_few_requests(tmp_path):
    with running_apiserver("1.37", bookmark_interval=3600) as server:
        server.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        server.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": BUDGET_NAME, "namespace": NS},
                      "data": {"max_domains": str(BUDGET), "fraction": "0.05", "cluster_gpus": "0"}})
        clock = ManualClock(T0)
        agents = [Agent(server, tmp_path, i, clock) for i in range(AGENTS)]
        pool = ThreadPoolExecutor(AGENTS)
        watcher = Watcher(server)

        def round_() -> None:
            """One pass of every agent, all at once (a failed pass is retried by the next round,
            as the remediator's loop does after its backoff)."""
            for f in [pool.submit(a.rem.reconcile) for a in agents]:
                try:
                    f.result(timeout=120)
                except Exception as e:
                    print("pass failed:", type(e).__name__, e)

        try:
            start = len(server.requests)
            # The storm: every GPU fails within one second; each agent fences at once and raises
            # after its settle window (2 s), so the raises race over the next second.
            for i, a in enumerate(agents):
                a.xid()
                if i % 15 == 14:
                    round_()
                    clock.advance(0.25)
            for _ in range(16):  # 4 s in quarter seconds: every settle window ends
                round_()
                clock.advance(0.25)
            # The minute after: nothing changes; the passes go on at the remediator's cadence.
            for step in range(int(60 / STEP)):
                if step == int(30 / STEP):
                    quiet_from = len(server.requests)
                round_()
                clock.advance(STEP)
            watcher.stop()
            assert watcher.most_slots <= BUDGET and watcher.most_ne <= BUDGET, (watcher.most_slots, watcher.most_ne)
            assert len(noexecute(server)) == BUDGET and len(slots(server)) == BUDGET  # the budget is used, and all of it
            rules = server.list("resource.k8s.io", "devicetaintrules")
            assert len(rules) == AGENTS  # every GPU fenced, at least
            per_agent = [len(budget_requests(server, a.user, start)) for a in agents]
            mean = sum(per_agent) / AGENTS
            print(f"\nbudget requests per agent over the storm and the minute after: mean {mean:.2f}, max {max(per_agent)}, "
                  f"total {sum(per_agent)}; conflicts {sum(a.rem.budget.conflicts for a in agents)}")
            assert mean <= 5 and max(per_agent) <= 12, per_agent
            assert budget_requests(server, since=quiet_from) == []  # nothing changes, nothing is asked

            # One slot is freed: a holder's GPU is reset, healthy for the clear time, then its
            # rule steps down after the hold and gives the slot back.
            holder = next(a for a in agents if a.node in noexecute(server))
            holders = noexecute(server)
            watcher = Watcher(server)
            holder.recover()
            clock.advance(POLICY.clear_hold)
            holder.clean()
            holder.rem.reconcile()
            clock.advance(HOLD)
            holder.rem.reconcile()
            assert holder.node not in noexecute(server) and len(slots(server)) == BUDGET - 1
            released = len(server.requests)

            def one_more_raised() -> bool:
                round_()
                return len(noexecute(server)) == BUDGET

            # A waiting agent's watch shows the free slot; it asks at its random turn within the
            # spread (5 s); the bound stated in docs/health-and-remediation.md is the spread plus one pass.
            wait_until(one_more_raised, timeout=120, interval=0.2, message="a waiting agent raised into the freed slot")
            watcher.stop()
            assert watcher.most_slots <= BUDGET and watcher.most_ne <= BUDGET
            new = noexecute(server) - holders
            assert len(new) == 1 and holder.node not in noexecute(server)
            puts = [r for r in budget_requests(server, since=released) if r.method == "PUT"]
            print(f"after the release: {len(puts)} PUTs by the waiting agents ({sum(r.status == 409 for r in puts)} conflicts)")
        finally:
            for a in agents:
                a.rem.stop()
            pool.shutdown(wait=False, cancel_futures=True)


def test_a_missing_budget_object_is_asked_for_at_most_once_a_minute(tmp_path):
    """Ten minutes with the object missing and a fault waiting: the agent fails safe (NoSchedule,
    suppressed{budget_unavailable} once, one Event), and asks for the object at most once a
    minute. When the object appears, the waiting fault is raised."""
    with running_apiserver("1.37", bookmark_interval=3600) as server:
        server.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        clock = ManualClock(T0)
        a = Agent(server, tmp_path, 0, clock)
        try:
            a.xid()
            by_minute: list[int] = []
            for _minute in range(10):
                before = len(budget_requests(server))
                for _ in range(int(60 / STEP)):
                    a.rem.reconcile()
                    clock.advance(STEP)
                by_minute.append(len(budget_requests(server)) - before)
            print(f"\nbudget requests per minute with the object missing: {by_minute}")
            assert all(n <= 1 for n in by_minute[1:]) and sum(by_minute) >= 1, by_minute  # looked, then backed off
            rep = a.rem.report()
            assert rep.suppressed == {"budget_unavailable": 1}
            assert [r["spec"]["taint"]["effect"] for r in server.list("resource.k8s.io", "devicetaintrules")] == ["NoSchedule"]
            warned = [e for e in server.list("events.k8s.io", "events", namespace="default") if e["reason"] == "HealthRemediationSuppressed"]
            assert len(warned) == 1 and "budget" in warned[0]["note"]
            # the installer creates it: the watch sees it and the waiting fault is raised
            server.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": BUDGET_NAME, "namespace": NS}, "data": {"max_domains": "8"}})

            def raised() -> bool:
                a.rem.reconcile()
                return noexecute(server) == {a.node}

            wait_until(raised, timeout=30, interval=0.1, message="the fault raised once the budget exists")
            assert slots(server) == {f"{a.node}.{a.ident.uuid}"}
        finally:
            a.rem.stop()
