"""DeviceTaintRule remediation against the HTTP Kubernetes API test server.

Real parts: the in-process kube-apiserver emulation over HTTP (discovery, per-release API
versions, validation, 409s, outages), the agent's own HTTP client and SliceWatcher, the health
engine. The API server runs a strict kubernetes-validate validator for the emulated release, so
every object the agent writes (rules, Events) is checked against the official schema; the POST
bodies themselves are validated again from the request log.

Schemas: kubernetes-validate (1.37.0) has DeviceTaintRule schemas for every version the agent
can be served: resource.k8s.io/v1alpha3 (1.33+), v1beta2 (1.36+) and v1 (1.37). It lacks
v1beta2 before 1.36 and v1 before 1.37, which those releases do not serve either, and it has
no v1beta1 DeviceTaintRule (none ever existed). So no version is skipped:
``test_schema_coverage_for_every_served_rule_version`` pins this down.

Time: the health engine and the remediator share a fake clock (``rig.clock``); ``reconcile()``
is called directly, so no test sleeps. Only the remediator-thread test waits (bounded) for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from clock_helpers import ManualClock
from k8s_helpers import api_client, call_json, running_apiserver, wait_until, write_kubeconfig
from kit_helpers import Samples, gpu, parse_samples
from validation import StrictValidator, has_schema, validate_strict

from drasim.backend import SimBackend
from drasim.scenario import parse_scenario
from exporter.agent import Agent
from exporter.catalog import BY_NAME
from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, ReadError, RecoveryAction, Vendor
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.k8s import names
from exporter.k8s.connection import ApiError, connect
from exporter.k8s.discovery import Discovery
from exporter.k8s.slices import SliceWatcher
from exporter.k8s.taintrules import TaintRule, TaintRuleClient
from exporter.model.join import JoinInputs, join
from exporter.remediation.adoption import BootIdentity
from exporter.remediation.engine import Remediator
from exporter.remediation.plan import RECORD_REFRESH
from exporter.remediation.rails import LocalBudget
from exporter.wiring import build_remediator, compose

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
T0 = 1_750_000_000.0
HOLD = 600.0
POLICY = HealthPolicy(clear_hold=60.0, event_quiet=1800.0, info_quiet=600.0)
RULES = "/devicetaintrules"
SERVED = {"1.33": "v1alpha3", "1.34": "v1alpha3", "1.35": "v1alpha3", "1.36": "v1beta2", "1.37": "v1"}
BOOT = BootIdentity("boot-1", T0 - 86400)  # the node's boot: the same for every agent process of a rig
REFUSED_RETRY = 300.0  # RemediationPolicy.refused_retry's default


def slice_object(node: str, ids, version: str = "v1", name: str | None = None) -> dict:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": f"gpu-{d.minor}", "attributes": {"uuid": {"string": d.uuid}, "resource.kubernetes.io/pciBusID": {"string": d.pci_bus_id}}}
                for d in ids
            ],
        },
    }


class Rig:
    """One node: a ResourceSlice with ``n`` GPUs, a SliceWatcher, a health engine, a remediator.

    Eight GPUs by default, so that two failing together are not yet a node-wide fault."""

    def __init__(self, server, tmp: Path, version: str, n: int = 8, extra_local: int = 0, mode: TaintMode = TaintMode.ENFORCE, resync: float = 0.0, **cfg) -> None:
        self.server, self.version = server, version
        self.validator = StrictValidator(version)
        server.set_validator(self.validator)
        server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}})
        self.ids = [gpu(i) for i in range(n)]
        self.local = list(self.ids) + [gpu(n + j) for j in range(extra_local)]  # extras: device-plugin GPUs
        self.slice_version = "v1beta2" if version == "1.33" else "v1"
        server.apply(slice_object(NODE, self.ids, self.slice_version))
        self.api = connect(str(write_kubeconfig(tmp / "kubeconfig", server.url)))
        self.discovery = Discovery(self.api)
        self.watcher = SliceWatcher(self.api, NODE, discovery=self.discovery, backoff_initial=0.02, backoff_max=0.2)
        self.watcher.start()
        assert self.watcher.wait_synced(10), "slices never listed"
        self.clock = ManualClock(T0)
        # Settle window and node-fault window 0 here: these tests are about what each decision
        # writes, so a fatal fault's rule gets NoExecute in the pass that sees it (as before
        # issue 16). The fence-then-evict tests (test_remediation_domains.py) use the defaults.
        cfg.setdefault("taint_settle_seconds", 0.0)
        cfg.setdefault("node_fault_window", 0.0)
        self.cfg = Config(node_name=NODE, taint_mode=mode, taint_hold_seconds=HOLD, **cfg)
        self.resync = resync
        self.health = HealthEngine(self.clock, POLICY)
        self.rem = self.remediator()

    def remediator(self, health: HealthEngine | None = None) -> Remediator:
        """Built by the production wiring; rules listed and the Node read every ``resync`` s (no
        watches: "listed once, before the rule appears" is how a 409 is met), a local budget."""
        h = health or self.health
        h.set_topology(self.local)
        rules = TaintRuleClient(self.api, self.discovery)
        rem = build_remediator(self.cfg, self.api, h, self.clock, self.resync, watch=False, rules=rules,
                               budget=LocalBudget(self.cfg.taint_budget_max), boot=BOOT, node_state=False)
        rem.update(self.snapshot())
        return rem

    def snapshot(self):
        """A cycle's snapshot: this node's devices and the slices as the watcher holds them."""
        return join(JoinInputs(node=NODE, timestamp=self.clock(), identities=tuple(self.local), readings={}, health={}, slices=self.watcher.devices()))

    def restart(self) -> None:
        """A new agent process: fresh health engine and remediator, same cluster."""
        self.health = HealthEngine(self.clock, POLICY)
        self.rem = self.remediator()

    def set_local(self, ids) -> None:
        self.local = list(ids)
        self.health.set_topology(self.local)
        self.rem.update(self.snapshot())

    # -- evidence ------------------------------------------------------------------------------
    def xid(self, i: int, code: int = 79) -> None:
        self.health.on_event(DeviceEvent(uuid=self.local[i].uuid, kind=EventKind.XID, code=code, detail="test"))

    def reset(self, i: int) -> None:
        self.health.on_event(DeviceEvent(uuid=self.local[i].uuid, kind=EventKind.RESET))

    def observe(self, **bad: DeviceReading) -> None:
        readings = {d.uuid: DeviceReading(uuid=d.uuid, recovery_action=RecoveryAction.NONE, ecc_uncorrectable_total=0) for d in self.local}
        readings.update({self.local[int(k[1:])].uuid: r for k, r in bad.items()})
        self.health.observe(self.local, readings)

    def recover(self, i: int) -> None:
        """Reset observed, then healthy for the health engine's hold."""
        self.reset(i)
        self.clock.advance(POLICY.clear_hold)
        self.observe()  # the agent's next collection cycle
        assert self.health.health(self.local[i].uuid).healthy

    def reconcile(self, times: int = 1) -> None:
        for _ in range(times):
            self.rem.update(self.snapshot())  # the sampler hands the remediator each cycle's snapshot
            self.rem.reconcile()

    # -- cluster state -------------------------------------------------------------------------
    def rules(self) -> list[dict]:
        return self.server.list("resource.k8s.io", "devicetaintrules")

    def by_device(self) -> dict[str, dict]:
        out = {}
        for r in self.rules():
            dev = r["spec"]["deviceSelector"]["device"]
            assert dev not in out, f"two rules for {dev}"
            out[dev] = r
        return out

    def effects(self) -> dict[str, str]:
        return {dev: r["spec"]["taint"]["effect"] for dev, r in self.by_device().items()}

    def events(self, reason: str | None = None) -> list[dict]:
        evs = self.server.list("events.k8s.io", "events", namespace="default")
        evs.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [e for e in evs if reason is None or e["reason"] == reason]

    def writes(self, path_part: str = RULES) -> list:
        return [q for q in self.server.requests if q.method in ("POST", "PUT", "PATCH", "DELETE") and path_part in q.path]

    def check_everything_sent(self) -> None:
        """Every write passed the server's strict validator, and every POST body validates by itself."""
        assert self.validator.failures == []
        # Kubernetes 1.37 refuses an unconditional PUT of a v1 rule: the agent writes none at all
        assert [q.path for q in self.server.requests if q.method == "PUT" and RULES in q.path] == []
        for q in self.server.requests:
            if q.method == "POST" and isinstance(q.body, dict) and q.body.get("kind") in ("DeviceTaintRule", "Event"):
                validate_strict(q.body, self.version)
        for r in self.rules():
            sel = r["spec"]["deviceSelector"]
            assert set(sel) == {"driver", "pool", "device"} and all(sel.values()), f"selector must name one device: {sel}"

    def close(self) -> None:
        self.rem.stop()
        self.watcher.stop()


