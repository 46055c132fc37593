"""The Kubernetes API collectors: this node's ResourceSlices, the claims its pods hold, its Pods.

What each source's answer means for a cycle lives here, beside the sources:

* slices (:class:`exporter.k8s.slices.SliceWatcher`, a watch): no data before the first list
  (a failure: the join then attributes nothing rather than "unresolved" everything); the last
  known devices, flagged degraded, while the watch is failing;
* claims (:class:`exporter.k8s.claims.ClaimCache`, GETs): fetched only when one is missing or
  expired, on a deadline lane of its own, so a black-holed API server costs one deadline and
  the cycle goes on with what the cache holds (degraded). The first fetch of a dense node's
  claims is waited for as long as it makes progress (see :meth:`ClaimCollector._first_fetch`);
* pods (:class:`exporter.k8s.pods.NodePods`, a cached list): on its own deadline lane too; when
  it is too slow, the last list stands in (degraded).

This module imports no Kubernetes client code: the sources are handed in (exporter/wiring.py),
so an agent without an API server never loads the kubernetes package.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from ..collect import Collector, Degraded, Gathered, Slot, SourceStats
from ..devices.deadline import CallHung, DeadlineRunner
from .model import ClaimInfo, DeviceKey, PodInfo, SliceDevice

__all__ = ["CLAIMS", "FIRST_FETCH_LIMIT", "PODS", "SLICES", "ClaimCollector", "PodCollector", "SliceCollector"]

ClaimKey = tuple[str, str]  # (namespace, name)

SLICES: Slot[Mapping[DeviceKey, SliceDevice]] = Slot("slices")
CLAIMS: Slot[Mapping[ClaimKey, ClaimInfo]] = Slot("claims")
PODS: Slot[tuple[PodInfo, ...]] = Slot("pods")

#: longest the agent's first claim fetch is waited for while it keeps making progress (seconds)
FIRST_FETCH_LIMIT = 60.0


@runtime_checkable
class WatchStatsView(Protocol):
    lists: int
    watches: int
    relists: int
    watch_restarts: int
    errors: int
    malformed_skipped: int


class SliceSource(Protocol):
    """This node's ResourceSlice devices, watched (exporter.k8s.slices.SliceWatcher)."""

    @property
    def synced(self) -> bool: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def stats(self) -> WatchStatsView: ...
    def devices(self) -> dict[DeviceKey, SliceDevice]: ...
    def wait_synced(self, timeout: float | None = None) -> bool: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...


class ClaimStatsView(Protocol):
    fetches: int
    errors: int
    malformed: int


class ClaimSource(Protocol):
    """The claims this node's pods hold, fetched as needed (exporter.k8s.claims.ClaimCache)."""

    @property
    def last_error(self) -> str | None: ...
    @property
    def stats(self) -> ClaimStatsView: ...
    def progress(self) -> tuple[int, int]: ...
    def due(self, keys: Iterable[ClaimKey]) -> bool: ...
    def refresh(self, keys: Iterable[ClaimKey]) -> None: ...
    def prune(self, keep: Iterable[ClaimKey]) -> None: ...
    def infos(self, keys: Iterable[ClaimKey]) -> dict[ClaimKey, ClaimInfo]: ...


class PodStatsView(Protocol):
    lists: int
    errors: int
    malformed_skipped: int


class PodSource(Protocol):
    """This node's Pod objects, for labels and per-process attribution (exporter.k8s.pods.NodePods)."""

    @property
    def stats(self) -> PodStatsView: ...
    def list(self, force: bool = False) -> list[PodInfo]: ...


def watch_stats(s: WatchStatsView) -> SourceStats:
    """A reflector's counters (exporter.k8s.watch.WatcherStats) in the one shape."""
    return SourceStats(requests={"list": s.lists, "watch": s.watches}, errors=s.errors, relists=s.relists,
                       watch_restarts=s.watch_restarts, malformed=s.malformed_skipped)


