"""Version-independent parsers for resource.k8s.io objects and pods (pure functions).

The agent reads raw JSON rather than the ``kubernetes`` package's models: the served version
may be v1, v1beta2, v1beta1 or v1alpha3, and newer servers add fields the models of an older
client would reject. Only the fields the agent needs are read; everything else is ignored, so
future fields never break parsing.

Shape differences handled here:

* v1 and v1beta2 put ``attributes``/``capacity`` directly on each device; v1beta1 and v1alpha3
  nest them under ``device.basic``.
* Attribute names without a domain belong to the driver's domain and are qualified with it
  (``uuid`` from ``gpu.nvidia.com`` becomes ``gpu.nvidia.com/uuid``).
* Attribute values: ``int``, ``bool``, ``string`` and ``version`` become Python scalars
  (version -> str). The list types added in 1.36 (``ints``, ``bools``, ``strings``,
  ``versions``, alpha ``DRAListTypeAttributes``) are joined into one comma-separated string
  (bools as ``true``/``false``), because the model's values are scalars and nothing the agent
  resolves on is a list; keeping them visible beats dropping them. An attribute with no known
  value field (a type from a future release) is skipped.

Every problem with the input -- a missing key, a wrong type -- raises :class:`ParseError` and
nothing else, so the watcher can log the object, count it and carry on.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .model import (
    AllocatedDevice,
    AttributeValue,
    ClaimInfo,
    DeviceTaint,
    DeviceToleration,
    OwnerRef,
    PodInfo,
    ReportedHealth,
    SliceDevice,
)

T = TypeVar("T")

__all__ = [
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "NESTED_DEVICE_VERSIONS",
    "ParseError",
    "ParsedSlice",
    "parse_attribute",
    "parse_claim",
    "parse_pod",
    "parse_slice",
    "parse_slice_full",
    "qualify",
    "quantity_value",
    "version_of",
]

#: the annotation the scheduler puts on the claim it generates for a pod's DRA-backed extended
#: resources (KEP-5004; ``resourceapi.ExtendedResourceClaimAnnotation``)
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"

#: versions whose Device nests attributes and capacity under ``basic``
NESTED_DEVICE_VERSIONS = frozenset({"v1beta1", "v1alpha3"})

_LIST_FIELDS = ("ints", "bools", "strings", "versions")


class ParseError(ValueError):
    """The object does not have the shape the agent needs. The message says where and why."""


@dataclass(frozen=True)
class ParsedSlice:
    """One ResourceSlice: the pool bookkeeping the watcher needs plus its devices."""

    name: str
    driver: str
    pool: str
    pool_generation: int
    resource_slice_count: int
    node_name: str
    resource_version: str
    devices: tuple[SliceDevice, ...]


# --------------------------------------------------------------------------- small readers


def _dict(value: Any, where: str, *, required: bool = True) -> dict[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise ParseError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    # a list field that is absent or null is simply empty (omitempty in the Go types)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ParseError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _str(value: Any, where: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ParseError(f"{where}: expected a string, got {type(value).__name__}")
    if required and not value:
        raise ParseError(f"{where}: must not be empty")
    return value


def _int(value: Any, where: str, default: int = 0) -> int:
    if value is None:
        return default
    # bool is an int subclass in Python but never a valid int64 in the API
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParseError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _bool(value: Any, where: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ParseError(f"{where}: expected a boolean, got {type(value).__name__}")
    return value


def _time(value: Any, where: str) -> float | None:
    """An RFC 3339 timestamp (metav1.Time) as unix seconds; None when absent."""
    if value is None:
        return None
    text = _str(value, where)
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ParseError(f"{where}: expected an RFC 3339 time, got {text[:40]!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def _tolerations(value: Any, where: str) -> tuple[DeviceToleration, ...]:
    out = []
    for i, raw in enumerate(_list(value, where)):
        twhere = f"{where}[{i}]"
        t = _dict(raw, twhere)
        seconds = t.get("tolerationSeconds")
        out.append(DeviceToleration(
            key=_str(t.get("key"), f"{twhere}.key", required=False),
            operator=_str(t.get("operator"), f"{twhere}.operator", required=False) or "Equal",
            value=_str(t.get("value"), f"{twhere}.value", required=False),
            effect=_str(t.get("effect"), f"{twhere}.effect", required=False),
            seconds=None if seconds is None else _int(seconds, f"{twhere}.tolerationSeconds"),
        ))
    return tuple(out)


def _taints(value: Any, where: str) -> tuple[DeviceTaint, ...]:
    out = []
    for i, raw in enumerate(_list(value, where)):
        t = _dict(raw, f"{where}[{i}]")
        out.append(DeviceTaint(_str(t.get("key"), f"{where}[{i}].key"),
                               _str(t.get("value"), f"{where}[{i}].value", required=False),
                               _str(t.get("effect"), f"{where}[{i}].effect")))
    return tuple(out)


def _only_parse_errors(kind: str, parse: Callable[..., T], *args: Any) -> T:
    """Run a parser; anything but ParseError becomes one (belt and braces: callers catch only
    ParseError, and a surprise in outside input must not kill a watcher)."""
    try:
        return parse(*args)
    except ParseError:
        raise
    except Exception as exc:
        raise ParseError(f"{kind}: unexpected {type(exc).__name__}: {exc}") from exc


def _namespaced_meta(obj: Any, kind: str) -> tuple[dict[str, Any], str, str, str, str]:
    """(object, name, namespace, uid, where) of a namespaced object; ``where`` prefixes
    messages about it, e.g. "pod ml/trainer"."""
    obj = _dict(obj, kind)
    meta = _dict(obj.get("metadata"), f"{kind}.metadata")
    name = _str(meta.get("name"), f"{kind}.metadata.name")
    namespace = _str(meta.get("namespace"), f"{kind} {name}: metadata.namespace")
    where = f"{kind} {namespace}/{name}"
    uid = _str(meta.get("uid"), f"{where}: metadata.uid", required=False)
    return obj, name, namespace, uid, where


def version_of(obj: Any, api_version: str) -> str:
    """The bare version (``v1``, ``v1beta1`` ...) to interpret ``obj`` with.

    Watch events and single GETs carry ``apiVersion``; items of a list usually do not, so the
    version the caller requested is the fallback.
    """
    declared = obj.get("apiVersion") if isinstance(obj, dict) else None
    chosen = declared if isinstance(declared, str) and declared else (api_version or "")
    return chosen.rsplit("/", 1)[-1]


def qualify(name: str, driver: str) -> str:
    """A name without a domain belongs to the driver's domain (resource.k8s.io QualifiedName)."""
    return name if "/" in name else f"{driver}/{name}"


