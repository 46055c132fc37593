"""The kubelet's word on this node's DRA devices (KEP-4680), read from its pods, beside ours.

With ``--kubelet-device-health`` the agent watches this node's pods (:class:`PodWatcher`,
``fieldSelector=spec.nodeName=<node>`` like the kubelet's own pod watch; it then also serves
``--per-process`` and ``--pod-label-allowlist``) and reads each container's
``status.allocatedResourcesStatus``. An entry's ``resourceID`` is what the kubelet writes
(pkg/kubelet/cm/dra/manager.go, ``buildResourceHealth``): the device's first CDI id when its
driver returned any, else ``<driver>/<pool>/<device>``. The latter names the device; a CDI id
(``vendor/class=name``) names none, so it is matched only where the entry's claim request has one
device, never guessed: drivers may give a claim's devices one shared first CDI id (NVIDIA's
``k8s.gpu.nvidia.com/device=all``), which the kubelet lists once. docs/metrics.md says more.
Evidence to show beside the agent's verdict, never an input to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from ..collect import Collector, Degraded, Gathered, Slot, SourceStats
from .collectors import CLAIMS, watch_stats
from .connection import ApiClient
from .model import ClaimInfo, DeviceKey, PodInfo
from .parse import ParseError, parse_pod
from .watch import Reflector, _name_of

log = structlog.get_logger(__name__)

__all__ = ["REPORTED", "PodWatcher", "ReportedHealthCollector", "reported_health"]

HEALTH_RANK = {"Healthy": 0, "Unknown": 1, "Unhealthy": 2}

#: the kubelet's health per DRA device of this node; absent unless --kubelet-device-health
REPORTED: Slot[Mapping[DeviceKey, str]] = Slot("kubelet_health")


class PodWatcher(Reflector[PodInfo]):
    """List+watch of this node's pods (``fieldSelector=spec.nodeName=<node>``), keyed
    ``namespace/name``. Also a pod source for labels and per-process attribution (``list``).
    Finished pods are dropped: they hold no device, and the kubelet no longer updates their status
    (kubernetes#132978); a batch node's completed Jobs would otherwise be kept and walked."""

    kind = "pods"

    def __init__(self, client: ApiClient, node_name: str, **kw: Any) -> None:
        if not node_name:
            raise ValueError("PodWatcher needs a node name")
        selector = f"spec.nodeName={node_name}"
        super().__init__(client, group="", resource="pods", label=node_name, field_selector=selector, **kw)
        self.node_name = node_name
        self.version = 0  # counts changes: what depends on the pods is recomputed when it moves

    def list(self, force: bool = False) -> list[PodInfo]:
        return list(self.items().values())

    def _key_of(self, obj: Any) -> str:
        name = _name_of(obj)
        return f"{obj['metadata'].get('namespace', '')}/{name}" if name else ""

    def _parse(self, obj: Any, version: str) -> PodInfo | None:
        try:
            return parse_pod(obj, reported=True)
        except ParseError as exc:
            log.warning("pods_malformed", node=self.node_name, error=str(exc))
            return None

    def _keep(self, item: PodInfo) -> bool:
        return item.node_name in ("", self.node_name) and item.phase not in ("Succeeded", "Failed")

    def _recompute(self) -> None:
        self.version += 1


def _device_of(resource_id: str) -> DeviceKey | None:
    """``<driver>/<pool>/<device>``, or None for a CDI id (``vendor/class=name``)."""
    driver, _, rest = resource_id.partition("/")
    pool, _, device = rest.rpartition("/")
    return (driver, pool, device) if "=" not in resource_id and driver and pool and device else None


def _only_device(claim: ClaimInfo | None, request: str) -> DeviceKey | None:
    """The one device the claim's allocation gives the request (any request when ""), or None.
    The kubelet compares a device's request with the container's without a subrequest part."""
    if claim is None:
        return None
    base = request.partition("/")[0]
    found = {(d.driver, d.pool, d.device) for d in claim.devices if not base or d.request.partition("/")[0] == base}
    return found.pop() if len(found) == 1 else None


def reported_health(
    pods: Iterable[PodInfo], claims: Mapping[tuple[str, str], ClaimInfo],
) -> tuple[dict[DeviceKey, str], int]:
    """(device -> the worst health the kubelet reports for it, entries matched to no device)."""
    out: dict[DeviceKey, str] = {}
    unmatched = 0
    for pod in pods:
        for r in pod.reported:
            key = _device_of(r.resource_id) or _only_device(claims.get((pod.namespace, r.claim)), r.request)
            if key is None or r.health not in HEALTH_RANK:
                unmatched += 1
            elif HEALTH_RANK[r.health] >= HEALTH_RANK.get(out.get(key, "Healthy"), 0):
                out[key] = r.health
    return out, unmatched


class ReportedHealthCollector(Collector[Mapping[DeviceKey, str]]):
    """The kubelet's health per device, from the watched pods and the cycle's claims (runs
    after the claims collector). Owns the pod watch's life. No data before the first list."""

    FIRST_LIST_WAIT = 2.0  # seconds the first cycle waits for the initial list

    def __init__(self, watcher: PodWatcher, *, counted: bool = True) -> None:
        super().__init__(REPORTED)
        self.watcher = watcher
        self.counted = counted  # False: the pods collector shares the watch and counts its requests
        self.unmatched = 0  # entries of the last cycle matched to no device (see the module docstring)
        # (pod watch version, the claims mapping, the answer): a quiet node costs no pass over its pods
        self._last: tuple[int, object, dict[DeviceKey, str]] = (-1, None, {})

    def start(self) -> None:
        self.watcher.start()

    def await_first(self, deadline: float) -> None:
        self.watcher.wait_synced(max(0.0, min(deadline - time.monotonic(), self.FIRST_LIST_WAIT)))

    def collect(self, found: Gathered) -> Mapping[DeviceKey, str]:
        w = self.watcher
        if not w.synced:
            raise RuntimeError(f"Pods not listed yet{': ' + w.last_error if w.last_error else ''}")
        version, claims = w.version, found.get(CLAIMS) or {}
        if version != self._last[0] or claims is not self._last[1]:
            out, unmatched = reported_health(w.list(), claims)
            self._last = (version, claims, self._last[2] if out == self._last[2] else out)
            if unmatched != self.unmatched:
                log.info("kubelet_health_unmatched", node=w.node_name, entries=unmatched)
                self.unmatched = unmatched
        out = self._last[2]  # the same object while nothing moved (the join's memo compares identity)
        if w.last_error:
            raise Degraded(f"Pod watch: {w.last_error}", out)
        return out

    def stop(self) -> None:
        self.watcher.stop()

    def stats(self) -> SourceStats | None:
        return watch_stats(self.watcher.stats) if self.counted else None
