"""Failure isolation and attribution of the whole agent, built by the production wiring
(gRPC kubelet client, Kubernetes API client over HTTP) around real peers: a FakeKubelet on a
unix socket and a FakeApiServer. Only the device backend is simulated.

Cycles are driven by hand (``agent.run_cycle()``; the sampler's interval is an hour) and the
results are read back over HTTP from the agent's own /metrics and /readyz.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from kit_helpers import fetch, wait_until
from prometheus_client.parser import text_string_to_metric_families

from drasim import objects
from drasim.apiserver import FakeApiServer
from drasim.backend import SimClock
from drasim.kubelet import FakeKubelet
from drasim.node import SimulatedNode
from drasim.scenario import Scenario, bundled_scenarios, default_scenario, load_scenario, parse_scenario
from exporter.agent import Agent
from exporter.config import TaintMode

# ------------------------------------------------------------------ helpers


class Scrape:
    def __init__(self, body: bytes) -> None:
        self.samples = [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]

    def find(self, name: str, **labels: str) -> list:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float | None:
        hits = self.find(name, **labels)
        assert len(hits) <= 1, f"{name}{labels}: {len(hits)} series"
        return hits[0].value if hits else None


@dataclass
class Node:
    agent: Agent
    kubelet: FakeKubelet
    api: FakeApiServer
    sc: Scenario
    socket: str

    def scrape(self, cycle: bool = True) -> Scrape:
        if cycle:
            self.agent.run_cycle()
        status, body = fetch(self.agent.server.url + "/metrics")
        assert status == 200
        return Scrape(body)

    def readyz(self) -> tuple[int, str]:
        status, body = fetch(self.agent.server.url + "/readyz")
        return status, body.decode()

    def set_pods(self, pods) -> None:
        """What the kubelet and the API server say about the node's pods, changed together."""
        self.kubelet.set_pods(objects.kubelet_pods(self.sc, list(pods)))
        for c in objects.resource_claims(self.sc, list(pods)):
            self.api.apply(c)

    def uuid(self, ref: str) -> str:
        return objects.device_uuid(self.sc, ref)


@contextmanager
def simulated_node(sc: Scenario, *, start_kubelet: bool = True, t: float = 0.0, scale: float = 1e-6, api_setup=None, **cfg_kw):
    """The agent on a simulated node. Simulated time starts at ``t`` and runs ``scale`` times
    faster than real time (the default barely moves: tests pick the moment they look at)."""
    with SimulatedNode(sc, SimClock(scale=scale, start_offset=t), bookmark_interval=0.2, kubelet_qps=None) as node:
        node.start(start_kubelet=start_kubelet, api_setup=api_setup)
        kw = dict(interval=3600.0, call_timeout=1.0, taint_mode=TaintMode.OFF)
        kw.update(cfg_kw)
        agent = node.start_agent(remediation_resync=0.2, **kw)
        wait_until(lambda: agent.src.get("slices").watcher.synced, timeout=60, message="ResourceSlices listed")
        yield Node(agent, node.kubelet, node.api, sc, node.socket)


def with_faults(sc: Scenario, *faults: dict) -> Scenario:
    """The scenario with extra faults (``{"kind": ..., "gpu": ..., "at": ...}``)."""
    from drasim.scenario import Fault

    extra = tuple(Fault(kind=f["kind"], gpu=f["gpu"], at=f.get("at", 0.0), until=f.get("until"), code=f.get("code", 0)) for f in faults)
    return dataclasses.replace(sc, faults=tuple(sorted(sc.faults + extra, key=lambda f: f.at)))


MIXED = dataclasses.replace(default_scenario(), faults=())  # the bundled node, minus its script


# ------------------------------------------------------------------ devices


