"""The node agent: sources -> one joined model -> outputs, once per interval.

Each source is a *collector* with its own duration and success self-metrics (as in
node_exporter). A failing collector is logged and reported; the others carry on, and the last
good data of a failing source is kept for a grace period so a kubelet restart or an API blip
does not blank the dashboards.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from .config import Config
from .devices.base import DeviceBackend
from .devices.deadline import CallHung, DeadlineRunner
from .devices.model import DeviceIdentity, DeviceReading, ReadError
from .health.engine import HealthEngine, HealthPolicy
from .health.starvation import StarvationMonitor
from .k8s.model import ClaimInfo, PodInfo, SliceDevice
from .kubelet.model import AllocationSource, PodResourcesSnapshot
from .metrics.render import Renderer, RenderState
from .metrics.server import MetricsServer
from .metrics.webconfig import load_web_config
from .model.join import DeviceKey, JoinInputs, JoinMemo, join
from .model.lost import lost_devices
from .model.snapshot import Snapshot
from .model.usage import Usage, UsageAccountant
from .remediation.report import RemediationReport

log = structlog.get_logger(__name__)


@dataclass
class CollectorStatus:
    duration: float = 0.0
    success: bool = False
    error: str = ""
    last_success: float | None = None  # monotonic


class KubeletSource(Protocol):
    """The kubelet's PodResources API (exporter.kubelet.client.PodResourcesClient)."""

    def list(self) -> PodResourcesSnapshot: ...
    def close(self) -> None: ...


class SliceSource(Protocol):
    """This node's ResourceSlice devices, watched (exporter.k8s.slices.SliceWatcher)."""

    @property
    def synced(self) -> bool: ...
    @property
    def last_error(self) -> str | None: ...
    def devices(self) -> dict[tuple[str, str, str], SliceDevice]: ...
    def wait_synced(self, timeout: float | None = None) -> bool: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...


class ClaimSource(Protocol):
    """The claims this node's pods hold, fetched as needed (exporter.k8s.claims.ClaimCache)."""

    @property
    def last_error(self) -> str | None: ...
    def due(self, keys: Iterable[tuple[str, str]]) -> bool: ...
    def refresh(self, keys: Iterable[tuple[str, str]]) -> None: ...
    def prune(self, keep: Iterable[tuple[str, str]]) -> None: ...
    def infos(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], ClaimInfo]: ...


class PodSource(Protocol):
    """This node's Pod objects, for labels and per-process attribution (exporter.k8s.pods.NodePods)."""

    def list(self, force: bool = False) -> list[PodInfo]: ...


