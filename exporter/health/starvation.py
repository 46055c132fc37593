"""Is the agent itself getting the CPU? Evidence about the agent, never about a device.

A device read that misses its deadline is evidence against the device only when the agent was
able to run. On a busy node (a CPU-bound neighbour, the DaemonSet's CPU limit, an HTTP flood
against the metrics port) every thread of the agent runs late, device lanes included. This
monitor tells that apart from a stuck device call, from signals that do not depend on any
device:

* a **scheduling-lag probe**: a thread that asks to wake every ``period`` seconds and measures
  how late it actually runs (the OS scheduler, the GIL, cgroup throttling all show up here);
* the **sampler's own lateness** against its fixed-rate schedule (:meth:`note_lag`);
* **calls that never started**: a lane whose worker did not get to run the call before its
  deadline (:meth:`note_unstarted`);
* **CPU throttling** of the agent's cgroup (``cpu.stat``: ``nr_throttled`` and
  ``throttled_usec`` on cgroup v2, ``throttled_time`` in ns on v1), when readable.

The agent counts as starved while any of these fired within the last ``window`` seconds: long
enough for a call that was merely slow to return once the agent runs again, so a starved
episode never turns into ``driver_hung``. Times are ``time.monotonic``.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

CGROUP_CPU_STAT = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat")


@dataclass(frozen=True)
class StarvationState:
    starved: bool
    lag_seconds: float  # worst scheduling lag seen within the window
    reason: str = ""  # the latest signal, for /readyz and logs


def read_throttled_seconds(path: str) -> tuple[int, float] | None:
    """(nr_throttled, seconds throttled) from a cgroup ``cpu.stat``; None when unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return parse_cpu_stat(text)


def parse_cpu_stat(text: str) -> tuple[int, float] | None:
    """(nr_throttled, seconds throttled) from the text of a cgroup ``cpu.stat``."""
    vals: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            vals[parts[0]] = int(parts[1])
    if "nr_throttled" not in vals:
        return None
    if "throttled_usec" in vals:  # cgroup v2
        return vals["nr_throttled"], vals["throttled_usec"] / 1e6
    if "throttled_time" in vals:  # cgroup v1, nanoseconds
        return vals["nr_throttled"], vals["throttled_time"] / 1e9
    return None


