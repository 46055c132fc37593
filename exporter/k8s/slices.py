"""Watch this node's ResourceSlices and keep the devices of each pool's newest generation.

A daemon thread runs the reflector protocol (:mod:`exporter.k8s.watch`) against the API server:

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

from collections.abc import Callable
from typing import Any

import structlog

from .connection import ApiClient
from .discovery import DEFAULT_PREFERENCE, RESOURCE_GROUP, Discovery
from .model import DeviceKey, SliceDevice
from .parse import ParsedSlice, ParseError, parse_slice_full
from .watch import Reflector, WatcherStats

log = structlog.get_logger(__name__)

__all__ = ["DeviceKey", "SliceWatcher", "WatcherStats"]


RESOURCE = "resourceslices"
LIST_PAGE_SIZE = 500


class SliceWatcher(Reflector[ParsedSlice]):
    """List+watch of this node's ResourceSlices in a daemon thread.

    ``devices()`` is always safe to call and returns a copy; before the first list completes it
    is empty and ``synced`` is False. ``on_change`` (if given) runs on the watcher thread after
    every applied change, with the watcher's lock released; keep it short (e.g. set an event).
    """

    kind = "slices"

    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        api_version: str | None = None,
        *,
        on_change: Callable[[], None] | None = None,
        discovery: Discovery,
        watch_timeout: float = 300.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        preference: tuple[str, ...] = DEFAULT_PREFERENCE,
    ) -> None:
        if not node_name:
            raise ValueError("SliceWatcher needs a node name")
        super().__init__(
            client,
            group=RESOURCE_GROUP,
            resource=RESOURCE,
            label=node_name,
            field_selector=f"spec.nodeName={node_name}",
            api_version=api_version,
            on_change=on_change,
            discovery=discovery,
            watch_timeout=watch_timeout,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            preference=preference,
        )
        self.node_name = node_name
        self._devices: dict[DeviceKey, SliceDevice] = {}

    def devices(self) -> dict[DeviceKey, SliceDevice]:
        with self._lock:
            return dict(self._devices)

    def device(self, key: DeviceKey) -> SliceDevice | None:
        with self._lock:
            return self._devices.get(key)

    # ------------------------------------------------------------------ reflector hooks

    def _page_size(self) -> int:
        return LIST_PAGE_SIZE  # (read at call time: tests shrink it)

    def _parse(self, obj: Any, version: str) -> ParsedSlice | None:
        try:
            return parse_slice_full(obj, version)
        except ParseError as exc:
            log.warning("slices_malformed", node=self.node_name, error=str(exc))
            return None

    def _parse_logged(self, obj: Any, version: str) -> ParsedSlice | None:
        return self._parse(obj, version)  # the parser's own message says more than the default

    def _keep(self, item: ParsedSlice) -> bool:
        # slices moved to another node are no longer ours
        return item.node_name in ("", self.node_name)

    def _rv_of(self, item: ParsedSlice) -> str:
        return item.resource_version

    def _recompute(self) -> None:
        """Rebuild the device map (caller holds the lock): newest pool generation only."""
        newest: dict[tuple[str, str], int] = {}
        for s in self._items.values():
            pool = (s.driver, s.pool)
            newest[pool] = max(newest.get(pool, s.pool_generation), s.pool_generation)
        devices: dict[DeviceKey, SliceDevice] = {}
        for s in sorted(self._items.values(), key=lambda s: s.name):
            if s.pool_generation != newest[(s.driver, s.pool)]:
                continue
            for dev in s.devices:
                devices[dev.key] = dev
        self._devices = devices
