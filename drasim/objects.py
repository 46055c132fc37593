"""A scenario as the cluster would publish it: Node, ResourceSlice, ResourceClaims, Pods, and
the kubelet's PodResources view. Shapes follow resource.k8s.io/v1 and the NVIDIA DRA driver
(device names gpu-<minor> and gpu-<minor>-mig-<profile>-<giProfileId>-<start>; pool = node).

A pod with DRA-backed extended resources (KEP-5004, GA in 1.37) looks as a 1.37 cluster shows
it: the container asks for ``nvidia.com/gpu`` in its resources; the scheduler's generated claim
``<pod>-extended-resources-<5 characters>`` (annotated ``resource.kubernetes.io/extended-resource-claim``,
owned by the pod, one request ``container-<i>-request-<j>`` per container and resource) holds the
devices; the pod's ``status.extendedResourceClaimStatus`` maps each container's resource to its
request; and the kubelet reports the generated claim among the container's dynamic resources
(``GetContainerClaimInfos`` adds it for every container its request mappings name).
"""

from __future__ import annotations

import hashlib
import uuid as uuidlib
from typing import Any

from exporter.kubelet import api_pb2

from . import kubelet as kb
from .scenario import DRIVER, ClaimSpec, ContainerSpec, GpuSpec, MigSpec, PodSpec, Scenario

_NS = uuidlib.UUID("0e4d7f6a-9a51-4bfa-8d2e-3c5b9e0f1a22")


def pod_uid(p: PodSpec) -> str:
    return str(uuidlib.uuid5(_NS, f"{p.namespace}/{p.name}"))


# what the API server's name generator appends to a generateName (k8s.io/apiserver/pkg/storage/names)
_GENERATED_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATE_BASE = 58  # 63 - 5: longer bases are cut, as the generator does


def extended_claim_name(p: PodSpec) -> str:
    """The name of the claim the scheduler generates for a pod's extended resources:
    generateName ``<pod>-extended-resources-`` (cut to 58 characters) plus five characters,
    stable per pod here (the real ones are random)."""
    base = f"{p.name}-extended-resources-"[:_MAX_GENERATE_BASE]
    digest = hashlib.sha256(f"{p.namespace}/{p.name}".encode()).digest()
    return base + "".join(_GENERATED_ALPHABET[b % len(_GENERATED_ALPHABET)] for b in digest[:5])


def _ordered_containers(p: PodSpec) -> list[ContainerSpec]:
    """The pod's containers in the API's order: init containers (the sidecars), then the others.
    A container's index here is the ``container-<i>`` of its extended-resource requests."""
    return [ct for ct in p.containers if ct.restartable_init] + [ct for ct in p.containers if not ct.restartable_init]


def _container_resources(ct: ContainerSpec) -> dict[str, str]:
    limits: dict[str, str] = {}
    for res, _ in (*ct.device_plugin, *ct.extended):
        limits[res] = str(int(limits.get(res, "0")) + 1)
    return limits


def _extended_requests(p: PodSpec) -> list[tuple[ContainerSpec, str, str, list[str]]]:
    """(container, resource, request name, device refs) of the pod's extended resources. The
    request is ``container-<index>-request-<index of the resource among the container's sorted
    resource names>``, as kube-scheduler names it."""
    out = []
    for i, ct in enumerate(_ordered_containers(p)):
        names = sorted(_container_resources(ct))
        by_res: dict[str, list[str]] = {}
        for res, ref in ct.extended:
            by_res.setdefault(res, []).append(ref)
        for res, refs in sorted(by_res.items()):
            out.append((ct, res, f"container-{i}-request-{names.index(res)}", refs))
    return out


def _semver(v: str) -> str:
    """NVIDIA driver versions have leading zeros (580.95.05); semver forbids them."""
    # isascii: "²".isdigit() is True but int("²") raises
    return ".".join(str(int(x)) for x in v.split(".") if x.isascii() and x.isdigit()) or "0.0.0"


def device_name(sc: Scenario, ref: str) -> str:
    parts = ref.split(":")
    g = sc.gpu(parts[0])
    if len(parts) == 1:
        return g.device_name
    m = next(m for m in g.mig if m.profile == parts[1] and str(m.placement_start) == parts[2])
    return g.mig_device_name(m)


def device_uuid(sc: Scenario, ref: str) -> str:
    parts = ref.split(":")
    g = sc.gpu(parts[0])
    if len(parts) == 1:
        return g.uuid
    return next(m.uuid for m in g.mig if m.profile == parts[1] and str(m.placement_start) == parts[2])


def _common_attrs(sc: Scenario, g: GpuSpec) -> dict[str, Any]:
    return {
        "productName": {"string": g.model[:64]},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"},
        "driverVersion": {"version": _semver(sc.driver_version)},
        "cudaComputeCapability": {"version": "9.0.0"},
        "resource.kubernetes.io/pciBusID": {"string": g.pci_bus_id},
    }


