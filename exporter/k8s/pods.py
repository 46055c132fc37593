"""The pods bound to this node, listed on demand and cached for a short TTL; and single pods
read by name (:class:`PodFacts`, for the remediator's overdue evictions).

Used to map pod UIDs (from process cgroups) to pods for per-process attribution and to know
which ResourceClaims each pod holds. The list uses ``fieldSelector=spec.nodeName=<node>`` --
the same index the kubelet's own pod watch uses -- and ``resourceVersion=0`` so the API server
answers from its watch cache instead of a quorum read of every pod in etcd: a DaemonSet on
every node polling a consistent list would be a real load on a big cluster, and a copy a few
seconds old is fine for attribution.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import quote

import structlog

from ..backoff import Backoff
from .connection import ApiClient, ApiError, get_json
from .model import ClaimInfo, PodInfo
from .parse import ParseError, parse_pod

log = structlog.get_logger(__name__)

__all__ = ["NodePods", "PodFacts", "PodStats"]


class ClaimLookup(Protocol):
    """A claim by name (exporter.k8s.claims.ClaimCache)."""

    def get(self, namespace: str, name: str) -> ClaimInfo | None: ...

PAGE_SIZE = 500


@dataclass
class PodStats:
    lists: int = 0
    errors: int = 0
    malformed_skipped: int = 0


class NodePods:
    """``list()`` returns this node's pods, refetched when older than ``ttl``.

    On an API failure the last good list is returned (``stale`` becomes True) and further
    attempts wait for a backoff, so a down API server costs one failed request per backoff
    period, not one per call. Never raises.
    """

    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        ttl: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
    ) -> None:
        if not node_name:
            raise ValueError("NodePods needs a node name")
        self._client = client
        self.node_name = node_name
        self.ttl = ttl
        self._clock = clock
        self._backoff = Backoff(backoff_initial, backoff_max)
        self._lock = threading.Lock()
        self._fetch_lock = threading.Lock()  # one list in flight; concurrent callers share it
        self._pods: list[PodInfo] = []
        self._fetched_at: float | None = None
        self._retry_at = 0.0
        self._stale = False
        self._last_error: str | None = None
        self._stats = PodStats()

    def list(self, force: bool = False) -> list[PodInfo]:
        with self._fetch_lock:
            now = self._clock()
            with self._lock:
                fresh = self._fetched_at is not None and now - self._fetched_at < self.ttl
                paused = now < self._retry_at
            if (force or not fresh) and not paused:
                self._fetch()
            with self._lock:
                return list(self._pods)

    def by_uid(self, force: bool = False) -> dict[str, PodInfo]:
        return {p.uid: p for p in self.list(force) if p.uid}

    @property
    def stale(self) -> bool:
        with self._lock:
            return self._stale

    @property
    def synced(self) -> bool:
        with self._lock:
            return self._fetched_at is not None

    @property
    def last_error(self) -> str | None:
        with self._lock:
            return self._last_error

    @property
    def stats(self) -> PodStats:
        with self._lock:
            return replace(self._stats)

    def _fetch(self) -> None:
        pods: list[PodInfo] = []
        malformed = 0
        cont = ""
        try:
            while True:
                query: list[tuple[str, Any]] = [
                    ("fieldSelector", f"spec.nodeName={self.node_name}"),
                    ("limit", PAGE_SIZE),
                ]
                # resourceVersion=0 ("any version", from the watch cache) cannot be combined with
                # a continue token, so only the first page asks for it
                query.append(("continue", cont) if cont else ("resourceVersion", "0"))
                page = get_json(self._client, "/api/v1/pods", query)
                items = page.get("items")
                for item in items if isinstance(items, list) else []:
                    try:
                        pod = parse_pod(item)
                    except ParseError as exc:
                        malformed += 1
                        log.warning("pods_malformed", node=self.node_name, error=str(exc))
                        continue
                    if pod.node_name in ("", self.node_name):
                        pods.append(pod)
                meta = page.get("metadata")
                cont = (meta.get("continue") if isinstance(meta, dict) else "") or ""
                if not cont:
                    break
        except ApiError as exc:
            delay = self._backoff.next_delay(exc.retry_after)
            with self._lock:
                self._stats.errors += 1
                self._last_error = str(exc)
                self._stale = self._fetched_at is not None
                self._retry_at = self._clock() + delay
            log.warning("pods_list_failed", node=self.node_name, error=str(exc), retry_in=round(delay, 2))
            return
        self._backoff.reset()
        with self._lock:
            self._pods = pods
            self._fetched_at = self._clock()
            self._retry_at = 0.0
            self._stale = False
            self._last_error = None
            self._stats.lists += 1
            self._stats.malformed_skipped += malformed


class PodFacts:
    """One pod, or one claim, read by name: what the remediator asks about a pod that still
    holds a device after its NoExecute taint's grace period (exporter.remediation.evictions).

    A GET by name, not this node's pod list: it is asked only for the few pods that outstay an
    eviction, once per pod and deadline, so a node with no such pod costs nothing, and a
    dense node's pod list (hundreds of pods, pages of JSON) is never fetched for it.
    ``resourceVersion=0`` answers from the API server's watch cache. The claim comes from a
    :class:`~exporter.k8s.claims.ClaimCache` that ``claims`` makes on first use (wiring gives it
    the agent's one Discovery; an agent that never has such a pod never builds it).
    """

    def __init__(self, client: ApiClient, claims: Callable[[], ClaimLookup]) -> None:
        self._client = client
        self._make_claims = claims
        self._claims: ClaimLookup | None = None

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod, or None when it no longer exists. Raises ApiError (non-404) and ParseError."""
        try:
            obj = get_json(self._client, f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}",
                           {"resourceVersion": "0"})
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        return parse_pod(obj)

    def claim(self, namespace: str, name: str) -> ClaimInfo | None:
        """The claim (cached once read), or None when it does not exist or cannot be read."""
        if self._claims is None:
            self._claims = self._make_claims()  # on first use: most agents never ask
        return self._claims.get(namespace, name)
