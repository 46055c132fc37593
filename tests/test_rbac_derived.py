"""RBAC and admission derived from what the agent really asks the API server for.

The agent is built by the real wiring against the repository's HTTP API emulation and taken
through start-up, a fatal fault (XID 79 + lost GPU -> DeviceTaintRule, Events; nothing evicts the
pod on the GPU here, so a minute after the NoExecute taint the agent reads it by name and tells it
in Events on the pod, in its namespace, and on the rule) and the recovery (GPU reset -> step down
-> rule deleted). Every request in the emulation's request log is turned
into the authorization attributes the kube-apiserver would check (verb, API group, resource,
namespace, name; list/watch names come from a metadata.name field selector), and then:

* every request must be allowed by the chart's RBAC (ClusterRole/Role bindings for the agent's
  service account, evaluated the way the RBAC authorizer does, resourceNames included);
* every verb the chart grants must be used by some request (least privilege), except grants
  listed in GRANTED_AHEAD_OF_USE, each with the reason and the team whose code will use it; a
  test fails as soon as such a grant is used, so the list only shrinks;
* every write the agent made passes the chart's ValidatingAdmissionPolicies (evaluated with
  cel-python, tests/vap_eval.py), with the node-name claim of the agent's own pod-bound token.

When the agent's requests change, this test names the missing or unused grant; update
deploy/helm/dra-gpu-exporter/templates/02-rbac.yaml and run tools/render_manifest.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pytest
from chart_render import NAMESPACE, RELEASE, render_docs
from k8s_helpers import publish_scenario, running_apiserver, wait_until, write_kubeconfig
from validation import StrictValidator
from vap_eval import PolicyEvaluator, agent_request

from drasim import objects
from drasim.backend import SimBackend, SimClock
from drasim.kubelet import FakeKubelet
from drasim.scenario import parse_scenario
from exporter.config import Config, TaintMode
from exporter.health.engine import HealthPolicy
from exporter.wiring import build_agent

AGENT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}"
# The run turns on the opt-in pod labels, so it exercises the pods list too; the chart is rendered
# with the same feature on (podLabelAllowlist), and test_default_install_has_no_pod_access checks
# that the default install does without it.
POD_LABELS = ("app",)
CHART_VALUES = {"podLabelAllowlist": list(POD_LABELS)}
SCALE = 20.0  # simulated seconds per real second
SCENARIO = {
    "name": "rbac-derivation",
    "node": "rbac-node",
    "gpus": [{"name": f"gpu{i}", "utilization": 0.5, "memory_used": 0.25} for i in range(2)],
    "claims": [{"namespace": "team-a", "name": "train", "devices": ["gpu1"]}],
    "pods": [{"namespace": "team-a", "name": "trainer", "containers": [{"name": "main", "claims": ["train"]}]}],
    "faults": [
        {"kind": "xid", "gpu": "gpu1", "at": "5s", "code": 79},
        {"kind": "lost", "gpu": "gpu1", "at": "5s"},
        # ~7 s of real time after the fault: room for a settle window before NoExecute, and for
        # the grace (60 s) after which the pod still on the GPU is looked at and told
        {"kind": "reset", "gpu": "gpu1", "at": "150s"},
    ],
}

# Grants the chart makes before the code on this branch uses them: (group, resource, verb,
# namespace or "*" for cluster-wide, resourceName or "") -> why. Agreed in the team interfaces;
# delete an entry once the code uses it (test_grants_ahead_of_use_are_not_yet_used says when).
GRANTED_AHEAD_OF_USE: dict[tuple[str, str, str, str, str], str] = {
    ("", "configmaps", "create", NAMESPACE, ""): "per-node state ConfigMap, created the first time an admin deletion must be remembered (not in this run)",
    ("resource.k8s.io", "devicetaintrules", "get", "*", ""): "only after a 409 on create, to adopt a rule of ours whose create answer was lost (not exercised by this run)",
}


# --- request -> authorization attributes ------------------------------------------------------


@dataclass(frozen=True)
class Access:
    verb: str
    group: str
    resource: str  # with "/subresource" when there is one
    namespace: str  # "" for cluster-scoped objects and for requests across all namespaces
    name: str  # "" for collections (list/watch/create) unless a metadata.name field selector names one

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {self.group or 'core'}/{self.resource}{where}{' ' + self.name if self.name else ''}"


_DISCOVERY = re.compile(r"^/(api|apis)(/[^/]+){0,2}/?$")
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def access_of(method: str, path: str, query: dict[str, str], watch: bool) -> Access | None:
    """The RBAC attributes of one request (None for discovery, which system:discovery grants to
    every authenticated user)."""
    path = path.split("?", 1)[0].rstrip("/")
    if _DISCOVERY.match(path) and not path.startswith("/api/v1/") and (path.count("/") <= 2 or path.startswith("/apis/")):
        return None
    parts = [unquote(p) for p in path.strip("/").split("/")]
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        raise AssertionError(f"non-resource request {method} {path}: no RBAC rule covers it")
    if not rest:
        return None  # /api/v1 or /apis/<group>/<version>: discovery
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else "")
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        verb = "get" if name else ("watch" if watch or query.get("watch") in ("true", "1") else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS[method]
    if verb in ("list", "watch") and not name:
        # RBAC matches resourceNames for list/watch only through a metadata.name field selector.
        for term in query.get("fieldSelector", "").split(","):
            key, _, value = term.partition("=")
            if key == "metadata.name" and value and not value.startswith("="):
                name = value
    return Access(verb, group, resource, namespace, name)


# --- the RBAC authorizer, over the rendered chart ---------------------------------------------


@dataclass(frozen=True)
class Grant:
    group: str
    resource: str
    verb: str
    namespace: str  # "*" for a ClusterRole bound cluster-wide
    resource_name: str  # "" when the rule has no resourceNames

    def key(self) -> tuple[str, str, str, str, str]:
        return (self.group, self.resource, self.verb, self.namespace, self.resource_name)

    def allows(self, a: Access) -> bool:
        if (self.group, self.resource, self.verb) != (a.group, a.resource, a.verb):
            return False
        if self.namespace != "*" and self.namespace != a.namespace:
            return False
        return not self.resource_name or self.resource_name == a.name


def agent_grants(docs: list[dict[str, Any]]) -> list[Grant]:
    """Every (group, resource, verb, scope, name) the chart grants the agent's service account."""
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    grants: list[Grant] = []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE} not in b["subjects"]:
            continue
        ref = b["roleRef"]
        scope = "*" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
        role_ns = "" if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
        role = roles[(ref["kind"], role_ns, ref["name"])]
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, "the agent requests no non-resource URL"
            for verb in rule["verbs"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for rn in rule.get("resourceNames") or [""]:
                            grants.append(Grant(group, resource, verb, scope, rn))
    return grants


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    accesses: list[Access]
    writes: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]]  # (operation, kind, object, oldObject)
    node: str


