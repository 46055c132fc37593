"""The per-node state ConfigMap ``dra-gpu-exporter-node-<node>`` in the agent's namespace: what the
remediator must remember across restarts and no rule can carry, the rules an admin deleted (a
deleted rule is gone, and with it its annotations).

Read once, written only when the set changes, guarded by the object's resourceVersion.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, TypedDict

import structlog

from ..constants import API_TIMEOUT
from . import names
from .connection import ApiClient, ApiError, get_json, request_json
from .model import DeviceKey

log = structlog.get_logger(__name__)

ADMIN_DELETED_KEY = "admin-deleted"  # ConfigMap data key: JSON {"driver/pool/device": {"at": epoch s, "reason": r}}


class Deletion(NamedTuple):
    """A rule an admin deleted: when the agent noticed, and the condition the rule stood for."""

    at: float
    reason: str


class _StoredDeletion(TypedDict):
    """One entry of the ConfigMap's admin-deleted JSON."""

    at: float
    reason: str


class NodeState:
    """The per-node ConfigMap: admin deletions by device key. Reads once, writes on change."""

    def __init__(self, client: ApiClient, namespace: str, node: str) -> None:
        self.client = client
        self.namespace = namespace
        self.name = names.node_state_name(node)
        self.node = node
        self._rv: str | None = None
        self._exists: bool | None = None
        self._written: dict[str, _StoredDeletion] | None = None

    def _path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps" + (f"/{name}" if name else "")

    def load(self) -> dict[DeviceKey, Deletion]:
        """The remembered deletions. Raises ApiError when the object cannot be read (not 404)."""
        try:
            obj = get_json(self.client, self._path(self.name), timeout=API_TIMEOUT)
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
        out: dict[DeviceKey, Deletion] = {}
        for k, v in data.items():
            parts = k.split("/", 2)
            if len(parts) == 3:
                out[(parts[0], parts[1], parts[2])] = Deletion(v["at"], v["reason"])
        return out

    def save(self, deleted: dict[DeviceKey, Deletion], _tries: int = 3) -> bool:
        """Write the set if it changed. False when nothing had to be written."""
        data: dict[str, _StoredDeletion] = {"/".join(k): {"at": round(v.at, 3),
                                                          "reason": v.reason} for k, v in sorted(deleted.items())}
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
                out = request_json(self.client, "POST", self._path(), body=body, timeout=API_TIMEOUT)
            except ApiError as e:
                if e.status != 409 or _tries <= 1:
                    raise
                self.load()
                return self.save(deleted, _tries - 1)
        else:
            body["metadata"]["resourceVersion"] = self._rv
            try:
                out = request_json(self.client, "PUT", self._path(self.name), body=body, timeout=API_TIMEOUT)
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