def test_one_lost_gpu_does_not_affect_the_others():
    sc = with_faults(MIXED, {"kind": "lost", "gpu": "gpu1"})
    with simulated_node(sc) as n:
        m = n.scrape()
        lost = n.uuid("gpu1")
        assert m.value("gpu_up", uuid=lost) == 0
        assert m.find("gpu_utilization_ratio", uuid=lost) == [] and m.find("gpu_power_watts", uuid=lost) == []
        assert m.value("gpu_healthy", uuid=lost) == 0
        assert m.value("dra_gpu_exporter_collector_success", collector="devices") == 1
        for g in ("gpu0", "gpu3", "gpu4"):
            u = n.uuid(g)
            assert m.value("gpu_up", uuid=u) == 1
            assert m.value("gpu_utilization_ratio", uuid=u) is not None
            assert m.value("gpu_healthy", uuid=u) == 1
        for ref in ("gpu2:3g.40gb:0", "gpu2:3g.40gb:4"):
            assert m.value("gpu_up", uuid=n.uuid(ref)) == 1
        # who holds the lost GPU is still known; its claim is unhealthy, the others are not
        assert m.value("dra_device_allocation_info", pod="big-train", uuid=lost, claim="train-xl") == 1
        assert m.value("dra_claim_healthy", namespace="ml", claim="train-xl") == 0
        assert m.value("dra_claim_healthy", namespace="ml", claim="shared-gpu") == 1
        assert m.find("dra_claim_utilization_ratio", claim="train-xl") == []
        assert n.readyz()[0] == 200


def test_unallocated_device_is_still_exported():
    sc = parse_scenario(
        {"node": "n1", "gpus": [{"name": "used", "utilization": 0.5}, {"name": "free", "utilization": 0.0}],
         "claims": [{"namespace": "a", "name": "c", "devices": ["used"]}],
         "pods": [{"namespace": "a", "name": "p", "containers": [{"name": "m", "claims": ["c"]}]}]},
        "t",
    )
    with simulated_node(sc) as n:
        m = n.scrape()
        free = n.uuid("free")
        assert m.value("gpu_info", uuid=free) == 1
        assert m.value("gpu_up", uuid=free) == 1
        assert m.value("gpu_utilization_ratio", uuid=free) == 0.0
        assert m.find("dra_device_allocation_info", uuid=free) == []
        assert m.value("dra_device_allocation_info", uuid=n.uuid("used"), pod="p", claim="c", device="gpu-0", pool="n1", driver="gpu.nvidia.com") == 1


# ------------------------------------------------------------------ kubelet


def test_kubelet_missing_then_back():
    with simulated_node(MIXED, start_kubelet=False) as n:
        m = n.scrape()
        # device metrics are served without the kubelet
        assert m.value("gpu_up", uuid=n.uuid("gpu0")) == 1
        assert m.value("dra_gpu_exporter_collector_success", collector="kubelet") == 0
        assert m.value("dra_gpu_exporter_collector_success", collector="devices") == 1
        assert m.find("dra_device_allocation_info") == []
        status, body = n.readyz()
        assert status == 200 and "kubelet" in body and body.startswith("ready (degraded)")

        n.kubelet.start()
        m = wait_until(lambda: (s := n.scrape()).value("dra_gpu_exporter_collector_success", collector="kubelet") == 1 and s,
                       timeout=10, interval=0.05, message="kubelet collector recovered")
        assert m.value("dra_device_allocation_info", pod="trainer-a", uuid=n.uuid("gpu0"), claim="shared-gpu") == 1
        assert m.value("dra_claim_devices", namespace="ml", claim="shared-gpu") == 1
        assert n.readyz() == (200, "ready\n")


def test_kubelet_restart_keeps_last_allocations_within_grace():
    with simulated_node(MIXED) as n:
        assert n.scrape().value("dra_device_allocation_info", pod="trainer-a", uuid=n.uuid("gpu0"), claim="shared-gpu") == 1
        n.kubelet.stop()
        m = n.scrape()
        assert m.value("dra_gpu_exporter_collector_success", collector="kubelet") == 0
        # a kubelet restart must not blank the dashboards: last good allocations are kept
        assert m.value("dra_device_allocation_info", pod="trainer-a", uuid=n.uuid("gpu0"), claim="shared-gpu") == 1


