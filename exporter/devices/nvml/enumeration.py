"""Which NVIDIA devices exist, and what is fixed about each: full GPUs and, with MIG mode on,
their MIG devices (:class:`DeviceRegistry`).

The layout is cached and scanned again only when it may have changed: a MIG config-change
event, ``invalidate()``, or a dead MIG handle. A full GPU's identity (UUID, name, PCI bus id
normalised to ``dddd:bb:dd.f``, index, minor, serial, memory, driver version) is read once per
UUID. A GPU whose handle can no longer be had is kept, so its reads report it lost instead of
it vanishing.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

import structlog

from ..model import DeviceIdentity, Vendor, normalize_pci_bus_id
from .abi import ERR_INVALID_ARGUMENT, ERR_NOT_FOUND, UNSUPPORTED, address, pynvml
from .device import NvmlDevice
from .readers import readers_for

log = structlog.get_logger(__name__)

_MIG_NAME_PROFILE = re.compile(r"\bMIG\s+(\S+)\s*$")


def mig_profile_from_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` -> ``"1g.5gb"``; also ``"MIG 1c.3g.20gb"``."""
    m = _MIG_NAME_PROFILE.search(name or "")
    return m.group(1) if m else ""


def mig_profile_from_size(slice_count: int, memory_mb: int) -> str:
    """Approximate NVIDIA's profile name from GI profile info when no name is available.

    NVIDIA names round the instance's memory up to whole GB (1g.5gb = 4864 MB, 1g.10gb =
    9856 MB); this is a fallback only, the device or profile name is preferred.
    """
    if slice_count <= 0 or memory_mb <= 0:
        return ""
    return f"{slice_count}g.{math.ceil(memory_mb / 1024)}gb"


def memory_info(handle: Any, uuid: str) -> Any:
    """Memory info at enumeration: v2 (``used`` excludes driver-reserved memory), else v1."""
    for version in (getattr(pynvml, "nvmlMemory_v2", None), None):
        try:
            return (
                pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                if version
                else pynvml.nvmlDeviceGetMemoryInfo(handle)
            )
        except pynvml.NVMLError as exc:
            log.debug("nvml_memory_info_failed", uuid=uuid, v2=bool(version), error=str(exc))
    return None


