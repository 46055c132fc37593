"""Vendor-neutral device model.

Every backend (NVML, AMD SMI, simulated) produces these types and nothing else, so the join,
the health engine and the metrics never see a vendor library. Units are normalised here:
bytes, watts, joules, celsius, hertz and ratios in 0..1.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from ..clock import SYSTEM

__all__ = [
    "DeviceEvent",
    "DeviceIdentity",
    "DeviceReading",
    "EventKind",
    "ReadError",
    "RecoveryAction",
    "Vendor",
    "normalize_pci_bus_id",
]


class Vendor(str, enum.Enum):
    NVIDIA = "nvidia"
    AMD = "amd"


class RecoveryAction(enum.IntEnum):
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5


class ReadError(str, enum.Enum):
    """Why a device could not be read in a cycle. Exported as a label, so keep the set small."""

    LOST = "lost"  # GPU fell off the bus / NVML_ERROR_GPU_IS_LOST
    UNKNOWN = "unknown"  # NVML_ERROR_UNKNOWN and friends
    TIMEOUT = "timeout"  # a call has been stuck beyond --hung-after while the agent got CPU (hung driver)
    # A call missed its deadline but that is no evidence against the device (yet): the agent
    # was starved of CPU, the call never started, or it has not been stuck for --hung-after.
    LATE = "late"
    GONE = "gone"  # the device disappeared from enumeration
    ERROR = "error"  # anything else


_BDF_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})\.(?P<fn>[0-7])$"
)


def normalize_pci_bus_id(bus_id: str) -> str:
    """Return the bus id as ``dddd:bb:dd.f`` in lower case.

    NVML answers ``00000000:3B:00.0`` (8-digit domain, upper case); DRA's standard
    ``resource.kubernetes.io/pciBusID`` attribute is ``0000:3b:00.0``. Joining the two needs one
    canonical form. An id that is not a BDF at all is returned lower-cased and stripped, so a
    bad value still shows up rather than vanishing.
    """
    s = (bus_id or "").strip()
    m = _BDF_RE.match(s)
    if not m:
        return s.lower()
    domain = int(m.group("domain") or "0", 16)
    return "%04x:%02x:%02x.%s" % (domain & 0xFFFF, int(m.group("bus"), 16), int(m.group("dev"), 16), m.group("fn"))


@dataclass(frozen=True)
class DeviceIdentity:
    """Static facts about one schedulable device: a full GPU, a MIG instance or an AMD partition.

    Read once at enumeration time; a change of MIG layout produces a new set of identities.
    """

    uuid: str
    vendor: Vendor
    model: str
    pci_bus_id: str  # normalised, see normalize_pci_bus_id; MIG and partitions carry the parent's
    index: int  # backend enumeration index (NVML index; MIG: index within the parent)
    minor: int | None = None  # /dev/nvidia<minor>; the NVIDIA DRA driver names devices gpu-<minor>
    driver_version: str = ""
    parent_uuid: str = ""  # set for MIG instances and AMD partitions
    mig_profile: str = ""  # e.g. "1g.10gb"
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    gi_profile_id: int | None = None  # MIG GPU-instance profile id (DynamicMIG names carry it)
    placement_start: int | None = None  # MIG placement start slot
    card_index: int | None = None  # AMD: /dev/dri/card<N>
    render_index: int | None = None  # AMD: /dev/dri/renderD<N>
    serial: str = ""
    memory_total_bytes: int | None = None
    #: The memory this device draws on, when other devices draw on it too: devices naming the
    #: same pool report the same memory (amdsmi 7.0.x reports an AMD GPU's whole pool on each of
    #: its partitions in NPS1), so aggregates over devices count a pool once. "" = the device's
    #: own memory (full GPUs, MIG instances, partitions with memory of their own).
    memory_pool: str = ""

    @property
    def memory_pool_key(self) -> str:
        """What to count memory once per: the shared pool, else the device itself."""
        return self.memory_pool or self.uuid

    @property
    def is_partition(self) -> bool:
        """A MIG instance or an AMD partition other than the GPU's first one.

        AMD partitions all name the first partition as parent, the first one included, so
        "has a parent" alone would hide the physical GPU itself.
        """
        return bool(self.parent_uuid) and self.parent_uuid != self.uuid

    @property
    def physical_uuid(self) -> str:
        return self.parent_uuid or self.uuid


@dataclass
class DeviceReading:
    """One cycle's readings of one device. ``None`` means "not available on this device"."""

    uuid: str
    ok: bool = True
    error: ReadError | None = None
    error_detail: str = ""
    timestamp: float = field(default_factory=SYSTEM.wall)  # wall: nothing in the agent measures with it

    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    energy_joules: float | None = None  # monotonic counter since driver load
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    clock_event_reasons: int | None = None  # NVML bitmask (nvmlClocksEventReason*)

    ecc_correctable_total: int | None = None
    ecc_uncorrectable_total: int | None = None
    retired_pages_total: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_replay_total: int | None = None
    recovery_action: RecoveryAction | None = None
    throttle_seconds: dict[str, float] = field(default_factory=dict)  # reason -> seconds clocks held down

    # GPM (Hopper+) / AMD activity counters, 0..1
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None

    # per-process usage on this device: host pid -> used bytes (None when unknown)
    processes: dict[int, int | None] = field(default_factory=dict)

    @classmethod
    def failed(cls, uuid: str, error: ReadError, detail: str = "") -> DeviceReading:
        return cls(uuid=uuid, ok=False, error=error, error_detail=detail)


class EventKind(str, enum.Enum):
    XID = "xid"
    ECC_DBE = "ecc_dbe"  # double-bit (uncorrectable) ECC event
    ECC_SBE = "ecc_sbe"
    GPU_LOST = "gpu_lost"
    RECOVERY_ACTION = "recovery_action"
    MIG_CONFIG_CHANGE = "mig_config_change"
    RAS = "ras"  # AMD RAS / CPER event
    RESET = "reset"  # the device was reset (evidence for recovery of fatal faults)


@dataclass(frozen=True)
class DeviceEvent:
    """Something a device library reported asynchronously (NVML event set, amdsmi event reader)."""

    uuid: str
    kind: EventKind
    code: int = 0  # XID number, recovery action value, ...
    timestamp: float = field(default_factory=SYSTEM.wall)  # wall: nothing in the agent measures with it
    detail: str = ""
