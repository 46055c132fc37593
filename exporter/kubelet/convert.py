"""Turn a PodResources List response into a PodResourcesSnapshot (pure, no I/O).

One ContainerAllocation per (pod, container, device):
- device-plugin allocations: every id in `devices[].device_ids` is one row, tagged with the
  plugin's resource name (nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu, ...);
- DRA allocations: every `dynamic_resources[].claim_resources[]` entry is one row, keyed by
  (driver, pool, device) and carrying the claim that holds it.

`cdi_devices` is ignored on purpose: the kubelet appends CDI ids per driver, so the k-th
claim resource of a driver carries the CDI ids of devices 0..k and identifies nothing.
"""

from __future__ import annotations

import time

from exporter.kubelet import api_pb2
from exporter.kubelet.model import AllocationSource, ContainerAllocation, PodResourcesSnapshot

_PLUGIN, _DRA = AllocationSource.DEVICE_PLUGIN, AllocationSource.DRA


class DeadlinePassed(Exception):
    """The conversion ran past the deadline it was given."""


def to_snapshot(resp: api_pb2.ListPodResourcesResponse, deadline: float | None = None) -> PodResourcesSnapshot:
    """Flatten the response into de-duplicated allocation rows.

    Entries that name no device are skipped and counted in `skipped_entries`: claim
    resources from kubelets 1.27-1.30 (only CDI names, no driver/pool/device) and empty
    device-plugin ids. Exact duplicate rows (the same pod listed twice, a device id repeated)
    collapse to one, first occurrence first.

    ``deadline`` (time.monotonic()): checked before each pod; DeadlinePassed once it is past.
    """
    # dicts keep insertion order, so the output order follows the kubelet's order.
    rows: dict[ContainerAllocation, None] = {}
    pods: dict[tuple[str, str], None] = {}
    skipped = 0

    for pr in resp.pod_resources:
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlinePassed
        # Each string is read once and shared by the rows that repeat it: protobuf makes a
        # new str object at every read.
        ns, pod = pr.namespace, pr.name
        pods[(ns, pod)] = None
        # The kubelet lists regular containers and restartable init containers (sidecars)
        # side by side; a sidecar is an ordinary entry here and needs no special case.
        # Ordinary init containers are never listed.
        for ctr in pr.containers:
            cname = ctr.name
            for dev in ctr.devices:
                resource = dev.resource_name
                for device_id in dev.device_ids:
                    if not device_id:
                        skipped += 1
                        continue
                    rows[ContainerAllocation(namespace=ns, pod=pod, container=cname, source=_PLUGIN,
                                             resource_name=resource, device_id=device_id)] = None
            for dyn in ctr.dynamic_resources:
                claim_ns, claim_name = dyn.claim_namespace, dyn.claim_name
                for cr in dyn.claim_resources:
                    # The (driver, pool, device) triple is the device's identity in
                    # ResourceSlices; a partial triple cannot be joined to anything.
                    driver, pool, device = cr.driver_name, cr.pool_name, cr.device_name
                    if not (driver and pool and device):
                        skipped += 1
                        continue
                    rows[
                        ContainerAllocation(
                            namespace=ns,
                            pod=pod,
                            container=cname,
                            source=_DRA,
                            driver=driver,
                            pool=pool,
                            device=device,
                            claim_namespace=claim_ns,
                            claim_name=claim_name,
                            # proto3 `optional`: absent (not consumable capacity) vs set.
                            share_id=cr.share_id if cr.HasField("share_id") else "",
                        )
                    ] = None

    return PodResourcesSnapshot(
        allocations=tuple(rows),
        pods=tuple(pods),
        skipped_entries=skipped,
    )
