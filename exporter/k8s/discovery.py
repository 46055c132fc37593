"""Which resource.k8s.io versions the API server serves, and which one has a given resource.

Servers differ: 1.34+ serve v1 by default, 1.32/1.33 serve v1beta1/v1beta2 only when enabled,
1.31 has only v1alpha3; DeviceTaintRule exists in v1alpha3 (1.33-1.35), v1beta2 (1.36) and v1
(1.37) and may be switched off in any of them. So "the group is served at v1" does not mean
"v1 has devicetaintrules": :func:`resource_version_for` checks each version's APIResourceList.

Discovery answers change only on control-plane upgrades or runtime-config changes, so
:class:`Discovery` caches them and is refreshed explicitly (e.g. after a 404 on a resource that
was expected) or after ``ttl`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import structlog

from .connection import ApiClient, ApiError, get_json

log = structlog.get_logger(__name__)

__all__ = [
    "DEFAULT_PREFERENCE",
    "RESOURCE_GROUP",
    "Discovery",
    "pick_version",
    "resource_version_for",
    "resources_in",
    "served_versions",
]

RESOURCE_GROUP = "resource.k8s.io"
#: newest first; v1alpha3 last (1.31 only served that, with the v1beta1 device shape)
DEFAULT_PREFERENCE: tuple[str, ...] = ("v1", "v1beta2", "v1beta1", "v1alpha3")

_TIMEOUT = (5.0, 10.0)


def served_versions(client: ApiClient, group: str = RESOURCE_GROUP) -> list[str]:
    """The versions of ``group`` the server serves (server order); ``[]`` when the group is absent.

    Raises :class:`ApiError` for anything but 404 (outage, forbidden), so callers can tell
    "not served" from "could not ask".
    """
    try:
        doc = get_json(client, f"/apis/{group}", timeout=_TIMEOUT)
    except ApiError as exc:
        if exc.status == 404:
            return []
        raise
    out: list[str] = []
    versions = doc.get("versions")
    for entry in versions if isinstance(versions, list) else []:
        version = entry.get("version") if isinstance(entry, dict) else None
        if isinstance(version, str) and version and version not in out:
            out.append(version)
    return out


def pick_version(served: Sequence[str],
                 supported_in_preference_order: Sequence[str] = DEFAULT_PREFERENCE) -> str | None:
    """The first supported version that is served, or ``None``."""
    served_set = set(served)
    return next((v for v in supported_in_preference_order if v in served_set), None)


def resources_in(client: ApiClient, group: str, version: str) -> set[str]:
    """Names of the top-level resources of ``group/version`` (subresources such as
    ``resourceclaims/status`` are left out); empty when the version is not served."""
    try:
        doc = get_json(client, f"/apis/{group}/{version}", timeout=_TIMEOUT)
    except ApiError as exc:
        if exc.status == 404:
            return set()
        raise
    names: set[str] = set()
    resources = doc.get("resources")
    for entry in resources if isinstance(resources, list) else []:
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str) and name and "/" not in name:
            names.add(name)
    return names


def resource_version_for(
    client: ApiClient,
    group: str,
    resource: str,
    preference: Sequence[str] = DEFAULT_PREFERENCE,
) -> str | None:
    """The most preferred served version of ``group`` that has ``resource``, or ``None``."""
    served = set(served_versions(client, group))
    for version in preference:
        if version in served and resource in resources_in(client, group, version):
            return version
    return None


class Discovery:
    """Cached discovery for one API client. Thread-safe; raises :class:`ApiError` like the
    functions above when the server cannot be asked and nothing is cached yet."""

    def __init__(self, client: ApiClient, ttl: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._versions: dict[str, tuple[float, list[str]]] = {}
        self._resources: dict[tuple[str, str], tuple[float, set[str]]] = {}

    def refresh(self) -> None:
        """Forget everything; the next question asks the server again."""
        with self._lock:
            self._versions.clear()
            self._resources.clear()

    def _fresh(self, stamp: float) -> bool:
        return self._clock() - stamp < self._ttl

    def served_versions(self, group: str = RESOURCE_GROUP) -> list[str]:
        with self._lock:
            hit = self._versions.get(group)
            if hit and self._fresh(hit[0]):
                return list(hit[1])
        versions = served_versions(self._client, group)
        with self._lock:
            self._versions[group] = (self._clock(), versions)
        return list(versions)

    def resources(self, group: str, version: str) -> set[str]:
        with self._lock:
            hit = self._resources.get((group, version))
            if hit and self._fresh(hit[0]):
                return set(hit[1])
        names = resources_in(self._client, group, version)
        with self._lock:
            self._resources[(group, version)] = (self._clock(), names)
        return set(names)

    def pick(self, group: str = RESOURCE_GROUP, preference: Sequence[str] = DEFAULT_PREFERENCE) -> str | None:
        return pick_version(self.served_versions(group), preference)

    def version_for(self, group: str, resource: str, preference: Sequence[str] = DEFAULT_PREFERENCE) -> str | None:
        served = set(self.served_versions(group))
        for version in preference:
            if version in served and resource in self.resources(group, version):
                return version
        log.info("discovery_resource_not_served", group=group, resource=resource, served=sorted(served))
        return None