def parse_attribute(value: Any, where: str) -> AttributeValue | None:
    """One DeviceAttribute -> scalar; ``None`` for a value type this agent does not know."""
    value = _dict(value, where)
    if "int" in value and value["int"] is not None:
        return _int(value["int"], f"{where}.int")
    if "bool" in value and value["bool"] is not None:
        return _bool(value["bool"], f"{where}.bool")
    if "string" in value and value["string"] is not None:
        return _str(value["string"], f"{where}.string", required=False)
    if "version" in value and value["version"] is not None:
        return _str(value["version"], f"{where}.version", required=False)
    for list_field in _LIST_FIELDS:
        items = value.get(list_field)
        if items is None:
            continue
        parts = []
        for i, item in enumerate(_list(items, f"{where}.{list_field}")):
            item_where = f"{where}.{list_field}[{i}]"
            if list_field == "ints":
                parts.append(str(_int(item, item_where)))
            elif list_field == "bools":
                parts.append("true" if _bool(item, item_where) else "false")
            else:
                parts.append(_str(item, item_where, required=False))
        return ",".join(parts)
    return None


def _quantity(value: Any, where: str) -> str:
    # DeviceCapacity is {"value": Quantity}; Quantity serialises as a string, but a number in
    # hand-written JSON means the same thing, so accept it.
    value = _dict(value, where)
    q = value.get("value")
    if isinstance(q, str) and q:
        return q
    if isinstance(q, (int, float)) and not isinstance(q, bool):
        return str(q)
    raise ParseError(f"{where}.value: expected a quantity string, got {type(q).__name__}")


def quantity_value(text: str) -> float | None:
    """A resource.Quantity string ("20Gi", "1500m", "1e3") as a number; None when it is not one."""
    # The kubernetes client's parser, imported here: a claim with a consumed capacity is only
    # parsed on an agent that talks to the API server, so the client is loaded already.
    from kubernetes.utils.quantity import parse_quantity

    try:
        value = float(parse_quantity(text.strip()))  # type: ignore[no-untyped-call]
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # it takes "Infinity" and "NaN", which no Quantity is


# --------------------------------------------------------------------------- ResourceSlice


