"""What the NVML backend keeps per device between cycles, and the one place a library call's
failure is classified (:class:`Calls`): unsupported (remember, stop asking), fatal for the
device (the whole reading fails), or transient (this field is empty this cycle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..model import DeviceIdentity, DeviceReading
from .abi import DEVICE_FATAL, LIBRARY_MISMATCH, UNSUPPORTED, pynvml

log = structlog.get_logger(__name__)

#: (call key, function, bound arguments) of one of several equivalent calls
Fallback = tuple[str, Callable[..., Any], tuple[Any, ...]]


class CallFailed(Exception):
    """A device-level failure: the whole reading becomes DeviceReading.failed."""

    def __init__(self, code: int, call: str, message: str) -> None:
        super().__init__(f"{call}: {message}")
        self.code = code
        self.call = call


@dataclass
class NvmlDevice:
    """Everything this backend keeps about one enumerated device between cycles."""

    identity: DeviceIdentity
    handle: Any
    parent_handle: Any = None  # MIG: the parent GPU's handle
    gpm_supported: bool = False
    #: the readers (readers.READERS) that apply to this device, in table order
    readers: tuple[Callable[[Calls, NvmlDevice, DeviceReading], None], ...] = ()
    unsupported: set[str] = field(default_factory=set)  # call keys this device does not support
    unsupported_fields: set[int] = field(default_factory=set)
    # The field requests this device answers, rebuilt when a field turns out unsupported:
    # filtering FIELD_REQUESTS on every read was a measurable share of the per-read cost.
    field_requests: list[tuple[int, int]] | None = None
    fast_field_requests: list[tuple[int, int]] | None = None  # field_requests less SLOW_FIELDS
    slow_due: float = 0.0  # monotonic time the slow fields are next asked for
    slow_values: dict[int, int | float] = field(default_factory=dict)  # their last answers
    slow_direct: dict[str, tuple[float, Any]] = field(default_factory=dict)  # key -> (due, value)
    # Equivalent-call fallbacks (newest API first) per quantity, built once per device: the
    # handle never changes for an NvmlDevice, so neither do the bound argument tuples.
    fallbacks: dict[str, list[Fallback]] = field(default_factory=dict)
    gpm_samples: list[Any] = field(default_factory=list)  # two rotating samples
    gpm_prev: int = -1  # index of the sample holding the previous cycle, -1 = none yet
    failing: str = ""  # last failure, so a lost GPU is logged once and not every cycle

    @property
    def is_mig(self) -> bool:
        return bool(self.identity.parent_uuid)


class Calls:
    """NVML calls for reading fields, with their failures classified per device.

    ``call`` is the single place a reader calls the library through (bench/nvml_hardware.py
    captures a read's calls by wrapping it). ``slow_call`` spaces out calls the driver answers
    slowly; ``clock`` and ``slow_period`` are the backend's.
    """

    def __init__(self, *, clock: Callable[[], float], slow_period: float, lock_timeout_s: float) -> None:
        self.clock = clock
        self.slow_period = slow_period
        self.lock_timeout_s = lock_timeout_s

    def call(self, dev: NvmlDevice, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One NVML call for one reading field. Returns None when the field is unavailable;
        raises CallFailed when the device as a whole is."""
        if key in dev.unsupported:
            return None
        try:
            return fn(*args, **kwargs)
        except pynvml.NVMLError as exc:
            code = int(getattr(exc, "value", -1))
            if code in UNSUPPORTED:
                dev.unsupported.add(key)
                log.info("nvml_call_unsupported", uuid=dev.identity.uuid, call=key, error=str(exc))
                return None
            if code in DEVICE_FATAL:
                raise CallFailed(code, key, str(exc)) from exc
            log.debug("nvml_call_transient_error", uuid=dev.identity.uuid, call=key, error=str(exc))
            return None
        except LIBRARY_MISMATCH as exc:  # unversioned wrapper whose C symbol is missing
            dev.unsupported.add(key)
            log.info("nvml_call_unsupported", uuid=dev.identity.uuid, call=key, error=str(exc))
            return None

    def first(self, dev: NvmlDevice, calls: list[Fallback]) -> Any:
        """The first of several equivalent calls this device supports (newest API first)."""
        for key, fn, args in calls:
            if key in dev.unsupported:
                continue
            value = self.call(dev, key, fn, *args)
            if value is not None or key not in dev.unsupported:
                return value
        return None

    def slow_call(self, dev: NvmlDevice, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A SLOW_FIELDS quantity read by its own call (the direct equivalents are as slow as the
        fields): asked once per period, the last answer reported in between."""
        now = self.clock()
        due, value = dev.slow_direct.get(key, (0.0, None))
        if now >= due:
            value = self.call(dev, key, fn, *args)
            dev.slow_direct[key] = (now + self.slow_period, value)
        return value


def quiet(fn: Callable[..., Any], *args: Any) -> None:
    """A teardown call whose failure changes nothing (the device or library is going away)."""
    try:
        fn(*args)
    except Exception as exc:
        log.debug("nvml_teardown_call_failed", call=getattr(fn, "__name__", "?"), error=str(exc))