class SliceCollector(Collector[Mapping[DeviceKey, SliceDevice]]):
    FIRST_LIST_WAIT = 2.0  # seconds the first cycle waits for the initial list

    def __init__(self, watcher: SliceSource) -> None:
        super().__init__(SLICES)
        self.watcher = watcher

    def start(self) -> None:
        self.watcher.start()

    def await_first(self, deadline: float) -> None:
        """Ready means joined: the first cycle renders device attribution only once the node's
        ResourceSlices are listed, or it would publish "unresolved" and a degraded /readyz for
        a whole interval. Bounded, and cut short by a failing list: an API outage must not hold
        device metrics back (that cycle then reports the slices collector as failed)."""
        w = self.watcher
        deadline = min(deadline, time.monotonic() + self.FIRST_LIST_WAIT)
        while not w.synced and not w.last_error and time.monotonic() < deadline:
            w.wait_synced(0.02)

    def collect(self, found: Gathered) -> Mapping[DeviceKey, SliceDevice]:
        w = self.watcher
        if not w.synced:
            raise RuntimeError(f"ResourceSlices not listed yet{': ' + w.last_error if w.last_error else ''}")
        if w.last_error:
            # Keep using the devices we have, but say the watch is unhealthy.
            raise Degraded(f"ResourceSlice watch: {w.last_error}", w.devices())
        return w.devices()

    def stop(self) -> None:
        self.watcher.stop()

    def stats(self) -> SourceStats:
        return watch_stats(self.watcher.stats)


class ClaimCollector(Collector[Mapping[ClaimKey, ClaimInfo]]):
    """``wanted(found)`` names the claims to hold this cycle (exporter.model.inputs.NeededClaims)."""

    def __init__(self, cache: ClaimSource, wanted: Callable[[Gathered], list[ClaimKey]], deadline: float) -> None:
        super().__init__(CLAIMS)
        self.cache = cache
        self._wanted = wanted
        self.deadline = deadline
        self.runner = DeadlineRunner()  # the "claims" lane: fetches must not stall the cycle
        self._fetched_once = False

    def collect(self, found: Gathered) -> Mapping[ClaimKey, ClaimInfo]:
        cache, keys = self.cache, self._wanted(found)
        slow = ""
        try:
            # Claims rarely change (a new allocation is a new claim): the lane is woken only
            # when one is missing or expired, not on every cycle.
            if cache.due(keys):
                self._refresh(keys)
        except CallHung as e:
            # The fetch goes on in the background and fills the cache; use what it has now.
            slow = f"ResourceClaims: API too slow ({e})"
        cache.prune(keys)
        out = cache.infos(keys)  # no I/O: refresh() fetched what was due
        if slow:
            raise Degraded(slow, out)
        if cache.last_error:
            raise Degraded(f"ResourceClaims: {cache.last_error}", out)
        return out

    def _refresh(self, keys: list[ClaimKey]) -> None:
        first, self._fetched_once = not self._fetched_once, True
        answered = self.cache.progress()[0]
        try:
            self.runner.call("claims", lambda: self.cache.refresh(keys), self.deadline)
        except CallHung:
            if not first or not self._first_fetch(answered):
                raise

    def _first_fetch(self, answered: int) -> bool:
        """The agent's first fetch, past its deadline. Every claim of the node is new at once
        (2,048 GETs on the dense 4x node, a few in flight at a time), so it takes as long as
        the claim count says, not one deadline: it is waited for, a deadline at a time, while
        answers keep coming and claims are still queued behind them, up to
        :data:`FIRST_FETCH_LIMIT`. A slow answer (nothing queued behind the GETs in flight) or
        a black-holed API server (no answers) is not waited for: the cycle goes on without
        those claims, as on any other cycle. True when the fetch finished."""
        end = time.monotonic() + FIRST_FETCH_LIMIT
        while time.monotonic() < end:
            now, queued = self.cache.progress()
            if now == answered or not queued:
                return False
            answered = now
            if self.runner.wait("claims", min(self.deadline, max(0.0, end - time.monotonic()))):
                return True
        return False

    def stop(self) -> None:
        self.runner.close()

    def stats(self) -> SourceStats:
        s = self.cache.stats
        return SourceStats(requests={"get": s.fetches}, errors=s.errors, malformed=s.malformed)


class PodCollector(Collector[tuple[PodInfo, ...]]):
    def __init__(self, pods: PodSource, deadline: float) -> None:
        super().__init__(PODS)
        self.pods = pods
        self.deadline = deadline
        self.runner = DeadlineRunner()  # the "pods" lane
        self._last: tuple[PodInfo, ...] = ()

    def collect(self, found: Gathered) -> tuple[PodInfo, ...]:
        try:
            pods = tuple(self.runner.call("pods", self.pods.list, self.deadline))
        except CallHung as e:
            raise Degraded(f"Pods: API too slow ({e})", self._last) from None
        self._last = pods
        return pods

    def stop(self) -> None:
        self.runner.close()

    def stats(self) -> SourceStats:
        s = self.pods.stats
        if isinstance(s, WatchStatsView):  # the pod watch of --kubelet-device-health, shared
            return watch_stats(s)
        return SourceStats(requests={"list": s.lists}, errors=s.errors, malformed=s.malformed_skipped)
