"""Per-resource defaulting and validation, modelled on kube-apiserver's registry strategies.

Only rules the agent can trip over are emulated: object names and labels, the ResourceSlice
invariants, DeviceTaintRule effects per release (effect None is 1.35+) and timeAdded stamping,
and the events.k8s.io/v1 Event rules. Functions work on the storage (v1) shape and return a
list of causes; an empty list means valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .apiserver_catalog import ResourceType

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CAMEL_CASE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True)
class Cause:
    field: str
    reason: str  # FieldValueRequired, FieldValueInvalid, FieldValueNotSupported, ...
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}


def now_rfc3339(micro: bool = False) -> str:
    now = datetime.now(UTC)
    if micro:
        return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def _required(field: str) -> Cause:
    return Cause(field, "FieldValueRequired", f"{field}: Required value")


def _invalid(field: str, value: Any, detail: str) -> Cause:
    return Cause(field, "FieldValueInvalid", f"{field}: Invalid value: {value!r}: {detail}")


def _unsupported(field: str, value: Any, supported: list[str]) -> Cause:
    listed = ", ".join(f'"{s}"' for s in supported)
    return Cause(field, "FieldValueNotSupported",
                 f'{field}: Unsupported value: "{value}": supported values: {listed}')


def _qualified_name_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def validate_metadata(rt: ResourceType, obj: dict[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    if not name:
        causes.append(Cause("metadata.name", "FieldValueRequired",
                            "metadata.name: Required value: name or generateName is required"))
    else:
        pattern = _DNS_LABEL if rt.resource == "namespaces" else _DNS_SUBDOMAIN
        if len(name) > 253 or not pattern.match(name):
            causes.append(_invalid("metadata.name", name,
                                   "a lowercase RFC 1123 subdomain must consist of lower case "
                                   "alphanumeric characters, '-' or '.'"))
    for key, value in (meta.get("labels") or {}).items():
        if not _qualified_name_ok(str(key)):
            causes.append(_invalid("metadata.labels", key, "name part must consist of alphanumeric characters"))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(_invalid("metadata.labels", value, "a valid label must be an empty string "
                                   "or consist of alphanumeric characters, '-', '_' or '.'"))
    for key in (meta.get("annotations") or {}):
        if not _qualified_name_ok(str(key)):
            causes.append(_invalid("metadata.annotations", key, "name part must consist of alphanumeric characters"))
    return causes


# ---------------------------------------------------------------- resource.k8s.io


def taint_effects(release: int) -> list[str]:
    return ["NoExecute", "NoSchedule", "None"] if release >= 35 else ["NoExecute", "NoSchedule"]


def _validate_taint(taint: Any, field: str, release: int) -> list[Cause]:
    if not isinstance(taint, dict):
        return [_required(field)]
    causes: list[Cause] = []
    key = taint.get("key") or ""
    if not key:
        causes.append(_required(f"{field}.key"))
    elif not _qualified_name_ok(key):
        causes.append(_invalid(f"{field}.key", key, "name part must consist of alphanumeric characters"))
    effect = taint.get("effect") or ""
    if not effect:
        causes.append(_required(f"{field}.effect"))
    elif effect not in taint_effects(release):
        causes.append(_unsupported(f"{field}.effect", effect, taint_effects(release)))
    return causes


def _validate_resource_slice(obj: dict[str, Any], release: int) -> list[Cause]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [_required("spec")]
    causes: list[Cause] = []
    if not spec.get("driver"):
        causes.append(_required("spec.driver"))
    raw_pool = spec.get("pool")
    pool = raw_pool if isinstance(raw_pool, dict) else {}
    if not pool.get("name"):
        causes.append(_required("spec.pool.name"))
    if int(pool.get("resourceSliceCount") or 0) <= 0:
        causes.append(_invalid("spec.pool.resourceSliceCount", pool.get("resourceSliceCount", 0),
                               "must be greater than zero"))
    choices = [bool(spec.get("nodeName")), spec.get("nodeSelector") is not None,
               bool(spec.get("allNodes")), bool(spec.get("perDeviceNodeSelection"))]
    if sum(choices) != 1:
        causes.append(Cause("spec", "FieldValueInvalid" if sum(choices) else "FieldValueRequired",
                            "spec: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                            "`perDeviceNodeSelection` is required"))
    devices = spec.get("devices") or []
    if len(devices) > 128:
        causes.append(Cause("spec.devices", "FieldValueTooMany",
                            f"spec.devices: Too many: {len(devices)}: must have at most 128 items"))
    seen: set[str] = set()
    max_taints = 16 if release >= 35 else 4
    for i, dev in enumerate(devices):
        field = f"spec.devices[{i}]"
        name = dev.get("name") if isinstance(dev, dict) else None
        if not name:
            causes.append(_required(f"{field}.name"))
            continue
        if not _DNS_LABEL.match(name) or len(name) > 63:
            causes.append(_invalid(f"{field}.name", name, "a lowercase RFC 1123 label"))
        if name in seen:
            causes.append(Cause(f"{field}.name", "FieldValueDuplicate", f"{field}.name: Duplicate value: {name!r}"))
        seen.add(name)
        taints = dev.get("taints") or []
        if len(taints) > max_taints:
            causes.append(Cause(f"{field}.taints", "FieldValueTooMany",
                                f"{field}.taints: Too many: {len(taints)}: must have at most {max_taints} items"))
        for j, taint in enumerate(taints):
            causes += _validate_taint(taint, f"{field}.taints[{j}]", release)
    return causes


def _validate_device_taint_rule(obj: dict[str, Any], release: int) -> list[Cause]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [_required("spec")]
    return _validate_taint(spec.get("taint"), "spec.taint", release)


def _validate_resource_claim(obj: dict[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    requests = ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []
    names: set[str] = set()
    for i, req in enumerate(requests):
        field = f"spec.devices.requests[{i}]"
        if not isinstance(req, dict) or not req.get("name"):
            causes.append(_required(f"{field}.name"))
            continue
        if req["name"] in names:
            causes.append(Cause(f"{field}.name", "FieldValueDuplicate", f"{field}.name: Duplicate value"))
        names.add(req["name"])
        if ("exactly" in req) == ("firstAvailable" in req):
            causes.append(Cause(field, "FieldValueRequired",
                                f"{field}: exactly one of `exactly` or `firstAvailable` is required"))
    return causes


# ---------------------------------------------------------------- events.k8s.io/v1

_EVENT_IMMUTABLE = ("reason", "note", "type", "action", "reportingController",
                    "reportingInstance", "regarding", "related", "eventTime")


def _validate_v1_event(obj: dict[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    if not obj.get("eventTime"):
        causes.append(_required("eventTime"))
    controller = obj.get("reportingController") or ""
    if not controller:
        causes.append(_required("reportingController"))
    elif not _qualified_name_ok(controller):
        causes.append(_invalid("reportingController", controller, "must be a qualified name"))
    instance = obj.get("reportingInstance") or ""
    if not instance:
        causes.append(_required("reportingInstance"))
    elif len(instance) > 128:
        causes.append(_invalid("reportingInstance", instance, "can have at most 128 characters"))
    for field in ("action", "reason"):
        value = obj.get(field) or ""
        if not value:
            causes.append(_required(field))
        elif len(value) > 128:
            causes.append(_invalid(field, value, "can have at most 128 characters"))
    if len(obj.get("note") or "") > 1024:
        causes.append(_invalid("note", "...", "can have at most 1024 characters"))
    if obj.get("type") not in ("Normal", "Warning"):
        causes.append(_unsupported("type", obj.get("type") or "", ["Normal", "Warning"]))
    series = obj.get("series")
    if series is not None and int((series or {}).get("count") or 0) < 2:
        causes.append(_invalid("series.count", (series or {}).get("count"), "should be at least 2"))
    namespace = (obj.get("metadata") or {}).get("namespace") or ""
    regarding_ns = (obj.get("regarding") or {}).get("namespace") or ""
    if regarding_ns and regarding_ns != namespace:
        causes.append(_invalid("metadata.namespace", namespace, "does not match regarding.namespace"))
    if not regarding_ns and namespace not in ("default", "kube-system"):
        causes.append(_invalid("metadata.namespace", namespace,
                               "events about cluster-scoped objects go to 'default' (or 'kube-system')"))
    return causes


# ---------------------------------------------------------------- entry points


def prepare(rt: ResourceType, release: int, new: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Server-side defaulting, in place, on the storage shape (PrepareForCreate/Update)."""
    if rt.group == "resource.k8s.io" and rt.resource == "devicetaintrules":
        taint = (new.get("spec") or {}).get("taint")
        if isinstance(taint, dict):
            old_taint = ((old or {}).get("spec") or {}).get("taint") or {}
            stamp = taint.get("timeAdded")
            # The apiserver stamps timeAdded when unset, and re-stamps it when an update flips
            # the effect but carries the old stamp (the dry-run None -> NoExecute pattern).
            if old is not None and old_taint.get("effect") != taint.get("effect"):
                if not stamp or stamp == old_taint.get("timeAdded"):
                    stamp = now_rfc3339()
            elif not stamp:
                stamp = old_taint.get("timeAdded") or now_rfc3339()
            taint["timeAdded"] = stamp


def validate(rt: ResourceType, release: int, new: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    causes = validate_metadata(rt, new)
    if rt.group == "resource.k8s.io":
        if rt.resource == "resourceslices":
            causes += _validate_resource_slice(new, release)
        elif rt.resource == "devicetaintrules":
            causes += _validate_device_taint_rule(new, release)
        elif rt.resource == "resourceclaims":
            causes += _validate_resource_claim(new)
    elif rt.group == "events.k8s.io" and rt.resource == "events":
        causes += _validate_v1_event(new)
        if old is not None:
            for field in _EVENT_IMMUTABLE:
                if new.get(field) != old.get(field):
                    causes.append(Cause(field, "FieldValueInvalid", f"{field}: Invalid value: field is immutable"))
    return causes


def allows_unconditional_update(rt: ResourceType, version: str) -> bool:
    """Whether a PUT without ``metadata.resourceVersion`` is accepted (the strategy's
    AllowUnconditionalUpdate). Built-in resources allow it, except DeviceTaintRule in
    resource.k8s.io/v1 (Kubernetes 1.37, kubernetes/kubernetes#138676: the v1 strategy returns
    false; the older versions keep their historic true)."""
    return not (rt.key == ("resource.k8s.io", "devicetaintrules") and version == "v1")
