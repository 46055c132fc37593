"""List+watch of one selector-scoped set of objects in a daemon thread: the reflector protocol.

1. LIST the collection with the selector (paginated), replace the local state with the result
   and remember the list's resourceVersion;
2. WATCH from that resourceVersion with ``allowWatchBookmarks=true``; apply ADDED / MODIFIED /
   DELETED, advance the resourceVersion on every event including BOOKMARKs, and when the
   server ends the watch (its timeout), watch again from where it stopped -- no relist;
3. on 410 Gone -- an HTTP 410 answer or an ``ERROR`` event whose Status has code 410 -- the
   resourceVersion is compacted away: relist. The old state stays visible until the new list
   has arrived, then is replaced in one step, so consumers never see an empty set;
4. on connection errors, 5xx, 429 and oversized answers retry with capped, jittered exponential
   backoff, at least as long as the server's Retry-After. Nothing escapes the thread.

Every request carries a field or label selector naming this node (or one object), so at rest an
agent costs the API server one open watch per reflector and nothing else, whatever the size of
the cluster. :class:`Reflector` is generic; :class:`exporter.k8s.slices.SliceWatcher`,
:class:`NodeWatch`, :class:`OwnedRuleWatch` and :class:`exporter.k8s.podhealth.PodWatcher` are its uses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar, cast

import structlog

from ..backoff import Backoff
from .connection import ApiClient, ApiError, WatchStream, get_json, stream_watch
from .discovery import DEFAULT_PREFERENCE, Discovery
from .names import MANAGED_BY, MANAGED_BY_VALUE, NODE_LABEL

log = structlog.get_logger(__name__)

__all__ = ["NodeWatch", "OwnedRuleWatch", "Reflector", "WatcherStats"]

LIST_PAGE_SIZE = 500
T = TypeVar("T")


@dataclass
class WatcherStats:
    lists: int = 0  # complete lists (a paginated one counts once), the first included
    watches: int = 0  # watches opened, the first included
    relists: int = 0  # lists after the first (410 Gone, version change, error recovery)
    watch_restarts: int = 0  # watches opened after the first
    malformed_skipped: int = 0  # objects or event lines that could not be parsed
    errors: int = 0  # failed requests / streams
    events: int = 0  # ADDED, MODIFIED, DELETED applied
    bookmarks: int = 0


class _RelistNeeded(Exception):
    """The watch reported 410 Gone in-band; start over with a list."""


class Reflector(Generic[T]):
    """List+watch in a daemon thread; the state is ``name -> parsed item``.

    Subclasses say what to watch (``group``, ``resource``, the selectors) and may override
    :meth:`_parse` (object -> item, None for malformed), :meth:`_keep` (whether a parsed item
    belongs here), :meth:`_rv_of` and :meth:`_recompute` (derived state, under the lock).
    ``on_change`` runs on the watcher thread after every applied change, with the lock
    released; keep it short (e.g. wake another thread).
    """

    kind = "objects"  # the `kind` field of its log events (watch_listed kind=slices, ...)

    def __init__(
        self,
        client: ApiClient,
        *,
        group: str,
        resource: str,
        label: str,
        field_selector: str = "",
        label_selector: str = "",
        api_version: str | None = None,
        on_change: Callable[[], None] | None = None,
        discovery: Discovery | None = None,
        watch_timeout: float = 300.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        preference: tuple[str, ...] = DEFAULT_PREFERENCE,
    ) -> None:
        self._client = client
        self.group = group
        self.resource = resource
        self.label = label  # who this reflector is for (node name): logs and the thread name
        self.field_selector = field_selector
        self.label_selector = label_selector
        self._forced_version = api_version.rsplit("/", 1)[-1] if api_version else ("v1" if not group else None)
        self._version: str | None = self._forced_version
        if self._version is None and discovery is None:
            # one Discovery per agent, built by the wiring: a watch never builds its own
            raise ValueError(f"a watch of {group}/{resource} without a version needs the shared Discovery")
        self._discovery = discovery
        self._preference = preference
        self._watch_timeout = watch_timeout
        self._backoff = Backoff(backoff_initial, backoff_max)
        self.on_change = on_change

        self._lock = threading.Lock()
        self._items: dict[str, T] = {}
        self._rv = ""
        self._stats = WatcherStats()
        self._last_error: str | None = None
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._gone_streak = 0  # consecutive 410s without a good event in between

    # ------------------------------------------------------------------ hooks

    def _parse(self, obj: Any, version: str) -> T | None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            return None
        # The default hook keeps the raw object: only the Reflector[dict[str, Any]] uses (NodeWatch,
        # OwnedRuleWatch) rely on it, and ``obj`` was just checked to be a dict; parsing
        # subclasses (SliceWatcher) override it.
        return cast(T, obj)

    def _keep(self, item: T) -> bool:
        return True

    def _rv_of(self, item: T) -> str:
        meta = item.get("metadata") if isinstance(item, dict) else None
        return str((meta or {}).get("resourceVersion") or "")

    def _recompute(self) -> None:
        """Derived state from ``self._items`` (caller holds the lock)."""

    def _page_size(self) -> int:
        return LIST_PAGE_SIZE

    def _key_of(self, obj: Any) -> str:
        """The object's key in the state ("" for none): its name (cluster-scoped, or one namespace)."""
        return _name_of(obj)

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"{self.kind}-watcher-{self.label}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def items(self) -> dict[str, T]:
        with self._lock:
            return dict(self._items)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    @property
    def last_error(self) -> str | None:
        with self._lock:
            return self._last_error

    @property
    def stats(self) -> WatcherStats:
        with self._lock:
            return replace(self._stats)

    @property
    def resource_version(self) -> str:
        with self._lock:
            return self._rv

    @property
    def api_version(self) -> str | None:
        return self._version

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        need_list = True
        while not self._stop.is_set():
            try:
                version = self._ensure_version()
                if version is None:
                    self._fail(f"{self.group} serves no version with {self.resource} (supported: "
                               f"{', '.join(self._preference)})")
                    continue
                if need_list:
                    self._list(version)
                    need_list = False
                    self._backoff.reset()
                self._watch(version)
            except _RelistNeeded:
                need_list = self._gone()
            except ApiError as exc:
                if self._stop.is_set():
                    break
                if exc.gone:
                    log.info("watch_gone", kind=self.kind, node=self.label, detail=exc.message)
                    need_list = self._gone()
                    continue
                if exc.status == 404 and self._forced_version is None and self._discovery is not None:
                    # the version we discovered went away (control-plane upgrade): ask again
                    self._discovery.refresh()
                    self._version = None
                    need_list = True
                self._fail(str(exc), exc.retry_after)
            except Exception as exc:  # a bug must not kill the watcher; say so loudly and go on
                if self._stop.is_set():
                    break
                log.exception("watch_unexpected_error", kind=self.kind, node=self.label)
                need_list = True
                self._fail(f"unexpected {type(exc).__name__}: {exc}")

    def _gone(self) -> bool:
        """410 Gone: relist at once the first time; if 410s keep coming right after fresh
        lists, something is wrong with the server, so back off instead of spinning."""
        self._gone_streak += 1
        if self._gone_streak > 1:
            self._sleep(self._backoff.next_delay())
        return True

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _fail(self, message: str, retry_after: float | None = None) -> None:
        delay = self._backoff.next_delay(retry_after)
        with self._lock:
            self._stats.errors += 1
            repeated = self._last_error == message
            self._last_error = message
        # The same failure again (an outage, an oversized answer) is one line, not one per retry.
        (log.debug if repeated else log.warning)("watch_error", kind=self.kind, node=self.label, error=message,
                                                 retry_in=round(delay, 2))
        self._sleep(delay)

    def _ensure_version(self) -> str | None:
        if self._version is None:
            assert self._discovery is not None  # __init__: no version, so a Discovery
            self._version = self._discovery.version_for(self.group, self.resource, self._preference)
            if self._version:
                log.info("watch_version", kind=self.kind, version=self._version)
        return self._version

    def _path(self, version: str) -> str:
        return f"/apis/{self.group}/{version}/{self.resource}" if self.group else f"/api/{version}/{self.resource}"

    def _selectors(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.field_selector:
            out.append(("fieldSelector", self.field_selector))
        if self.label_selector:
            out.append(("labelSelector", self.label_selector))
        return out

    # ------------------------------------------------------------------ list

    def _list(self, version: str) -> None:
        items: dict[str, T] = {}
        malformed = 0
        cont = ""
        restarted = False
        while True:
            query: list[tuple[str, Any]] = [*self._selectors(), ("limit", self._page_size())]
            if cont:
                query.append(("continue", cont))
            try:
                page = get_json(self._client, self._path(version), query)
            except ApiError as exc:
                # an expired continue token: start the list over once, consistently
                if exc.gone and cont and not restarted:
                    items, malformed, cont, restarted = {}, 0, "", True
                    continue
                raise
            page_meta = page.get("metadata")
            meta = page_meta if isinstance(page_meta, dict) else {}
            page_items = page.get("items")
            for obj in page_items if isinstance(page_items, list) else []:
                parsed = self._parse_logged(obj, version)
                if parsed is None:
                    malformed += 1
                elif self._keep(parsed):
                    items[self._key_of(obj)] = parsed
            cont = meta.get("continue") or ""
            if not cont:
                rv = str(meta.get("resourceVersion") or "")
                break
        with self._lock:
            before = {n: self._rv_of(s) for n, s in self._items.items()}
            self._items = items
            self._rv = rv
            self._stats.malformed_skipped += malformed
            if self._stats.lists:
                self._stats.relists += 1
            self._stats.lists += 1
            self._last_error = None
            self._recompute()
            changed = before != {n: self._rv_of(s) for n, s in items.items()} or not self._synced.is_set()
        self._synced.set()
        log.info("watch_listed", kind=self.kind, node=self.label, version=version, items=len(items), rv=rv)
        if changed:
            self._notify()

    def _parse_logged(self, obj: Any, version: str) -> T | None:
        parsed = self._parse(obj, version)
        if parsed is None:
            log.warning("watch_malformed", kind=self.kind, node=self.label, name=_name_of(obj) or None)
        return parsed

    # ------------------------------------------------------------------ watch

    def _watch(self, version: str) -> None:
        with self._lock:
            rv = self._rv
        query: list[tuple[str, Any]] = [
            *self._selectors(),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", int(self._watch_timeout)),
        ]
        if rv:
            query.append(("resourceVersion", rv))
        stream = stream_watch(self._client, self._path(version), query, self._watch_timeout)
        with self._lock:
            self._stream = stream
            if self._stats.watches:
                self._stats.watch_restarts += 1
            self._stats.watches += 1
            self._last_error = None
        if self._stop.is_set():  # stop() ran between the request and the assignment above
            stream.close()
            return
        self._backoff.reset()
        received = 0
        started = time.monotonic()
        try:
            for event in stream:
                received += 1
                self._apply(event, version)
                self._gone_streak = 0
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        if received == 0 and time.monotonic() - started < 1.0:
            # a server that closes watches at once would otherwise make this a busy loop
            self._sleep(self._backoff.initial)

    def _apply(self, event: dict[str, Any], version: str) -> None:
        etype = event.get("type")
        obj = event.get("object")
        if etype == "ERROR":
            status = obj if isinstance(obj, dict) else {}
            code = status.get("code")
            message = str(status.get("message") or "watch error")
            if code == 410 or status.get("reason") in ("Expired", "Gone"):
                log.info("watch_gone", kind=self.kind, node=self.label, detail=message)
                raise _RelistNeeded()
            raise ApiError(
                status=code if isinstance(code, int) else 500,
                reason=str(status.get("reason") or "WatchError"),
                message=message,
                body=status or None,
            )
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if etype == "BOOKMARK":
            with self._lock:
                if isinstance(rv, str) and rv:
                    self._rv = rv
                self._stats.bookmarks += 1
            return
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            with self._lock:
                self._stats.malformed_skipped += 1
            log.warning("watch_bad_event", kind=self.kind, node=self.label, type=str(etype),
                        raw=str(event.get("raw", ""))[:200])
            return
        name = self._key_of(obj)
        if not name:
            with self._lock:
                self._stats.malformed_skipped += 1
            log.warning("watch_malformed", kind=self.kind, node=self.label,
                        error=f"{etype} event without metadata.name")
            return
        parsed = None if etype == "DELETED" else self._parse_logged(obj, version)
        with self._lock:
            if isinstance(rv, str) and rv:
                self._rv = rv
            self._stats.events += 1
            if etype != "DELETED" and parsed is None:
                self._stats.malformed_skipped += 1
            # A malformed update cannot be trusted, and an object that no longer belongs here
            # (moved to another node) is gone for us: both leave the state like a delete.
            if parsed is not None and self._keep(parsed):
                self._items[name] = parsed
            else:
                self._items.pop(name, None)
            self._recompute()
        self._notify()

    def _notify(self) -> None:
        callback = self.on_change
        if callback is None:
            return
        try:
            callback()
        except Exception:
            log.exception("watch_on_change_failed", kind=self.kind, node=self.label)


def _name_of(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""


class NodeWatch(Reflector[dict[str, Any]]):
    """This node's Node object (fieldSelector ``metadata.name=<node>``): its labels carry the
    remediation kill switch. One watch instead of a GET every resync."""

    kind = "node"

    def __init__(self, client: ApiClient, node: str, **kw: Any) -> None:
        if not node:
            raise ValueError("NodeWatch needs a node name")
        super().__init__(client, group="", resource="nodes", label=node, field_selector=f"metadata.name={node}", **kw)
        self.node = node

    def labels(self) -> dict[str, str]:
        with self._lock:
            obj = self._items.get(self.node)
        labels = ((obj or {}).get("metadata") or {}).get("labels")
        return dict(labels) if isinstance(labels, dict) else {}


class OwnedRuleWatch(Reflector[dict[str, Any]]):
    """The DeviceTaintRules this agent owns (labelSelector managed-by and
    ``dra-gpu-exporter.io/node=<node>``), in the served resource.k8s.io ``version``. One watch
    instead of a node-scoped list every resync; an admin's deletion is seen at once."""

    kind = "rules"

    def __init__(self, client: ApiClient, node: str, version: str, **kw: Any) -> None:
        if not node:
            raise ValueError("OwnedRuleWatch needs a node name")
        super().__init__(
            client,
            group="resource.k8s.io",
            resource="devicetaintrules",
            label=node,
            label_selector=f"{MANAGED_BY}={MANAGED_BY_VALUE},{NODE_LABEL}={node}",
            api_version=version,
            **kw,
        )

    def objects(self) -> dict[str, dict[str, Any]]:
        return self.items()
