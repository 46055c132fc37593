"""Per-version conversion for the few resource.k8s.io shapes that differ between versions.

Storage is the v1 shape (v1beta2 is identical for these objects). v1beta1 differs:
  - ResourceSlice devices nest everything but `name` under `basic`;
  - DeviceRequest carries the ExactDeviceRequest fields inline instead of under `exactly`.
Everything else (and every other group) is stored and served unchanged.
Functions return new dicts and never mutate their input.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from .apiserver_catalog import ResourceType

_DRA = "resource.k8s.io"


def _device_to_v1beta1(device: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device.get("name", "")}
    basic = {k: v for k, v in device.items() if k != "name"}
    # A v1beta1 Device always carries `basic` for a plain device (it is the only variant).
    out["basic"] = basic
    return out


def _device_from_v1beta1(device: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device.get("name", "")}
    basic = device.get("basic") or {}
    out.update(basic)
    return out


def _request_to_v1beta1(req: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in req.items() if k != "exactly"}
    out.update(req.get("exactly") or {})
    return out


def _request_from_v1beta1(req: dict[str, Any]) -> dict[str, Any]:
    if "firstAvailable" in req:
        return {k: v for k, v in req.items() if k in ("name", "firstAvailable")}
    out: dict[str, Any] = {"name": req.get("name", "")}
    exactly = {k: v for k, v in req.items() if k != "name"}
    out["exactly"] = exactly
    return out


def _map_list(obj: dict[str, Any], path: tuple[str, ...],
              fn: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Apply fn to each dict of the list at path (a copy of obj is returned)."""
    out = copy.deepcopy(obj)
    cur: Any = out
    for part in path[:-1]:
        if not isinstance(cur, dict) or not isinstance(cur.get(part), dict):
            return out
        cur = cur[part]
    items = cur.get(path[-1]) if isinstance(cur, dict) else None
    if isinstance(items, list):
        cur[path[-1]] = [fn(i) if isinstance(i, dict) else i for i in items]
    return out


def _claim_spec_paths(rt: ResourceType) -> tuple[str, ...]:
    # ResourceClaimTemplate wraps a claim spec one level deeper (spec.spec).
    return ("spec", "spec") if rt.resource == "resourceclaimtemplates" else ("spec",)


def to_version(rt: ResourceType, version: str, stored: dict[str, Any]) -> dict[str, Any]:
    """Storage (v1 shape) -> the shape of `version`."""
    if rt.group != _DRA or version != "v1beta1":
        return copy.deepcopy(stored)
    if rt.resource == "resourceslices":
        return _map_list(stored, ("spec", "devices"), _device_to_v1beta1)
    if rt.resource in ("resourceclaims", "resourceclaimtemplates"):
        return _map_list(stored, _claim_spec_paths(rt) + ("devices", "requests"), _request_to_v1beta1)
    return copy.deepcopy(stored)


def from_version(rt: ResourceType, version: str, wire: dict[str, Any]) -> dict[str, Any]:
    """The shape of `version` -> storage (v1 shape)."""
    if rt.group != _DRA or version != "v1beta1":
        return copy.deepcopy(wire)
    if rt.resource == "resourceslices":
        return _map_list(wire, ("spec", "devices"), _device_from_v1beta1)
    if rt.resource in ("resourceclaims", "resourceclaimtemplates"):
        return _map_list(wire, _claim_spec_paths(rt) + ("devices", "requests"), _request_from_v1beta1)
    return copy.deepcopy(wire)
