"""Resolve a DRA device (driver, pool, device) or a device-plugin id to a local physical device.

Pure functions over the ResourceSlice device, the claim's allocation result and the devices
the backend enumerated. No I/O, so every rule is testable with plain data.

Rules, in the order they are tried (what the drivers publish, read from their sources:
https://github.com/NVIDIA/k8s-dra-driver-gpu and
https://github.com/ROCm/k8s-gpu-dra-driver/blob/main/docs/driver-attributes.md):

``gpu.nvidia.com``
  * ``uuid`` attribute (``GPU-...`` for a full GPU, ``MIG-...`` for a static MIG device).
  * MIG by name: ``gpu-<minor>-mig-<profile>-<giProfileId>-<start>`` (driver v25.12+) or
    ``gpu-<minor>-mig-<giProfileId>-<start>-<size>`` (up to v25.8) with the parent from the
    ``parentUUID`` attribute or the minor number -> the local MIG instance with that GPU-instance
    profile and placement start. DynamicMIG devices have no ``uuid`` (the MIG instance exists
    only once prepared), so when no such instance exists the *parent* GPU is reported with
    method ``dynamic-mig-parent``: the claim's usage then shows on the GPU it lives on.
  * ``resource.kubernetes.io/pciBusID`` or the legacy unqualified ``pcieBusID`` -> full GPU.
  * legacy ``minor`` attribute or the name ``gpu-<minor>`` -> full GPU by minor number.

``gpu.amd.com``
  * BDF from ``resource.kubernetes.io/pciBusID``, ``pciAddr`` or ``parentPciAddr`` plus card and
    render index from the name ``gpu-<card>-<render>`` (or ``cardIndex``/``renderIndex``):
    partitions share their parent's BDF, so the BDF alone is not enough for them. This covers
    both generations of ROCm/k8s-gpu-dra-driver: v1.x publishes ``type`` ``amdgpu`` /
    ``amdgpu-partition``, ``partitionProfile`` and the parent's standard pciBusID on every
    partition, with card and render only in the name; the alpha published ``pciAddr`` /
    ``parentPciAddr`` and ``cardIndex`` / ``renderIndex``, and no standard pciBusID.
  * otherwise the BDF alone (full GPUs only), then a ``uuid`` attribute if it happens to be local
    (the intermediate driver's synthetic uuid never is, so this cannot mis-resolve).

any other driver
  * ``uuid`` attribute, then ``resource.kubernetes.io/pciBusID``.

When the slice says nothing useful (or the device is gone from the slice), the claim's
``status.devices[].data`` is tried (``{"uuid": {"string": ...}}`` or ``{"uuid": "..."}``, same
for ``pciBusID``), then name heuristics (NVIDIA ``gpu-<minor>``, NVIDIA MIG names, AMD
``gpu-<card>-<render>``).

A slice that names a uuid this node's library does not know gives ``ok=False`` with that uuid and
method ``uuid-not-local`` (still useful as a label); nothing at all gives
``Resolution(ok=False, uuid="", method="unresolved")``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..constants import AMD_DRIVER, NVIDIA_DRIVER
from ..devices.model import DeviceIdentity, Vendor, normalize_pci_bus_id
from .model import AllocatedDevice, SliceDevice

__all__ = [
    "AMD_DRIVER",
    "NVIDIA_DRIVER",
    "PCI_BUS_ID_ATTR",
    "UNRESOLVED",
    "DeviceIndex",
    "Resolution",
    "parse_mig_name",
    "resolve",
    "resolve_device_plugin",
]

PCI_BUS_ID_ATTR = "resource.kubernetes.io/pciBusID"

# v25.12+: the profile token ("1g10gb") always contains letters; the older scheme is all digits.
# Test the all-digit form first: the newer regex also matches old names, with the wrong groups.
_MIG_OLD_RE = re.compile(r"^gpu-(\d+)-mig-(\d+)-(\d+)-(\d+)$")
_MIG_NEW_RE = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)$")
_NVIDIA_GPU_RE = re.compile(r"^gpu-(\d+)$")
_AMD_CARD_RENDER_RE = re.compile(r"^gpu-(\d+)-(\d+)$")
_TIME_SLICED_SUFFIX_RE = re.compile(r"::\d+$")


@dataclass(frozen=True)
class Resolution:
    uuid: str
    parent_uuid: str = ""
    mig_profile: str = ""
    method: str = "unresolved"
    ok: bool = False


UNRESOLVED = Resolution(uuid="", method="unresolved", ok=False)


@dataclass(frozen=True)
class MigName:
    minor: int
    gi_profile_id: int
    placement_start: int
    profile_token: str = ""  # "1g10gb" in the new scheme (dots removed), "" in the old one


def parse_mig_name(name: str) -> MigName | None:
    """Parse an NVIDIA DRA MIG device name in either scheme; ``None`` if it is not one."""
    m = _MIG_OLD_RE.match(name)
    if m:
        return MigName(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    m = _MIG_NEW_RE.match(name)
    if m:
        return MigName(int(m.group(1)), int(m.group(3)), int(m.group(4)), m.group(2))
    return None


class DeviceIndex:
    """Lookups over the devices the backend enumerated on this node."""

    def __init__(self, identities: Iterable[DeviceIdentity]) -> None:
        self.by_uuid: dict[str, DeviceIdentity] = {}
        self.by_pci: dict[str, DeviceIdentity] = {}  # full GPUs only: partitions share the BDF
        self.by_minor: dict[int, DeviceIdentity] = {}
        self.by_mig: dict[tuple[str, int, int], DeviceIdentity] = {}
        self.by_amd: dict[tuple[str, int, int], DeviceIdentity] = {}
        self.by_card_render: dict[tuple[int, int], DeviceIdentity] = {}
        self.by_index: dict[int, DeviceIdentity] = {}  # NVIDIA full GPUs by NVML index
        self.mig_by_parent_index: dict[tuple[str, int], DeviceIdentity] = {}
        for ident in identities:
            self.add(ident)

    def add(self, ident: DeviceIdentity) -> None:
        if ident.uuid:
            self.by_uuid[ident.uuid] = ident
        pci = normalize_pci_bus_id(ident.pci_bus_id) if ident.pci_bus_id else ""
        if not ident.parent_uuid:
            if pci:
                self.by_pci[pci] = ident
            if ident.minor is not None:
                self.by_minor[ident.minor] = ident
            if ident.vendor is Vendor.NVIDIA:
                self.by_index[ident.index] = ident
        else:
            self.mig_by_parent_index[(ident.parent_uuid, ident.index)] = ident
            if ident.gi_profile_id is not None and ident.placement_start is not None:
                self.by_mig[(ident.parent_uuid, ident.gi_profile_id, ident.placement_start)] = ident
        if ident.card_index is not None and ident.render_index is not None:
            self.by_amd[(pci, ident.card_index, ident.render_index)] = ident
            self.by_card_render[(ident.card_index, ident.render_index)] = ident

    def __len__(self) -> int:
        return len(self.by_uuid)


# --------------------------------------------------------------------------- helpers


def _from_identity(ident: DeviceIdentity, method: str, profile_hint: str = "") -> Resolution:
    return Resolution(
        uuid=ident.uuid,
        parent_uuid=ident.parent_uuid,
        mig_profile=ident.mig_profile or (profile_hint if ident.parent_uuid else ""),
        method=method,
        ok=True,
    )


def _as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _data_value(data: dict[str, Any], name: str) -> str:
    """A value from claim status data, either ``{"uuid": "x"}`` or ``{"uuid": {"string": "x"}}``."""
    value = data.get(name) if isinstance(data, dict) else None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for field_name in ("string", "version"):
            field_value = value.get(field_name)
            if isinstance(field_value, str):
                return field_value
    return ""


def _by_uuid(uuid: str, index: DeviceIndex, method: str, profile_hint: str = "") -> Resolution | None:
    ident = index.by_uuid.get(uuid) if uuid else None
    return _from_identity(ident, method, profile_hint) if ident else None


def _by_pci(pci: str, index: DeviceIndex, method: str) -> Resolution | None:
    ident = index.by_pci.get(normalize_pci_bus_id(pci)) if pci else None
    return _from_identity(ident, method) if ident else None


def _nvidia_mig(name: str, parent_hint: str, profile_hint: str, index: DeviceIndex, method: str) -> Resolution | None:
    mig = parse_mig_name(name)
    if mig is None:
        return None
    parent = parent_hint if parent_hint in index.by_uuid else ""
    if not parent:
        ident = index.by_minor.get(mig.minor)
        parent = ident.uuid if ident else ""
    if not parent:
        return None
    inst = index.by_mig.get((parent, mig.gi_profile_id, mig.placement_start))
    if inst is not None:
        return _from_identity(inst, method, profile_hint)
    # The MIG instance does not exist (yet): a DynamicMIG device before Prepare, or a layout
    # change the backend has not rescanned. Attribute to the GPU the slot lives on.
    return Resolution(uuid=parent, parent_uuid=parent, mig_profile=profile_hint, method="dynamic-mig-parent", ok=True)


def _amd_card_render(name: str, dev: SliceDevice | None) -> tuple[int, int] | None:
    if dev is not None:
        card, render = _as_int(dev.attr("cardIndex")), _as_int(dev.attr("renderIndex"))
        if card is not None and render is not None:
            return card, render
    m = _AMD_CARD_RENDER_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _amd(name: str, dev: SliceDevice | None, pci: str, index: DeviceIndex, prefix: str) -> Resolution | None:
    cr = _amd_card_render(name, dev)
    if cr is not None:
        if pci:
            ident = index.by_amd.get((normalize_pci_bus_id(pci), cr[0], cr[1]))
            if ident is not None:
                return _from_identity(ident, f"{prefix}pci-card-render")
        ident = index.by_card_render.get(cr)
        # without a BDF on either side the card/render pair is the only key there is
        if ident is not None and (not pci or not ident.pci_bus_id):
            return _from_identity(ident, f"{prefix}card-render")
    is_partition = dev is not None and dev.attr("type") == "amdgpu-partition"
    if pci and not is_partition:
        return _by_pci(pci, index, f"{prefix}pci")
    return None


# --------------------------------------------------------------------------- DRA


def _resolve_slice(driver: str, name: str, dev: SliceDevice, index: DeviceIndex) -> Resolution | None:
    uuid = _as_str(dev.attr("uuid"))
    std_pci = _as_str(dev.attr(PCI_BUS_ID_ATTR))
    if driver == NVIDIA_DRIVER:
        parent_hint = _as_str(dev.attr("parentUUID"))
        profile = _as_str(dev.attr("profile"))
        pci = std_pci or _as_str(dev.attr("pcieBusID"))
        minor = _as_int(dev.attr("minor"))
        return (
            _by_uuid(uuid, index, "uuid", profile)
            or _nvidia_mig(name, parent_hint, profile, index, "mig-placement")
            # a MIG device must never fall through to its parent's BDF as if it were the GPU
            or (None if parent_hint or parse_mig_name(name) else _by_pci(pci, index, "pci"))
            or (None if parent_hint or minor is None else _minor(minor, index, "minor"))
            or (_by_uuid(parent_hint, index, "dynamic-mig-parent") and _parent_only(parent_hint, profile))
            or _not_local(uuid)
        )
    if driver == AMD_DRIVER:
        pci = std_pci or _as_str(dev.attr("pciAddr")) or _as_str(dev.attr("parentPciAddr"))
        return _amd(name, dev, pci, index, "") or _by_uuid(uuid, index, "uuid")
    return _by_uuid(uuid, index, "uuid") or _by_pci(std_pci, index, "pci") or _not_local(uuid)


def _parent_only(parent: str, profile: str) -> Resolution:
    return Resolution(uuid=parent, parent_uuid=parent, mig_profile=profile, method="dynamic-mig-parent", ok=True)


def _minor(minor: int, index: DeviceIndex, method: str) -> Resolution | None:
    ident = index.by_minor.get(minor)
    return _from_identity(ident, method) if ident else None


def _not_local(uuid: str) -> Resolution | None:
    return Resolution(uuid=uuid, method="uuid-not-local", ok=False) if uuid else None


def _resolve_claim_data(allocated: AllocatedDevice, index: DeviceIndex) -> Resolution | None:
    data = allocated.data or {}
    uuid = _data_value(data, "uuid")
    pci = _data_value(data, "pciBusID") or _data_value(data, PCI_BUS_ID_ATTR)
    return _by_uuid(uuid, index, "claim-data-uuid") or _by_pci(pci, index, "claim-data-pci")


def _resolve_name(driver: str, name: str, index: DeviceIndex) -> Resolution | None:
    if driver == NVIDIA_DRIVER:
        m = _NVIDIA_GPU_RE.match(name)
        if m:
            return _minor(int(m.group(1)), index, "name-minor")
        return _nvidia_mig(name, "", "", index, "name-mig")
    if driver == AMD_DRIVER:
        return _amd(name, None, "", index, "name-")
    return None


def resolve(
    key: tuple[str, str, str],
    slice_dev: SliceDevice | None,
    allocated: AllocatedDevice | None,
    index: DeviceIndex,
) -> Resolution:
    """Map one DRA device to a local device. Never raises; see the module docstring."""
    driver, _pool, name = key
    not_local: Resolution | None = None
    if slice_dev is not None:
        res = _resolve_slice(driver, name, slice_dev, index)
        if res is not None and res.ok:
            return res
        not_local = res
    if allocated is not None:
        res = _resolve_claim_data(allocated, index)
        if res is not None:
            return res
    if not_local is None:
        # Name heuristics only when the slice named no device of its own: a slice that says
        # "uuid X" about gpu-0 must not be pinned on whatever local GPU has minor 0.
        res = _resolve_name(driver, name, index)
        if res is not None:
            return res
    return not_local or UNRESOLVED


# --------------------------------------------------------------------------- device plugins


def resolve_device_plugin(resource_name: str, device_id: str, index: DeviceIndex) -> Resolution:
    """Map a device-plugin allocation (PodResources ``devices``) to a local device.

    * ``nvidia.com/gpu``: the GPU UUID; time-slicing/MPS replicas append ``::<n>``; with
      ``deviceIDStrategy=index`` the id is the NVML index.
    * ``nvidia.com/mig-<profile>``: the MIG UUID; with the index strategy ``<gpu>:<mig>``.
    * ``amd.com/gpu``: a UUID or a PCI bus id.
    * anything else: by uuid, then by PCI bus id.
    """
    dev_id = _TIME_SLICED_SUFFIX_RE.sub("", (device_id or "").strip())
    if not dev_id:
        return UNRESOLVED
    res = _by_uuid(dev_id, index, "device-plugin-uuid")
    if res is not None:
        return res
    if resource_name.startswith("nvidia.com/"):
        parts = dev_id.split(":")
        if all(p.isdigit() for p in parts) and len(parts) in (1, 2):
            gpu = index.by_index.get(int(parts[0]))
            if gpu is not None and len(parts) == 1:
                return _from_identity(gpu, "device-plugin-index")
            if gpu is not None:
                mig = index.mig_by_parent_index.get((gpu.uuid, int(parts[1])))
                if mig is not None:
                    return _from_identity(mig, "device-plugin-index")
            return UNRESOLVED
    res = _by_pci(dev_id, index, "device-plugin-pci") if ":" in dev_id else None
    return res or UNRESOLVED
