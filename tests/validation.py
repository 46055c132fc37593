"""Strict schema validation of API objects with the official OpenAPI schemas (kubernetes-validate).

    from validation import StrictValidator  # tests/ is on sys.path

    v = StrictValidator("1.36")
    server.set_validator(v)          # every create/update/patch result is checked, 422 if invalid
    ...
    assert v.failures == []          # what the server rejected (kept even if the client swallowed it)
    assert ("resource.k8s.io/v1beta2", "DeviceTaintRule") in v.validated

``strict`` means additionalProperties=false everywhere: a misspelt or invented field fails, not
only a wrong type. A kind kubernetes-validate has no schema for is a *failure* (``SchemaNotFound``),
never a silent pass, so a test cannot believe it validated something it did not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import kubernetes_validate


@dataclass
class Rejection:
    api_version: str
    kind: str
    name: str
    message: str
    path: str = ""


@dataclass
class StrictValidator:
    """A ``FakeApiServer.set_validator`` hook for one Kubernetes release ("1.33" ... "1.37")."""

    kubernetes_version: str
    validated: list[tuple[str, str]] = field(default_factory=list)  # (apiVersion, kind) that passed
    failures: list[Rejection] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, api_version: str, kind: str, body: dict[str, Any]) -> None:
        obj = {**body, "apiVersion": api_version, "kind": kind}
        name = str((body.get("metadata") or {}).get("name", ""))
        try:
            validate_strict(obj, self.kubernetes_version)
        except kubernetes_validate.ValidationError as e:
            with self._lock:
                self.failures.append(Rejection(api_version, kind, name, e.message, ".".join(str(p) for p in e.path)))
            raise
        except kubernetes_validate.SchemaNotFoundError as e:
            with self._lock:
                self.failures.append(Rejection(api_version, kind, name, e.message))
            raise
        with self._lock:
            self.validated.append((api_version, kind))

    def kinds(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self.validated)


def validate_strict(obj: dict[str, Any], kubernetes_version: str) -> None:
    """Raise kubernetes_validate.ValidationError / SchemaNotFoundError unless ``obj`` is valid."""
    kubernetes_validate.validate(obj, kubernetes_version, strict=True)


def has_schema(kubernetes_version: str, api_version: str, kind: str) -> bool:
    """Whether kubernetes-validate ships a schema for this kind at this release."""
    try:
        kubernetes_validate.validate({"apiVersion": api_version, "kind": kind}, kubernetes_version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except kubernetes_validate.ValidationError:
        return True  # the schema exists; our stub object just is not valid against it
    return True
