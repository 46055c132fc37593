"""Run vendor-library calls under a deadline, one lane per device.

NVML and amdsmi calls can block forever in the kernel (a GPU stuck after XID 119, a driver in
D state). Python cannot cancel such a call, so the caller must not wait on it: each device gets
its own worker thread ("lane"). A call that overruns its deadline is reported as hung and the
lane stays busy; until the stuck call returns, further calls on that lane fail fast instead of
piling up threads. Other devices keep their own lanes and are unaffected.

A missed deadline alone does not tell a stuck device from a starved agent: :class:`CallHung`
says whether the call ever started running on its lane (a worker that never got the CPU before
the deadline is the agent's problem) and for how long it has been running, so the caller can
ask for a hang that persists before blaming the device.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class CallHung(Exception):
    """A call did not return before its deadline (or an earlier one on the lane is still stuck)."""

    def __init__(self, lane: str, since: float, message: str = "", running_for: float | None = None) -> None:
        self.lane = lane
        self.since = since  # monotonic time the call was handed to its lane
        # seconds the call has been running on its lane; None: it never started (the lane's
        # worker got no CPU before the deadline), which is no evidence against the device
        self.running_for = running_for
        super().__init__(message or f"call on {lane} has not returned for {time.monotonic() - since:.1f}s")


class _Lane:
    """One daemon worker thread. Daemon, because a thread stuck in the kernel must never keep
    the process from exiting (ThreadPoolExecutor joins its workers at exit)."""

    __slots__ = ("jobs", "pending", "ran_at", "started", "thread")

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self.pending: Future[Any] | None = None
        self.started = 0.0
        self.ran_at: float | None = None  # when the worker began the pending call
        self.thread = threading.Thread(target=self._run, name=f"lane-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            self.ran_at = time.monotonic()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self.jobs.put((fut, fn))
        return fut

    def stop(self) -> None:
        self.jobs.put(None)


class DeadlineRunner:
    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()

    def call(self, lane: str, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` on ``lane``'s worker and wait at most ``timeout`` seconds.

        Raises CallHung when the deadline passes or when the lane is still stuck in an earlier
        call. Exceptions raised by ``fn`` propagate unchanged.
        """
        with self._lock:
            ln = self._lanes.get(lane)
            if ln is None:
                ln = self._lanes[lane] = _Lane(lane)
            if ln.pending is not None and not ln.pending.done():
                raise CallHung(lane, ln.started, running_for=_running_for(ln))
            ln.started = time.monotonic()
            ln.ran_at = None
            fut = ln.submit(fn)
            ln.pending = fut
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            running = _running_for(ln)
            what = f"exceeded its {timeout:.3g}s deadline" if running is not None else f"did not start within its {timeout:.3g}s deadline"
            raise CallHung(lane, ln.started, f"call on {lane} {what}", running_for=running) from None

    def running_for(self, lane: str) -> float | None:
        """Seconds the lane's pending call has been running; None when none is running."""
        with self._lock:
            ln = self._lanes.get(lane)
            if ln is None or ln.pending is None or ln.pending.done():
                return None
            return _running_for(ln)

    def hung_lanes(self) -> dict[str, float]:
        """Lanes whose last call is still running: lane -> seconds stuck."""
        now = time.monotonic()
        with self._lock:
            return {
                name: now - ln.started
                for name, ln in self._lanes.items()
                if ln.pending is not None and not ln.pending.done()
            }

    def retire(self, lane: str) -> None:
        """Forget a lane whose device is gone. A stuck worker is abandoned, not joined."""
        with self._lock:
            ln = self._lanes.pop(lane, None)
        if ln is not None:
            ln.stop()

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for ln in lanes:
            ln.stop()


def _running_for(ln: _Lane) -> float | None:
    ran = ln.ran_at
    return None if ran is None else max(0.0, time.monotonic() - ran)
