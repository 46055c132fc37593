"""Evictions you can see (issue 23, Deliver 3): the pods that still hold a device this agent
tainted NoExecute, counted per rule, and the ones that outstay the taint told in Warning Events
with the reason.

End to end (the whole agent by the production wiring, on the simulated node of the bundled
``eviction`` scenario, whose cluster also plays kube-controller-manager's device-taint eviction
controller as 1.37 runs it): a claim's pod is evicted from its failing GPU; a pod whose GPU came
through a DRA extended-resource claim (kubelet PodResources, pod status and generated claim shaped
like 1.37's) stays, as kubernetes/kubernetes#141290 leaves it. The agent attributes it like any
claim, counts it in ``dra_taint_pods_pending_eviction``, tells it in one Warning Event on the pod
and one on the rule (both checked against the official schemas), and the series it exports fires
``GPUTaintEvictionStuck`` under promtool.

Then the bookkeeping itself (:class:`exporter.remediation.evictions.EvictionWatch`) against a
lookup and an event sink of plain data: every reason, the deadlines (grace, tolerationSeconds, a
pod's deletion), one Event per pod (and per controller) per episode, API failures.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from clock_helpers import ManualClock
from kit_helpers import fetch, wait_until
from prom_helpers import PROMTOOL
from prometheus_client.parser import text_string_to_metric_families
from validation import StrictValidator, validate_strict

from drasim import objects
from drasim.backend import SimClock
from drasim.demo import DEMO_POLICY, DemoCluster
from drasim.scenario import bundled_scenarios, load_scenario
from exporter.config import TaintMode
from exporter.k8s.connection import ApiError
from exporter.k8s.model import AllocatedDevice, ClaimInfo, DeviceToleration, OwnerRef, PodInfo
from exporter.k8s.parse import parse_claim, parse_pod
from exporter.model.snapshot import AllocationView
from exporter.remediation.evictions import EVENT_REASON, LOOKUPS_PER_PASS, EvictionWatch, Overdue
from exporter.remediation.record import OwnedRule

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "dra-gpu-exporter.rules.yml"


def samples(body: bytes, name: str) -> list[Any]:
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples if s.name == name]


# ------------------------------------------------------------------------------ end to end


@pytest.fixture
def eviction_node(tmp_path):
    sc = load_scenario(bundled_scenarios()["eviction"])
    validator = StrictValidator("1.37")
    cluster = DemoCluster(sc, SimClock(20.0, start_offset=15.0), tmp_path)
    try:
        cluster.start(api_setup=lambda api: api.set_validator(validator))
        agent = cluster.start_agent(interval=0.2, taint_mode=TaintMode.ENFORCE, health_policy=DEMO_POLICY, remediation_resync=0.5)
        yield sc, cluster, agent, validator
    finally:
        cluster.stop()


def test_an_extended_resource_pod_that_noexecute_does_not_evict_is_counted_told_and_alerted(eviction_node, tmp_path):
    sc, cluster, agent, validator = eviction_node
    legacy = next(p for p in sc.pods if p.name == "legacy-trainer")
    ext_claim = objects.extended_claim_name(legacy)

    def scrape() -> bytes:
        status, body = fetch(agent.server.url + "/metrics")
        assert status == 200
        return body

    # Attributed like any claim: PodResources names the generated claim, the claim resolves.
    def attributed():
        rows = samples(scrape(), "dra_device_allocation_info")
        return [s for s in rows if s.labels["pod"] == "legacy-trainer"] or None

    rows = wait_until(attributed, timeout=60, message="the extended-resource pod's allocation")
    assert [(s.labels["claim"], s.labels["device"], s.labels["uuid"], s.labels["container"]) for s in rows] == [
        (ext_claim, "gpu-2", objects.device_uuid(sc, "gpu2"), "main")
    ]

    # Both GPUs tainted NoExecute; the claim's pod is evicted (0), the extended-resource pod stays (1).
    def pending() -> dict[str, tuple[float, str]] | None:
        got = {s.labels["device"]: (s.value, s.labels["rule"]) for s in samples(scrape(), "dra_taint_pods_pending_eviction")}
        return got if got.get("gpu-1", (None,))[0] == 0 and got.get("gpu-2", (None,))[0] == 1 else None

    got = wait_until(pending, timeout=120, interval=0.1, message="gpu-1's pod evicted, gpu-2's pod pending")
    rules = {r["spec"]["deviceSelector"]["device"]: r for r in cluster.api.list("resource.k8s.io", "devicetaintrules")}
    assert {d: r["spec"]["taint"]["effect"] for d, r in rules.items()} == {"gpu-1": "NoExecute", "gpu-2": "NoExecute"}
    assert {d: rule for d, (_v, rule) in got.items()} == {d: r["metadata"]["name"] for d, r in rules.items()}
    assert ("ml", "trainer") in cluster.evicted
    wait_until(lambda: ("ml", "legacy-trainer") in cluster.stayed, timeout=30, message="the simulated eviction controller passing it over")

    # A grace (60 s) after gpu-2's taint: one Warning Event on the pod, in its namespace, and one on the rule.
    def told() -> tuple[list[dict], list[dict]] | None:
        on_pod = [e for e in cluster.api.list("events.k8s.io", "events", namespace="ml") if e["reason"] == EVENT_REASON]
        on_rule = [e for e in cluster.api.list("events.k8s.io", "events", namespace="default") if e["reason"] == EVENT_REASON]
        return (on_pod, on_rule) if on_pod and on_rule else None

    on_pod, on_rule = wait_until(told, timeout=120, interval=0.1, message="the overdue eviction's Events")
    (ev,) = on_pod
    assert ev["type"] == "Warning" and ev["regarding"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "legacy-trainer",
                                                            "uid": objects.pod_uid(legacy)}
    assert f"extended-resource claim {ext_claim}" in ev["note"] and "141290" in ev["note"] and rules["gpu-2"]["metadata"]["name"] in ev["note"]
    (rev,) = on_rule
    assert rev["regarding"]["kind"] == "DeviceTaintRule" and rev["regarding"]["name"] == rules["gpu-2"]["metadata"]["name"]
    assert "pod ml/legacy-trainer still holds gpu.nvidia.com/eviction-node/gpu-2" in rev["note"]
    # ... and only once, however many passes go by; the evicted pod was never told
    passes = agent.out.remediation.passes
    wait_until(lambda: agent.out.remediation.passes >= passes + 5, timeout=60, message="more passes")
    assert len(told()[0]) == 1 and len(told()[1]) == 1
    assert not [e for e in cluster.api.list("events.k8s.io", "events") if e["reason"] == EVENT_REASON and "trainer" == e["regarding"].get("name")]
    # every object the agent sent passed the strict schema check, the Events included
    assert validator.failures == [] and ("events.k8s.io/v1", "Event") in validator.kinds()
    for q in cluster.api.requests:
        if q.method == "POST" and isinstance(q.body, dict) and q.body.get("kind") == "Event":
            validate_strict(q.body, "1.37")
    # what it read to find out: the pod and its claim by name, nothing cluster-wide
    reads = [q.path for q in cluster.api.requests if q.method == "GET" and ("/pods" in q.path)]
    assert reads and set(reads) == {"/api/v1/namespaces/ml/pods/legacy-trainer"}, reads

    # The series the agent exports fires the alert (promtool, the repository's rules).
    if PROMTOOL is None:
        pytest.skip("promtool not found: install Debian's `prometheus` package (CI does)")
    series = next(s for s in samples(scrape(), "dra_taint_pods_pending_eviction") if s.labels["device"] == "gpu-2")
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(series.labels.items()))
    quiet = next(s for s in samples(scrape(), "dra_taint_pods_pending_eviction") if s.labels["device"] == "gpu-1")
    quiet_labels = ", ".join(f'{k}="{v}"' for k, v in sorted(quiet.labels.items()))
    case = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f"dra_taint_pods_pending_eviction{{{labels}}}", "values": f"{series.value:g}x20"},
                {"series": f"dra_taint_pods_pending_eviction{{{quiet_labels}}}", "values": f"{quiet.value:g}x20"},
            ],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "GPUTaintEvictionStuck", "exp_alerts": []},
                {"eval_time": "11m", "alertname": "GPUTaintEvictionStuck", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", **series.labels},
                    "exp_annotations": {
                        "summary": f"Pods still on NoExecute-tainted GPU gpu-2 on {sc.node}",
                        "description": f"1 pods on node {sc.node} still hold device gpu.nvidia.com/{sc.node}/gpu-2, which DeviceTaintRule "
                                       f"{series.labels['rule']} has tainted NoExecute for at least 10 minutes: they run on a failing GPU. "
                                       "The Warning Events with reason GPUEvictionOverdue on the pods and on the rule name the reason.",
                        "runbook_url": "https://github.com/dra-gpu-exporter/dra-gpu-exporter/blob/main/docs/deploy.md#gputaintevictionstuck",
                    },
                }]},
            ],
        }],
    }
    path = tmp_path / "evictions.test.yml"
    path.write_text(yaml.safe_dump(case))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------------------------ the bookkeeping

T0 = 1_750_000_000.0
NODE = "node-a"
DRIVER = "gpu.nvidia.com"
KEY = "gpu-health.dra-gpu-exporter.io/fatal"


def rule(device: str = "gpu-1", effect: str = "NoExecute", **kw: Any) -> OwnedRule:
    return OwnedRule(name=f"dra-gpu-exporter-{NODE}-{device}-abc", driver=DRIVER, pool=NODE, device=device, uuid=f"GPU-{device}",
                     effect=effect, tier="fatal", reason="xid_79", **kw)


def held(pod: str, device: str = "gpu-1", claim: str = "", ns: str = "ml") -> AllocationView:
    return AllocationView(driver=DRIVER, pool=NODE, device=device, uuid=f"GPU-{device}", namespace=ns, pod=pod, container="main",
                          claim=claim or f"{pod}-claim", source="dra", method="attribute")


class Lookup:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], PodInfo | Exception | None] = {}
        self.claims: dict[tuple[str, str], ClaimInfo] = {}
        self.asked: list[tuple[str, str, str]] = []

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        self.asked.append(("pod", namespace, name))
        got = self.pods.get((namespace, name))
        if isinstance(got, Exception):
            raise got
        return got if (namespace, name) in self.pods else PodInfo(namespace, name, f"uid-{name}", node_name=NODE, created_at=T0 - 3600)

    def claim(self, namespace: str, name: str) -> ClaimInfo | None:
        self.asked.append(("claim", namespace, name))
        return self.claims.get((namespace, name))


class Events:
    def __init__(self) -> None:
        self.sent: list[tuple[dict[str, str], str, str]] = []

    def record(self, regarding, reason, note, action, warning=False):
        assert warning and reason == EVENT_REASON
        self.sent.append((dict(regarding), reason, note))
        return None

    def pods(self) -> list[str]:
        return [f"{r['namespace']}/{r['name']}" for r, _, _ in self.sent if r["kind"] == "Pod"]


def watch(grace: float = 60.0) -> tuple[EvictionWatch, Lookup, Events]:
    lookup, events = Lookup(), Events()
    # (a clock whose wall and monotonic time agree: the pods' dates are the deadlines' instants)
    ref = lambda name: {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "name": name}  # noqa: E731
    w = EvictionWatch(lookup, events, ref, grace, ManualClock(0.0))
    return w, lookup, events


def counts(w: EvictionWatch) -> dict[str, int]:
    return {v.device: v.pods for v in w.pending}


def claim_with(name: str, device: str = "gpu-1", *tolerations: DeviceToleration, extended: bool = False) -> ClaimInfo:
    return ClaimInfo("ml", name, devices=(AllocatedDevice("gpu", DRIVER, NODE, device, tolerations=tolerations),), extended=extended)


def test_pods_on_noexecute_devices_are_counted_per_rule_and_nothing_else():
    w, lookup, events = watch()
    rules = [rule("gpu-1"), rule("gpu-2"), rule("gpu-3", effect="NoSchedule"), rule("gpu-4", virtual=True)]
    allocs = [held("a"), held("a", claim="a-claim"), held("b"), held("c", device="gpu-3"), held("d", device="gpu-4"),
              dataclasses.replace(held("e"), source="device-plugin", pool="")]
    w.run(rules, allocs, T0)
    # one series per NoExecute rule (0 included); a pod counts once however many containers hold it
    assert counts(w) == {"gpu-1": 2, "gpu-2": 0}
    assert [v.rule for v in w.pending] == [rules[0].name, rules[1].name]
    w.run(rules, [held("b")], T0 + 10)
    assert counts(w) == {"gpu-1": 1, "gpu-2": 0}
    w.run([], [held("b")], T0 + 20)
    assert w.pending == () and lookup.asked == [] and events.sent == []


def test_pods_that_leave_within_the_grace_cost_nothing():
    w, lookup, events = watch()
    w.run([rule()], [held("a")], T0)
    w.run([rule()], [held("a")], T0 + 59)
    w.run([rule()], [], T0 + 61)  # evicted in time
    w.run([rule()], [], T0 + 300)
    assert lookup.asked == [] and events.sent == [] and counts(w) == {"gpu-1": 0}


def test_an_extended_resource_pod_is_told_once_on_the_pod_and_the_rule():
    w, lookup, events = watch()
    lookup.pods[("ml", "legacy")] = PodInfo("ml", "legacy", "uid-legacy", extended_claim="legacy-extended-resources-x7k2p")
    alloc = [held("legacy", claim="legacy-extended-resources-x7k2p")]
    w.run([rule()], alloc, T0)
    w.run([rule()], alloc, T0 + 59.9)
    assert events.sent == []  # within the grace
    w.run([rule()], alloc, T0 + 60)
    assert events.pods() == ["ml/legacy"] and len(events.sent) == 2
    (pod_ref, _, pod_note), (rule_ref, _, rule_note) = events.sent
    assert pod_ref == {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "legacy", "uid": "uid-legacy"}
    assert rule_ref["kind"] == "DeviceTaintRule" and rule_ref["name"] == rule().name
    assert "extended-resource claim legacy-extended-resources-x7k2p" in pod_note and "kubernetes/kubernetes#141290" in pod_note
    assert "still holds gpu.nvidia.com/node-a/gpu-1 (GPU GPU-gpu-1) 60s after DeviceTaintRule" in pod_note
    assert rule_note.startswith("pod ml/legacy still holds gpu.nvidia.com/node-a/gpu-1")
    for t in range(1, 20):
        w.run([rule()], alloc, T0 + 60 + 10 * t)
    assert len(events.sent) == 2 and lookup.asked.count(("pod", "ml", "legacy")) == 1  # one look, one pair of Events
    assert w.told == {Overdue.EXTENDED_RESOURCE_CLAIM.value: 1}


def test_the_claims_annotation_tells_an_extended_resource_claim_when_the_pod_cannot_be_read():
    w, lookup, events = watch()
    lookup.pods[("ml", "legacy")] = ApiError(status=403, reason="Forbidden", message="pods is forbidden")
    lookup.claims[("ml", "gen")] = claim_with("gen", extended=True)
    w.run([rule()], [held("legacy", claim="gen")], T0)
    w.run([rule()], [held("legacy", claim="gen")], T0 + 60)
    (_, _, note), _ = events.sent
    assert "extended-resource claim gen" in note and "the pod could not be read (403)" in note
    assert events.sent[0][0].get("uid") is None


def test_a_toleration_for_ever_is_the_reason():
    w, _lookup, events = watch()
    _lookup.claims[("ml", "c")] = claim_with("c", "gpu-1", DeviceToleration(key=KEY, operator="Exists", effect="NoExecute"))
    w.run([rule()], [held("a", claim="c")], T0)
    w.run([rule()], [held("a", claim="c")], T0 + 60)
    assert "its claim c tolerates the taint gpu-health.dra-gpu-exporter.io/fatal without tolerationSeconds" in events.sent[0][2]
    assert w.told == {"toleration": 1}


@pytest.mark.parametrize(("toleration", "matches"), [
    (DeviceToleration(operator="Exists"), True),  # every taint
    (DeviceToleration(key=KEY, value="xid_79"), True),  # Equal, the rule's value
    (DeviceToleration(key=KEY, value="xid_48"), False),
    (DeviceToleration(key=KEY, operator="Exists", effect="NoSchedule"), False),
    (DeviceToleration(key="gpu.amd.com/memory-partition-conflict", operator="Exists"), False),
])
def test_which_tolerations_match_the_agents_taint(toleration, matches):
    assert toleration.tolerates(KEY, "xid_79", "NoExecute") is matches


def test_toleration_seconds_push_the_deadline_and_then_it_is_told_without_a_reason():
    w, lookup, events = watch()
    # two matching tolerations: the shorter time counts, as for the eviction controller
    lookup.claims[("ml", "c")] = claim_with("c", "gpu-1", DeviceToleration(key=KEY, operator="Exists", seconds=600),
                                            DeviceToleration(operator="Exists", seconds=300))
    alloc = [held("a", claim="c")]
    w.run([rule()], alloc, T0)
    w.run([rule()], alloc, T0 + 60)  # looked at: tolerated for 300 s
    w.run([rule()], alloc, T0 + 359)
    assert events.sent == []
    w.run([rule()], alloc, T0 + 360)
    assert len(events.sent) == 2 and "its claim tolerates the taint for 300s" in events.sent[0][2]
    assert "device-taint eviction controller running" in events.sent[0][2] and w.told == {"unknown": 1}


def test_a_pod_being_deleted_gets_its_grace_then_is_told_as_stuck_terminating():
    w, lookup, events = watch()
    lookup.pods[("ml", "a")] = PodInfo("ml", "a", "uid-a", deleting_at=T0 + 100)
    w.run([rule()], [held("a")], T0)
    w.run([rule()], [held("a")], T0 + 60)
    w.run([rule()], [held("a")], T0 + 159)
    assert events.sent == []
    w.run([rule()], [held("a")], T0 + 160)
    assert "deleted at" in events.sent[0][2] and w.told == {"terminating": 1}


def test_pods_a_controller_recreates_on_the_device_are_told_once_per_controller():
    w, lookup, events = watch()
    rs = OwnerRef("ReplicaSet", "train-7d9f", "rs-uid")
    w.run([rule()], [], T0)  # the taint: the device is free
    for i, at in enumerate((T0 + 10, T0 + 20)):
        lookup.pods[("ml", f"train-{i}")] = PodInfo("ml", f"train-{i}", f"uid-{i}", controller=rs, created_at=at)
    w.run([rule()], [held("train-0", claim="shared")], T0 + 10)  # a new pod, through the still-allocated claim
    w.run([rule()], [held("train-0", claim="shared")], T0 + 70)
    assert events.pods() == ["ml/train-0"] and "created after the taint by its controller ReplicaSet/train-7d9f" in events.sent[0][2]
    w.run([rule()], [held("train-1", claim="shared")], T0 + 80)  # evicted, and the next one came
    w.run([rule()], [held("train-1", claim="shared")], T0 + 140)
    assert events.pods() == ["ml/train-0"]  # the same controller: told already
    # a pod that was there before the taint is no "recreated" pod
    lookup.pods[("ml", "old")] = PodInfo("ml", "old", "uid-old", controller=rs, created_at=T0 - 5)
    w.run([rule("gpu-2")], [held("old", device="gpu-2")], T0 + 200)
    w.run([rule("gpu-2")], [held("old", device="gpu-2")], T0 + 260)
    assert events.pods()[-1] == "ml/old" and "device-taint eviction controller running" in events.sent[-2][2]


def test_a_new_episode_tells_again_and_an_api_outage_only_postpones():
    w, lookup, events = watch()
    lookup.pods[("ml", "a")] = ApiError(status=503, reason="ServiceUnavailable", message="etcd down")
    w.run([rule()], [held("a")], T0)
    w.run([rule()], [held("a")], T0 + 60)
    assert events.sent == [] and lookup.asked == [("pod", "ml", "a")]
    w.run([rule()], [held("a")], T0 + 80)  # retried after RETRY, not every pass
    assert len(lookup.asked) == 1
    del lookup.pods[("ml", "a")]
    w.run([rule()], [held("a")], T0 + 90)
    assert events.pods() == ["ml/a"]
    # stepped down and raised again: a new episode, a new Event
    w.run([rule(effect="NoSchedule")], [held("a")], T0 + 100)
    w.run([rule()], [held("a")], T0 + 200)
    w.run([rule()], [held("a")], T0 + 260)
    assert events.pods() == ["ml/a", "ml/a"]


def test_a_pod_gone_from_the_api_is_not_told_and_lookups_are_bounded_per_pass():
    w, lookup, events = watch()
    lookup.pods[("ml", "ghost")] = None
    w.run([rule()], [held("ghost")], T0)
    w.run([rule()], [held("ghost")], T0 + 60)
    assert events.sent == []
    many = [held(f"p{i}", claim="shared") for i in range(40)]
    w.run([rule("gpu-2")], [dataclasses.replace(a, device="gpu-2") for a in many], T0 + 100)
    lookup.asked.clear()
    w.run([rule("gpu-2")], [dataclasses.replace(a, device="gpu-2") for a in many], T0 + 160)
    assert len([a for a in lookup.asked if a[0] == "pod"]) == LOOKUPS_PER_PASS
    for t in range(2, 5):
        w.run([rule("gpu-2")], [dataclasses.replace(a, device="gpu-2") for a in many], T0 + 160 + t)
    assert len(events.pods()) == 40


def test_a_surprise_about_one_pod_costs_neither_the_count_nor_the_other_pods():
    w, lookup, events = watch()
    lookup.pods[("ml", "a")] = RuntimeError("a bug in a lookup")
    w.run([rule()], [held("a"), held("b")], T0)
    w.run([rule()], [held("a"), held("b")], T0 + 60)
    assert counts(w) == {"gpu-1": 2} and events.pods() == ["ml/b"]
    del lookup.pods[("ml", "a")]
    w.run([rule()], [held("a"), held("b")], T0 + 70)
    assert events.pods() == ["ml/b"]  # retried after RETRY, not at once
    w.run([rule()], [held("a"), held("b")], T0 + 90)
    assert events.pods() == ["ml/b", "ml/a"]


def test_without_api_access_it_still_tells():
    events = Events()
    w = EvictionWatch(None, events, lambda name: {"kind": "DeviceTaintRule", "name": name})
    w.run([rule()], [held("a")], T0)
    w.run([rule()], [held("a")], T0 + 60)
    assert events.pods() == ["ml/a"] and "no API access to read it" in events.sent[0][2]


# ------------------------------------------------------------------------------ parsing 1.37's shapes


def test_a_137_pod_and_its_generated_claim_parse_with_what_the_remediator_reads():
    sc = load_scenario(bundled_scenarios()["eviction"])
    legacy = next(p for p in sc.pods if p.name == "legacy-trainer")
    pod_obj = objects.pod_object(sc, legacy)
    pod_obj["metadata"].update(creationTimestamp="2026-08-01T12:00:00Z", deletionTimestamp="2026-08-01T12:05:30Z",
                               ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": "legacy", "uid": "job-uid", "controller": True}])
    validate_strict(pod_obj, "1.37")
    pod = parse_pod(pod_obj)
    assert pod.extended_claim == objects.extended_claim_name(legacy) and pod.extended_claim in pod.claims
    assert pod.controller == OwnerRef("Job", "legacy", "job-uid")
    assert pod.deleting_at is not None and pod.created_at is not None and pod.deleting_at - pod.created_at == 330.0
    (claim_obj,) = [c for c in objects.resource_claims(sc, [legacy]) if c["metadata"]["name"] == pod.extended_claim]
    claim_obj["status"]["allocation"]["devices"]["results"][0]["tolerations"] = [
        {"key": KEY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
    validate_strict(claim_obj, "1.37")
    claim = parse_claim(claim_obj, "v1")
    assert claim.extended
    dev = claim.device(DRIVER, sc.node, "gpu-2")
    assert dev is not None and dev.tolerations == (DeviceToleration(key=KEY, operator="Exists", effect="NoExecute", seconds=300),)
    # the scenario's other claims are no extended-resource claims
    assert not any(parse_claim(c, "v1").extended for c in objects.resource_claims(sc, list(sc.pods)) if c["metadata"]["name"] != pod.extended_claim)