@pytest.fixture
def make_rig(tmp_path):
    made = []
    servers = []

    def make(version: str = "1.37", **kw) -> Rig:
        cm = running_apiserver(version, bookmark_interval=3600)
        server = cm.__enter__()
        servers.append(cm)
        rig = Rig(server, tmp_path, version, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()
        rig.check_everything_sent()
        # every suppression a scenario made the agent count is a documented reason
        help_ = BY_NAME["dra_gpu_exporter_taint_suppressed_total"].help
        assert [r for r in rig.rem.report().suppressed if r not in help_] == []
    for cm in servers:
        cm.__exit__(None, None, None)


# The agent the rig's metrics go through: its device source is a simulated GPU it never reads.
IDLE_DEVICES = parse_scenario({"node": NODE, "gpus": [{"name": "idle"}]}, "rig")


def metric_samples(rig: Rig) -> Samples:
    """What the agent serves for the rig's node: an agent holding the rig's health engine and
    remediator publishes the rig's snapshot with ``Agent.publish`` (the cycle's own mapping of
    the remediator's report to metrics, so every report field is rendered as in production)."""
    parts = compose(rig.cfg, SimBackend(IDLE_DEVICES))
    agent = Agent(rig.cfg, parts.src, dataclasses.replace(parts.out, health=rig.health, remediation=rig.rem), clock=rig.clock)
    agent.snapshot = join(JoinInputs(node=NODE, timestamp=rig.clock(), identities=tuple(rig.local), readings={},
                                     health=rig.health.all_health()))
    agent.publish()
    exposition = agent.expositions.exposition()  # not agent.stop() after: the rig goes on with its remediator
    assert exposition is not None
    return parse_samples(exposition.body.decode())


# ------------------------------------------------------------------------------ versions and schemas


def test_schema_coverage_for_every_served_rule_version():
    """kubernetes-validate has a schema for each DeviceTaintRule version a release serves."""
    for release, version in SERVED.items():
        assert has_schema(release, f"resource.k8s.io/{version}", "DeviceTaintRule"), (release, version)
        assert has_schema(release, "events.k8s.io/v1", "Event")
    assert has_schema("1.37", "resource.k8s.io/v1beta2", "DeviceTaintRule")  # 1.37 still serves it
    # what it lacks (and those releases do not serve):
    assert not has_schema("1.35", "resource.k8s.io/v1beta2", "DeviceTaintRule")
    assert not has_schema("1.36", "resource.k8s.io/v1", "DeviceTaintRule")
    assert not has_schema("1.37", "resource.k8s.io/v1beta1", "DeviceTaintRule")


@pytest.mark.parametrize("release", sorted(SERVED))
def test_each_served_version(make_rig, release):
    """Discovery picks the release's version; fatal -> NoExecute, degraded -> NoSchedule,
    informational -> None only from 1.35 (none at all before); all of it schema-valid."""
    rig = make_rig(release)
    version = SERVED[release]
    assert rig.rem.rules.served().version == version
    assert rig.rem.rules.served().supports_none is (release >= "1.35")
    rig.xid(0, 79)
    rig.xid(1, 74)
    rig.xid(2, 13)
    rig.reconcile()
    expected = {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}
    if release >= "1.35":
        expected["gpu-2"] = "None"
    assert rig.effects() == expected
    for q in rig.writes():
        assert q.path.startswith(f"/apis/resource.k8s.io/{version}/devicetaintrules"), q.path
    assert (f"resource.k8s.io/{version}", "DeviceTaintRule") in rig.validator.kinds()
    assert ("events.k8s.io/v1", "Event") in rig.validator.kinds()
    # recovery works in every version too
    for i in range(3):
        rig.recover(i)
    for _ in range(3):
        rig.reconcile()
        rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.rules() == []
    rig.check_everything_sent()


def test_validator_really_rejects_what_the_schema_forbids(make_rig):
    """The strict validator is live: an invented field in a rule gets a 422."""
    rig = make_rig("1.36")
    body = rig.rem.rules.body("x", DRIVER, NODE, "gpu-0", f"{names.TAINT_DOMAIN}/fatal", "v", "NoExecute", {}, {})
    body["spec"]["taint"]["tolerationSeconds"] = 5
    from exporter.k8s.connection import request_json

    with pytest.raises(ApiError) as e:
        request_json(rig.api, "POST", "/apis/resource.k8s.io/v1beta2/devicetaintrules", body=body)
    assert e.value.status == 422
    assert rig.validator.failures and "tolerationSeconds" in rig.validator.failures[0].message
    rig.validator.failures.clear()  # (this test's own bad request is not the agent's)
    rig.server.clear_requests()


# Served group/versions of releases whose API has no DeviceTaintRule: 1.36 with the
# DRADeviceTaintRules gate off (its default), and 1.33 without v1alpha3 (discovery finds no version).
NO_RULE_API = {
    "1.36": {"v1", "events.k8s.io/v1", "resource.k8s.io/v1"},
    "1.33": {"v1", "events.k8s.io/v1", "resource.k8s.io/v1beta2"},
}


@pytest.mark.parametrize("release", sorted(NO_RULE_API))
def test_no_rule_api_served_is_told_once_in_an_event_not_worked_around(tmp_path, release):
    """No DeviceTaintRule version is served: what the cluster offers, not a failure. The only
    write is one Warning Event on the Node per agent start, saying what to enable, however
    often the pass runs; no other kind of taint is tried instead; the remediator stays ok (no
    failing collector, no warning per pass on every node of such a cluster)."""
    with running_apiserver(release, served_versions=NO_RULE_API[release]) as server:
        rig = Rig(server, tmp_path, release)
        try:
            rig.xid(0, 79)
            for _ in range(3):
                rig.reconcile()
            writes = [q for q in server.requests if q.method != "GET"]
            assert [(q.method, q.path) for q in writes] == [("POST", "/apis/events.k8s.io/v1/namespaces/default/events")]
            (ev,) = rig.events()
            assert (ev["reason"], ev["type"]) == ("HealthRemediationSuppressed", "Warning")
            assert ev["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE}
            assert "no DeviceTaintRule API served" in ev["note"] and "DRADeviceTaintRules" in ev["note"]
            assert rig.rem.report().suppressed == {"no_api": 1}
            m = metric_samples(rig)
            assert [(lab["reason"], v) for lab, v in m["dra_gpu_exporter_taint_suppressed_total"]] == [("no_api", 1.0)]
            assert m.get("dra_device_taint_rule", []) == []
            assert m["dra_gpu_exporter_remediation_active"] == [({"node": NODE, "mode": "enforce"}, 0.0)]  # unprotected, and it says so
            # the remediator thread keeps looking without telling it again
            rig.rem.start()
            rig.rem.poke()
            wait_until(lambda: rig.rem.passes >= 2, timeout=10, message="two good passes of the thread")
            assert rig.rem.ok and rig.rem.last_error is None
            assert len(rig.events()) == 1
            # a new agent process tells it once more
            rig.rem.stop()
            rig.restart()
            rig.reconcile()
            assert len(rig.events("HealthRemediationSuppressed")) == 2
            assert rig.rules() == []
            rig.check_everything_sent()
        finally:
            rig.close()


def test_rule_body_selects_exactly_one_device_or_is_refused(make_rig):
    rules = make_rig("1.37").rem.rules  # the agent's client, after real discovery
    b = rules.body("n", DRIVER, NODE, "gpu-3", f"{names.TAINT_DOMAIN}/fatal", "xid_79", "NoExecute", {"l": "v"}, {"a": "v"})
    assert b["apiVersion"] == "resource.k8s.io/v1" and b["kind"] == "DeviceTaintRule"
    assert b["spec"] == {
        "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-3"},
        "taint": {"key": f"{names.TAINT_DOMAIN}/fatal", "value": "xid_79", "effect": "NoExecute"},
    }
    # An empty selector matches every device in the cluster (kubernetes#141422): never built.
    for driver, pool, device in (("", NODE, "gpu-3"), (DRIVER, "", "gpu-3"), (DRIVER, NODE, ""), ("", "", "")):
        with pytest.raises(ValueError):
            rules.body("n", driver, pool, device, "k.io/x", "v", "NoExecute", {}, {})


def test_a_rule_record_comes_back_field_for_field_through_its_codec(make_rig):
    """One typed record, one codec: what create_rule writes (labels, annotations, taint) the API
    server stores and parse_rule reads back as the same record; a patch writes what it records."""
    rules = make_rig("1.37").rem.rules
    rule = TaintRule(
        name="dra-gpu-exporter-codec", uid="", driver=DRIVER, pool=NODE, device="gpu-3", effect="NoExecute", ours=True,
        tier="fatal", reason="xid_79", evidence="XID 79 fell off the bus", uuid="GPU-3", gpu="GPU-3", scope="gpu",
        sticky=True, first_seen=1_700_000_000.25, reset_required=True, boot_id="boot-1", node=NODE,
    )
    created = rules.create_rule(rule)
    assert created.uid and created == dataclasses.replace(rule, uid=created.uid)
    stepped = dataclasses.replace(created, effect="NoSchedule", tier="degraded", reset_required=False, evidence="quiet")
    rules.patch_rule(stepped, mark_sticky=False)
    assert rules.get_rule(rule.name) == stepped


# ------------------------------------------------------------------------------ lifecycle


def test_create_step_down_delete_with_events_and_metrics(make_rig):
    rig = make_rig("1.37")
    rig.clock.advance(3)
    rig.xid(1, 79)
    rig.clock.advance(2)  # detected 2 s before the rule is written
    rig.reconcile()
    rule = rig.by_device()["gpu-1"]
    assert set(rig.by_device()) == {"gpu-1"}
    meta = rule["metadata"]
    assert meta["name"] == names.rule_name(NODE, DRIVER, NODE, "gpu-1")
    assert meta["labels"] == {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: NODE, names.TIER_LABEL: "fatal"}
    ann = meta["annotations"]
    assert ann[names.UUID_ANNOTATION] == rig.ids[1].uuid
    assert ann[names.REASON_ANNOTATION] == "xid_79" and "XID 79" in ann[names.EVIDENCE_ANNOTATION]
    assert ann[names.FIRST_SEEN_ANNOTATION].endswith("Z")
    assert rule["spec"]["taint"]["key"] == f"{names.TAINT_DOMAIN}/fatal"
    assert rule["spec"]["taint"]["value"] == "xid_79"
    assert rule["spec"]["taint"]["effect"] == "NoExecute"
    tainted = rig.events("GPUTainted")
    assert len(tainted) == 1 and tainted[0]["type"] == "Warning"
    assert tainted[0]["regarding"] == {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "name": meta["name"]}
    assert tainted[0]["reportingController"] == names.REPORTING_CONTROLLER
    assert rig.rem.report().latency.count == 1 and rig.rem.report().latency.sum == pytest.approx(2.0)

    m = metric_samples(rig)
    assert [(lab["device"], lab["effect"], lab["tier"]) for lab, _ in m["dra_device_taint_rule"]] == [("gpu-1", "NoExecute", "fatal")]
    assert {lab["action"]: v for lab, v in m["dra_gpu_exporter_taint_actions_total"]} == {"create": 1.0}
    count = [v for lab, v in m["dra_gpu_exporter_detection_to_taint_seconds_count"]]
    assert count == [1.0]

    # still failing: nothing more is written
    before = len(rig.writes())
    rig.clock.advance(10 * HOLD)
    rig.reconcile()
    assert len(rig.writes()) == before

    # recovery: reset, healthy for the engine's hold, then one step down per remediation hold
    rig.recover(1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    rig.clock.advance(HOLD - 1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoSchedule"}
    down = rig.events("GPUTaintSteppedDown")
    assert len(down) == 1 and "NoExecute -> NoSchedule" in down[0]["note"]
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.rules() == []
    assert len(rig.events("GPUUntainted")) == 1
    assert dict(rig.rem.report().actions) == {"create": 1, "update": 1, "delete": 1}
    assert rig.rem.report().rules == ()
    assert metric_samples(rig).get("dra_device_taint_rule", []) == []


def test_escalation_from_degraded_to_fatal_patches_the_rule(make_rig):
    rig = make_rig("1.37")
    rig.observe(g0=DeviceReading(uuid=rig.ids[0].uuid, row_remap_pending=True))
    rig.reconcile()
    first = rig.by_device()["gpu-0"]
    assert first["spec"]["taint"]["effect"] == "NoSchedule" and first["metadata"]["labels"][names.TIER_LABEL] == "degraded"
    rig.xid(0, 79)
    rig.reconcile()
    now = rig.by_device()["gpu-0"]
    assert now["metadata"]["uid"] == first["metadata"]["uid"]  # the same rule, edited
    assert now["spec"]["taint"] == {**now["spec"]["taint"], "effect": "NoExecute", "key": f"{names.TAINT_DOMAIN}/fatal", "value": "xid_79"}
    assert now["metadata"]["labels"][names.TIER_LABEL] == "fatal"
    assert len(rig.events("GPUTaintEscalated")) == 1
    assert [q.method for q in rig.writes()] == ["POST", "PATCH"]


def test_a_new_reason_with_the_same_effect_is_written_onto_the_same_rule(make_rig):
    """Regression: only effect/tier changes were written, so a rule kept naming a condition the
    device no longer had while another one of the same tier held the taint."""
    rig = make_rig("1.37")
    pending = DeviceReading(uuid=rig.ids[0].uuid, row_remap_pending=True)
    rig.observe(g0=pending)
    rig.reconcile()
    first = rig.by_device()["gpu-0"]
    assert (first["spec"]["taint"]["effect"], first["metadata"]["annotations"][names.REASON_ANNOTATION]) == ("NoSchedule", "row_remap_pending")
    rig.xid(0, 74)  # degraded too: while the remap is pending, the rule still names it
    rig.observe(g0=pending)
    rig.reconcile()
    assert [q.method for q in rig.writes()] == ["POST"]
    rig.observe()  # the remap is done: after the health engine's hold only XID 74 is left
    rig.clock.advance(POLICY.clear_hold)
    rig.observe()
    assert [c.reason for c in rig.health.health(rig.ids[0].uuid).conditions] == ["xid_74"]
    assert POLICY.clear_hold >= RECORD_REFRESH  # (so the record is due now)
    rig.reconcile()
    now = rig.by_device()["gpu-0"]
    assert len(rig.rules()) == 1 and now["metadata"]["uid"] == first["metadata"]["uid"]
    assert now["metadata"]["annotations"][names.REASON_ANNOTATION] == "xid_74"
    assert now["metadata"]["annotations"][names.EVIDENCE_ANNOTATION] == "XID 74 test"
    assert now["spec"]["taint"] == {**now["spec"]["taint"], "key": f"{names.TAINT_DOMAIN}/degraded", "value": "xid_74", "effect": "NoSchedule"}
    assert now["metadata"]["labels"][names.TIER_LABEL] == "degraded"
    assert [q.method for q in rig.writes()] == ["POST", "PATCH"]
    updated = rig.events("GPUTaintUpdated")
    assert len(updated) == 1 and "row_remap_pending -> xid_74" in updated[0]["note"]
    assert rig.rem.report().actions["refresh"] == 1 and "update" not in rig.rem.report().actions
    rig.reconcile(2)
    assert [q.method for q in rig.writes()] == ["POST", "PATCH"]  # written once


def test_new_evidence_is_written_at_most_once_a_minute(make_rig):
    rig = make_rig("1.37")
    rig.xid(0, 79)
    rig.reconcile()
    for n in range(20):  # an XID storm on a GPU that is already tainted
        rig.health.on_event(DeviceEvent(uuid=rig.ids[0].uuid, kind=EventKind.XID, code=79, detail=f"storm {n}"))
        rig.reconcile()
    assert [q.method for q in rig.writes()] == ["POST"]
    rig.clock.advance(RECORD_REFRESH)
    rig.reconcile(2)
    assert [q.method for q in rig.writes()] == ["POST", "PATCH"]
    ann = rig.by_device()["gpu-0"]["metadata"]["annotations"]
    assert (ann[names.REASON_ANNOTATION], ann[names.EVIDENCE_ANNOTATION]) == ("xid_79", "XID 79 storm 19")
    assert len(rig.rules()) == 1 and rig.events("GPUTaintUpdated") == []  # same reason: no Event


def fail_until_sticky(rig: Rig, i: int) -> None:
    """GPU ``i`` fails, recovers and fails again until the health engine calls it sticky."""
    for _ in range(POLICY.sticky_after):
        rig.xid(i, 79)
        rig.reconcile()
        rig.reset(i)
        rig.clock.advance(POLICY.clear_hold)
        rig.observe()
        rig.clock.advance(3600)
        rig.reconcile(2)
    h = rig.health.health(rig.local[i].uuid)
    assert h.sticky and not h.healthy


def sticky_rules(rig: Rig) -> list[dict]:
    """What a person finds with ``kubectl get devicetaintrules -l <sticky>=true``, over HTTP."""
    status, out = call_json(api_client(rig.server.url), "GET", f"/apis/resource.k8s.io/{SERVED[rig.version]}/devicetaintrules",
                            {"labelSelector": f"{names.STICKY_LABEL}=true,{names.NODE_LABEL}={NODE}"})
    assert status == 200
    return out["items"]


def test_sticky_device_stays_tainted_until_a_person_deletes_the_rule(make_rig):
    rig = make_rig("1.37")
    fail_until_sticky(rig, 0)
    rig.clock.advance(30 * 86400)
    rig.reconcile(3)
    assert rig.effects() == {"gpu-0": "NoExecute"}
    rule = rig.by_device()["gpu-0"]
    assert rule["metadata"]["labels"][names.STICKY_LABEL] == "true"
    assert [r["metadata"]["name"] for r in sticky_rules(rig)] == [rule["metadata"]["name"]]
    marked = rig.events("GPUTaintSticky")
    assert len(marked) == 1 and marked[0]["type"] == "Warning" and names.STICKY_LABEL in marked[0]["note"]
    assert len(rig.rules()) == 1 and rig.by_device()["gpu-0"]["metadata"]["uid"] == rule["metadata"]["uid"]  # marked, not recreated
    # a person clears it by deleting the rule (kubectl delete devicetaintrules -l ...sticky=true)
    for r in sticky_rules(rig):
        status, _ = call_json(api_client(rig.server.url), "DELETE", f"/apis/resource.k8s.io/v1/devicetaintrules/{r['metadata']['name']}")
        assert status == 200
    rig.reconcile(2)
    assert rig.rules() == []
    assert rig.health.health(rig.ids[0].uuid).healthy
    rig.clock.advance(POLICY.clear_hold)
    rig.observe()
    rig.reconcile(2)
    assert rig.rules() == []  # not recreated: no new evidence since the deletion
    rig.clock.advance(601)
    rig.xid(0, 79)  # new evidence is
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"} and names.STICKY_LABEL not in rig.by_device()["gpu-0"]["metadata"]["labels"]


def test_a_sticky_rule_outlives_an_agent_restart(make_rig):
    """The agent's failure history is in memory; the label on the rule is not. A restarted
    agent sees a healthy GPU but must not release a rule only a person may release."""
    rig = make_rig("1.37")
    fail_until_sticky(rig, 0)
    rig.reconcile()
    uid = rig.by_device()["gpu-0"]["metadata"]["uid"]
    rig.rem.stop()
    rig.restart()
    assert rig.health.health(rig.ids[0].uuid).healthy
    for _ in range(4):
        rig.observe()
        rig.reconcile()
        rig.clock.advance(HOLD)
    assert rig.effects() == {"gpu-0": "NoExecute"} and rig.by_device()["gpu-0"]["metadata"]["uid"] == uid
    assert not [q for q in rig.writes() if q.method == "DELETE"]
    # and the health side agrees with the rule: the adopted label made the GPU sticky again
    h = rig.health.health(rig.ids[0].uuid)
    assert h.sticky and not h.healthy
    (cond,) = h.conditions
    assert cond.reason == "repeated_failures" and "sticky label on DeviceTaintRule" in cond.evidence


def test_removing_the_sticky_label_lets_the_rule_step_down(make_rig):
    """``kubectl label devicetaintrule <rule> <sticky>-``: cleared, then released like any rule."""
    rig = make_rig("1.37")
    fail_until_sticky(rig, 0)
    rig.reconcile()
    name = rig.by_device()["gpu-0"]["metadata"]["name"]
    status, _ = call_json(api_client(rig.server.url), "PATCH", f"/apis/resource.k8s.io/v1/devicetaintrules/{name}",
                          body={"metadata": {"labels": {names.STICKY_LABEL: None}}}, content_type="application/merge-patch+json")
    assert status == 200
    cleared_at = len(rig.writes())
    rig.reconcile()
    h = rig.health.health(rig.ids[0].uuid)
    assert not h.sticky and h.healthy
    for _ in range(3):
        rig.clock.advance(HOLD)
        rig.reconcile()
    assert rig.rules() == []
    later = rig.writes()[cleared_at:]
    assert [q.method for q in later] == ["PATCH", "DELETE"]  # NoExecute -> NoSchedule -> gone
    assert names.STICKY_LABEL not in later[0].body["metadata"]["labels"]  # never put back


def test_a_patch_never_puts_back_a_sticky_label_a_person_removed(make_rig):
    """Regression: the label came back with the next refresh when it was removed between two
    lists (the agent had not seen the removal yet), so the person's "cleared" was undone."""
    rig = make_rig("1.37")
    fail_until_sticky(rig, 0)
    rig.reconcile()
    rig.rem.feed.resync = rig.rem.kill.resync = 3600  # the next list is not due: the agent still believes the rule sticky
    name = rig.by_device()["gpu-0"]["metadata"]["name"]
    status, _ = call_json(api_client(rig.server.url), "PATCH", f"/apis/resource.k8s.io/v1/devicetaintrules/{name}",
                          body={"metadata": {"labels": {names.STICKY_LABEL: None}}}, content_type="application/merge-patch+json")
    assert status == 200
    patches_before = len([q for q in rig.writes() if q.method == "PATCH"])
    rig.clock.advance(RECORD_REFRESH)
    rig.xid(0, 48)  # new evidence: the rule's record is refreshed
    rig.reconcile()
    assert len([q for q in rig.writes() if q.method == "PATCH"]) > patches_before  # it did write
    assert names.STICKY_LABEL not in rig.by_device()["gpu-0"]["metadata"]["labels"]


def test_deleting_a_mig_devices_sticky_rule_clears_its_gpu(make_rig):
    """Failure history is kept per physical GPU; the rule names the MIG device. Regression: the
    agent cleared the MIG uuid (which has no history), so the GPU stayed sticky and the rule
    the person deleted came straight back."""
    rig = make_rig("1.37", n=2)
    parent = rig.ids[0]
    inst = DeviceIdentity(uuid="MIG-00000000-1111-2222-3333-444444444444", vendor=Vendor.NVIDIA, model="NVIDIA H100 MIG 3g.40gb",
                          pci_bus_id=parent.pci_bus_id, index=0, minor=0, parent_uuid=parent.uuid, mig_profile="3g.40gb")
    slice_ = slice_object(NODE, rig.ids[1:], rig.slice_version)
    slice_["spec"]["devices"].append({"name": "gpu-0-mig-3g40gb-9-0", "attributes": {"uuid": {"string": inst.uuid}, "parentUUID": {"string": parent.uuid}}})
    rig.server.apply(slice_)
    wait_until(lambda: (DRIVER, NODE, "gpu-0-mig-3g40gb-9-0") in rig.watcher.devices(), timeout=5, message="the MIG device")
    rig.set_local([parent, inst, rig.ids[1]])
    fail_until_sticky(rig, 0)
    rig.reconcile()
    rule = rig.by_device()["gpu-0-mig-3g40gb-9-0"]
    assert rule["metadata"]["labels"][names.STICKY_LABEL] == "true" and set(rig.by_device()) == {"gpu-0-mig-3g40gb-9-0"}
    rig.server.delete("resource.k8s.io", "devicetaintrules", rule["metadata"]["name"])
    rig.reconcile(2)
    assert rig.rules() == []
    assert rig.health.health(parent.uuid).healthy


# ------------------------------------------------------------------------------ conflicts, outages, restarts


def test_409_on_create_adopts_the_existing_rule(make_rig):
    rig = make_rig("1.37", resync=3600)  # listed once, before the rule appears
    rig.reconcile()
    name = names.rule_name(NODE, DRIVER, NODE, "gpu-2")
    # Written by an earlier attempt whose answer was lost (or a previous agent process).
    rig.server.apply(rig.rem.rules.body(name, DRIVER, NODE, "gpu-2", f"{names.TAINT_DOMAIN}/degraded", "xid_74", "NoSchedule",
                                        {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: NODE, names.TIER_LABEL: "degraded"},
                                        {names.UUID_ANNOTATION: rig.ids[2].uuid}))
    uid = rig.by_device()["gpu-2"]["metadata"]["uid"]
    rig.xid(2, 79)
    rig.reconcile()
    wait_until(lambda: [(q.method, q.status) for q in rig.writes()] == [("POST", 409)], timeout=5, message="one POST answered 409")
    assert rig.rem.report().actions["adopt"] == 1 and len(rig.events("GPUTaintAdopted")) == 1
    rig.reconcile()  # the adopted rule is then brought in line
    rule = rig.by_device()["gpu-2"]
    assert rule["metadata"]["uid"] == uid and rule["spec"]["taint"]["effect"] == "NoExecute"
    assert len(rig.rules()) == 1


def test_409_for_a_rule_that_is_not_ours_is_left_alone(make_rig):
    rig = make_rig("1.37", resync=3600)
    rig.reconcile()
    name = names.rule_name(NODE, DRIVER, NODE, "gpu-2")
    rig.server.apply(rig.rem.rules.body(name, DRIVER, NODE, "gpu-2", "example.com/x", "v", "NoSchedule", {}, {}))
    rig.xid(2, 79)
    rig.reconcile(3)
    # told once (it was counted on every pass), in a Warning Event on the Node
    assert rig.rem.report().suppressed["name_conflict"] == 1 and rig.rem.report().rules == ()
    (ev,) = rig.events("HealthRemediationSuppressed")
    assert ev["type"] == "Warning" and name in ev["note"] and ev["regarding"]["kind"] == "Node"
    assert rig.by_device()["gpu-2"]["spec"]["taint"]["key"] == "example.com/x"
    assert [q.method for q in rig.writes()] == ["POST"]  # tried once, never overwritten
    rig.clock.advance(REFUSED_RETRY)  # asked again only after the hold
    rig.reconcile()
    assert [q.method for q in rig.writes()] == ["POST"] * 2 and rig.rem.report().suppressed["name_conflict"] == 1


def test_lost_create_response_is_retried_without_a_duplicate(make_rig):
    """The create reaches the server but its answer does not reach us (the client times out):
    the retry gets a 409 and adopts the rule the first attempt made."""
    rig = make_rig("1.37", resync=3600)
    rig.reconcile()
    rig.server.delay_next(r"/devicetaintrules$", 5.3, method="POST")  # > the client's 5 s read timeout
    rig.xid(3, 79)
    with pytest.raises(ApiError) as e:
        rig.reconcile()
    assert e.value.retryable
    wait_until(lambda: rig.rules(), timeout=5, message="the delayed create to land")
    rig.reconcile()
    posts = [q for q in rig.writes() if q.method == "POST"]
    assert len(posts) == 2  # (the first one's answer went nowhere)
    wait_until(lambda: posts[1].status == 409, timeout=5, message="the retry's 409")
    assert len(rig.rules()) == 1 and rig.effects() == {"gpu-3": "NoExecute"}
    assert rig.rem.report().actions["adopt"] == 1 and rig.rem.report().rules[0].device == "gpu-3"
    assert len(rig.events("GPUTaintAdopted")) == 1  # the lost create never got its Event


def test_outage_during_a_taint_is_retried_by_the_remediator_thread(make_rig):
    rig = make_rig("1.37")
    rig.rem.start()
    rig.server.outage(True)
    rig.xid(0, 79)  # wakes the remediator at once
    wait_until(lambda: rig.rem.last_error is not None, timeout=5, message="a failed pass")
    assert rig.rem.ok is False
    rig.server.outage(False)
    wait_until(lambda: rig.rules(), timeout=10, message="the rule after the outage")
    wait_until(lambda: rig.rem.ok, timeout=5, message="a good pass")
    assert rig.effects() == {"gpu-0": "NoExecute"}
    created = [q for q in rig.writes() if q.method == "POST" and q.status == 201]
    assert len(created) == 1
    rig.rem.poke()
    wait_until(lambda: rig.rem.ok, timeout=5)
    assert len(rig.rules()) == 1 and len(rig.events("GPUTainted")) == 1


@pytest.mark.parametrize("code", [429, 500, 503])
def test_throttled_or_failing_writes_during_a_taint_are_retried_to_exactly_one_rule(make_rig, code):
    """The API server answers 429 (with Retry-After), 500 or 503 to the create, and then to the
    patch that raises the rule's effect: the remediator thread retries each until it lands,
    with one rule throughout, never a duplicate, and says so while it fails."""
    rig = make_rig("1.37")
    rig.rem.start()
    wait_until(lambda: rig.rem.ok, timeout=5, message="a first pass")
    retry_after = 0 if code == 429 else None
    rig.server.fail_next("POST", r"/devicetaintrules$", code, count=2, retry_after=retry_after)
    rig.xid(0, 74)  # degraded: NoSchedule
    wait_until(lambda: rig.effects() == {"gpu-0": "NoSchedule"}, timeout=10, message="the rule after two refusals")
    wait_until(lambda: rig.rem.ok, timeout=5, message="a good pass")
    rig.server.fail_next("PATCH", r"/devicetaintrules/", code, count=2, retry_after=retry_after)
    rig.xid(0, 79)  # fatal: the same rule goes NoExecute
    wait_until(lambda: rig.effects() == {"gpu-0": "NoExecute"}, timeout=10, message="the raised rule after two refusals")
    wait_until(lambda: rig.events("GPUTaintEscalated"), timeout=5, message="the update's Event")
    writes = [(q.method, q.status) for q in rig.writes()]
    assert writes == [("POST", code)] * 2 + [("POST", 201)] + [("PATCH", code)] * 2 + [("PATCH", 200)]
    assert len(rig.rules()) == 1 and len(rig.events("GPUTainted")) == 1
    # (the report is published when the pass that wrote the Event ends)
    wait_until(lambda: "update" in rig.rem.report().actions, timeout=5, message="the pass's report")
    assert rig.rem.report().actions["create"] == 1 and rig.rem.report().actions["update"] == 1


def test_a_429s_retry_after_is_honoured_by_the_remediator(make_rig):
    from structlog.testing import capture_logs

    rig = make_rig("1.37")
    rig.rem.start()
    wait_until(lambda: rig.rem.ok, timeout=5, message="a first pass")
    rig.server.fail_next("POST", r"/devicetaintrules$", 429, count=1, retry_after=1.5)
    with capture_logs() as logs:
        rig.xid(0, 79)
        wait_until(lambda: rig.rules(), timeout=10, message="the rule after the 429")
    (failed,) = [e for e in logs if e["event"] == "remediation_pass_failed"]
    assert failed["retry_in"] >= 1.5 and "429" in failed["error"]  # not the 0.5 s first backoff


def test_a_refused_write_does_not_block_the_other_devices(make_rig):
    """Regression: one 4xx (e.g. an admission policy) aborted the whole pass, every pass. And
    a refused write is not asked again on every pass (every cycle, every health event): it is
    held for REFUSED_RETRY, then tried again."""
    rig = make_rig("1.37")
    deny = dict(method="POST", path_regex=r"/devicetaintrules$", code=403, message="denied by ValidatingAdmissionPolicy")
    rig.server.fail_next(**deny)
    rig.xid(0, 79)
    rig.xid(1, 79)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    rig.reconcile(3)  # held: not asked again
    assert [q.status for q in rig.writes() if q.method == "POST"] == [403, 201]
    assert rig.rem.report().suppressed["api_rejected"] == 1  # told once
    refused = [e for e in rig.events("HealthRemediationSuppressed") if "refused" in e["note"]]
    assert len(refused) == 1 and "denied by ValidatingAdmissionPolicy" in refused[0]["note"]
    rig.clock.advance(REFUSED_RETRY)
    rig.server.fail_next(**deny)
    rig.reconcile()  # asked again after the hold, refused again, told no more
    assert [q.status for q in rig.writes() if q.method == "POST"] == [403, 201, 403]
    assert len([e for e in rig.events("HealthRemediationSuppressed") if "refused" in e["note"]]) == 1
    rig.clock.advance(REFUSED_RETRY)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoExecute"}


def test_restart_adopts_rules_without_duplicates_or_orphans(make_rig):
    rig = make_rig("1.37")
    rig.xid(0, 79)
    rig.xid(1, 74)
    rig.reconcile()
    before = {d: r["metadata"]["uid"] for d, r in rig.by_device().items()}
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}
    rig.rem.stop()

    rig.restart()  # gpu-0 is still broken (the new process sees it lost); gpu-1 recovered meanwhile
    rig.observe(g0=DeviceReading.failed(rig.ids[0].uuid, ReadError.LOST))
    posts = len([q for q in rig.writes() if q.method == "POST"])
    rig.reconcile(2)
    assert {d: r["metadata"]["uid"] for d, r in rig.by_device().items()} == before
    assert len([q for q in rig.writes() if q.method == "POST"]) == posts  # nothing created again
    assert rig.rem.report().actions["adopt"] == 2 and len(rig.events("GPUTaintAdopted")) == 2
    assert {v.device: v.effect for v in rig.rem.report().rules} == {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}
    # the rule of the recovered device is no orphan: it is stepped down and removed. (Issue 16
    # changed the timing: the adopted rule's degraded condition is restored into the new
    # health engine, so it ages out as it would have without the restart, then the hold runs.)
    assert not rig.health.health(rig.ids[1].uuid).healthy
    rig.clock.advance(POLICY.event_quiet)
    rig.observe(g0=DeviceReading.failed(rig.ids[0].uuid, ReadError.LOST))
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    rig.clock.advance(1)
    rig.observe(g0=DeviceReading.failed(rig.ids[0].uuid, ReadError.LOST))
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}


def test_rule_for_a_device_no_longer_published_is_removed_after_the_hold(make_rig):
    """Regression: a rule whose device left the ResourceSlice (MIG relayout, driver gone) was orphaned."""
    rig = make_rig("1.37")
    rig.xid(3, 79)
    rig.reconcile()
    rig.server.apply(slice_object(NODE, rig.ids[:3], rig.slice_version))  # gpu-3 no longer published
    wait_until(lambda: len(rig.watcher.devices()) == 3, timeout=5, message="the slice update")
    rig.reconcile()
    rig.clock.advance(HOLD - 1)
    rig.reconcile()
    assert rig.effects() == {"gpu-3": "NoExecute"}  # a republish blip does not drop a taint
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.rules() == [] and rig.rem.report().rules == ()
    assert "no longer published" in rig.events("GPUUntainted")[-1]["note"]


# ------------------------------------------------------------------------------ safety


def test_budget_is_spent_per_fault_domain_then_new_faults_get_effect_none(make_rig):
    """Issue 13 changed this: the budget is one object the agents take slots of (one per fault
    domain raised to NoExecute), not a count of every agent's rules listed cluster-wide."""
    rig = make_rig("1.37", taint_budget_max=2)
    for gpu_uuid in ("GPU-b0", "GPU-b1"):  # another node's agent already holds two domains
        assert rig.rem.budget.take(f"node-b.{gpu_uuid}")
    rig.xid(0, 79)
    rig.xid(1, 79)
    rig.reconcile()
    ours = {r["spec"]["deviceSelector"]["device"]: r["spec"]["taint"]["effect"] for r in rig.rules() if r["spec"]["deviceSelector"]["pool"] == NODE}
    assert ours == {"gpu-0": "None", "gpu-1": "None"}
    assert rig.rem.report().budget_exhausted
    warn = [e for e in rig.events("HealthRemediationSuppressed") if "budget" in e["note"]]
    assert len(warn) == 2 and all(e["type"] == "Warning" for e in warn)  # one per device, not one per pass
    rig.reconcile(2)
    assert len([e for e in rig.events("HealthRemediationSuppressed") if "budget" in e["note"]]) == 2
    assert rig.rem.report().suppressed["budget"] == 2
    m = metric_samples(rig)
    assert [v for _, v in m["dra_gpu_exporter_taint_budget_exhausted"]] == [1.0]
    # the budget frees up: the suppressed faults get their real effect
    rig.rem.budget.release("node-b.GPU-b0")
    rig.reconcile()
    ours = {r["spec"]["deviceSelector"]["device"]: r["spec"]["taint"]["effect"] for r in rig.rules() if r["spec"]["deviceSelector"]["pool"] == NODE}
    assert sorted(ours.values()) == ["NoExecute", "None"]  # exactly one more fits
    assert rig.rem.budget.held(f"{NODE}.") == {f"{NODE}.{rig.ids[0].uuid}"}
    # recovery gives the slot back
    rig.recover(0)
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.rem.budget.held(f"{NODE}.") == set()


def test_budget_without_effect_none_falls_back_to_noschedule(make_rig):
    rig = make_rig("1.34", taint_budget_max=1)
    rig.xid(0, 79)
    rig.xid(1, 79)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}


