"""The simulated device backend: identities, readings over simulated time, scripted faults and
events, and a hang that really blocks (so the deadline runner is exercised)."""

from __future__ import annotations

import threading

import pytest

from drasim.backend import SimBackend, SimClock
from drasim.scenario import bundled_scenarios, load_scenario, parse_scenario
from exporter.devices.deadline import CallHung, DeadlineRunner
from exporter.devices.model import DeviceEvent, EventKind, ReadError, RecoveryAction, Vendor

# A clock that barely moves: simulated time sits at `start_offset` for the length of a test.
FROZEN = 1e-6


def at(t: float) -> SimClock:
    return SimClock(scale=FROZEN, start_offset=t)


def backend(data: dict, t: float = 0.0) -> SimBackend:
    b = SimBackend(parse_scenario(data, "test"), at(t))
    b.open()
    return b


TWO = {
    "driver_version": "570.1.2",
    "gpus": [
        {"name": "a", "utilization": {"pattern": "sine", "base": 0.5, "amplitude": 0.5, "period": 40}, "memory": "80Gi", "memory_used": 0.5},
        {"name": "m", "mig": [{"profile": "3g.40gb", "placement_start": 0, "utilization": 0.6, "memory_used": 0.5}, {"profile": "3g.40gb", "placement_start": 4, "utilization": 0.2}]},
    ],
}


def ident(b: SimBackend, uuid: str):
    return next(i for i in b.enumerate() if i.uuid == uuid)


def test_clock():
    c = SimClock(scale=FROZEN, start_offset=100.0)
    assert c.now() == pytest.approx(100.0, abs=0.01)
    assert c.epoch(160.0) - c.epoch(100.0) == pytest.approx(60.0)
    assert SimClock(scale=60).real_seconds(120) == pytest.approx(2.0)
    assert SimClock(scale=60).real_seconds(-5) == 0.0


def test_identities():
    b = backend(TWO)
    ids = b.enumerate()
    sc = b.scenario
    assert len(ids) == 2 + 2
    a, m = sc.gpus
    full = {i.uuid: i for i in ids if not i.parent_uuid}
    migs = [i for i in ids if i.parent_uuid]
    assert set(full) == {a.uuid, m.uuid}
    assert full[a.uuid].vendor is Vendor.NVIDIA and full[a.uuid].minor == 0 and full[a.uuid].pci_bus_id == a.pci_bus_id
    assert full[a.uuid].driver_version == "570.1.2" == b.driver_version()
    assert full[a.uuid].memory_total_bytes == 80 * 2**30
    assert [(i.parent_uuid, i.mig_profile, i.gi_profile_id, i.placement_start, i.minor) for i in migs] == [
        (m.uuid, "3g.40gb", 9, 0, 1),
        (m.uuid, "3g.40gb", 9, 4, 1),
    ]
    assert all(i.is_partition and i.physical_uuid == m.uuid for i in migs)
    assert [i.uuid for i in migs] == [x.uuid for x in m.mig]
    # a copy: callers cannot change the backend's list
    ids.clear()
    assert len(b.enumerate()) == 4


def test_readings_follow_the_curves():
    sc = parse_scenario(TWO, "t")
    g = sc.gpus[0]
    for t in (0.0, 10.0, 30.0):
        b = backend(TWO, t)
        r = b.read(ident(b, g.uuid))
        u = g.utilization.at(t)
        assert r.ok and r.error is None
        assert r.utilization_ratio == pytest.approx(u, abs=1e-3)
        assert r.memory_used_bytes == pytest.approx(0.5 * 80 * 2**30, rel=1e-6)
        assert r.memory_total_bytes == 80 * 2**30
        assert r.power_watts == pytest.approx(70 + 630 * u, abs=0.5)
        assert r.temperature_celsius == pytest.approx(35 + 45 * u, abs=0.2)
        assert 0 <= r.sm_active_ratio <= 1
        assert r.recovery_action is RecoveryAction.NONE
        assert r.row_remap_failure is False and r.row_remap_pending is False
        assert r.ecc_uncorrectable_total == 0


def test_mig_instances_and_parent():
    b = backend(TWO, 10.0)
    m = b.scenario.gpus[1]
    i0, _i1 = m.mig
    r0 = b.read(ident(b, i0.uuid))
    assert r0.ok
    assert r0.utilization_ratio is None  # NVML has no utilization rate for MIG
    assert r0.sm_active_ratio == pytest.approx(0.6)
    assert r0.memory_total_bytes == 40 * 2**30 and r0.memory_used_bytes == 20 * 2**30
    assert r0.power_watts is None  # power belongs to the physical GPU
    parent = b.read(ident(b, m.uuid))
    assert parent.utilization_ratio is None
    # weighted by each instance's share of the GPU's memory (2 x 40 GiB of 80 GiB)
    assert parent.sm_active_ratio == pytest.approx((0.6 + 0.2) / 2)
    assert parent.memory_used_bytes == 20 * 2**30
    assert parent.power_watts == pytest.approx(70 + 630 * 0.4, abs=0.5)


