"""GPUs the node's ResourceSlices publish but the device library cannot see: lost GPUs.

A GPU that fell off the bus before the agent started is not enumerated by NVML at all, so
without this it would have no series, no condition and no rule, and a claim holding it would
read healthy. NVIDIA's DRA driver publishes every GPU with its ``uuid`` attribute (``GPU-...``)
and every static MIG device with ``uuid`` (``MIG-...``) and ``parentUUID``; a published GPU
uuid (or MIG parent uuid) that the library's enumeration lacks is a lost GPU, and every MIG
device published on it is lost with it. Its identity is rebuilt from the slice's
attributes (product name, PCI bus id, driver version, minor, index, MIG profile) so it is
exported like any other GPU, with ``gpu_up 0``.

Only asked when enumeration succeeded: when the library cannot enumerate at all, nothing can be
told apart (the devices collector fails and /readyz says so). No I/O (:class:`LostDevices`
logs what changes).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from ..devices.model import DeviceIdentity, DeviceReading, ReadError, Vendor, normalize_pci_bus_id
from ..k8s.model import DeviceKey, SliceDevice
from ..k8s.resolve import NVIDIA_DRIVER, PCI_BUS_ID_ATTR

log = structlog.get_logger(__name__)


def _s(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _i(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _identity(dev: SliceDevice, uuid: str, parent: str = "") -> DeviceIdentity:
    idx = _i(dev.attr("index"))
    return DeviceIdentity(
        uuid=uuid,
        vendor=Vendor.NVIDIA,
        model=_s(dev.attr("productName")),
        pci_bus_id=normalize_pci_bus_id(_s(dev.attr(PCI_BUS_ID_ATTR)) or _s(dev.attr("pcieBusID"))),
        index=idx if idx is not None else -1,
        minor=_i(dev.attr("minor")),
        driver_version=_s(dev.attr("driverVersion")),
        parent_uuid=parent,
        mig_profile=_s(dev.attr("profile")) if parent else "",
    )


def lost_devices(slices: Mapping[DeviceKey, SliceDevice],
                 identities: Iterable[DeviceIdentity]) -> dict[str, tuple[DeviceIdentity, SliceDevice]]:
    """uuid -> (rebuilt identity, the slice device that publishes it), for every NVIDIA GPU the
    slices publish and ``identities`` lack, and every MIG device published on such a GPU."""
    local = {i.uuid for i in identities}
    out: dict[str, tuple[DeviceIdentity, SliceDevice]] = {}
    for key in sorted(slices):
        dev = slices[key]
        uuid = _s(dev.attr("uuid"))
        if dev.driver == NVIDIA_DRIVER and uuid.startswith("GPU-") and uuid not in local and uuid not in out:
            out[uuid] = (_identity(dev, uuid), dev)
    for key in sorted(slices):
        dev = slices[key]
        uuid, parent = _s(dev.attr("uuid")), _s(dev.attr("parentUUID"))
        if dev.driver != NVIDIA_DRIVER or not uuid or not parent.startswith("GPU-") or parent in local:
            continue
        # A MIG device lives on its GPU: when the GPU is lost, so is the instance. A GPU in MIG
        # mode is published only through its MIG devices (static MIG): their parentUUID names it.
        if parent not in out:
            out[parent] = (_identity(dev, parent), dev)
        if uuid not in local and uuid not in out:
            out[uuid] = (_identity(dev, uuid, parent), dev)
    return out


def _same_objects(a: Mapping[DeviceKey, SliceDevice], b: Mapping[DeviceKey, SliceDevice]) -> bool:
    """The same keys with the very same device objects. Not ``==``: a SliceDevice compares
    without its attributes, and a republished device's uuid is an attribute."""
    return a is b or (len(a) == len(b) and all(map(operator.is_, map(b.get, a), a.values())))


class LostDevices:
    """The last decision about lost GPUs, re-made only in a cycle whose enumeration succeeded
    and whose slices are listed; otherwise the last decision stands (a failed enumeration tells
    nothing about single GPUs)."""

    def __init__(self) -> None:
        self._lost: dict[str, tuple[DeviceIdentity, SliceDevice]] = {}
        # What the last decision was made from: the same slice devices and identities make the
        # same decision. On a steady node the slice watch hands over the very same SliceDevice
        # objects every cycle, so asking is a pointer check per device, in C, instead of
        # walking every slice device's attributes (0.1 ms of a dense cycle).
        self._from: tuple[Mapping[DeviceKey, SliceDevice], tuple[DeviceIdentity, ...]] | None = None

    def merge(
        self,
        identities: tuple[DeviceIdentity, ...],
        readings: Mapping[str, DeviceReading],
        slices: Mapping[DeviceKey, SliceDevice] | None,
        enumerated: bool,
    ) -> tuple[tuple[DeviceIdentity, ...], Mapping[str, DeviceReading]]:
        """The enumerated devices plus the lost ones, each lost one with a ``lost`` reading."""
        if (
            slices is not None
            and enumerated
            and (self._from is None or self._from[1] != identities or not _same_objects(self._from[0], slices))
        ):
            lost = lost_devices(slices, identities)
            self._from = (slices, identities)
            for u in sorted(lost.keys() - self._lost.keys()):
                ident, dev = lost[u]
                log.error("gpu_lost_not_enumerated", uuid=u, device=dev.name, pool=dev.pool,
                          parent=ident.parent_uuid or None)
            for u in sorted(self._lost.keys() - lost.keys()):
                log.info("gpu_found_again", uuid=u)
            self._lost = lost
        if not self._lost:
            return identities, readings
        out = dict(readings)
        for u, (_ident, dev) in self._lost.items():
            out[u] = DeviceReading.failed(u, ReadError.LOST,
                                          f"published by ResourceSlice device {dev.pool}/{dev.name} but not found by "
                                          "the device library")
        return identities + tuple(ident for ident, _ in self._lost.values()), out