def test_rate_limit_on_new_noexecute_rules(make_rig):
    rig = make_rig("1.37", taint_rate_limit=1, taint_rate_window=600.0)
    rig.xid(0, 79)
    rig.reconcile()
    rig.xid(1, 79)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}
    assert rig.rem.report().suppressed["rate_limit"] == 1
    assert len([e for e in rig.events("HealthRemediationSuppressed") if "rate limit" in e["note"]]) == 1
    rig.clock.advance(601)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoExecute"}
    assert len(rig.events("GPUTaintEscalated")) == 1


def test_most_gpus_failing_at_once_is_a_node_fault_with_one_event(make_rig):
    rig = make_rig("1.37", n=4)
    for i in range(3):
        rig.xid(i, 79)
    rig.reconcile(2)
    assert rig.effects() == {"gpu-0": "NoSchedule", "gpu-1": "NoSchedule", "gpu-2": "NoSchedule"}
    warn = rig.events("HealthRemediationSuppressed")
    assert len(warn) == 1 and "3 of 4 GPUs" in warn[0]["note"]
    assert warn[0]["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE}
    assert rig.rem.report().suppressed["node_fault"] == 1
    # a later, separate node-wide fault is told again
    for i in range(3):
        rig.recover(i)
    rig.reconcile()
    for i in range(3):
        rig.xid(i, 48)
    rig.reconcile()
    assert len(rig.events("HealthRemediationSuppressed")) == 2


def test_node_kill_switch_stops_every_write(make_rig):
    rig = make_rig("1.37")
    rig.xid(0, 79)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}
    assert metric_samples(rig)["dra_gpu_exporter_remediation_active"] == [({"node": NODE, "mode": "enforce"}, 1.0)]
    rig.server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {names.KILL_SWITCH_LABEL: "disabled"}}})
    writes = len(rig.writes())
    rig.xid(1, 79)  # new fault: not tainted
    rig.recover(0)  # recovered: not stepped down
    for _ in range(3):
        rig.reconcile()
        rig.clock.advance(HOLD)
    assert rig.effects() == {"gpu-0": "NoExecute"}
    new = gpu(0, serial=5)  # even a hardware swap does not make it write
    ids = [new] + rig.ids[1:]
    rig.server.apply(slice_object(NODE, ids, rig.slice_version))
    wait_until(lambda: rig.watcher.device((DRIVER, NODE, "gpu-0")).attr("uuid") == new.uuid, timeout=5, message="the new UUID")
    rig.set_local(ids)
    rig.reconcile()
    assert len(rig.writes()) == writes
    assert rig.effects() == {"gpu-0": "NoExecute"}
    assert rig.rem.report().suppressed["kill_switch"] >= 1
    assert any("kill switch" in e["note"] for e in rig.events("HealthRemediationSuppressed"))
    assert metric_samples(rig)["dra_gpu_exporter_remediation_active"] == [({"node": NODE, "mode": "enforce"}, 0.0)]
    # switch off again: the pending work happens
    rig.server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    assert len(rig.events("HardwareSwapDetected")) == 1


