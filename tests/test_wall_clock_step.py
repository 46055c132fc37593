"""A step of the node's wall clock moves no timer (issue 30).

NTP stepping a VM after live migration or suspend, ``chronyc makestep``, an operator fixing the
date: the agent's windows, holds and graces are measured on monotonic time, the wall clock only
dates what leaves the process. Each test here steps the wall clock (``step_wall``: ±1 h, +1 d)
while monotonic time runs on, at the moment that hurt before, and checks the timer in real
(monotonic) seconds. Time never passes by waiting: the clock is moved by hand.

The rigs are the ones the remediation tests use (tests/test_remediation_domains.py: the HTTP
Kubernetes API emulation with the strict validator, the agent's HTTP client, SliceWatcher,
health engine and remediator by the production wiring, defaults for the settle window, the
node-fault window and a rate limit of 2), with their ``ManualClock`` stepped; the health rows
drive the health engine alone. The last test runs the whole agent on the simulated node
(``SimClock.step_wall``). The billing rows (device-seconds, a gone claim's retention) are the
billing model's tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import test_remediation_domains as domains
from clock_helpers import ManualClock
from kit_helpers import gpu, scrape_samples, wait_until
from test_remediation_domains import HOLD, NODE, POLICY, SETTLE, Rig, plain_gpus

from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.config import TaintMode
from exporter.devices.model import DeviceEvent, DeviceReading, EventKind, ReadError, RecoveryAction
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.health.model import READING_STUCK
from exporter.k8s import names
from exporter.model.snapshot import AllocationView
from exporter.remediation.adoption import BootIdentity
from exporter.remediation.evictions import EVENT_REASON, GRACE

make_rig = domains.make_rig  # the remediation rig's fixture
HOUR, DAY = 3600.0, 86400.0
T0 = 1_750_000_000.0
G = gpu(0)


# ------------------------------------------------------------------------------ health


def engine(**policy: float) -> tuple[ManualClock, HealthEngine]:
    clock = ManualClock(T0)
    h = HealthEngine(clock, HealthPolicy(**policy))
    h.set_topology([G])
    return clock, h


def cycle(h: HealthEngine, **reading: object) -> None:
    base: dict[str, object] = {"recovery_action": RecoveryAction.NONE, "ecc_uncorrectable_total": 0}
    h.observe([G], {G.uuid: DeviceReading(uuid=G.uuid, **{**base, **reading})})  # type: ignore[arg-type]


def reasons(h: HealthEngine) -> list[str]:
    return [c.reason for c in h.health(G.uuid).conditions]


@pytest.mark.parametrize("step", [HOUR, DAY])
def test_a_moving_energy_counter_is_not_stuck_after_a_forward_step(step):
    """The energy counter is re-read every 10 s, so it stands still between re-reads: a step
    forward between two re-reads made 10 s look like an hour."""
    clock, h = engine(stuck_after=600.0)
    energy = 1000.0
    for second in range(60):
        if second % 10 == 0:
            energy += 3000.0  # 300 W for 10 s
        cycle(h, energy_joules=energy, power_watts=300.0, utilization_ratio=0.9)
        if second == 25:
            clock.step_wall(step)
        clock.advance(1)
        assert h.health(G.uuid).advisories == (), f"{second} s"
    # the check still works: a counter that really stops is stuck after stuck_after real seconds
    clock.advance(600)
    cycle(h, energy_joules=energy, power_watts=300.0, utilization_ratio=0.9)
    assert [c.reason for c in h.health(G.uuid).advisories] == [READING_STUCK]


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_fault_clears_after_its_clear_time_in_real_seconds(step):
    """XID 79, then a GPU reset: healthy once the reset is ``clear_hold`` real seconds old, not
    at once after a forward step, nor an hour late after a backward one."""
    clock, h = engine(clear_hold=5.0)
    h.on_event(DeviceEvent(uuid=G.uuid, kind=EventKind.XID, code=79))
    clock.advance(1)
    h.on_event(DeviceEvent(uuid=G.uuid, kind=EventKind.RESET))
    clock.step_wall(step)
    clock.advance(4)
    cycle(h)
    assert reasons(h) == ["xid_79"]
    clock.advance(1)
    cycle(h)
    assert reasons(h) == []


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_lost_gpu_clears_after_it_reads_clean_for_the_clear_time(step):
    """A level condition (the GPU lost, then answering after a reset): clean for ``clear_hold``
    real seconds."""
    clock, h = engine(clear_hold=5.0)
    h.observe([G], {G.uuid: DeviceReading.failed(G.uuid, ReadError.LOST)})
    clock.advance(1)
    cycle(h)
    clock.step_wall(step)
    clock.advance(4)
    cycle(h)
    assert reasons(h) == ["gpu_lost"]
    clock.advance(1)
    cycle(h)
    assert reasons(h) == []


def test_a_degraded_condition_waits_for_its_quiet_time_across_a_day_step():
    """XID 74 (degraded) clears after ``event_quiet`` of quiet, however far the date moves."""
    clock, h = engine(event_quiet=1800.0)
    h.on_event(DeviceEvent(uuid=G.uuid, kind=EventKind.XID, code=74))
    clock.step_wall(DAY)
    clock.advance(1)
    cycle(h)
    assert reasons(h) == ["xid_74"] and not h.health(G.uuid).healthy
    clock.advance(1798)
    cycle(h)
    assert reasons(h) == ["xid_74"]
    clock.advance(1)
    cycle(h)
    assert reasons(h) == []


def test_three_repeats_within_a_day_escalate_across_a_day_step():
    """XID 13 (informational) a third time within 24 h of real time is degraded, even when the
    date moved a day forward in between."""
    clock, h = engine()
    for _ in range(2):
        h.on_event(DeviceEvent(uuid=G.uuid, kind=EventKind.XID, code=13))
        clock.advance(60)
    assert h.health(G.uuid).healthy
    clock.step_wall(DAY)
    h.on_event(DeviceEvent(uuid=G.uuid, kind=EventKind.XID, code=13))
    (cond,) = h.health(G.uuid).conditions
    assert cond.tier.value == "degraded" and "repeated 3x in 24h" in cond.evidence


# ------------------------------------------------------------------------------ remediation


def fatal(rig: Rig, i: int) -> None:
    rig.xid(rig.local[i].uuid)


def noexecute(rig: Rig) -> list[str]:
    return sorted(dev for dev, effect in rig.effects().items() if effect == "NoExecute")


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_the_settle_window_is_settle_seconds_of_real_time(make_rig, step):
    """A step right after the NoSchedule fence: forward, the settle window used to be skipped
    (NoExecute 0.2 s after the XID); backward, NoExecute came an hour late."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    fatal(rig, 2)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoSchedule"}
    rig.clock.step_wall(step)
    rig.clock.advance(SETTLE - 1)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoSchedule"}
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoExecute"}