def test_energy_is_a_monotonic_counter():
    clock = SimClock(scale=1000.0)
    sc = parse_scenario({"gpus": [{"utilization": 1.0}]}, "t")
    b = SimBackend(sc, clock)
    b.open()
    i = b.enumerate()[0]
    values = []
    for _ in range(5):
        values.append(b.read(i).energy_joules)
        threading.Event().wait(0.002)
    assert values == sorted(values) and values[-1] > values[0]


FAULTS = {
    "gpus": [{"name": "a"}, {"name": "b"}, {"name": "m", "mig": [{"profile": "1g.10gb"}]}],
    "faults": [
        {"kind": "lost", "gpu": "a", "at": "1m", "until": "3m"},
        {"kind": "lost", "gpu": "m", "at": "1m"},
        {"kind": "ecc_uncorrectable", "gpu": "b", "at": "1m", "until": "3m", "rate_per_minute": 6},
        {"kind": "recovery_action", "gpu": "b", "at": "2m", "code": 2},
        {"kind": "row_remap_pending", "gpu": "b", "at": "2m"},
        {"kind": "row_remap_failure", "gpu": "b", "at": "2m", "until": "150s"},
        {"kind": "reset", "gpu": "b", "at": "10m"},
        {"kind": "reset", "gpu": "m", "at": "10m"},
    ],
}


def test_lost_gpu_fails_only_its_reads_and_only_while_lost():
    sc = parse_scenario(FAULTS, "t")
    a, b_, _m = sc.gpus
    for t, a_ok in [(30, True), (60, False), (179, False), (180, True)]:
        b = backend(FAULTS, t)
        r = b.read(ident(b, a.uuid))
        assert r.ok is a_ok, t
        if not a_ok:
            assert r.error is ReadError.LOST and "fallen off the bus" in r.error_detail
        assert b.read(ident(b, b_.uuid)).ok  # the neighbour is unaffected


def test_fault_on_a_mig_gpu_takes_its_instances_with_it():
    sc = parse_scenario(FAULTS, "t")
    m = sc.gpus[2]
    b = backend(FAULTS, 120)
    assert not b.read(ident(b, m.uuid)).ok
    assert b.read(ident(b, m.mig[0].uuid)).error is ReadError.LOST
    b = backend(FAULTS, 601)  # after the reset
    assert b.read(ident(b, m.mig[0].uuid)).ok


def test_ecc_growth_freezes_at_until_and_a_reset_zeroes_it():
    sc = parse_scenario(FAULTS, "t")
    uuid = sc.gpus[1].uuid

    def ecc(t):
        b = backend(FAULTS, t)
        return b.read(ident(b, uuid)).ecc_uncorrectable_total

    assert ecc(59) == 0
    assert ecc(90) == 3  # 6 per minute for 30 s
    assert ecc(180) == 12
    assert ecc(400) == 12  # errors stopped at 3m; the counter never goes back
    assert ecc(601) == 0  # reset at 10m


def test_recovery_action_and_row_remap_flags():
    sc = parse_scenario(FAULTS, "t")
    uuid = sc.gpus[1].uuid
    b = backend(FAULTS, 140)
    r = b.read(ident(b, uuid))
    assert r.recovery_action is RecoveryAction.NODE_REBOOT
    assert r.row_remap_pending is True and r.row_remap_failure is True
    b = backend(FAULTS, 200)
    r = b.read(ident(b, uuid))
    assert r.row_remap_failure is False and r.row_remap_pending is True
    b = backend(FAULTS, 601)
    r = b.read(ident(b, uuid))
    assert r.recovery_action is RecoveryAction.NONE and r.row_remap_pending is False


def test_hang_blocks_until_it_ends_and_the_deadline_runner_reports_it():
    data = {"gpus": [{"name": "a"}, {"name": "b"}], "faults": [{"kind": "hang", "gpu": "a", "at": 0}]}
    b = backend(data, 1.0)
    a_id, b_id = b.enumerate()
    runner = DeadlineRunner()
    try:
        with pytest.raises(CallHung):
            runner.call(a_id.uuid, lambda: b.read(a_id), 0.05)
        assert a_id.uuid in runner.hung_lanes()
        # further calls on the stuck lane fail fast; the other device reads normally
        with pytest.raises(CallHung):
            runner.call(a_id.uuid, lambda: b.read(a_id), 5.0)
        assert runner.call(b_id.uuid, lambda: b.read(b_id), 5.0).ok
    finally:
        b.close()  # releases the blocked read, as stopping the agent must
        runner.close()


