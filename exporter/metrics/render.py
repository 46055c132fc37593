"""Snapshot -> Prometheus exposition bytes.

The collector below follows prometheus/client_python's custom-collector pattern (``collect()``
yields metric families): prometheus_client's families, names, help and types are the contract,
and its ``generate_latest`` (text 0.0.4 and OpenMetrics 1.0) is the oracle a property test
compares our bytes with, byte for byte (tests/test_render_oracle.py).

A cycle is rendered at most once, and only when a scrape asks for it (``Expositions`` in
exporter/metrics/server.py). The :class:`Renderer` is a plain formatter: a header per family
and a ``name{labels} `` prefix per series are formatted once and kept while the family or
series lives; each value is written with prometheus_client's public ``floatToGoString``; one
body per format; gzip on the first request of a format. Why not ``generate_latest`` itself: it
re-validates and re-escapes every label of every sample each time, which takes the 8-GPU node
over its CPU budget. Families built with :class:`Gauge`/:class:`Counter` (what ``_fam`` returns)
take this path; anything else (histograms, timestamps, exemplars, ``_created``) is rendered by
prometheus_client itself, family by family.
"""

from __future__ import annotations

import copy
import gzip
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .. import __version__
from ..catalog import BY_NAME, OUR_TAINT_SOURCE
from ..collect import SourceStats
from ..devices.model import DeviceIdentity
from ..model.snapshot import Snapshot
from ..model.usage import Usage
from . import escaping
from .webstats import HttpStats

# gzip level for /metrics, chosen by measurement on the dense node's ~600 KB body
# (bench/run.py gzip): level 1 costs about a third of level 5's CPU for a body ~25 % larger,
# and the body is compressed at most once per cycle per format, not per scrape.
GZIP_LEVEL = 1

# Device series that dcgm-exporter-compatible labels are added to (--dcgm-compat-labels).
COMPAT_LABELS = (
    "pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace",
    "dra_driver_name", "dra_pool_name", "dra_device_name",
)

Row = tuple[tuple[str, ...], Any]  # (label values, sample value): one sample of a Gauge or Counter
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
    (``Expositions``, exporter/metrics/server.py): every part must be immutable or a copy made for it, never a
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
    detection_latency: Any = None  # exporter.remediation.contract.HistogramSnapshot
    process_memory: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (uuid, ns, pod) -> bytes
    pod_label_allowlist: tuple[str, ...] = ()
    dcgm_compat: bool = False
    excluded: frozenset[str] = frozenset()  # catalog names left out (--exclude-metrics)
    starved: bool | None = None  # the agent itself is starved of CPU (exporter.health.starvation)
    scheduling_lag: float | None = None  # worst scheduling lag of the agent's threads, seconds
    http: HttpStats | None = None  # the HTTP server's own counters (team endpoint); None when not serving
    usage: Usage | None = None  # billing totals and device splits (exporter.model.usage); None: not exported


_NO_STATE = RenderState()  # what the collector holds between renders


class _RowFamily:
    """A prometheus_client family that keeps ``add_metric(labels, value)`` calls as rows.

    The renderer reads the rows. ``samples`` is still the library's: when anyone reads it, the
    rows not yet seen are replayed through the parent class's own ``add_metric``, so
    ``generate_latest`` (the oracle) and every other prometheus_client consumer see exactly
    the samples the plain family would hold. A call with a timestamp, ``created`` or exemplar,
    or ``add_sample``, makes it an ordinary prometheus_client family (``rows`` None), which the
    renderer hands to the library.
    """

    _base: Any  # the prometheus_client family class whose add_metric we defer

    def _init_rows(self, labels: Sequence[str]) -> None:
        self.label_names: tuple[str, ...] = tuple(labels)  # (the library's copy is private)
        self.rows: list[Row] | None = []
        self._replayed = 0

    @property
    def samples(self) -> list[Any]:
        rows = self.__dict__.get("rows")
        if rows and self._replayed < len(rows):
            start, self._replayed = self._replayed, len(rows)
            for labels, value in rows[start:]:
                self._base.add_metric(self, labels, value)
        return self._samples

    @samples.setter
    def samples(self, value: list[Any]) -> None:
        self._samples = value

    def add_rows(self, rows: Iterable[Row]) -> None:
        """Many ``add_metric(labels, value)`` calls at once, labels already tuples."""
        if self.rows is None:
            for labels, value in rows:
                self._base.add_metric(self, labels, value)
        else:
            self.rows.extend(rows)

    def _go_plain(self) -> None:
        self.samples  # noqa: B018 - replay the rows first, keeping the samples' order
        self.rows = None

    def add_sample(self, *args: Any, **kw: Any) -> None:
        self._go_plain()
        Metric.add_sample(self, *args, **kw)  # type: ignore[arg-type]