def test_managed_false_annotation_is_honoured(make_rig):
    rig = make_rig("1.37")
    rig.xid(0, 79)
    rig.reconcile()
    rule = rig.by_device()["gpu-0"]
    rule["metadata"]["annotations"][names.UNMANAGED_ANNOTATION] = "false"
    rig.server.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", **rule})
    writes = len(rig.writes())
    rig.recover(0)
    for _ in range(4):
        rig.reconcile()
        rig.clock.advance(HOLD)
    rig.xid(0, 79)
    rig.reconcile()
    assert len(rig.writes()) == writes
    assert rig.effects() == {"gpu-0": "NoExecute"} and rig.by_device()["gpu-0"]["metadata"]["uid"] == rule["metadata"]["uid"]
    assert rig.rem.report().suppressed["unmanaged"] == 1


def test_a_rule_an_admin_deleted_is_not_recreated_without_new_evidence(make_rig):
    rig = make_rig("1.37")
    rig.xid(0, 79)
    lost = DeviceReading.failed(rig.ids[1].uuid, ReadError.LOST)
    rig.observe(g1=lost)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoExecute"}
    for r in rig.rules():
        rig.server.delete("resource.k8s.io", "devicetaintrules", r["metadata"]["name"])
    for _ in range(3):  # the GPU stays lost, cycle after cycle: that is not new evidence
        rig.clock.advance(10)
        rig.observe(g1=lost)
        rig.reconcile()
    assert rig.rules() == []
    rig.clock.advance(601)  # (past the NoExecute rate window)
    rig.xid(0, 79)  # a new XID after the deletion is
    rig.observe(g1=lost)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}


