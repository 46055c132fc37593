"""The contract every device backend fulfils.

A backend wraps one vendor library. It enumerates devices, reads one device at a time, and
pushes asynchronous events (XIDs, ECC, lost GPUs) to a sink. It never decides health and never
touches Kubernetes. Calls into the vendor library may hang forever on a wedged driver; the
sampler protects itself with :class:`exporter.devices.deadline.DeadlineRunner`, so a backend
only has to keep one device's failure from affecting another device's read.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable

import structlog

from .model import DeviceEvent, DeviceIdentity, DeviceReading

EventSink = Callable[[DeviceEvent], None]

log = structlog.get_logger(__name__)


class EventThread:
    """The one daemon thread on which a backend waits for its library's events.

    Every vendor needs the same scaffolding around its own wait: start once, stop on close()
    without waiting forever for a call wedged in the driver (the thread is a daemon, so a stuck
    one is abandoned, never joined at exit), and a heartbeat stamped each turn round the loop,
    which the agent's liveness reads (``DeviceBackend.event_heartbeat``): a loop that stopped
    turning is a reason to restart, a device that is merely quiet is not.

    The backend supplies ``turn``: one wait-and-deliver step, returning when its wait times out
    or ``stop_event`` is set. A backend whose wait has no bound (the simulator sleeps until its
    next scripted fault) passes ``heartbeat=False`` and is never reported stuck.
    """

    def __init__(self, name: str, *, heartbeat: bool = True) -> None:
        self.name = name
        self.stop_event = threading.Event()
        self._heartbeat = heartbeat
        self._thread: threading.Thread | None = None
        self._beat: float | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread (None before start() and after stop())."""
        return self._thread

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, turn: Callable[[], None]) -> None:
        self.stop_event.clear()
        self._beat = None  # None until the loop first turns: liveness waits for it
        t = threading.Thread(target=self._run, args=(turn,), name=self.name, daemon=True)
        self._thread = t
        t.start()

    def _run(self, turn: Callable[[], None]) -> None:
        while not self.stop_event.is_set():
            if self._heartbeat:
                self._beat = time.monotonic()  # liveness: the loop still turns
            try:
                turn()
            except Exception:
                # The backend's turn handles its library's errors; this only keeps a bug in it
                # from ending event delivery for good.
                log.exception("device_event_loop_error", thread=self.name)
                self.stop_event.wait(1.0)
        log.info("device_events_stopped", thread=self.name)

    def wait(self, seconds: float) -> bool:
        """Sleep (a back-off) until ``seconds`` pass or stop() is called; True when stopping."""
        return self.stop_event.wait(seconds)

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def request_stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float) -> bool:
        """Forget the thread after waiting up to ``timeout`` for it; True when it has ended
        (False: it is wedged in a library call and abandoned)."""
        t, self._thread = self._thread, None
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def stop(self, timeout: float) -> bool:
        self.request_stop()
        return self.join(timeout)

    def heartbeat(self) -> float | None:
        """``time.monotonic()`` of the latest turn round the loop; None when no thread runs."""
        if self._thread is None or self.stop_event.is_set():
            return None
        return self._beat


class BackendUnavailable(Exception):
    """The vendor library is not present or cannot initialise on this machine."""


class DeviceBackend(abc.ABC):
    #: short name used in logs and as the ``collector`` label of self-metrics
    name: str = "devices"
    #: the backend's event thread, when it has one (see EventThread)
    _events: EventThread | None = None

    @abc.abstractmethod
    def open(self) -> None:
        """Load and initialise the library. Raises BackendUnavailable when it cannot."""

    @abc.abstractmethod
    def enumerate(self) -> list[DeviceIdentity]:
        """Return the devices present now (full GPUs, MIG instances, partitions).

        Cheap to call repeatedly: backends cache identity and only rescan when the layout may
        have changed (a MIG reconfiguration event, a device that came back).
        """

    @abc.abstractmethod
    def read(self, device: DeviceIdentity) -> DeviceReading:
        """Read one device. Per-field failures (NotSupported) leave the field ``None``; a
        device-level failure (GPU lost) returns ``DeviceReading.failed``. Never raises for a
        device problem."""

    def start_events(self, sink: EventSink) -> None:  # pragma: no cover - default: no events
        """Start delivering asynchronous events to ``sink`` (from a backend-owned thread)."""

    def driver_version(self) -> str:
        return ""

    def event_heartbeat(self) -> float | None:
        """``time.monotonic()`` of the event thread's latest turn round its loop, for liveness;
        None when the backend has no event thread (or it is not running)."""
        return self._events.heartbeat() if self._events is not None else None

    def close(self) -> None:  # pragma: no cover - default: nothing to release
        """Stop event threads and release the library."""