class RemediationOutput(Protocol):
    """Acts on the joined model (exporter.remediation.engine.Remediator) and reports back in a
    frozen RemediationReport; the agent never reads its internals."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def update(self, snap: Snapshot) -> None: ...
    def report(self) -> RemediationReport: ...


@dataclass
class Sources:
    """The optional I/O edges. Any of them may be None (no kubelet, no API server)."""

    backend: DeviceBackend
    kubelet: KubeletSource | None = None
    slices: SliceSource | None = None
    claims: ClaimSource | None = None
    pods: PodSource | None = None
    remediation: RemediationOutput | None = None
    processes: Callable[[Snapshot], dict[tuple[str, str, str], int]] | None = None  # per-process attribution


class Agent:
    KUBELET_GRACE = 300.0  # seconds to keep the last allocations while the kubelet is unreachable
    LIVENESS_FLOOR = 30.0  # no completed cycle for at least this long (and 6 intervals): sampler stuck
    EVENT_STALL = 60.0  # the device event thread's loop (a wait with a timeout) not turning this long: stuck

    def __init__(self, cfg: Config, sources: Sources, clock: Callable[[], float] = time.time, health_policy: HealthPolicy | None = None) -> None:
        self.cfg = cfg
        self.src = sources
        self.clock = clock
        self.health = HealthEngine(clock, health_policy or HealthPolicy(clear_hold=cfg.fault_clear_seconds, stuck_after=cfg.stuck_reading_seconds))
        self.runner = DeadlineRunner()
        # The agent's own CPU starvation is told apart from stuck device calls: a lag of half a
        # deadline is starvation, and one keeps the agent "starved" long enough for a call that
        # was only slow to come back once the agent runs again.
        self.starvation = StarvationMonitor(threshold=max(0.05, cfg.call_timeout / 2), window=max(10.0, 5 * cfg.call_timeout))
        # Kubernetes API calls made inside a cycle (claims, pods) get their own lanes and
        # deadline, like device calls: a slow or black-holed API server (30 s read timeout per
        # request) must not stall device collection. Separate from ``runner`` so /readyz does
        # not list them as hung devices.
        self.api_runner = DeadlineRunner()
        self._last_pods: list[PodInfo] = []
        self.renderer = Renderer()
        self._join_memo = JoinMemo()  # the join's structure while pods, claims and slices stand still
        self.usage = UsageAccountant()  # billing counters: energy and device-time per claim and pod
        self._usage: Usage | None = None
        self.server: MetricsServer | None = None
        self.status: dict[str, CollectorStatus] = {}
        self.snapshot: Snapshot | None = None
        self.cycles = 0
        self._identities: list[DeviceIdentity] = []
        # GPUs (and their MIG devices) this node's ResourceSlices publish that the library
        # does not enumerate: lost, with series and a fatal condition (see model/lost.py)
        self._lost: dict[str, tuple[DeviceIdentity, Any]] = {}
        self._topology: list[str] = []
        self._readings: dict[str, DeviceReading] = {}
        self._pods_snapshot: PodResourcesSnapshot | None = None
        self._pods_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cycle_lock = threading.Lock()
        self._started = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, serve: bool = True) -> None:
        self.starvation.start()
        if serve:
            # First: /healthz answers and /readyz says "no device data yet" even while a
            # driver is slow to open or enumerate, instead of refusing connections.
            self.server = MetricsServer(
                self.cfg.listen_host,
                self.cfg.listen_port,
                self.readiness,
                liveness=self.liveness,
                web_config=load_web_config(self.cfg.web_config_file) if self.cfg.web_config_file else None,
            )
            self.server.start()
        try:
            self._start_sources()
        except BaseException:
            if self.server is not None:
                self.server.stop()
                self.server = None
            raise
        self._await_slices()
        self.run_cycle()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def _start_sources(self) -> None:
        self.src.backend.open()
        # The health engine must know which MIG instance lives on which GPU before the first
        # event can arrive: an instance's XID counts against its GPU. The first cycle would
        # tell it, but events start now. Same deadline lane as the cycle's enumerate; on any
        # failure the first cycle reports it and sets the topology.
        try:
            self.health.set_topology(self.runner.call("enumerate", self.src.backend.enumerate, self.cfg.call_timeout))
        except Exception as e:
            log.warning("early_enumerate_failed", error=str(e))
        self.src.backend.start_events(self.health.on_event)
        if self.src.slices is not None:
            self.src.slices.start()
        if self.src.remediation is not None:
            self.src.remediation.start()

    FIRST_LIST_WAIT = 2.0  # seconds the first cycle waits for the ResourceSlices' initial list

    def _await_slices(self) -> None:
        """Ready means joined: the first cycle renders device attribution only once the node's
        ResourceSlices are listed, or it would publish "unresolved" and a degraded /readyz for a
        whole interval. Bounded, and cut short by a failing list: an API outage must not hold
        device metrics back (that cycle then reports the slices collector as failed)."""
        w = self.src.slices
        if w is None or w.synced:
            return
        deadline = time.monotonic() + self.FIRST_LIST_WAIT
        while not w.synced and not w.last_error and time.monotonic() < deadline and not self._stop.is_set():
            w.wait_synced(0.02)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.interval + self.cfg.call_timeout + 2)
        for part in (self.src.remediation, self.src.slices):
            if part is not None:
                try:
                    part.stop()
                except Exception:
                    log.exception("stop_failed", part=type(part).__name__)
        if self.server is not None:
            self.server.stop()
        self.src.backend.close()
        if self.src.kubelet is not None:
            self.src.kubelet.close()
        self.runner.close()
        self.api_runner.close()
        self.starvation.stop()

    def _loop(self) -> None:
        # Fixed-rate schedule: a slow cycle delays the next one, it does not shift them all.
        next_at = time.monotonic() + self.cfg.interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            # How late the sampler woke is one of the starvation signals.
            self.starvation.note_lag("the sampler", time.monotonic() - next_at)
            try:
                self.run_cycle()
            except Exception:
                log.exception("cycle_failed")
            next_at += self.cfg.interval
            if next_at < time.monotonic():
                next_at = time.monotonic() + self.cfg.interval

    # -- one cycle ---------------------------------------------------------------------------
    def _collect(self, name: str, fn: Callable[[], Any]) -> Any:
        st = self.status.setdefault(name, CollectorStatus())
        t0 = time.perf_counter()
        try:
            result = fn()
        except Degraded as e:
            # The source answered with data it knows to be incomplete or old: use it, report it.
            st.duration = time.perf_counter() - t0
            if st.success or st.error != str(e):
                log.warning("collector_degraded", collector=name, error=str(e))
            st.success, st.error = False, str(e)
            return e.result
        except Exception as e:
            st.duration = time.perf_counter() - t0
            if st.success or st.error != str(e):
                log.warning("collector_failed", collector=name, error=str(e))
            st.success, st.error = False, str(e)
            return None
        st.duration = time.perf_counter() - t0
        if not st.success and st.error:
            log.info("collector_recovered", collector=name)
        st.success, st.error, st.last_success = True, "", time.monotonic()
        return result

    def _read_devices(self) -> dict[str, DeviceReading]:
        backend = self.src.backend
        try:
            idents = self.runner.call("enumerate", backend.enumerate, self.cfg.call_timeout)
        except CallHung as e:
            if e.running_for is None:
                self.starvation.note_unstarted("enumerate")
            raise
        if [i.uuid for i in idents] != [i.uuid for i in self._identities]:
            gone = {i.uuid for i in self._identities} - {i.uuid for i in idents}
            for u in gone:
                self.runner.retire(u)
            log.info("devices_enumerated", count=len(idents), gone=sorted(gone))
            self._identities = idents
        readings: dict[str, DeviceReading] = {}
        # Devices are read one after another, each under its own deadline, on one shared worker
        # until one hangs: that device then keeps a lane of its own, which fails fast while its
        # call is stuck, so a hung device costs one deadline, and only its own reads.
        results = self.runner.call_each([(i.uuid, functools.partial(backend.read, i)) for i in idents], self.cfg.call_timeout)
        for ident, res in zip(idents, results, strict=True):
            if isinstance(res, CallHung):
                readings[ident.uuid] = self._missed_deadline(ident.uuid, res)
            elif isinstance(res, Exception):  # a backend bug on one device must not cost the others
                log.error("device_read_failed", uuid=ident.uuid, exc_info=res)
                readings[ident.uuid] = DeviceReading.failed(ident.uuid, ReadError.ERROR, str(res))
            elif isinstance(res, BaseException):
                raise res
            else:
                readings[ident.uuid] = res
        for ident in idents:
            r = readings[ident.uuid]
            prev = self._readings.get(ident.uuid)
            if not r.ok and (prev is None or prev.ok or prev.error != r.error):
                log.warning("device_unreadable", uuid=ident.uuid, error=r.error.value if r.error else "", detail=r.error_detail)
            elif r.ok and prev is not None and not prev.ok:
                log.info("device_readable_again", uuid=ident.uuid)
        return readings

    def _missed_deadline(self, uuid: str, e: CallHung) -> DeviceReading:
        """A read that missed its deadline: evidence against the device only when the call has
        been running on its lane for ``--hung-after`` while the agent itself got CPU; else the
        reading is ``late`` (no data, no condition)."""
        if e.running_for is None:
            self.starvation.note_unstarted(uuid)
        hung_after = self.cfg.hung_after
        starved = self.starvation.state()
        if e.running_for is not None and e.running_for >= hung_after and not starved.starved:
            return DeviceReading.failed(uuid, ReadError.TIMEOUT, f"{e}; stuck for {e.running_for:.1f}s (hung after {hung_after:g}s)")
        if starved.starved:
            why = f"the agent is starved of CPU ({starved.reason})"
        elif e.running_for is None:
            why = "the call never started"
        else:
            why = f"stuck for {e.running_for:.1f}s, driver_hung after {hung_after:g}s"
        return DeviceReading.failed(uuid, ReadError.LATE, f"{e}: {why}")

    def _list_kubelet(self, kubelet: KubeletSource) -> PodResourcesSnapshot:
        snap = kubelet.list()
        self._pods_snapshot, self._pods_at = snap, time.monotonic()
        return snap

    def run_cycle(self) -> Snapshot:
        with self._cycle_lock:
            return self._run_cycle()

    def _run_cycle(self) -> Snapshot:
        t0 = time.perf_counter()
        readings = self._collect("devices", self._read_devices)
        if readings is not None:
            self._readings = readings
        kubelet = self.src.kubelet
        if kubelet is not None:
            self._collect("kubelet", lambda: self._list_kubelet(kubelet))
            if self._pods_at is not None and time.monotonic() - self._pods_at > self.KUBELET_GRACE:
                if self._pods_snapshot is not None:
                    log.warning("kubelet_data_expired", grace_seconds=self.KUBELET_GRACE)
                self._pods_snapshot = None
        allocations = self._pods_snapshot.allocations if self._pods_snapshot else ()

        slices = None
        watcher = self.src.slices
        if watcher is not None:
            slices = self._collect("slices", lambda: self._slice_devices(watcher))
        claims: dict[tuple[str, str], ClaimInfo] = {}
        cache = self.src.claims
        if cache is not None:
            keys = sorted({(a.claim_namespace, a.claim_name) for a in allocations if a.source == AllocationSource.DRA and a.claim_name})
            claims = self._collect("claims", lambda: self._claims(cache, keys)) or {}
        pods: list[PodInfo] = []
        pod_source = self.src.pods
        if pod_source is not None:
            pods = self._collect("pods", lambda: self._list_pods(pod_source)) or []

        identities, all_readings = self._with_lost(slices, enumerated=readings is not None)
        uuids = [i.uuid for i in identities]
        if uuids != self._topology:
            self.health.set_topology(identities)
            self._topology = uuids
        self.health.observe(identities, all_readings)
        health = self.health.all_health()
        snap = join(
            JoinInputs(
                node=self.cfg.node_name,
                timestamp=self.clock(),
                identities=tuple(identities),
                readings=all_readings,
                health=health,
                allocations=tuple(allocations),
                slices=slices,
                claims=claims,
                pods=tuple(pods),
                pod_labels={(p.namespace, p.name): getattr(p, "labels", {}) for p in pods},
            ),
            self._join_memo,
        )
        self.snapshot = snap
        if self.src.remediation is not None:
            self.src.remediation.update(snap)
            rep = self.src.remediation.report()
            # A refused write (401, 403, 422) fails the collector too: remediation is off for
            # that device and /readyz's body says why.
            self.status["remediation"] = CollectorStatus(
                success=rep.healthy, error=rep.problem, last_success=time.monotonic() if rep.healthy else None
            )
        process_memory: dict[tuple[str, str, str], int] = {}
        per_process = self.src.processes
        if per_process is not None:
            process_memory = self._collect("processes", lambda: per_process(snap)) or {}
        try:
            self._usage = self.usage.update(snap, process_memory if per_process is not None else None)
        except Exception:  # a bug in the accounting must not cost the cycle: keep the last totals
            log.exception("usage_accounting_failed")
        self.cycles += 1
        self.status["cycle"] = CollectorStatus(duration=time.perf_counter() - t0, success=True, last_success=time.monotonic())
        self.publish(process_memory)
        return snap

    def _with_lost(self, slices: dict[DeviceKey, SliceDevice] | None, enumerated: bool) -> tuple[list[DeviceIdentity], dict[str, DeviceReading]]:
        """The enumerated devices plus the lost ones the slices publish. Re-decided only in a
        cycle whose enumeration succeeded and whose slices are listed; otherwise the last
        decision stands (a failed enumeration tells nothing about single GPUs)."""
        if slices is not None and enumerated:
            lost = lost_devices(slices, self._identities)
            for u in sorted(lost.keys() - self._lost.keys()):
                ident, dev = lost[u]
                log.error("gpu_lost_not_enumerated", uuid=u, device=dev.name, pool=dev.pool, parent=ident.parent_uuid or None)
            for u in sorted(self._lost.keys() - lost.keys()):
                log.info("gpu_found_again", uuid=u)
            self._lost = lost
        if not self._lost:
            return list(self._identities), self._readings
        readings = dict(self._readings)
        for u, (_ident, dev) in self._lost.items():
            readings[u] = DeviceReading.failed(u, ReadError.LOST, f"published by ResourceSlice device {dev.pool}/{dev.name} but not found by the device library")
        return list(self._identities) + [ident for ident, _ in self._lost.values()], readings

    def _api_deadline(self) -> float:
        return max(self.cfg.call_timeout, 0.5)

    def _claims(self, cache: ClaimSource, keys: list[tuple[str, str]]) -> dict[tuple[str, str], ClaimInfo]:
        slow = ""
        try:
            # Claims rarely change (a new allocation is a new claim): the lane is woken only
            # when one is missing or expired, not on every cycle.
            if cache.due(keys):
                self.api_runner.call("claims", lambda: cache.refresh(keys), self._api_deadline())
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

    def _list_pods(self, source: PodSource) -> list[PodInfo]:
        try:
            pods: list[PodInfo] = self.api_runner.call("pods", source.list, self._api_deadline())
        except CallHung as e:
            raise Degraded(f"Pods: API too slow ({e})", self._last_pods) from None
        self._last_pods = pods
        return pods

    def _slice_devices(self, w: SliceSource) -> dict[DeviceKey, SliceDevice]:
        if not w.synced:
            raise RuntimeError(f"ResourceSlices not listed yet{': ' + w.last_error if w.last_error else ''}")
        if w.last_error:
            # Keep using the devices we have, but say the watch is unhealthy.
            raise Degraded(f"ResourceSlice watch: {w.last_error}", w.devices())
        return w.devices()

    def publish(self, process_memory: dict[tuple[str, str, str], int] | None = None) -> None:
        """Render the current state and hand the bytes to the HTTP server."""
        rep = self.src.remediation.report() if self.src.remediation is not None else None
        xid_counts, read_errors = self.health.counters()  # one consistent copy under the lock
        starved = self.starvation.state()
        state = RenderState(
            starved=starved.starved,
            scheduling_lag=starved.lag_seconds,
            snapshot=self.snapshot,
            xid_counts=xid_counts,
            read_errors=read_errors,
            collectors={n: (s.duration, s.success) for n, s in self.status.items() if n != "cycle"},
            last_collection=self.clock(),
            cycles=self.cycles,
            taint_rules=rep.rules if rep is not None else (),
            pending_eviction=rep.pending_eviction if rep is not None else (),
            taint_actions=rep.actions if rep is not None else {},
            taint_suppressed=rep.suppressed if rep is not None else {},
            budget_exhausted=rep.budget_exhausted if rep is not None else None,
            taint_writes_refused=len(rep.refused) if rep is not None else None,
            # no remediator: no API connection or mode off, so no fault gets a rule
            remediation=(self.cfg.taint_mode.value, rep is not None and rep.active),
            detection_latency=rep.latency if rep is not None else None,
            process_memory=process_memory or {},
            pod_label_allowlist=self.cfg.pod_label_allowlist,
            dcgm_compat=self.cfg.dcgm_compat_labels,
            excluded=self.cfg.exclude_metrics,
            http=self.server.stats() if self.server is not None else None,
            usage=self._usage,
        )
        exp = self.renderer.render(state)
        if self.server is not None:
            self.server.publish(exp)

    # -- probes ------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """Ready while device data is fresh (younger than three intervals).

        Kubernetes-side problems do not make the agent unready: device metrics are still worth
        scraping. They are listed in the body so ``kubectl describe`` and curl show them.
        """
        limit = 3 * self.cfg.interval + self.cfg.call_timeout
        dev = self.status.get("devices")
        problems = [f"{n}: {s.error}" for n, s in sorted(self.status.items()) if not s.success and s.error and n != "devices"]
        hung = self.runner.hung_lanes()
        if hung:
            stuck = {k: self.runner.running_for(k) for k in hung}
            long = {k: v for k, v in hung.items() if (stuck[k] or 0.0) >= self.cfg.hung_after}
            slow = {k: v for k, v in hung.items() if k not in long}
            if long:
                problems.append("hung device calls: " + ", ".join(f"{k} ({v:.0f}s)" for k, v in sorted(long.items())))
            if slow:
                problems.append(f"slow device calls (hung after {self.cfg.hung_after:g}s): " + ", ".join(f"{k} ({v:.0f}s)" for k, v in sorted(slow.items())))
        starved = self.starvation.state()
        if starved.starved:
            # The agent's problem, not a device's: late reads are not held against the GPUs.
            problems.append(f"agent starved of CPU: {starved.reason}; worst scheduling lag {starved.lag_seconds:.2f}s")
        if dev is None or dev.last_success is None:
            return False, "not ready: no successful device collection yet" + (f" ({dev.error})" if dev and dev.error else "")
        if self.server is not None and not self.server.published:
            # devices are read but the cycle's metrics are not rendered yet: a scrape now
            # would get no data, so not ready until there is something to serve
            return False, "not ready: first collection cycle still rendering"
        age = time.monotonic() - dev.last_success
        if age > limit:
            why = f"not ready: last successful device collection {age:.1f}s ago (limit {limit:.1f}s): {dev.error or 'sampler stalled'}"
            return False, why + "".join(f"\n{p}" for p in problems if p.startswith("agent starved"))
        if problems:
            return True, "ready (degraded)\n" + "\n".join(problems)
        return True, "ready"


    def liveness(self) -> tuple[bool, str]:
        """Alive unless the sampler or the device event thread is stuck: a restart is the cure
        only for those. A busy HTTP port, a slow API server or a hung device are not reasons
        (the sampler goes on around them; /readyz reports them)."""
        now = time.monotonic()
        # A cycle costs at most one deadline per device plus the API lanes' deadlines (stuck
        # lanes fail fast), so "several intervals" is counted on top of that.
        limit = max(6 * self.cfg.interval, self.LIVENESS_FLOOR) + self.cfg.call_timeout * (len(self._identities) + 3)
        cyc = self.status.get("cycle")
        last = cyc.last_success if cyc is not None and cyc.last_success is not None else self._started
        if self._thread is not None and now - last > limit:
            what = "since the agent started" if cyc is None else "ago"
            return False, f"not alive: sampler stuck, last collection cycle completed {now - last:.0f}s {what} (limit {limit:.0f}s)"
        beat = self.src.backend.event_heartbeat()
        if beat is not None and now - beat > self.EVENT_STALL:
            return False, f"not alive: device event thread stuck, last turn of its loop {now - beat:.0f}s ago (limit {self.EVENT_STALL:.0f}s)"
        return True, "ok"


class Degraded(Exception):
    """Raised by a collector that still has a usable (possibly stale) ``result``."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result
