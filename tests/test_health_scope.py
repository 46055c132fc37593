"""Fault scope and restored conditions: what the health engine books on a MIG instance, what
on its GPU, and how a condition read back from a DeviceTaintRule after a restart behaves.

Events carry the instance's uuid as the NVML backend resolves it from (GPU, GI, CI); the
backend side of that mapping is tested against the fake NVML in test_nvml_backend.py.
Time is a hand-moved clock: no sleeps, no timing assertions.
"""

from __future__ import annotations

import pytest
from clock_helpers import ManualClock
from prometheus_client.parser import text_string_to_metric_families
from test_health_engine import G0, G1, POLICY, T0, mig, observe, ok, xid

from exporter.devices.model import DeviceEvent, EventKind
from exporter.health.engine import HealthEngine
from exporter.health.model import Scope, Tier
from exporter.health.xid import FATAL_XIDS, GPU_WIDE_XIDS, xid_scope
from exporter.metrics.render import Renderer, RenderState
from exporter.model.join import JoinInputs, effective_health, join

M0, M1 = mig(G0, 0), mig(G0, 1)
IDS = (G0, M0, M1, G1)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def engine(clock: ManualClock) -> HealthEngine:
    e = HealthEngine(clock, POLICY)
    e.set_topology(IDS)
    return e


def views(engine: HealthEngine, clock: ManualClock) -> dict:
    snap = join(JoinInputs(node="n", timestamp=clock.t, identities=IDS, readings={d.uuid: ok(d) for d in IDS}, health=engine.all_health()))
    return {d.uuid: d.health for d in snap.devices}


def test_scope_table():
    assert FATAL_XIDS <= GPU_WIDE_XIDS
    for code in (79, 48, 119, 120, 140, 95, 63, 64, 74, 92, 154):
        assert xid_scope(code) is Scope.GPU, code
    for code in (13, 31, 43, 45, 68, 69, 94, 12345):
        assert xid_scope(code) is Scope.INSTANCE, code


def test_an_instance_scoped_xid_stays_on_its_instance_and_escalates_there(engine, clock):
    for _ in range(POLICY.info_repeat):  # repeats escalate informational -> degraded
        engine.on_event(xid(M1, 13))
        clock.advance(1)
    assert engine.xid_counts == {(M1.uuid, 13): POLICY.info_repeat}
    by = views(engine, clock)
    assert not by[M1.uuid].healthy
    (cond,) = by[M1.uuid].conditions
    assert (cond.uuid, cond.scope, cond.tier) == (M1.uuid, Scope.INSTANCE, Tier.DEGRADED)
    assert by[M0.uuid].healthy and by[G0.uuid].healthy and by[G1.uuid].healthy
    assert engine.health(G0.uuid).conditions == ()

    body = Renderer().render(RenderState(snapshot=join(JoinInputs(node="n", timestamp=clock.t, identities=IDS, readings={}, health=engine.all_health())), xid_counts=dict(engine.xid_counts))).body.decode()
    xids = [(s.labels["uuid"], s.value) for f in text_string_to_metric_families(body) for s in f.samples if s.name == "gpu_xid_errors_total"]
    assert xids == [(M1.uuid, POLICY.info_repeat)]


def test_a_gpu_wide_xid_on_an_instance_takes_the_whole_gpu(engine, clock):
    engine.on_event(xid(M1, 79))
    assert engine.xid_counts == {(G0.uuid, 79): 1}
    by = views(engine, clock)
    assert not by[G0.uuid].healthy and not by[M0.uuid].healthy and not by[M1.uuid].healthy
    assert by[G1.uuid].healthy
    assert {c.scope for c in by[M0.uuid].conditions} == {Scope.GPU}


def test_other_event_kinds_on_an_instance_are_gpu_wide(engine, clock):
    engine.on_event(DeviceEvent(uuid=M0.uuid, kind=EventKind.ECC_DBE))
    assert not engine.health(G0.uuid).healthy and M0.uuid not in engine.all_health()


def test_effective_health_gives_instances_the_gpus_gpu_wide_conditions_only(engine, clock):
    engine.on_event(xid(G0, 74))  # degraded, GPU-wide
    for _ in range(POLICY.info_repeat):
        engine.on_event(xid(M0, 31))
    health = engine.all_health()
    assert [c.reason for c in effective_health(M1.uuid, G0.uuid, health).conditions] == ["xid_74"]
    assert sorted(c.reason for c in effective_health(M0.uuid, G0.uuid, health).conditions) == ["xid_31", "xid_74"]
    assert [c.reason for c in effective_health(G0.uuid, "", health).conditions] == ["xid_74"]


def test_a_reset_of_the_gpu_is_a_reset_of_its_instances(engine, clock):
    # Instance-scoped XIDs escalate to degraded at most; a fatal instance condition comes from
    # a restored rule. Either way a reset of the GPU is what it waits for.
    engine.restore(M0.uuid, "xid_43", Tier.FATAL, T0, "XID 43 repeated", reset_required=True)
    (c,) = engine.health(M0.uuid).conditions
    assert (c.tier, c.reset_required, c.scope) == (Tier.FATAL, True, Scope.INSTANCE)
    clock.advance(POLICY.event_quiet * 2)
    assert not engine.health(M0.uuid).healthy
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RESET))
    clock.advance(POLICY.clear_hold)
    assert engine.health(M0.uuid).healthy


def test_an_instance_that_refails_becomes_sticky_on_its_own(engine, clock):
    for _ in range(POLICY.sticky_after):
        for _ in range(POLICY.info_repeat):
            engine.on_event(xid(M0, 13))
        clock.advance(POLICY.event_quiet + 1)
        observe(engine, ids=IDS)  # a cycle sees the instance healthy again
    assert engine.health(M0.uuid).sticky and not engine.health(G0.uuid).sticky
    by = views(engine, clock)
    assert not by[M0.uuid].healthy and by[M1.uuid].healthy and by[G0.uuid].healthy


