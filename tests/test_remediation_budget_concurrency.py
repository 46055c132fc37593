"""The cluster budget holds under concurrency (issue 13): 120 agents (threads) against one API
emulation, every one of them faulting at the same moment with a budget of N: exactly N fault
domains get NoExecute, never more, and the budget is returned on recovery.

Real parts: the HTTP API emulation (one server, optimistic concurrency on the one budget
ConfigMap), one HTTP client per agent, a health engine and a remediator per agent, the real
``ClusterBudget``. Each agent's ResourceSlice is parsed by the agent's own parser from the
object its node publishes (one SliceWatcher thread per agent would add 120 watch streams
without testing anything more about the budget).
"""

from __future__ import annotations

import threading

from clock_helpers import ManualClock
from k8s_helpers import running_apiserver, write_kubeconfig

from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, RecoveryAction, Vendor
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.k8s.budget import BUDGET_NAME, ClusterBudget
from exporter.k8s.connection import ApiError, connect
from exporter.k8s.parse import parse_slice
from exporter.model.join import JoinInputs, join
from exporter.remediation.adoption import BootIdentity
from exporter.wiring import build_remediator

AGENTS = 120
BUDGET = 7
NS = "dra-gpu-exporter"
T0 = 1_750_000_000.0
HOLD = 60.0
POLICY = HealthPolicy(clear_hold=10.0)


class PublishedSlices:
    """This node's devices, parsed from the ResourceSlice object the node publishes."""

    synced = True
    last_error = None
    api_version = "v1"

    def __init__(self, obj: dict) -> None:
        self._devices = {d.key: d for d in parse_slice(obj, "v1")}

    def devices(self):
        return dict(self._devices)


def node_objects(i: int) -> tuple[str, DeviceIdentity, dict]:
    node = f"gpu-node-{i:04d}"
    ident = DeviceIdentity(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", vendor=Vendor.NVIDIA, model="H100", pci_bus_id="0000:18:00.0", index=0, minor=0)
    sl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpu"},
          "spec": {"driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                   "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": ident.uuid}, "resource.kubernetes.io/pciBusID": {"string": ident.pci_bus_id}}}]}}
    return node, ident, sl


def make_budget(api):
    # The agent's own flag says 16; the object the installer created says BUDGET: the object wins.
    # 120 budget watches open at once on a busy 2-core machine: give each first list, and the
    # racers' conflicts, room enough that no agent fails safe (NoSchedule, which a full budget
    # then rightly keeps) for want of an answer: this test is about the race, not a slow API.
    return ClusterBudget(api, NS, taint_budget_max=16, attempts=AGENTS, first_read=60.0)


def test_agents_faulting_at_once_take_exactly_the_budget_and_return_it(tmp_path):
    with running_apiserver("1.37", bookmark_interval=3600) as server:
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", server.url))
        clock = ManualClock(T0)
        server.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        # as the Helm chart creates it (templates/06-budget.yaml)
        server.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": BUDGET_NAME, "namespace": NS},
                      "data": {"max_domains": str(BUDGET), "fraction": "0.05", "cluster_gpus": "0"}})
        agents = []
        for i in range(AGENTS):
            node, ident, sl = node_objects(i)
            server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
            api = connect(kubeconfig)
            health = HealthEngine(clock, POLICY)
            health.set_topology([ident])
            cfg = Config(node_name=node, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=HOLD, taint_settle_seconds=0.0, node_fault_window=0.0)
            rem = build_remediator(cfg, api, health, clock, 0.0, watch=False, budget=make_budget(api), node_state=False, boot=BootIdentity("boot-1", T0))
            rem.update(join(JoinInputs(node=node, timestamp=T0, identities=(ident,), readings={}, health={}, slices=PublishedSlices(sl).devices())))
            rem.rules.served()  # discovery before the race, as a running agent has done long before
            agents.append((rem, health, ident))

        for _, health, ident in agents:
            health.on_event(DeviceEvent(uuid=ident.uuid, kind=EventKind.XID, code=79, detail="test"))
        start = threading.Barrier(AGENTS)
        errors: list[BaseException] = []

        def run(rem):
            try:
                start.wait(timeout=60)
                rem.reconcile()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(rem,)) for rem, _, _ in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        def noexecute() -> int:
            return sum(r["spec"]["taint"]["effect"] == "NoExecute" for r in server.list("resource.k8s.io", "devicetaintrules"))

        # Never more than N, even in the race (on a busy machine some requests may time out:
        # those agents fenced with NoSchedule, failing safe, or failed their pass).
        assert noexecute() <= BUDGET
        # Their next pass (the loop retries after a failed pass) completes the picture.
        for rem, _, _ in agents:
            rem.reconcile()
        rules = server.list("resource.k8s.io", "devicetaintrules")
        effects = sorted(r["spec"]["taint"]["effect"] for r in rules)
        assert len(rules) == AGENTS
        assert effects.count("NoExecute") == BUDGET  # exactly N, never more
        assert effects.count("None") == AGENTS - BUDGET
        held = agents[0][0].budget.held()
        assert len(held) == BUDGET

        assert all(isinstance(e, ApiError) and e.retryable for e in errors), errors  # only transport trouble
        # a further pass changes nothing: no agent takes a slot twice or loses its own
        for rem, _, _ in agents:
            rem.reconcile()
        assert sorted(r["spec"]["taint"]["effect"] for r in server.list("resource.k8s.io", "devicetaintrules")).count("NoExecute") == BUDGET

        # every GPU recovers: reset, clean readings for the health hold, one step down per hold
        for _, health, ident in agents:
            health.on_event(DeviceEvent(uuid=ident.uuid, kind=EventKind.RESET))
        clock.advance(POLICY.clear_hold)
        for _, health, ident in agents:
            health.observe([ident], {ident.uuid: DeviceReading(uuid=ident.uuid, recovery_action=RecoveryAction.NONE, ecc_uncorrectable_total=0)})
        for _ in range(2):
            for rem, _, _ in agents:
                rem.reconcile()
            clock.advance(HOLD)
        for rem, _, _ in agents:
            rem.reconcile()
        assert "NoExecute" not in {r["spec"]["taint"]["effect"] for r in server.list("resource.k8s.io", "devicetaintrules")}
        assert agents[0][0].budget.held() == set()  # returned
        for rem, _, _ in agents:
            rem.stop()  # (closes its budget's watch, if one is still open)