def parse_slice_full(obj: Any, api_version: str) -> ParsedSlice:
    """Parse a ResourceSlice of any served version. Raises :class:`ParseError` only."""
    return _only_parse_errors("resourceslice", _parse_slice, obj, api_version)


def parse_slice(obj: Any, api_version: str) -> list[SliceDevice]:
    """The devices of one ResourceSlice (see :func:`parse_slice_full`)."""
    return list(parse_slice_full(obj, api_version).devices)


def _parse_slice(obj: Any, api_version: str) -> ParsedSlice:
    obj = _dict(obj, "resourceslice")
    meta = _dict(obj.get("metadata"), "resourceslice.metadata")
    slice_name = _str(meta.get("name"), "resourceslice.metadata.name")
    where = f"resourceslice {slice_name}"
    rv = _str(meta.get("resourceVersion"), f"{where}: metadata.resourceVersion", required=False)
    spec = _dict(obj.get("spec"), f"{where}: spec")
    driver = _str(spec.get("driver"), f"{where}: spec.driver")
    pool = _dict(spec.get("pool"), f"{where}: spec.pool")
    pool_name = _str(pool.get("name"), f"{where}: spec.pool.name")
    generation = _int(pool.get("generation"), f"{where}: spec.pool.generation")
    slice_count = _int(pool.get("resourceSliceCount"), f"{where}: spec.pool.resourceSliceCount", 1)
    node_name = _str(spec.get("nodeName"), f"{where}: spec.nodeName", required=False)
    nested = version_of(obj, api_version) in NESTED_DEVICE_VERSIONS

    devices: list[SliceDevice] = []
    seen: set[str] = set()
    for i, dev in enumerate(_list(spec.get("devices"), f"{where}: spec.devices")):
        dwhere = f"{where}: spec.devices[{i}]"
        dev = _dict(dev, dwhere)
        name = _str(dev.get("name"), f"{dwhere}.name")
        if name in seen:
            raise ParseError(f"{dwhere}: duplicate device name {name!r}")
        seen.add(name)
        body = dev
        if nested or ("basic" in dev and "attributes" not in dev and "capacity" not in dev):
            # v1beta1 shape; also accepted on a flat version so a mislabelled object still parses
            body = _dict(dev.get("basic"), f"{dwhere}.basic", required=False)
        attributes: dict[str, AttributeValue] = {}
        for aname, aval in _dict(body.get("attributes"), f"{dwhere}.attributes", required=False).items():
            parsed = parse_attribute(aval, f"{dwhere}.attributes[{aname}]")
            if parsed is not None:
                attributes[qualify(str(aname), driver)] = parsed
        capacity: dict[str, str] = {}
        for cname, cval in _dict(body.get("capacity"), f"{dwhere}.capacity", required=False).items():
            capacity[qualify(str(cname), driver)] = _quantity(cval, f"{dwhere}.capacity[{cname}]")
        devices.append(
            SliceDevice(
                driver=driver,
                pool=pool_name,
                name=name,
                attributes=attributes,
                capacity=capacity,
                slice_name=slice_name,
                pool_generation=generation,
                # (under basic in v1beta1, like attributes and capacity)
                multiple=_bool(body.get("allowMultipleAllocations"), f"{dwhere}.allowMultipleAllocations"),
                # v1 and v1beta2: on the device; v1beta1: under basic, with the attributes
                taints=_taints(body.get("taints"), f"{dwhere}.taints"),
            )
        )
    return ParsedSlice(
        name=slice_name,
        driver=driver,
        pool=pool_name,
        pool_generation=generation,
        resource_slice_count=slice_count,
        node_name=node_name,
        resource_version=rv,
        devices=tuple(devices),
    )


# --------------------------------------------------------------------------- ResourceClaim


def parse_claim(obj: Any, api_version: str) -> ClaimInfo:
    """Parse a ResourceClaim of any served version. Raises :class:`ParseError` only.

    The allocation results are joined with ``status.devices[]`` on (driver, pool, device,
    shareID) -- the list-map key of AllocatedDeviceStatus -- to attach the driver's ``data``.
    The result shape is the same in every version, so ``api_version`` only matters for
    messages; it is accepted for symmetry with :func:`parse_slice`.
    """
    return _only_parse_errors("resourceclaim", _parse_claim, obj)


