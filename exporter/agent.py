"""The node agent: it schedules the collectors it is given (exporter/wiring.py decides which),
joins what they found, publishes, and answers the probes. What a source's data means lives in its
collector, beside the source (exporter/collect.py). A failing collector is logged and reported
(``dra_gpu_exporter_collector_success``, /readyz); the others carry on, and its last good data
stands in for as long as it says (``keep_for``): a kubelet restart does not blank the dashboards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import structlog

from .clock import SYSTEM, Clock
from .collect import Collector, CollectorStatus, Degraded, Gathered
from .config import Config
from .devices.collector import DeviceCollector
from .health.engine import HealthEngine
from .health.starvation import StarvationMonitor
from .metrics.render import Renderer, RenderState
from .metrics.server import Expositions, MetricsServer, Probe
from .model.inputs import CycleJoin
from .model.processes import PROCESSES
from .model.snapshot import SNAPSHOT, Snapshot
from .model.usage import Usage, UsageAccountant
from .remediation.contract import RemediationReport

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Sources:
    """What the agent collects from, in cycle order: the devices first, then the collectors
    (each may read what those before it found), then those that read the joined snapshot."""

    devices: DeviceCollector
    collectors: tuple[Collector[object], ...] = ()
    after_join: tuple[Collector[object], ...] = ()

    @property
    def all(self) -> tuple[Collector[object], ...]:
        return (self.devices, *self.collectors, *self.after_join)

    def get(self, name: str) -> Collector[object] | None:  # (rigs and tests look at a source)
        return next((c for c in self.all if c.name == name), None)


class RemediationOutput(Protocol):
    """Acts on the joined model (exporter.remediation.engine.Remediator) and reports back in a
    frozen RemediationReport; the agent never reads its internals."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def update(self, snap: Snapshot) -> None: ...
    def report(self) -> RemediationReport: ...


@dataclass(frozen=True)
class Outputs:
    """What the agent feeds: the health engine (observed every cycle; device events reach it
    directly), the renderer and the HTTP endpoint (``serve`` opens it with the agent's probes),
    the billing counters and the remediator. ``starvation`` is the agent's own CPU probe."""

    health: HealthEngine
    starvation: StarvationMonitor
    renderer: Renderer
    usage: UsageAccountant
    serve: Callable[[Probe, Probe], MetricsServer] | None = None
    remediation: RemediationOutput | None = None


