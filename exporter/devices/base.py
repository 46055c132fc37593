"""The contract every device backend fulfils.

A backend wraps one vendor library. It enumerates devices, reads one device at a time, and
pushes asynchronous events (XIDs, ECC, lost GPUs) to a sink. It never decides health and never
touches Kubernetes. Calls into the vendor library may hang forever on a wedged driver; the
sampler protects itself with :class:`exporter.devices.deadline.DeadlineRunner`, so a backend
only has to keep one device's failure from affecting another device's read.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from .model import DeviceEvent, DeviceIdentity, DeviceReading

EventSink = Callable[[DeviceEvent], None]


class BackendUnavailable(Exception):
    """The vendor library is not present or cannot initialise on this machine."""


class DeviceBackend(abc.ABC):
    #: short name used in logs and as the ``collector`` label of self-metrics
    name: str = "devices"

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
        return None

    def close(self) -> None:  # pragma: no cover - default: nothing to release
        """Stop event threads and release the library."""
