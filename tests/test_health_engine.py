"""The health engine: readings and device events in, per-device conditions out.

All time comes from a mutable fake clock, so hysteresis, hold periods and repeat windows are
exercised exactly, without sleeping. Metrics are checked through the real renderer
(prometheus_client's exposition), parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import pytest
from clock_helpers import ManualClock
from kit_helpers import gpu, parse_samples

from exporter.devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, ReadError, RecoveryAction, Vendor
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.health.model import Tier
from exporter.health.xid import DEGRADED_XIDS, FATAL_XIDS, INFORMATIONAL_XIDS, classify_xid
from exporter.metrics.render import Renderer, RenderState
from exporter.model.join import JoinInputs, join

T0 = 1_750_000_000.0


def mig(parent: DeviceIdentity, j: int) -> DeviceIdentity:
    return DeviceIdentity(
        uuid=f"MIG-{parent.index:04d}{j:04d}-0000-0000-0000-000000000000", vendor=Vendor.NVIDIA, model="H100 MIG 1g.10gb",
        pci_bus_id=parent.pci_bus_id, index=j, minor=parent.minor, parent_uuid=parent.uuid, mig_profile="1g.10gb",
        gi_profile_id=19, placement_start=j,
    )


def ok(d: DeviceIdentity, **kw) -> DeviceReading:
    base = dict(recovery_action=RecoveryAction.NONE, row_remap_pending=False, row_remap_failure=False, retired_pages_pending=False, ecc_uncorrectable_total=0)
    base.update(kw)
    return DeviceReading(uuid=d.uuid, **base)


def xid(d: DeviceIdentity, code: int) -> DeviceEvent:
    return DeviceEvent(uuid=d.uuid, kind=EventKind.XID, code=code, detail="test")


G0, G1 = gpu(0), gpu(1)
POLICY = HealthPolicy(clear_hold=120, event_quiet=1800, info_quiet=600, repeat_window=86400, info_repeat=3, degraded_repeat=3, sticky_after=3, sticky_window=7 * 86400)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def engine(clock: ManualClock) -> HealthEngine:
    e = HealthEngine(clock, POLICY)
    e.set_topology([G0, G1])
    return e


def observe(engine: HealthEngine, *readings: DeviceReading, ids=(G0, G1)) -> None:
    """One collection cycle: every device healthy unless a reading for it is given."""
    given = {r.uuid: r for r in readings}
    engine.observe(list(ids), {d.uuid: given.get(d.uuid) or ok(d) for d in ids})


def reasons(engine: HealthEngine, d: DeviceIdentity) -> dict[str, Tier]:
    return {c.reason: c.tier for c in engine.health(d.uuid).conditions}


# ------------------------------------------------------------------------------ XID tiers


def test_xid_lists_match_the_issue():
    assert {48, 64, 79, 95, 119, 120, 140, 143} <= FATAL_XIDS
    assert {74, 109} <= DEGRADED_XIDS
    assert {13, 31, 43, 45, 68} <= INFORMATIONAL_XIDS
    assert not (FATAL_XIDS & DEGRADED_XIDS or FATAL_XIDS & INFORMATIONAL_XIDS or DEGRADED_XIDS & INFORMATIONAL_XIDS)
    assert classify_xid(99999) is Tier.INFORMATIONAL  # unknown codes never evict on guesswork


@pytest.mark.parametrize("code", [48, 64, 79, 95, 119, 120, 140, 143])
def test_fatal_xid_makes_the_gpu_unhealthy(engine, code):
    engine.on_event(xid(G0, code))
    h = engine.health(G0.uuid)
    assert not h.healthy and h.worst is Tier.FATAL
    assert reasons(engine, G0) == {f"xid_{code}": Tier.FATAL}
    assert engine.health(G1.uuid).healthy  # the other GPU is untouched


@pytest.mark.parametrize("code", [74, 109])
def test_degraded_xid(engine, code):
    engine.on_event(xid(G0, code))
    assert reasons(engine, G0) == {f"xid_{code}": Tier.DEGRADED}
    assert not engine.health(G0.uuid).healthy


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68])
def test_application_xid_is_informational_and_healthy(engine, code):
    engine.on_event(xid(G0, code))
    h = engine.health(G0.uuid)
    assert reasons(engine, G0) == {f"xid_{code}": Tier.INFORMATIONAL}
    assert h.healthy and h.worst is Tier.INFORMATIONAL


def test_xid_counts_are_per_gpu_and_code(engine):
    for _ in range(3):
        engine.on_event(xid(G0, 13))
    engine.on_event(xid(G1, 79))
    assert engine.xid_counts == {(G0.uuid, 13): 3, (G1.uuid, 79): 1}


# ------------------------------------------------------------------------------ polled states


@pytest.mark.parametrize(
    "reading,reason,tier",
    [
        (DeviceReading.failed(G0.uuid, ReadError.LOST, "fell off the bus"), "gpu_lost", Tier.FATAL),
        (DeviceReading.failed(G0.uuid, ReadError.TIMEOUT, "hung"), "driver_hung", Tier.FATAL),
        (ok(G0, recovery_action=RecoveryAction.GPU_RESET), "recovery_action_gpu_reset", Tier.FATAL),
        (ok(G0, recovery_action=RecoveryAction.NODE_REBOOT), "recovery_action_node_reboot", Tier.FATAL),
        (ok(G0, recovery_action=RecoveryAction.DRAIN_AND_RESET), "recovery_action_drain_and_reset", Tier.FATAL),
        (ok(G0, recovery_action=RecoveryAction.DRAIN_P2P), "recovery_action_drain_p2p", Tier.DEGRADED),
        (ok(G0, row_remap_failure=True), "row_remap_failure", Tier.FATAL),
        (ok(G0, row_remap_pending=True), "row_remap_pending", Tier.DEGRADED),
    ],
)
def test_level_conditions(engine, reading, reason, tier):
    observe(engine, reading)
    assert reasons(engine, G0) == {reason: tier}
    assert not engine.health(G0.uuid).healthy
    assert engine.health(G1.uuid).healthy


def test_uncorrectable_ecc_growth_is_fatal_but_a_steady_count_is_not(engine, clock):
    observe(engine, ok(G0, ecc_uncorrectable_total=5))  # first sight: a baseline, not growth
    clock.advance(10)
    observe(engine, ok(G0, ecc_uncorrectable_total=5))
    assert engine.health(G0.uuid).healthy
    clock.advance(10)
    observe(engine, ok(G0, ecc_uncorrectable_total=7))
    h = engine.health(G0.uuid)
    assert reasons(engine, G0) == {"ecc_uncorrectable_growth": Tier.FATAL}
    assert "grew by 2 to 7" in h.conditions[0].evidence


@pytest.mark.parametrize("action,tier", [(RecoveryAction.GPU_RESET, Tier.FATAL), (RecoveryAction.NODE_REBOOT, Tier.FATAL), (RecoveryAction.DRAIN_P2P, Tier.DEGRADED)])
def test_recovery_action_event(engine, action, tier):
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RECOVERY_ACTION, code=int(action)))
    assert reasons(engine, G0) == {f"recovery_action_{action.name.lower()}": tier}


def test_recovery_action_none_event_is_no_condition(engine):
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RECOVERY_ACTION, code=int(RecoveryAction.NONE)))
    assert engine.health(G0.uuid).conditions == ()


def test_lost_gpu_event(engine):
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.GPU_LOST))
    assert engine.health(G0.uuid).worst is Tier.FATAL


# ------------------------------------------------------------------------------ escalation


def test_repeated_informational_xid_on_one_gpu_escalates_to_degraded(engine, clock):
    engine.on_event(xid(G0, 13))
    clock.advance(60)
    engine.on_event(xid(G0, 13))
    assert engine.health(G0.uuid).healthy
    clock.advance(60)
    engine.on_event(xid(G0, 13))
    h = engine.health(G0.uuid)
    assert not h.healthy and reasons(engine, G0) == {"xid_13": Tier.DEGRADED}
    assert "repeated 3x" in h.conditions[0].evidence


def test_the_same_xid_on_different_gpus_does_not_escalate(engine):
    engine.on_event(xid(G0, 13))
    engine.on_event(xid(G1, 13))
    engine.on_event(xid(G0, 13))
    assert engine.health(G0.uuid).healthy and engine.health(G1.uuid).healthy


def test_repeats_outside_the_window_do_not_escalate(engine, clock):
    for _ in range(3):
        engine.on_event(xid(G0, 13))
        clock.advance(POLICY.repeat_window / 2 + 1)
    assert engine.health(G0.uuid).healthy


def test_repeated_degraded_escalates_to_fatal_and_never_back_on_a_repeat(engine, clock):
    for _ in range(3):
        engine.on_event(xid(G0, 74))
        clock.advance(30)
    assert reasons(engine, G0) == {"xid_74": Tier.FATAL}
    clock.advance(POLICY.repeat_window + 1)  # old repeats leave the window...
    engine.on_event(xid(G0, 74))
    assert reasons(engine, G0) == {"xid_74": Tier.FATAL}  # ...but a repeat never lowers the tier


# ------------------------------------------------------------------------------ hysteresis and recovery


def test_flapping_level_condition_does_not_flap_health(engine, clock):
    seen_healthy = []
    for i in range(20):  # pending remap present and absent on alternate 10 s cycles
        observe(engine, ok(G0, row_remap_pending=(i % 2 == 0)))
        seen_healthy.append(engine.health(G0.uuid).healthy)
        clock.advance(10)
    assert not any(seen_healthy)
    observe(engine, ok(G0, row_remap_pending=True))
    clock.advance(10)
    observe(engine)  # clean from here on
    clock.advance(POLICY.clear_hold - 1)
    observe(engine)
    assert not engine.health(G0.uuid).healthy  # clean for less than the hold: still there
    clock.advance(1)
    observe(engine)
    assert engine.health(G0.uuid).healthy and engine.health(G0.uuid).conditions == ()


def test_a_persisting_level_condition_is_one_occurrence(engine, clock):
    observe(engine, ok(G0, row_remap_failure=True))
    first = engine.health(G0.uuid).conditions[0]
    for _ in range(5):
        clock.advance(10)
        observe(engine, ok(G0, row_remap_failure=True))
    c = engine.health(G0.uuid).conditions[0]
    # Still the same occurrence: no new evidence (an admin who removed its rule is respected).
    assert (c.since, c.last_seen, c.count) == (first.since, first.since, 1)
    clock.advance(10)
    observe(engine)  # gone for a cycle ...
    clock.advance(10)
    observe(engine, ok(G0, row_remap_failure=True))  # ... and back within the hold: a new occurrence
    c = engine.health(G0.uuid).conditions[0]
    assert c.since == first.since and c.last_seen == clock.t and c.count == 2


def test_fatal_xid_waits_for_a_reset_then_the_hold(engine, clock):
    engine.on_event(xid(G0, 79))
    clock.advance(30 * 86400)  # healthy readings for a month do not clear a fatal XID
    observe(engine)
    assert engine.health(G0.uuid).worst is Tier.FATAL
    assert engine.last_reset(G0.uuid) is None
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RESET))
    assert engine.last_reset(G0.uuid) == clock.t
    clock.advance(POLICY.clear_hold - 1)
    assert engine.health(G0.uuid).worst is Tier.FATAL
    clock.advance(1)
    assert engine.health(G0.uuid).healthy


def test_a_fault_after_the_reset_is_not_cleared_by_it(engine, clock):
    engine.on_event(xid(G0, 79))
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RESET))
    clock.advance(5)
    engine.on_event(xid(G0, 79))  # fails again right after the reset
    clock.advance(POLICY.clear_hold * 10)
    assert engine.health(G0.uuid).worst is Tier.FATAL


def test_a_lost_gpu_that_answers_again_counts_as_reset(engine, clock):
    engine.on_event(xid(G0, 79))
    observe(engine, DeviceReading.failed(G0.uuid, ReadError.LOST))
    clock.advance(10)
    observe(engine)  # answers again: someone reset or re-seated it
    assert engine.last_reset(G0.uuid) == clock.t
    clock.advance(POLICY.clear_hold)
    observe(engine)
    assert engine.health(G0.uuid).healthy


def test_a_hung_call_that_returns_is_not_a_reset(engine, clock):
    """Regression: any failed->ok reading used to count as a reset and released fatal XIDs."""
    engine.on_event(xid(G0, 48))
    observe(engine, DeviceReading.failed(G0.uuid, ReadError.TIMEOUT, "call did not return"))
    for _ in range(3):
        clock.advance(POLICY.clear_hold)
        observe(engine)
    assert engine.last_reset(G0.uuid) is None
    assert reasons(engine, G0) == {"xid_48": Tier.FATAL}  # driver_hung cleared, the XID did not


def test_degraded_event_clears_after_quiet_period(engine, clock):
    engine.on_event(xid(G0, 74))
    clock.advance(POLICY.event_quiet - 1)
    assert not engine.health(G0.uuid).healthy
    clock.advance(1)
    assert engine.health(G0.uuid).healthy


def test_degraded_event_clears_after_a_reset_and_the_hold(engine, clock):
    engine.on_event(xid(G0, 74))
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RESET))
    clock.advance(POLICY.clear_hold)
    assert engine.health(G0.uuid).healthy


def test_informational_condition_expires(engine, clock):
    engine.on_event(xid(G0, 43))
    clock.advance(POLICY.info_quiet - 1)
    assert reasons(engine, G0) == {"xid_43": Tier.INFORMATIONAL}
    clock.advance(1)
    assert engine.health(G0.uuid).conditions == ()


def test_a_gpu_that_keeps_refailing_becomes_sticky_until_cleared(engine, clock):
    for _ in range(POLICY.sticky_after):
        observe(engine, ok(G0, row_remap_pending=True))
        clock.advance(10)
        observe(engine)
        clock.advance(POLICY.clear_hold)
        observe(engine)
        clock.advance(3600)
    h = engine.health(G0.uuid)
    assert h.sticky and not h.healthy
    assert reasons(engine, G0) == {"repeated_failures": Tier.FATAL}
    clock.advance(30 * 86400)
    observe(engine)
    assert not engine.health(G0.uuid).healthy  # time alone does not clear it
    engine.clear_sticky(G0.uuid)
    assert engine.health(G0.uuid).healthy and not engine.health(G0.uuid).sticky


def test_a_sticky_mark_made_before_the_topology_lands_on_the_gpu(clock):
    """After a restart an adopted sticky rule may name a MIG instance before the engine knows
    the instance's GPU. The mark must end up on the GPU, and clearing by either uuid clears it."""
    e = HealthEngine(clock, POLICY)
    m = mig(G1, 2)
    e.mark_sticky(m.uuid, "sticky label on DeviceTaintRule r")  # topology not known yet
    e.set_topology([G0, G1, m])
    assert e.health(G1.uuid).sticky and not e.health(G1.uuid).healthy
    assert not e.health(m.uuid).sticky  # the instance holds no state of its own
    (cond,) = e.health(G1.uuid).conditions
    assert cond.reason == "repeated_failures" and cond.evidence == "sticky label on DeviceTaintRule r"
    e.clear_sticky(m.uuid)  # the person deleted the instance's rule
    assert e.health(G1.uuid).healthy and not e.health(G1.uuid).sticky