def test_hardware_swap_clears_the_rule(make_rig):
    rig = make_rig("1.37")
    rig.xid(2, 79)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoExecute"}
    new = gpu(2, serial=7)  # another board in the same slot: same device name, new UUID
    ids = rig.ids[:2] + [new] + rig.ids[3:]
    rig.server.apply(slice_object(NODE, ids, rig.slice_version))
    wait_until(lambda: rig.watcher.device((DRIVER, NODE, "gpu-2")).attr("uuid") == new.uuid, timeout=5, message="the new UUID")
    rig.set_local(ids)
    rig.reconcile()
    assert rig.rules() == []
    swap = rig.events("HardwareSwapDetected")
    assert len(swap) == 1 and rig.ids[2].uuid in swap[0]["note"] and new.uuid in swap[0]["note"]
    rig.reconcile()
    assert rig.rules() == []  # the new board is healthy: nothing is recreated


# ------------------------------------------------------------------------------ modes


def test_dry_run_never_writes(make_rig):
    rig = make_rig("1.37", mode=TaintMode.DRY_RUN)
    rig.server.clear_requests()
    rig.xid(0, 79)
    rig.xid(1, 13)
    rig.reconcile(2)
    rig.recover(0)
    for _ in range(3):
        rig.clock.advance(HOLD)
        rig.reconcile()
    assert [q for q in rig.server.requests if q.method != "GET"] == []
    assert rig.rules() == [] and rig.rem.report().rules == ()
    assert rig.rem.report().actions["dry_run"] >= 2 and "create" not in rig.rem.report().actions
    assert metric_samples(rig)["dra_gpu_exporter_remediation_active"] == [({"node": NODE, "mode": "dry-run"}, 0.0)]