class DeviceRegistry:
    """The enumerated devices by uuid, in NVML order (each GPU followed by its MIG devices).

    Readers get an ``NvmlDevice`` by uuid; the event thread gets the full GPUs and a GPU's MIG
    devices. ``lock`` guards the maps and is never held across an NVML call; one rescan runs at
    a time.
    """

    def __init__(self, *, gpm: bool, processes: bool) -> None:
        self._use_gpm = gpm
        self._processes = processes
        self.driver_version = ""
        self.lock = threading.RLock()
        self._scan_lock = threading.Lock()
        self._devices: dict[str, NvmlDevice] = {}
        self._order: list[str] = []
        self._gpu_identity: dict[str, DeviceIdentity] = {}  # full GPUs: identity read once
        self._stale = True
        self.retired_samples: list[Any] = []  # GPM samples of vanished devices, freed at close

    # ---- lookups -----------------------------------------------------------------------------

    def get(self, uuid: str) -> NvmlDevice | None:
        with self.lock:
            return self._devices.get(uuid)

    def all(self) -> list[NvmlDevice]:
        with self.lock:
            return list(self._devices.values())

    def full_gpus(self) -> list[NvmlDevice]:
        with self.lock:
            return [d for d in self._devices.values() if not d.is_mig]

    def migs_of(self, parent: str, gpu_instance_id: int) -> list[DeviceIdentity]:
        with self.lock:
            return [
                d.identity
                for d in self._devices.values()
                if d.identity.parent_uuid == parent and d.identity.gpu_instance_id == gpu_instance_id
            ]

    # ---- layout ------------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Forget the layout; the next enumerate() rescans (handles after a MIG
        reconfiguration are invalid)."""
        self._stale = True

    def enumerate(self) -> list[DeviceIdentity]:
        with self._scan_lock:
            if self._stale:
                self._rescan()
            with self.lock:
                return [self._devices[u].identity for u in self._order]

    def _rescan(self) -> None:
        # Cleared first: a MIG change event arriving during the scan marks it stale again.
        self._stale = False
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.error("nvml_device_count_failed", error=str(exc))
            self._stale = True
            return
        with self.lock:
            old = dict(self._devices)
            old_by_index = {d.identity.index: d for d in old.values() if not d.is_mig}
        devices: dict[str, NvmlDevice] = {}
        order: list[str] = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = str(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                prev = old_by_index.get(index)
                log.warning("nvml_device_handle_failed", index=index, error=str(exc),
                            known_uuid=prev and prev.identity.uuid)
                if prev is not None:
                    # Keep a GPU we knew: its reads will report it lost instead of it vanishing.
                    devices[prev.identity.uuid] = prev
                    order.append(prev.identity.uuid)
                    for u, d in old.items():
                        if d.identity.parent_uuid == prev.identity.uuid:
                            devices[u] = d
                            order.append(u)
                continue
            gpu = self._gpu_device(index, handle, uuid, old.get(uuid))
            devices[uuid] = gpu
            order.append(uuid)
            for mig in self._mig_devices(gpu, old):
                devices[mig.identity.uuid] = mig
                order.append(mig.identity.uuid)
        with self.lock:
            for u, d in old.items():
                if devices.get(u) is not d:
                    self.retired_samples.extend(d.gpm_samples)
                    d.gpm_samples = []
            self._devices = devices
            self._order = order
        log.info("nvml_enumerated", devices=len(order), gpus=count)

    def take_gpm_samples(self) -> list[Any]:
        """Every GPM sample held (the devices' and the retired ones), forgotten here: for
        close() to free. Call with no GPM call running (readers.BATCH_LOCK held)."""
        with self.lock:
            samples = [s for d in self._devices.values() for s in d.gpm_samples] + self.retired_samples
            self.retired_samples = []
            for d in self._devices.values():
                d.gpm_samples, d.gpm_prev = [], -1
        return samples

    def _device(self, identity: DeviceIdentity, handle: Any, parent_handle: Any = None,
                gpm: bool = False) -> NvmlDevice:
        dev = NvmlDevice(identity=identity, handle=handle, parent_handle=parent_handle, gpm_supported=gpm)
        dev.readers = readers_for(dev, processes=self._processes)
        return dev

    # ---- full GPUs ---------------------------------------------------------------------------

    def _gpu_device(self, index: int, handle: Any, uuid: str, old: NvmlDevice | None) -> NvmlDevice:
        ident = self._gpu_identity.get(uuid)
        if ident is None:
            ident = self._gpu_identity[uuid] = self._read_gpu_identity(index, handle, uuid)
        dev = self._device(ident, handle, gpm=self._gpm_support(handle))
        if old is not None and old.handle is not None and address(old.handle) == address(handle):
            # Same GPU, same handle: keep its GPM baseline; support is re-learnt after a rescan
            # because MIG mode changes what the parent supports.
            dev.gpm_samples, dev.gpm_prev = old.gpm_samples, old.gpm_prev
            old.gpm_samples = []
        return dev

    def _read_gpu_identity(self, index: int, handle: Any, uuid: str) -> DeviceIdentity:
        def best(fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                log.info("nvml_identity_field_unavailable", uuid=uuid, call=fn.__name__, error=str(exc))
                return default

        name = best(pynvml.nvmlDeviceGetName, handle, default="")
        pci = best(pynvml.nvmlDeviceGetPciInfo, handle)
        bus_id = (pci.busId.decode() if pci is not None and isinstance(pci.busId, bytes)
                  else str(getattr(pci, "busId", "") or ""))
        mem = memory_info(handle, uuid)
        return DeviceIdentity(
            uuid=uuid,
            vendor=Vendor.NVIDIA,
            model=str(name),
            pci_bus_id=normalize_pci_bus_id(bus_id),
            index=index,
            minor=best(pynvml.nvmlDeviceGetMinorNumber, handle),
            driver_version=self.driver_version,
            serial=str(best(pynvml.nvmlDeviceGetSerial, handle, default="") or ""),
            memory_total_bytes=int(mem.total) if mem is not None else None,
        )

    def _gpm_support(self, handle: Any) -> bool:
        if not self._use_gpm or not hasattr(pynvml, "nvmlGpmQueryDeviceSupport"):
            return False
        try:
            return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except pynvml.NVMLError:
            return False

    # ---- MIG devices -------------------------------------------------------------------------

    def _mig_devices(self, gpu: NvmlDevice, old: dict[str, NvmlDevice]) -> list[NvmlDevice]:
        h, parent = gpu.handle, gpu.identity
        try:
            if pynvml.nvmlDeviceGetMigMode(h)[0] != 1:  # NVML_DEVICE_MIG_ENABLE
                return []
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(h)
        except pynvml.NVMLError as exc:
            if exc.value not in UNSUPPORTED:
                log.warning("nvml_mig_mode_failed", uuid=parent.uuid, error=str(exc))
            return []
        out: list[NvmlDevice] = []
        for slot in range(slots):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except pynvml.NVMLError as exc:
                if exc.value not in (ERR_NOT_FOUND, ERR_INVALID_ARGUMENT):
                    log.warning("nvml_mig_handle_failed", uuid=parent.uuid, slot=slot, error=str(exc))
                continue
            try:
                ident = self._read_mig_identity(parent, h, mh, slot)
            except pynvml.NVMLError as exc:
                log.warning("nvml_mig_identity_failed", uuid=parent.uuid, slot=slot, error=str(exc))
                continue
            dev = self._device(ident, mh, parent_handle=h, gpm=gpu.gpm_supported)
            prev = old.get(ident.uuid)
            if prev is not None and address(prev.handle) == address(mh):
                dev.gpm_samples, dev.gpm_prev = prev.gpm_samples, prev.gpm_prev
                prev.gpm_samples = []
            out.append(dev)
        return out

    def _read_mig_identity(self, parent: DeviceIdentity, h: Any, mh: Any, slot: int) -> DeviceIdentity:
        """A MIG device's identity: profile from its name (``"... MIG 1g.10gb"``), else the GI
        profile's name, else ``<slices>g.<ceil(memoryMB/1024)>gb``; GI profile id and placement
        from its GPU instance (needs privileges on real systems; empty without them)."""
        uuid = str(pynvml.nvmlDeviceGetUUID(mh))

        def best(fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError as exc:
                log.info("nvml_mig_field_unavailable", uuid=uuid, call=getattr(fn, "__name__", "?"), error=str(exc))
                return None

        name = best(pynvml.nvmlDeviceGetName, mh) or ""
        gi_id = best(pynvml.nvmlDeviceGetGpuInstanceId, mh)
        ci_id = best(pynvml.nvmlDeviceGetComputeInstanceId, mh)
        profile = mig_profile_from_name(str(name))
        gi_profile_id = placement = None
        if gi_id is not None:
            gi = best(pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id)
            info = best(pynvml.nvmlGpuInstanceGetInfo, gi) if gi is not None else None
            if info is not None:
                gi_profile_id, placement = int(info.profileId), int(info.placement.start)
        if not profile and gi_profile_id is not None and hasattr(pynvml, "nvmlDeviceGetGpuInstanceProfileInfoById"):
            pinfo = best(pynvml.nvmlDeviceGetGpuInstanceProfileInfoById, h, gi_profile_id)
            if pinfo is not None:
                pname = pinfo.name.decode() if isinstance(pinfo.name, bytes) else str(pinfo.name)
                profile = (mig_profile_from_name(pname)
                           or mig_profile_from_size(int(pinfo.sliceCount), int(pinfo.memorySizeMB)))
        mem = memory_info(mh, uuid)
        return DeviceIdentity(
            uuid=uuid,
            vendor=Vendor.NVIDIA,
            model=parent.model,
            pci_bus_id=parent.pci_bus_id,
            index=slot,
            minor=None,
            driver_version=self.driver_version,
            parent_uuid=parent.uuid,
            mig_profile=profile,
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            gi_profile_id=gi_profile_id,
            placement_start=placement,
            memory_total_bytes=int(mem.total) if mem is not None else None,
        )