def test_failures_spread_beyond_the_sticky_window_do_not_stick(engine, clock):
    for _ in range(POLICY.sticky_after):
        observe(engine, ok(G0, row_remap_pending=True))
        clock.advance(10)
        observe(engine)
        clock.advance(POLICY.sticky_window / 2 + 1)
        observe(engine)
    assert engine.health(G0.uuid).healthy and not engine.health(G0.uuid).sticky


# ------------------------------------------------------------------------------ MIG, listeners


def test_mig_events_are_facts_about_the_physical_gpu(clock):
    m0, m1 = mig(G0, 0), mig(G0, 1)
    engine = HealthEngine(clock, POLICY)
    engine.set_topology([G0, m0, m1, G1])
    engine.on_event(xid(m1, 79))
    assert engine.xid_counts == {(G0.uuid, 79): 1}
    all_h = engine.all_health()
    assert all_h[G0.uuid].worst is Tier.FATAL and m1.uuid not in all_h
    snap = join(JoinInputs(node="n", timestamp=clock.t, identities=(G0, m0, m1, G1), readings={}, health=all_h))
    by = {d.uuid: d.health for d in snap.devices}
    assert not by[m0.uuid].healthy and not by[m1.uuid].healthy  # both instances live on the bad GPU
    assert by[G1.uuid].healthy


