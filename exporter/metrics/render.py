"""Snapshot -> Prometheus exposition bytes, incrementally.

Rendering happens at most once per collection cycle, never per scrape, and only for a cycle
whose bytes something asks for (exporter/metrics/ondemand.py): the HTTP handler serves the last
rendered bytes. The collector below follows prometheus/client_python's custom-collector
pattern (``collect()`` yields metric families): prometheus_client's families, names, help and
types are the contract, and its ``generate_latest`` (text 0.0.4 and OpenMetrics 1.0) is the
oracle a property test compares our bytes with, byte for byte.

Why not call ``generate_latest`` every cycle: it re-validates and re-escapes every label of
every sample each time (~4,500 samples on a dense node, most of the cycle's CPU), while series
come and go rarely and only about a third of the values change between cycles. So the
:class:`Renderer` formats a series' ``name{labels} `` prefix once, when the series appears,
re-formats a sample only when its value changed, and forgets a series (or a whole family) as
soon as a cycle no longer yields it. It stays generic: any family the collector yields renders
without changes here; families built with :class:`Gauge`/:class:`Counter` (what ``_fam``
returns) take the fast path, anything else (histograms, timestamps, exemplars, ``_created``)
is rendered by prometheus_client itself, family by family.
"""

from __future__ import annotations

import gzip
import math
import operator
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .. import __version__
from ..catalog import BY_NAME, OUR_TAINT_SOURCE
from ..collect import SourceStats
from ..devices.model import DeviceIdentity
from ..model.snapshot import AllocationView, PublishedDevice, Snapshot
from ..model.usage import DeviceSplit, Usage
from . import escaping
from .webstats import HttpStats

# gzip level for /metrics, chosen by measurement on the dense node's ~600 KB body
# (bench/run.py gzip): level 1 costs about a third of level 5's CPU for a body ~25 % larger,
# and the body is compressed at most once per cycle per format, not per scrape.
GZIP_LEVEL = 1

# Device series that dcgm-exporter-compatible labels are added to (--dcgm-compat-labels).
COMPAT_LABELS = ("pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name")


Row = tuple[tuple[str, ...], Any]  # (label values, sample value): one sample of a fast-path family
# A series the renderer keeps: [value, text line, OpenMetrics line, text prefix, OpenMetrics prefix, label values]
Series = list[Any]
FamilyKey = tuple[str, str, tuple[str, ...]]  # (type, name, label names) of a fast-path family
Chunk = tuple[list[Row], str, str, list[Series]]  # a family's rows, its text and OpenMetrics bytes and its series in order, last render
Generic = tuple[list[Sample], str, str, str, str]  # (samples, help, unit, text, OpenMetrics) of another family