class RecordingValidator(StrictValidator):
    """The strict schema check, plus the object as stored after each create/update/patch (what
    admission sees as `object`)."""

    def __init__(self, version: str) -> None:
        super().__init__(version)
        self.objects: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, api_version: str, kind: str, body: dict[str, Any]) -> None:
        super().__call__(api_version, kind, body)
        self.objects.append((kind, {**body, "apiVersion": api_version, "kind": kind}))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("rbac")
    sc = parse_scenario(SCENARIO, "rbac")
    kubelet = FakeKubelet(str(tmp / "kubelet.sock"))
    kubelet.set_pods(objects.kubelet_pods(sc, list(sc.pods)))
    kubelet.start()
    try:
        with running_apiserver("1.37", bookmark_interval=1.0) as server:
            validator = RecordingValidator("1.37")
            server.set_validator(validator)
            publish_scenario(server, sc)
            server.clear_requests()  # what the test set up is not the agent's
            # ... but the agent's updates of it (the budget ConfigMap) are UPDATEs of these
            installed = {("ConfigMap", o["metadata"]["name"]): {**o, "apiVersion": "v1", "kind": "ConfigMap"}
                         for o in server.list("", "configmaps")}
            validator.objects.clear()
            kubeconfig = write_kubeconfig(tmp / "kubeconfig", server.url)
            clock = SimClock(SCALE, start_offset=-20.0)
            cfg = Config(
                listen_host="127.0.0.1", listen_port=0, node_name=sc.node, kubelet_socket=kubelet.socket_path,
                kubeconfig=str(kubeconfig), backend="sim", interval=0.1, call_timeout=1.0,
                taint_mode=TaintMode.ENFORCE, taint_hold_seconds=4.0, pod_label_allowlist=POD_LABELS,
            )
            agent = build_agent(cfg, backend=SimBackend(sc, clock), clock=clock,
                                health_policy=HealthPolicy(clear_hold=4.0), remediation_resync=0.5)
            agent.start(serve=True)
            try:
                wait_until(lambda: server.list("resource.k8s.io", "devicetaintrules"), timeout=60, message="the fault's rule")
                wait_until(lambda: not server.list("resource.k8s.io", "devicetaintrules")
                           and clock.now() > 150.0, timeout=120, message="the recovery")
            finally:
                agent.stop()
            log = server.requests
    finally:
        kubelet.stop()
    assert validator.failures == []
    accesses = [a for r in log if r.status and (a := access_of(r.method, r.path, r.query, r.watch))]
    # Admission sees, per write, the stored object before (oldObject) and after (object).
    writes: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]] = []
    last: dict[tuple[str, str], dict[str, Any]] = dict(installed)
    for kind, obj in validator.objects:
        key = (kind, obj["metadata"]["name"])
        writes.append(("UPDATE" if key in last else "CREATE", kind, obj, last.get(key)))
        last[key] = obj
    for r in log:
        if r.method == "DELETE" and r.status and r.status < 300 and "/devicetaintrules/" in r.path:
            name = r.path.rstrip("/").rsplit("/", 1)[1]
            writes.append(("DELETE", "DeviceTaintRule", None, last[("DeviceTaintRule", name)]))
    return Run(accesses, writes, sc.node)