@pytest.mark.parametrize("release,expected", [("1.35", {"gpu-0": "None", "gpu-1": "None"}), ("1.34", {})])
def test_shadow_writes_effect_none_where_served(make_rig, release, expected):
    rig = make_rig(release, mode=TaintMode.SHADOW)
    rig.xid(0, 79)
    rig.xid(1, 74)
    rig.reconcile()
    assert rig.effects() == expected
    if expected:
        assert rig.by_device()["gpu-0"]["metadata"]["labels"][names.TIER_LABEL] == "fatal"


def test_off_mode_does_nothing(make_rig):
    rig = make_rig("1.37", mode=TaintMode.OFF)
    rig.server.clear_requests()
    rig.xid(0, 79)
    rig.reconcile()
    # The slice watcher may re-open its watch at any moment; remediation itself must not call.
    assert [r for r in rig.server.requests if "/resourceslices" not in r.path] == []


# ------------------------------------------------------------------------------ device-plugin GPUs


def test_device_plugin_gpus_get_events_but_no_rule(make_rig):
    rig = make_rig("1.37", n=2, extra_local=1)  # local GPU 2 is in no ResourceSlice
    rig.reconcile()
    assert rig.events() == []
    rig.xid(2, 79)
    rig.reconcile(2)
    assert rig.rules() == []
    ev = rig.events("GPUUnhealthy")
    assert len(ev) == 1 and ev[0]["type"] == "Warning" and rig.local[2].uuid in ev[0]["note"]
    assert ev[0]["regarding"]["kind"] == "Node"
    assert not rig.health.health(rig.local[2].uuid).healthy  # the condition itself is there
    rig.recover(2)
    rig.reconcile()
    assert len(rig.events("GPUHealthy")) == 1