def test_the_node_wide_test_holds_across_a_forward_step(make_rig):
    """XID 79 on 6 of 8 GPUs within 0.25 s of real time, the date stepped an hour forward in the
    middle: one node-wide fault, NoSchedule only (it used to give two NoExecute rules)."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    for i in range(3):
        fatal(rig, i)
        rig.clock.advance(0.05)
    rig.reconcile()
    rig.clock.step_wall(HOUR)
    for i in range(3, 6):
        fatal(rig, i)
        rig.clock.advance(0.05)
    rig.reconcile()
    rig.clock.advance(2 * SETTLE)
    rig.reconcile(2)
    assert rig.effects() == {f"gpu-{i}": "NoSchedule" for i in range(6)}
    assert rig.rem.report().suppressed.get("node_fault")


def test_the_rate_window_holds_across_a_forward_step(make_rig):
    """Two NoExecute rules (the rate limit), the date an hour forward: a third fault within the
    10-minute window of real time is refused."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids, taint_rate_window=600.0)
    for i in (0, 1):
        fatal(rig, i)
        rig.reconcile()
        rig.clock.advance(2 * SETTLE)  # not one node-wide fault: each settles on its own
        rig.reconcile()
    assert noexecute(rig) == ["gpu-0", "gpu-1"]
    rig.clock.step_wall(HOUR)
    fatal(rig, 2)
    rig.clock.advance(2 * SETTLE)
    rig.reconcile(2)
    assert rig.effects()["gpu-2"] == "NoSchedule" and rig.rem.report().suppressed.get("rate_limit")
    # ...and the window ends after 600 real seconds
    rig.clock.advance(600)
    rig.reconcile()
    assert noexecute(rig) == ["gpu-0", "gpu-1", "gpu-2"]