def test_ended_pods_vanish_next_cycle():
    with simulated_node(MIXED) as n:
        m = n.scrape()
        assert m.value("dra_claim_pods", namespace="ml", claim="shared-gpu") == 2
        assert m.find("dra_device_allocation_info", pod="notebook")
        remaining = [p for p in MIXED.pods if p.name not in ("trainer-b", "notebook")]
        n.set_pods(remaining)
        m = n.scrape()
        assert m.find("dra_device_allocation_info", pod="trainer-b") == []
        assert m.find("dra_device_allocation_info", pod="notebook") == []
        # the shared claim stays, with one pod; the notebook's claim is gone entirely
        assert m.value("dra_claim_pods", namespace="ml", claim="shared-gpu") == 1
        for fam in ("dra_claim_devices", "dra_claim_pods", "dra_claim_utilization_ratio", "dra_claim_healthy"):
            assert m.find(fam, claim="idle-notebook") == [], fam
        # the device itself is still there, now unallocated
        assert m.value("gpu_up", uuid=n.uuid("gpu4")) == 1


def test_reallocated_claim_moves_with_its_device():
    with simulated_node(MIXED) as n:
        m = n.scrape()
        old, new = n.uuid("gpu1"), n.uuid("gpu4")
        assert m.value("dra_device_allocation_info", pod="big-train", uuid=old, device="gpu-1") == 1
        # big-train ends, its claim is reallocated to gpu4 (the notebook's pod is gone too)
        claims = tuple(dataclasses.replace(c, devices=("gpu4",)) if c.name == "train-xl" else c for c in MIXED.claims if c.name != "idle-notebook")
        pods = tuple(p for p in MIXED.pods if p.name != "notebook")
        n.sc = dataclasses.replace(MIXED, claims=claims, pods=pods)
        n.set_pods(pods)
        m = n.scrape()
        assert m.find("dra_device_allocation_info", uuid=old) == []
        assert m.value("dra_device_allocation_info", pod="big-train", uuid=new, device="gpu-4", claim="train-xl") == 1
        util_new = m.value("gpu_utilization_ratio", uuid=new)
        assert m.value("dra_claim_utilization_ratio", namespace="ml", claim="train-xl") == pytest.approx(util_new)
        assert m.value("dra_claim_memory_used_bytes", namespace="ml", claim="train-xl") == m.value("gpu_memory_used_bytes", uuid=new)


# ------------------------------------------------------------------ API server


def test_api_server_outage_keeps_serving():
    with simulated_node(MIXED) as n:
        before = n.scrape()
        rows = {(s.labels["pod"], s.labels["container"], s.labels["uuid"]) for s in before.find("dra_device_allocation_info")}
        assert len(rows) == 9  # the mixed node's containers that hold a GPU
        n.api.outage(True)
        wait_until(lambda: n.agent.src.get("slices").watcher.last_error, timeout=10, message="the slice watch to notice the outage")
        m = n.scrape()
        # device metrics and attribution (from the kubelet and the last good slices) go on
        assert m.value("gpu_up", uuid=n.uuid("gpu0")) == 1
        assert {(s.labels["pod"], s.labels["container"], s.labels["uuid"]) for s in m.find("dra_device_allocation_info")} == rows
        assert m.value("dra_claim_devices", namespace="ml", claim="shared-gpu") == 1
        assert m.value("dra_gpu_exporter_collector_success", collector="slices") == 0
        status, body = n.readyz()
        assert status == 200 and "slices" in body
        n.api.outage(False)
        wait_until(lambda: n.scrape().value("dra_gpu_exporter_collector_success", collector="slices") == 1,
                   timeout=15, interval=0.1, message="slice watch recovered")


def test_slow_api_server_does_not_stall_device_collection():
    # The API server holds the first ResourceClaim GET for 2 s. The cycle must not wait for it:
    # it finishes with what it has, and the fetch completes in the background.
    def slow_claims(api):
        api.delay_next(r"/resourceclaims/", 2.0, count=1)

    with simulated_node(MIXED, api_setup=slow_claims) as n:
        m = n.scrape()
        held = [r for r in n.api.requests if "/resourceclaims/" in r.path and r.status == 0]
        assert held, "the cycle returned only after the API answered"
        assert m.value("gpu_up", uuid=n.uuid("gpu0")) == 1
        assert m.value("dra_gpu_exporter_collector_success", collector="devices") == 1
        assert m.value("dra_gpu_exporter_collector_success", collector="claims") == 0
        status, body = n.readyz()
        assert status == 200 and "API too slow" in body
        # attribution does not depend on the claims (the slice resolves the devices)
        assert m.value("dra_device_allocation_info", pod="trainer-a", uuid=n.uuid("gpu0"), claim="shared-gpu") == 1
        wait_until(lambda: n.scrape().value("dra_gpu_exporter_collector_success", collector="claims") == 1,
                   timeout=15, interval=0.1, message="claims fetched after the slow answer")


