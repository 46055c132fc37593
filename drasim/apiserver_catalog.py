"""Which API groups, versions and resources the fake API server serves, per Kubernetes release.

The tables follow the versions each release serves (k8s.io/api's resource packages,
https://github.com/kubernetes/api/tree/master/resource, and the DRADeviceTaints /
DRADeviceTaintRules gates in https://github.com/kubernetes/kubernetes/blob/master/pkg/features/kube_features.go,
KEP-5055): resource.k8s.io moved
from v1beta1 (1.32) to v1beta2 (1.33) to v1 (1.34), while DeviceTaintRule stayed alpha (v1alpha3)
until 1.35, became v1beta2 in 1.36 and v1 in 1.37. A release "has" more versions than it serves
by default (betas need --runtime-config); callers can serve any version the release has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Kubernetes releases this emulation knows (minor numbers of 1.x).
SUPPORTED_RELEASES = (32, 33, 34, 35, 36, 37)

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

# Priority order a real server uses for a group's versions (GA > beta > alpha, newer first).
_VERSION_PRIORITY = ("v1", "v1beta2", "v1beta1", "v1alpha3")


@dataclass(frozen=True)
class ResourceType:
    """One (group, resource) with one storage representation, whatever version it is read in."""

    group: str  # "" for the core group
    resource: str  # plural, lower case: "resourceslices"
    kind: str
    singular: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    # With a status subresource, writes to the main resource keep the stored status and
    # writes to /status change only the status (as the real registry strategies do).
    status_subresource: bool = False
    # Whether create discards a client-supplied status (pods, claims, rules); nodes keep it.
    reset_status_on_create: bool = False
    # Whether metadata.generation is maintained (bumped when anything but metadata/status changes).
    has_generation: bool = True

    @property
    def qualified(self) -> str:
        """The name real error messages use: "resourceslices.resource.k8s.io", or "pods"."""
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.resource)


@dataclass(frozen=True)
class GroupVersion:
    group: str
    version: str
    resources: tuple[ResourceType, ...] = field(default=())

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def find(self, resource: str) -> ResourceType | None:
        for rt in self.resources:
            if rt.resource == resource:
                return rt
        return None


def parse_release(version: str | int) -> int:
    """'1.34', 'v1.34.2', '34' or 34 -> 34."""
    text = str(version).strip().lstrip("v")
    parts = text.split(".")
    minor = parts[1] if len(parts) >= 2 else parts[0]
    try:
        value = int(minor)
    except ValueError:
        raise ValueError(f"not a Kubernetes version: {version!r}") from None
    if value not in SUPPORTED_RELEASES:
        raise ValueError(
            f"Kubernetes 1.{value} is not emulated; choose one of "
            + ", ".join(f"1.{r}" for r in SUPPORTED_RELEASES)
        )
    return value


def _core_types() -> tuple[ResourceType, ...]:
    return (
        ResourceType("", "namespaces", "Namespace", "namespace", False, ("ns",),
                     status_subresource=True, has_generation=False),
        ResourceType("", "nodes", "Node", "node", False, ("no",),
                     status_subresource=True, has_generation=False),
        ResourceType("", "pods", "Pod", "pod", True, ("po",),
                     status_subresource=True, reset_status_on_create=True),
        ResourceType("", "events", "Event", "event", True, ("ev",), has_generation=False),
        # the agent's budget object and per-node state (issues 13, 16)
        ResourceType("", "configmaps", "ConfigMap", "configmap", True, ("cm",), has_generation=False),
    )


def _dra_types(release: int, version: str) -> tuple[ResourceType, ...]:
    """resource.k8s.io resources that exist in `version` in release 1.`release`."""
    g = "resource.k8s.io"
    slices = ResourceType(g, "resourceslices", "ResourceSlice", "resourceslice", False)
    claims = ResourceType(g, "resourceclaims", "ResourceClaim", "resourceclaim", True,
                          status_subresource=True, reset_status_on_create=True)
    templates = ResourceType(g, "resourceclaimtemplates", "ResourceClaimTemplate",
                             "resourceclaimtemplate", True)
    classes = ResourceType(g, "deviceclasses", "DeviceClass", "deviceclass", False)
    # DeviceTaintRule got a status (and the /status subresource) in 1.35.
    rules = ResourceType(g, "devicetaintrules", "DeviceTaintRule", "devicetaintrule", False,
                         status_subresource=release >= 35, reset_status_on_create=release >= 35)
    dra_core = (slices, claims, templates, classes)
    out: list[ResourceType] = []
    if version == "v1beta1" and release >= 32:
        out += dra_core
    if version == "v1beta2" and release >= 33:
        out += dra_core
        if release >= 36:
            out.append(rules)
    if version == "v1" and release >= 34:
        out += dra_core
        if release >= 37:
            out.append(rules)
    if version == "v1alpha3" and release >= 33:
        out.append(rules)
    return tuple(out)


def available_group_versions(release: int) -> list[GroupVersion]:
    """Every group/version the release has (served or not), in discovery order."""
    gvs = [
        GroupVersion("", "v1", _core_types()),
        GroupVersion("events.k8s.io", "v1",
                     (ResourceType("events.k8s.io", "events", "Event", "event", True, ("ev",),
                                   has_generation=False),)),
        GroupVersion("coordination.k8s.io", "v1",
                     (ResourceType("coordination.k8s.io", "leases", "Lease", "lease", True,
                                   has_generation=False),)),
    ]
    for version in _VERSION_PRIORITY:
        types = _dra_types(release, version)
        if types:
            gvs.append(GroupVersion("resource.k8s.io", version, types))
    return gvs


def default_served(release: int) -> set[str]:
    """Group/versions served by default.

    Real clusters before 1.34 need betas switched on for DRA at all; we serve them anyway
    because emulating 1.32/1.33 is only useful with DRA on. DeviceTaintRule is served in the
    version the anchors name for each release (v1alpha3 up to 1.35, v1beta2 in 1.36, v1 plus
    the still-served v1beta2 in 1.37).
    """
    served = {"v1", "events.k8s.io/v1", "coordination.k8s.io/v1"}
    r = "resource.k8s.io/"
    if release == 32:
        served |= {r + "v1beta1"}
    elif release == 33:
        served |= {r + "v1beta1", r + "v1beta2", r + "v1alpha3"}
    elif release in (34, 35):
        served |= {r + "v1", r + "v1alpha3"}
    elif release == 36:
        served |= {r + "v1", r + "v1beta2"}
    else:
        served |= {r + "v1", r + "v1beta2"}
    return served


def served_group_versions(release: int, served: set[str] | None = None) -> list[GroupVersion]:
    """The served group/versions; in 1.36 v1beta2 serves only DeviceTaintRule by default.

    `served` entries are "group/version" ("v1" for core). A version the release does not
    have is an error, so a test cannot accidentally emulate an impossible cluster.
    """
    available = {gv.group_version: gv for gv in available_group_versions(release)}
    wanted = set(served) if served is not None else default_served(release)
    unknown = wanted - set(available)
    if unknown:
        raise ValueError(f"Kubernetes 1.{release} has no API version(s) {sorted(unknown)}")
    out: list[GroupVersion] = []
    for gv_name, gv in available.items():
        if gv_name not in wanted:
            continue
        if served is None and gv.group == "resource.k8s.io" and gv.version == "v1beta2" and release >= 36:
            # By default the newer releases serve v1beta2 only for the rule (betas are off,
            # but DeviceTaintRule's beta is the point of enabling it).
            gv = GroupVersion(gv.group, gv.version,
                              tuple(rt for rt in gv.resources if rt.resource == "devicetaintrules"))
        out.append(gv)
    # Core first, then the groups in the order they first appear (like /apis).
    return out


def version_priority(version: str) -> int:
    try:
        return _VERSION_PRIORITY.index(version)
    except ValueError:
        return len(_VERSION_PRIORITY)


# ---------------------------------------------------------------- discovery documents


def api_resource_list(gv: GroupVersion) -> dict[str, Any]:
    resources: list[dict[str, Any]] = []
    for rt in gv.resources:
        entry = {
            "name": rt.resource,
            "singularName": rt.singular,
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": list(ALL_VERBS),
        }
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        resources.append(entry)
        if rt.status_subresource:
            resources.append({
                "name": f"{rt.resource}/status",
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": ["get", "patch", "update"],
            })
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv.group_version,
            "resources": resources}


def api_group(group: str, gvs: list[GroupVersion]) -> dict[str, Any]:
    versions = sorted((gv for gv in gvs if gv.group == group), key=lambda gv: version_priority(gv.version))
    entries = [{"groupVersion": gv.group_version, "version": gv.version} for gv in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
            "preferredVersion": entries[0]}


def api_group_list(gvs: list[GroupVersion]) -> dict[str, Any]:
    groups: list[str] = []
    for gv in gvs:
        if gv.group and gv.group not in groups:
            groups.append(gv.group)
    body = [api_group(g, gvs) for g in groups]
    for entry in body:
        del entry["kind"], entry["apiVersion"]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": body}
