"""The ValidatingAdmissionPolicy in daemonset.yaml, evaluated by a real CEL interpreter.

There is no kube-apiserver here, so the policy's own expressions (matchConditions, variables,
validations, messageExpressions) are compiled and run by cel-python against admission requests
shaped like the apiserver's (request.operation, request.userInfo with the node-name extra from a
pod-bound service-account token, object, oldObject). Evaluation follows the apiserver's rules:
variables are evaluated in order and visible as ``variables.<name>``; a policy applies only when all
matchConditions are true; any false validation denies; an evaluation error denies because the
policy's failurePolicy is Fail.

The sample DeviceTaintRules are themselves validated against the official schemas of every
DeviceTaintRule version, so the objects the policy is tested on are objects the apiserver accepts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

celpy = pytest.importorskip("celpy", reason="cel-python (test extra) is needed to evaluate CEL")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parent.parent
AGENT_USER = "system:serviceaccount:dra-gpu-exporter:dra-gpu-exporter"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
# DeviceTaintRule versions and the first release whose schema has them in the shape we use
# (v1alpha3 dropped deviceClassName/selectors in 1.35).
RULE_VERSIONS = {"v1alpha3": "1.35", "v1beta2": "1.36", "v1": "1.37"}


def _load_policy() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 1, "daemonset.yaml must hold exactly one ValidatingAdmissionPolicy"
    return policies[0]


@dataclass
class Decision:
    applies: bool
    denials: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.denials


class PolicyEvaluator:
    """Runs one ValidatingAdmissionPolicy's CEL the way the apiserver does (see module doc)."""

    def __init__(self, policy: dict[str, Any]) -> None:
        env = celpy.Environment()
        spec = policy["spec"]
        self.fail_closed = spec.get("failurePolicy", "Fail") == "Fail"
        self.match_conditions = [
            (m["name"], env.program(env.compile(m["expression"])))
            for m in spec.get("matchConditions", [])
        ]
        self.variables = [
            (v["name"], env.program(env.compile(v["expression"]))) for v in spec.get("variables", [])
        ]
        self.validations = []
        for v in spec["validations"]:
            message_program = (
                env.program(env.compile(v["messageExpression"])) if "messageExpression" in v else None
            )
            self.validations.append(
                (v["expression"], env.program(env.compile(v["expression"])), v.get("message"), message_program)
            )

    def evaluate(self, request: dict[str, Any], obj: dict[str, Any] | None, old: dict[str, Any] | None) -> Decision:
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request),
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
        }
        for _name, program in self.match_conditions:
            if not bool(program.evaluate(activation)):
                return Decision(applies=False)
        variables: dict[str, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celpy.celtypes.MapType(
                {celpy.celtypes.StringType(k): v for k, v in variables.items()}
            )
            variables[name] = program.evaluate(activation)
        activation["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        decision = Decision(applies=True)
        for source, program, message, message_program in self.validations:
            try:
                ok = program.evaluate(activation)
            except celpy.CELEvalError as exc:
                if self.fail_closed:
                    decision.denials.append(f"error evaluating {source!r}: {exc}")
                continue
            if isinstance(ok, celpy.CELEvalError):
                decision.denials.append(f"error evaluating {source!r}: {ok}")
                continue
            if not bool(ok):
                text = message or source
                if message_program is not None:
                    text = str(message_program.evaluate(activation))
                decision.denials.append(text)
        return decision


@pytest.fixture(scope="module")
def policy() -> PolicyEvaluator:
    return PolicyEvaluator(_load_policy())


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
    extra: dict[str, list[str]] = {
        "authentication.kubernetes.io/pod-name": ["dra-gpu-exporter-abcde"],
        "authentication.kubernetes.io/pod-uid": ["0f3c1d9e-1111-4222-8333-444455556666"],
    }
    if node is not None:
        extra[NODE_CLAIM] = [node]
    return {
        "operation": operation,
        "userInfo": {
            "username": user,
            "uid": "6a3f0c2e-aaaa-4bbb-8ccc-ddddeeeeffff",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:dra-gpu-exporter", "system:authenticated"],
            "extra": extra,
        },
    }


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
    _denied(policy.evaluate(request("CREATE"), rule(name=name), None), "named dra-gpu-exporter-*")


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
    _denied(decision, "named dra-gpu-exporter-*")
    _denied(decision, "gpu-health.dra-gpu-exporter.io/ domain")