# ------------------------------------------------------------------ labels


def test_dcgm_compat_labels():
    with simulated_node(MIXED, dcgm_compat_labels=True) as n:
        m = n.scrape()
        shared = n.uuid("gpu0")
        rows = m.find("gpu_utilization_ratio", uuid=shared)
        # dcgm-exporter style: one series per pod holding the device
        assert {(s.labels["pod"], s.labels["namespace"], s.labels["container"], s.labels["dra_claim_name"]) for s in rows} == {
            ("trainer-a", "ml", "main", "shared-gpu"),
            ("trainer-b", "ml", "main", "shared-gpu"),
        }
        assert rows[0].labels["dra_driver_name"] == "gpu.nvidia.com" and rows[0].labels["dra_device_name"] == "gpu-0"
        dp = m.find("gpu_utilization_ratio", uuid=n.uuid("gpu3"))
        assert [(s.labels["pod"], s.labels["dra_claim_name"]) for s in dp] == [("dp-job", "")]
        # the claim metrics are still once per claim
        assert len(m.find("dra_claim_utilization_ratio", claim="shared-gpu")) == 1


def test_dcgm_compat_labels_off_by_default():
    with simulated_node(MIXED) as n:
        rows = n.scrape().find("gpu_utilization_ratio", uuid=n.uuid("gpu0"))
        assert len(rows) == 1 and "pod" not in rows[0].labels


def test_pod_label_allowlist():
    with simulated_node(MIXED, pod_label_allowlist=("app", "team")) as n:
        m = wait_until(lambda: (s := n.scrape()).find("dra_pod_labels", pod="trainer-a", label_app="trainer") and s,
                       timeout=10, interval=0.05, message="pod labels")
        assert m.value("dra_pod_labels", namespace="ml", pod="trainer-a", label_app="trainer", label_team="ml") == 1
        # a pod without one of the labels gets it empty; labels not on the list never appear
        assert m.value("dra_pod_labels", namespace="inference", pod="infer-0", label_app="infer", label_team="") == 1
        assert all(set(s.labels) == {"node", "namespace", "pod", "label_app", "label_team"} for s in m.find("dra_pod_labels"))


# ------------------------------------------------------------------ node-wide failures


def test_failure_storm_is_treated_as_a_node_fault():
    sc = load_scenario(bundled_scenarios()["failure-storm"])
    # x20: the 25 simulated seconds of the storm take 1.25 s
    with simulated_node(sc, scale=20.0, taint_mode=TaintMode.ENFORCE, call_timeout=0.5) as n:
        def settled():
            n.agent.run_cycle()
            rules = n.api.list("resource.k8s.io", "devicetaintrules")
            effects = sorted(r["spec"]["taint"]["effect"] for r in rules)
            return len(rules) == 5 and effects.count("NoExecute") == n.agent.cfg.taint_rate_limit and rules

        # Issue 16 changed this: "node-wide" is a majority of the GPUs failing within
        # --node-fault-window (2 s); these five fail 5 s apart over 20 s, so each is its own
        # fault and the per-node rate limit is what caps the evictions.
        rules = wait_until(settled, timeout=15, interval=0.1, message="five rules, the rate limit's worth of them NoExecute")
        effects = sorted(r["spec"]["taint"]["effect"] for r in rules)
        # at most the per-node rate limit evicts; the rest only stop new placements
        assert effects.count("NoExecute") <= n.agent.cfg.taint_rate_limit
        assert effects.count("NoSchedule") >= 3
        m = n.scrape()
        assert m.value("dra_gpu_exporter_taint_suppressed_total", reason="rate_limit") >= 1
        assert sum(1 for g in sc.gpus if m.value("gpu_healthy", uuid=g.uuid) == 0) == 5
