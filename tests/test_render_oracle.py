"""The incremental renderer against prometheus_client, byte for byte.

prometheus_client's own ``generate_latest`` (text 0.0.4) and
``openmetrics.exposition.generate_latest`` (OpenMetrics 1.0) are the oracle: for random nodes
(devices, MIG instances, claims, pods, conditions, counters) whose label values carry quotes,
backslashes, newlines and non-ASCII text, rendered one after another by ONE renderer (so series
appear, change value, and vanish between renders, and the caches are exercised), every
exposition must equal what the library makes of the very same family objects.
"""

from __future__ import annotations

import gzip
import math
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics import exposition as om

from exporter.devices.model import DeviceIdentity, DeviceReading, RecoveryAction, Vendor
from exporter.health.model import Condition, DeviceHealth, Tier
from exporter.metrics.render import Counter, Gauge, Renderer, RenderState
from exporter.model.snapshot import AllocationView, ClaimView, DeviceView, Snapshot
from exporter.remediation.contract import Histogram, TaintRuleView

PROMTOOL = shutil.which("promtool")

# Label text that needs escaping in the exposition formats, and text that must pass unchanged.
nasty = st.text(alphabet=st.sampled_from(list('ab-_.:/ "\\\n\t{}=,#é日本🚀\u2028\x00')), max_size=12)
label_value = st.one_of(st.sampled_from(["", "x", 'q"uote', "back\\slash", "new\nline", "ü", "\\n"]), nasty)
number = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1, 1.0, 1e-7, 123456789.0, 1e22, 0.1]),
)
maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731


@st.composite
def devices(draw):
    n = draw(st.integers(0, 6))
    out = []
    for i in range(n):
        uuid = draw(st.sampled_from([f"GPU-{i}", f"MIG-{i}", draw(label_value)]))
        ident = DeviceIdentity(
            uuid=uuid,
            vendor=draw(st.sampled_from(list(Vendor))),
            model=draw(label_value),
            pci_bus_id=draw(label_value),
            index=i,
            driver_version=draw(label_value),
            parent_uuid=draw(st.sampled_from(["", "GPU-0"])),
            mig_profile=draw(st.sampled_from(["", "1g.10gb", 'odd"profile'])),
        )
        reading = draw(
            st.one_of(
                st.none(),
                st.just(DeviceReading(uuid=uuid, ok=False)),
                st.builds(
                    DeviceReading,
                    uuid=st.just(uuid),
                    utilization_ratio=maybe(number),
                    memory_used_bytes=maybe(number),
                    memory_total_bytes=maybe(number),
                    power_watts=maybe(number),
                    energy_joules=maybe(number),
                    temperature_celsius=maybe(number),
                    clock_event_reasons=maybe(st.integers(0, 2**40)),
                    ecc_correctable_total=maybe(st.integers(0, 10**12)),
                    ecc_uncorrectable_total=maybe(st.integers(0, 10)),
                    remapped_rows_correctable=maybe(st.integers(0, 10)),
                    row_remap_pending=maybe(st.booleans()),
                    recovery_action=maybe(st.sampled_from(list(RecoveryAction))),
                    sm_active_ratio=maybe(number),
                    throttle_seconds=st.dictionaries(
                        st.sampled_from(["power", "thermal", "total_app_clocks"]), number, max_size=3
                    ),
                ),
            )
        )
        conds = tuple(
            Condition(uuid=uuid, tier=t, reason=r, since=0.0, last_seen=0.0)
            for t, r in draw(st.lists(st.tuples(st.sampled_from(list(Tier)), label_value), max_size=3))
        )
        out.append(DeviceView(identity=ident, reading=reading, health=DeviceHealth(uuid=uuid, conditions=conds)))
    return tuple(out)