def _parse_claim(obj: Any) -> ClaimInfo:
    obj, name, namespace, uid, where = _namespaced_meta(obj, "resourceclaim")
    status = _dict(obj.get("status"), f"{where}: status", required=False)

    data_by_key: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for i, st in enumerate(_list(status.get("devices"), f"{where}: status.devices")):
        swhere = f"{where}: status.devices[{i}]"
        st = _dict(st, swhere)
        key = (
            _str(st.get("driver"), f"{swhere}.driver"),
            _str(st.get("pool"), f"{swhere}.pool"),
            _str(st.get("device"), f"{swhere}.device"),
            _str(st.get("shareID"), f"{swhere}.shareID", required=False),
        )
        data = st.get("data")
        # data is a RawExtension: any JSON. Only an object can carry named facts like a uuid.
        data_by_key[key] = data if isinstance(data, dict) else {}

    allocation = _dict(status.get("allocation"), f"{where}: status.allocation", required=False)
    alloc_devices = _dict(allocation.get("devices"), f"{where}: status.allocation.devices", required=False)
    devices: list[AllocatedDevice] = []
    for i, res in enumerate(_list(alloc_devices.get("results"), f"{where}: status.allocation.devices.results")):
        rwhere = f"{where}: status.allocation.devices.results[{i}]"
        res = _dict(res, rwhere)
        driver = _str(res.get("driver"), f"{rwhere}.driver")
        pool = _str(res.get("pool"), f"{rwhere}.pool")
        device = _str(res.get("device"), f"{rwhere}.device")
        share_id = _str(res.get("shareID"), f"{rwhere}.shareID", required=False)
        consumed: dict[str, float] = {}
        for cname, q in _dict(res.get("consumedCapacity"), f"{rwhere}.consumedCapacity", required=False).items():
            amount = quantity_value(q) if isinstance(q, str) else None
            if amount is None:
                raise ParseError(f"{rwhere}.consumedCapacity[{cname}]: expected a quantity, got {str(q)[:40]!r}")
            consumed[qualify(str(cname), driver)] = amount
        devices.append(
            AllocatedDevice(
                request=_str(res.get("request"), f"{rwhere}.request", required=False),
                driver=driver,
                pool=pool,
                device=device,
                share_id=share_id,
                admin_access=_bool(res.get("adminAccess"), f"{rwhere}.adminAccess"),
                data=data_by_key.get((driver, pool, device, share_id), {}),
                tolerations=_tolerations(res.get("tolerations"), f"{rwhere}.tolerations"),
                consumed=consumed,
            )
        )

    reserved: list[str] = []
    for i, ref in enumerate(_list(status.get("reservedFor"), f"{where}: status.reservedFor")):
        fwhere = f"{where}: status.reservedFor[{i}]"
        ref = _dict(ref, fwhere)
        group = _str(ref.get("apiGroup"), f"{fwhere}.apiGroup", required=False)
        resource = _str(ref.get("resource"), f"{fwhere}.resource", required=False)
        ref_name = _str(ref.get("name"), f"{fwhere}.name", required=False)
        # only core pods interest the agent; other consumers (e.g. a controller) are skipped
        if group == "" and resource == "pods" and ref_name:
            reserved.append(ref_name)

    annotations = _dict(obj["metadata"].get("annotations"), f"{where}: metadata.annotations", required=False)
    return ClaimInfo(
        namespace=namespace,
        name=name,
        uid=uid,
        devices=tuple(devices),
        reserved_for=tuple(reserved),
        extended=annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) == "true",
    )


# --------------------------------------------------------------------------- Pod


def parse_pod(obj: Any, *, reported: bool = False) -> PodInfo:
    """Parse a core/v1 Pod. Raises :class:`ParseError` only.

    ``claims`` are the names of the ResourceClaims the pod holds in its namespace: direct
    references from ``spec.resourceClaims[].resourceClaimName``, generated names from
    ``status.resourceClaimStatuses[].resourceClaimName`` (template claims; null until the claim
    exists) and the DRA extended-resource claim from ``status.extendedResourceClaimStatus``
    (also kept on its own, ``extended_claim``: NoExecute does not evict a pod for that claim's
    devices, kubernetes/kubernetes#141290). The controller, creation and deletion times serve the
    remediator's account of pods that outstay a NoExecute taint. ``reported``: also the kubelet's
    device health (``--kubelet-device-health``; otherwise that part of the status is not read).
    """
    return _only_parse_errors("pod", _parse_pod, obj, reported)


