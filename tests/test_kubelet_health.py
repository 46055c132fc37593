"""The kubelet's device health (KEP-4680) read from this node's pods, beside the agent's verdict.

The agent (production wiring) runs on a simulated node whose pods carry what the kubelet writes
into their status (``allocatedResourcesStatus``, resource ids in the kubelet's two forms), checked
against the official schemas. The per-device series carry the kubelet's word, the agent's own
verdict ignores it, the pod watch names this node, and with the flag off nothing of it exists.
The alert that compares the two verdicts is tested under promtool (alerts/tests/kubelet-health.test.yml).
"""

from __future__ import annotations

import pytest
from chart_render import render_docs
from kit_helpers import scrape_samples, wait_until
from validation import validate_strict

from drasim import objects
from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.k8s.model import AllocatedDevice, ClaimInfo
from exporter.k8s.parse import parse_pod
from exporter.k8s.podhealth import reported_health

DRIVER = objects.DRIVER
SCENARIO = {
    "name": "kubelet-health",
    "node": "kh-node",
    "gpus": [{"name": f"gpu{i}", "utilization": 0.5, "memory_used": 0.25} for i in range(5)],
    "claims": [
        {"namespace": "team-a", "name": "train", "devices": ["gpu0"]},
        {"namespace": "team-a", "name": "eval", "devices": ["gpu1"]},
        {"namespace": "team-b", "name": "serve", "devices": ["gpu2"]},
        {"namespace": "team-b", "name": "pair", "devices": ["gpu3", "gpu4"]},
    ],
    "pods": [
        {"namespace": "team-a", "name": "trainer", "containers": [{"name": "main", "claims": ["train", "eval"]}]},
        {"namespace": "team-b", "name": "server", "containers": [{"name": "main", "claims": ["serve", "pair"]}]},
    ],
    # our evidence: gpu0 falls off the bus (XID 79): the agent's verdict is "failed"
    "faults": [{"kind": "xid", "gpu": "gpu0", "at": "1s", "code": 79}, {"kind": "lost", "gpu": "gpu0", "at": "1s"}],
}
# what the driver streams through the kubelet; gpu0 Healthy is the disagreement with our evidence
HEALTH = {"gpu0": "Healthy", "gpu1": "Unhealthy", "gpu2": "Unknown", "gpu3": "Unhealthy", "gpu4": "Unhealthy"}
# gpu1's driver returned a CDI id (the kubelet then writes that, not driver/pool/device): its claim
# has one device, so the id is that device's. gpu3 and gpu4 share NVIDIA's "device=all" id, which
# the kubelet lists once: it names neither, and is not guessed.
CDI = {"gpu1": "k8s.gpu.nvidia.com/claim=6a1c-gpu-1",
       "gpu3": "k8s.gpu.nvidia.com/device=all", "gpu4": "k8s.gpu.nvidia.com/device=all"}


def reported_pods(sc, health=HEALTH):
    return [objects.pod_with_reported_health(sc, p, health, CDI) for p in sc.pods]


@pytest.mark.parametrize("version", ["1.34", "1.37"])
def test_the_pods_as_the_kubelet_writes_them_are_valid(version):
    sc = parse_scenario(SCENARIO, "kh")
    for pod in reported_pods(sc):
        validate_strict(pod, version)
    statuses = reported_pods(sc)[1]["status"]["containerStatuses"][0]["allocatedResourcesStatus"]
    assert {s["name"]: [r["resourceID"] for r in s["resources"]] for s in statuses} == {
        "claim:serve": [f"{DRIVER}/kh-node/gpu-2"], "claim:pair": ["k8s.gpu.nvidia.com/device=all"]}


def _pod(claims, statuses):
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"nodeName": "n", "containers": [{"name": "c"}],
                     "resourceClaims": [{"name": ref, "resourceClaimTemplateName": "t"} for ref in claims]},
            "status": {"phase": "Running",
                       "resourceClaimStatuses": [{"name": r, "resourceClaimName": n} for r, n in claims.items()],
                       "containerStatuses": [{"name": "c", "allocatedResourcesStatus": statuses}]}}


def test_resource_ids_match_as_the_kubelet_writes_them():
    claims = {
        ("ns", "p-gpus-x7"): ClaimInfo("ns", "p-gpus-x7", devices=(
            AllocatedDevice("big/a", "gpu.example.com", "pool", "d0"),
            AllocatedDevice("small", "gpu.example.com", "pool", "d1"),
            AllocatedDevice("small", "gpu.example.com", "pool", "d2"))),
    }
    entries = [
        # <driver>/<pool>/<device>: a pool may hold slashes, the driver and the device cannot
        {"name": "claim:gpus/small",
         "resources": [{"resourceID": "gpu.example.com/rack-1/node-a/d9", "health": "Unhealthy"}]},
        # a CDI id for a request the allocation gives one device (a subrequest counts as its request)
        {"name": "claim:gpus/big", "resources": [{"resourceID": "vendor.example/gpu=x", "health": "Unknown"}]},
        # a CDI id for a request with two devices, and for the whole claim: not matched
        {"name": "claim:gpus/small", "resources": [{"resourceID": "vendor.example/gpu=y", "health": "Unhealthy"}]},
        {"name": "claim:gpus", "resources": [{"resourceID": "vendor.example/gpu=z", "health": "Unhealthy"}]},
        # a device-plugin resource is not read; a health outside the API's three is not matched
        {"name": "nvidia.com/gpu", "resources": [{"resourceID": "GPU-1234", "health": "Unhealthy"}]},
        {"name": "claim:gpus/small", "resources": [{"resourceID": "gpu.example.com/pool/d1", "health": "Degraded"}]},
        # the same device twice: the worst report wins whatever the order
        {"name": "claim:gpus/small", "resources": [{"resourceID": "gpu.example.com/pool/d2", "health": "Unhealthy"}]},
        {"name": "claim:gpus/small", "resources": [{"resourceID": "gpu.example.com/pool/d2", "health": "Healthy"}]},
    ]
    pod = parse_pod(_pod({"gpus": "p-gpus-x7"}, entries), reported=True)
    assert len(pod.reported) == 7 and pod.reported[0].claim == "p-gpus-x7" and pod.reported[1].request == "big"
    assert parse_pod(_pod({"gpus": "p-gpus-x7"}, entries)).reported == ()  # not read without the flag
    health, unmatched = reported_health([pod], claims)
    assert health == {("gpu.example.com", "rack-1/node-a", "d9"): "Unhealthy",
                      ("gpu.example.com", "pool", "d0"): "Unknown",
                      ("gpu.example.com", "pool", "d2"): "Unhealthy"}
    assert unmatched == 3


