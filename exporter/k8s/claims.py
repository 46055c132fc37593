"""A cache of the ResourceClaims this node's pods hold.

Why GETs instead of a watch: ResourceClaims are namespaced and can be numerous cluster-wide,
and no field selector narrows them to a node (``status.allocation.nodeSelector`` is not a
selectable field). A watch would stream every claim of the cluster to every GPU node. The
agent needs few claims even of its own pods (the kubelet names their devices, the slices resolve
them): only those its caller asks for (the claims collector: exporter.model.inputs.NeededClaims;
the eviction look-up: a pod that outstays a NoExecute taint), once each:

* a claim is fetched when it is first asked for (many at once: concurrently, a few at a time)
  and then kept while the node's pods hold it: an allocated claim's devices do not change (a
  new allocation is a new claim for a new pod). ``ttl`` (default: never) re-reads it anyway
  where a caller wants that;
* a claim not found or not allocated yet is asked again after ``negative_ttl``;
* every GET carries ``resourceVersion=0``: the API server answers from its watch cache instead
  of a quorum read from etcd.

So in steady state (no allocation changes) the cache makes no request at all. When the API is
down, the last good copy keeps being served, flagged ``stale``, and fetching pauses with a
backoff so a black-holed API server does not stall every collection cycle.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import quote

import structlog

from ..backoff import Backoff
from .connection import ApiClient, ApiError, get_json
from .discovery import DEFAULT_PREFERENCE, RESOURCE_GROUP, Discovery
from .model import ClaimInfo
from .parse import ParseError, parse_claim

log = structlog.get_logger(__name__)

__all__ = ["ClaimCache", "ClaimEntry", "ClaimKey", "ClaimStats"]

ClaimKey = tuple[str, str]  # (namespace, name)
RESOURCE = "resourceclaims"
#: parallel GETs when many claims are new at once (the first cycle of a dense node)
FETCH_PARALLEL = 8


@dataclass(frozen=True)
class ClaimEntry:
    info: ClaimInfo | None  # None: the claim does not exist (404) or could not be parsed
    fetched_at: float
    stale: bool = False  # the last refresh attempt failed; this is an older copy
    error: str = ""


@dataclass
class ClaimStats:
    fetches: int = 0
    hits: int = 0
    not_found: int = 0
    errors: int = 0
    malformed: int = 0
    stale_served: int = 0


class ClaimCache:
    """``get``/``refresh`` fetch from ``/apis/resource.k8s.io/<v>/namespaces/<ns>/resourceclaims/<name>``.

    Thread-safe; requests run without the lock held. Never raises: failures are logged,
    counted, and recorded as ``last_error``.
    """

    def __init__(
        self,
        client: ApiClient,
        api_version: str | None = None,
        ttl: float = math.inf,
        *,
        negative_ttl: float = 10.0,
        discovery: Discovery,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        preference: tuple[str, ...] = DEFAULT_PREFERENCE,
    ) -> None:
        self._client = client
        self._forced_version = api_version.rsplit("/", 1)[-1] if api_version else None
        self._version = self._forced_version
        self._discovery = discovery
        self._preference = preference
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self._clock = clock
        self._backoff = Backoff(backoff_initial, backoff_max)
        self._lock = threading.Lock()
        self._entries: dict[ClaimKey, ClaimEntry] = {}
        # per-entry lifetime, jittered so claims fetched together do not all expire together
        self._expires: dict[ClaimKey, float] = {}
        self._paused_until = 0.0
        # The agent asks due/prune/infos for the node's same few hundred claims every cycle;
        # while no entry changed, the answers are too. Each memo holds the keys it answered for
        # and the change count it saw. (An expiry is a time, not a change: due() keeps the
        # earliest one.)
        self._changes = 0  # bumped by every change to _entries or _expires
        self._due_memo: tuple[list[ClaimKey], int, float] | None = None  # (keys, changes, earliest expiry)
        self._pruned_for: tuple[list[ClaimKey], int] | None = None
        self._infos_memo: tuple[list[ClaimKey], int, dict[ClaimKey, ClaimInfo]] | None = None
        self._stats = ClaimStats()
        self._last_error: str | None = None
        # The current refresh's progress, for a caller that waits for it: GETs answered since
        # the cache was made, and GETs of the running refresh not started yet.
        self._answered = 0
        self._queued = 0

    # ------------------------------------------------------------------ public

    def get(self, namespace: str, name: str) -> ClaimInfo | None:
        """The claim, fetched if missing or expired; a stale copy when the API is down."""
        key = (namespace, name)
        if self.due([key]):
            self._fetch_many([key])
        else:
            with self._lock:
                self._stats.hits += 1
        entry = self.entry(namespace, name)
        if entry is not None and entry.stale:
            with self._lock:
                self._stats.stale_served += 1
        return entry.info if entry else None

    def due(self, keys: Iterable[ClaimKey]) -> bool:
        """Whether any of ``keys`` is missing or expired, without I/O: the agent calls
        :meth:`refresh` (on a deadline lane) only then, not on every cycle."""
        now = self._clock()
        keys = keys if isinstance(keys, list) else list(keys)
        with self._lock:
            memo = self._due_memo
            if memo is None or memo[1] != self._changes or memo[0] != keys:
                entries, expires = self._entries, self._expires
                earliest = min((expires.get(k, 0.0) if k in entries else -math.inf for k in keys), default=math.inf)
                memo = self._due_memo = (list(keys), self._changes, earliest)
            return now >= memo[2]

    def refresh(self, keys: Iterable[ClaimKey]) -> None:
        """Fetch those of ``keys`` that are missing or expired (one call per collection cycle)."""
        now = self._clock()
        with self._lock:  # one acquisition for the node's claims, not one per claim
            todo = [k for k in dict.fromkeys(keys) if self._due_locked(k, now)]
        if todo:
            self._fetch_many(todo)

    def entry(self, namespace: str, name: str) -> ClaimEntry | None:
        """The cached entry without any I/O (``stale`` tells whether it is a last good copy)."""
        with self._lock:
            return self._entries.get((namespace, name))

    def infos(self, keys: Iterable[ClaimKey]) -> dict[ClaimKey, ClaimInfo]:
        """The cached claims among ``keys`` that exist, without I/O (one lock for all of them).
        While nothing changed, the same mapping as last time: callers must not modify it."""
        keys = keys if isinstance(keys, list) else list(keys)
        with self._lock:
            memo = self._infos_memo
            if memo is None or memo[1] != self._changes or memo[0] != keys:
                entries = [(k, self._entries.get(k)) for k in keys]
                infos = {k: e.info for k, e in entries if e is not None and e.info is not None}
                memo = self._infos_memo = (list(keys), self._changes, infos)
            return memo[2]

    def prune(self, keep: Iterable[ClaimKey]) -> None:
        """Forget claims no longer referenced, so the cache tracks the node's pods."""
        keep = keep if isinstance(keep, list) else list(keep)
        with self._lock:
            done = self._pruned_for
            if done is not None and done[1] == self._changes and done[0] == keep:
                return  # pruned to these keys, and nothing was added since
            keep_set = set(keep)
            gone = [k for k in self._entries if k not in keep_set]
            for key in gone:
                self._entries.pop(key, None)
                self._expires.pop(key, None)
            self._changes += bool(gone)
            self._pruned_for = (list(keep), self._changes)

    @property
    def last_error(self) -> str | None:
        with self._lock:
            return self._last_error

    @property
    def stats(self) -> ClaimStats:
        with self._lock:
            return replace(self._stats)

    def progress(self) -> tuple[int, int]:
        """(GETs answered so far, GETs of the running refresh still waiting their turn): a
        refresh of many new claims whose answers keep coming and that still has claims queued
        is slow because it is long, not because the API server is (exporter.k8s.collectors)."""
        with self._lock:
            return self._answered, self._queued

    @property
    def api_version(self) -> str | None:
        return self._version

    # ------------------------------------------------------------------ internals

    def _due_locked(self, key: ClaimKey, now: float) -> bool:
        """Missing or expired (the caller holds ``_lock``)."""
        return key not in self._entries or now >= self._expires.get(key, 0.0)

    def _ensure_version(self) -> str | None:
        if self._version is None:
            self._version = self._discovery.version_for(RESOURCE_GROUP, RESOURCE, self._preference)
        return self._version

    def _fetch_many(self, keys: list[ClaimKey]) -> None:
        with self._lock:
            new = [k for k in keys if k not in self._entries]
            self._queued = len(keys)
        try:
            self._fetch_rounds(keys, new)
        finally:
            with self._lock:
                self._queued = 0

    def _fetch_rounds(self, keys: list[ClaimKey], new: list[ClaimKey]) -> None:
        if len(new) > 1:
            # Many claims never seen (start-up): a few GETs in flight instead of one after the
            # other, so a 50 ms API round trip costs the first cycle ~1/8 of the time. Re-reads
            # stay sequential: the first failure of an outage stops the round.
            chunks = [new[i::FETCH_PARALLEL] for i in range(min(FETCH_PARALLEL, len(new)))]
            with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="claims-fetch") as pool:
                list(pool.map(self._fetch_seq, chunks))
            fetched = set(new)  # (once: a set per key made the dense 4x node's first refresh quadratic)
            keys = [k for k in keys if k not in fetched]
            if not keys:
                return
        self._fetch_seq(keys)

    def _fetch_seq(self, keys: list[ClaimKey]) -> None:
        now = self._clock()
        with self._lock:
            if now < self._paused_until:
                self._mark_stale_locked(keys, self._last_error or "API unavailable")
                return
        try:
            version = self._ensure_version()
        except ApiError as exc:
            self._outage(keys, f"discovery: {exc}", exc.retry_after)
            return
        if version is None:
            self._outage(keys, f"{RESOURCE_GROUP} serves no version with {RESOURCE}", None)
            return
        for i, key in enumerate(keys):
            namespace, name = key
            path = (
                f"/apis/{RESOURCE_GROUP}/{version}/namespaces/{quote(namespace, safe='')}"
                f"/{RESOURCE}/{quote(name, safe='')}"
            )
            with self._lock:
                self._stats.fetches += 1
                self._queued -= 1
            try:
                # resourceVersion=0: from the API server's cache, not a quorum read of etcd
                obj = get_json(self._client, path, {"resourceVersion": "0"})
            except ApiError as exc:
                with self._lock:
                    self._answered += 1
                if exc.status == 404:
                    # The API server's answer for a missing object names it (a Status whose
                    # details.kind is the resource): the claim is gone, most often deleted with its
                    # pod. Only a 404 that does not (a path no longer served) asks discovery.
                    details = (exc.body or {}).get("details") or {}
                    gone = isinstance(details, dict) and details.get("kind") == RESOURCE
                    if not gone and self._forced_version is None and not self._group_version_still_served(version):
                        self._outage(keys[i:], f"{RESOURCE_GROUP}/{version} no longer served", None)
                        return
                    self._store(key, None, self.negative_ttl, error="not found")
                    with self._lock:
                        self._stats.not_found += 1
                    continue
                if exc.retryable:
                    # the API is down or throttling: stop this round, serve what we have
                    self._outage(keys[i:], str(exc), exc.retry_after)
                    return
                # 401/403 and friends: a per-claim problem worth logging, not an outage
                log.warning("claims_fetch_failed", namespace=namespace, claim=name, error=str(exc))
                with self._lock:
                    if key in self._entries:
                        self._mark_stale_locked([key], str(exc))
                    else:
                        self._entries[key] = ClaimEntry(info=None, fetched_at=self._clock(), error=str(exc))
                    self._stats.errors += 1
                    self._last_error = str(exc)
                    self._expires[key] = self._clock() + self.negative_ttl
                    self._changes += 1
                continue
            with self._lock:
                self._answered += 1
            try:
                info = parse_claim(obj, version)
            except ParseError as exc:
                log.warning("claims_malformed", namespace=namespace, claim=name, error=str(exc))
                with self._lock:
                    self._stats.malformed += 1
                self._store(key, None, self.negative_ttl, error=str(exc))
                continue
            # Not allocated yet: ask again soon; allocated: kept (see the module doc).
            self._store(key, info, self.ttl if info.devices else self.negative_ttl)
        with self._lock:
            self._backoff.reset()
            self._paused_until = 0.0
            self._last_error = None

    def _group_version_still_served(self, version: str) -> bool:
        # A 404 normally means "no such claim". After a control-plane upgrade it can also mean
        # the version is gone; tell the two apart once, cheaply, through cached discovery.
        try:
            self._discovery.refresh()
            if RESOURCE in self._discovery.resources(RESOURCE_GROUP, version):
                return True
        except ApiError:
            return True  # cannot tell; treat the 404 as about the claim
        self._version = None
        return False

    def _store(self, key: ClaimKey, info: ClaimInfo | None, ttl: float, error: str = "") -> None:
        now = self._clock()
        with self._lock:
            self._entries[key] = ClaimEntry(info=info, fetched_at=now, stale=False, error=error)
            self._expires[key] = now + ttl * (0.8 + 0.2 * random.random()) if math.isfinite(ttl) else math.inf
            self._changes += 1

    def _mark_stale_locked(self, keys: Iterable[ClaimKey], error: str) -> None:
        """Keep the last good copies of ``keys`` and flag them. Caller holds the lock."""
        for key in keys:
            old = self._entries.get(key)
            if old is not None and not old.stale:
                self._entries[key] = replace(old, stale=True, error=error)
                self._changes += 1

    def _outage(self, keys: list[ClaimKey], error: str, retry_after: float | None) -> None:
        delay = self._backoff.next_delay(retry_after)
        with self._lock:
            self._stats.errors += 1
            self._last_error = error
            self._paused_until = self._clock() + delay
            self._mark_stale_locked(keys, error)
        log.warning("claims_unavailable", error=error, retry_in=round(delay, 2), pending=len(keys))