class StarvationMonitor:
    def __init__(
        self,
        threshold: float,
        window: float,
        *,
        period: float | None = None,
        cpu_stat: str | None = None,
        throttle_ratio: float = 0.1,
        throttle_every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``threshold``: a lag at least this long is starvation (the agent uses half a device
        deadline); ``window``: how long one signal keeps the agent starved; ``cpu_stat``: the
        cgroup file (default: the first readable of the usual places); ``throttle_ratio``: the
        share of wall time throttled that counts; ``period``: how often the probe wakes (default
        the threshold, at most 1 s: an episode as long as threshold + period, a device call's
        whole deadline, is always seen; with the default 2 s deadline the probe wakes once a
        second). Starvation matters for a call stuck ``--hung-after`` (30 s): far longer."""
        self.threshold = threshold
        self.window = window
        self.period = period if period is not None else min(1.0, threshold)
        self.throttle_ratio = throttle_ratio
        self.throttle_every = throttle_every
        self.clock = clock
        if cpu_stat is None:
            cpu_stat = next((p for p in CGROUP_CPU_STAT if read_throttled_seconds(p) is not None), "")
        self._cpu_stat = cpu_stat
        self._stat_fd: int | None = None  # the cgroup file, kept open (see _read_cpu_stat)
        self._lock = threading.Lock()
        self._lags: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, lag) at or above a tenth of the threshold
        self._last_signal: float | None = None
        self._reason = ""
        self._throttle_prev: tuple[float, int, float] | None = None  # (when, nr_throttled, seconds)
        self._was_starved = False
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # a pipe: stop() writes to end the probe's wait
        self.last_probe: float | None = None  # when the probe last ran (its own liveness)

    # -- signals -----------------------------------------------------------------------------
    def note_lag(self, source: str, lag: float, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            if lag >= self.threshold / 10:
                self._lags.append((now, lag))
            if lag >= self.threshold:
                self._signal(now, f"{source} ran {lag:.2f}s late")

    def note_unstarted(self, lane: str, now: float | None = None) -> None:
        with self._lock:
            self._signal(self.clock() if now is None else now, f"a call on lane {lane} got no CPU before its deadline")

    def note_throttling(self, now: float | None = None) -> None:
        """Read the cgroup's throttling counters; starved when throttled for a large share of
        the time since the last reading."""
        if not self._cpu_stat:
            return
        cur = self._read_cpu_stat()
        if cur is None:
            return
        now = self.clock() if now is None else now
        with self._lock:
            prev, self._throttle_prev = self._throttle_prev, (now, cur[0], cur[1])
            if prev is None or now <= prev[0]:
                return
            share = (cur[1] - prev[2]) / (now - prev[0])
            if cur[0] > prev[1] and share >= self.throttle_ratio:
                self._signal(now, f"CPU throttled by the cgroup quota {share:.0%} of the last {now - prev[0]:.1f}s "
                                  f"({cur[0] - prev[1]} periods)")

    def _read_cpu_stat(self) -> tuple[int, float] | None:
        # Read once a second for the agent's whole life: a pread of the open file costs a
        # quarter of open + read + close (~45 against ~200 us of CPU on the bench machine).
        fd = self._stat_fd
        if fd is None:
            try:
                fd = self._stat_fd = os.open(self._cpu_stat, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            data = os.pread(fd, 8192, 0)
        except OSError:
            self._close_stat()
            return None
        return parse_cpu_stat(data.decode("ascii", "replace"))

    def _close_stat(self) -> None:
        if self._stat_fd is not None:
            os.close(self._stat_fd)
            self._stat_fd = None

    def _signal(self, now: float, reason: str) -> None:
        self._last_signal, self._reason = now, reason

    # -- state -------------------------------------------------------------------------------
    def state(self, now: float | None = None) -> StarvationState:
        now = self.clock() if now is None else now
        with self._lock:
            while self._lags and now - self._lags[0][0] > self.window:
                self._lags.popleft()
            lag = max((v for _, v in self._lags), default=0.0)
            starved = self._last_signal is not None and now - self._last_signal <= self.window
            reason = self._reason if starved else ""
            changed, self._was_starved = starved != self._was_starved, starved
        if changed:
            # Logged on change only: a starved agent must not spend its little CPU on logs.
            (log.warning if starved else log.info)("agent_starved" if starved else "agent_no_longer_starved",
                                                   reason=reason or None, lag_seconds=round(lag, 3))
        return StarvationState(starved=starved, lag_seconds=lag, reason=reason)

    # -- the probe thread ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._probe, args=(self._wake[0],), name="starvation-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=2)
        if self._wake is not None and (thread is None or not thread.is_alive()):
            for fd in self._wake:  # a probe that is somehow still running keeps its pipe
                os.close(fd)
            self._close_stat()
        self._wake = None

    def _probe(self, wake: int) -> None:
        mono = time.monotonic  # the probe measures real scheduling, whatever clock states use
        expected = mono() + self.period
        next_throttle = mono()
        # The probe runs all the agent's life: it waits in select() on a pipe, one system call,
        # rather than on a threading.Event, whose timed wait costs twice the CPU per wake-up.
        while not select.select((wake,), (), (), max(0.0, expected - mono()))[0]:
            now = mono()
            self.last_probe = now
            self.note_lag("the scheduling-lag probe", now - expected, self.clock())
            if now >= next_throttle:
                self.note_throttling()
                next_throttle = now + self.throttle_every
            expected = now + self.period