def test_listeners_hear_changes_and_a_failing_listener_is_isolated(engine, clock):
    heard = []
    engine.subscribe(lambda u: (_ for _ in ()).throw(RuntimeError("listener bug")))
    engine.subscribe(heard.append)
    engine.on_event(xid(G0, 79))
    assert heard == [G0.uuid]
    observe(engine, ok(G1, row_remap_pending=True))
    assert heard == [G0.uuid, G1.uuid]
    observe(engine, ok(G1, row_remap_pending=True))
    assert heard == [G0.uuid, G1.uuid]  # nothing changed in this cycle


# ------------------------------------------------------------------------------ metrics


def _samples(engine: HealthEngine, ids, clock) -> dict[str, list]:
    snap = join(JoinInputs(node="node-a", timestamp=clock.t, identities=tuple(ids), readings={d.uuid: ok(d) for d in ids}, health=engine.all_health()))
    return parse_samples(Renderer().render(RenderState(snapshot=snap, xid_counts=dict(engine.xid_counts))).body.decode())


def test_health_metrics(engine, clock):
    engine.on_event(xid(G0, 79))
    engine.on_event(xid(G0, 79))
    engine.on_event(xid(G1, 13))
    m = _samples(engine, (G0, G1), clock)
    healthy = {lab["uuid"]: v for lab, v in m["gpu_healthy"]}
    assert healthy == {G0.uuid: 0.0, G1.uuid: 1.0}
    conds = {(lab["uuid"], lab["tier"], lab["reason"]) for lab, v in m["gpu_health_condition"] if v == 1}
    assert conds == {(G0.uuid, "fatal", "xid_79"), (G1.uuid, "informational", "xid_13")}
    xids = {(lab["uuid"], lab["xid"]): v for lab, v in m["gpu_xid_errors_total"]}
    assert xids == {(G0.uuid, "79"): 2.0, (G1.uuid, "13"): 1.0}
    assert all(lab["node"] == "node-a" for lab, _ in m["gpu_healthy"])
