"""A scenario as the cluster would publish it: Node, ResourceSlice, ResourceClaims, Pods, and
the kubelet's PodResources view. Shapes follow resource.k8s.io/v1 and the NVIDIA DRA driver
(device names gpu-<minor> and gpu-<minor>-mig-<profile>-<giProfileId>-<start>; pool = node)."""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

from exporter.kubelet import api_pb2

from . import kubelet as kb
from .scenario import DRIVER, ContainerSpec, GpuSpec, MigSpec, PodSpec, Scenario

_NS = uuidlib.UUID("0e4d7f6a-9a51-4bfa-8d2e-3c5b9e0f1a22")


def pod_uid(p: PodSpec) -> str:
    return str(uuidlib.uuid5(_NS, f"{p.namespace}/{p.name}"))


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
    return {
        "name": g.device_name,
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": g.uuid}, **_common_attrs(sc, g)},
        "capacity": {"memory": {"value": str(g.memory_bytes)}},
    }


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
        if g.mig:
            devices.extend(_mig_device(sc, g, m) for m in g.mig)
        else:
            devices.append(_gpu_device(sc, g))
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
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": c.name, "namespace": c.namespace},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": len(c.devices)}}]}},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {"request": "gpu", "driver": DRIVER, "pool": sc.node, "device": device_name(sc, ref)} for ref in c.devices
                            ]
                        }
                    },
                    "reservedFor": [{"resource": "pods", "name": p.name, "uid": pod_uid(p)} for p in holders],
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
        limits: dict[str, str] = {}
        for res, _ in ct.device_plugin:
            limits[res] = str(int(limits.get(res, "0")) + 1)
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
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": p.name, "namespace": p.namespace, "uid": pod_uid(p), "labels": dict(p.labels)},
        "spec": spec,
        "status": {"phase": "Running"},
    }


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
                claims.append(kb.claim(p.namespace, cn, [(DRIVER, sc.node, device_name(sc, ref), None) for ref in c.devices]))
            containers.append(kb.container(ct.name, devices=devices, claims=claims))
        out.append(kb.pod(p.namespace, p.name, containers))
    return out
