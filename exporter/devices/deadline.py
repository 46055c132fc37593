"""Run vendor-library calls under a deadline, one lane per device.

NVML and amdsmi calls can block forever in the kernel (a GPU stuck after XID 119, a driver in
D state). Python cannot cancel such a call, so the caller must not wait on it: each device gets
its own worker thread ("lane"). A call that overruns its deadline is reported as hung and the
lane stays busy; until the stuck call returns, further calls on that lane fail fast instead of
piling up threads. Other devices keep their own lanes and are unaffected.

Calling through a lane costs two thread hand-offs (submit, result), and a dense node reads 64
devices per cycle: :meth:`DeadlineRunner.call_each` runs a cycle's reads one after another on
one *shared* worker instead, each still under its own deadline. A call that overruns it takes
the shared worker with it as its device's own stuck lane, and the calls after it go on on a
fresh shared worker: a hung device still costs one deadline, once, and only its own lane.

A missed deadline alone does not tell a stuck device from a starved agent: :class:`CallHung`
says whether the call ever started running on its lane (a worker that never got the CPU before
the deadline is the agent's problem) and for how long it has been running, so the caller can
ask for a hang that persists before blaming the device.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
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


class _Batch:
    """Calls run one after another by one worker (:meth:`run`), watched by the caller.

    The worker wakes the caller only when the batch ends; the caller sleeps until the deadline
    of whichever call is current, so a cycle of fast reads costs one hand-off each way."""

    __slots__ = ("calls", "cond", "eligible_at", "ended", "limit", "ran_at", "results")

    def __init__(self, calls: Sequence[Callable[[], Any]]) -> None:
        self.calls = calls
        self.cond = threading.Condition(threading.Lock())
        self.results: list[tuple[bool, Any]] = []  # (returned, value or the exception raised), in order
        self.limit = len(calls)  # the worker starts no call at or after this index
        self.eligible_at = time.monotonic()  # when the current call could begin (its deadline's start)
        self.ran_at: float | None = None  # when the worker began the current call
        self.ended = False

    def run(self) -> None:
        cond = self.cond
        for i, fn in enumerate(self.calls):
            with cond:
                if i >= self.limit:
                    break
                self.ran_at = time.monotonic()
            try:
                out: tuple[bool, Any] = (True, fn())
            except BaseException as exc:  # handed to the caller, like a Future would
                out = (False, exc)
            with cond:
                self.results.append(out)
                self.ran_at = None
                self.eligible_at = time.monotonic()
        with cond:
            self.ended = True
            cond.notify_all()

    def wait(self, timeout: float) -> tuple[int, float | None] | None:
        """Until the batch ends (None), or the current call misses its deadline: (its index,
        seconds it has been running, None if it never started). The worker is then told to
        start nothing after it."""
        with self.cond:
            while True:
                n = len(self.results)
                if self.ended or n >= self.limit:
                    return None
                now = time.monotonic()
                deadline = self.eligible_at + timeout
                if now >= deadline:
                    running = None if self.ran_at is None else max(0.0, now - self.ran_at)
                    self.limit = n + 1 if running is not None else n
                    return n, running
                self.cond.wait(deadline - now)


class DeadlineRunner:
    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._shared: _Lane | None = None  # the worker of call_each's calls (lanes that never hung)
        self._lock = threading.Lock()

    def call_each(self, calls: Sequence[tuple[str, Callable[[], T]]], timeout: float) -> list[T | BaseException]:
        """Run ``calls`` ((lane, fn) pairs) one after another, each under its own ``timeout``
        counted from when it could begin, and return what each returned or raised, in order
        (:class:`CallHung` for a missed deadline or a lane still stuck). Calls on a lane that
        hung before run on that lane (:meth:`call`); the others share one worker."""
        out: list[Any] = [None] * len(calls)
        shared: list[int] = []
        for k, (lane, fn) in enumerate(calls):
            with self._lock:
                own = lane in self._lanes
            if not own:
                shared.append(k)
                continue
            try:
                out[k] = self.call(lane, fn, timeout)
            except Exception as exc:
                out[k] = exc
        while shared:
            batch = _Batch([calls[k][1] for k in shared])
            with self._lock:
                worker = self._shared
                if worker is None:
                    worker = self._shared = _Lane("shared")
                job = worker.submit(batch.run)
            missed = batch.wait(timeout)
            for k, (_, value) in zip(shared, batch.results, strict=False):
                out[k] = value
            if missed is None:
                break
            n, running = missed
            k = shared[n]
            lane = calls[k][0]
            since = batch.eligible_at
            if running is None:
                what = f"did not start within its {timeout:.3g}s deadline"
            else:
                what = f"exceeded its {timeout:.3g}s deadline"
                # The worker is stuck in this call: it becomes the lane's own, and fails that
                # lane's next calls fast until the call returns; the rest get a new worker.
                with self._lock:
                    if self._shared is worker:
                        self._shared = None
                    worker.pending, worker.started, worker.ran_at = job, since, time.monotonic() - running
                    self._lanes[lane] = worker
                    worker.thread.name = f"lane-{lane}"
            out[k] = CallHung(lane, since, f"call on {lane} {what}", running_for=running)
            shared = shared[n + 1 :]
        return out

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
            what = (f"exceeded its {timeout:.3g}s deadline" if running is not None
                    else f"did not start within its {timeout:.3g}s deadline")
            raise CallHung(lane, ln.started, f"call on {lane} {what}", running_for=running) from None

    def wait(self, lane: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lane's pending call (one that missed its
        deadline) to end; True when it has, or none is pending. Its result is not reported."""
        with self._lock:
            ln = self._lanes.get(lane)
            fut = ln.pending if ln is not None else None
        if fut is None:
            return True
        done, _ = wait_futures([fut], timeout)
        return bool(done)

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
            if self._shared is not None:
                lanes.append(self._shared)
                self._shared = None
        for ln in lanes:
            ln.stop()


def _running_for(ln: _Lane) -> float | None:
    ran = ln.ran_at
    return None if ran is None else max(0.0, time.monotonic() - ran)