# ------------------------------------------------------------------------------ concurrency


def test_health_changes_wake_the_remediator(make_rig):
    rig = make_rig("1.37")
    rig.rem.start()
    wait_until(lambda: rig.rem.ok, timeout=5, message="a first pass")
    rig.xid(1, 79)  # no collection cycle follows: the health engine's notification alone must do it
    wait_until(lambda: rig.effects() == {"gpu-1": "NoExecute"}, timeout=5, message="the rule")
    # the pass ends with the rule's Event: waiting for it keeps the thread's log line in this test
    wait_until(lambda: rig.events("GPUTainted"), timeout=5, message="the rule's Event")


def test_the_report_is_a_frozen_copy_of_one_moment(make_rig):
    """report() hands out what the last pass published: later passes change nothing in it (the
    latency histogram included: a copy, not the one the remediation thread keeps writing)."""
    import dataclasses

    from exporter.remediation.contract import HistogramSnapshot

    rig = make_rig("1.37")
    rig.xid(0, 79)
    rig.reconcile()
    first = rig.rem.report()
    rig.xid(1, 79)
    rig.reconcile()
    later = rig.rem.report()
    assert isinstance(first.latency, HistogramSnapshot) and first.latency.count == 1 and later.latency.count == 2
    assert [v.device for v in first.rules] == ["gpu-0"] and [v.device for v in later.rules] == ["gpu-0", "gpu-1"]
    assert first.actions == {"create": 1} and later.actions == {"create": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.ok = False  # type: ignore[misc]