class TaintRuleView(Protocol):
    """What the renderer reads of a DeviceTaintRule the remediator holds (its report's rules)."""

    @property
    def driver(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def effect(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def uuid(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def value(self) -> str: ...


class PendingEvictionView(Protocol):
    """A NoExecute rule of the remediator and the pods still holding its device (its report's
    pending_eviction)."""

    @property
    def rule(self) -> str: ...
    @property
    def driver(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def pods(self) -> int: ...


@dataclass
class RenderState:
    """Everything a render needs besides the snapshot; each part owned by its producer.

    Published by the sampler each cycle and rendered later, on another thread, if a scrape asks
    (exporter/metrics/ondemand.py): every part must be immutable or a copy made for it, never a
    live object the next cycle changes."""

    snapshot: Snapshot | None = None
    xid_counts: Mapping[tuple[str, int], int] = field(default_factory=dict)
    read_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    collectors: Mapping[str, tuple[float, bool]] = field(default_factory=dict)
    sources: Mapping[str, SourceStats] = field(default_factory=dict)  # each source's own request counters
    last_collection: float | None = None
    cycles: int = 0
    taint_rules: tuple[TaintRuleView, ...] = ()
    pending_eviction: tuple[PendingEvictionView, ...] = ()  # one per NoExecute rule the remediator owns
    taint_actions: Mapping[str, int] = field(default_factory=dict)
    taint_suppressed: Mapping[str, int] = field(default_factory=dict)
    budget_exhausted: bool | None = None
    taint_writes_refused: int | None = None  # remediator: writes the API server refuses now
    remediation: tuple[str, bool] | None = None  # (mode, active); None: not known (tests)
    detection_latency: Any = None  # exporter.remediation.engine.Histogram
    process_memory: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (uuid, ns, pod) -> bytes
    pod_label_allowlist: tuple[str, ...] = ()
    dcgm_compat: bool = False
    excluded: frozenset[str] = frozenset()  # catalog names left out (--exclude-metrics)
    starved: bool | None = None  # the agent itself is starved of CPU (exporter.health.starvation)
    scheduling_lag: float | None = None  # worst scheduling lag of the agent's threads, seconds
    http: HttpStats | None = None  # the HTTP server's own counters (team endpoint); None when not serving
    usage: Usage | None = None  # billing totals and device splits (exporter.model.usage); None: not exported


_NO_STATE = RenderState()  # what the collector holds between renders
_second = operator.itemgetter(1)  # a row's value


class _RowFamily:
    """A prometheus_client family that records ``add_metric`` calls as (labels, value) rows.

    The renderer reads the rows directly. ``samples`` is still the library's: the first time
    anyone reads it, the rows are replayed through the parent class's own ``add_metric``, so
    ``generate_latest`` (the oracle), ``==`` and every other prometheus_client consumer see
    exactly the samples the plain family would hold. A call the fast path does not cover
    (timestamp, ``created``, exemplar, ``add_sample``) turns the family "plain": it becomes an
    ordinary prometheus_client family and is rendered by the library.
    """

    _base: Any  # the prometheus_client family class whose add_metric we defer

    def _init_rows(self, labels: Sequence[str]) -> None:
        # The label names, kept here: the library's own copy is a private attribute.
        self.label_names: tuple[str, ...] = tuple(labels)
        self._rows: list[Row] = []
        self._replayed = 0
        self.plain = False
        # -0.0 == 0.0 but the two print differently: a family holding one is never taken as
        # "unchanged" by list equality (see Renderer._fast).
        self.negative_zero = False

    @property
    def samples(self) -> list[Sample]:
        rows = self.__dict__.get("_rows")
        if rows is not None and self._replayed < len(rows):
            start, self._replayed = self._replayed, len(rows)
            for labels, value in rows[start:]:
                self._base.add_metric(self, labels, value)
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        self._samples = value

    def add_rows(self, rows: Iterable[Row]) -> None:
        """Many ``add_metric(labels, value)`` calls at once, labels already tuples: the dense
        node's claim and allocation families are thousands of samples, and a method call
        per sample was most of their cost."""
        if self.plain:
            for labels, value in rows:
                self.add_metric(labels, value)  # type: ignore[attr-defined]
            return
        start = len(self._rows)
        self._rows.extend(rows)
        self._see_zeros(list(map(_second, self._rows[start:])))

    def add_columns(self, labels: Sequence[tuple[str, ...]], values: Sequence[Any]) -> None:
        """``add_rows(zip(labels, values))``, for values that come as a column (the billing
        counters: ~1,500 a dense cycle): they need not be taken out of the rows again."""
        if self.plain:
            self.add_rows(zip(labels, values, strict=True))
            return
        self._rows.extend(zip(labels, values, strict=True))
        self._see_zeros(values)

    def _see_zeros(self, values: Sequence[Any]) -> None:
        # -0.0 is a zero: only a family with a zero value needs signs looked at, and whether it
        # has one is asked in C (the sequence's own ==): most families have none.
        if 0 in values and any(v.__class__ is float and not v and math.copysign(1.0, v) < 0 for v in values):
            self.negative_zero = True

    def _go_plain(self) -> None:
        self.samples  # noqa: B018 - replay the rows first, keeping the samples' order
        self.plain = True

    def add_sample(self, *args: Any, **kw: Any) -> None:
        self._go_plain()
        Metric.add_sample(self, *args, **kw)  # type: ignore[arg-type]


class Gauge(_RowFamily, GaugeMetricFamily):
    _base = GaugeMetricFamily

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        GaugeMetricFamily.__init__(self, name, documentation, labels=labels)
        self._init_rows(labels)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        if self.plain or timestamp is not None:
            self._go_plain()
            GaugeMetricFamily.add_metric(self, labels, value, timestamp)
        else:
            self._rows.append((tuple(labels), value))
            if not value and value.__class__ is float and math.copysign(1.0, value) < 0:
                self.negative_zero = True


class Counter(_RowFamily, CounterMetricFamily):
    _base = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        CounterMetricFamily.__init__(self, name, documentation, labels=labels)
        self._init_rows(labels)

    def add_metric(self, labels: Sequence[str], value: float, created: float | None = None, timestamp: Any = None, exemplar: Any = None) -> None:
        if self.plain or created is not None or timestamp is not None or exemplar is not None:
            self._go_plain()
            CounterMetricFamily.add_metric(self, labels, value, created, timestamp, exemplar)
        else:
            self._rows.append((tuple(labels), value))
            if not value and value.__class__ is float and math.copysign(1.0, value) < 0:
                self.negative_zero = True


# One validated family per (catalog name, extra labels), copied for each render: building ~60
# families through prometheus_client's constructors (name and label validation) every cycle was
# a fifth of a small node's cycle at a 1 s interval.
_PROTOTYPES: dict[tuple[str, tuple[str, ...]], Gauge | Counter] = {}


def _fam(name: str, extra_labels: tuple[str, ...] = ()) -> Gauge | Counter:
    proto = _PROTOTYPES.get((name, extra_labels))
    if proto is None:
        d = BY_NAME[name]
        labels = ["node", *d.labels, *extra_labels]
        if d.kind == "counter":
            # CounterMetricFamily appends _total itself; the catalog carries the full name.
            proto = Counter(name[: -len("_total")] if name.endswith("_total") else name, d.help, labels=labels)
        else:
            proto = Gauge(name, d.help, labels=labels)
        _PROTOTYPES[(name, extra_labels)] = proto
    fam = object.__new__(type(proto))
    attrs = fam.__dict__
    attrs.update(proto.__dict__)  # name, documentation, unit, type, label names; no rows, not plain
    attrs["_samples"] = []  # (what the samples setter and _init_rows would do, without the calls)
    attrs["_rows"] = []
    return fam


# (family, DeviceReading field): readings are in base units already (exporter.devices.model)
_READING_GAUGES: tuple[tuple[str, str], ...] = (
    ("gpu_utilization_ratio", "utilization_ratio"),
    ("gpu_memory_used_bytes", "memory_used_bytes"),
    ("gpu_memory_total_bytes", "memory_total_bytes"),
    ("gpu_power_watts", "power_watts"),
    ("gpu_energy_joules_total", "energy_joules"),
    ("gpu_temperature_celsius", "temperature_celsius"),
    ("gpu_memory_temperature_celsius", "memory_temperature_celsius"),
    ("gpu_sm_clock_hertz", "sm_clock_hertz"),
    ("gpu_memory_clock_hertz", "memory_clock_hertz"),
    ("gpu_clock_event_reasons", "clock_event_reasons"),
    ("gpu_sm_active_ratio", "sm_active_ratio"),
    ("gpu_sm_occupancy_ratio", "sm_occupancy_ratio"),
    ("gpu_tensor_active_ratio", "tensor_active_ratio"),
    ("gpu_dram_active_ratio", "dram_active_ratio"),
    ("gpu_retired_pages_total", "retired_pages_total"),
    ("gpu_row_remap_pending", "row_remap_pending"),
    ("gpu_row_remap_failure", "row_remap_failure"),
    ("gpu_pcie_replay_total", "pcie_replay_total"),
    ("gpu_recovery_action", "recovery_action"),
)

_LABEL_KEY_RE = re.compile(r"[^a-zA-Z0-9_]")


class SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.state = RenderState()
        # (node, the snapshot's allocations tuple, its dra_device_allocation_info rows)
        self._alloc_rows: tuple[str, tuple[AllocationView, ...], list[Row]] | None = None
        # (node, the devices' identities, their gpu_info rows)
        self._info: tuple[str, tuple[DeviceIdentity, ...], list[Row]] | None = None
        # (node, the usage's splits, their dra_pod_device_share_ratio rows)
        self._share_rows: tuple[str, tuple[DeviceSplit, ...], list[Row]] | None = None
        # (node, the snapshot's published devices, their driver taints' dra_device_taint_info rows)
        self._taint_rows: tuple[str, tuple[PublishedDevice, ...] | None, dict[tuple[str, ...], int]] | None = None
        # claims', pods' (node, keys of the usage totals, their label tuples)
        self._usage_keys: list[tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, str, str], ...]] | None] = [None, None]

    def collect(self) -> Iterator[Metric]:
        st = self.state
        if not st.excluded:
            yield from self._families(st)
            return
        for fam in self._families(st):
            # A counter family's name has no _total; the catalog's (and the user's) does.
            if fam.name not in st.excluded and f"{fam.name}_total" not in st.excluded:
                yield fam

    def _families(self, st: RenderState) -> Iterator[Metric]:
        snap = st.snapshot
        node = snap.node if snap else ""
        yield from self._self_metrics(node, st)
        if snap is None:
            return
        yield from self._devices(node, snap, st)
        yield from self._health(node, snap, st)
        yield from self._attribution(node, snap, st)
        yield from self._taints(node, snap, st)
        yield from self._remediation(node, st)

    # -- families ----------------------------------------------------------------------------
    def _self_metrics(self, node: str, st: RenderState) -> Iterable[Metric]:
        b = _fam("dra_gpu_exporter_build_info")
        b.add_metric([node, __version__], 1)
        yield b
        dur, ok = _fam("dra_gpu_exporter_collector_duration_seconds"), _fam("dra_gpu_exporter_collector_success")
        for name, (seconds, success) in sorted(st.collectors.items()):
            dur.add_metric([node, name], seconds)
            ok.add_metric([node, name], 1 if success else 0)
        yield dur
        yield ok
        if st.sources:
            yield from self._sources(node, st.sources)
        if st.last_collection is not None:
            t = _fam("dra_gpu_exporter_last_collection_timestamp_seconds")
            t.add_metric([node], st.last_collection)
            yield t
        c = _fam("dra_gpu_exporter_cycles_total")
        c.add_metric([node], st.cycles)
        yield c
        if st.starved is not None:
            sv = _fam("dra_gpu_exporter_starved")
            sv.add_metric([node], 1 if st.starved else 0)
            yield sv
        if st.scheduling_lag is not None:
            lag = _fam("dra_gpu_exporter_scheduling_lag_seconds")
            lag.add_metric([node], st.scheduling_lag)
            yield lag
        if st.http is not None:
            yield from self._http(node, st.http)

    def _sources(self, node: str, sources: Mapping[str, SourceStats]) -> Iterable[Metric]:
        req, err = _fam("dra_gpu_exporter_source_requests_total"), _fam("dra_gpu_exporter_source_errors_total")
        bad = _fam("dra_gpu_exporter_source_malformed_total")
        relist, restart = _fam("dra_gpu_exporter_source_relists_total"), _fam("dra_gpu_exporter_source_watch_restarts_total")
        watching = False
        for name, s in sorted(sources.items()):
            for verb, n in sorted(s.requests.items()):
                req.add_metric([node, name, verb], n)
            err.add_metric([node, name], s.errors)
            bad.add_metric([node, name], s.malformed)
            if "watch" in s.requests:  # only a watching source relists or restarts a watch
                watching = True
                relist.add_metric([node, name], s.relists)
                restart.add_metric([node, name], s.watch_restarts)
        yield from (req, err, bad, relist, restart) if watching else (req, err, bad)

    def _http(self, node: str, h: HttpStats) -> Iterable[Metric]:
        o = _fam("dra_gpu_exporter_http_connections_open")
        o.add_metric([node], h.connections_open)
        lim = _fam("dra_gpu_exporter_http_connection_limit")
        lim.add_metric([node], h.connection_limit)
        closed = _fam("dra_gpu_exporter_http_connections_rejected_total")
        closed.add_metric([node, "refused"], h.refused)
        closed.add_metric([node, "evicted"], h.evicted)
        closed.add_metric([node, "tls_failed"], h.tls_failed)
        to = _fam("dra_gpu_exporter_http_timeouts_total")
        for phase in ("idle", "header", "write", "tls_handshake"):
            to.add_metric([node, phase], h.timed_out.get(phase, 0))
        req = _fam("dra_gpu_exporter_http_requests_total")
        for code, n in sorted(h.requests.items()):
            req.add_metric([node, code], n)
        yield from (o, lim, closed, to, req)

    def _compat_rows(self, snap: Snapshot) -> dict[str, list[tuple[str, ...]]]:
        rows: dict[str, list[tuple[str, ...]]] = {}
        for a in snap.allocations:
            if not a.uuid:
                continue
            rows.setdefault(a.uuid, []).append(
                (a.pod, a.namespace, a.container, a.claim, a.namespace if a.claim else "", a.driver if a.claim else "", a.pool, a.device if a.claim else "")
            )
        return rows

    def _info_rows(self, node: str, snap: Snapshot) -> list[Row]:
        """gpu_info rows: made again only when the node's devices (identities) change."""
        idents = tuple(d.identity for d in snap.devices)
        cached = self._info
        if cached is not None and cached[0] == node and cached[1] == idents:
            return cached[2]
        gpu_index = {i.uuid: i.index for i in idents if not i.is_partition}
        out: list[Row] = []
        for i in idents:
            # index is the physical GPU's (a MIG instance's own index is a slot in its GPU)
            index = gpu_index.get(i.parent_uuid if i.is_partition else i.uuid)
            gi = "" if i.gpu_instance_id is None else str(i.gpu_instance_id)
            out.append(((node, i.uuid, i.vendor.value, i.model, i.pci_bus_id, i.driver_version, i.parent_uuid, i.mig_profile, "" if index is None else str(index), gi), 1))
        self._info = (node, idents, out)
        return out

    def _devices(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        info = _fam("gpu_info")
        info.add_rows(self._info_rows(node, snap))
        up = _fam("gpu_up")
        up.add_rows([((node, d.identity.uuid), 1 if d.up else 0) for d in snap.devices])
        read = [((node, d.identity.uuid), d.reading) for d in snap.devices if d.reading is not None and d.reading.ok]
        extra = COMPAT_LABELS if st.dcgm_compat else ()
        gauges = []
        if extra:
            # dcgm-compat: one sample per (device, pod) pair; the label tuples made once per
            # device, not once per sample
            compat = self._compat_rows(snap)
            empty = ("",) * len(extra)
            keyed = [([(*key, *ls) for ls in compat.get(key[1], [empty])], r) for key, r in read]
            for name, attr in _READING_GAUGES:
                g = _fam(name, extra)
                g.add_rows([(k, v) for keys, r in keyed if (v := getattr(r, attr)) is not None for k in keys])
                gauges.append(g)
        else:
            # One comprehension per family over the devices read (a loop of appends per device
            # and family cost twice as much). Values go in as read: the exposition prints an int
            # and its float alike, as prometheus_client does.
            for name, attr in _READING_GAUGES:
                g = _fam(name)
                g.add_rows([(key, v) for key, r in read if (v := getattr(r, attr)) is not None])
                gauges.append(g)
        ecc: list[Row] = []
        remap: list[Row] = []
        for key, r in read:
            uuid = key[1]
            if r.ecc_correctable_total is not None:
                ecc.append(((node, uuid, "correctable"), r.ecc_correctable_total))
            if r.ecc_uncorrectable_total is not None:
                ecc.append(((node, uuid, "uncorrectable"), r.ecc_uncorrectable_total))
            if r.remapped_rows_correctable is not None:
                remap.append(((node, uuid, "correctable"), r.remapped_rows_correctable))
            if r.remapped_rows_uncorrectable is not None:
                remap.append(((node, uuid, "uncorrectable"), r.remapped_rows_uncorrectable))
        ecc_fam = _fam("gpu_ecc_errors_total")
        ecc_fam.add_rows(ecc)
        remap_fam = _fam("gpu_remapped_rows_total")
        remap_fam.add_rows(remap)
        yield info
        yield up
        yield from gauges
        yield ecc_fam
        yield remap_fam
        errs = _fam("gpu_read_errors_total")
        for (uuid, reason), n in sorted(st.read_errors.items()):
            errs.add_metric([node, uuid, reason], n)
        yield errs
        pm = _fam("gpu_process_memory_used_bytes")
        for (uuid, ns, pod), n in sorted(st.process_memory.items()):
            pm.add_metric([node, uuid, ns, pod], n)
        yield pm

    def _health(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        healthy = _fam("gpu_healthy")
        cond = _fam("gpu_health_condition")
        healthy.add_rows([((node, d.uuid), 1 if d.health.healthy else 0) for d in snap.devices])
        for d in snap.devices:
            h = d.health
            if not h.conditions and not h.advisories:
                continue
            seen = set()
            # advisories (reading_stuck) are conditions to see, never to act on: same series
            for c in h.conditions + h.advisories if h.advisories else h.conditions:
                key = (c.tier.value, c.reason)
                if key in seen:  # a MIG instance inherits its parent's conditions; one series each
                    continue
                seen.add(key)
                cond.add_metric([node, d.uuid, c.tier.value, c.reason], 1)
        yield healthy
        yield cond
        xid = _fam("gpu_xid_errors_total")
        for (uuid, code), n in sorted(st.xid_counts.items()):
            xid.add_metric([node, uuid, str(code)], n)
        yield xid
        if snap.reported is not None:  # --kubelet-device-health: without it the family is absent
            rep = _fam("dra_device_reported_health")
            rep.add_rows([((node, r.driver, r.pool, r.device, r.uuid, r.health), 1) for r in snap.reported])
            yield rep

    def _attribution(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        alloc = _fam("dra_device_allocation_info")
        cached = self._alloc_rows
        if cached is None or cached[0] != node or cached[1] is not snap.allocations:
            # The join hands back the very same allocation tuple while nothing moved (JoinMemo):
            # the rows are built when it changes, not every cycle.
            alloc_rows: list[Row] = [((node, a.driver, a.pool, a.device, a.uuid, a.namespace, a.pod, a.container, a.claim), 1) for a in snap.allocations]
            cached = self._alloc_rows = (node, snap.allocations, alloc_rows)
        alloc.add_rows(cached[2])
        yield alloc
        # One comprehension per family over (label values, claim) pairs: a dense node's 512
        # claims make 3,584 rows a cycle, and a loop of appends cost twice as much. ClaimView is
        # a named tuple; c[5:10] are its figures (utilization, memory used and total, power,
        # healthy).
        claims = snap.claims
        keyed = [((node, c[0], c[1]), c) for c in claims]
        for name, claim_rows in (
            ("dra_claim_devices", [(k, len(c[2])) for k, c in keyed]),
            ("dra_claim_pods", [(k, len(c[4])) for k, c in keyed]),
            ("dra_claim_utilization_ratio", [(k, c[5]) for k, c in keyed if c[5] is not None]),
            ("dra_claim_memory_used_bytes", [(k, c[6]) for k, c in keyed if c[6] is not None]),
            ("dra_claim_memory_total_bytes", [(k, c[7]) for k, c in keyed if c[7] is not None]),
            ("dra_claim_power_watts", [(k, c[8]) for k, c in keyed if c[8] is not None]),
            ("dra_claim_healthy", [(k, 1 if c[9] else 0) for k, c in keyed]),
        ):
            fam = _fam(name)
            fam.add_rows(claim_rows)
            yield fam
        if st.usage is not None:
            yield from self._usage(node, st.usage)
        for name, counts in (("dra_unresolved_devices", snap.unresolved), ("dra_unpublished_devices", snap.unpublished)):
            fam = _fam(name)
            fam.add_rows([((node, drv), n) for drv, n in sorted(counts.items())])
            yield fam
        if st.pod_label_allowlist:
            keys = st.pod_label_allowlist
            lbl = Gauge(
                "dra_pod_labels",
                BY_NAME["dra_pod_labels"].help,
                labels=["node", "namespace", "pod", *("label_" + _LABEL_KEY_RE.sub("_", k) for k in keys)],
            )
            for ns, pod in sorted({(a.namespace, a.pod) for a in snap.allocations}):
                labels = snap.pod_labels.get((ns, pod), {})
                lbl.add_metric([node, ns, pod, *(labels.get(k, "") for k in keys)], 1)
            yield lbl

    def _usage(self, node: str, u: Usage) -> Iterable[Metric]:
        """The billing counters and the split of each held device (exporter/model/usage.py)."""
        claims, pods = self._usage_labels(node, u.claims.keys, 0), self._usage_labels(node, u.pods.keys, 1)
        # every value of these moves each cycle: zipped in C onto label tuples made once per key set
        for name, labels, values in (
            ("dra_claim_energy_joules_total", claims, u.claims.joules),
            ("dra_claim_device_seconds_total", claims, u.claims.seconds),
            ("dra_pod_energy_joules_total", pods, u.pods.joules),
            ("dra_pod_device_seconds_total", pods, u.pods.seconds),
        ):
            fam = _fam(name)
            fam.add_columns(labels, values)
            yield fam
        cached = self._share_rows
        if cached is None or cached[0] != node or cached[1] is not u.splits:
            # The splits change when holders or per-process memory do, not every cycle.
            shares: dict[tuple[str, ...], float] = {}
            for sp in u.splits:
                for _claim, (ns, pod), share in sp.usage:  # a pod holding the device twice: one series
                    key = (node, sp.uuid, ns, pod, sp.rule)
                    shares[key] = shares.get(key, 0.0) + share
            cached = self._share_rows = (node, u.splits, list(shares.items()))
        share_fam = _fam("dra_pod_device_share_ratio")
        share_fam.add_rows(cached[2])
        yield share_fam

    def _usage_labels(self, node: str, keys: tuple[tuple[str, str], ...], which: int) -> tuple[tuple[str, str, str], ...]:
        """(node, namespace, claim or pod) label tuples of a Totals' keys, remade when the keys change."""
        cached = self._usage_keys[which]
        if cached is None or cached[0] != node or cached[1] is not keys:
            cached = self._usage_keys[which] = (node, keys, tuple((node, k[0], k[1]) for k in keys))
        return cached[2]

    def _taints(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        """Every taint on this node's devices, by source: the drivers' (in their slices) and ours."""
        cached = self._taint_rows
        if cached is None or cached[0] != node or cached[1] is not snap.published:
            # The join hands back the very same published tuple while the slices stand still.
            rows: dict[tuple[str, ...], int] = {
                (node, p.driver, p.pool, p.device, p.uuid, t.key, t.value, t.effect, p.driver): 1 for p in snap.published or () for t in p.taints
            }
            cached = self._taint_rows = (node, snap.published, rows)
        rows = dict(cached[2])
        rows.update(((node, r.driver, r.pool, r.device, r.uuid, r.key, r.value, r.effect, OUR_TAINT_SOURCE), 1) for r in st.taint_rules)
        fam = _fam("dra_device_taint_info")
        fam.add_rows(list(rows.items()))
        yield fam

    def _remediation(self, node: str, st: RenderState) -> Iterable[Metric]:
        rules = _fam("dra_device_taint_rule")
        for r in st.taint_rules:
            rules.add_metric([node, r.driver, r.pool, r.device, r.effect, r.tier], 1)
        yield rules
        pending = _fam("dra_taint_pods_pending_eviction")
        for p in st.pending_eviction:
            pending.add_metric([node, p.rule, p.driver, p.pool, p.device], p.pods)
        yield pending
        acts = _fam("dra_gpu_exporter_taint_actions_total")
        for a, n in sorted(st.taint_actions.items()):
            acts.add_metric([node, a], n)
        yield acts
        sup = _fam("dra_gpu_exporter_taint_suppressed_total")
        for a, n in sorted(st.taint_suppressed.items()):
            sup.add_metric([node, a], n)
        yield sup
        h = st.detection_latency
        if h is not None:
            fam = HistogramMetricFamily(
                "dra_gpu_exporter_detection_to_taint_seconds", BY_NAME["dra_gpu_exporter_detection_to_taint_seconds"].help, labels=["node"]
            )
            cum, buckets = 0, []
            for bound, n in zip([*h.buckets, float("inf")], h.counts, strict=False):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            fam.add_metric([node], buckets, h.sum)
            yield fam
        if st.budget_exhausted is not None:
            b = _fam("dra_gpu_exporter_taint_budget_exhausted")
            b.add_metric([node], 1 if st.budget_exhausted else 0)
            yield b
        if st.taint_writes_refused is not None:
            w = _fam("dra_gpu_exporter_taint_writes_refused")
            w.add_metric([node], st.taint_writes_refused)
            yield w
        if st.remediation is not None:
            active = _fam("dra_gpu_exporter_remediation_active")
            active.add_metric([node, st.remediation[0]], 1 if st.remediation[1] else 0)
            yield active


# The four forms of an exposition, by the name of the property that gives it.
Form = Literal["body", "openmetrics", "gzipped", "openmetrics_gzipped"]
FORMS: tuple[Form, ...] = ("body", "openmetrics", "gzipped", "openmetrics_gzipped")
_GZIPPED_OF: dict[str, Form] = {"gzipped": "body", "openmetrics_gzipped": "openmetrics"}  # compressed form -> what it compresses


class Exposition:
    """One cycle's bytes: the text format (0.0.4) and OpenMetrics 1.0, each also gzipped.

    A render hands over each format's pieces; a body is joined from them on first use, and each
    gzipped form compressed on first use, then kept: each costs at most once per cycle (never
    per scrape), and only for the formats that are actually scraped. Prometheus asks for one of
    the four (OpenMetrics, gzipped, by default), so joining the other body every cycle was
    wasted: 0.1-0.3 ms of a dense node's cycle.
    """

    __slots__ = ("_done", "_lock", "_parts", "gzip_level")

    def __init__(self, body: bytes, openmetrics: bytes | None = None, gzip_level: int = GZIP_LEVEL, gzipped: bytes | None = None, openmetrics_gzipped: bytes | None = None) -> None:
        done = {"body": body, "openmetrics": openmetrics if openmetrics is not None else body, "gzipped": gzipped, "openmetrics_gzipped": openmetrics_gzipped}
        self._setup(gzip_level, {k: v for k, v in done.items() if v is not None}, {})

    @classmethod
    def of_parts(cls, text: list[str], openmetrics: list[str], gzip_level: int = GZIP_LEVEL) -> Exposition:
        """The exposition whose bodies are these strings joined (UTF-8), when first asked for."""
        exp = cls.__new__(cls)
        exp._setup(gzip_level, {}, {"body": text, "openmetrics": openmetrics})
        return exp

    def _setup(self, gzip_level: int, done: dict[str, bytes], parts: dict[str, list[str]]) -> None:
        self.gzip_level = gzip_level
        self._done = done  # bodies (and gzipped forms) made so far
        self._parts = parts  # the pieces of the bodies not joined yet
        self._lock = threading.RLock()  # a gzipped body first joins its body, under the same lock

    def _get(self, which: str) -> bytes:
        data = self._done.get(which)
        if data is None:
            with self._lock:  # concurrent first scrapers wait for one join or compression, not ten
                data = self._done.get(which)
                if data is None:
                    if which in _GZIPPED_OF:
                        data = gzip.compress(self._get(_GZIPPED_OF[which]), compresslevel=self.gzip_level, mtime=0)
                    else:
                        data = "".join(self._parts.pop(which)).encode("utf-8")
                    self._done[which] = data
        return data

    def get(self, form: Form) -> bytes:
        """One of the four forms, made now if it is not yet (joined, or compressed: milliseconds)."""
        return self._get(form)

    def ready(self, form: Form) -> bool:
        """Whether ``form`` is made already: reading it costs nothing."""
        return form in self._done

    @property
    def body(self) -> bytes:
        return self._get("body")

    @property
    def openmetrics(self) -> bytes:
        return self._get("openmetrics")

    @property
    def gzipped(self) -> bytes:
        return self._get("gzipped")

    @property
    def openmetrics_gzipped(self) -> bytes:
        return self._get("openmetrics_gzipped")


class _One(Collector):
    """A registry of one family, to let prometheus_client render a family we do not fast-path."""

    def __init__(self, fam: Metric) -> None:
        self.fam = fam

    def collect(self) -> list[Metric]:
        return [self.fam]


_OM_EOF = "# EOF\n"
# prometheus_client leaves these two unannotated; typed here once instead of at every call.
_om_generate_latest: Callable[[Collector], bytes] = om_generate_latest
_go_float: Callable[[float], str] = floatToGoString
_label_name, _label_value = escaping.label_name, escaping.label_value


def _label_str(labelnames: tuple[str, ...], labels: tuple[str, ...]) -> str:
    # The same escaping and ordering as prometheus_client's two generate_latest (label values
    # escape backslash, newline and double quote; names sorted; exporter.metrics.escaping).
    # Identical for both formats.
    if not labelnames or not labels:
        return ""
    items = sorted(dict(zip(labelnames, labels, strict=False)).items())
    return "{" + ",".join(f'{_label_name(k)}="{_label_value(v)}"' for k, v in items) + "}"


class Renderer:
    """Owns the registry; ``render()`` turns the current state into cached bytes, incrementally."""

    def __init__(self, registry: CollectorRegistry | None = None, gzip_level: int = GZIP_LEVEL) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.gzip_level = gzip_level
        # (type, name, labelnames) -> {label values: series}; only what the last render yielded
        self._series: dict[FamilyKey, dict[tuple[str, ...], Series]] = {}
        # (type, name, labelnames) -> (rows, text chunk, OpenMetrics chunk) of the last render
        self._chunks: dict[FamilyKey, Chunk] = {}
        # (type, name) -> (samples, documentation, unit, text, OpenMetrics) of other families
        self._generic_last: dict[tuple[str, str], Generic] = {}
        self._headers: dict[tuple[Any, ...], tuple[str, str, str, str]] = {}

    def render(self, state: RenderState) -> Exposition:
        """``state``'s exposition. One caller at a time (exporter/metrics/ondemand.py holds a
        lock around it): the caches below carry over from one render to the next."""
        self.collector.state = state
        try:
            return self.render_families(self.registry.collect())
        finally:
            # Rendered on demand, a state may be many cycles old by the next render: keep none.
            self.collector.state = _NO_STATE

    def render_families(self, families: Iterable[Metric]) -> Exposition:
        """The exposition of ``families`` (what ``generate_latest`` would make of a registry
        yielding them), reusing what the previous call formatted."""
        text: list[str] = []
        om: list[str] = []
        series: dict[FamilyKey, dict[tuple[str, ...], Series]] = {}
        chunks: dict[FamilyKey, Chunk] = {}
        generic: dict[tuple[str, str], Generic] = {}
        # value -> its text, for this render: claims on the same devices share their figures,
        # so a dense node's 512 claims have a few dozen distinct values per family
        formatted: dict[Any, str] = {}
        for fam in families:
            if isinstance(fam, (Gauge, Counter)) and not fam.plain:
                self._fast(fam, text, om, series, chunks, formatted)
            else:
                self._generic(fam, text, om, generic)
        om.append(_OM_EOF)
        # Series and families not yielded this time are dropped here, at once.
        self._series, self._chunks, self._generic_last = series, chunks, generic
        if len(self._headers) > 4 * len(series) + 64:  # families with changing help or labels
            self._headers.clear()
        return Exposition.of_parts(text, om, self.gzip_level)

    def _generic(self, fam: Metric, text: list[str], om: list[str], generic: dict[tuple[str, str], Generic]) -> None:
        """A family outside the fast path, rendered by prometheus_client itself; its bytes are
        kept while its samples stay equal (a histogram changes only when a taint is written)."""
        key = (fam.type, fam.name)
        samples = list(fam.samples)
        last = self._generic_last.get(key)
        if (
            last is not None
            and key not in generic
            and last[0] == samples
            and last[1] == fam.documentation
            and last[2] == fam.unit
            and not any(s.value.__class__ is float and not s.value and math.copysign(1.0, s.value) < 0 for s in samples)
        ):
            generic[key] = last
        else:
            one = _One(fam)
            om_text: str = _om_generate_latest(one).decode("utf-8")
            last = (samples, fam.documentation, fam.unit, generate_latest(one).decode("utf-8"), om_text[: -len(_OM_EOF)])
            generic.setdefault(key, last)
        text.append(last[3])
        om.append(last[4])

    def _header(self, fam: Metric, hkey: tuple[Any, ...]) -> tuple[str, str, str, str]:
        """(text header, OpenMetrics header, text sample name, OpenMetrics sample name)."""
        h = self._headers.get(hkey)
        if h is None:
            name, mtype = fam.name, fam.type
            sample = name + "_total" if mtype == "counter" else name
            tname = escaping.metric_name(sample)
            text = f"# HELP {tname} {escaping.help_text(fam.documentation)}\n# TYPE {tname} {mtype}\n"
            oname = escaping.metric_name(name)
            om = f"# HELP {oname} {escaping.help_openmetrics(fam.documentation)}\n# TYPE {oname} {mtype}\n"
            if fam.unit:
                om += f"# UNIT {oname} {fam.unit}\n"
            h = self._headers[hkey] = (text, om, tname, escaping.openmetrics_sample_name(sample))
        return h

    def _fast(
        self,
        fam: Gauge | Counter,
        text: list[str],
        om: list[str],
        series: dict[FamilyKey, dict[tuple[str, ...], Series]],
        chunks: dict[FamilyKey, Chunk],
        formatted: dict[Any, str],
    ) -> None:
        labelnames = fam.label_names
        key = (fam.type, fam.name, labelnames)
        text_header, om_header, tname, oname = self._header(fam, (*key, fam.documentation, fam.unit))
        text.append(text_header)
        om.append(om_header)
        rows = fam._rows
        last = self._chunks.get(key)
        if last is not None and key not in series and not fam.negative_zero and last[0] == rows:
            # Most families do not change between cycles (info, allocation, claim and health
            # series): one list comparison in C instead of a look-up per sample. Equal values
            # print equally, except 0.0/-0.0 (excluded above) .
            series[key] = self._series[key]
            chunks[key] = last
            text.append(last[1])
            om.append(last[2])
            return
        # A series is [value, text line, OpenMetrics line, text prefix, OpenMetrics prefix,
        # label values]. The two formats' sample lines differ only when the sample name escapes
        # differently (never for legacy names), so usually one list of lines serves both bodies.
        same = tname == oname
        lines: list[str] = []
        om_lines = lines if same else []
        order: list[Series] | None = None
        if last is not None and key not in series and len(last[3]) == len(rows):
            # The same series as last time, in the same order (a family whose values moved):
            # walk them side by side, no look-up per sample. Any other label falls back below.
            order = last[3]
            put, om_put, known = lines.append, om_lines.append, formatted.get
            for kept, (labels, value) in zip(order, rows, strict=False):  # equal lengths, checked above
                if labels is not kept[5] and labels != kept[5]:
                    order = None
                    break
                if value != kept[0] or not value:
                    # _set_value, inlined: a dense node's counters and figures move on ~1,700
                    # series a cycle, and a call per moved sample was a fifth of this loop
                    vt = known(value) if value else None
                    if vt is None:
                        vt = _go_float(value) + "\n"
                        if value:
                            formatted[value] = vt
                    kept[0] = value
                    kept[1] = moved = kept[3] + vt
                    kept[2] = moved if same else kept[4] + vt
                    put(moved)
                else:
                    put(kept[1])
                if not same:
                    om_put(kept[2])
        if order is not None:
            series[key] = self._series[key]
        else:
            lines.clear()
            om_lines.clear()
            order = []
            prev = self._series.get(key, {})
            cur = series.get(key)
            if cur is None:
                cur = series[key] = {}
            add, om_add, keep = lines.append, om_lines.append, order.append
            get, pget = cur.get, prev.get
            for labels, value in rows:
                s = get(labels)
                if s is None:
                    s = pget(labels)
                    if s is None:
                        ls = _label_str(labelnames, labels)
                        s = [None, "", "", f"{tname}{ls} ", f"{oname}{ls} ", labels]
                    cur[labels] = s
                if value != s[0] or not value:
                    _set_value(s, value, formatted, same)
                add(s[1])
                keep(s)
                if not same:
                    om_add(s[2])
        chunk = "".join(lines)
        om_chunk = chunk if same else "".join(om_lines)
        text.append(chunk)
        om.append(om_chunk)
        if not fam.negative_zero and key not in chunks:
            chunks[key] = (rows, chunk, om_chunk, order)


def _set_value(s: Series, value: Any, formatted: dict[Any, str], same: bool) -> None:
    """A series' new value and its sample lines. Called for a changed value, and always for 0:
    0.0 == -0.0 but they print differently (so zeros are not memoised either); NaN never equals
    itself; a new series' None equals no number. ``formatted``: value -> its text and line
    feed, for this render."""
    t = formatted.get(value) if value else None
    if t is None:
        t = _go_float(value) + "\n"
        if value:
            formatted[value] = t
    s[0] = value
    s[1] = line = s[3] + t
    s[2] = line if same else s[4] + t
