"""From what one cycle's collectors found to the joined Snapshot.

The agent hands over the cycle's :class:`exporter.collect.Gathered`; this reads each source's
slot (devices, kubelet, slices, claims, pods) into the join's inputs. A source whose data the
model should use is read here; a source that only reports (its self-metrics, /readyz) needs
nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..collect import Gathered
from ..devices.collector import DEVICES
from ..devices.model import DeviceIdentity, DeviceReading
from ..health.model import DeviceHealth
from ..k8s.collectors import CLAIMS, PODS, SLICES
from ..k8s.podhealth import REPORTED
from ..k8s.resolve import DeviceIndex, resolve
from ..kubelet.collector import KUBELET
from ..kubelet.model import AllocationSource
from .join import JoinInputs, JoinMemo, join
from .lost import LostDevices
from .snapshot import ReportedDevice, Snapshot


class CycleJoin:
    """The devices of a cycle (enumerated, plus lost GPUs the slices publish), then the join,
    memoized while pods, claims and slices stand still."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lost = LostDevices()
        self._memo = JoinMemo()
        # (the kubelet's reports, the published devices, their rows): see _reported
        self._rep: tuple[object, object, tuple[ReportedDevice, ...]] | None = None

    def devices(self, found: Gathered) -> tuple[tuple[DeviceIdentity, ...], Mapping[str, DeviceReading]]:
        scan = found.get(DEVICES)
        identities, readings = (scan.identities, scan.readings) if scan is not None else ((), {})
        return self._lost.merge(identities, readings, found.get(SLICES), enumerated=found.fresh(DEVICES))

    def join(
        self,
        found: Gathered,
        timestamp: float,
        monotonic: float,
        identities: tuple[DeviceIdentity, ...],
        readings: Mapping[str, DeviceReading],
        health: Mapping[str, DeviceHealth],
    ) -> Snapshot:
        kubelet = found.get(KUBELET)
        pods = found.get(PODS) or ()
        snap = join(
            JoinInputs(
                node=self.node,
                timestamp=timestamp,
                monotonic=monotonic,
                identities=identities,
                readings=readings,
                health=health,
                allocations=kubelet.allocations if kubelet is not None else (),
                slices=found.get(SLICES),
                claims=found.get(CLAIMS) or {},
                pods=pods,
                pod_labels={(p.namespace, p.name): p.labels for p in pods},
            ),
            self._memo,
        )
        reported = found.get(REPORTED)
        return snap if reported is None else replace(snap, reported=self._reported(reported, snap))

    def _reported(self, reported: Mapping[tuple[str, str, str], str], snap: Snapshot) -> tuple[ReportedDevice, ...]:
        """The kubelet's health per device with the local device each resolves to; rebuilt when
        either the reports or the published devices are other objects than last cycle's."""
        if self._rep is None or self._rep[0] is not reported or self._rep[1] is not snap.published:
            uuids = {p.key: p.uuid for p in snap.published or ()}
            rows = tuple(ReportedDevice(*k, uuids.get(k, ""), h) for k, h in sorted(reported.items()))
            self._rep = (reported, snap.published, rows)
        return self._rep[2]


class NeededClaims:
    """The ResourceClaims the claims collector fetches (its ``wanted``): only those the join needs.

    The kubelet's answer names each claim's devices (driver, pool, device) and this node's
    ResourceSlices (watched) resolve them to local GPUs, so a claim is a fallback source, read
    only where something is missing: a device gone from the slices or not listed yet (the
    claim's ``status.devices[].data`` may still name it), a device the slice alone does not
    resolve here, and a device several claims share by consumable capacity (KEP-5075
    ``allowMultipleAllocations``: each claim's ``consumedCapacity`` splits it). Worked out again
    only when the allocations, the slices or the devices differ. With ``every`` (set by
    --kubelet-device-health, whose CDI ids are matched through each claim's allocation) every
    claim is read."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self._memo: tuple[tuple[object, ...], list[tuple[str, str]]] | None = None

    def __call__(self, found: Gathered) -> list[tuple[str, str]]:
        kubelet = found.get(KUBELET)
        if kubelet is None:
            return []
        slices, scan = found.get(SLICES), found.get(DEVICES)
        identities = scan.identities if scan is not None else ()
        key = (kubelet.allocations, slices, identities)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        index = DeviceIndex(identities)
        settled: dict[tuple[str, str, str], bool] = {}  # device -> resolved by the slices alone
        needed: set[tuple[str, str]] = set()
        for a in kubelet.allocations:
            if a.source != AllocationSource.DRA or not a.claim_name:
                continue
            device = (a.driver, a.pool, a.device)
            if device not in settled:
                dev = slices.get(device) if slices is not None else None
                settled[device] = (not self.every and dev is not None and not dev.multiple
                                   and resolve(device, dev, None, index).ok)
            if not settled[device]:
                needed.add((a.claim_namespace, a.claim_name))
        self._memo = (key, sorted(needed))
        return self._memo[1]
