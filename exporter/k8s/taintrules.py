"""DeviceTaintRule CRUD against whichever resource.k8s.io version serves it.

DeviceTaintRule is v1alpha3 in Kubernetes 1.33-1.35, v1beta2 in 1.36 and v1 from 1.37. The
body we send is the same in all three (``spec.deviceSelector{driver,pool,device}`` and
``spec.taint{key,value,effect}``); only ``apiVersion`` and the URL differ. Effect ``None``
exists from 1.35 on: below that, shadow mode cannot be expressed and the caller is told so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .connection import MERGE_PATCH, ApiError, get_json, request_json
from .discovery import RESOURCE_GROUP, Discovery
from .names import MANAGED_BY, MANAGED_BY_VALUE, NODE_LABEL

PREFERENCE = ("v1", "v1beta2", "v1alpha3")
TIMEOUT = (3.0, 5.0)


class TaintRulesUnavailable(Exception):
    """The API server serves no DeviceTaintRule version (feature gate off, or too old)."""


@dataclass(frozen=True)
class ServedTaintRules:
    version: str
    supports_none: bool


class TaintRuleClient:
    def __init__(self, client: Any, discovery: Discovery | None = None) -> None:
        self.client = client
        self.discovery = discovery or Discovery(client)
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
            info = get_json(self.client, "/version", timeout=TIMEOUT)
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
        self, name: str, driver: str, pool: str, device: str, key: str, value: str, effect: str, labels: dict[str, str], annotations: dict[str, str]
    ) -> dict[str, Any]:
        if not (driver and pool and device):
            # An empty selector matches every device in the cluster (kubernetes#141422).
            raise ValueError("refusing to build a DeviceTaintRule without driver, pool and device")
        return {
            "apiVersion": self.api_version,
            "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {
                "deviceSelector": {"driver": driver, "pool": pool, "device": device},
                "taint": {"key": key, "value": value, "effect": effect},
            },
        }

    def list_owned(self, node: str | None = None) -> list[dict[str, Any]]:
        sel = f"{MANAGED_BY}={MANAGED_BY_VALUE}" + (f",{NODE_LABEL}={node}" if node else "")
        items: list[dict[str, Any]] = []
        cont = None
        while True:
            q = {"labelSelector": sel, "limit": 500}
            if cont:
                q["continue"] = cont
            out = get_json(self.client, self._base(), q, timeout=TIMEOUT)
            items.extend(out.get("items") or [])
            cont = (out.get("metadata") or {}).get("continue")
            if not cont:
                return items

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return get_json(self.client, f"{self._base()}/{name}", timeout=TIMEOUT)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return request_json(self.client, "POST", self._base(), body=body, timeout=TIMEOUT)

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return request_json(self.client, "PATCH", f"{self._base()}/{name}", body=patch, content_type=MERGE_PATCH, timeout=TIMEOUT)

    def delete(self, name: str, uid: str | None = None) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}  # never delete a rule someone recreated meanwhile
        try:
            request_json(self.client, "DELETE", f"{self._base()}/{name}", body=body, timeout=TIMEOUT)
        except ApiError as e:
            if e.status != 404:
                raise
