"""Watch this node's ResourceSlices and keep the devices of each pool's newest generation.

A daemon thread runs the reflector protocol against the API server:

1. LIST ``resourceslices`` with ``fieldSelector=spec.nodeName=<node>`` (paginated), replace the
   local state with the result and remember the list's resourceVersion;
2. WATCH from that resourceVersion with ``allowWatchBookmarks=true``; apply ADDED / MODIFIED /
   DELETED, advance the resourceVersion on every event including BOOKMARKs, and when the
   server ends the watch (its timeout), watch again from where it stopped -- no relist;
3. on 410 Gone -- an HTTP 410 answer or an ``ERROR`` event whose Status has code 410 -- the
   resourceVersion is compacted away: relist. The old state stays visible until the new list
   has arrived, then is replaced in one step, so consumers never see an empty node;
4. on connection errors, 5xx and 429 retry with capped, jittered exponential backoff, at least
   as long as the server's Retry-After. Nothing escapes the thread.

Per pool only the slices with the highest ``pool.generation`` count (a driver republishing a
pool bumps the generation and the older slices are stale until deleted).

The node filter is a server-side field selector (indexed in the watch cache), so the agent
never receives other nodes' slices; slices that use ``nodeSelector``/``allNodes`` have an empty
``spec.nodeName`` and are deliberately out of scope (node-local GPU drivers set nodeName).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import structlog

from ..backoff import Backoff
from .connection import ApiClient, ApiError, WatchStream, get_json, stream_watch
from .discovery import DEFAULT_PREFERENCE, RESOURCE_GROUP, Discovery
from .model import SliceDevice
from .parse import ParsedSlice, ParseError, parse_slice_full

log = structlog.get_logger(__name__)

__all__ = ["SliceWatcher", "WatcherStats", "Backoff", "DeviceKey"]

DeviceKey = tuple[str, str, str]  # (driver, pool, device)

RESOURCE = "resourceslices"
LIST_PAGE_SIZE = 500


@dataclass
class WatcherStats:
    relists: int = 0  # lists after the first (410 Gone, version change, error recovery)
    watch_restarts: int = 0  # watches opened after the first
    malformed_skipped: int = 0  # objects or event lines that could not be parsed
    errors: int = 0  # failed requests / streams
    events: int = 0  # ADDED, MODIFIED, DELETED applied
    bookmarks: int = 0


class _RelistNeeded(Exception):
    """The watch reported 410 Gone in-band; start over with a list."""


class SliceWatcher:
    """List+watch of this node's ResourceSlices in a daemon thread.

    ``devices()`` is always safe to call and returns a copy; before the first list completes it
    is empty and ``synced`` is False. ``on_change`` (if given) runs on the watcher thread after
    every applied change, with the watcher's lock released; keep it short (e.g. set an event).
    """

    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        api_version: str | None = None,
        *,
        on_change: Callable[[], None] | None = None,
        discovery: Discovery | None = None,
        watch_timeout: float = 300.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        preference: tuple[str, ...] = DEFAULT_PREFERENCE,
    ) -> None:
        if not node_name:
            raise ValueError("SliceWatcher needs a node name")
        self._client = client
        self.node_name = node_name
        self._forced_version = api_version.rsplit("/", 1)[-1] if api_version else None
        self._version: str | None = self._forced_version
        self._discovery = discovery or Discovery(client)
        self._preference = preference
        self._watch_timeout = watch_timeout
        self._backoff = Backoff(backoff_initial, backoff_max)
        self.on_change = on_change

        self._lock = threading.Lock()
        self._slices: dict[str, ParsedSlice] = {}
        self._devices: dict[DeviceKey, SliceDevice] = {}
        self._rv = ""
        self._stats = WatcherStats()
        self._last_error: str | None = None
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._lists = 0
        self._watches = 0
        self._gone_streak = 0  # consecutive 410s without a good event in between

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"slice-watcher-{self.node_name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def devices(self) -> dict[DeviceKey, SliceDevice]:
        with self._lock:
            return dict(self._devices)

    def device(self, key: DeviceKey) -> SliceDevice | None:
        with self._lock:
            return self._devices.get(key)

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
                    self._fail(f"{RESOURCE_GROUP} serves no version with {RESOURCE} (supported: {', '.join(self._preference)})")
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
                    log.info("k8s.slices.gone", node=self.node_name, detail=exc.message)
                    need_list = self._gone()
                    continue
                if exc.status == 404 and self._forced_version is None:
                    # the version we discovered went away (control-plane upgrade): ask again
                    self._discovery.refresh()
                    self._version = None
                    need_list = True
                self._fail(str(exc), exc.retry_after)
            except Exception as exc:  # a bug must not kill the watcher; say so loudly and go on
                if self._stop.is_set():
                    break
                log.exception("k8s.slices.unexpected", node=self.node_name)
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
            self._last_error = message
        log.warning("k8s.slices.error", node=self.node_name, error=message, retry_in=round(delay, 2))
        self._sleep(delay)

    def _ensure_version(self) -> str | None:
        if self._version is None:
            self._version = self._discovery.version_for(RESOURCE_GROUP, RESOURCE, self._preference)
            if self._version:
                log.info("k8s.slices.version", version=self._version)
        return self._version

    def _path(self, version: str) -> str:
        return f"/apis/{RESOURCE_GROUP}/{version}/{RESOURCE}"

    def _selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    # ------------------------------------------------------------------ list

    def _list(self, version: str) -> None:
        slices: dict[str, ParsedSlice] = {}
        malformed = 0
        cont = ""
        restarted = False
        while True:
            query: list[tuple[str, Any]] = [("fieldSelector", self._selector()), ("limit", LIST_PAGE_SIZE)]
            if cont:
                query.append(("continue", cont))
            try:
                page = get_json(self._client, self._path(version), query)
            except ApiError as exc:
                # an expired continue token: start the list over once, consistently
                if exc.gone and cont and not restarted:
                    slices, malformed, cont, restarted = {}, 0, "", True
                    continue
                raise
            meta = page.get("metadata") if isinstance(page.get("metadata"), dict) else {}
            items = page.get("items")
            for item in items if isinstance(items, list) else []:
                parsed = self._parse(item, version)
                if parsed is None:
                    malformed += 1
                elif parsed.node_name in ("", self.node_name):
                    slices[parsed.name] = parsed
            cont = meta.get("continue") or ""
            if not cont:
                rv = str(meta.get("resourceVersion") or "")
                break
        with self._lock:
            before = {n: s.resource_version for n, s in self._slices.items()}
            self._slices = slices
            self._rv = rv
            self._stats.malformed_skipped += malformed
            if self._lists:
                self._stats.relists += 1
            self._lists += 1
            self._last_error = None
            self._recompute()
            changed = before != {n: s.resource_version for n, s in slices.items()} or not self._synced.is_set()
        self._synced.set()
        log.info("k8s.slices.listed", node=self.node_name, version=version, slices=len(slices), rv=rv)
        if changed:
            self._notify()

    def _parse(self, obj: Any, version: str) -> ParsedSlice | None:
        try:
            return parse_slice_full(obj, version)
        except ParseError as exc:
            log.warning("k8s.slices.malformed", node=self.node_name, error=str(exc))
            return None

    # ------------------------------------------------------------------ watch

    def _watch(self, version: str) -> None:
        with self._lock:
            rv = self._rv
        query: list[tuple[str, Any]] = [
            ("fieldSelector", self._selector()),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", int(self._watch_timeout)),
        ]
        if rv:
            query.append(("resourceVersion", rv))
        stream = stream_watch(self._client, self._path(version), query, self._watch_timeout)
        with self._lock:
            self._stream = stream
            if self._watches:
                self._stats.watch_restarts += 1
            self._watches += 1
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

    def _apply(self, event: dict, version: str) -> None:
        etype = event.get("type")
        obj = event.get("object")
        if etype == "ERROR":
            status = obj if isinstance(obj, dict) else {}
            code = status.get("code")
            message = str(status.get("message") or "watch error")
            if code == 410 or status.get("reason") in ("Expired", "Gone"):
                log.info("k8s.slices.gone", node=self.node_name, detail=message)
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
            log.warning("k8s.slices.bad_event", node=self.node_name, type=str(etype), raw=str(event.get("raw", ""))[:200])
            return
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            with self._lock:
                self._stats.malformed_skipped += 1
            log.warning("k8s.slices.malformed", node=self.node_name, error=f"{etype} event without metadata.name")
            return
        parsed = None if etype == "DELETED" else self._parse(obj, version)
        with self._lock:
            if isinstance(rv, str) and rv:
                self._rv = rv
            self._stats.events += 1
            if etype != "DELETED" and parsed is None:
                self._stats.malformed_skipped += 1
            # A malformed update cannot be trusted, and a slice moved to another node is no
            # longer ours: both leave the state like a delete.
            if parsed is not None and parsed.node_name in ("", self.node_name):
                self._slices[name] = parsed
            else:
                self._slices.pop(name, None)
            self._recompute()
        self._notify()

    # ------------------------------------------------------------------ state

    def _recompute(self) -> None:
        """Rebuild the device map (caller holds the lock): newest pool generation only."""
        newest: dict[tuple[str, str], int] = {}
        for s in self._slices.values():
            pool = (s.driver, s.pool)
            newest[pool] = max(newest.get(pool, s.pool_generation), s.pool_generation)
        devices: dict[DeviceKey, SliceDevice] = {}
        for s in sorted(self._slices.values(), key=lambda s: s.name):
            if s.pool_generation != newest[(s.driver, s.pool)]:
                continue
            for dev in s.devices:
                devices[dev.key] = dev
        self._devices = devices

    def _notify(self) -> None:
        callback = self.on_change
        if callback is None:
            return
        try:
            callback()
        except Exception:
            log.exception("k8s.slices.on_change_failed", node=self.node_name)

