"""End to end: a simulated XID 79 on one GPU -> exactly that device's NoExecute DeviceTaintRule
-> removed again after the GPU is reset and has stayed healthy.

The agent is built by the real wiring (``build_agent``): the sim device backend, a real gRPC
PodResources server on a unix socket, the in-process Kubernetes API over HTTP (with a strict
kubernetes-validate validator for every object written), the SliceWatcher, the health engine and
the remediator thread, and the agent's own /metrics server, scraped over HTTP. Simulated time
runs 20x faster than real time, and the test holds it still while it looks at the faulted state.
"""

from __future__ import annotations

import pytest
from kit_helpers import scrape_samples, wait_until
from validation import StrictValidator, validate_strict

from drasim import objects
from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.config import TaintMode
from exporter.health.engine import HealthPolicy
from exporter.k8s import names

SCALE = 20.0  # simulated seconds per real second
FAULT_AT = 5.0
RESET_AT = 40.0
# Nothing depends on how fast this machine is: simulated time stands still while the agent
# starts, runs at real speed (35 s of slack) from the fault until the rule is written, stands
# still while the test looks at the faulted state, then jumps to the reset and runs at SCALE.
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
        {"kind": "reset", "gpu": "gpu1", "at": "40s"},  # RESET_AT
    ],
}


@pytest.fixture
def node():
    sc = parse_scenario(SCENARIO, "e2e")
    clock = SimClock(1.0)
    clock.pause()  # at sim t=0 until the agent has joined: start-up takes what it takes
    with SimulatedNode(sc, clock, bookmark_interval=1.0) as node:
        validator = StrictValidator("1.37")
        node.start(api_setup=lambda api: api.set_validator(validator))
        yield node, validator


def test_xid79_taints_exactly_that_device_and_recovery_removes_it(node):
    node, validator = node
    sc, server, clock = node.scenario, node.api, node.clock
    bad = sc.gpu("gpu1")
    expected_name = names.rule_name(sc.node, objects.DRIVER, sc.node, bad.device_name)
    agent = node.start_agent(
        interval=0.1, call_timeout=1.0, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=4.0,
        health_policy=HealthPolicy(clear_hold=4.0), remediation_resync=0.5,
    )
    try:
        assert clock.now() < FAULT_AT
        wait_until(lambda: agent.snapshot is not None and any(a.claim == "train" for a in agent.snapshot.allocations), timeout=60, message="the join")
        clock.advance_to(FAULT_AT - 0.5)
        clock.resume(scale=1.0)
        wait_until(lambda: server.list("resource.k8s.io", "devicetaintrules"), timeout=60, message="the DeviceTaintRule")
        # Fenced at once with NoSchedule, raised to NoExecute after the settle window (issue 16:
        # this test used to see NoExecute in the first write; it now waits for the raise).
        wait_until(
            lambda: [r["spec"]["taint"]["effect"] for r in server.list("resource.k8s.io", "devicetaintrules")] == ["NoExecute"],
            timeout=60, message="the raise to NoExecute after the settle window",
        )
        clock.pause()  # the faulted state holds while we look at it
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
        m = wait_until(
            lambda: (lambda m: m if [lab["effect"] for lab, _ in m.get("dra_device_taint_rule", [])] == ["NoExecute"] else None)(scrape_samples(agent.server.url)),
            timeout=60, message="the metrics",
        )
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

        # the reset, healthy for the health hold, then one step per remediation hold
        clock.advance_to(RESET_AT)
        clock.resume(scale=SCALE)
        wait_until(lambda: not server.list("resource.k8s.io", "devicetaintrules"), timeout=60, message="the rule's removal")
        assert clock.now() > RESET_AT
        wait_until(lambda: not scrape_samples(agent.server.url).get("dra_device_taint_rule"), timeout=60, message="the series to go")
    finally:
        agent.stop()

    # Exactly one rule was ever written, for exactly that device; nothing else was touched.
    writes = [q for q in server.requests if q.method in ("POST", "PATCH", "PUT", "DELETE") and "/devicetaintrules" in q.path]
    assert [q.method for q in writes] == ["POST", "PATCH", "PATCH", "DELETE"]  # fence, raise, step down, remove
    assert writes[0].body["spec"]["taint"]["effect"] == "NoSchedule"
    assert all(q.path.endswith("/devicetaintrules") or q.path.endswith("/" + expected_name) for q in writes)
    assert writes[0].body["spec"]["deviceSelector"]["device"] == bad.device_name
    events = sorted(server.list("events.k8s.io", "events", namespace="default"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    assert [e["reason"] for e in events] == ["GPUTainted", "GPUTaintEscalated", "GPUTaintSteppedDown", "GPUUntainted"]
    # Every object the agent sent is valid against the official 1.37 schema.
    assert validator.failures == []
    assert {("resource.k8s.io/v1", "DeviceTaintRule"), ("events.k8s.io/v1", "Event")} <= validator.kinds()
    for q in server.requests:
        if q.method == "POST" and isinstance(q.body, dict) and q.body.get("kind"):
            validate_strict(q.body, "1.37")
