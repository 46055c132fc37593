"""End to end: a simulated XID 79 on one GPU -> exactly that device's NoExecute DeviceTaintRule
-> removed again after the GPU is reset and has stayed healthy.

The agent is built by the real wiring (``build_agent``): the sim device backend, a real gRPC
PodResources server on a unix socket, the in-process Kubernetes API over HTTP (with a strict
kubernetes-validate validator for every object written), the SliceWatcher, the health engine and
the remediator thread, and the agent's own /metrics server, scraped over HTTP. Simulated time
runs 20x faster than real time.
"""

from __future__ import annotations

import urllib.request

import pytest
from k8s_helpers import publish_scenario, running_apiserver, wait_until, write_kubeconfig
from prometheus_client.parser import text_string_to_metric_families
from validation import StrictValidator, validate_strict

from exporter.config import Config, TaintMode
from drasim.backend import SimBackend, SimClock
from exporter.health.engine import HealthPolicy
from exporter.remediation import names
from drasim import objects
from drasim.kubelet import FakeKubelet
from drasim.scenario import parse_scenario
from exporter.wiring import build_agent

SCALE = 20.0  # simulated seconds per real second
RESET_AT = 40.0
SCENARIO = {
    "name": "e2e-xid79",
    "node": "e2e-node",
    "gpus": [{"name": f"gpu{i}", "utilization": 0.5, "memory_used": 0.25} for i in range(4)],
    "claims": [
        {"namespace": "team-a", "name": "train", "devices": ["gpu1"]},
        {"namespace": "team-b", "name": "serve", "devices": ["gpu2"]},
    ],
    "pods": [
        {"namespace": "team-a", "name": "trainer", "containers": [{"name": "main", "claims": ["train"]}]},
        {"namespace": "team-b", "name": "server", "containers": [{"name": "main", "claims": ["serve"]}]},
    ],
    "faults": [
        {"kind": "xid", "gpu": "gpu1", "at": "5s", "code": 79},
        {"kind": "lost", "gpu": "gpu1", "at": "5s"},
        {"kind": "reset", "gpu": "gpu1", "at": "40s"},  # 1.75 s of real time after the XID for the checks
    ],
}


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture
def cluster(tmp_path):
    sc = parse_scenario(SCENARIO, "e2e")
    kubelet = FakeKubelet(str(tmp_path / "kubelet.sock"))
    kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
    kubelet.start()
    with running_apiserver("1.37", bookmark_interval=1.0) as server:
        validator = StrictValidator("1.37")
        server.set_validator(validator)
        publish_scenario(server, sc)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url)
        try:
            yield sc, server, validator, kubelet, kubeconfig
        finally:
            kubelet.stop()


def test_xid79_taints_exactly_that_device_and_recovery_removes_it(cluster):
    sc, server, validator, kubelet, kubeconfig = cluster
    clock = SimClock(SCALE, start_offset=-20.0)  # 1 s of real time to start up before sim t=0
    cfg = Config(
        listen_host="127.0.0.1", listen_port=0, node_name=sc.node, kubelet_socket=kubelet.socket_path, kubeconfig=str(kubeconfig),
        backend="sim", interval=0.1, call_timeout=1.0, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=4.0,
    )
    agent = build_agent(cfg, backend=SimBackend(sc, clock), clock=clock.epoch, health_policy=HealthPolicy(clear_hold=4.0), remediation_resync=0.5)
    bad = sc.gpu("gpu1")
    expected_name = names.rule_name(sc.node, objects.DRIVER, sc.node, bad.device_name)
    agent.start(serve=True)
    try:
        assert clock.now() < 5.0, "the machine is too slow for this scenario's timeline"
        wait_until(lambda: agent.snapshot is not None and any(a.claim == "train" for a in agent.snapshot.allocations), timeout=5, message="the join")
        wait_until(lambda: server.list("resource.k8s.io", "devicetaintrules"), timeout=10, message="the DeviceTaintRule")
        rules = server.list("resource.k8s.io", "devicetaintrules")
        assert len(rules) == 1
        rule = rules[0]
        assert rule["metadata"]["name"] == expected_name
        assert rule["spec"]["deviceSelector"] == {"driver": objects.DRIVER, "pool": sc.node, "device": bad.device_name}
        assert rule["spec"]["taint"]["effect"] == "NoExecute"
        assert rule["spec"]["taint"]["key"] == f"{names.TAINT_DOMAIN}/fatal"
        assert rule["metadata"]["annotations"][names.UUID_ANNOTATION] == bad.uuid
        assert rule["metadata"]["labels"][names.NODE_LABEL] == sc.node
        assert clock.now() < RESET_AT, "checked before the scripted reset"

        # the next collection cycle publishes it
        m = wait_until(lambda: (lambda m: m if m.get("dra_device_taint_rule") else None)(scrape(agent.server.url)), timeout=5, message="the metrics")
        healthy = {lab["uuid"]: v for lab, v in m["gpu_healthy"]}
        assert healthy[bad.uuid] == 0.0
        assert all(v == 1.0 for u, v in healthy.items() if u != bad.uuid)  # the others untouched
        assert {(lab["uuid"], lab["xid"]) for lab, _ in m["gpu_xid_errors_total"]} == {(bad.uuid, "79")}
        conds = {(lab["uuid"], lab["tier"], lab["reason"]) for lab, _ in m["gpu_health_condition"]}
        assert (bad.uuid, "fatal", "xid_79") in conds and all(u == bad.uuid for u, _, _ in conds)
        assert [(lab["device"], lab["effect"]) for lab, _ in m["dra_device_taint_rule"]] == [(bad.device_name, "NoExecute")]
        assert [v for lab, v in m["dra_gpu_exporter_detection_to_taint_seconds_count"]] == [1.0]
        claim_ok = {lab["claim"]: v for lab, v in m["dra_claim_healthy"]}
        assert claim_ok == {"train": 0.0, "serve": 1.0}
        assert clock.now() < RESET_AT, "checked before the scripted reset"

        # reset at t=20 s, healthy for the health hold, then one step per remediation hold
        wait_until(lambda: not server.list("resource.k8s.io", "devicetaintrules"), timeout=15, message="the rule's removal")
        assert clock.now() > RESET_AT
        wait_until(lambda: not scrape(agent.server.url).get("dra_device_taint_rule"), timeout=5, message="the series to go")
    finally:
        agent.stop()

    # Exactly one rule was ever written, for exactly that device; nothing else was touched.
    writes = [q for q in server.requests if q.method in ("POST", "PATCH", "PUT", "DELETE") and "/devicetaintrules" in q.path]
    assert [q.method for q in writes] == ["POST", "PATCH", "DELETE"]
    assert all(q.path.endswith("/devicetaintrules") or q.path.endswith("/" + expected_name) for q in writes)
    assert writes[0].body["spec"]["deviceSelector"]["device"] == bad.device_name
    events = sorted(server.list("events.k8s.io", "events", namespace="default"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    assert [e["reason"] for e in events] == ["GPUTainted", "GPUTaintSteppedDown", "GPUUntainted"]
    # Every object the agent sent is valid against the official 1.37 schema.
    assert validator.failures == []
    assert {("resource.k8s.io/v1", "DeviceTaintRule"), ("events.k8s.io/v1", "Event")} <= validator.kinds()
    for q in server.requests:
        if q.method == "POST" and isinstance(q.body, dict) and q.body.get("kind"):
            validate_strict(q.body, "1.37")
