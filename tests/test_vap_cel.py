"""The ValidatingAdmissionPolicies in daemonset.yaml (the chart's default render), evaluated by a
real CEL interpreter (cel-python, tests/vap_eval.py: the apiserver's evaluation rules).

Two policies: "own-node-taints" confines each agent to DeviceTaintRules of its own node (name
prefix with the node, pool == node, node label, a configured GPU driver, one device, our taint
key domain); "own-node-state" confines its ConfigMap writes to its node's state object and its
own entries of the shared budget. The node name is the one bound into the pod's service-account
token. The sample DeviceTaintRules are themselves validated against the official schemas of every
DeviceTaintRule version, so the objects the policy is tested on are objects the apiserver accepts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("celpy", reason="cel-python (test extra) is needed to evaluate CEL")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from chart_render import render_docs  # noqa: E402
from vap_eval import NODE_CLAIM, Decision, PolicyEvaluator, agent_request  # noqa: E402,F401

REPO = Path(__file__).resolve().parent.parent
AGENT_USER = "system:serviceaccount:dra-gpu-exporter:dra-gpu-exporter"
# DeviceTaintRule versions and the first release whose schema has them in the shape we use
# (v1alpha3 dropped deviceClassName/selectors in 1.35).
RULE_VERSIONS = {"v1alpha3": "1.35", "v1beta2": "1.36", "v1": "1.37"}
TAINTS_POLICY = "dra-gpu-exporter-own-node-taints"
STATE_POLICY = "dra-gpu-exporter-own-node-state"


def _load_policy(name: str = TAINTS_POLICY, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if docs is None:
        docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name]
    assert len(policies) == 1, f"expected exactly one ValidatingAdmissionPolicy {name}"
    return policies[0]


@pytest.fixture(scope="module")
def policy() -> PolicyEvaluator:
    return PolicyEvaluator(_load_policy())


@pytest.fixture(scope="module")
def state_policy() -> PolicyEvaluator:
    return PolicyEvaluator(_load_policy(STATE_POLICY))


def rule(
    node: str = "gpu-node-1",
    device: str | None = "gpu-3",
    driver: str | None = "gpu.nvidia.com",
    key: str = "gpu-health.dra-gpu-exporter.io/fatal",
    name: str | None = None,
    label_node: str | None = None,
    effect: str = "NoExecute",
    version: str = "v1",
) -> dict[str, Any]:
    selector: dict[str, Any] = {"pool": node}
    if driver is not None:
        selector["driver"] = driver
    if device is not None:
        selector["device"] = device
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name or f"dra-gpu-exporter-{node}-{device or 'x'}-fatal",
            "labels": {
                "app.kubernetes.io/managed-by": "dra-gpu-exporter",
                "dra-gpu-exporter.io/node": label_node if label_node is not None else node,
            },
            "annotations": {"dra-gpu-exporter.io/uuid": "GPU-5a0c2d1e-0000-4000-8000-000000000003"},
        },
        "spec": {
            "deviceSelector": selector,
            "taint": {"key": key, "value": "xid-79", "effect": effect},
        },
    }


def request(operation: str, node: str | None = "gpu-node-1", user: str = AGENT_USER) -> dict[str, Any]:
    return agent_request(operation, node, user)


# --- the samples are real DeviceTaintRules -----------------------------------------------------


@pytest.mark.parametrize("version", sorted(RULE_VERSIONS))
@pytest.mark.parametrize(
    "sample",
    [
        rule(),
        rule(node="gpu-node-2"),
        rule(device=""),
        rule(key="example.com/broken"),
        rule(name="someone-elses-rule"),
        rule(effect="None"),
    ],
    ids=["own", "other-node", "empty-device", "foreign-key", "foreign-name", "effect-none"],
)
def test_samples_are_schema_valid_device_taint_rules(version: str, sample: dict[str, Any]) -> None:
    obj = copy.deepcopy(sample)
    obj["apiVersion"] = f"resource.k8s.io/{version}"
    kubernetes_validate.validate(obj, RULE_VERSIONS[version], strict=True)


def test_policy_matches_every_device_taint_rule_version_and_operation() -> None:
    spec = _load_policy()["spec"]
    (resource_rule,) = spec["matchConstraints"]["resourceRules"]
    assert resource_rule["apiGroups"] == ["resource.k8s.io"]
    assert resource_rule["resources"] == ["devicetaintrules"]
    assert resource_rule["apiVersions"] == ["*"]
    assert set(resource_rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert spec["failurePolicy"] == "Fail"


# --- allowed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", sorted(RULE_VERSIONS))
def test_create_for_own_node_is_allowed(policy: PolicyEvaluator, version: str) -> None:
    decision = policy.evaluate(request("CREATE"), rule(version=version), None)
    assert decision.applies
    assert decision.allowed, decision.denials


def test_shadow_to_enforce_update_on_own_node_is_allowed(policy: PolicyEvaluator) -> None:
    old = rule(effect="None")
    new = rule(effect="NoExecute")
    decision = policy.evaluate(request("UPDATE"), new, old)
    assert decision.allowed, decision.denials


def test_delete_of_own_rule_is_allowed(policy: PolicyEvaluator) -> None:
    decision = policy.evaluate(request("DELETE"), None, rule())
    assert decision.allowed, decision.denials


def test_other_users_are_not_subject_to_the_policy(policy: PolicyEvaluator) -> None:
    # An admin writing a cluster-wide rule (empty selector, foreign key) is not our business.
    admin_rule = rule(node="gpu-node-9", key="example.com/maintenance", name="maintenance-window")
    decision = policy.evaluate(request("CREATE", node=None, user="kubernetes-admin"), admin_rule, None)
    assert not decision.applies
    decision = policy.evaluate(
        request("CREATE", user="system:serviceaccount:other-ns:dra-gpu-exporter"), admin_rule, None
    )
    assert not decision.applies


# --- denied -----------------------------------------------------------------------------------


def _denied(decision: Decision, fragment: str) -> None:
    assert decision.applies
    assert not decision.allowed
    assert any(fragment in d for d in decision.denials), decision.denials


def test_create_for_another_nodes_pool_is_denied(policy: PolicyEvaluator) -> None:
    decision = policy.evaluate(request("CREATE"), rule(node="gpu-node-2", label_node="gpu-node-1"), None)
    _denied(decision, "may only taint devices in pool gpu-node-1")


def test_create_without_pool_is_denied(policy: PolicyEvaluator) -> None:
    obj = rule()
    del obj["spec"]["deviceSelector"]["pool"]
    _denied(policy.evaluate(request("CREATE"), obj, None), "may only taint devices in pool")


def test_create_without_selector_is_denied(policy: PolicyEvaluator) -> None:
    obj = rule()
    del obj["spec"]["deviceSelector"]
    _denied(policy.evaluate(request("CREATE"), obj, None), "may only taint devices in pool")


@pytest.mark.parametrize("device", ["", None], ids=["empty", "missing"])
def test_create_without_a_device_is_denied(policy: PolicyEvaluator, device: str | None) -> None:
    # An empty or missing device would select every device of the pool (the whole node).
    _denied(policy.evaluate(request("CREATE"), rule(device=device), None), "must name one device")


def test_create_without_a_driver_is_denied(policy: PolicyEvaluator) -> None:
    _denied(policy.evaluate(request("CREATE"), rule(driver=None), None), "must name one device")


@pytest.mark.parametrize(
    "key",
    [
        "example.com/fatal",
        "gpu-health.dra-gpu-exporter.io.evil.com/fatal",
        "dra-gpu-exporter.io/fatal",
        "fatal",
    ],
)
def test_create_with_a_foreign_taint_key_is_denied(policy: PolicyEvaluator, key: str) -> None:
    _denied(policy.evaluate(request("CREATE"), rule(key=key), None), "gpu-health.dra-gpu-exporter.io/ domain")


@pytest.mark.parametrize("name", ["gpu-node-1-gpu-3", "dra-gpu-exporter", "xdra-gpu-exporter-gpu-node-1"])
def test_create_with_a_foreign_name_is_denied(policy: PolicyEvaluator, name: str) -> None:
    _denied(policy.evaluate(request("CREATE"), rule(name=name), None), "named dra-gpu-exporter-gpu-node-1-*")


def test_create_with_a_wrong_node_label_is_denied(policy: PolicyEvaluator) -> None:
    obj = rule(label_node="gpu-node-2")
    _denied(policy.evaluate(request("CREATE"), obj, None), "dra-gpu-exporter.io/node=gpu-node-1")


def test_token_without_node_claim_is_denied(policy: PolicyEvaluator) -> None:
    # A legacy secret-based token (no pod binding) carries no node name: nothing is allowed.
    _denied(policy.evaluate(request("CREATE", node=None), rule(), None), "no node-name claim")


def test_delete_of_another_nodes_rule_is_denied(policy: PolicyEvaluator) -> None:
    other = rule(node="gpu-node-2")
    _denied(policy.evaluate(request("DELETE"), None, other), "may only taint devices in pool gpu-node-1")


def test_update_taking_over_another_nodes_rule_is_denied(policy: PolicyEvaluator) -> None:
    # Rewriting gpu-node-2's rule to point at our own pool would silently untaint gpu-node-2.
    old = rule(node="gpu-node-2", name="dra-gpu-exporter-shared-name")
    new = rule(node="gpu-node-1", name="dra-gpu-exporter-shared-name")
    _denied(policy.evaluate(request("UPDATE"), new, old), "may only taint devices in pool gpu-node-1")


def test_update_widening_own_rule_to_the_whole_node_is_denied(policy: PolicyEvaluator) -> None:
    old = rule()
    new = rule(device="")
    _denied(policy.evaluate(request("UPDATE"), new, old), "must name one device")


def test_delete_of_a_non_agent_rule_on_own_node_is_denied(policy: PolicyEvaluator) -> None:
    # An admin's own maintenance rule on this node: the agent must leave it alone.
    admin_rule = rule(name="maintenance-gpu-node-1", key="example.com/maintenance")
    decision = policy.evaluate(request("DELETE"), None, admin_rule)
    _denied(decision, "named dra-gpu-exporter-gpu-node-1-*")
    _denied(decision, "gpu-health.dra-gpu-exporter.io/ domain")


# --- bound to the node: names and drivers (issue 16) --------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "dra-gpu-exporter-gpu-node-2-gpu-3-5a0c2d1e00",  # another node's deterministic name
        "dra-gpu-exporter-gpu-node-10-gpu-3-5a0c2d1e00",  # a node whose name starts with ours
        "dra-gpu-exporter-gpu-3-5a0c2d1e00",
    ],
    ids=["other-node", "longer-node-name", "no-node"],
)
def test_create_with_a_cross_node_name_for_own_pool_is_denied(policy: PolicyEvaluator, name: str) -> None:
    # node-b squatting node-a's rule name: node-a's agent would adopt it, be refused and never taint.
    decision = policy.evaluate(request("CREATE"), rule(name=name), None)
    _denied(decision, "named dra-gpu-exporter-gpu-node-1-*")
    assert len(decision.denials) == 1  # the pool, label, driver and key are all fine


def test_the_agents_own_rule_names_are_allowed(policy: PolicyEvaluator) -> None:
    from exporter.k8s import names

    for device in ("gpu-0", "gpu-0-mig-1g.10gb-9-0", "GPU_7"):
        name = names.rule_name("gpu-node-1", "gpu.nvidia.com", "gpu-node-1", device)
        assert policy.evaluate(request("CREATE"), rule(name=name, device=device), None).allowed, name


@pytest.mark.parametrize("driver", ["gpu.amd.com", "gpu.nvidia.com"])
def test_gpu_drivers_are_allowed(policy: PolicyEvaluator, driver: str) -> None:
    assert policy.evaluate(request("CREATE"), rule(driver=driver), None).allowed


@pytest.mark.parametrize("driver", ["compute-domain.nvidia.com", "sriovnetwork.k8snetworkplumbingwg.io", "gpu.nvidia.com.evil"])
def test_non_gpu_drivers_are_denied(policy: PolicyEvaluator, driver: str) -> None:
    # NIC VFs and compute-domain channels share the node's pool name; a GPU agent must not taint them.
    decision = policy.evaluate(request("CREATE"), rule(driver=driver), None)
    _denied(decision, "only taint devices of the GPU drivers gpu.nvidia.com, gpu.amd.com")
    decision = policy.evaluate(request("UPDATE"), rule(), rule(driver=driver))
    _denied(decision, "GPU drivers")


def test_the_driver_list_is_a_chart_value() -> None:
    docs = render_docs({"admissionPolicy": {"gpuDrivers": ["gpu.example.com"]}})
    custom = PolicyEvaluator(_load_policy(TAINTS_POLICY, docs))
    assert custom.evaluate(request("CREATE"), rule(driver="gpu.example.com"), None).allowed
    _denied(custom.evaluate(request("CREATE"), rule(driver="gpu.nvidia.com"), None), "GPU drivers gpu.example.com")


# --- the state and budget ConfigMaps ------------------------------------------------------------

BUDGET = "dra-gpu-exporter-budget"


def configmap(name: str, data: dict[str, str] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "dra-gpu-exporter", "resourceVersion": "7"},
    }
    if data is not None:
        obj["data"] = data
    return obj


CAPACITY = {"max_domains": "0", "fraction": "0.05", "cluster_gpus": "800"}


def test_configmap_samples_are_schema_valid() -> None:
    for obj in (configmap("dra-gpu-exporter-node-gpu-node-1", {"state": "{}"}), configmap(BUDGET, CAPACITY)):
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_own_state_configmap_create_and_update_are_allowed(state_policy: PolicyEvaluator) -> None:
    own = configmap("dra-gpu-exporter-node-gpu-node-1", {"rules": "{}"})
    assert state_policy.evaluate(request("CREATE"), own, None).allowed
    newer = configmap("dra-gpu-exporter-node-gpu-node-1", {"rules": '{"gpu-3": "fatal"}'})
    assert state_policy.evaluate(request("UPDATE"), newer, own).allowed


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
@pytest.mark.parametrize(
    "name", ["dra-gpu-exporter-node-gpu-node-2", "dra-gpu-exporter-node-gpu-node-10", "kube-root-ca.crt", "dra-gpu-exporter-node-"]
)
def test_another_nodes_state_configmap_is_denied(state_policy: PolicyEvaluator, operation: str, name: str) -> None:
    obj = configmap(name, {"rules": "{}"})
    old = copy.deepcopy(obj) if operation == "UPDATE" else None
    _denied(state_policy.evaluate(request(operation), obj, old), "may only write ConfigMap")


def test_state_configmaps_cannot_be_deleted(state_policy: PolicyEvaluator) -> None:
    own = configmap("dra-gpu-exporter-node-gpu-node-1", {})
    _denied(state_policy.evaluate(request("DELETE"), None, own), "may only write ConfigMap")


def test_budget_take_and_release_of_own_entries_are_allowed(state_policy: PolicyEvaluator) -> None:
    before = configmap(BUDGET, {**CAPACITY, "gpu-node-2.GPU-b": "1"})
    taken = configmap(BUDGET, {**CAPACITY, "gpu-node-2.GPU-b": "1", "gpu-node-1.GPU-a": "1"})
    assert state_policy.evaluate(request("UPDATE"), taken, before).allowed
    assert state_policy.evaluate(request("UPDATE"), before, taken).allowed  # released
    # the first entry ever, into a budget created without data
    assert state_policy.evaluate(request("UPDATE"), configmap(BUDGET, {"gpu-node-1.GPU-a": "1"}), configmap(BUDGET)).allowed


@pytest.mark.parametrize(
    "after",
    [
        {**CAPACITY},  # another node's entry released
        {**CAPACITY, "gpu-node-2.GPU-b": "1", "gpu-node-2.GPU-c": "1"},  # taken for another node
        {**CAPACITY, "gpu-node-2.GPU-b": "2"},  # another node's entry rewritten
        {"max_domains": "1000", "fraction": "0.05", "cluster_gpus": "800", "gpu-node-2.GPU-b": "1"},  # capacity raised
        {"gpu-node-2.GPU-b": "1"},  # capacity removed
    ],
    ids=["release-other", "take-for-other", "rewrite-other", "raise-capacity", "drop-capacity"],
)
def test_budget_updates_beyond_own_entries_are_denied(state_policy: PolicyEvaluator, after: dict[str, str]) -> None:
    before = configmap(BUDGET, {**CAPACITY, "gpu-node-2.GPU-b": "1"})
    _denied(state_policy.evaluate(request("UPDATE"), configmap(BUDGET, after), before), "may only change budget entries gpu-node-1.*")


def test_budget_cannot_be_created_or_deleted_by_the_agent(state_policy: PolicyEvaluator) -> None:
    _denied(state_policy.evaluate(request("CREATE"), configmap(BUDGET, CAPACITY), None), "update dra-gpu-exporter-budget")
    _denied(state_policy.evaluate(request("DELETE"), None, configmap(BUDGET, CAPACITY)), "update dra-gpu-exporter-budget")


def test_state_policy_needs_the_node_claim_and_ignores_others(state_policy: PolicyEvaluator) -> None:
    own = configmap("dra-gpu-exporter-node-gpu-node-1", {})
    _denied(state_policy.evaluate(request("CREATE", node=None), own, None), "no node-name claim")
    assert not state_policy.evaluate(request("CREATE", user="kubernetes-admin"), configmap(BUDGET, CAPACITY), None).applies


def test_state_policy_is_scoped_to_the_agents_namespace_and_configmaps() -> None:
    spec = _load_policy(STATE_POLICY)["spec"]
    constraints = spec["matchConstraints"]
    assert constraints["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "dra-gpu-exporter"}}
    (resource_rule,) = constraints["resourceRules"]
    assert resource_rule["resources"] == ["configmaps"] and resource_rule["apiGroups"] == [""]
    assert spec["failurePolicy"] == "Fail"


# --- own-node-events: the Events an agent may create anywhere -----------------------------------
# Built by the agent's own build_event, so the policy is tested on the objects it really sends.

EVENTS_POLICY = "dra-gpu-exporter-own-node-events"


@pytest.fixture(scope="module")
def events_policy() -> PolicyEvaluator:
    return PolicyEvaluator(_load_policy(EVENTS_POLICY))


def event(regarding: dict[str, str], namespace: str = "default", node: str = "gpu-node-1", **override: Any) -> dict[str, Any]:
    from exporter.k8s.events import build_event

    obj = build_event(regarding=regarding, reason="GPUEvictionOverdue", note="still holds gpu-3", action="Observe", type_="Warning",
                      node=node, now=1_750_000_000.0, namespace=namespace)
    obj.update(override)
    return obj


OWN_RULE = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "name": "dra-gpu-exporter-gpu-node-1-gpu-3-1a2b3c4d5e"}
POD = {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "legacy-trainer", "uid": "27cec86c-380a-5d89-95d0-4e757c192236"}


def test_event_samples_are_schema_valid() -> None:
    for obj in (event({"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1"}), event(OWN_RULE), event(POD, namespace="ml")):
        kubernetes_validate.validate(obj, "1.37", strict=True)


@pytest.mark.parametrize(("regarding", "namespace"), [
    ({"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1"}, "default"),
    (OWN_RULE, "default"),
    (POD, "ml"),
], ids=["own-node", "own-rule", "pod-in-its-namespace"])
def test_the_agents_own_events_are_allowed(events_policy: PolicyEvaluator, regarding: dict[str, str], namespace: str) -> None:
    decision = events_policy.evaluate(request("CREATE"), event(regarding, namespace), None)
    assert decision.applies and decision.allowed, decision.denials


@pytest.mark.parametrize(("regarding", "namespace", "override", "fragment"), [
    ({"apiVersion": "v1", "kind": "Node", "name": "gpu-node-2"}, "default", {}, "may only write Events about Node gpu-node-1"),
    ({**OWN_RULE, "name": "dra-gpu-exporter-gpu-node-2-gpu-3-1a2b3c4d5e"}, "default", {}, "may only write Events about"),
    ({**OWN_RULE, "name": "dra-gpu-exporter-gpu-node-10-gpu-3-1a2b3c4d5e"}, "default", {}, "may only write Events about"),
    (POD, "kube-system", {}, "may only write Events about"),  # a pod's Event outside its namespace
    ({"apiVersion": "v1", "kind": "Secret", "namespace": "ml", "name": "token"}, "ml", {}, "may only write Events about"),
    (POD, "ml", {"reportingInstance": "dra-gpu-exporter-gpu-node-2"}, "may only report Events as dra-gpu-exporter-gpu-node-1"),
    (POD, "ml", {"reportingController": "kubelet"}, "may only report Events as"),
], ids=["other-node", "other-nodes-rule", "prefix-node", "pod-elsewhere", "other-kind", "other-instance", "other-controller"])
def test_events_beyond_its_own_are_denied(events_policy: PolicyEvaluator, regarding: dict[str, str], namespace: str,
                                          override: dict[str, str], fragment: str) -> None:
    _denied(events_policy.evaluate(request("CREATE"), event(regarding, namespace, **override), None), fragment)


def test_a_long_node_names_cut_reporting_instance_is_its_own() -> None:
    node = "n" * 200
    policy = PolicyEvaluator(_load_policy(EVENTS_POLICY))
    own = event({"apiVersion": "v1", "kind": "Node", "name": node}, node=node)
    assert len(own["reportingInstance"]) == 128
    assert policy.evaluate(request("CREATE", node=node), own, None).allowed
    other = event({"apiVersion": "v1", "kind": "Node", "name": node}, node=node, reportingInstance="dra-gpu-exporter-" + "n" * 20)
    _denied(policy.evaluate(request("CREATE", node=node), other, None), "may only report Events as")


def test_events_policy_needs_the_node_claim_ignores_others_and_covers_events() -> None:
    policy = PolicyEvaluator(_load_policy(EVENTS_POLICY))
    own = event(POD, namespace="ml")
    _denied(policy.evaluate(request("CREATE", node=None), own, None), "no node-name claim")
    assert not policy.evaluate(request("CREATE", user="system:serviceaccount:kube-system:kube-controller-manager"), own, None).applies
    spec = _load_policy(EVENTS_POLICY)["spec"]
    (resource_rule,) = spec["matchConstraints"]["resourceRules"]
    assert resource_rule["resources"] == ["events"] and resource_rule["apiGroups"] == ["events.k8s.io"]
    assert spec["matchConstraints"]["matchPolicy"] == "Equivalent" and spec["failurePolicy"] == "Fail"
