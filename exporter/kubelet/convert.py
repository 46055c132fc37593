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

from exporter.kubelet import api_pb2
from exporter.kubelet.model import AllocationSource, ContainerAllocation, PodResourcesSnapshot


def to_snapshot(resp: api_pb2.ListPodResourcesResponse) -> PodResourcesSnapshot:
    """Flatten the response into de-duplicated allocation rows.

    Entries that name no device are skipped and counted in `skipped_entries`: claim
    resources from kubelets 1.27-1.30 (only CDI names, no driver/pool/device) and empty
    device-plugin ids. Exact duplicate rows (the same pod listed twice, a device id repeated)
    collapse to one, first occurrence first.
    """
    # dicts keep insertion order, so the output order follows the kubelet's order.
    rows: dict[ContainerAllocation, None] = {}
    pods: dict[tuple[str, str], None] = {}
    skipped = 0

    for pr in resp.pod_resources:
        ns, pod = pr.namespace, pr.name
        pods[(ns, pod)] = None
        # The kubelet lists regular containers and restartable init containers (sidecars)
        # side by side; a sidecar is an ordinary entry here and needs no special case.
        # Ordinary init containers are never listed.
        for ctr in pr.containers:
            for dev in ctr.devices:
                for device_id in dev.device_ids:
                    if not device_id:
                        skipped += 1
                        continue
                    rows[
                        ContainerAllocation(
                            namespace=ns,
                            pod=pod,
                            container=ctr.name,
                            source=AllocationSource.DEVICE_PLUGIN,
                            resource_name=dev.resource_name,
                            device_id=device_id,
                        )
                    ] = None
            for dyn in ctr.dynamic_resources:
                for cr in dyn.claim_resources:
                    # The (driver, pool, device) triple is the device's identity in
                    # ResourceSlices; a partial triple cannot be joined to anything.
                    if not (cr.driver_name and cr.pool_name and cr.device_name):
                        skipped += 1
                        continue
                    rows[
                        ContainerAllocation(
                            namespace=ns,
                            pod=pod,
                            container=ctr.name,
                            source=AllocationSource.DRA,
                            driver=cr.driver_name,
                            pool=cr.pool_name,
                            device=cr.device_name,
                            claim_namespace=dyn.claim_namespace,
                            claim_name=dyn.claim_name,
                            # proto3 `optional`: absent (not consumable capacity) vs set.
                            share_id=cr.share_id if cr.HasField("share_id") else "",
                        )
                    ] = None

    return PodResourcesSnapshot(
        allocations=tuple(rows),
        pods=tuple(pods),
        skipped_entries=skipped,
    )