def _gpu_device(sc: Scenario, g: GpuSpec) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": g.device_name,
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": g.uuid}, **_common_attrs(sc, g)},
        "capacity": {"memory": {"value": str(g.memory_bytes)}},
    }
    if g.consumable_shares:
        # NVIDIA's ConsumableShares in memory mode (cmd/gpu-kubelet-plugin/consumable_shares.go):
        # several allocations, memory consumed in 1 Mi steps, a claim that asks for none takes it all
        dev["allowMultipleAllocations"] = True
        whole = _quantity(g.memory_bytes)
        dev["capacity"]["memory"]["requestPolicy"] = {
            "default": whole, "validRange": {"min": "1Mi", "max": whole, "step": "1Mi"}}
    return dev


def share_id(sc: Scenario, c: ClaimSpec, ref: str) -> str | None:
    """The shareID the scheduler gives a claim's allocation of a consumable-shares GPU (a UID;
    stable here), which the kubelet reports too; None for a device allocated whole."""
    if ":" in ref or not sc.gpu(ref).consumable_shares:
        return None
    return str(uuidlib.uuid5(_NS, f"share/{c.namespace}/{c.name}/{ref}"))


def _result(sc: Scenario, c: ClaimSpec, ref: str) -> dict[str, Any]:
    """One allocation result of a scenario claim; on a consumable-shares GPU with its shareID and
    the memory it consumed (the claim's, else the request policy's default: the whole GPU)."""
    out: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": sc.node, "device": device_name(sc, ref)}
    share = share_id(sc, c, ref)
    if share is not None:
        memory = c.memory if c.memory is not None else sc.gpu(ref).memory_bytes
        out.update(shareID=share, consumedCapacity={"memory": _quantity(memory)})
    return out


def _quantity(size: int) -> str:
    """Bytes as the API writes a Quantity: 20Gi rather than 21474836480."""
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20)):
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def _mig_device(sc: Scenario, g: GpuSpec, m: MigSpec) -> dict[str, Any]:
    return {
        "name": g.mig_device_name(m),
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": m.uuid},
            "parentUUID": {"string": g.uuid},
            "profile": {"string": m.profile},
            **_common_attrs(sc, g),
        },
        "capacity": {"memory": {"value": str(m.memory_bytes)}},
    }


AGENT_NAMESPACE = "dra-gpu-exporter"  # the agent's namespace when POD_NAMESPACE is unset


