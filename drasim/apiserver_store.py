"""In-memory object storage with a global resourceVersion and a bounded event history.

Like etcd behind kube-apiserver: every write gets the next revision, and a watch is a cursor
into the history of writes. Every write produces exactly one history entry, so revisions in
the history are contiguous and a cursor maps to an index. A cursor older than the history
window is "compacted": the watch gets 410 Gone (reason Expired), as from the real server.

All methods expect the caller to hold `lock` (a Condition over an RLock), except the ones
documented otherwise; watchers wait on the same condition for new writes.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from .apiserver_catalog import ResourceType

ObjectKey = tuple[str, str]  # (namespace or "", name)

# Real clusters hand out large revisions; starting above 1 makes "0" and "1" obviously special.
_FIRST_RV = 1000


class ApiError(Exception):
    """An error the server answers with a metav1.Status body."""

    _REASONS = {
        400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
        405: "MethodNotAllowed", 406: "NotAcceptable", 409: "Conflict", 410: "Expired",
        415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests",
        500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout",
    }

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: dict[str, Any] | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or self._REASONS.get(code, "Unknown")
        self.details = details
        self.retry_after = retry_after

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        details = dict(self.details or {})
        if self.retry_after is not None:
            details["retryAfterSeconds"] = math.ceil(self.retry_after)
        if details:
            body["details"] = details
        return body

    # Constructors for the messages real clients and humans recognise.
    @classmethod
    def not_found(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(404, f'{rt.qualified} "{name}" not found',
                   details={"name": name, "group": rt.group, "kind": rt.resource})

    @classmethod
    def already_exists(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(409, f'{rt.qualified} "{name}" already exists', reason="AlreadyExists",
                   details={"name": name, "group": rt.group, "kind": rt.resource})

    @classmethod
    def conflict(cls, rt: ResourceType, name: str, why: str) -> ApiError:
        return cls(409, f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
                   reason="Conflict", details={"name": name, "group": rt.group, "kind": rt.resource})

    @classmethod
    def invalid(cls, rt: ResourceType, name: str, causes: list[dict[str, str]]) -> ApiError:
        summary = ", ".join(c["message"] for c in causes)
        if len(causes) > 1:
            summary = f"[{summary}]"
        return cls(422, f'{rt.qualified_kind} "{name}" is invalid: {summary}', reason="Invalid",
                   details={"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})

    @classmethod
    def expired(cls, requested: int, oldest: int) -> ApiError:
        return cls(410, f"too old resource version: {requested} ({oldest})", reason="Expired")


@dataclass(frozen=True)
class WriteEvent:
    rv: int
    rt: ResourceType
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]  # the object after the write (for DELETED: last state, with the delete rv)
    prev: dict[str, Any] | None  # the object before the write


class Store:
    def __init__(self, history_size: int = 1000) -> None:
        if history_size < 1:
            raise ValueError("history_size must be >= 1")
        self.lock = threading.Condition(threading.RLock())
        self._objects: dict[tuple[str, str], dict[ObjectKey, dict[str, Any]]] = {}
        self._rv = _FIRST_RV
        self._history: deque[WriteEvent] = deque()
        self._history_size = history_size
        # A watch may start from any rv >= _oldest (events after it are all still in history).
        self._oldest = _FIRST_RV

    # ------------------------------------------------------------ reads

    @property
    def rv(self) -> int:
        return self._rv

    @property
    def oldest(self) -> int:
        return self._oldest

    def current(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object; treat it as read-only (writes store new dicts)."""
        return self._objects.get(rt.key, {}).get((namespace, name))

    def items(self, rt: ResourceType, namespace: str | None = None) -> list[dict[str, Any]]:
        bucket = self._objects.get(rt.key, {})
        keys = sorted(k for k in bucket if namespace is None or k[0] == namespace)
        return [bucket[k] for k in keys]

    # ------------------------------------------------------------ writes

    def commit(self, rt: ResourceType, type_: str, obj: dict[str, Any],
               prev: dict[str, Any] | None) -> dict[str, Any]:
        """Store (or for DELETED remove) obj under the next revision and wake watchers.

        obj becomes owned by the store; it gets metadata.resourceVersion set here.
        """
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._rv)
        key = (meta.get("namespace") or "", meta.get("name") or "")
        bucket = self._objects.setdefault(rt.key, {})
        if type_ == "DELETED":
            bucket.pop(key, None)
        else:
            bucket[key] = obj
        self._history.append(WriteEvent(self._rv, rt, type_, obj, prev))
        while len(self._history) > self._history_size:
            dropped = self._history.popleft()
            self._oldest = dropped.rv
        self.lock.notify_all()
        return obj

    def compact(self) -> None:
        """Forget all history: a watch from any earlier revision now gets 410 Gone."""
        with self.lock:
            self._history.clear()
            self._oldest = self._rv
            self.lock.notify_all()

    def events_after(self, cursor: int) -> list[WriteEvent]:
        """Writes with rv > cursor. Raises ApiError 410 when they are no longer all known."""
        if cursor < self._oldest:
            raise ApiError.expired(cursor, self._oldest + 1)
        if not self._history or cursor >= self._rv:
            return []
        first = self._history[0].rv
        start = max(0, cursor + 1 - first)
        return [self._history[i] for i in range(start, len(self._history))]