@pytest.fixture(scope="module")
def grants() -> list[Grant]:
    return agent_grants(render_docs(CHART_VALUES))


# --- tests ------------------------------------------------------------------------------------


def test_the_run_covers_start_up_fault_and_recovery(run: Run) -> None:
    verbs = {(a.resource, a.verb) for a in run.accesses}
    assert {("devicetaintrules", "create"), ("devicetaintrules", "delete"), ("events", "create")} <= verbs
    # the pod that outstayed the taint: read by name, told in its own namespace
    assert {str(a) for a in run.accesses if a.resource == "pods" and a.verb == "get"} == {"get core/pods in team-a trainer"}
    assert {a.namespace for a in run.accesses if a.resource == "events"} == {"default", "team-a"}
    assert ("resourceslices", "watch") in verbs and ("resourceclaims", "get") in verbs


def test_every_request_is_allowed_by_the_charts_rbac(run: Run, grants: list[Grant]) -> None:
    denied = sorted({str(a) for a in run.accesses if not any(g.allows(a) for g in grants)})
    assert denied == [], (
        "the agent made requests the chart's RBAC forbids (add them to templates/02-rbac.yaml, "
        f"then run tools/render_manifest.py): {denied}"
    )


def test_every_grant_is_used(run: Run, grants: list[Grant]) -> None:
    unused = sorted(
        g.key() for g in grants
        if g.key() not in GRANTED_AHEAD_OF_USE and not any(g.allows(a) for a in run.accesses)
    )
    assert unused == [], f"the chart grants what the agent never requests (least privilege): {unused}"


def test_grants_ahead_of_use_are_granted_and_not_yet_used(run: Run, grants: list[Grant]) -> None:
    keys = {g.key() for g in grants}
    assert set(GRANTED_AHEAD_OF_USE) <= keys, sorted(set(GRANTED_AHEAD_OF_USE) - keys)
    now_used = sorted(k for k in GRANTED_AHEAD_OF_USE if any(g.allows(a) for g in grants if g.key() == k for a in run.accesses))
    assert now_used == [], f"the code now uses these grants: move them out of GRANTED_AHEAD_OF_USE: {now_used}"


def test_no_wildcards_and_no_cluster_wide_namespaced_writes(grants: list[Grant]) -> None:
    for g in grants:
        assert "*" not in (g.group, g.resource, g.verb)
        assert g.verb not in ("deletecollection", "escalate", "bind", "impersonate")
    # The only cluster-wide writes are on the cluster-scoped DeviceTaintRules and the creation of
    # Events (an Event about a pod must be in the pod's namespace), each confined to the agent's
    # own node by an admission policy.
    cluster_writes = {(g.resource, g.verb) for g in grants if g.namespace == "*" and g.verb not in ("get", "list", "watch")}
    assert {r for r, v in cluster_writes if (r, v) != ("events", "create")} <= {"devicetaintrules"}, cluster_writes
    policed = {r for d in render_docs(CHART_VALUES) if d["kind"] == "ValidatingAdmissionPolicy"
               for rule in d["spec"]["matchConstraints"]["resourceRules"] for r in rule["resources"]}
    assert {r for r, _ in cluster_writes} <= policed


def test_every_write_of_the_agent_passes_the_admission_policies(run: Run) -> None:
    docs = render_docs(CHART_VALUES)
    policies = [PolicyEvaluator(d) for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 3
    assert run.writes, "the run wrote nothing"
    checked = 0
    for operation, kind, obj, old in run.writes:
        request = agent_request(operation, run.node, user=AGENT)
        for policy in policies:
            if not policy.matches_kind(kind):
                continue
            decision = policy.evaluate(request, obj, old)
            assert decision.applies
            assert decision.allowed, (operation, kind, (obj or old)["metadata"]["name"], decision.denials)
            checked += 1
    assert checked >= 3  # the rule's create, step-down and delete at least
    kinds = {(kind, ((obj or {}).get("regarding") or {}).get("kind", "")) for _, kind, obj, _ in run.writes}
    assert {("Event", "Pod"), ("Event", "DeviceTaintRule")} <= kinds, kinds  # the overdue eviction's pair checked too
    # The same writes from another node's agent are all refused (an Event about a pod names no node).
    for operation, kind, obj, old in run.writes:
        if kind not in ("DeviceTaintRule", "Event") or (kind == "Event" and (obj or {}).get("regarding", {}).get("kind") == "Pod"):
            continue
        for policy in policies:
            if policy.matches_kind(kind):
                assert not policy.evaluate(agent_request(operation, "other-node", user=AGENT), obj, old).allowed


def test_default_install_lists_no_pods(grants: list[Grant]) -> None:
    default = {g.key() for g in agent_grants(render_docs())}
    with_labels = {g.key() for g in grants}
    # by default a pod is only ever read by name (one that outstays a NoExecute taint), never listed
    assert {k for k in default if k[1] == "pods"} == {("", "pods", "get", "*", "")}
    assert with_labels - default == {("", "pods", "list", "*", "")}
    assert default <= with_labels
    per_process = {g.key() for g in agent_grants(render_docs({"perProcess": True}))}
    assert per_process == with_labels