@st.composite
def states(draw):
    devs = draw(devices())
    uuids = [d.uuid for d in devs] or [""]
    allocs = tuple(
        AllocationView(driver=draw(label_value), pool=draw(label_value), device=draw(label_value), uuid=draw(st.sampled_from(uuids)),
                       namespace=draw(label_value), pod=draw(label_value), container=draw(label_value), claim=draw(label_value),
                       source="dra", method="attribute")
        for _ in range(draw(st.integers(0, 5)))
    )
    claims = tuple(
        ClaimView(namespace=draw(label_value), name=draw(label_value), devices=(("d", "p", "x"),) * draw(st.integers(0, 2)),
                  uuids=(), pods=("p",) * draw(st.integers(0, 2)), utilization=draw(maybe(number)), memory_used_bytes=draw(maybe(number)),
                  memory_total_bytes=draw(maybe(number)), power_watts=draw(maybe(number)), healthy=draw(st.booleans()))
        for _ in range(draw(st.integers(0, 5)))
    )
    pods = {(a.namespace, a.pod) for a in allocs}
    snap = Snapshot(
        node=draw(label_value), timestamp=0.0, devices=devs, allocations=allocs, claims=claims,
        unresolved=draw(st.dictionaries(label_value, st.integers(0, 5), max_size=3)),
        pod_labels={p: draw(st.dictionaries(st.sampled_from(["app", "team.io/x", "1bad"]), label_value, max_size=2)) for p in pods},
    )
    hist = None
    if draw(st.booleans()):
        hist = Histogram()
        for v in draw(st.lists(st.floats(0, 1000), max_size=5)):
            hist.observe(v)
    return RenderState(
        snapshot=draw(st.one_of(st.none(), st.just(snap))) if draw(st.integers(0, 9)) == 0 else snap,
        xid_counts=draw(st.dictionaries(st.tuples(st.sampled_from(uuids), st.integers(0, 200)), st.integers(0, 9), max_size=3)),
        read_errors=draw(st.dictionaries(st.tuples(st.sampled_from(uuids), label_value), st.integers(0, 9), max_size=3)),
        collectors=draw(st.dictionaries(label_value, st.tuples(number, st.booleans()), max_size=3)),
        last_collection=draw(maybe(number)),
        cycles=draw(st.integers(0, 10**9)),
        taint_rules=tuple(TaintRuleView(*draw(st.tuples(*[label_value] * 5))) for _ in range(draw(st.integers(0, 2)))),
        taint_actions=draw(st.dictionaries(label_value, st.integers(0, 9), max_size=2)),
        budget_exhausted=draw(maybe(st.booleans())),
        remediation=draw(maybe(st.tuples(label_value, st.booleans()))),
        detection_latency=hist,
        process_memory=draw(st.dictionaries(st.tuples(st.sampled_from(uuids), label_value, label_value), st.integers(0, 2**40), max_size=3)),
        pod_label_allowlist=tuple(draw(st.lists(st.sampled_from(["app", "team.io/x", "1bad"]), unique=True, max_size=2))),
        dcgm_compat=draw(st.booleans()),
        excluded=frozenset(draw(st.lists(st.sampled_from(["gpu_up", "gpu_ecc_errors_total", "dra_claim_pods"]), max_size=2))),
    )


@st.composite
def foreign_families(draw):
    """Families another part of the program might yield: our row families, also with the
    calls that turn them into ordinary prometheus_client families (created, timestamps), and
    plain prometheus_client families."""
    out = []
    for k in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["gauge", "counter", "plain_gauge", "plain_counter"]))
        names = draw(st.lists(st.sampled_from(["a", "b", "le", "x-y", "9z", "ünï"]), unique=True, max_size=3))
        doc = draw(label_value)
        fam = {"gauge": Gauge, "counter": Counter, "plain_gauge": GaugeMetricFamily, "plain_counter": CounterMetricFamily}[kind](
            f"extra_{k}_{kind}", doc, labels=names
        )
        for _ in range(draw(st.integers(0, 3))):
            labels = [draw(label_value) for _ in names]
            value = draw(number)
            if "counter" in kind and draw(st.booleans()):
                fam.add_metric(labels, value, created=draw(st.floats(0, 2e9)))
            elif draw(st.integers(0, 5)) == 0:
                fam.add_metric(labels, value, timestamp=draw(st.floats(0, 2e9)))
            else:
                fam.add_metric(labels, value)
        out.append(fam)
    return out


class Families:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return self.fams


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(states(), foreign_families(), st.booleans(), st.booleans()), min_size=1, max_size=5))
def test_incremental_render_is_byte_identical_to_prometheus_client(cycles):
    renderer = Renderer()
    late = []  # expositions read only after later renders (bodies are joined on first use)
    for state, extra, oracle_first, read_late in cycles:
        renderer.collector.state = state
        fams = list(renderer.collector.collect()) + extra
        if oracle_first:  # the oracle reads .samples first: the fast path must not care
            want_text, want_om = generate_latest(Families(fams)), om.generate_latest(Families(fams))
            exp = renderer.render_families(fams)
        else:
            exp = renderer.render_families(fams)
            want_text, want_om = generate_latest(Families(fams)), om.generate_latest(Families(fams))
        if read_late:
            late.append((exp, want_text, want_om))
        else:
            # in the order a gzip-asking scraper would: the compressed form before the body
            assert gzip.decompress(exp.openmetrics_gzipped) == want_om
            assert exp.openmetrics == want_om
            assert exp.body == want_text
            assert gzip.decompress(exp.gzipped) == want_text
    for exp, want_text, want_om in late:
        assert exp.body == want_text
        assert exp.openmetrics == want_om
        assert gzip.decompress(exp.gzipped) == want_text
        assert gzip.decompress(exp.openmetrics_gzipped) == want_om


