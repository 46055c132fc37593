"""AMD GPUs through AMD SMI (the ``amdsmi`` Python package over ``libamd_smi.so``).

The module is named ``amd`` rather than ``amdsmi`` so that it never shadows the vendor package.
``amdsmi`` is an optional extra: it is imported lazily in :meth:`AmdSmiBackend.open`, because
importing it on a machine without ROCm prints two lines and raises ``KeyError`` (not
ImportError) - see docs/amd.md.

Units as amdsmi 7.0.x reports them (amdsmi.h) and what we convert them to:

* activity ``gfx_activity`` / ``umc_activity``: percent -> ratio 0..1 (0xFFFF reads as "N/A")
* VRAM ``amdsmi_get_gpu_memory_usage/total(VRAM)``: bytes (``vram_usage`` is MB; not used)
* power ``amdsmi_get_power_info``: watts (``current_socket_power`` on MI300+,
  ``average_socket_power`` on MI200 and older, ``socket_power`` as a last resort)
* energy ``amdsmi_get_energy_count``: ``energy_accumulator`` counts x ``counter_resolution``
  microjoules per count (about 15.26 uJ, per the gpu_metrics "15.259uJ" unit) -> joules
* temperature ``amdsmi_get_temp_metric``: degrees Celsius (hotspot/junction, edge fallback)
* clocks ``amdsmi_get_clock_info``: MHz -> Hz
* process list: ``memory_usage.vram_mem`` bytes (amd-smi prints it as bytes although one
  header comment says MB; ``mem`` is documented as bytes and used as fallback)
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import io
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..text import one_line
from .base import BackendUnavailable, DeviceBackend, EventSink, EventThread
from .model import (
    DeviceEvent,
    DeviceIdentity,
    DeviceReading,
    EventKind,
    ReadError,
    Vendor,
    normalize_pci_bus_id,
)

__all__ = ["AmdSmiBackend", "GpuProbe", "amdsmi_available", "assign_partitions"]

log = structlog.get_logger(__name__)

LIB_NAME = "libamd_smi.so"
_LD_CACHE = Path("/etc/ld.so.cache")


# --------------------------------------------------------------------------------------------
# Availability check (for --backend auto)
# --------------------------------------------------------------------------------------------


def amdsmi_available(
    environ: Mapping[str, str] | None = None,
    *,
    default_dirs: Iterable[str] = ("/opt/rocm/lib",),
    ld_cache: Path = _LD_CACHE,
) -> bool:
    """Cheaply tell whether ``import amdsmi`` could load ``libamd_smi.so`` here.

    Looks where amdsmi_wrapper's ``find_smi_library`` looks - ``$ROCM_HOME/lib`` or
    ``$ROCM_PATH/lib``, the dynamic linker (``LD_LIBRARY_PATH`` and ``/etc/ld.so.cache``), next
    to the package, ``/opt/rocm/lib`` - without importing amdsmi, whose import prints noise and
    raises KeyError when the library is missing. Also requires the Python package itself.
    """
    env = os.environ if environ is None else environ
    try:
        spec = importlib.util.find_spec("amdsmi")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False
    dirs: list[str] = []
    rocm = env.get("ROCM_HOME") or env.get("ROCM_PATH")
    if rocm:
        dirs.append(os.path.join(rocm, "lib"))
    dirs.extend(p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p)
    for loc in spec.submodule_search_locations or ():
        dirs.append(loc)
    dirs.extend(default_dirs)
    if any(os.path.isfile(os.path.join(d, LIB_NAME)) for d in dirs):
        return True
    # ld.so.cache holds the sonames it knows as plain strings; a substring test is enough and
    # avoids spawning ldconfig.
    try:
        return LIB_NAME.encode() in ld_cache.read_bytes()
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Enumeration: pure part
# --------------------------------------------------------------------------------------------

_BDF_PARTS = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class GpuProbe:
    """What enumeration learned about one amdsmi processor handle."""

    index: int  # position among GPU processor handles (amd-smi's GPU index)
    handle_key: int  # the handle's pointer value
    uuid: str
    bdf: str  # as amdsmi reports it, "dddd:bb:dd.f"
    model: str = ""
    driver_version: str = ""
    serial: str = ""
    card: int | None = None
    render: int | None = None
    memory_total_bytes: int | None = None  # VRAM as this handle reports it
    compute_partition: str = ""  # "SPX", "DPX", "CPX", ... ("" when unknown or unanswered)
    partition_id: int | None = None  # kfd current_partition_id
    memory_partition: str = ""  # "NPS1", "NPS2", "NPS4", "NPS8" ("" when unknown or unanswered)


def _bdf_split(bdf: str) -> tuple[int, int, int, int] | None:
    m = _BDF_PARTS.match(bdf.strip())
    if not m:
        return None
    return tuple(int(x, 16) for x in m.groups())  # type: ignore[return-value]


def _group_mode(members: list[GpuProbe], attr: str) -> str:
    """A partition mode is the GPU's, not the partition's: the first answer in partition order.

    amdsmi 7.0.x answers the partition queries only on a GPU's first partition (fixed upstream
    in ROCm/rocm-systems#8491, mid-2026); the other partitions' errors leave "" here."""
    return next((v for v in (getattr(p, attr) for p in members) if v), "")