def raised(rig: Rig, i: int) -> None:
    fatal(rig, i)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects()[f"gpu-{i}"] == "NoExecute"


def recovered(rig: Rig, i: int) -> None:
    """A GPU reset observed, then clean for the health engine's clear time."""
    rig.health.on_event(DeviceEvent(uuid=rig.local[i].uuid, kind=EventKind.RESET))
    rig.clock.advance(POLICY.clear_hold)
    rig.clean()
    assert rig.health.health(rig.local[i].uuid).healthy


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_the_hold_after_a_recovery_is_hold_seconds_of_real_time(make_rig, step):
    """Recovered, the date stepped: NoExecute steps down after the hold of healthy time, not at
    once (forward) nor an hour late (backward)."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    raised(rig, 1)
    recovered(rig, 1)
    rig.reconcile()  # the hold starts
    rig.clock.step_wall(step)
    rig.clock.advance(HOLD - 1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoSchedule"}


def test_the_eviction_grace_is_grace_seconds_of_real_time(make_rig):
    """A pod still on the NoExecute GPU, the date an hour forward: it is looked at and told in
    GPUEvictionOverdue Events once the 60 s grace has passed in real time, not 5 s later."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rig.server.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    rig.server.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"},
                      "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "registry.example/sim:1"}]}})
    raised(rig, 1)
    on_gpu = AllocationView(driver="gpu.nvidia.com", pool=NODE, device="gpu-1", uuid=ids[1].uuid, namespace="ml",
                            pod="train", container="main", claim="train-claim", source="dra", method="attribute")

    def cycle() -> None:
        rig.rem.update(dataclasses.replace(rig.snapshot(), allocations=(on_gpu,)))
        rig.rem.reconcile()

    cycle()  # the pod is seen on the tainted device: its grace starts
    assert [(v.device, v.pods) for v in rig.rem.report().pending_eviction] == [("gpu-1", 1)]
    rig.clock.step_wall(HOUR)
    rig.clock.advance(5)
    cycle()
    rig.clock.advance(GRACE - 5 - 1)
    cycle()
    assert rig.events(EVENT_REASON) == [] and rig.rem.evictions.told == {}
    rig.clock.advance(1)
    cycle()
    assert rig.rem.evictions.told == {"unknown": 1}
    assert len(rig.events(EVENT_REASON)) == 1  # the rule's (the pod's is in its namespace)


# ------------------------------------------------------------------------------ across a restart


def test_an_adopted_rules_hold_is_unmoved_by_a_step_after_the_restart(make_rig):
    """The agent restarts under a NoExecute rule; the GPU is reset and clean for the clear time,
    and while the adopted rule's hold runs the date steps an hour forward: it steps down after
    the hold of real time."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    raised(rig, 1)
    rig.restart()
    rig.reconcile()  # adopted: the fatal condition waits for a reset again
    recovered(rig, 1)
    rig.reconcile()  # the hold starts
    rig.clock.step_wall(HOUR)
    rig.clock.advance(HOLD - 1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoExecute"}
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoSchedule"}


@pytest.mark.parametrize(("booted", "step", "released"), [(T0 - HOUR, DAY, False), (T0 + HOUR, -DAY, True)])
def test_the_boot_comparison_is_unmoved_by_a_step_after_the_restart(make_rig, booted, step, released):
    """A rule without a boot-ID annotation (the boot ID was unknown) is released on adoption
    when its fault was first seen before the node's boot: both are dates as written and read at
    start-up, and a step of the wall clock after the restart changes neither. (Comparing a
    first-seen converted with the stepped clock would release the first and keep the second.)"""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rig.restart(BootIdentity("", T0 - DAY))
    raised(rig, 1)
    assert names.BOOT_ID_ANNOTATION not in rig.rules()[0]["metadata"]["annotations"]
    rig.restart(BootIdentity("", booted))  # (T0 + 1 h: the node rebooted after the fault)
    rig.clock.step_wall(step)
    rig.reconcile()  # the adoption: a reset proven by the boot is booked now
    rig.clock.advance(POLICY.clear_hold)
    rig.clean()
    assert rig.health.health(ids[1].uuid).healthy is released
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.effects() == ({"gpu-1": "NoSchedule"} if released else {"gpu-1": "NoExecute"})


def test_a_backward_step_while_down_delays_no_raise_and_keeps_no_gpu(make_rig):
    """The agent is down while the date steps an hour back. What it reads back is then dated
    in its future: a fenced fault's first-seen counts as "now" (NoExecute after the settle
    window, not an hour later), and a deletion an admin made counts as older than anything
    this process sees (a new fault on that GPU is tainted again at once)."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    raised(rig, 3)
    rig.server.delete("resource.k8s.io", "devicetaintrules", rig.rules()[0]["metadata"]["name"])
    rig.reconcile()  # noticed: remembered in the node's state ConfigMap
    assert rig.effects() == {}
    fatal(rig, 2)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoSchedule"}  # fenced, settling
    rig.clock.advance(1)
    rig.clock.step_wall(-HOUR)
    rig.restart()
    rig.clock.advance(1)
    fatal(rig, 3)  # new evidence on the GPU whose rule the admin deleted
    rig.reconcile()  # the adoption, and the deletion read back
    assert rig.effects() == {"gpu-2": "NoSchedule", "gpu-3": "NoSchedule"}
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {"gpu-2": "NoExecute", "gpu-3": "NoExecute"}