def agent_namespace_objects(namespace: str = AGENT_NAMESPACE) -> list[dict[str, Any]]:
    """What the installer (the Helm chart) creates besides the DaemonSet and that the agent
    reads: its namespace and the cluster budget ConfigMap, with the chart's default capacity
    (nothing stated: each agent's ``--taint-budget-max`` applies)."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "dra-gpu-exporter-budget", "namespace": namespace},
            "data": {"max_domains": "0", "fraction": "0.05", "cluster_gpus": "0"},
        },
    ]


def node(sc: Scenario) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": sc.node, "labels": {"kubernetes.io/hostname": sc.node, "nvidia.com/gpu.present": "true"}},
        "spec": {},
        "status": {},
    }


def resource_slice(sc: Scenario) -> dict[str, Any]:
    devices: list[dict[str, Any]] = []
    for g in sc.gpus:
        if not g.published:
            continue
        mine = [_mig_device(sc, g, m) for m in g.mig] if g.mig else [_gpu_device(sc, g)]
        for d in mine:
            if g.taints:  # NVIDIA's driver leaves timeAdded to the API server
                d["taints"] = [{"key": k, "value": v, "effect": e} for k, v, e in g.taints]
        devices.extend(mine)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{sc.node}-{DRIVER}-0"},
        "spec": {
            "driver": DRIVER,
            "nodeName": sc.node,
            "pool": {"name": sc.node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def resource_claims(sc: Scenario, pods: list[PodSpec]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for c in sc.claims:
        holders = [p for p in pods if p.namespace == c.namespace and any(c.name in ct.claims for ct in p.containers)]
        exactly: dict[str, Any] = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": len(c.devices)}
        if c.memory is not None:
            exactly["capacity"] = {"requests": {"memory": _quantity(c.memory)}}
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": c.name, "namespace": c.namespace},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
                "status": {
                    "allocation": {"devices": {"results": [_result(sc, c, ref) for ref in c.devices]}},
                    "reservedFor": [{"resource": "pods", "name": p.name, "uid": pod_uid(p)} for p in holders],
                },
            }
        )
    for p in pods:
        reqs = _extended_requests(p)
        if not reqs:
            continue
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": extended_claim_name(p),
                    "namespace": p.namespace,
                    "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": p.name, "uid": pod_uid(p),
                                         "controller": True, "blockOwnerDeletion": True}],
                },
                "spec": {"devices": {"requests": [
                    {"name": req,
                     "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
                                 "count": len(refs)}}
                    for _ct, _res, req, refs in reqs
                ]}},
                "status": {
                    "allocation": {"devices": {"results": [
                        {"request": req, "driver": DRIVER, "pool": sc.node,
                         "device": device_name(sc, ref)} for _ct, _res, req, refs in reqs for ref in refs
                    ]}},
                    "reservedFor": [{"resource": "pods", "name": p.name, "uid": pod_uid(p)}],
                },
            }
        )
    return out


def pod_object(sc: Scenario, p: PodSpec) -> dict[str, Any]:
    claims = sorted({cn for ct in p.containers for cn in ct.claims})

    def container(ct: ContainerSpec) -> dict[str, Any]:
        d: dict[str, Any] = {"name": ct.name, "image": "registry.example/sim:1"}
        if ct.claims:
            d["resources"] = {"claims": [{"name": cn} for cn in ct.claims]}
        limits = _container_resources(ct)
        if limits:
            d.setdefault("resources", {})["limits"] = limits
        if ct.restartable_init:
            d["restartPolicy"] = "Always"
        return d

    spec: dict[str, Any] = {
        "nodeName": sc.node,
        "containers": [container(ct) for ct in p.containers if not ct.restartable_init],
    }
    inits = [container(ct) for ct in p.containers if ct.restartable_init]
    if inits:
        spec["initContainers"] = inits
    if claims:
        spec["resourceClaims"] = [{"name": cn, "resourceClaimName": cn} for cn in claims]
    status: dict[str, Any] = {"phase": "Running"}
    ext = _extended_requests(p)
    if ext:
        status["extendedResourceClaimStatus"] = {
            "resourceClaimName": extended_claim_name(p),
            "requestMappings": [{"containerName": ct.name, "resourceName": res,
                                 "requestName": req} for ct, res, req, _refs in ext],
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": p.name, "namespace": p.namespace, "uid": pod_uid(p), "labels": dict(p.labels)},
        "spec": spec,
        "status": status,
    }


def pod_with_reported_health(
    sc: Scenario, p: PodSpec, health: dict[str, str], cdi: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The pod as the kubelet updates its status when the driver streams device health (KEP-4680):
    ``health`` maps a scenario device ref to Healthy|Unhealthy|Unknown. Per container and claim one
    ``allocatedResourcesStatus`` entry named ``claim:<pod's claim name>``, its ``resourceID`` the
    device's first CDI id where ``cdi`` gives one, else ``<driver>/<pool>/<device>``; an id the
    claim's devices share is listed once (kubelet pkg/kubelet/cm/dra/manager.go)."""
    obj = pod_object(sc, p)
    statuses = []
    for ct in p.containers:
        if ct.restartable_init:
            continue
        entries = []
        for cn in ct.claims:
            c = next(c for c in sc.claims if c.namespace == p.namespace and c.name == cn)
            ids = {(cdi or {}).get(ref) or f"{DRIVER}/{sc.node}/{device_name(sc, ref)}": health[ref]
                   for ref in reversed(c.devices) if ref in health}  # (reversed: a shared id keeps the first's)
            if ids:
                resources = [{"resourceID": i, "health": h} for i, h in reversed(ids.items())]
                entries.append({"name": f"claim:{cn}", "resources": resources})
        st: dict[str, Any] = {"name": ct.name, "ready": True, "restartCount": 0, "image": "registry.example/sim:1",
                              "imageID": "", "started": True, "state": {"running": {}}}
        if entries:
            st["allocatedResourcesStatus"] = entries
        statuses.append(st)
    obj["status"]["containerStatuses"] = statuses
    return obj


def kubelet_pods(sc: Scenario, pods: list[PodSpec]) -> list[api_pb2.PodResources]:
    """The PodResources answer for these pods: what the kubelet's List returns."""
    out = []
    for p in pods:
        containers = []
        for ct in p.containers:
            devices = [(res, [device_uuid(sc, ref)]) for res, ref in ct.device_plugin]
            claims = []
            for cn in ct.claims:
                c = next(c for c in sc.claims if c.namespace == p.namespace and c.name == cn)
                held = [(DRIVER, sc.node, device_name(sc, ref), share_id(sc, c, ref)) for ref in c.devices]
                claims.append(kb.claim(p.namespace, cn, held))
            if ct.extended:
                # the generated claim, as GetContainerClaimInfos reports it for a container its
                # request mappings name: all of the claim's devices, like any claim's
                every = [ref for c2 in p.containers for _res, ref in c2.extended]
                claims.append(kb.claim(p.namespace, extended_claim_name(p),
                                       [(DRIVER, sc.node, device_name(sc, ref), None) for ref in every]))
            containers.append(kb.container(ct.name, devices=devices, claims=claims))
        out.append(kb.pod(p.namespace, p.name, containers))
    return out
