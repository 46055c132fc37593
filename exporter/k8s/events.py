"""Kubernetes Events (events.k8s.io/v1) for every remediation action.

Events about cluster-scoped objects (DeviceTaintRule, Node) go to the ``default`` namespace,
as the kubelet does for Node events; an Event about a namespaced object (a Pod that outstays
its eviction) goes to that object's namespace, as the API server requires and where
``kubectl describe pod`` looks. Event names follow the kubelet convention
``<regarding>.<hex nanoseconds>``, the nanoseconds of the Event's date on the node's wall clock
(made unique within the process: a wall clock stepped back repeats dates). Failures to record
an event are logged, never raised: an audit trail must not block remediation.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import structlog

from ..clock import SYSTEM, Clock
from ..constants import API_TIMEOUT
from .connection import ApiClient, ApiError, request_json
from .names import REPORTING_CONTROLLER

log = structlog.get_logger(__name__)


def micro_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_names_lock = threading.Lock()
_last = [0]  # the latest name's nanoseconds


def _name_ns(now: float) -> int:
    """``now`` in nanoseconds, above every value handed out before in this process."""
    with _names_lock:
        _last[0] = max(int(now * 1e9), _last[0] + 1)
        return _last[0]


def build_event(
    *, regarding: Mapping[str, str], reason: str, note: str, action: str, type_: str, node: str, now: float,
    namespace: str = "default"
) -> dict[str, Any]:
    name = f"{regarding.get('name', 'object')}.{_name_ns(now):x}"[:253]
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "eventTime": micro_time(now),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": f"dra-gpu-exporter-{node}"[:128],
        "action": action[:128],
        "reason": reason[:128],
        "regarding": dict(regarding),
        "note": note[:1024],
        "type": type_,
    }


class EventRecorder:
    def __init__(self, client: ApiClient, node: str, clock: Clock = SYSTEM) -> None:
        self.client, self.clock = client, clock
        self.node = node
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()

    def record(self, regarding: Mapping[str, str], reason: str, note: str, action: str,
               warning: bool = False) -> dict[str, Any] | None:
        namespace = regarding.get("namespace") or "default"
        ev = build_event(regarding=regarding, reason=reason, note=note, action=action,
                         type_="Warning" if warning else "Normal", node=self.node,
                         now=self.clock.wall(), namespace=namespace)
        try:
            out = request_json(self.client, "POST",
                               f"/apis/events.k8s.io/v1/namespaces/{quote(namespace, safe='')}/events", body=ev,
                               timeout=API_TIMEOUT)
        except ApiError as e:
            with self._lock:
                self.failed += 1
            log.warning("event_not_recorded", reason=reason, error=str(e))
            return None
        with self._lock:
            self.sent += 1
        return out


def pod_ref(namespace: str, name: str, uid: str = "") -> dict[str, str]:
    """An Event's ``regarding`` for a pod (its uid when known: kubectl describe matches on it)."""
    ref = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name}
    if uid:
        ref["uid"] = uid
    return ref
