"""The cluster-wide NoExecute budget: one ConfigMap, shared by every agent, changed only through
the API server's optimistic concurrency.

The installer (the Helm chart) creates ConfigMap ``dra-gpu-exporter-budget`` in the agents'
namespace and states its capacity there, so no agent ever counts the cluster's GPUs by listing
it. Data keys without a dot are the installer's:

* ``max_domains``: at most this many fault domains under NoExecute at once (0 or absent: no
  absolute cap);
* ``fraction`` and ``cluster_gpus``: at most ``floor(fraction * cluster_gpus)`` (at least 1)
  when ``cluster_gpus`` is above 0.

The capacity is the smallest cap stated; when the object states none, the agent's default
(``Config.taint_budget_max``, 16) applies. Every other key is one held slot, ``<node>.<fault domain>``
(the admission policy lets an agent add or remove only keys that start with its own node name
and a dot), its value the time it was taken.

What it costs (issue 26). At rest an agent neither reads nor watches the object. An agent that
wants a slot opens a watch on that one object by name (``fieldSelector=metadata.name=...``: a list
and a watch) and reads it from there; it takes a slot with a PUT carrying the read's
``resourceVersion``, so agents faulting at the same moment can never take more slots than there
are (a 409 means another agent wrote first: the agent waits for its watch to show that write,
after a random pause that grows with each conflict, and decides again from it, asking nothing
more). Refused (full), it keeps the watch open and asks again only when the watch shows a free
slot, at a random moment within ``SPREAD`` seconds, so the waiting agents do not all race for one
slot: most see it taken before their turn. Once it holds its slot (or stops wanting one) the
watch is closed. A missing object is a watch that shows nothing: nothing more is asked until
it appears; an object that cannot be listed (403, 5xx) is retried by the watch with capped,
jittered backoff (5 s doubling to 120 s: at most one try a minute after a few minutes).

Returning a slot is a read and a guarded PUT (re-read on 409), only when a domain steps down.

When the object cannot be read, :class:`ApiError` reaches the caller, which fails safe
(NoSchedule, never NoExecute beyond the budget).

A node deleted while holding slots leaves its keys behind; they are freed by deleting those
keys (``kubectl edit configmap dra-gpu-exporter-budget``). An agent that restarts keeps its own
keys for the domains it still holds and frees the others as those domains step down.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from ..clock import SYSTEM, Clock
from ..constants import API_TIMEOUT
from .connection import ApiClient, ApiError, ApiUnavailable, get_json, request_json
from .watch import Reflector

log = structlog.get_logger(__name__)

BUDGET_NAME = "dra-gpu-exporter-budget"
CAPACITY_KEYS = ("max_domains", "fraction", "cluster_gpus")
SPREAD = 5.0  # seconds: a waiting agent that sees a free slot asks at a random moment within this
FIRST_READ = 5.0  # seconds a take waits for the watch's first list while it is neither done nor failed
CONFLICT_PAUSE = 1.0  # seconds, at most, of the random pause after a conflict (grows from 20 ms)
_KEY_BAD = re.compile(r"[^-._a-zA-Z0-9]")

Listener = Callable[[], None]


def holder_key(holder: str) -> str:
    """A valid ConfigMap key for ``holder`` (``<node>.<domain>``); ConfigMap keys allow letters,
    digits, ``-``, ``_`` and ``.``, at most 253 characters."""
    return _KEY_BAD.sub("_", holder)[:253]


def capacity_of(data: dict[str, Any], default: int) -> int:
    """The budget the installer stated in ``data`` (see the module doc); ``default`` when none."""
    caps: list[int] = []
    try:
        max_domains = int(str(data.get("max_domains", "0")).strip() or 0)
    except ValueError:
        max_domains = 0
    if max_domains > 0:
        caps.append(max_domains)
    try:
        gpus = int(str(data.get("cluster_gpus", "0")).strip() or 0)
        fraction = float(str(data.get("fraction", "0")).strip() or 0)
    except ValueError:
        gpus, fraction = 0, 0.0
    if gpus > 0 and fraction > 0 and math.isfinite(fraction):
        caps.append(max(1, math.floor(fraction * gpus)))
    return min(caps) if caps else default


def _slots(data: dict[str, Any]) -> list[str]:
    return [k for k in data if "." in k]


def _rv(obj: dict[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


class BudgetWatch(Reflector[dict[str, Any]]):
    """The budget ConfigMap, watched by name in its namespace."""

    kind = "budget"

    def __init__(self, client: ApiClient, namespace: str, name: str, **kw: Any) -> None:
        super().__init__(client, group="", resource="configmaps", label=name, field_selector=f"metadata.name={name}",
                         **kw)
        self.namespace, self.name = namespace, name

    def _path(self, version: str) -> str:
        return f"/api/{version}/namespaces/{self.namespace}/configmaps"

    def current(self) -> dict[str, Any] | None:
        return self.items().get(self.name)


class ClusterBudget:
    """The :class:`exporter.remediation.contract.Budget` protocol on the shared ConfigMap."""

    def __init__(
        self,
        client: ApiClient,
        namespace: str,
        name: str = BUDGET_NAME,
        *,
        taint_budget_max: int = 16,
        attempts: int = 16,
        clock: Clock = SYSTEM,  # its wall clock dates a slot; its waits are real time
        rng: Callable[[], float] = random.random,
        spread: float = SPREAD,
        watch_backoff: tuple[float, float] = (5.0, 120.0),
        first_read: float = FIRST_READ,
    ) -> None:
        self.client = client
        self.first_read = first_read
        self.namespace = namespace
        self.name = name
        self.default_capacity = taint_budget_max
        self.attempts = attempts
        self.clock = clock
        self.capacity = taint_budget_max  # as last read from the object
        self.conflicts = 0  # 409s met (another agent wrote first): for tests and debugging
        self._rng = rng
        self._spread = spread
        self._watch_backoff = watch_backoff
        self._lock = threading.Condition()  # guards what follows; notified on every watch change
        self._watch: BudgetWatch | None = None
        self._waiting: set[str] = set()  # holders refused (or not read yet) that still want a slot
        self._full_rv = ""  # the object's version when a holder was last refused
        self._not_before = 0.0  # monotonic: a waiting holder asks no earlier (a free slot was seen)
        self._listeners: list[Listener] = []
        self._timer: threading.Timer | None = None

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps/{self.name}"

    def subscribe(self, listener: Listener) -> None:
        """``listener()`` is called (from a watch or timer thread) when a waiting holder's take
        may succeed now: a slot came free, or the object appeared."""
        self._listeners.append(listener)

    # -- the watch ----------------------------------------------------------------------------
    def _open_watch(self) -> tuple[BudgetWatch, bool]:
        """The watch, opened now (True) or already open."""
        with self._lock:
            if self._watch is not None:
                return self._watch, False
            initial, cap = self._watch_backoff
            watch = self._watch = BudgetWatch(self.client, self.namespace, self.name, on_change=self._changed,
                                              backoff_initial=initial, backoff_max=cap)
        watch.start()
        return watch, True

    def _close_watch_if_idle(self) -> None:
        with self._lock:
            if self._waiting or self._watch is None:
                return
            watch, self._watch = self._watch, None
        watch.stop()

    def _changed(self) -> None:
        """The watched object changed (watch thread). A waiting holder gets its turn at a
        random moment within the spread when a slot is free; at once when the object appeared."""
        with self._lock:
            self._lock.notify_all()
            watch = self._watch
            obj = watch.current() if watch is not None else None
            if not self._waiting or obj is None:
                return
            data = obj.get("data") or {}
            if len(_slots(data)) >= capacity_of(data, self.default_capacity) or _rv(obj) == self._full_rv:
                return
            delay = 0.0 if not self._full_rv else self._rng() * self._spread
            self._not_before = time.monotonic() + delay
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(delay, self._tell)
            self._timer.daemon = True
            self._timer.start()

    def _tell(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:
                log.exception("budget_listener_failed")

    def _fresh(self, watch: BudgetWatch, stale_rv: str, timeout: float) -> dict[str, Any] | None:
        """The watched object, once it is newer than ``stale_rv`` (bounded wait)."""
        with self._lock:
            self._lock.wait_for(lambda: _rv(watch.current()) != stale_rv or self._watch is not watch, timeout)
        return watch.current()

    # -- the protocol -------------------------------------------------------------------------
    def take(self, holder: str) -> bool:
        key = holder_key(holder)
        watch, _ = self._open_watch()
        deadline = time.monotonic() + self.first_read
        while not watch.synced and not watch.last_error and time.monotonic() < deadline:
            watch.wait_synced(0.05)  # the list is on its way; a failing one is not waited for
        if not watch.synced:
            with self._lock:
                self._waiting.add(key)
            # (no answer yet: like a request that got none, retryable)
            raise ApiUnavailable(status=0, reason="Unavailable",
                                 message=f"budget {self.namespace}/{self.name} not read yet: "
                                         f"{watch.last_error or 'list pending'}")
        obj = watch.current()
        tried = ""
        for attempt in range(self.attempts):
            if tried:
                # Another agent wrote first: a random pause (it grows with each conflict, so the
                # racers spread out), then decide again from what the watch shows, not a GET.
                time.sleep(self._rng() * min(CONFLICT_PAUSE, 0.02 * 2**attempt))
                obj = self._fresh(watch, tried, 2.0)
                if _rv(obj) == tried:
                    obj = get_json(self.client, self._path, timeout=API_TIMEOUT)  # the watch is behind
            if obj is None:
                with self._lock:
                    self._waiting.add(key)
                raise ApiError(status=404, reason="NotFound",
                               message=f"configmap {self.namespace}/{self.name} not found (the installer creates it)")
            data = dict(obj.get("data") or {})
            self.capacity = capacity_of(data, self.default_capacity)
            if key in data:
                return self._done(key, True)  # ours already (a retry after a lost answer, a restart)
            if len(_slots(data)) >= self.capacity:
                with self._lock:
                    first = key not in self._waiting
                    self._waiting.add(key)
                    self._full_rv = _rv(obj)
                (log.info if first else log.debug)("budget_full", holder=key, capacity=self.capacity)
                return False
            with self._lock:
                if key in self._waiting and time.monotonic() < self._not_before:
                    return False  # a slot is free: this holder's turn is still to come
            data[key] = f"{self.clock.wall():.0f}"  # a date for the people who read the object
            if not self._put(obj, data):
                tried = _rv(obj)
                continue
            log.info("budget_taken", holder=key, capacity=self.capacity)
            return self._done(key, True)
        raise ApiError(status=409, reason="Conflict",
                       message=f"budget {self.namespace}/{self.name}: still conflicting after {self.attempts} attempts")

    def _put(self, obj: dict[str, Any], data: dict[str, Any]) -> bool:
        """Write ``obj`` with ``data``, conditional on the resourceVersion it was read at. False
        when someone wrote it meanwhile (409, counted in ``conflicts``: read it again); any other
        error raises."""
        try:
            request_json(self.client, "PUT", self._path, body={**obj, "data": data}, timeout=API_TIMEOUT)
        except ApiError as e:
            if e.status != 409:
                raise
            self.conflicts += 1
            return False
        return True

    def _done(self, key: str, answer: bool) -> bool:
        with self._lock:
            self._waiting.discard(key)
        self._close_watch_if_idle()
        return answer

    def cancel(self, holder: str) -> None:
        """The holder no longer wants a slot: no more waiting (no request)."""
        self._done(holder_key(holder), False)

    def release(self, holder: str) -> None:
        key = holder_key(holder)
        with self._lock:
            self._waiting.discard(key)
        for attempt in range(self.attempts):
            obj = get_json(self.client, self._path, timeout=API_TIMEOUT)
            data = dict(obj.get("data") or {})
            if key not in data:
                break
            del data[key]
            if not self._put(obj, data):
                time.sleep(self._rng() * min(CONFLICT_PAUSE, 0.02 * 2**attempt))
                continue
            log.info("budget_released", holder=key)
            break
        else:
            raise ApiError(status=409, reason="Conflict",
                           message=f"budget {self.namespace}/{self.name}: still conflicting after {self.attempts} "
                                   "attempts")
        self._close_watch_if_idle()

    def held(self, prefix: str | None = None) -> set[str]:
        data = get_json(self.client, self._path, timeout=API_TIMEOUT).get("data") or {}
        return {k for k in _slots(data) if prefix is None or k.startswith(prefix)}

    def close(self) -> None:
        with self._lock:
            self._waiting.clear()
            if self._timer is not None:
                self._timer.cancel()
        self._close_watch_if_idle()
