"""NVIDIA backend on NVML through nvidia-ml-py (``import pynvml``), shaped like the AMD one.

* ``abi``: NVML's numbers (return codes, field ids, event bits, GPM ids) and the decoding of a
  field-values batch;
* ``enumeration``: which devices exist (full GPUs and, with MIG mode on, their MIG devices),
  cached until the layout may have changed;
* ``readers``: what one read asks, as a table of readers, one per quantity, in base units;
* ``device``: the per-device state kept between cycles, and the one place a call's failure is
  classified;
* ``events``: the event set, waited on by the thread base.EventThread runs;
* ``backend``: ``NvmlBackend``, the lifecycle and the seams between the above.

What a read asks, per cycle and device: direct calls (no field id exists for them) for
utilization (not on MIG), memory (``_v2`` -> v1), GPU temperature (``TemperatureV`` ->
``GetTemperature``), SM/memory clocks, clock event reasons, running compute processes; one
batched ``nvmlDeviceGetFieldValues`` call for everything that has a field id (energy, average
power, memory temperature, ECC volatile and aggregate totals, retired pages, remapped rows,
PCIe replays, GPU recovery action, throttle time per reason); GPM (Hopper+) SM active, SM occupancy, tensor active, DRAM
active from the previous cycle's sample and this one's.

Failures: a call a device does not support is remembered per device and not retried until the
next rescan; ``GPU_IS_LOST``/``UNKNOWN`` turn the whole reading into ``DeviceReading.failed``.
Nothing here raises for a device problem. Hangs are the caller's business (DeadlineRunner),
but no lock taken here can be held forever by a stuck call and block other devices.
"""

from __future__ import annotations

from .abi import FIELD_IDS, FIELD_REQUESTS, GPM_METRICS, SLOW_FIELDS
from .backend import NvmlBackend
from .enumeration import mig_profile_from_name, mig_profile_from_size

__all__ = [
    "FIELD_IDS",
    "FIELD_REQUESTS",
    "GPM_METRICS",
    "SLOW_FIELDS",
    "NvmlBackend",
    "mig_profile_from_name",
    "mig_profile_from_size",
]