def _parse_pod(obj: Any, reported: bool = False) -> PodInfo:
    obj, name, namespace, uid, where = _namespaced_meta(obj, "pod")
    spec = _dict(obj.get("spec"), f"{where}: spec", required=False)
    status = _dict(obj.get("status"), f"{where}: status", required=False)
    node_name = _str(spec.get("nodeName"), f"{where}: spec.nodeName", required=False)
    phase = _str(status.get("phase"), f"{where}: status.phase", required=False)

    claims: list[str] = []
    named: dict[str, str] = {}  # the pod's name for a claim (spec.resourceClaims[].name) -> the claim's

    def add(claim: Any, at: str, ref: Any = None) -> None:
        claim_name = _str(claim, at, required=False)
        if claim_name and claim_name not in claims:
            claims.append(claim_name)
        if claim_name and isinstance(ref, str):
            named[ref] = claim_name

    for i, rc in enumerate(_list(spec.get("resourceClaims"), f"{where}: spec.resourceClaims")):
        rc = _dict(rc, f"{where}: spec.resourceClaims[{i}]")
        add(rc.get("resourceClaimName"), f"{where}: spec.resourceClaims[{i}].resourceClaimName", rc.get("name"))
    for i, rcs in enumerate(_list(status.get("resourceClaimStatuses"), f"{where}: status.resourceClaimStatuses")):
        at = f"{where}: status.resourceClaimStatuses[{i}]"
        rcs = _dict(rcs, at)
        add(rcs.get("resourceClaimName"), f"{at}.resourceClaimName", rcs.get("name"))
    ext = _dict(status.get("extendedResourceClaimStatus"), f"{where}: status.extendedResourceClaimStatus",
                required=False)
    extended = _str(ext.get("resourceClaimName"), f"{where}: status.extendedResourceClaimStatus.resourceClaimName",
                    required=False)
    add(extended, f"{where}: status.extendedResourceClaimStatus.resourceClaimName")

    meta = obj["metadata"]
    controller = None
    for i, ref in enumerate(_list(meta.get("ownerReferences"), f"{where}: metadata.ownerReferences")):
        rwhere = f"{where}: metadata.ownerReferences[{i}]"
        ref = _dict(ref, rwhere)
        if _bool(ref.get("controller"), f"{rwhere}.controller"):
            controller = OwnerRef(_str(ref.get("kind"), f"{rwhere}.kind"), _str(ref.get("name"), f"{rwhere}.name"),
                                  _str(ref.get("uid"), f"{rwhere}.uid", required=False))
    return PodInfo(
        namespace=namespace,
        name=name,
        uid=uid,
        node_name=node_name,
        phase=phase,
        claims=tuple(claims),
        labels={str(k): str(v) for k, v in _dict(meta.get("labels"), f"{where}: metadata.labels",
                                                 required=False).items()},
        extended_claim=extended,
        controller=controller,
        created_at=_time(meta.get("creationTimestamp"), f"{where}: metadata.creationTimestamp"),
        deleting_at=_time(meta.get("deletionTimestamp"), f"{where}: metadata.deletionTimestamp"),
        reported=_reported_health(status, named, where) if reported else (),
    )


def _reported_health(status: dict[str, Any], named: dict[str, str], where: str) -> tuple[ReportedHealth, ...]:
    """The kubelet's KEP-4680 health of the pod's DRA devices: ``status.containerStatuses[]
    .allocatedResourcesStatus[]``, whose ``name`` is ``claim:<pod's claim name>`` or
    ``claim:<name>/<request>`` for a DRA claim (kubelet pkg/kubelet/cm/dra/manager.go,
    UpdateAllocatedResourcesStatus); device-plugin entries (a resource name) are not read."""
    out: list[ReportedHealth] = []
    for i, cs in enumerate(_list(status.get("containerStatuses"), f"{where}: status.containerStatuses")):
        cs = _dict(cs, f"{where}: status.containerStatuses[{i}]")
        at = f"{where}: status.containerStatuses[{i}].allocatedResourcesStatus"
        for j, rs in enumerate(_list(cs.get("allocatedResourcesStatus"), at)):
            rs = _dict(rs, f"{at}[{j}]")
            ref, _, request = _str(rs.get("name"), f"{at}[{j}].name").partition("/")
            if not ref.startswith("claim:"):
                continue
            claim = named.get(ref[len("claim:"):], "")
            for k, rh in enumerate(_list(rs.get("resources"), f"{at}[{j}].resources")):
                rat = f"{at}[{j}].resources[{k}]"
                rh = _dict(rh, rat)
                health = _str(rh.get("health"), f"{rat}.health", required=False) or "Unknown"
                out.append(ReportedHealth(claim, request, _str(rh.get("resourceID"), f"{rat}.resourceID"), health))
    return tuple(out)