@pytest.fixture
def node():
    sc = parse_scenario(SCENARIO, "kh")
    with SimulatedNode(sc, SimClock(1.0)) as node:
        node.start()
        for pod in reported_pods(sc):
            node.api.apply(pod)
        yield node


def _reported(url):
    rows = scrape_samples(url).get("dra_device_reported_health", [])
    return {lab["device"]: (lab["health"], lab["uuid"], lab["pool"]) for lab, v in rows if v == 1}


def test_the_kubelets_word_is_exported_beside_ours_and_never_taken_for_it(node):
    sc = node.scenario
    # pod labels want the node's pods too: the one watch serves both
    agent = node.start_agent(interval=0.1, call_timeout=1.0, kubelet_device_health=True, pod_label_allowlist=("app",))
    url = agent.server.url
    expected = {node.device_name("gpu0"): ("Healthy", node.uuid("gpu0"), sc.node),
                node.device_name("gpu1"): ("Unhealthy", node.uuid("gpu1"), sc.node),
                node.device_name("gpu2"): ("Unknown", node.uuid("gpu2"), sc.node)}
    wait_until(lambda: _reported(url) == expected, timeout=30, message=f"the kubelet's health per device {expected}")
    # our verdict stands on our evidence alone: gpu0 failed (the kubelet's Healthy changes
    # nothing), gpu1 is healthy (its Unhealthy is the driver's word, not ours)
    ours = wait_until(lambda: (lambda h: h if h.get(node.uuid("gpu0")) == 0 else None)(
        {lab["uuid"]: v for lab, v in scrape_samples(url)["gpu_healthy"]}), timeout=30, message="gpu0 failed")
    assert ours[node.uuid("gpu1")] == 1 and ours[node.uuid("gpu2")] == 1
    # the kubelet writes a new status: the watch brings it, no poll
    node.api.apply(objects.pod_with_reported_health(sc, sc.pods[0], {**HEALTH, "gpu1": "Healthy"}, CDI))
    wait_until(lambda: _reported(url).get(node.device_name("gpu1"), ("",))[0] == "Healthy",
               timeout=30, message="the update")
    assert {lab["uuid"]: v for lab, v in scrape_samples(url)["gpu_healthy"]}[node.uuid("gpu0")] == 0
    # a finished pod's status is no longer updated by the kubelet: its last word is not evidence
    done = objects.pod_with_reported_health(sc, sc.pods[1], HEALTH, CDI)
    done["status"]["phase"] = "Succeeded"
    node.api.apply(done)
    wait_until(lambda: node.device_name("gpu2") not in _reported(url), timeout=30,
               message="the finished pod's report to go")
    # every read of the pods is this node's: one list and its watch, by field selector, counted once
    pods = [r for r in node.api.requests if r.path.rstrip("/") == "/api/v1/pods"]
    assert any(r.watch for r in pods) and len([r for r in pods if not r.watch]) == 1
    assert {r.query.get("fieldSelector") for r in pods} == {f"spec.nodeName={sc.node}"}
    requests = scrape_samples(url)["dra_gpu_exporter_source_requests_total"]
    counted = {(lab["source"], lab["verb"]): v for lab, v in requests}
    assert counted[("pods", "list")] == 1 and counted[("pods", "watch")] >= 1
    assert not [k for k in counted if k[0] == "kubelet_health"]


def test_off_by_default_no_series_and_no_pod_reads(node):
    agent = node.start_agent(interval=0.1, call_timeout=1.0)
    url = agent.server.url
    wait_until(lambda: scrape_samples(url).get("dra_device_allocation_info"), timeout=30, message="the join")
    assert "dra_device_reported_health" not in scrape_samples(url)
    assert not [r for r in node.api.requests if "/pods" in r.path and not r.path.startswith("/api/v1/namespaces/")]


def test_the_chart_grants_the_pod_watch_only_with_its_value():
    def pod_verbs(values):
        roles = [d for d in render_docs(values)
                 if d and d.get("kind") == "ClusterRole" and d["metadata"]["name"] == "dra-gpu-exporter"]
        return sorted(v for r in roles[0]["rules"] if "pods" in r["resources"] for v in r["verbs"])

    def env(values):
        ds = next(d for d in render_docs(values) if d and d.get("kind") == "DaemonSet")
        return {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert pod_verbs({}) == ["get"]
    assert pod_verbs({"kubeletDeviceHealth": True}) == ["get", "list", "watch"]
    assert pod_verbs({"kubeletDeviceHealth": True, "perProcess": True}) == ["get", "list", "watch"]
    assert env({"kubeletDeviceHealth": True})["DRA_GPU_EXPORTER_KUBELET_DEVICE_HEALTH"] == "true"
    assert "DRA_GPU_EXPORTER_KUBELET_DEVICE_HEALTH" not in env({})