def test_a_forward_step_while_down_releases_no_gpu_early(make_rig):
    """The agent is down while the date steps a day forward. An adopted rule that was stepping
    down (its reset was seen) keeps NoExecute for a whole hold of this process's time: the hold
    is never read back from a date, so no step while down can shorten it."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    raised(rig, 1)
    recovered(rig, 1)
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoSchedule"}  # stepped down once: written reset-required false
    rig.clock.advance(1)
    rig.clock.step_wall(DAY)
    rig.restart()
    rig.clean()
    rig.reconcile()
    rig.clock.advance(HOLD - 1)
    rig.clean()
    rig.reconcile()
    assert rig.effects() == {"gpu-1": "NoSchedule"}
    rig.clock.advance(1)
    rig.reconcile()
    assert rig.effects() == {}


# ------------------------------------------------------------------------------ the whole agent

STEADY = {
    "name": "steady", "node": "steady-node",
    "gpus": [{"name": f"gpu{i}", "utilization": 0.9, "memory_used": 0.5} for i in range(8)],
    "claims": [{"namespace": "ml", "name": "train", "devices": ["gpu0", "gpu1"]}],
    "pods": [{"namespace": "ml", "name": "trainer", "containers": [{"name": "main", "claims": ["train"]}]}],
}


def test_a_steady_node_stays_steady_through_wall_clock_steps(tmp_path):
    """The whole agent on the simulated node (API emulation, gRPC kubelet, production wiring),
    busy GPUs, enforce mode, a 60 s stuck-reading check. Simulated time stands still while the
    node's date steps +1 h, +1 d and -1 h: the energy counters do not move, but for 0 real
    seconds, so nothing is stuck, no condition opens and no rule is written; the step shows
    where it belongs, in the date the agent stamps its collections with."""
    clock = SimClock(1.0)
    clock.pause()
    with SimulatedNode(parse_scenario(STEADY, "steady"), clock, workdir=tmp_path) as node:
        node.start()
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.ENFORCE, stuck_reading_seconds=60.0,
                                 remediation_resync=0.5)
        wait_until(lambda: agent.snapshot is not None and any(a.claim == "train" for a in agent.snapshot.allocations),
                   timeout=60, message="the join")
        for step in (HOUR, DAY, -HOUR):
            clock.step_wall(step)
            seen = agent.cycles
            wait_until(lambda: agent.cycles >= seen + 5, timeout=60, message="five cycles after the step")  # noqa: B023
            m = scrape_samples(agent.server.url)
            assert m.get("gpu_health_condition", []) == [], step
            assert {v for _, v in m["gpu_healthy"]} == {1.0}
            assert abs(m["dra_gpu_exporter_last_collection_timestamp_seconds"][0][1] - clock.wall()) < 1.0
        assert node.api.list("resource.k8s.io", "devicetaintrules") == []
        writes = [q for q in node.api.requests if q.method != "GET" and "devicetaintrules" in q.path]
        assert writes == []
