"""What an agent asks the API server does not depend on the size of the cluster (issue 13).

The same node is run twice through the production wiring against the HTTP API emulation: once
alone, once in a cluster of other GPU nodes (their ResourceSlices, their Node objects and their
agents' DeviceTaintRules). The set of requests the agent makes must be the same, every list and
watch must name this node (a field or label selector) or be API discovery, and in steady state
(no fault, no allocation change) the agent makes no request but its open watches.
"""

from __future__ import annotations

from typing import Any

import pytest
from kit_helpers import wait_until

from drasim import objects
from drasim.node import SimulatedNode
from drasim.scenario import bundled_scenarios, load_scenario
from exporter.config import TaintMode
from exporter.k8s import names

OTHER_NODES = 300
GPUS = 8
STEADY_CYCLES = 15


def _other_node_objects(i: int) -> list[dict[str, Any]]:
    node = f"other-{i:05d}"
    devices = [{"name": f"gpu-{g}", "attributes": {"uuid": {"string": f"GPU-{i:05d}-{g}"}}} for g in range(GPUS)]
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpu"},
         "spec": {"driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                  "devices": devices}},
    ]
    if i % 3 == 0:  # a third of the other nodes have a tainted GPU
        objs.append({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": names.rule_name(node, "gpu.nvidia.com", node, "gpu-0"),
                         "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: node, names.TIER_LABEL: "fatal"}},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"},
                     "taint": {"key": f"{names.TAINT_DOMAIN}/fatal", "value": "xid_79", "effect": "NoExecute"}},
        })
    return objs


def _shape(method: str, path: str, query: dict[str, str], watch: bool) -> tuple[str, str, bool, tuple[tuple[str, str], ...]]:
    """A request without what changes from run to run (resource versions, continue tokens)."""
    keep = tuple(sorted((k, v) for k, v in query.items() if k in ("fieldSelector", "labelSelector", "limit", "watch")))
    return (method, path, watch, keep)


def _run(other_nodes: int) -> tuple[set[tuple[str, str, bool, tuple[tuple[str, str], ...]]], list[Any], str]:
    sc = load_scenario(bundled_scenarios()["small-node"])
    with SimulatedNode(sc) as node:
        node.start()
        for i in range(other_nodes):
            for obj in _other_node_objects(i):
                node.api.apply(obj)
        node.api.clear_requests()
        agent = node.start_agent(interval=0.2, taint_mode=TaintMode.ENFORCE)
        rem = agent.out.remediation
        assert rem is not None
        wait_until(lambda: agent.src.get("slices").watcher.synced and rem.passes > 0 and agent.cycles > 3, timeout=120, message="the agent settled")
        startup = list(node.api.requests)
        node.api.clear_requests()
        start = agent.cycles
        wait_until(lambda: agent.cycles >= start + STEADY_CYCLES, timeout=240, message="steady-state cycles")
        steady = [r for r in node.api.requests if not r.watch]
        shapes = {_shape(r.method, r.path, r.query, r.watch) for r in startup + list(node.api.requests)}
        return shapes, steady, sc.node


@pytest.mark.slow
def test_a_big_cluster_does_not_change_what_the_agent_asks() -> None:
    alone, steady_alone, node = _run(0)
    crowded, steady_crowded, _ = _run(OTHER_NODES)
    assert crowded == alone, f"requests that depend on the cluster's size: {sorted(crowded ^ alone)}"
    # Steady state with no fault and no allocation change: nothing but the open watches.
    assert steady_alone == [] and steady_crowded == [], (steady_alone, steady_crowded)
    collections = ("/nodes", "/resourceslices", "/devicetaintrules", "/resourceclaims", "/pods", "/configmaps", "/events")
    lists = [(m, p, dict(q)) for m, p, _w, q in crowded if m == "GET" and p.endswith(collections)]
    assert lists, "the run made no list or watch at all"
    for method, path, q in lists:  # every list and watch names this node
        assert node in q.get("fieldSelector", "") + q.get("labelSelector", ""), f"a cluster-wide {method} {path} {q}"


# ------------------------------------------------------------------ claims read only when needed (issue 33)

CHURN_GPUS, CHURN_CLAIMS, BATCH = 8, 40, 10


def _churn_scenario() -> dict[str, Any]:
    """8 GPUs, the last shared by consumable capacity; 40 claims (one in ten on the shared GPU),
    each held by a pod of its own."""
    gpus = [{"name": f"g{i}", "consumable_shares": i == CHURN_GPUS - 1} for i in range(CHURN_GPUS)]
    claims = [{"namespace": "batch", "name": f"job-{c}", "devices": ["g7" if c % 10 == 9 else f"g{c % 7}"],
               **({"memory": "4Gi"} if c % 10 == 9 else {})} for c in range(CHURN_CLAIMS)]
    pods = [{"namespace": "batch", "name": f"job-{c}", "containers": [{"name": "main", "claims": [f"job-{c}"]}]}
            for c in range(CHURN_CLAIMS)]
    return {"name": "churn", "node": "churn-node", "gpus": gpus, "claims": claims, "pods": pods}


