"""What the remediator must not forget across restarts, and how it reads it back.

* A rule records what it stands for in its annotations (tier, reason, evidence, first seen,
  whether a GPU reset is required, the fault domain and the scope); :func:`rule_from_object`
  reads them back and :func:`restore_health` hands them to the health engine on adoption, so a
  restarted agent keeps a fatal rule until a reset is observed instead of calling the GPU
  healthy at once.
* An admin's deletion of a rule is remembered in the ConfigMap ``dra-gpu-exporter-node-<node>``
  in the agent's namespace (:class:`NodeState`): a restarted agent does not undo it without new
  evidence. Written only when the set changes (a deletion noticed, a rule created again).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, TypedDict

import structlog

from ..health.model import Tier
from ..k8s.connection import ApiError, get_json, request_json
from . import names
from .plan import Effect, OwnedRule

log = structlog.get_logger(__name__)

TIMEOUT = (3.0, 5.0)
ADMIN_DELETED_KEY = "admin-deleted"  # ConfigMap data key: JSON {"driver/pool/device": {"at": epoch s, "reason": r}}


@dataclass(frozen=True)
class AdminDeletion:
    at: float  # when the agent noticed the deletion
    reason: str = ""  # the condition the deleted rule stood for
    carried: bool = False  # read back from the ConfigMap: noticed by an earlier process


class _StoredDeletion(TypedDict):
    """One entry of the ConfigMap's admin-deleted JSON."""

    at: float
    reason: str


def parse_time(value: str) -> float | None:
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()
    except (TypeError, ValueError):
        return None


def rule_from_object(obj: dict[str, Any]) -> OwnedRule | None:
    try:
        meta = obj["metadata"]
        sel = obj["spec"]["deviceSelector"]
        taint = obj["spec"]["taint"]
        labels = meta.get("labels") or {}
        ann = meta.get("annotations") or {}
        return OwnedRule(
            name=meta["name"],
            driver=sel.get("driver", ""),
            pool=sel.get("pool", ""),
            device=sel.get("device", ""),
            uuid=ann.get(names.UUID_ANNOTATION, ""),
            effect=taint.get("effect", Effect.NONE.value),
            tier=labels.get(names.TIER_LABEL, "") or ann.get(names.TIER_ANNOTATION, ""),
            reason=ann.get(names.REASON_ANNOTATION, ""),
            evidence=ann.get(names.EVIDENCE_ANNOTATION, ""),
            sticky=labels.get(names.STICKY_LABEL, "").lower() == "true",
            uid=meta.get("uid", ""),
            managed=ann.get(names.UNMANAGED_ANNOTATION, "true").lower() != "false",
            gpu=ann.get(names.GPU_ANNOTATION, ""),
            scope=ann.get(names.SCOPE_ANNOTATION, "gpu"),
            first_seen=parse_time(ann.get(names.FIRST_SEEN_ANNOTATION, "")),
            reset_required=ann.get(names.RESET_REQUIRED_ANNOTATION, "").lower() == "true",
        )
    except (KeyError, TypeError, AttributeError):
        return None


def restore_health(health: Any, rules: list[OwnedRule], now: float) -> int:
    """Re-create, in the health engine, the conditions adopted rules stand for (one per device
    and reason). Returns how many were restored. A health engine without ``restore`` (older
    build) is left alone."""
    restore = getattr(health, "restore", None)
    if restore is None:
        return 0
    done: set[tuple[str, str]] = set()
    for r in rules:
        if not r.reason or r.tier not in {t.value for t in Tier} or r.sticky:
            continue  # (a sticky rule comes back through mark_sticky: its label is the record)
        uuid = r.uuid if r.scope == "instance" or not r.gpu else r.gpu
        if not uuid or (uuid, r.reason) in done:
            continue
        done.add((uuid, r.reason))
        restore(uuid, r.reason, Tier(r.tier), r.first_seen or now, r.evidence, r.reset_required)
        log.info("health_restored_from_rule", rule=r.name, uuid=uuid, reason=r.reason, tier=r.tier, reset_required=r.reset_required)
    return len(done)


class NodeState:
    """The per-node ConfigMap: admin deletions by device key. Reads once, writes on change."""

    def __init__(self, client: Any, namespace: str, node: str) -> None:
        self.client = client
        self.namespace = namespace
        self.name = names.node_state_name(node)
        self.node = node
        self._rv: str | None = None
        self._exists: bool | None = None
        self._written: dict[str, _StoredDeletion] | None = None

    def _path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps" + (f"/{name}" if name else "")

    def load(self) -> dict[tuple[str, str, str], AdminDeletion]:
        """The remembered deletions. Raises ApiError when the object cannot be read (not 404)."""
        try:
            obj = get_json(self.client, self._path(self.name), timeout=TIMEOUT)
        except ApiError as e:
            if e.status != 404:
                raise
            self._exists, self._written = False, {}
            return {}
        self._exists = True
        self._rv = (obj.get("metadata") or {}).get("resourceVersion")
        raw = (obj.get("data") or {}).get(ADMIN_DELETED_KEY, "{}")
        try:
            data: dict[str, _StoredDeletion] = {
                str(k): {"at": float(v["at"]), "reason": str(v.get("reason", ""))} for k, v in json.loads(raw).items()
            }
        except (ValueError, TypeError, AttributeError, KeyError):
            log.warning("node_state_unreadable", configmap=self.name)
            data = {}
        self._written = data
        out: dict[tuple[str, str, str], AdminDeletion] = {}
        for k, v in data.items():
            parts = k.split("/", 2)
            if len(parts) == 3:
                out[(parts[0], parts[1], parts[2])] = AdminDeletion(v["at"], v["reason"], carried=True)
        return out

    def save(self, deleted: dict[tuple[str, str, str], AdminDeletion], _tries: int = 3) -> bool:
        """Write the set if it changed. False when nothing had to be written."""
        data: dict[str, _StoredDeletion] = {"/".join(k): {"at": round(v.at, 3), "reason": v.reason} for k, v in sorted(deleted.items())}
        if data == self._written:
            return False
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.NODE_LABEL: self.node},
            },
            "data": {ADMIN_DELETED_KEY: json.dumps(data, sort_keys=True)},
        }
        if self._exists is None:
            self.load()
        if not self._exists:
            try:
                out = request_json(self.client, "POST", self._path(), body=body, timeout=TIMEOUT)
            except ApiError as e:
                if e.status != 409 or _tries <= 1:
                    raise
                self.load()
                return self.save(deleted, _tries - 1)
        else:
            body["metadata"]["resourceVersion"] = self._rv
            try:
                out = request_json(self.client, "PUT", self._path(self.name), body=body, timeout=TIMEOUT)
            except ApiError as e:
                if e.status not in (404, 409) or _tries <= 1:
                    raise
                self._exists = None
                self.load()
                return self.save(deleted, _tries - 1)
        self._exists = True
        self._rv = (out.get("metadata") or {}).get("resourceVersion")
        self._written = data
        return True