def test_sticky_mark_with_instance_scope_stays_on_the_instance(clock):
    e = HealthEngine(clock, POLICY)
    e.mark_sticky(M0.uuid, "sticky label on rule r", scope=Scope.INSTANCE)
    e.set_topology(IDS)
    assert e.health(M0.uuid).sticky and not e.health(G0.uuid).sticky


# ------------------------------------------------------------------------------ restore


def test_a_restored_fatal_condition_holds_until_a_reset_is_observed(engine, clock):
    engine.restore(G0.uuid, "xid_48", Tier.FATAL, T0 - 3600, "XID 48 double-bit ECC", reset_required=True)
    (c,) = engine.health(G0.uuid).conditions
    assert (c.reason, c.tier, c.since, c.reset_required, c.scope) == ("xid_48", Tier.FATAL, T0 - 3600, True, Scope.GPU)
    for _ in range(10):  # clean readings and a long time are no reset
        observe(engine, ids=(G0, G1))
        clock.advance(POLICY.event_quiet)
    assert not engine.health(G0.uuid).healthy
    assert not effective_health(M1.uuid, G0.uuid, engine.all_health()).healthy
    engine.on_event(DeviceEvent(uuid=G0.uuid, kind=EventKind.RESET))
    clock.advance(POLICY.clear_hold - 1)
    assert not engine.health(G0.uuid).healthy
    clock.advance(1)
    assert engine.health(G0.uuid).healthy


def test_a_restored_level_condition_clears_after_clean_readings(engine, clock):
    engine.restore(G1.uuid, "driver_hung", Tier.FATAL, T0 - 60, "call did not return", reset_required=False)
    assert not engine.health(G1.uuid).healthy
    observe(engine)
    clock.advance(POLICY.clear_hold - 1)
    observe(engine)
    assert not engine.health(G1.uuid).healthy
    clock.advance(1)
    assert engine.health(G1.uuid).healthy


def test_a_restored_level_seen_again_keeps_its_start(engine, clock):
    engine.restore(G1.uuid, "row_remap_pending", Tier.DEGRADED, T0 - 600, "pending", reset_required=False)
    observe(engine, ok(G1, row_remap_pending=True))
    (c,) = engine.health(G1.uuid).conditions
    assert (c.reason, c.since) == ("row_remap_pending", T0 - 600)


def test_a_restored_instance_condition_stays_on_the_instance(engine, clock):
    engine.restore(M1.uuid, "xid_13", Tier.DEGRADED, T0 - 10, "XID 13 repeated", reset_required=False)
    by = views(engine, clock)
    assert not by[M1.uuid].healthy and by[M0.uuid].healthy and by[G0.uuid].healthy
    assert by[M1.uuid].conditions[0].scope is Scope.INSTANCE
    # a GPU-wide reason restored for an instance's rule lands on the GPU
    engine.restore(M0.uuid, "xid_79", Tier.FATAL, T0 - 10, "XID 79", reset_required=True)
    by = views(engine, clock)
    assert not by[G0.uuid].healthy and not by[M0.uuid].healthy and not by[M1.uuid].healthy


# ------------------------------------------------------------------ through NVML and the agent


def test_an_xid_nvml_attributes_to_a_mig_instance_is_booked_on_that_instance():
    """The real ctypes event struct from the fake NVML carries gpuInstanceId/computeInstanceId;
    the backend maps (parent, GI, CI) to the instance's uuid, the engine books it there."""
    import pynvml
    from fakes.fake_nvml import FakeNvml, installed
    from kit_helpers import wait_until
    from test_nvml_backend import GPU0, GPU1, MIG_A, MIG_B, idle_gpu, mig_gpu

    from exporter.config import Config
    from exporter.devices.nvml import NvmlBackend
    from exporter.wiring import compose

    fake = FakeNvml([mig_gpu(fields={}), idle_gpu()])  # no field values: no "reset pending" of its own
    with installed(fake):
        agent = compose(
            Config(listen_host="127.0.0.1", listen_port=0, node_name="n1", interval=3600.0, call_timeout=1.0),
            NvmlBackend(event_wait_ms=50, lock_timeout_s=0.2),
        )
        agent.start(serve=False)
        try:
            XID = pynvml.nvmlEventTypeXidCriticalError
            for _ in range(POLICY.info_repeat):  # XID 13 on MIG_A's GPU instance: escalates to degraded there
                fake.queue_event(MIG_A, XID, data=13)
            wait_until(lambda: agent.health.counters()[0].get((MIG_A, 13)) == POLICY.info_repeat, timeout=30, message="three XID 13 on MIG_A")
            snap = agent.run_cycle()
            by = {d.uuid: d.health for d in snap.devices}
            assert not by[MIG_A].healthy and [c.scope for c in by[MIG_A].conditions] == [Scope.INSTANCE]
            assert by[MIG_B].healthy and by[GPU0].healthy and by[GPU1].healthy
            assert (GPU0, 13) not in agent.health.counters()[0]

            fake.queue_event(MIG_B, XID, data=79)  # GPU-wide by nature, though NVML names the instance
            wait_until(lambda: agent.health.counters()[0].get((GPU0, 79)) == 1, timeout=30, message="XID 79 on GPU0")
            snap = agent.run_cycle()
            by = {d.uuid: d.health for d in snap.devices}
            assert not by[GPU0].healthy and not by[MIG_A].healthy and not by[MIG_B].healthy and by[GPU1].healthy
        finally:
            agent.stop()
