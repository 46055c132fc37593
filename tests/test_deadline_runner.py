"""DeadlineRunner.call_each: a cycle's device reads on one shared worker, each under its own
deadline, and a hung read isolated on a lane of its own."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from kit_helpers import wait_until

from exporter.devices.deadline import CallHung, DeadlineRunner


def lane_threads() -> Counter[str]:
    return Counter(t.name for t in threading.enumerate() if t.name.startswith("lane-"))


@pytest.fixture
def runner():
    r = DeadlineRunner()
    yield r
    r.close()


def test_fast_calls_share_one_worker_and_keep_their_order(runner: DeadlineRunner) -> None:
    before = lane_threads()

    def boom() -> int:
        raise ValueError("a backend bug on one device")

    out = runner.call_each([("a", lambda: 1), ("b", boom), ("c", lambda: 3)], timeout=30)
    assert out[0] == 1 and out[2] == 3
    assert isinstance(out[1], ValueError)
    assert runner.call_each([(f"d{i}", lambda i=i: i) for i in range(64)], timeout=30) == list(range(64))
    assert lane_threads() - before == Counter({"lane-shared": 1})  # one worker for 67 calls
    assert runner.hung_lanes() == {}


def test_a_hung_call_gets_its_own_lane_and_the_rest_go_on(runner: DeadlineRunner) -> None:
    release, entered = threading.Event(), threading.Event()

    def hang() -> str:
        entered.set()
        release.wait(60)
        return "late"

    try:
        # 2 s: long enough for the fast calls on a busy CI machine; the hang still overruns it
        out = runner.call_each([("a", lambda: "a"), ("stuck", hang), ("c", lambda: "c")], timeout=2.0)
        assert out[0] == "a" and out[2] == "c"
        assert isinstance(out[1], CallHung) and out[1].lane == "stuck"
        assert out[1].running_for is not None  # it ran: evidence against the device
        assert "stuck" in runner.hung_lanes()
        # next cycle: the stuck lane fails fast, the others are read as before
        out = runner.call_each([("a", lambda: "a2"), ("stuck", lambda: "never"), ("c", lambda: "c2")], timeout=30)
        assert out[0] == "a2" and out[2] == "c2"
        assert isinstance(out[1], CallHung) and out[1].running_for is not None
        assert "lane-stuck" in lane_threads()
    finally:
        release.set()
    wait_until(lambda: not runner.hung_lanes(), message="the stuck call to return")
    # once it returns, the device is read again, on its own lane
    assert runner.call_each([("stuck", lambda: "back"), ("a", lambda: "a3")], timeout=30) == ["back", "a3"]


def test_a_call_that_never_started_is_not_held_against_its_device(runner: DeadlineRunner) -> None:
    # The shared worker gets no chance to start the call before its deadline (here: it is busy
    # with an earlier job, as a starved worker would be): "never started", no lane of its own.
    runner.call_each([("warm", lambda: None)], timeout=30)
    busy = threading.Event()
    worker = runner._shared
    assert worker is not None
    worker.submit(lambda: busy.wait(60))
    try:
        out = runner.call_each([("a", lambda: "a")], timeout=0.1)
        assert isinstance(out[0], CallHung) and out[0].running_for is None
        assert runner.hung_lanes() == {}
    finally:
        busy.set()
    assert runner.call_each([("a", lambda: "a"), ("b", lambda: "b")], timeout=30) == ["a", "b"]


def test_retire_and_close_end_the_workers(runner: DeadlineRunner) -> None:
    release = threading.Event()
    out = runner.call_each([("gone", lambda: release.wait(60)), ("x", lambda: 1)], timeout=2.0)
    assert isinstance(out[0], CallHung) and out[1] == 1
    workers = [runner._lanes["gone"].thread, runner._shared.thread]
    assert [w.name for w in workers] == ["lane-gone", "lane-shared"]
    runner.retire("gone")  # the device went away: its stuck worker is abandoned
    assert "gone" not in runner.hung_lanes()
    release.set()
    runner.close()
    wait_until(lambda: not any(w.is_alive() for w in workers), message="the workers to end")


def test_wait_follows_a_call_past_its_deadline_until_it_ends(runner: DeadlineRunner) -> None:
    """The claims collector waits on a long first fetch through wait(): False while the call
    is still running on its lane, True once it has ended (or when nothing is pending)."""
    assert runner.wait("api", 0.0)  # nothing pending
    release = threading.Event()
    with pytest.raises(CallHung):
        runner.call("api", lambda: release.wait(60), 0.05)
    assert not runner.wait("api", 0.05)
    release.set()
    assert runner.wait("api", 60)
    assert runner.call("api", lambda: 7, 10) == 7  # the lane is free again
