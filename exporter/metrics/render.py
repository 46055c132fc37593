"""Snapshot -> Prometheus exposition bytes.

Rendering happens once per collection cycle, never per scrape: the HTTP handler serves the
last rendered bytes. The collector below follows prometheus/client_python's custom-collector
pattern (``collect()`` yields metric families) so the text format, escaping and ordering are
the library's, not ours.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__
from ..devices.model import DeviceReading
from ..model.snapshot import Snapshot
from .catalog import BY_NAME
from .webstats import HttpStats

# Device series that dcgm-exporter-compatible labels are added to (--dcgm-compat-labels).
COMPAT_LABELS = ("pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name")


@dataclass(frozen=True)
class TaintRuleView:
    driver: str
    pool: str
    device: str
    effect: str
    tier: str


@dataclass
class RenderState:
    """Everything a render needs besides the snapshot; each part owned by its producer."""

    snapshot: Snapshot | None = None
    xid_counts: Mapping[tuple[str, int], int] = field(default_factory=dict)
    read_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    collectors: Mapping[str, tuple[float, bool]] = field(default_factory=dict)
    last_collection: float | None = None
    cycles: int = 0
    taint_rules: tuple[TaintRuleView, ...] = ()
    taint_actions: Mapping[str, int] = field(default_factory=dict)
    taint_suppressed: Mapping[str, int] = field(default_factory=dict)
    budget_exhausted: bool | None = None
    remediation: tuple[str, bool] | None = None  # (mode, active); None: not known (tests)
    detection_latency: Any = None  # exporter.remediation.engine.Histogram
    process_memory: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (uuid, ns, pod) -> bytes
    pod_label_allowlist: tuple[str, ...] = ()
    dcgm_compat: bool = False
    excluded: frozenset[str] = frozenset()  # catalog names left out (--exclude-metrics)
    http: HttpStats | None = None  # the HTTP server's own counters; None when not serving


def _fam(name: str, extra_labels: tuple[str, ...] = ()) -> Metric:
    d = BY_NAME[name]
    labels = ["node", *d.labels, *extra_labels]
    if d.kind == "counter":
        # CounterMetricFamily appends _total itself; the catalog carries the full name.
        return CounterMetricFamily(name[: -len("_total")] if name.endswith("_total") else name, d.help, labels=labels)
    return GaugeMetricFamily(name, d.help, labels=labels)


_READING_GAUGES: tuple[tuple[str, str, float], ...] = (
    ("gpu_utilization_ratio", "utilization_ratio", 1.0),
    ("gpu_memory_used_bytes", "memory_used_bytes", 1.0),
    ("gpu_memory_total_bytes", "memory_total_bytes", 1.0),
    ("gpu_power_watts", "power_watts", 1.0),
    ("gpu_energy_joules_total", "energy_joules", 1.0),
    ("gpu_temperature_celsius", "temperature_celsius", 1.0),
    ("gpu_memory_temperature_celsius", "memory_temperature_celsius", 1.0),
    ("gpu_sm_clock_hertz", "sm_clock_hertz", 1.0),
    ("gpu_memory_clock_hertz", "memory_clock_hertz", 1.0),
    ("gpu_clock_event_reasons", "clock_event_reasons", 1.0),
    ("gpu_sm_active_ratio", "sm_active_ratio", 1.0),
    ("gpu_sm_occupancy_ratio", "sm_occupancy_ratio", 1.0),
    ("gpu_tensor_active_ratio", "tensor_active_ratio", 1.0),
    ("gpu_dram_active_ratio", "dram_active_ratio", 1.0),
    ("gpu_retired_pages_total", "retired_pages_total", 1.0),
    ("gpu_row_remap_pending", "row_remap_pending", 1.0),
    ("gpu_row_remap_failure", "row_remap_failure", 1.0),
    ("gpu_pcie_replay_total", "pcie_replay_total", 1.0),
    ("gpu_recovery_action", "recovery_action", 1.0),
)

_LABEL_KEY_RE = re.compile(r"[^a-zA-Z0-9_]")


class SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.state = RenderState()

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
        if st.last_collection is not None:
            t = _fam("dra_gpu_exporter_last_collection_timestamp_seconds")
            t.add_metric([node], st.last_collection)
            yield t
        c = _fam("dra_gpu_exporter_cycles_total")
        c.add_metric([node], st.cycles)
        yield c
        if st.http is not None:
            yield from self._http(node, st.http)

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

    def _devices(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        info = _fam("gpu_info")
        up = _fam("gpu_up")
        extra = COMPAT_LABELS if st.dcgm_compat else ()
        compat = self._compat_rows(snap) if st.dcgm_compat else {}
        empty = ("",) * len(extra)
        gauges = {name: _fam(name, extra) for name, _, _ in _READING_GAUGES}
        ecc = _fam("gpu_ecc_errors_total")
        remap = _fam("gpu_remapped_rows_total")
        gpu_index = {d.uuid: d.identity.index for d in snap.devices if not d.identity.is_partition}
        for d in snap.devices:
            i = d.identity
            # index is the physical GPU's (a MIG instance's own index is a slot in its GPU)
            index = gpu_index.get(i.parent_uuid if i.is_partition else i.uuid)
            gi = "" if i.gpu_instance_id is None else str(i.gpu_instance_id)
            info.add_metric([node, i.uuid, i.vendor.value, i.model, i.pci_bus_id, i.driver_version, i.parent_uuid, i.mig_profile, "" if index is None else str(index), gi], 1)
            up.add_metric([node, i.uuid], 1 if d.up else 0)
            r: DeviceReading | None = d.reading
            if r is None or not r.ok:
                continue
            label_sets = compat.get(i.uuid, [empty]) if extra else [()]
            for name, attr, scale in _READING_GAUGES:
                v = getattr(r, attr)
                if v is None:
                    continue
                for ls in label_sets:
                    gauges[name].add_metric([node, i.uuid, *ls], float(v) * scale)
            if r.ecc_correctable_total is not None:
                ecc.add_metric([node, i.uuid, "correctable"], r.ecc_correctable_total)
            if r.ecc_uncorrectable_total is not None:
                ecc.add_metric([node, i.uuid, "uncorrectable"], r.ecc_uncorrectable_total)
            if r.remapped_rows_correctable is not None:
                remap.add_metric([node, i.uuid, "correctable"], r.remapped_rows_correctable)
            if r.remapped_rows_uncorrectable is not None:
                remap.add_metric([node, i.uuid, "uncorrectable"], r.remapped_rows_uncorrectable)
        yield info
        yield up
        yield from gauges.values()
        yield ecc
        yield remap
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
        for d in snap.devices:
            healthy.add_metric([node, d.uuid], 1 if d.health.healthy else 0)
            seen = set()
            for c in d.health.conditions:
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

    def _attribution(self, node: str, snap: Snapshot, st: RenderState) -> Iterable[Metric]:
        alloc = _fam("dra_device_allocation_info")
        for a in snap.allocations:
            alloc.add_metric([node, a.driver, a.pool, a.device, a.uuid, a.namespace, a.pod, a.container, a.claim], 1)
        yield alloc
        fams = {n: _fam(n) for n in ("dra_claim_devices", "dra_claim_pods", "dra_claim_utilization_ratio", "dra_claim_memory_used_bytes", "dra_claim_memory_total_bytes", "dra_claim_power_watts", "dra_claim_healthy")}
        for c in snap.claims:
            key = [node, c.namespace, c.name]
            fams["dra_claim_devices"].add_metric(key, len(c.devices))
            fams["dra_claim_pods"].add_metric(key, len(c.pods))
            if c.utilization is not None:
                fams["dra_claim_utilization_ratio"].add_metric(key, c.utilization)
            if c.memory_used_bytes is not None:
                fams["dra_claim_memory_used_bytes"].add_metric(key, c.memory_used_bytes)
            if c.memory_total_bytes is not None:
                fams["dra_claim_memory_total_bytes"].add_metric(key, c.memory_total_bytes)
            if c.power_watts is not None:
                fams["dra_claim_power_watts"].add_metric(key, c.power_watts)
            fams["dra_claim_healthy"].add_metric(key, 1 if c.healthy else 0)
        yield from fams.values()
        un = _fam("dra_unresolved_devices")
        for drv, n in sorted(snap.unresolved.items()):
            un.add_metric([node, drv], n)
        yield un
        if st.pod_label_allowlist:
            keys = st.pod_label_allowlist
            lbl = GaugeMetricFamily(
                "dra_pod_labels",
                BY_NAME["dra_pod_labels"].help,
                labels=["node", "namespace", "pod", *("label_" + _LABEL_KEY_RE.sub("_", k) for k in keys)],
            )
            pods = sorted({(a.namespace, a.pod) for a in snap.allocations})
            for ns, pod in pods:
                labels = snap.pod_labels.get((ns, pod), {})
                lbl.add_metric([node, ns, pod, *(labels.get(k, "") for k in keys)], 1)
            yield lbl

    def _remediation(self, node: str, st: RenderState) -> Iterable[Metric]:
        rules = _fam("dra_device_taint_rule")
        for r in st.taint_rules:
            rules.add_metric([node, r.driver, r.pool, r.device, r.effect, r.tier], 1)
        yield rules
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
            for bound, n in zip(list(h.buckets) + [float("inf")], h.counts):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            fam.add_metric([node], buckets, h.sum)
            yield fam
        if st.budget_exhausted is not None:
            b = _fam("dra_gpu_exporter_taint_budget_exhausted")
            b.add_metric([node], 1 if st.budget_exhausted else 0)
            yield b
        if st.remediation is not None:
            a = _fam("dra_gpu_exporter_remediation_active")
            a.add_metric([node, st.remediation[0]], 1 if st.remediation[1] else 0)
            yield a


@dataclass(frozen=True)
class Exposition:
    body: bytes  # text format 0.0.4
    gzipped: bytes
    openmetrics: bytes = b"# EOF\n"  # OpenMetrics 1.0, ends with # EOF
    openmetrics_gzipped: bytes = b""


class Renderer:
    """Owns the registry; ``render()`` turns the current state into cached bytes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)

    def render(self, state: RenderState) -> Exposition:
        self.collector.state = state
        body = generate_latest(self.registry)
        om = generate_openmetrics(self.registry)
        # Compress once per cycle, not once per scrape: scrapers asking for gzip get these bytes.
        return Exposition(body=body, gzipped=gzip.compress(body, compresslevel=5), openmetrics=om, openmetrics_gzipped=gzip.compress(om, compresslevel=5))