class Agent:
    LIVENESS_FLOOR = 30.0  # no completed cycle for at least this long (and 6 intervals): sampler stuck
    EVENT_STALL = 60.0  # the device event thread's loop (a wait with a timeout) not turning this long: stuck
    FIRST_WAIT = 2.0  # seconds start() waits for sources' first data (the ResourceSlices' list)

    def __init__(self, cfg: Config, sources: Sources, outputs: Outputs, clock: Clock = SYSTEM) -> None:
        self.cfg = cfg
        self.src = sources
        self.out = outputs
        self.clock = clock
        self.health = outputs.health
        self.starvation = outputs.starvation
        self.expositions = Expositions(outputs.renderer)  # each cycle's state, rendered when a scrape asks
        self.server: MetricsServer | None = None
        self.status: dict[str, CollectorStatus] = {}
        self.snapshot: Snapshot | None = None
        self.found = Gathered()  # the last cycle's findings: the last good data of each source
        self.cycles = 0
        self._join = CycleJoin(cfg.node_name)
        self._per_process = any(c.slot is PROCESSES for c in sources.after_join)
        self._usage: Usage | None = None
        self._topology: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cycle_lock = threading.Lock()
        self._started = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, serve: bool = True) -> None:
        self.starvation.start()
        if serve and self.out.serve is not None:
            # First: /healthz answers and /readyz says "no device data yet" even while a
            # driver is slow to open or enumerate, instead of refusing connections.
            self.server = self.out.serve(self.readiness, self.liveness)
            self.server.serve_from(self.expositions)
            self.server.start()
        try:
            for c in self.src.all:
                c.start()
            if self.out.remediation is not None:
                self.out.remediation.start()
        except BaseException:
            if self.server is not None:
                self.server.stop()
                self.server = None
            raise
        deadline = time.monotonic() + self.FIRST_WAIT
        for c in self.src.all:
            c.await_first(deadline)
        self.run_cycle()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.interval + self.cfg.call_timeout + 2)
        parts: list[tuple[str, Callable[[], None]]] = [(c.name, c.stop) for c in reversed(self.src.all)]
        if self.out.remediation is not None:  # first: it acts on what the sources say
            parts.insert(0, (type(self.out.remediation).__name__, self.out.remediation.stop))
        for name, stop in parts:
            try:
                stop()
            except Exception:
                log.exception("stop_failed", part=name)
        if self.server is not None:
            self.server.stop()
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
    def _run(self, c: Collector[T], found: Gathered) -> Gathered:
        """Collect ``c``, timed and reported; on failure its last good result within ``keep_for``."""
        st = self.status.setdefault(c.name, CollectorStatus())
        t0 = time.perf_counter()
        try:
            value: T | None = c.collect(found)
        except Degraded as e:
            # The source answered with data it knows to be incomplete or old: use it, report it.
            st.failed(c.name, time.perf_counter() - t0, e, degraded=True)
            return found.with_value(c.slot, cast("T", e.result), fresh=True)  # a collector raises its own type
        except Exception as e:
            st.failed(c.name, time.perf_counter() - t0, e)
            kept = self.found.get(c.slot) if c.keep_for > 0 else None
            if kept is not None and (st.last_success is None or time.monotonic() - st.last_success > c.keep_for):
                log.warning("collector_data_expired", collector=c.name, grace_seconds=c.keep_for)
                kept = None
            return found.with_value(c.slot, kept, fresh=False)
        st.succeeded(c.name, time.perf_counter() - t0)
        return found.with_value(c.slot, value, fresh=True)

    def run_cycle(self) -> Snapshot:
        with self._cycle_lock:
            return self._run_cycle()

    def _run_cycle(self) -> Snapshot:
        t0 = time.perf_counter()
        found = Gathered()
        for c in (self.src.devices, *self.src.collectors):
            found = self._run(c, found)
        identities, readings = self._join.devices(found)
        uuids = [i.uuid for i in identities]
        if uuids != self._topology:
            self.health.set_topology(identities)
            self._topology = uuids
        self.health.observe(identities, readings)
        snap = self._join.join(found, self.clock.wall(), self.clock.monotonic(), identities, readings,
                               self.health.all_health())
        self.snapshot = snap
        rem = self.out.remediation
        if rem is not None:
            rem.update(snap)
            rep = rem.report()  # a refused write (401, 403, 422) fails it: /readyz says why
            self.status["remediation"] = CollectorStatus(success=rep.healthy, error=rep.problem,
                                                         last_success=time.monotonic() if rep.healthy else None)
        found = found.with_value(SNAPSHOT, snap, fresh=True)
        for c in self.src.after_join:
            found = self._run(c, found)
        self.found = found
        process_memory = found.get(PROCESSES) or {}
        try:
            self._usage = self.out.usage.update(snap, process_memory if self._per_process else None)
        except Exception:  # a bug in the accounting must not cost the cycle: keep the last totals
            log.exception("usage_accounting_failed")
        self.cycles += 1
        self.status["cycle"] = CollectorStatus(duration=time.perf_counter() - t0, success=True,
                                               last_success=time.monotonic())
        self.publish()
        return snap

    def publish(self) -> None:
        """Publish the cycle's state: rendered when a scrape asks for it (exporter/metrics/server.py)."""
        rep = self.out.remediation.report() if self.out.remediation is not None else None
        xid_counts, read_errors = self.health.counters()  # one consistent copy under the lock
        starved = self.starvation.state()
        state = RenderState(
            starved=starved.starved,
            scheduling_lag=starved.lag_seconds,
            snapshot=self.snapshot,
            xid_counts=xid_counts,
            read_errors=read_errors,
            collectors={n: (s.duration, s.success) for n, s in self.status.items() if n != "cycle"},
            sources={c.name: s for c in self.src.all if (s := c.stats()) is not None},
            last_collection=self.clock.wall(),
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
            process_memory=self.found.get(PROCESSES) or {},
            pod_label_allowlist=self.cfg.pod_label_allowlist,
            dcgm_compat=self.cfg.dcgm_compat_labels,
            excluded=self.cfg.exclude_metrics,
            http=self.server.stats() if self.server is not None else None,
            usage=self._usage,
        )
        self.expositions.publish(state)

    # -- probes ------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """Ready while device data is fresh (younger than three intervals).

        Kubernetes-side problems do not make the agent unready: device metrics are still worth
        scraping. They are listed in the body so ``kubectl describe`` and curl show them.
        """
        limit = 3 * self.cfg.interval + self.cfg.call_timeout
        dev = self.status.get(self.src.devices.name)
        problems = [
            f"{n}: {s.error}"
            for n, s in sorted(self.status.items())
            if not s.success and s.error and n != self.src.devices.name
        ]
        problems += [p for c in self.src.all for p in c.problems()]
        problems += self.snapshot.unpublished_notes() if self.snapshot is not None else []
        starved = self.starvation.state()
        if starved.starved:
            # The agent's problem, not a device's: late reads are not held against the GPUs.
            problems.append(f"agent starved of CPU: {starved.reason}; worst scheduling lag {starved.lag_seconds:.2f}s")
        if dev is None or dev.last_success is None:
            return False, "not ready: no successful device collection yet" + (
                f" ({dev.error})" if dev and dev.error else ""
            )
        if not self.expositions.published:  # devices read, the cycle not yet published: nothing to serve
            return False, "not ready: first collection cycle still running"
        if self.expositions.error is not None:  # a render failed: logged; the last good bytes are served
            if not self.expositions.rendered:
                return False, f"not ready: {self.expositions.error}"
            problems.append(f"{self.expositions.error}; serving the last metrics rendered")
        age = time.monotonic() - dev.last_success
        if age > limit:
            why = (f"not ready: last successful device collection {age:.1f}s ago (limit {limit:.1f}s): "
                   f"{dev.error or 'sampler stalled'}")
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
        limit = max(6 * self.cfg.interval, self.LIVENESS_FLOOR) + self.cfg.call_timeout * (self.src.devices.count + 3)
        cyc = self.status.get("cycle")
        last = cyc.last_success if cyc is not None and cyc.last_success is not None else self._started
        if self._thread is not None and now - last > limit:
            what = "since the agent started" if cyc is None else "ago"
            return False, (f"not alive: sampler stuck, last collection cycle completed {now - last:.0f}s {what} (limit "
                           f"{limit:.0f}s)")
        beat = self.src.devices.heartbeat()
        if beat is not None and now - beat > self.EVENT_STALL:
            return False, (f"not alive: device event thread stuck, last turn of its loop {now - beat:.0f}s ago (limit "
                           f"{self.EVENT_STALL:.0f}s)")
        return True, "ok"
