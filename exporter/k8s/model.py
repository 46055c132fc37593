"""DRA objects as the agent needs them, independent of the served API version.

The API server may serve resource.k8s.io v1, v1beta2 or v1beta1 (where device fields are
nested under ``basic``); parsers turn each into these types so nothing downstream cares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AttributeValue = str | int | bool


@dataclass(frozen=True)
class SliceDevice:
    driver: str
    pool: str
    name: str
    # Attribute names are fully qualified: a name without a domain belongs to the driver's
    # domain ("uuid" from gpu.nvidia.com becomes "gpu.nvidia.com/uuid"); standard ones keep
    # "resource.kubernetes.io/...". Values are plain Python scalars (version -> str).
    attributes: dict[str, AttributeValue] = field(default_factory=dict, hash=False, compare=False)
    capacity: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    slice_name: str = ""
    pool_generation: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    def attr(self, name: str) -> AttributeValue | None:
        """Look an attribute up by short name (driver domain) or by qualified name."""
        if "/" in name:
            return self.attributes.get(name)
        return self.attributes.get(f"{self.driver}/{name}")


@dataclass(frozen=True)
class AllocatedDevice:
    """One entry of a ResourceClaim's status.allocation.devices.results, with its status data."""

    request: str
    driver: str
    pool: str
    device: str
    share_id: str = ""
    admin_access: bool = False
    # status.devices[].data for this device, when the driver published any (may carry a uuid)
    data: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class ClaimInfo:
    namespace: str
    name: str
    uid: str = ""
    devices: tuple[AllocatedDevice, ...] = ()
    reserved_for: tuple[str, ...] = ()  # pod names holding the claim


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    node_name: str = ""
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    phase: str = ""  # status.phase (Pending, Running, Succeeded, Failed, Unknown)
    # names of the ResourceClaims (in the pod's namespace) the pod holds: spec references,
    # generated template claims from status.resourceClaimStatuses, the extended-resource claim
    claims: tuple[str, ...] = ()
