"""A ValidatingAdmissionPolicy's CEL, run by a real CEL interpreter (cel-python).

There is no kube-apiserver here, so the policy's own expressions (matchConditions, variables,
validations, messageExpressions) are compiled and run against admission requests shaped like the
apiserver's (request.operation, request.userInfo with the node-name extra of a pod-bound
service-account token, object, oldObject). Evaluation follows the apiserver's rules: variables are
evaluated in order and visible as ``variables.<name>``; a policy applies only when all
matchConditions are true; any false validation denies; an evaluation error denies when the
policy's failurePolicy is Fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import celpy

NODE_CLAIM = "authentication.kubernetes.io/node-name"
# The kinds a policy's resourceRules name (resource -> kind) for the ones our policies use.
_KINDS = {"devicetaintrules": "DeviceTaintRule", "configmaps": "ConfigMap", "events": "Event"}


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
        self.name = policy["metadata"]["name"]
        self.kinds = {_KINDS[r] for rule in spec["matchConstraints"]["resourceRules"] for r in rule["resources"]}
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

    def matches_kind(self, kind: str) -> bool:
        return kind in self.kinds

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


def agent_request(operation: str, node: str | None, user: str) -> dict[str, Any]:
    """An admission request's ``request`` from an agent pod's bound token on ``node``."""
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