def _memory_pools(members: list[GpuProbe], parent_uuid: str, memory_mode: str) -> list[str]:
    """The memory pool of each partition of one GPU ("" = memory of its own), in member order.

    In NPS1 the GPU's memory is one NUMA pool that every compute partition allocates from, and
    amdsmi 7.0.x reports that whole pool (total and used) on each partition: partitions that all
    report the same VRAM total share the parent's pool. No memory-mode answer at all counts as
    NPS1, the mode every partitioned MI300 supports. In NPS2/NPS4/NPS8, or when the partitions
    report different totals (per-partition VRAM), each partition's memory is its own.
    """
    own = [""] * len(members)
    if memory_mode.strip().upper() not in ("", "NPS1"):
        return own
    totals = {p.memory_total_bytes for p in members}
    if len(totals) != 1 or None in totals:
        return own
    return [parent_uuid] * len(members)


def assign_partitions(probes: list[GpuProbe]) -> tuple[list[DeviceIdentity], dict[str, int]]:
    """Turn probes into identities, recognising compute partitions.

    Rule: amdsmi reports each partition of an MI300-class GPU (DPX/CPX...) as its own processor
    handle with the same PCI domain:bus:device and the partition number in the function bits.
    Handles sharing domain:bus:device are therefore one physical GPU. Within such a group the
    member with the lowest (function, partition id, index) is partition 0 and stands for the
    physical GPU: *every* member, partition 0 included, gets ``parent_uuid`` = partition 0's
    uuid (so ``parent_uuid or uuid`` is always the physical-GPU key), ``mig_profile`` = the
    GPU's compute partition mode (whichever partition answered, see _group_mode),
    ``memory_pool`` per _memory_pools, and ``pci_bus_id`` = the group's function-0 address
    (what lspci and DRA's pciBusID show). A handle alone at its address is a whole GPU (no
    parent, no profile, its own memory). amdsmi before ROCm 7.12 reports one uuid for all
    partitions of a GPU (it is made from the GPU's serial): later ones get ``-p<partition id>``
    appended so identities stay unique (and stable across rescans).

    Returns the identities and uuid -> handle key.
    """
    groups: dict[tuple[int, int, int] | str, list[tuple[tuple[int, int, int, int] | None, GpuProbe]]] = {}
    for p in probes:
        parts = _bdf_split(p.bdf)
        key: tuple[int, int, int] | str = parts[:3] if parts else f"unparsed:{p.bdf}:{p.index}"
        groups.setdefault(key, []).append((parts, p))

    identities: list[DeviceIdentity] = []
    handles: dict[str, int] = {}
    seen: set[str] = set()
    for _key, members in groups.items():
        members.sort(key=lambda m: ((m[0] or (0, 0, 0, 0))[3], m[1].partition_id or 0, m[1].index))
        probes_in = [p for _, p in members]
        partitioned = len(members) > 1
        parent_uuid = probes_in[0].uuid if partitioned else ""
        mode = _group_mode(probes_in, "compute_partition") if partitioned else ""
        pools = _memory_pools(probes_in, parent_uuid,
                              _group_mode(probes_in, "memory_partition")) if partitioned else [""]
        renamed: list[str] = []
        for pos, (parts, p) in enumerate(members):
            uuid = p.uuid
            if uuid in seen:
                uuid = f"{p.uuid}-p{p.partition_id if p.partition_id is not None else pos}"
                renamed.append(uuid)
            seen.add(uuid)
            if partitioned and parts is not None:
                bus_id = "%04x:%02x:%02x.0" % parts[:3]
            else:
                bus_id = normalize_pci_bus_id(p.bdf)
            identities.append(
                DeviceIdentity(
                    uuid=uuid,
                    vendor=Vendor.AMD,
                    model=p.model,
                    pci_bus_id=bus_id,
                    index=p.index,
                    driver_version=p.driver_version,
                    parent_uuid=parent_uuid,
                    mig_profile=mode,
                    card_index=p.card,
                    render_index=p.render,
                    serial=p.serial,
                    memory_total_bytes=p.memory_total_bytes,
                    memory_pool=pools[pos],
                )
            )
            handles[uuid] = p.handle_key
        if renamed:
            log.info("amdsmi_duplicate_uuid", uuid=probes_in[0].uuid, renamed=renamed, bdf=probes_in[0].bdf)
    identities.sort(key=lambda d: d.index)
    return identities, handles


