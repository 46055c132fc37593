"""base.EventThread: the event-thread scaffolding every backend (NVML, AMD SMI, the simulator)
runs its library's wait on. The vendors' own tests drive it through their libraries; these pin
the contract the agent's liveness relies on."""

from __future__ import annotations

import threading

from kit_helpers import wait_until

from exporter.devices.base import EventThread


def test_heartbeat_is_stamped_each_turn_and_gone_once_stopped() -> None:
    turns = threading.Semaphore(0)
    gate = threading.Event()
    t = EventThread("test-events")
    assert t.heartbeat() is None and not t.started

    def turn() -> None:
        turns.release()
        gate.wait(10)  # a wait inside the library

    t.start(turn)
    assert turns.acquire(timeout=10)
    first = t.heartbeat()
    assert first is not None and t.thread is not None and t.thread.name == "test-events"
    gate.set()  # the wait returns: the loop turns again and stamps a newer beat
    wait_until(lambda: (t.heartbeat() or 0.0) > first)
    assert t.stop(10)
    assert t.heartbeat() is None and not t.started


def test_a_stuck_turn_stops_the_heartbeat_and_is_abandoned_on_stop() -> None:
    entered, release = threading.Event(), threading.Event()
    t = EventThread("stuck-events")

    def turn() -> None:
        entered.set()
        release.wait(30)  # wedged in the driver

    t.start(turn)
    assert entered.wait(10)
    beat = t.heartbeat()
    assert beat is not None and t.heartbeat() == beat  # no turn, no new beat: liveness sees it age
    assert t.stop(0.05) is False  # not joined forever: abandoned (a daemon thread)
    release.set()


def test_a_crashing_turn_does_not_end_event_delivery() -> None:
    calls: list[int] = []
    second = threading.Event()
    t = EventThread("crashy-events")

    def turn() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the backend's turn")
        second.set()
        t.wait(10)

    t.start(turn)
    assert second.wait(10)
    assert t.stop(10)


def test_without_heartbeat_a_long_wait_is_never_reported() -> None:
    t = EventThread("sim-like", heartbeat=False)
    t.start(lambda: t.wait(10))
    wait_until(lambda: t.thread is not None and t.thread.is_alive())
    assert t.heartbeat() is None
    assert t.stop(10)