# Names the legacy character sets do not allow (Prometheus 3 accepts any UTF-8 name): the
# renderer's own escaping (exporter.metrics.escaping) must write them as the library does. A line
# feed is left out: there the renderer deliberately differs (see that module's docstring).
odd_name = st.text(alphabet=st.sampled_from(list('abZ_:09-. é日🚀{}="\\/')), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), odd_name, label_value, st.lists(st.tuples(odd_name, label_value), max_size=3, unique_by=lambda t: t[0]))
def test_names_help_and_values_escape_as_prometheus_client(counter, name, doc, labels):
    fam = (Counter if counter else Gauge)(name, doc, labels=[k for k, _ in labels])
    fam.add_metric([v for _, v in labels], 1.5)
    exp = Renderer().render_families([fam])
    assert exp.body == generate_latest(Families([fam]))
    assert exp.openmetrics == om.generate_latest(Families([fam]))


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.sampled_from(["moved", "x:y", "ünï"]), st.lists(st.lists(number, min_size=3, max_size=3), min_size=2, max_size=8))
def test_moved_values_of_the_same_series_print_as_prometheus_client(counter, name, renders):
    """The path that remakes only the lines of moved values (the same series in the same order
    as the last render: counters, readings), render after render, byte for byte; also for a name
    whose two formats' sample lines differ."""
    r = Renderer()
    for values in renders:
        fam = (Counter if counter else Gauge)(name, "h", labels=["k"])
        fam.add_rows([(("a",), values[0]), (("b",), values[1])])
        fam.add_metric(["c"], values[2])
        exp = r.render_families([fam])
        assert exp.body == generate_latest(Families([fam])), values
        assert exp.openmetrics == om.generate_latest(Families([fam])), values


def test_vanished_series_and_families_are_dropped_at_once():
    """A series (and a whole family) that a cycle no longer yields is gone from that cycle's
    bytes and from the renderer's caches; one that comes back is formatted afresh."""
    r = Renderer()

    def fams(claims, with_extra):
        g = Gauge("dra_claim_pods", "h", labels=["node", "namespace", "claim"])
        for c, v in claims:
            g.add_metric(["n", "ns", c], v)
        out = [g]
        if with_extra:
            e = Counter("extra", "h", labels=["k"])
            e.add_metric(["v"], 1)
            out.append(e)
        return out

    a = r.render_families(fams([("c1", 1), ("c2", 2)], True)).body.decode()
    assert 'claim="c2"' in a and "extra_total" in a
    b = r.render_families(fams([("c1", 5)], False)).body.decode()
    assert 'claim="c2"' not in b and "extra" not in b and '{claim="c1",namespace="ns",node="n"} 5.0' in b
    assert [list(s) for s in r._prefixes.values()] == [[("n", "ns", "c1")]]
    c = r.render_families(fams([("c1", 5), ("c2", -0.0)], False)).body.decode()
    assert '{claim="c2",namespace="ns",node="n"} -0.0' in c


def test_value_changes_are_seen_including_zero_sign_and_nan():
    r = Renderer()
    for v in (1, 1.0, 2, 0.0, -0.0, 0, math.nan, math.nan, math.inf, 1e22, True):
        g = Gauge("g", "h", labels=["a"])
        g.add_metric(["x"], v)
        assert r.render_families([g]).body == generate_latest(Families([g])), v


def test_bulk_rows_see_a_zero_change_its_sign():
    # Claim families are filled with add_rows; rows equal to the last render's (0.0 == -0.0)
    # must still not reuse the last bytes when a zero changed its sign.
    r = Renderer()
    for zero in (0.0, -0.0, 0.0, 0, -0.0, -0.0):
        g = Gauge("dra_claim_power_watts", "h", labels=["node", "namespace", "claim"])
        g.add_rows([(("n", "ns", "a"), 1.5), (("n", "ns", "b"), zero), (("n", "ns", "c"), 2)])
        exp = r.render_families([g])
        assert exp.body == generate_latest(Families([g])), zero
        assert exp.openmetrics == om.generate_latest(Families([g])), zero


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's `prometheus` package (CI does)")
def test_promtool_accepts_the_text_body_with_nasty_labels_after_series_churn():
    ident = DeviceIdentity(uuid='GPU-"x"\\\n日本', vendor=Vendor.NVIDIA, model="H100 \"SXM\"", pci_bus_id="0000:18:00.0", index=0)
    dev = DeviceView(identity=ident, reading=DeviceReading(uuid=ident.uuid, utilization_ratio=0.5, energy_joules=12.0, ecc_correctable_total=0),
                     health=DeviceHealth(uuid=ident.uuid, conditions=(Condition(ident.uuid, Tier.FATAL, "xid_79", 0.0, 0.0),)))
    alloc = AllocationView("gpu.nvidia.com", "node\\a", "gpu-0", ident.uuid, "ns\n1", 'pod"1', "c", "claim-ü", "dra", "attribute")
    claim = ClaimView("ns\n1", "claim-ü", (("gpu.nvidia.com", "p", "gpu-0"),), (ident.uuid,), ('pod"1',), 0.5, 1, 2, 3.0, False)
    r = Renderer()
    hist = Histogram()
    hist.observe(0.2)
    for claims in ((claim,), (), (claim,)):
        snap = Snapshot(node="n\\1", timestamp=0.0, devices=(dev,), allocations=(alloc,), claims=claims, unresolved={"gpu.nvidia.com": 0})
        body = r.render(RenderState(snapshot=snap, xid_counts={(ident.uuid, 79): 1}, detection_latency=hist, cycles=3)).body
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)
        assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (done.stdout, done.stderr)
