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
from ..kubelet.collector import KUBELET
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