def test_new_claims_on_a_node_whose_slices_are_published_cost_no_claim_reads() -> None:
    """Batches of new pods and claims come and go; the kubelet's answer names their devices and
    the slices resolve them, so only the claims on the shared GPU (their consumed capacity
    splits it) are read: at most 0.1 API requests per new claim, one GET each for those."""
    from drasim.scenario import parse_scenario

    sc = parse_scenario(_churn_scenario())
    with SimulatedNode(sc) as node:
        node.start(pods=[])
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.ENFORCE)
        wait_until(lambda: agent.src.get("slices").watcher.synced and agent.cycles > 2, timeout=60,
                   message="the agent settled")
        node.api.clear_requests()
        for start in range(0, CHURN_CLAIMS, BATCH):
            batch = sc.pods[start:start + BATCH]
            node.set_pods(batch)
            want = {p.name for p in batch}
            wait_until(lambda w=want: agent.snapshot is not None and {c.name for c in agent.snapshot.claims} == w,
                       timeout=60, message="the batch's claims joined")
        asked = [r for r in node.api.requests if not r.watch]
        gets = sorted(r.path.rsplit("/", 1)[1] for r in asked if "/resourceclaims/" in r.path)
        assert gets == sorted(f"job-{c}" for c in range(CHURN_CLAIMS) if c % 10 == 9)
        assert len(asked) / CHURN_CLAIMS <= 0.1, [(r.method, r.path) for r in asked]


def test_a_claim_deleted_before_its_read_is_not_asked_again_and_costs_no_discovery() -> None:
    """A claim on a shared GPU the kubelet still reports but the API server no longer holds (its
    pod is going): one GET, a 404 that names the claim, no discovery request; once the kubelet
    lets go of it, it is never asked for again."""
    from drasim.scenario import parse_scenario

    sc = parse_scenario(_churn_scenario())
    gone = sc.pods[9]  # job-9: on the shared GPU
    with SimulatedNode(sc) as node:
        node.start(pods=[])
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.OFF)
        wait_until(lambda: agent.src.get("slices").watcher.synced and agent.cycles > 2, timeout=60,
                   message="the agent settled")
        node.api.delete("resource.k8s.io", "resourceclaims", gone.name, namespace=gone.namespace)
        node.api.clear_requests()
        node.kubelet.set_pods(objects.kubelet_pods(sc, [gone]))  # reported, no longer in the API
        wait_until(lambda: any("/resourceclaims/job-9" in r.path and r.status == 404 for r in node.api.requests),
                   timeout=30, message="the claim's GET answered 404")
        node.kubelet.set_pods([])
        start = agent.cycles
        wait_until(lambda: agent.cycles >= start + 20, timeout=60, message="cycles after the kubelet let go")
        asked = [(r.method, r.path, r.status) for r in node.api.requests if not r.watch]
        assert asked == [("GET", "/apis/resource.k8s.io/v1/namespaces/batch/resourceclaims/job-9", 404)]


def test_a_device_gone_from_the_slices_is_still_resolved_through_its_claim() -> None:
    """The fallback stays: job-0's GPU is not in this node's slice (a driver restart republishing
    it, say), so the agent reads job-0's claim and resolves the device by the uuid its driver
    wrote in ``status.devices[].data``; job-1's GPU is published, and its claim is not read."""
    from drasim.scenario import DRIVER, parse_scenario

    sc = parse_scenario(_churn_scenario())
    held = sc.pods[:2]
    with SimulatedNode(sc) as node:
        node.start(pods=held)
        (claim,) = [c for c in objects.resource_claims(sc, held) if c["metadata"]["name"] == "job-0"]
        claim["status"]["devices"] = [{"driver": DRIVER, "pool": sc.node, "device": "gpu-0",
                                       "data": {"uuid": {"string": node.uuid("g0")}}}]
        node.api.apply(claim)
        sl = objects.resource_slice(sc)
        sl["spec"]["devices"] = [d for d in sl["spec"]["devices"] if d["name"] != "gpu-0"]
        node.api.apply(sl)
        node.api.clear_requests()
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.OFF)

        def resolved() -> dict[str, tuple[str, str]] | None:
            rows = {a.claim: (a.uuid, a.method) for a in (agent.snapshot.allocations if agent.snapshot else ())}
            return rows if rows.get("job-0", ("", ""))[0] else None

        rows = wait_until(resolved, timeout=60, message="job-0's device resolved through its claim")
        assert rows == {"job-0": (node.uuid("g0"), "claim-data-uuid"), "job-1": (node.uuid("g1"), "uuid")}
        gets = [r.path.rsplit("/", 1)[1] for r in node.api.requests if "/resourceclaims/" in r.path]
        assert gets == ["job-0"]