# --------------------------------------------------------------------------------------------
# Unit conversions (pure)
# --------------------------------------------------------------------------------------------


def _num(v: Any) -> int | float | None:
    """amdsmi reports unavailable values as the string "N/A"."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def percent_to_ratio(v: Any) -> float | None:
    n = _num(v)
    if n is None or n < 0 or n > 100:
        return None
    return n / 100.0


def mhz_to_hz(v: Any) -> float | None:
    n = _num(v)
    return None if n is None else float(n) * 1e6


def energy_joules(accumulator: Any, resolution_uj: Any) -> float | None:
    """``energy_accumulator`` x ``counter_resolution`` (microjoules per count) in joules."""
    acc, res = _num(accumulator), _num(resolution_uj)
    if acc is None or res is None or res <= 0:
        return None
    return acc * res * 1e-6


def socket_power_watts(info: Mapping[str, Any]) -> float | None:
    """MI300+ fill ``current_socket_power``; MI200 and older ``average_socket_power``; the other
    reads "N/A" (0xFFFF) or 0. Take the first positive one, else the first number."""
    values = [_num(info.get(k)) for k in ("current_socket_power", "average_socket_power", "socket_power")]
    numbers = [v for v in values if v is not None]
    for v in numbers:
        if v > 0:
            return float(v)
    return float(numbers[0]) if numbers else None


# --------------------------------------------------------------------------------------------
# Error classification
# --------------------------------------------------------------------------------------------


class _Fault(enum.Enum):
    UNSUPPORTED = "unsupported"  # permanent for this device: remember, never ask again
    TRANSIENT = "transient"  # None this cycle, ask again next cycle
    FIELD = "field"  # unexpected per-field error: None this cycle, warn once
    DEVICE = "device"  # the device itself is failing: the whole reading fails


_UNSUPPORTED = ("NOT_SUPPORTED", "NOT_YET_IMPLEMENTED", "NO_PERM", "SETTING_UNAVAILABLE", "FAIL_LOAD_SYMBOL")
_TRANSIENT = ("RETRY", "BUSY", "NO_DATA", "INTERRUPT")
_LOST = ("NOT_FOUND", "DRIVER_NOT_LOADED", "IO", "AMDGPU_RESTART_ERR")
_UNKNOWN = ("UNKNOWN_ERROR", "MAP_ERROR")
_DEVICE_OTHER = ("DRM_ERROR", "NOT_INIT", "INIT_ERROR", "INTERNAL_EXCEPTION", "FAIL_LOAD_MODULE")


def _codes(wrapper: Any, names: Iterable[str]) -> frozenset[int]:
    return frozenset(
        getattr(wrapper, "AMDSMI_STATUS_" + n) for n in names if hasattr(wrapper, "AMDSMI_STATUS_" + n)
    )


@dataclass(frozen=True)
class _StatusTable:
    unsupported: frozenset[int]
    transient: frozenset[int]
    lost: frozenset[int]
    unknown: frozenset[int]
    device_other: frozenset[int]
    timeout: int | None
    no_data: int | None

    @classmethod
    def from_wrapper(cls, wrapper: Any) -> _StatusTable:
        return cls(
            unsupported=_codes(wrapper, _UNSUPPORTED),
            transient=_codes(wrapper, _TRANSIENT),
            lost=_codes(wrapper, _LOST),
            unknown=_codes(wrapper, _UNKNOWN),
            device_other=_codes(wrapper, _DEVICE_OTHER),
            timeout=getattr(wrapper, "AMDSMI_STATUS_TIMEOUT", None),
            no_data=getattr(wrapper, "AMDSMI_STATUS_NO_DATA", None),
        )

    def classify(self, code: int | None) -> tuple[_Fault, ReadError | None]:
        if code is None:
            return _Fault.FIELD, None
        if code in self.unsupported:
            return _Fault.UNSUPPORTED, None
        if code in self.transient:
            return _Fault.TRANSIENT, None
        if code == self.timeout:
            # amdsmi gave up waiting (its own lock or a firmware message) and returned: the call
            # is not stuck, so this is no news about the GPU, not driver_hung. A call that really
            # hangs is caught by the agent's deadline and becomes driver_hung only after
            # --hung-after, as for every backend.
            return _Fault.DEVICE, ReadError.LATE
        if code in self.lost:
            return _Fault.DEVICE, ReadError.LOST
        if code in self.unknown:
            return _Fault.DEVICE, ReadError.UNKNOWN
        if code in self.device_other:
            return _Fault.DEVICE, ReadError.ERROR
        # INVAL, INSUFFICIENT_SIZE, ...: more likely a binding/version problem with this one
        # call than a sick GPU, so do not fail the device for it.
        return _Fault.FIELD, None


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "err_code", None)
    return code if isinstance(code, int) else None


# --------------------------------------------------------------------------------------------
# Field readers: each fills part of a DeviceReading from one amdsmi call
# --------------------------------------------------------------------------------------------

FieldReader = Callable[[Any, Any, DeviceReading], None]


def _read_activity(am: Any, h: Any, r: DeviceReading) -> None:
    act = am.amdsmi_get_gpu_activity(h)
    r.utilization_ratio = percent_to_ratio(act.get("gfx_activity"))
    # UMC = memory controller busy share, the closest thing to DCGM's DRAM-active
    r.dram_active_ratio = percent_to_ratio(act.get("umc_activity"))


def _read_memory_used(am: Any, h: Any, r: DeviceReading) -> None:
    r.memory_used_bytes = int(am.amdsmi_get_gpu_memory_usage(h, am.AmdSmiMemoryType.VRAM))


def _read_memory_total(am: Any, h: Any, r: DeviceReading) -> None:
    if r.memory_total_bytes is None:
        r.memory_total_bytes = int(am.amdsmi_get_gpu_memory_total(h, am.AmdSmiMemoryType.VRAM))


def _read_power(am: Any, h: Any, r: DeviceReading) -> None:
    r.power_watts = socket_power_watts(am.amdsmi_get_power_info(h))


def _read_energy(am: Any, h: Any, r: DeviceReading) -> None:
    e = am.amdsmi_get_energy_count(h)
    r.energy_joules = energy_joules(e.get("energy_accumulator"), e.get("counter_resolution"))


def _temp(am: Any, h: Any, sensor: str) -> float | None:
    v = _num(am.amdsmi_get_temp_metric(h, am.AmdSmiTemperatureType[sensor], am.AmdSmiTemperatureMetric.CURRENT))
    return None if v is None else float(v)


def _read_temp_hotspot(am: Any, h: Any, r: DeviceReading) -> None:
    r.temperature_celsius = _temp(am, h, "HOTSPOT")


def _read_temp_edge(am: Any, h: Any, r: DeviceReading) -> None:
    if r.temperature_celsius is None:  # fallback only: boards without a junction sensor
        r.temperature_celsius = _temp(am, h, "EDGE")


def _read_temp_vram(am: Any, h: Any, r: DeviceReading) -> None:
    r.memory_temperature_celsius = _temp(am, h, "VRAM")


def _read_gfx_clock(am: Any, h: Any, r: DeviceReading) -> None:
    r.sm_clock_hertz = mhz_to_hz(am.amdsmi_get_clock_info(h, am.AmdSmiClkType.GFX).get("clk"))


def _read_mem_clock(am: Any, h: Any, r: DeviceReading) -> None:
    r.memory_clock_hertz = mhz_to_hz(am.amdsmi_get_clock_info(h, am.AmdSmiClkType.MEM).get("clk"))


def _read_ecc(am: Any, h: Any, r: DeviceReading) -> None:
    ecc = am.amdsmi_get_gpu_total_ecc_count(h)
    c, u = _num(ecc.get("correctable_count")), _num(ecc.get("uncorrectable_count"))
    r.ecc_correctable_total = None if c is None else int(c)
    r.ecc_uncorrectable_total = None if u is None else int(u)


def _read_pcie_replay(am: Any, h: Any, r: DeviceReading) -> None:
    v = _num(am.amdsmi_get_gpu_pci_replay_counter(h))
    r.pcie_replay_total = None if v is None else int(v)


def _read_pcie_replay_metrics(am: Any, h: Any, r: DeviceReading) -> None:
    # Fallback when the dedicated counter is unsupported: the (large) gpu_metrics table.
    if r.pcie_replay_total is None:
        v = _num(am.amdsmi_get_gpu_metrics_info(h).get("pcie_replay_count_acc"))
        r.pcie_replay_total = None if v is None else int(v)


def _read_processes(am: Any, h: Any, r: DeviceReading) -> None:
    procs: dict[int, int | None] = {}
    for p in am.amdsmi_get_gpu_process_list(h):
        pid = _num(p.get("pid"))
        if pid is None:
            continue
        vram = _num((p.get("memory_usage") or {}).get("vram_mem"))
        if not vram:
            vram = _num(p.get("mem"))
        procs[int(pid)] = None if vram is None else int(vram)
    r.processes = procs


#: Order matters: the first call doubles as the liveness probe, so a lost GPU fails fast;
#: fallbacks come right after the reader they stand in for.
FIELD_READERS: tuple[tuple[str, FieldReader], ...] = (
    ("activity", _read_activity),
    ("memory_used", _read_memory_used),
    ("memory_total", _read_memory_total),
    ("power", _read_power),
    ("energy", _read_energy),
    ("temp_hotspot", _read_temp_hotspot),
    ("temp_edge", _read_temp_edge),
    ("temp_vram", _read_temp_vram),
    ("clock_gfx", _read_gfx_clock),
    ("clock_mem", _read_mem_clock),
    ("ecc", _read_ecc),
    ("pcie_replay", _read_pcie_replay),
    ("pcie_replay_metrics", _read_pcie_replay_metrics),
    ("processes", _read_processes),
)

# amdsmi event notification types -> our events. PRE_RESET means the driver found the GPU
# hung or hit a fatal RAS error and is about to reset it; POST_RESET is the evidence of
# recovery. VMFAULT (an application's bad access, like NVIDIA's app XIDs) and
# THERMAL_THROTTLE are deliberately not subscribed: neither says the hardware is failing.
_EVENT_MAP: dict[str, EventKind] = {
    "GPU_PRE_RESET": EventKind.RAS,
    "GPU_POST_RESET": EventKind.RESET,
}


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


class AmdSmiBackend(DeviceBackend):
    name = "amdsmi"

    def __init__(self, *, event_poll_ms: int = 1000, event_error_backoff_s: float = 5.0) -> None:
        self._am: Any = None
        self._status: _StatusTable | None = None
        self._lock = threading.Lock()
        self._identities: list[DeviceIdentity] | None = None
        self._rescan = threading.Event()
        self._handles: dict[str, Any] = {}  # uuid -> amdsmi processor handle
        self._uuid_by_key: dict[int, str] = {}  # handle pointer value -> uuid
        self._unsupported: dict[str, set[str]] = {}  # uuid -> field keys never to ask again
        self._warned: set[tuple[str, str, int | None]] = set()
        self._driver_version = ""
        self._event_poll_ms = event_poll_ms
        self._event_backoff = event_error_backoff_s
        self._events: EventThread = EventThread("amdsmi-events")
        self._event_readers: list[Any] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self) -> None:
        if self._am is not None:
            return
        noise = io.StringIO()
        try:
            # amdsmi_wrapper print()s its search failures; keep them out of our stdout and put
            # them in the error instead.
            with contextlib.redirect_stdout(noise):
                import amdsmi
        except Exception as exc:  # KeyError/OSError/AttributeError, not ImportError
            printed = " ".join(noise.getvalue().split())
            raise BackendUnavailable(
                "AMD SMI is not usable: cannot import amdsmi / load libamd_smi.so "
                f"({type(exc).__name__}: {exc}){'; ' + printed if printed else ''}. Install the "
                "ROCm amd-smi-lib and an amdsmi package no newer than it, or set ROCM_PATH."
            ) from exc
        try:
            amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except Exception as exc:
            raise BackendUnavailable(
                f"amdsmi_init failed ({type(exc).__name__}: {one_line(exc)}); is the amdgpu driver loaded?"
            ) from exc
        self._am = amdsmi
        self._status = _StatusTable.from_wrapper(amdsmi.amdsmi_wrapper)
        log.info("amdsmi_opened", version=getattr(amdsmi, "__version__", ""))

    def close(self) -> None:
        # The reader wakes at least every poll interval; a wedged one is abandoned (daemon).
        self._events.stop(self._event_poll_ms / 1000.0 + 1.0)
        for reader in self._event_readers:
            with contextlib.suppress(Exception):
                reader.stop()
        self._event_readers = []
        am, self._am = self._am, None
        if am is not None:
            try:
                am.amdsmi_shut_down()
            except Exception as exc:
                log.warning("amdsmi_shutdown_failed", error=one_line(exc))

    def driver_version(self) -> str:
        return self._driver_version

    # -- enumeration ----------------------------------------------------------------------------
    def enumerate(self) -> list[DeviceIdentity]:
        with self._lock:
            if self._identities is not None and not self._rescan.is_set():
                return list(self._identities)
            self._rescan.clear()
            am = self._require()
            try:
                handles = am.amdsmi_get_processor_handles()
            except Exception as exc:
                log.error("amdsmi_enumerate_failed", error=one_line(exc))
                return list(self._identities or [])
            probes: list[GpuProbe] = []
            by_key: dict[int, Any] = {}
            for h in handles:
                if not self._is_gpu(h):
                    continue
                probe = self._probe(h, len(probes))
                if probe is not None:
                    probes.append(probe)
                    by_key[probe.handle_key] = h
            identities, keys = assign_partitions(probes)
            self._handles = {uuid: by_key[k] for uuid, k in keys.items()}
            self._uuid_by_key = {k: uuid for uuid, k in keys.items()}
            self._identities = identities
            if identities and not self._driver_version:
                self._driver_version = identities[0].driver_version
            log.info(
                "amdsmi_enumerated",
                devices=len(identities),
                partitions=sum(1 for d in identities if d.is_partition),
            )
            return list(identities)

    def _require(self) -> Any:
        if self._am is None:
            raise BackendUnavailable("AmdSmiBackend used before open()")
        return self._am

    def _is_gpu(self, h: Any) -> bool:
        try:
            kind = self._am.amdsmi_get_processor_type(h).get("processor_type", "")
        except Exception:
            # We asked amdsmi_init for GPUs only; an unanswerable type is still a GPU.
            return True
        # Exact name: "AMDSMI_PROCESSOR_TYPE_NON_AMD_GPU" contains "AMD_GPU" too.
        return str(kind) == "AMDSMI_PROCESSOR_TYPE_AMD_GPU"

    def _probe(self, h: Any, index: int) -> GpuProbe | None:
        am = self._am
        key = int(h.value or 0)
        try:
            uuid = am.amdsmi_get_gpu_device_uuid(h)
            bdf = am.amdsmi_get_gpu_device_bdf(h)
        except Exception as exc:
            log.error("amdsmi_probe_failed", index=index, error=one_line(exc))
            return None

        def opt(call: Callable[[], Any], default: Any = None) -> Any:
            try:
                return call()
            except Exception as exc:
                log.debug("amdsmi_probe_field_unavailable", uuid=uuid, error=one_line(exc))
                return default

        enum_info = opt(lambda: am.amdsmi_get_gpu_enumeration_info(h), {}) or {}
        asic = opt(lambda: am.amdsmi_get_gpu_asic_info(h), {}) or {}
        driver = opt(lambda: am.amdsmi_get_gpu_driver_info(h), {}) or {}
        kfd = opt(lambda: am.amdsmi_get_gpu_kfd_info(h), {}) or {}
        total = opt(lambda: am.amdsmi_get_gpu_memory_total(h, am.AmdSmiMemoryType.VRAM))
        # amdsmi 7.0.x answers these on a GPU's first partition only; assign_partitions takes
        # the mode from whichever partition answered.
        partition = opt(lambda: am.amdsmi_get_gpu_compute_partition(h), "") or ""
        memory_partition = opt(lambda: am.amdsmi_get_gpu_memory_partition(h), "") or ""

        def text(v: Any) -> str:
            return "" if v in (None, "N/A") else str(v)

        def integer(v: Any) -> int | None:
            n = _num(v)
            return None if n is None else int(n)

        return GpuProbe(
            index=index,
            handle_key=key,
            uuid=str(uuid),
            bdf=str(bdf),
            model=text(asic.get("market_name")),
            driver_version=text(driver.get("driver_version")),
            serial=text(asic.get("asic_serial")),
            card=integer(enum_info.get("drm_card")),
            render=integer(enum_info.get("drm_render")),
            memory_total_bytes=integer(total),
            compute_partition=text(partition),
            partition_id=integer(kfd.get("current_partition_id")),
            memory_partition=text(memory_partition),
        )

    # -- reading --------------------------------------------------------------------------------
    def read(self, device: DeviceIdentity) -> DeviceReading:
        am = self._am
        handle = self._handles.get(device.uuid)
        if am is None or handle is None or self._status is None:
            return DeviceReading.failed(device.uuid, ReadError.GONE, "not enumerated by amdsmi")
        reading = DeviceReading(uuid=device.uuid, memory_total_bytes=device.memory_total_bytes)
        skip = self._unsupported.setdefault(device.uuid, set())
        for key, reader in FIELD_READERS:
            if key in skip:
                continue
            try:
                reader(am, handle, reading)
            except Exception as exc:
                code = _error_code(exc)
                fault, err = self._status.classify(code)
                if fault is _Fault.DEVICE:
                    detail = f"{key}: {one_line(exc)}"
                    err = err or ReadError.ERROR
                    log.warning("amdsmi_device_failed", uuid=device.uuid, field=key, code=code, error=err.value)
                    return DeviceReading.failed(device.uuid, err, detail)
                if fault is _Fault.UNSUPPORTED:
                    skip.add(key)
                    log.debug("amdsmi_field_unsupported", uuid=device.uuid, field=key, code=code)
                elif fault is _Fault.FIELD and (device.uuid, key, code) not in self._warned:
                    self._warned.add((device.uuid, key, code))
                    log.warning("amdsmi_field_error", uuid=device.uuid, field=key, code=code, error=one_line(exc))
        return reading

    # -- events ---------------------------------------------------------------------------------
    def start_events(self, sink: EventSink) -> None:
        """Watch KFD reset notifications on a daemon thread. Best effort: any failure to set up
        is logged and leaves the backend working without events."""
        if self._events.started:
            return
        am = self._require()
        self.enumerate()
        try:
            types = [getattr(am.AmdSmiEvtNotificationType, n) for n in _EVENT_MAP]
        except AttributeError as exc:
            log.warning("amdsmi_events_unavailable", error=str(exc))
            return
        readers = []
        for uuid, h in self._handles.items():
            try:
                readers.append(am.AmdSmiEventReader(h, types))
            except Exception as exc:
                log.warning("amdsmi_events_unavailable", uuid=uuid, error=one_line(exc))
        if not readers:
            return
        self._event_readers = readers
        # One reader thread: amdsmi_get_gpu_event_notification is a global poll that drains the
        # events of every registered device, whichever reader object calls it.
        reader = readers[0]
        self._events.start(lambda: self._event_turn(reader, sink))

    def _event_turn(self, reader: Any, sink: EventSink) -> None:
        status = self._status
        try:
            events = reader.read(self._event_poll_ms, 32)
        except Exception as exc:
            if status is not None and _error_code(exc) == status.no_data:
                return  # the wait timed out without events
            if self._events.stopping():
                return
            log.warning("amdsmi_event_read_failed", error=one_line(exc))
            self._events.wait(self._event_backoff)
            return
        for ev in events:
            try:
                self._deliver(ev, sink)
            except Exception:
                log.exception("amdsmi_event_dropped")

    def _deliver(self, ev: Mapping[str, Any], sink: EventSink) -> None:
        name = str(ev.get("event", ""))
        kind = _EVENT_MAP.get(name)
        if kind is None:
            return
        h = ev.get("processor_handle")
        uuid = self._uuid_by_key.get(int(getattr(h, "value", None) or 0), "")
        if not uuid:
            log.warning("amdsmi_event_unknown_device", notification=name)
            return
        if kind is EventKind.RESET:
            # A reset can change the partition layout; re-read identities on next enumerate().
            self._rescan.set()
        code = int(getattr(self._am.AmdSmiEvtNotificationType, name, 0)) if self._am is not None else 0
        detail = f"{name}: {ev.get('message', '')}".strip().rstrip(":")
        log.info("amdsmi_event", uuid=uuid, notification=name, kind=kind.value)
        try:
            sink(DeviceEvent(uuid=uuid, kind=kind, code=code, detail=detail))
        except Exception:
            log.exception("amdsmi_event_sink_failed", uuid=uuid, notification=name)