class Gauge(_RowFamily, GaugeMetricFamily):
    _base = GaugeMetricFamily

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        GaugeMetricFamily.__init__(self, name, documentation, labels=labels)
        self._init_rows(labels)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        if self.rows is None or timestamp is not None:
            self._go_plain()
            GaugeMetricFamily.add_metric(self, labels, value, timestamp)
        else:
            self.rows.append((tuple(labels), value))


class Counter(_RowFamily, CounterMetricFamily):
    _base = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        CounterMetricFamily.__init__(self, name, documentation, labels=labels)
        self._init_rows(labels)

    def add_metric(
        self, labels: Sequence[str], value: float, created: float | None = None, timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        if self.rows is None or created is not None or timestamp is not None or exemplar is not None:
            self._go_plain()
            CounterMetricFamily.add_metric(self, labels, value, created, timestamp, exemplar)
        else:
            self.rows.append((tuple(labels), value))


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
            proto = Counter(name.removesuffix("_total"), d.help, labels=labels)
        else:
            proto = Gauge(name, d.help, labels=labels)
        _PROTOTYPES[(name, extra_labels)] = proto
    fam = copy.copy(proto)
    fam.__dict__.update(_samples=[], rows=[], _replayed=0)
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
    """The metric contract: every family the agent exports, from one RenderState."""

    def __init__(self) -> None:
        self.state = RenderState()

    def collect(self) -> Iterator[Metric]:
        st = self.state
        excluded = st.excluded
        for fam in self._families(st):
            # --exclude-metrics, applied here, where the families are collected. A counter
            # family's name has no _total; the catalog's (and the user's) does.
            if not excluded or (fam.name not in excluded and f"{fam.name}_total" not in excluded):
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
        relist, restart = (
            _fam("dra_gpu_exporter_source_relists_total"),
            _fam("dra_gpu_exporter_source_watch_restarts_total"),
        )
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
                (a.pod, a.namespace, a.container, a.claim, a.namespace if a.claim else "", a.driver if a.claim else "",
                 a.pool, a.device if a.claim else "")
            )
        return rows

    def _info_rows(self, node: str, idents: Sequence[DeviceIdentity]) -> list[Row]:
        gpu_index = {i.uuid: i.index for i in idents if not i.is_partition}
        out: list[Row] = []
        for i in idents:
            # index is the physical GPU's (a MIG instance's own index is a slot in its GPU)
            index = gpu_index.get(i.parent_uuid if i.is_partition else i.uuid)
            gi = "" if i.gpu_instance_id is None else str(i.gpu_instance_id)
            labels = (i.uuid, i.vendor.value, i.model, i.pci_bus_id, i.driver_version, i.parent_uuid, i.mig_profile)
            out.append(((node, *labels, "" if index is None else str(index), gi), 1))
        return out

    def _devices(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        info = _fam("gpu_info")
        info.add_rows(self._info_rows(node, [d.identity for d in snap.devices]))
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
        throttle: list[Row] = []
        for key, r in read:
            uuid = key[1]
            throttle.extend(((node, uuid, reason), s) for reason, s in r.throttle_seconds.items())
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
        throttle_fam = _fam("gpu_clock_throttle_seconds_total")
        throttle_fam.add_rows(throttle)
        yield info
        yield up
        yield from gauges
        yield ecc_fam
        yield remap_fam
        yield throttle_fam
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
        alloc.add_rows(
            [((node, a.driver, a.pool, a.device, a.uuid, a.namespace, a.pod, a.container, a.claim), 1)
             for a in snap.allocations]
        )
        yield alloc
        keyed = [((node, c.namespace, c.name), c) for c in snap.claims]
        for name, claim_rows in (
            ("dra_claim_devices", [(k, len(c.devices)) for k, c in keyed]),
            ("dra_claim_pods", [(k, len(c.pods)) for k, c in keyed]),
            ("dra_claim_utilization_ratio", [(k, c.utilization) for k, c in keyed if c.utilization is not None]),
            ("dra_claim_memory_used_bytes", [(k, m) for k, c in keyed if (m := c.memory_used_bytes) is not None]),
            ("dra_claim_memory_total_bytes", [(k, m) for k, c in keyed if (m := c.memory_total_bytes) is not None]),
            ("dra_claim_power_watts", [(k, c.power_watts) for k, c in keyed if c.power_watts is not None]),
            ("dra_claim_healthy", [(k, 1 if c.healthy else 0) for k, c in keyed]),
        ):
            fam = _fam(name)
            fam.add_rows(claim_rows)
            yield fam
        if st.usage is not None:
            yield from self._usage(node, st.usage)
        for name, counts in (("dra_unresolved_devices", snap.unresolved),
                             ("dra_unpublished_devices", snap.unpublished)):
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
        claims = [(node, ns, name) for ns, name in u.claims.keys]
        pods = [(node, ns, pod) for ns, pod in u.pods.keys]
        for name, labels, values in (
            ("dra_claim_energy_joules_total", claims, u.claims.joules),
            ("dra_claim_device_seconds_total", claims, u.claims.seconds),
            ("dra_pod_energy_joules_total", pods, u.pods.joules),
            ("dra_pod_device_seconds_total", pods, u.pods.seconds),
        ):
            fam = _fam(name)
            fam.add_rows(zip(labels, values, strict=True))
            yield fam
        shares: dict[tuple[str, ...], float] = {}
        for sp in u.splits:
            for _claim, (ns, pod), share in sp.usage:  # a pod holding the device twice: one series
                key = (node, sp.uuid, ns, pod, sp.rule)
                shares[key] = shares.get(key, 0.0) + share
        share_fam = _fam("dra_pod_device_share_ratio")
        share_fam.add_rows(shares.items())
        yield share_fam

    def _taints(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        """Every taint on this node's devices, by source: the drivers' (in their slices) and ours."""
        rows = {(node, p.driver, p.pool, p.device, p.uuid, t.key, t.value, t.effect, p.driver): 1
                for p in snap.published or () for t in p.taints}
        rows.update(((node, r.driver, r.pool, r.device, r.uuid, r.key, r.value, r.effect, OUR_TAINT_SOURCE), 1)
                    for r in st.taint_rules)
        fam = _fam("dra_device_taint_info")
        fam.add_rows(rows.items())
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
                "dra_gpu_exporter_detection_to_taint_seconds",
                BY_NAME["dra_gpu_exporter_detection_to_taint_seconds"].help, labels=["node"]
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


# The four forms of an exposition.
Form = Literal["body", "openmetrics", "gzipped", "openmetrics_gzipped"]
_GZIPPED_OF: dict[str, str] = {"gzipped": "body", "openmetrics_gzipped": "openmetrics"}  # compressed form -> its body


class Exposition:
    """One cycle's bytes: the text format (0.0.4) and OpenMetrics 1.0, each gzipped on the
    first request for it, then kept (once per cycle and format, never per scrape)."""

    __slots__ = ("_forms", "_lock", "gzip_level")

    def __init__(self, body: bytes, openmetrics: bytes | None = None, gzip_level: int = GZIP_LEVEL) -> None:
        self._forms: dict[str, bytes] = {"body": body, "openmetrics": body if openmetrics is None else openmetrics}
        self._lock = threading.Lock()  # concurrent first scrapers wait for one compression, not ten
        self.gzip_level = gzip_level

    def get(self, form: Form) -> bytes:
        """One of the four forms, compressed now if it is not yet (milliseconds)."""
        data = self._forms.get(form)
        if data is None:
            with self._lock:
                data = self._forms.get(form)
                if data is None:
                    data = gzip.compress(self._forms[_GZIPPED_OF[form]], compresslevel=self.gzip_level, mtime=0)
                    self._forms[form] = data
        return data

    def ready(self, form: Form) -> bool:
        """Whether ``form`` is made already: reading it costs nothing."""
        return form in self._forms

    @property
    def body(self) -> bytes:
        return self._forms["body"]

    @property
    def openmetrics(self) -> bytes:
        return self._forms["openmetrics"]

    @property
    def gzipped(self) -> bytes:
        return self.get("gzipped")

    @property
    def openmetrics_gzipped(self) -> bytes:
        return self.get("openmetrics_gzipped")


class _One(Collector):
    """A registry of one family, to let prometheus_client render a family we do not format."""

    def __init__(self, fam: Metric) -> None:
        self.fam = fam

    def collect(self) -> list[Metric]:
        return [self.fam]


_OM_EOF = "# EOF\n"
# prometheus_client leaves these two unannotated; typed here once instead of at every call.
_om_generate_latest: Callable[[Collector], bytes] = om_generate_latest
_go_float: Callable[[float], str] = floatToGoString
_label_name, _label_value = escaping.label_name, escaping.label_value
Prefixes = dict[tuple[str, ...], tuple[str, str]]  # a family's label values -> (text, OpenMetrics) ``name{labels} ``


def _label_str(labelnames: tuple[str, ...], labels: tuple[str, ...]) -> str:
    # The same escaping and ordering as prometheus_client's two generate_latest (label values
    # escape backslash, newline and double quote; names sorted; exporter.metrics.escaping).
    # Identical for both formats.
    if not labelnames or not labels:
        return ""
    items = sorted(dict(zip(labelnames, labels, strict=False)).items())
    return "{" + ",".join(f'{_label_name(k)}="{_label_value(v)}"' for k, v in items) + "}"


class Renderer:
    """Families -> an :class:`Exposition`, keeping each family's header and each live series'
    ``name{labels} `` prefix from one render to the next. One caller at a time (the server's
    ``Expositions`` holds a lock around it)."""

    def __init__(self, gzip_level: int = GZIP_LEVEL) -> None:
        self.collector = SnapshotCollector()
        self.gzip_level = gzip_level
        # (type, name, help, unit) -> (text header, OpenMetrics header, text sample name, OpenMetrics sample name)
        self._headers: dict[tuple[str, str, str, str], tuple[str, str, str, str]] = {}
        self._prefixes: dict[tuple[Any, ...], Prefixes] = {}  # per family: its series of the last render

    def render(self, state: RenderState) -> Exposition:
        self.collector.state = state
        try:
            return self.render_families(self.collector.collect())
        finally:
            self.collector.state = _NO_STATE  # a state may be many cycles old by the next render: keep none

    def render_families(self, families: Iterable[Metric]) -> Exposition:
        """The exposition of ``families``: what ``generate_latest`` would make of a registry yielding them."""
        text: list[str] = []
        om: list[str] = []
        prefixes: dict[tuple[Any, ...], Prefixes] = {}
        for fam in families:
            rows = fam.rows if isinstance(fam, _RowFamily) else None
            if rows is None or not isinstance(fam, _RowFamily):
                text.append(generate_latest(_One(fam)).decode("utf-8"))
                om.append(_om_generate_latest(_One(fam)).decode("utf-8")[: -len(_OM_EOF)])
                continue
            text_header, om_header, tname, oname = self._header(fam)
            names = fam.label_names
            key = (tname, oname, names)
            last, cur = self._prefixes.get(key, {}), prefixes.setdefault(key, {})
            text.append(text_header)
            om.append(om_header)
            lines: list[str] = []
            om_lines = lines if tname == oname else []  # sample names escape alike: one list of lines for both
            for labels, value in rows:
                p = last.get(labels) or cur.get(labels)
                if p is None:
                    ls = _label_str(names, labels)
                    p = (f"{tname}{ls} ", f"{oname}{ls} ")
                cur[labels] = p
                v = _go_float(value)
                lines.append(f"{p[0]}{v}\n")
                if om_lines is not lines:
                    om_lines.append(f"{p[1]}{v}\n")
            chunk = "".join(lines)
            text.append(chunk)
            om.append(chunk if om_lines is lines else "".join(om_lines))
        om.append(_OM_EOF)
        self._prefixes = prefixes  # series and families not yielded this time are forgotten
        if len(self._headers) > 4 * len(prefixes) + 64:  # families with changing help
            self._headers.clear()
        return Exposition("".join(text).encode("utf-8"), "".join(om).encode("utf-8"), self.gzip_level)

    def _header(self, fam: Metric) -> tuple[str, str, str, str]:
        """(text header, OpenMetrics header, text sample name, OpenMetrics sample name)."""
        hkey = (fam.type, fam.name, fam.documentation, fam.unit)
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
