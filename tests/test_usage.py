"""Billing counters (exporter/model/usage.py): weights, shares, integration, churn, retention.

Examples for each rule of the billing model (docs/billing.md), then a property test over
random sequences of cycles (allocations that come and go, MIG and AMD partitions, device-plugin
pods, energy counters that grow, reset, go missing or are unsupported, per-process memory or
none) against a naive reference: every split's parts add up to 1, counters never decrease, every
counter equals the reference's, and the claims' and pods' energy plus the unattributed part equal
the integrated device energy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit_helpers import gpu

from exporter.devices.model import DeviceIdentity, DeviceReading, ReadError, Vendor
from exporter.health.model import DeviceHealth
from exporter.metrics.render import Renderer, RenderState
from exporter.model.snapshot import AllocationView, ClaimView, DeviceView, Snapshot
from exporter.model.usage import (
    CAPACITY,
    EQUAL,
    PER_PROCESS,
    DeviceSplit,
    UsageAccountant,
    device_weights,
    mig_weight,
    split_devices,
)

H100 = "NVIDIA H100 80GB HBM3"


def mig(parent: DeviceIdentity, name: str, profile: str, memory: int | None = None) -> DeviceIdentity:
    return DeviceIdentity(
        uuid=f"MIG-{name}", vendor=Vendor.NVIDIA, model=parent.model, pci_bus_id=parent.pci_bus_id, index=0,
        parent_uuid=parent.uuid, mig_profile=profile, memory_total_bytes=memory,
    )


def amd_group(name: str, n: int) -> list[DeviceIdentity]:
    """An MI300-style GPU in n compute partitions: every member names partition 0 as parent."""
    first = f"AMD-{name}-0"
    return [
        DeviceIdentity(uuid=f"AMD-{name}-{k}", vendor=Vendor.AMD, model="MI300X", pci_bus_id=f"0000:18:00.{k}", index=k, parent_uuid=first, mig_profile="CPX")
        for k in range(n)
    ]


G0, G1, G2 = gpu(0), gpu(1), gpu(2)
M3A, M3B, M1 = mig(G2, "3a", "3g.40gb"), mig(G2, "3b", "3g.40gb"), mig(G2, "1", "1g.10gb")
AMD = amd_group("a", 2)
IDENTS = (G0, G1, G2, M3A, M3B, M1, *AMD)
PHYSICAL = [i for i in IDENTS if not i.is_partition]


def view(ident: DeviceIdentity, energy: float | None = None, ok: bool = True, power: float | None = 300.0, mem: int | None = None) -> DeviceView:
    if ok:
        r = DeviceReading(uuid=ident.uuid, energy_joules=energy, power_watts=power, memory_used_bytes=mem, utilization_ratio=0.5)
    else:
        r = DeviceReading.failed(ident.uuid, ReadError.LOST)
    return DeviceView(identity=ident, reading=r, health=DeviceHealth(uuid=ident.uuid))


def dra(ns: str, pod: str, claim: str, uuid: str, container: str = "main") -> AllocationView:
    return AllocationView(driver="gpu.nvidia.com", pool="node", device=uuid.lower(), uuid=uuid, namespace=ns, pod=pod, container=container, claim=claim, source="dra", method="attribute")


def plugin(ns: str, pod: str, uuid: str) -> AllocationView:
    return AllocationView(driver="nvidia.com/gpu", pool="", device=uuid, uuid=uuid, namespace=ns, pod=pod, container="main", claim="", source="device-plugin", method="uuid")


def claims_of(allocations: Iterable[AllocationView]) -> tuple[ClaimView, ...]:
    groups: dict[tuple[str, str], set[str]] = defaultdict(set)
    for a in allocations:
        if a.claim:
            groups[(a.namespace, a.claim)].add(a.pod)
    return tuple(ClaimView(ns, name, (), (), tuple(sorted(pods)), None, None, None, None, True) for (ns, name), pods in sorted(groups.items()))


def snap(
    t: float, allocations: tuple[AllocationView, ...] = (), energy: dict[str, float | None] | None = None,
    devices: Iterable[DeviceIdentity] = IDENTS, missing: Iterable[str] = (), power: dict[str, float | None] | None = None,
) -> Snapshot:
    energy, power = energy or {}, power or {}
    views = tuple(view(i, energy.get(i.uuid), ok=i.uuid not in set(missing), power=power.get(i.uuid, 300.0)) for i in devices)
    return Snapshot(node="node", timestamp=t, monotonic=t, devices=views, allocations=allocations, claims=claims_of(allocations))


def split_of(splits: tuple[DeviceSplit, ...], uuid: str) -> DeviceSplit:
    return next(s for s in splits if s.uuid == uuid)


# --- weights ------------------------------------------------------------------------------------


def test_mig_weight_is_compute_slices_over_the_gpus():
    assert mig_weight("3g.40gb", H100) == pytest.approx(3 / 7)
    assert mig_weight("4g.40gb", H100) == pytest.approx(4 / 7)  # same memory as 3g.40gb, more SMs
    assert mig_weight("7g.80gb", H100) == 1.0
    assert mig_weight("1g.10gb+me", H100) == pytest.approx(1 / 7)
    assert mig_weight("1c.3g.40gb", H100) == pytest.approx(1 / 7)  # a compute instance: its own slices
    assert mig_weight("1g.6gb", "NVIDIA A30") == pytest.approx(1 / 4)
    assert mig_weight("4g.24gb", "NVIDIA A30") == 1.0
    assert mig_weight("", H100) is None and mig_weight("weird", H100) is None


def test_device_weights_full_mig_amd_and_fallbacks():
    odd = mig(G1, "odd", "custom-profile", memory=20 * 2**30)
    bare = mig(G0, "bare", "custom-profile")
    w = device_weights([*IDENTS, odd, bare])
    assert w[G0.uuid] == (G0.uuid, 1.0) and w[G2.uuid] == (G2.uuid, 1.0)
    assert w[M3A.uuid] == (G2.uuid, pytest.approx(3 / 7)) and w[M1.uuid] == (G2.uuid, pytest.approx(1 / 7))
    assert w[AMD[0].uuid] == (AMD[0].uuid, 0.5) and w[AMD[1].uuid] == (AMD[0].uuid, 0.5)  # partition 0 included
    assert w[odd.uuid] == (G1.uuid, pytest.approx(0.25))  # unparsed profile: its share of the memory
    assert w[bare.uuid] == (G0.uuid, 1.0)  # nothing known: 1/instances of its GPU


# --- shares -------------------------------------------------------------------------------------


def test_equal_split_between_claims_then_their_pods():
    allocs = (
        dra("ml", "a", "shared", G0.uuid), dra("ml", "b", "shared", G0.uuid),
        dra("ml", "b", "shared", G0.uuid, container="sidecar"),  # a second container is not a second pod
        dra("web", "c", "own", G0.uuid), plugin("old", "d", G0.uuid),
    )
    s = split_of(split_devices(snap(0, allocs)), G0.uuid)
    assert s.rule == EQUAL and s.fraction == 1.0
    parts = {(c, p): share for c, p, share in s.usage}
    assert parts == {
        (("ml", "shared"), ("ml", "a")): pytest.approx(1 / 6), (("ml", "shared"), ("ml", "b")): pytest.approx(1 / 6),
        (("web", "own"), ("web", "c")): pytest.approx(1 / 3), (None, ("old", "d")): pytest.approx(1 / 3),
    }
    assert s.time == s.usage


def test_capacity_split_by_what_each_claim_consumed_then_its_pods():
    """KEP-5075: claims on one device, each allocation stating its consumed memory (20 and 60 Gi):
    usage, energy and device-time by those amounts, then equally between a claim's pods; a claim
    that states none makes it equal again; measured per-process memory still wins for usage."""
    allocs = (dra("ml", "a", "small", G0.uuid), dra("ml", "b", "small", G0.uuid), dra("web", "c", "big", G0.uuid))
    base = snap(0, allocs)
    consumed = {(G0.uuid, "ml", "small"): 20 * 2**30, (G0.uuid, "web", "big"): 60 * 2**30}
    shared = dataclasses.replace(base, consumed=consumed)
    s = split_of(split_devices(shared), G0.uuid)
    assert s.rule == CAPACITY and s.time == s.usage
    assert {(c, p): share for c, p, share in s.usage} == {
        (("ml", "small"), ("ml", "a")): pytest.approx(1 / 8), (("ml", "small"), ("ml", "b")): pytest.approx(1 / 8),
        (("web", "big"), ("web", "c")): pytest.approx(3 / 4),
    }
    partial = dataclasses.replace(base, consumed={(G0.uuid, "web", "big"): 60 * 2**30})
    assert split_of(split_devices(partial), G0.uuid).rule == EQUAL
    measured = split_of(split_devices(shared, {(G0.uuid, "ml", "a"): 2**30}), G0.uuid)
    assert measured.rule == PER_PROCESS and measured.time == s.time


def test_per_process_split_by_holder_pods_memory():
    allocs = (dra("ml", "a", "shared", G0.uuid), dra("ml", "b", "shared", G0.uuid), dra("ml", "b", "extra", G0.uuid), dra("web", "c", "own", G1.uuid))
    memory = {(G0.uuid, "ml", "a"): 3 * 2**30, (G0.uuid, "ml", "b"): 1 * 2**30, (G0.uuid, "", ""): 5 * 2**30, (G1.uuid, "web", "c"): 0}
    splits = split_devices(snap(0, allocs), memory)
    s0, s1 = split_of(splits, G0.uuid), split_of(splits, G1.uuid)
    assert s0.rule == PER_PROCESS
    parts = {(c, p): share for c, p, share in s0.usage}
    # unmapped processes ("", "") are nobody's; pod b's quarter is split between its two claims
    assert parts == {
        (("ml", "shared"), ("ml", "a")): pytest.approx(0.75),
        (("ml", "extra"), ("ml", "b")): pytest.approx(0.125), (("ml", "shared"), ("ml", "b")): pytest.approx(0.125),
    }
    # allocation time is not use: always equal
    assert {(c, p): share for c, p, share in s0.time}[(("ml", "shared"), ("ml", "a"))] == pytest.approx(0.25)
    assert s1.rule == EQUAL  # no holder's process uses memory there yet: equal


def test_a_gpu_held_whole_and_in_parts_splits_by_weight():
    splits = split_devices(snap(0, (dra("a", "p", "whole", G2.uuid), dra("b", "q", "slice", M3A.uuid))))
    whole, part = split_of(splits, G2.uuid), split_of(splits, M3A.uuid)
    total = 1 + 3 / 7
    assert whole.fraction == pytest.approx(1 / total) and part.fraction == pytest.approx((3 / 7) / total)


# --- counters -----------------------------------------------------------------------------------


def test_energy_deltas_first_reading_reset_and_missing_readings():
    acc = UsageAccountant()
    allocs = (dra("ml", "a", "train", G0.uuid),)
    u = acc.update(snap(0, allocs, {G0.uuid: 1000.0}))
    assert u.claims.get(("ml", "train")) == (0.0, 0.0)  # the first reading is a mark; a new counter starts at 0
    u = acc.update(snap(10, allocs, {G0.uuid: 4000.0}))
    assert u.claims.get(("ml", "train")) == (3000.0, 10.0)
    u = acc.update(snap(20, allocs, {G0.uuid: 500.0}))  # driver reload: the counter restarted from 0
    assert u.claims.get(("ml", "train")) == (3500.0, 20.0)
    u = acc.update(snap(30, allocs, missing=[G0.uuid]))  # no reading: nothing to add, time still counts
    assert u.claims.get(("ml", "train")) == (3500.0, 30.0)
    u = acc.update(snap(40, allocs, {G0.uuid: 900.0}))  # the increase over the gap
    assert u.claims.get(("ml", "train")) == (3900.0, 40.0)
    assert u.integrated_joules == 2900.0 + 3000.0 + 500.0 - 2500.0 and u.unattributed_joules == 0.0
    u = acc.update(snap(50, allocs, {G0.uuid: None}))  # unsupported: nothing
    assert u.claims.get(("ml", "train")) == (3900.0, 50.0)


def test_mig_gpu_energy_goes_to_instances_by_weight_rest_unattributed():
    acc = UsageAccountant()
    allocs = (dra("a", "p", "three", M3A.uuid), dra("b", "q", "one", M1.uuid))
    acc.update(snap(0, allocs, {G2.uuid: 0.0}))
    u = acc.update(snap(7, allocs, {G2.uuid: 700.0}))
    assert u.claims.get(("a", "three")) == (pytest.approx(300.0), pytest.approx(3.0))
    assert u.claims.get(("b", "one")) == (pytest.approx(100.0), pytest.approx(1.0))
    assert u.unattributed_joules == pytest.approx(300.0)  # the free 3g slot
    # AMD: two partitions, one held: half of the GPU's energy
    allocs = (dra("c", "r", "part", AMD[1].uuid),)
    acc.update(snap(8, allocs, {AMD[0].uuid: 0.0}))
    u = acc.update(snap(9, allocs, {AMD[0].uuid: 100.0}))
    assert u.claims.get(("c", "part"))[0] == pytest.approx(50.0)


def test_a_claim_seen_by_one_cycle_gets_the_interval_after_it_and_is_kept_for_the_retention():
    acc = UsageAccountant(retention=600.0)
    base = (dra("ml", "long", "steady", G0.uuid),)
    acc.update(snap(0, base, {G0.uuid: 0.0}))
    # a job appears for a single cycle, between two scrapes
    u = acc.update(snap(5, (*base, dra("batch", "job", "blink", G0.uuid)), {G0.uuid: 500.0}))
    assert u.claims.get(("batch", "blink")) == (0.0, 0.0)  # starts at 0: rate() sees all of it
    u = acc.update(snap(10, base, {G0.uuid: 1500.0}))
    assert u.claims.get(("batch", "blink")) == (500.0, 2.5)  # half the device for the 5 s it held it
    assert u.claims.get(("ml", "steady")) == (1000.0, 7.5)
    u = acc.update(snap(600, base, {G0.uuid: 1500.0}))
    assert u.claims.get(("batch", "blink")) == (500.0, 2.5)  # gone at t=5, kept until t=605
    u = acc.update(snap(606, base, {G0.uuid: 1500.0}))
    assert u.claims.get(("batch", "blink")) is None and u.pods.get(("batch", "job")) is None
    # back after the retention: a new counter from 0
    u = acc.update(snap(607, (*base, dra("batch", "job", "blink", G0.uuid)), {G0.uuid: 1500.0}))
    assert u.claims.get(("batch", "blink")) == (0.0, 0.0)


def test_a_claim_back_within_the_retention_continues_its_counters():
    acc = UsageAccountant(retention=600.0)
    allocs = (dra("ml", "a", "c", G0.uuid),)
    acc.update(snap(0, allocs, {G0.uuid: 0.0}))
    acc.update(snap(10, allocs, {G0.uuid: 100.0}))
    acc.update(snap(20, (), {G0.uuid: 300.0}))
    u = acc.update(snap(30, allocs, {G0.uuid: 400.0}))
    assert u.claims.get(("ml", "c")) == (300.0, 20.0)  # 0-10 and 10-20; nobody held it 20-30


def test_a_clock_step_back_counts_no_time_and_the_last_holders_keep_the_interval():
    # The holders change at a cycle whose clock stepped back: that cycle counts no time, and the
    # interval up to the next cycle still goes to the holders of the last cycle whose clock had
    # not (the splits are summed per source between changes: the switch must still happen).
    acc = UsageAccountant()
    a, b = (dra("ml", "a", "first", G0.uuid),), (dra("ml", "b", "second", G0.uuid),)
    acc.update(snap(0, a))
    acc.update(snap(10, a))
    u = acc.update(snap(5, b))
    assert u.claims.get(("ml", "first")) == (0.0, 10.0) and u.claims.get(("ml", "second")) == (0.0, 0.0)
    u = acc.update(snap(20, b))
    assert u.claims.get(("ml", "first")) == (0.0, 20.0) and u.claims.get(("ml", "second")) == (0.0, 0.0)
    u = acc.update(snap(30, b))
    assert u.claims.get(("ml", "first")) == (0.0, 20.0) and u.claims.get(("ml", "second")) == (0.0, 10.0)


def test_a_wall_clock_step_moves_no_bill_and_no_retention():
    # the wall clock steps +1 h, then +1 day, then -1 h; monotonic time runs on
    acc = UsageAccountant(retention=600.0)
    a = (dra("ml", "a", "train", G0.uuid),)
    for t, wall, allocs in ((0, 0, a), (10, 3600, a), (20, 86_400, ()), (25, -3600, ())):
        u = acc.update(dataclasses.replace(snap(t, allocs, {G0.uuid: 100.0 * t}), timestamp=1e9 + t + wall))
    assert u.claims.get(("ml", "train")) == (2000.0, 20.0)  # still kept, 20 s held


def test_gone_holders_are_capped_in_a_churn_storm():
    # one cap in series, every kind together: 40 series are 10 claims and 10 pods (2 counters each)
    acc = UsageAccountant(retention=600.0, max_series=40)
    for i in range(40):
        acc.update(snap(i, (dra("ns", f"pod-{i}", f"job-{i}", G0.uuid),)))
    u = acc.update(snap(41, ()))
    assert len(u.claims.keys) == 10 and ("ns", "job-39") in u.claims.keys and ("ns", "job-0") not in u.claims.keys
    assert len(u.pods.keys) == 10 and ("ns", "pod-39") in u.pods.keys and ("ns", "pod-29") not in u.pods.keys
    assert u.claims.get(("ns", "job-39")) == (0.0, 2.0)  # its final totals (seen at 39, gone at 41), kept


def test_a_slow_counters_increase_goes_to_each_intervals_holders_by_its_power():
    # Churn on one GPU: a new job every cycle (0.5 s), each drawing its own power, the energy
    # counter re-read every 10 s (20 cycles) as the NVML backend does; the power reading is the
    # average over the interval before it. Each job gets power x time held (the old rule gave a
    # re-read's whole increase to the job of the cycle before it), and the jobs add up exactly.
    acc, energy, mark, t, used = UsageAccountant(), 0.0, 0.0, 0.0, {}
    watts = [100.0 + 37.0 * (i % 11) for i in range(200)]
    for i in range(200):
        if i:
            energy += watts[i - 1] * 0.5  # job i-1 held the GPU since the cycle before, at its power
            used[("batch", f"job-{i - 1}")] = watts[i - 1] * 0.5
        mark = energy if i % 20 == 0 else mark  # re-read every 20 cycles; the last value between
        power = {G0.uuid: watts[i - 1] if i else 0.0}
        u = acc.update(snap(t, (dra("batch", f"pod-{i}", f"job-{i}", G0.uuid),), {G0.uuid: mark}, power=power))
        t += 0.5
    got = u.claims.as_dict()
    settled = [k for k in used if int(k[1].split("-")[1]) < 180]  # re-read at cycle 180 covers these
    assert settled and all(got[k][0] == pytest.approx(used[k], rel=0.05) for k in settled)
    assert sum(j for j, _ in got.values()) == pytest.approx(sum(watts[:180]) * 0.5, rel=1e-12)
    assert u.unattributed_joules == 0.0


def test_claims_without_a_resolved_device_have_zero_counters():
    unresolved = AllocationView(driver="gpu.nvidia.com", pool="node", device="gpu-9", uuid="", namespace="ml", pod="p", container="main", claim="lost", source="dra", method="")
    u = UsageAccountant().update(snap(0, (unresolved,)))
    assert u.claims.get(("ml", "lost")) == (0.0, 0.0) and u.splits == ()


# --- rendering ----------------------------------------------------------------------------------


def test_rendered_families_and_one_share_series_per_pod_and_device():
    acc = UsageAccountant()
    allocs = (dra("ml", "a", "one", G0.uuid), dra("ml", "a", "two", G0.uuid), dra("ml", "b", "two", G0.uuid), plugin("old", "d", G1.uuid))
    acc.update(snap(0, allocs, {G0.uuid: 0.0, G1.uuid: 0.0}))
    u = acc.update(snap(10, allocs, {G0.uuid: 100.0, G1.uuid: 50.0}))
    body = Renderer().render(RenderState(snapshot=snap(10, allocs), usage=u)).body.decode()
    lines = [line for line in body.splitlines() if not line.startswith("#")]
    assert 'dra_claim_energy_joules_total{claim="one",namespace="ml",node="node"} 50.0' in lines
    assert 'dra_claim_device_seconds_total{claim="two",namespace="ml",node="node"} 5.0' in lines
    assert 'dra_pod_energy_joules_total{namespace="old",node="node",pod="d"} 50.0' in lines
    assert 'dra_pod_energy_joules_total{namespace="ml",node="node",pod="a"} 75.0' in lines
    shares = [line for line in lines if line.startswith("dra_pod_device_share_ratio")]
    assert f'dra_pod_device_share_ratio{{namespace="ml",node="node",pod="a",rule="equal",uuid="{G0.uuid}"}} 0.75' in shares
    assert len(shares) == 3  # pod a holds G0 through two claims: one series
    assert "# TYPE dra_claim_energy_joules_total counter" in body
    # without usage (no accountant) the families are not exported at all
    assert "dra_claim_energy_joules_total" not in Renderer().render(RenderState(snapshot=snap(10, allocs))).body.decode()


# --- the property test --------------------------------------------------------------------------


CLAIMS = [("ns1", "c1"), ("ns1", "c2"), ("ns2", "c3")]
PODS = {"ns1": ["p1", "p2"], "ns2": ["p3"]}
HELD = [i for i in IDENTS]


@st.composite
def cycles(draw: st.DrawFn) -> list[tuple[float, tuple[AllocationView, ...], dict[str, float | None], set[str], dict[tuple[str, str, str], int] | None, dict[str, float | None]]]:
    out = []
    energy = {g.uuid: draw(st.floats(0, 1e6)) for g in PHYSICAL}
    t = draw(st.floats(0, 1e6))
    last_allocs: tuple[AllocationView, ...] = ()
    for _ in range(draw(st.integers(1, 12))):
        t += draw(st.sampled_from([0.0, 0.5, 1.0, 5.0, 37.5, 3600.0]))
        if out and draw(st.booleans()):
            allocs = last_allocs  # the very same tuple, as the join hands back while nothing moves
        else:
            rows = []
            for dev in draw(st.lists(st.sampled_from(HELD), max_size=6)):
                if draw(st.integers(0, 4)) == 0:
                    rows.append(plugin("ns3", draw(st.sampled_from(["d1", "d2"])), dev.uuid))
                else:
                    ns, claim = draw(st.sampled_from(CLAIMS))
                    for pod in draw(st.lists(st.sampled_from(PODS[ns]), min_size=1, max_size=2, unique=True)):
                        rows.append(dra(ns, pod, claim, dev.uuid))
            allocs = tuple(rows)
        last_allocs = allocs
        readings: dict[str, float | None] = {}
        power: dict[str, float | None] = {}
        missing = set()
        for g in PHYSICAL:
            kind = draw(st.sampled_from(["grow", "grow", "grow", "reset", "missing", "unsupported", "held", "held"]))
            power[g.uuid] = draw(st.sampled_from([0.0, 60.0, 300.0, 700.0, None]))
            if kind == "held":
                pass  # not re-read (a slow counter): its intervals wait for the increase
            elif kind == "grow":
                energy[g.uuid] += draw(st.floats(0, 1e5))
            elif kind == "reset":
                energy[g.uuid] = draw(st.floats(0, 1e3))
            elif kind == "missing":
                missing.add(g.uuid)
                continue
            readings[g.uuid] = None if kind == "unsupported" else energy[g.uuid]
        memory = None
        if draw(st.booleans()):
            memory = {(d.uuid, ns, pod): draw(st.integers(0, 2**34)) for d in HELD for ns, pods in PODS.items() for pod in pods if draw(st.booleans())}
        out.append((t, allocs, readings, missing, memory, power))
    return out


class Reference:
    """The billing rules done the slow, obvious way: every part of every split, every cycle; each
    energy increase split over the intervals since the counter last moved, by length x power."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.pods: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.prev: tuple[float, tuple[DeviceSplit, ...]] | None = None
        # physical GPU -> its mark, the intervals since (holders' splits, length, length x power)
        self.mark: dict[str, float] = {}
        self.window: dict[str, list[tuple[list[DeviceSplit], float, float]]] = defaultdict(list)
        self.holders: dict[str, list[DeviceSplit]] = defaultdict(list)  # of the last cycle
        self.power: dict[str, float] = defaultdict(float)
        self.integrated = 0.0
        self.plugin_joules = 0.0

    def cycle(self, s: Snapshot, memory: dict[tuple[str, str, str], int] | None) -> None:
        splits = split_devices(s, memory)
        advance = self.prev is None or s.monotonic >= self.prev[0]
        dt = s.monotonic - self.prev[0] if self.prev is not None and s.monotonic > self.prev[0] else 0.0
        if dt > 0:
            for sp in self.prev[1]:
                for claim, pod, share in sp.time:
                    if claim is not None:
                        self.claims[claim][1] += dt * sp.fraction * share
                    self.pods[pod][1] += dt * sp.fraction * share
        if advance:
            self.prev = (s.monotonic, splits)
        for d in s.devices:
            r, uuid = d.reading, d.identity.uuid
            if d.identity.is_partition:
                continue
            ok = r is not None and r.ok
            if advance and ok and r.power_watts is not None:
                self.power[uuid] = r.power_watts
            if advance and dt > 0 and uuid in self.mark:
                self.window[uuid].append((self.holders[uuid], dt, dt * self.power[uuid]))
            e = r.energy_joules if ok else None
            if e is not None and e != self.mark.get(uuid):
                if uuid in self.mark:
                    self.settle(uuid, e - self.mark[uuid] if e >= self.mark[uuid] else e)
                self.mark[uuid], self.window[uuid] = e, []
            if advance:
                self.holders[uuid] = [sp for sp in splits if sp.gpu == uuid]

    def settle(self, uuid: str, delta: float) -> None:
        self.integrated += delta
        window = self.window[uuid] or [(self.holders[uuid], 0.0, 0.0)]
        col = 2 if sum(x[2] for x in window) > 0 else 1
        total = sum(x[col] for x in window)
        for entry in window:
            part = delta * entry[col] / total if total > 0 else delta
            for sp in entry[0]:
                for claim, pod, share in sp.usage:
                    if claim is not None:
                        self.claims[claim][0] += part * sp.fraction * share
                    else:
                        self.plugin_joules += part * sp.fraction * share
                    self.pods[pod][0] += part * sp.fraction * share


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cycles())
def test_counters_are_exact_monotonic_and_add_up_to_the_device_energy(seq):
    acc = UsageAccountant(retention=1e12)
    ref = Reference()
    before: dict[str, dict[tuple[str, str], tuple[float, float]]] = {"claims": {}, "pods": {}}
    for t, allocs, readings, missing, memory, power in seq:
        s = snap(t, allocs, readings, missing=missing, power=power)
        u = acc.update(s, memory)
        ref.cycle(s, memory)
        # every held device's parts add up to the whole device, in both splits
        per_gpu: dict[str, float] = defaultdict(float)
        for sp in u.splits:
            assert close(sum(share for _, _, share in sp.usage), 1.0) and close(sum(share for _, _, share in sp.time), 1.0)
            assert sp.rule in (EQUAL, PER_PROCESS) and 0 < sp.fraction <= sp.weight <= 1.0
            per_gpu[sp.gpu] += sp.fraction
        assert all(f <= 1.0 + 1e-9 for f in per_gpu.values())
        for kind, totals, expected in (("claims", u.claims, ref.claims), ("pods", u.pods, ref.pods)):
            now = totals.as_dict()
            # one series per key: the final ones' (oldest first), then the live ones' (sorted)
            assert len(totals.keys) == len(now)
            for key, (joules, seconds) in now.items():
                want = expected.get(key, [0.0, 0.0])
                assert close(joules, want[0]) and close(seconds, want[1]), (kind, key, joules, seconds, want)
                old = before[kind].get(key)
                assert old is None or (joules >= old[0] and seconds >= old[1]), (kind, key)  # never decreases
            assert set(k for k, v in expected.items() if v != [0.0, 0.0]) <= set(now)
            before[kind] = now
        assert close(u.integrated_joules, ref.integrated)
        pods_sum = sum(u.pods.joules)
        claims_sum = sum(u.claims.joules)
        assert close(pods_sum + u.unattributed_joules, u.integrated_joules)
        assert close(claims_sum + ref.plugin_joules + u.unattributed_joules, u.integrated_joules)
