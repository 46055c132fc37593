"""DeviceTaintRule CRUD against whichever resource.k8s.io version serves it.

DeviceTaintRule is v1alpha3 in Kubernetes 1.33-1.35, v1beta2 in 1.36 and v1 from 1.37. The
body we send is the same in all three (``spec.deviceSelector{driver,pool,device}`` and
``spec.taint{key,value,effect}``); only ``apiVersion`` and the URL differ. Effect ``None``
exists from 1.35 on: below that, shadow mode cannot be expressed and the caller is told so.

Writes are a create (POST), a JSON merge patch and a delete with a uid precondition: never a
PUT. From 1.37 an update (PUT) of a v1 DeviceTaintRule must carry ``metadata.resourceVersion``
(kubernetes/kubernetes#138676: the v1 strategy no longer allows unconditional updates); a merge
patch is applied by the server to the object it stores, so it needs none and is accepted by every
release.

The remediator reads and writes one typed record (:class:`TaintRule`); the JSON, the labels and the
annotations stay here.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..constants import API_TIMEOUT
from . import names
from .connection import MERGE_PATCH, ApiClient, ApiError, get_json, request_json
from .discovery import RESOURCE_GROUP, Discovery
from .events import micro_time
from .model import DeviceKey

PREFERENCE = ("v1", "v1beta2", "v1alpha3")


class TaintRulesUnavailable(Exception):
    """The API server serves no DeviceTaintRule version (feature gate off, or too old)."""


@dataclass(frozen=True)
class ServedTaintRules:
    version: str
    supports_none: bool


@dataclass(frozen=True)
class TaintRule:
    """One DeviceTaintRule as this agent writes and reads it: the device it selects, its effect, and
    what its labels and annotations record about the fault. :func:`parse_rule` and
    :meth:`TaintRuleClient.create_rule` / :meth:`TaintRuleClient.patch_rule` are its one codec."""

    name: str
    uid: str
    driver: str
    pool: str
    device: str
    effect: str
    ours: bool  # carries this agent's managed-by label
    tier: str = ""
    reason: str = ""
    evidence: str = ""
    uuid: str = ""  # the local device the rule was written for
    gpu: str = ""  # its fault domain (physical GPU)
    scope: str = "gpu"
    sticky: bool = False
    managed: bool = True  # False: annotated managed=false, hands off
    first_seen: float | None = None  # a wall date (epoch seconds)
    reset_required: bool | None = None  # None: not annotated (a rule from an older agent)
    boot_id: str = ""  # the node boot the rule's fault was recorded under; "" when not annotated
    node: str = ""  # the node label: whose agent owns it

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.device)

    def labels(self, sticky: bool) -> dict[str, str]:
        labels = {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: self.node, names.TIER_LABEL: self.tier}
        if sticky:
            # Only ever added by the agent; taking it off (or deleting the rule) is the person's
            # "cleared", so patches never remove it.
            labels[names.STICKY_LABEL] = "true"
        return labels

    def fault_annotations(self) -> dict[str, str]:
        """What a write records about the fault (a create, and every patch)."""
        out = {
            names.REASON_ANNOTATION: self.reason,
            names.EVIDENCE_ANNOTATION: self.evidence,
            names.TIER_ANNOTATION: self.tier,
            names.RESET_REQUIRED_ANNOTATION: "true" if self.reset_required else "false",
        }
        if self.boot_id:
            out[names.BOOT_ID_ANNOTATION] = self.boot_id
        return out

    def taint(self) -> dict[str, str]:
        return {"key": names.taint_key(self.tier), "value": names.label_value(self.reason), "effect": self.effect}


def parse_time(value: str) -> float | None:
    """An annotation written by :func:`exporter.k8s.events.micro_time`, as epoch seconds."""
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()
    except (TypeError, ValueError):
        return None


def _flag(value: str | None) -> bool | None:
    return None if value is None else value.lower() == "true"


def parse_rule(obj: dict[str, Any]) -> TaintRule | None:
    """The record a DeviceTaintRule object stands for; None when it is not a rule at all."""
    try:
        meta = obj["metadata"]
        sel = obj["spec"]["deviceSelector"]
        taint = obj["spec"]["taint"]
        labels = meta.get("labels") or {}
        ann = meta.get("annotations") or {}
        return TaintRule(
            name=meta["name"],
            uid=meta.get("uid", ""),
            driver=sel.get("driver", ""),
            pool=sel.get("pool", ""),
            device=sel.get("device", ""),
            effect=taint.get("effect", "None"),
            ours=labels.get(names.MANAGED_BY) == names.MANAGED_BY_VALUE,
            tier=labels.get(names.TIER_LABEL, "") or ann.get(names.TIER_ANNOTATION, ""),
            reason=ann.get(names.REASON_ANNOTATION, ""),
            evidence=ann.get(names.EVIDENCE_ANNOTATION, ""),
            uuid=ann.get(names.UUID_ANNOTATION, ""),
            gpu=ann.get(names.GPU_ANNOTATION, ""),
            scope=ann.get(names.SCOPE_ANNOTATION, "gpu"),
            sticky=labels.get(names.STICKY_LABEL, "").lower() == "true",
            managed=ann.get(names.UNMANAGED_ANNOTATION, "true").lower() != "false",
            first_seen=parse_time(ann.get(names.FIRST_SEEN_ANNOTATION, "")),
            reset_required=_flag(ann.get(names.RESET_REQUIRED_ANNOTATION)),
            boot_id=ann.get(names.BOOT_ID_ANNOTATION, ""),
            node=labels.get(names.NODE_LABEL, ""),
        )
    except (KeyError, TypeError, AttributeError):
        return None


class TaintRuleClient:
    def __init__(self, client: ApiClient, discovery: Discovery) -> None:
        self.client = client
        self.discovery = discovery
        self._served: ServedTaintRules | None = None

    def served(self) -> ServedTaintRules:
        if self._served is None:
            versions = self.discovery.served_versions(RESOURCE_GROUP)
            for v in PREFERENCE:
                if v in versions and "devicetaintrules" in self.discovery.resources(RESOURCE_GROUP, v):
                    self._served = ServedTaintRules(version=v, supports_none=v != "v1alpha3" or self._minor() >= 35)
                    break
            else:
                raise TaintRulesUnavailable(
                    f"no DeviceTaintRule API served (resource.k8s.io versions: {', '.join(versions) or 'none'}); "
                    "enable the DRADeviceTaintRules feature gate and its API version"
                )
        return self._served

    def forget_version(self) -> None:
        """Re-discover on next use (after a 404 on the collection: the cluster was upgraded)."""
        self._served = None
        self.discovery.refresh()

    def _minor(self) -> int:
        try:
            info = get_json(self.client, "/version", timeout=API_TIMEOUT)
        except ApiError:
            return 0
        m = re.match(r"(\d+)", str(info.get("minor", "")))
        return int(m.group(1)) if m else 0

    def _base(self) -> str:
        return f"/apis/{RESOURCE_GROUP}/{self.served().version}/devicetaintrules"

    @property
    def api_version(self) -> str:
        return f"{RESOURCE_GROUP}/{self.served().version}"

    def body(
        self, name: str, driver: str, pool: str, device: str, key: str, value: str, effect: str,
        labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> dict[str, Any]:
        if not (driver and pool and device):
            # An empty selector matches every device in the cluster (kubernetes#141422).
            raise ValueError("refusing to build a DeviceTaintRule without driver, pool and device")
        return {
            "apiVersion": self.api_version,
            "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": dict(labels), "annotations": dict(annotations)},
            "spec": {
                "deviceSelector": {"driver": driver, "pool": pool, "device": device},
                "taint": {"key": key, "value": value, "effect": effect},
            },
        }

    def list_owned(self, node: str | None = None) -> list[dict[str, Any]]:
        sel = f"{names.MANAGED_BY}={names.MANAGED_BY_VALUE}" + (f",{names.NODE_LABEL}={node}" if node else "")
        items: list[dict[str, Any]] = []
        cont = None
        while True:
            q = {"labelSelector": sel, "limit": 500}
            if cont:
                q["continue"] = cont
            out = get_json(self.client, self._base(), q, timeout=API_TIMEOUT)
            items.extend(out.get("items") or [])
            cont = (out.get("metadata") or {}).get("continue")
            if not cont:
                return items

    def list_rules(self, node: str) -> list[TaintRule]:
        """This node's rules (node-scoped label selector), parsed; malformed ones left out."""
        return [r for r in map(parse_rule, self.list_owned(node)) if r is not None]

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return get_json(self.client, f"{self._base()}/{name}", timeout=API_TIMEOUT)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def get_rule(self, name: str) -> TaintRule | None:
        obj = self.get(name)
        return parse_rule(obj) if obj is not None else None

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return request_json(self.client, "POST", self._base(), body=body, timeout=API_TIMEOUT)

    def create_rule(self, rule: TaintRule) -> TaintRule:
        """Create ``rule`` (name, selector, taint, labels and every annotation it records)."""
        seen = micro_time(rule.first_seen or 0.0)
        annotations = {names.UUID_ANNOTATION: rule.uuid, names.GPU_ANNOTATION: rule.gpu,
                       names.SCOPE_ANNOTATION: rule.scope,
                       names.FIRST_SEEN_ANNOTATION: seen, **rule.fault_annotations()}
        taint = rule.taint()
        body = self.body(rule.name, rule.driver, rule.pool, rule.device, taint["key"], taint["value"], rule.effect,
                         rule.labels(rule.sticky), annotations)
        created = parse_rule(self.create(body))
        if created is None:
            raise ApiError(status=500, reason="BadResponse",
                           message=f"the answer to creating DeviceTaintRule {rule.name} is no DeviceTaintRule")
        return created

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return request_json(self.client, "PATCH", f"{self._base()}/{name}", body=patch, content_type=MERGE_PATCH,
                            timeout=API_TIMEOUT)

    def patch_rule(self, rule: TaintRule, mark_sticky: bool) -> None:
        """One merge patch: the taint, the labels and what the rule records about the fault (the
        device, its GPU, scope and first-seen date are written once, at creation). The sticky label
        only when ``mark_sticky``: re-sending it would put back a label a person removed since our
        last look (a merge patch without it leaves it be)."""
        self.patch(rule.name, {
            "metadata": {"labels": rule.labels(mark_sticky), "annotations": rule.fault_annotations()},
            "spec": {"taint": rule.taint()},
        })

    def delete(self, name: str, uid: str | None = None) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}  # never delete a rule someone recreated meanwhile
        try:
            request_json(self.client, "DELETE", f"{self._base()}/{name}", body=body, timeout=API_TIMEOUT)
        except ApiError as e:
            if e.status != 404:
                raise