def test_close_releases_a_hung_read():
    data = {"gpus": [{"name": "a"}], "faults": [{"kind": "hang", "gpu": "a", "at": 0}]}
    b = backend(data, 1.0)
    i = b.enumerate()[0]
    done = threading.Event()
    result = []

    def reader():
        result.append(b.read(i))
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    assert not done.wait(0.05)  # really blocked
    b.close()
    assert done.wait(5.0)
    assert result and result[0].ok  # the hang has no end; the reading after release is normal


def test_hang_with_an_end_returns_a_reading_after_it():
    # 20 simulated seconds of hang at x1000 speed: a real 20 ms block
    data = {"gpus": [{"name": "a"}], "faults": [{"kind": "hang", "gpu": "a", "at": 0, "until": 20}]}
    b = SimBackend(parse_scenario(data, "t"), SimClock(scale=1000.0))
    b.open()
    try:
        r = b.read(b.enumerate()[0])
        assert r.ok
        assert b.clock.now() >= 20
    finally:
        b.close()


def test_events_arrive_at_their_time():
    data = {
        "gpus": [{"name": "a"}, {"name": "b"}],
        "faults": [
            {"kind": "xid", "gpu": "a", "at": 0.5, "code": 13},  # in the past at start: not replayed
            {"kind": "xid", "gpu": "a", "at": 100, "code": 79},
            {"kind": "lost", "gpu": "a", "at": 100},
            {"kind": "ecc_uncorrectable", "gpu": "b", "at": 110, "rate_per_minute": 1},
            {"kind": "recovery_action", "gpu": "b", "at": 120, "code": 1},
            {"kind": "hang", "gpu": "b", "at": 125},  # no event for a hang
            {"kind": "reset", "gpu": "a", "at": 130},
        ],
    }
    sc = parse_scenario(data, "t")
    got: list[DeviceEvent] = []
    all_in = threading.Event()

    def sink(ev: DeviceEvent) -> None:
        got.append(ev)
        if len(got) == 5:
            all_in.set()

    # x1000: the 130 simulated seconds pass in 0.13 s
    clock = SimClock(scale=1000.0, start_offset=1.0)
    b = SimBackend(sc, clock)
    b.open()
    b.start_events(sink)
    try:
        assert all_in.wait(5.0), got
    finally:
        b.close()
    a, bb = sc.gpus
    assert [(e.uuid, e.kind, e.code) for e in got] == [
        (a.uuid, EventKind.XID, 79),
        (a.uuid, EventKind.GPU_LOST, 0),
        (bb.uuid, EventKind.ECC_DBE, 0),
        (bb.uuid, EventKind.RECOVERY_ACTION, 1),
        (a.uuid, EventKind.RESET, 0),
    ]
    assert got[0].timestamp == pytest.approx(clock.epoch(100.0))


def test_a_failing_sink_does_not_stop_the_event_thread():
    data = {"gpus": [{"name": "a"}], "faults": [{"kind": "xid", "gpu": "a", "at": 100, "code": 13}, {"kind": "xid", "gpu": "a", "at": 101, "code": 31}]}
    got = []
    second = threading.Event()

    def sink(ev):
        got.append(ev.code)
        if ev.code == 13:
            raise RuntimeError("health engine bug")
        second.set()

    b = SimBackend(parse_scenario(data, "t"), SimClock(scale=1000.0))
    b.open()
    b.start_events(sink)
    try:
        assert second.wait(5.0)
    finally:
        b.close()
    assert got == [13, 31]


def test_close_stops_the_event_thread_before_far_faults():
    data = {"gpus": [{"name": "a"}], "faults": [{"kind": "xid", "gpu": "a", "at": "10h", "code": 79}]}
    got = []
    b = SimBackend(parse_scenario(data, "t"), SimClock(scale=1.0))
    b.open()
    before = set(threading.enumerate())
    b.start_events(got.append)
    (events,) = [t for t in set(threading.enumerate()) - before if t.name == "sim-events"]
    b.close()
    assert not events.is_alive()  # close() woke it from its 10-hour wait
    assert got == []


@pytest.mark.parametrize("name", sorted(bundled_scenarios()))
def test_every_bundled_scenario_reads_at_start(name):
    sc = load_scenario(bundled_scenarios()[name])
    b = SimBackend(sc, at(0.0))
    b.open()
    ids = b.enumerate()
    assert len(ids) == len(sc.gpus) + sum(len(g.mig) for g in sc.gpus)
    assert len({i.uuid for i in ids}) == len(ids)
    for i in ids:
        r = b.read(i)
        assert r.ok, (name, i.uuid, r.error_detail)
