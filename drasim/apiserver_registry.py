"""The verbs (get, list, create, update, patch, delete, watch) over the Store.

Requests arrive in the wire shape of one served version; the registry converts to storage,
applies the resource strategy (defaulting, validation), preconditions and the optional schema
validator, commits, and converts back. Everything here is synchronous and runs under the
store lock, so each verb is atomic like an etcd transaction.
"""

from __future__ import annotations

import builtins
import copy
import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import yaml

from . import apiserver_convert as convert
from . import apiserver_strategy as strategy
from .apiserver_catalog import ResourceType
from .apiserver_patch import PatchError, json_patch, merge_patch
from .apiserver_selectors import Selector
from .apiserver_store import ApiError, Store, WriteEvent

log = structlog.get_logger(__name__)

# (apiVersion, kind, body) -> None, raising to reject the object (the server answers 422).
Validator = Callable[[str, str, dict[str, Any]], None]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH, APPLY_PATCH)

_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what apiserver's name generator uses


@dataclass(frozen=True)
class Target:
    """What a request addresses: a resource in one served version, maybe one object."""

    rt: ResourceType
    version: str
    namespace: str | None = None  # None: all namespaces (or cluster-scoped)
    name: str | None = None
    subresource: str | None = None

    @property
    def api_version(self) -> str:
        return f"{self.rt.group}/{self.version}" if self.rt.group else self.version


def _without_meta_status(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _strip_rv(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out.get("metadata", {}).pop("resourceVersion", None)
    return out


class Registry:
    def __init__(self, store: Store, release: int) -> None:
        self.store = store
        self.release = release
        self.validator: Validator | None = None

    # ------------------------------------------------------------ shapes

    def to_wire(self, t: Target, stored: dict[str, Any], typed: bool = True) -> dict[str, Any]:
        body = convert.to_version(t.rt, t.version, stored)
        if not typed:
            return body
        # apiVersion and kind first, like the real serializer.
        return {"apiVersion": t.api_version, "kind": t.rt.kind, **body}

    def _from_wire(self, t: Target, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        api_version = body.get("apiVersion")
        if api_version and api_version != t.api_version:
            raise ApiError(400, f"the API version in the data ({api_version}) does not match "
                                f"the expected API version ({t.api_version})")
        kind = body.get("kind")
        if kind and kind != t.rt.kind:
            raise ApiError(400, f"the kind in the data ({kind}) does not match the expected kind ({t.rt.kind})")
        stored = convert.from_version(t.rt, t.version, body)
        stored.pop("apiVersion", None)
        stored.pop("kind", None)
        if not isinstance(stored.get("metadata", {}), dict):
            raise ApiError(400, "metadata must be an object")
        stored.setdefault("metadata", {})
        return stored

    def _check(self, t: Target, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        strategy.prepare(t.rt, self.release, new, old)
        name = new["metadata"].get("name", "")
        causes = strategy.validate(t.rt, self.release, new, old)
        if causes:
            raise ApiError.invalid(t.rt, name, [c.as_dict() for c in causes])
        if self.validator is not None:
            wire = self.to_wire(t, new)
            try:
                self.validator(t.api_version, t.rt.kind, wire)
            except Exception as exc:  # the hook's own exception types are unknown to us
                # jsonschema-style errors carry a one-line .message and the failing .path;
                # their str() appends the whole schema, which is no use in a Status.
                message = getattr(exc, "message", None)
                message = message if isinstance(message, str) and message else str(exc)
                path = getattr(exc, "path", None)
                field = ".".join(str(p) for p in path) if path and not isinstance(path, str) else ""
                log.info("apiserver_validator_rejected", kind=t.rt.kind, name=name, field=field, error=message)
                cause = {"reason": "FieldValueInvalid", "message": f"{field}: {message}" if field else message,
                         "field": field}
                raise ApiError.invalid(t.rt, name, [cause]) from None

    def _namespace(self, t: Target, stored: dict[str, Any]) -> None:
        meta = stored["metadata"]
        if t.rt.namespaced:
            body_ns = meta.get("namespace")
            if t.namespace is None:
                raise ApiError(400, f"{t.rt.kind} is namespaced: create it under /namespaces/<ns>/")
            if body_ns and body_ns != t.namespace:
                raise ApiError(400, "the namespace of the provided object does not match the "
                                    "namespace sent on the request")
            meta["namespace"] = t.namespace
        else:
            meta.pop("namespace", None)

    # ------------------------------------------------------------ reads

    def get(self, t: Target) -> dict[str, Any]:
        with self.store.lock:
            cur = self.store.current(t.rt, t.namespace or "", t.name or "")
            if cur is None:
                raise ApiError.not_found(t.rt, t.name or "")
            return self.to_wire(t, cur)

    def list(self, t: Target, selector: Selector, limit: int | None = None,
             continue_after: tuple[str, str] | None = None) -> tuple[list[dict[str, Any]], int, tuple[str, str] | None]:
        """Matching items (wire shape, untyped like real list items), the list rv, and the
        key to continue after when `limit` cut the list short."""
        with self.store.lock:
            out: list[dict[str, Any]] = []
            last: tuple[str, str] | None = None
            for stored in self.store.items(t.rt, t.namespace):
                meta = stored["metadata"]
                key = (meta.get("namespace", ""), meta["name"])
                if continue_after is not None and key <= continue_after:
                    continue
                wire = self.to_wire(t, stored, typed=False)
                if not selector.matches(wire):
                    continue
                if limit and len(out) >= limit:
                    return out, self.store.rv, last
                out.append(wire)
                last = key
            return out, self.store.rv, None

    # ------------------------------------------------------------ writes

    def create(self, t: Target, body: Any, dry_run: bool = False) -> dict[str, Any]:
        with self.store.lock:
            new = self._from_wire(t, body)
            self._namespace(t, new)
            meta = new["metadata"]
            if meta.get("resourceVersion"):
                # etcd3 store: a create carrying a resourceVersion is a client bug (500 there too).
                raise ApiError(500, "resourceVersion should not be set on objects to be created")
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(random.choices(_GENERATE_ALPHABET, k=5))
            for server_owned in ("uid", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
                meta.pop(server_owned, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = strategy.now_rfc3339()
            if t.rt.has_generation:
                meta["generation"] = 1
            if t.rt.reset_status_on_create:
                new.pop("status", None)
            self._check(t, new, None)
            if self.store.current(t.rt, meta.get("namespace", ""), meta["name"]) is not None:
                raise ApiError.already_exists(t.rt, meta["name"])
            if dry_run:
                return self.to_wire(t, new)
            return self.to_wire(t, self.store.commit(t.rt, "ADDED", new, None))

    def update(self, t: Target, body: Any, dry_run: bool = False) -> dict[str, Any]:
        """PUT. (A patch goes through :meth:`_update` with the stored object's resourceVersion:
        it is applied to what is stored, so it is never an unconditional update.)"""
        with self.store.lock:
            cur = self.store.current(t.rt, t.namespace or "", t.name or "")
            if cur is None:
                raise ApiError.not_found(t.rt, t.name or "")
            new = self._from_wire(t, body)
            if not new["metadata"].get("resourceVersion") and not strategy.allows_unconditional_update(t.rt, t.version):
                # genericregistry.Store.Update: the strategy wants optimistic concurrency, and
                # the error names the resource where it names a kind (a known quirk upstream).
                raise ApiError(422, f'{t.rt.qualified} "{t.name}" is invalid: metadata.resourceVersion: Invalid value: '
                                    '0x0: '
                                    "must be specified for an update", reason="Invalid",
                               details={"name": t.name or "", "group": t.rt.group, "kind": t.rt.resource,
                                        "causes": [{"reason": "FieldValueInvalid", "field": "metadata.resourceVersion",
                                                    "message": "Invalid value: 0x0: must be specified for an update"}]})
            return self._update(t, cur, new, dry_run)

    def _update(self, t: Target, cur: dict[str, Any], new: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        meta = new["metadata"]
        name = t.name or ""
        if meta.get("name") and meta["name"] != name:
            raise ApiError(400, f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        meta["name"] = name
        self._namespace(t, new)
        cur_meta = cur["metadata"]
        want_rv = meta.get("resourceVersion")
        if want_rv and want_rv != cur_meta.get("resourceVersion"):
            raise ApiError.conflict(t.rt, name, "the object has been modified; please apply your "
                                                "changes to the latest version and try again")
        if t.subresource == "status":
            # Only the status changes through /status; everything else is kept as stored.
            status = new.get("status")
            new = copy.deepcopy(cur)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
            meta = new["metadata"]
        else:
            for server_owned in ("uid", "creationTimestamp", "deletionTimestamp",
                                 "deletionGracePeriodSeconds", "generation"):
                if server_owned in cur_meta:
                    meta[server_owned] = cur_meta[server_owned]
                else:
                    meta.pop(server_owned, None)
            if t.rt.status_subresource:
                if "status" in cur:
                    new["status"] = copy.deepcopy(cur["status"])
                else:
                    new.pop("status", None)
        meta.pop("resourceVersion", None)
        if t.rt.has_generation and _without_meta_status(new) != _without_meta_status(cur):
            meta["generation"] = int(cur_meta.get("generation") or 0) + 1
        self._check(t, new, cur)
        if new == _strip_rv(cur):
            # A no-op update neither bumps resourceVersion nor wakes watchers (as in etcd3).
            return self.to_wire(t, cur)
        if dry_run:
            return self.to_wire(t, new)
        if cur_meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # The last finalizer went away from an object being deleted: now it is gone.
            return self.to_wire(t, self.store.commit(t.rt, "DELETED", new, cur))
        return self.to_wire(t, self.store.commit(t.rt, "MODIFIED", new, cur))

    def patch(self, t: Target, content_type: str, raw: bytes, dry_run: bool = False,
              field_manager: str | None = None) -> dict[str, Any]:
        ctype = content_type.split(";")[0].strip().lower()
        if ctype not in PATCH_TYPES:
            raise ApiError(415, f"the body of the request was in an unknown format - accepted media "
                                f"types include: {', '.join(PATCH_TYPES)}")
        try:
            patch = yaml.safe_load(raw) if ctype == APPLY_PATCH else _json_loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError(400, f"error decoding patch: {exc}") from None
        with self.store.lock:
            cur = self.store.current(t.rt, t.namespace or "", t.name or "")
            if ctype == APPLY_PATCH:
                if not field_manager:
                    raise ApiError(422, "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: "
                                        "Required value: is required for apply patch", reason="Invalid")
                if cur is None:
                    # Server-side apply creates missing objects (ownership tracking is not emulated).
                    body = copy.deepcopy(patch) if isinstance(patch, dict) else patch
                    if isinstance(body, dict):
                        body.setdefault("metadata", {}).setdefault("name", t.name)
                    return self.create(Target(t.rt, t.version, t.namespace), body, dry_run)
            if cur is None:
                raise ApiError.not_found(t.rt, t.name or "")
            wire = self.to_wire(t, cur)
            try:
                if ctype == JSON_PATCH:
                    patched = json_patch(wire, patch)
                else:
                    if not isinstance(patch, dict):
                        raise PatchError(400, "a merge patch must be a JSON object")
                    patched = merge_patch(wire, patch)
            except PatchError as exc:
                raise ApiError(exc.code, exc.message) from None
            return self._update(t, cur, self._from_wire(t, patched), dry_run)

    def delete(self, t: Target, options: dict[str, Any] | None = None, dry_run: bool = False) -> dict[str, Any]:
        with self.store.lock:
            cur = self.store.current(t.rt, t.namespace or "", t.name or "")
            if cur is None:
                raise ApiError.not_found(t.rt, t.name or "")
            pre = (options or {}).get("preconditions") or {}
            meta = cur["metadata"]
            if pre.get("uid") and pre["uid"] != meta.get("uid"):
                raise ApiError.conflict(t.rt, t.name or "", f"Precondition failed: UID in precondition: "
                                                            f"{pre['uid']}, UID in object meta: {meta.get('uid')}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
                raise ApiError.conflict(t.rt, t.name or "", "Precondition failed: ResourceVersion in "
                                                            f"precondition: {pre['resourceVersion']}, "
                                                            "ResourceVersion in object meta: "
                                                            f"{meta.get('resourceVersion')}")
            if dry_run:
                return self.to_wire(t, cur)
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp"):
                    return self.to_wire(t, cur)
                marked = _strip_rv(cur)
                marked["metadata"]["deletionTimestamp"] = strategy.now_rfc3339()
                marked["metadata"]["deletionGracePeriodSeconds"] = 0
                return self.to_wire(t, self.store.commit(t.rt, "MODIFIED", marked, cur))
            gone = _strip_rv(cur)
            return self.to_wire(t, self.store.commit(t.rt, "DELETED", gone, cur))

    def delete_collection(self, t: Target, selector: Selector, dry_run: bool = False) -> dict[str, Any]:
        with self.store.lock:
            items, _, _ = self.list(t, selector)
            deleted = []
            for item in items:
                meta = item["metadata"]
                one = Target(t.rt, t.version, meta.get("namespace") if t.rt.namespaced else None, meta["name"])
                deleted.append(self.delete(one, None, dry_run))
            return {"kind": f"{t.rt.kind}List", "apiVersion": t.api_version,
                    "metadata": {"resourceVersion": str(self.store.rv)}, "items": deleted}

    # ------------------------------------------------------------ backdoor for tests and the demo

    def apply_direct(self, t: Target, body: dict[str, Any]) -> dict[str, Any]:
        """Create or replace with everything (status included) as given; no validation hook.

        Server-owned metadata is filled or kept like a real write, so watchers see ordinary
        ADDED/MODIFIED events with fresh resourceVersions.
        """
        with self.store.lock:
            new = self._from_wire(t, body)
            meta = new["metadata"]
            name = meta.get("name")
            if not name:
                raise ValueError("apply() needs metadata.name")
            ns = meta.get("namespace") or ("default" if t.rt.namespaced else "")
            if t.rt.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            meta.pop("resourceVersion", None)
            cur = self.store.current(t.rt, ns, name)
            if cur is None:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", strategy.now_rfc3339())
                if t.rt.has_generation:
                    meta.setdefault("generation", 1)
                strategy.prepare(t.rt, self.release, new, None)
                return self.to_wire(t, self.store.commit(t.rt, "ADDED", new, None))
            cur_meta = cur["metadata"]
            meta["uid"] = cur_meta.get("uid")
            meta["creationTimestamp"] = cur_meta.get("creationTimestamp")
            if t.rt.has_generation and "generation" not in meta:
                bump = _without_meta_status(new) != _without_meta_status(cur)
                meta["generation"] = int(cur_meta.get("generation") or 1) + (1 if bump else 0)
            strategy.prepare(t.rt, self.release, new, cur)
            return self.to_wire(t, self.store.commit(t.rt, "MODIFIED", new, cur))

    def delete_direct(self, t: Target) -> bool:
        with self.store.lock:
            cur = self.store.current(t.rt, t.namespace or "", t.name or "")
            if cur is None:
                return False
            self.store.commit(t.rt, "DELETED", _strip_rv(cur), cur)
            return True

    # ------------------------------------------------------------ watch

    def watch_start(
        self, t: Target, selector: Selector, rv_param: str | None
    ) -> tuple[builtins.list[dict[str, Any]], int]:
        """Initial events and the cursor to follow from. Raises ApiError 410 on a compacted rv."""
        with self.store.lock:
            if rv_param in (None, "", "0"):
                # "Get state and start at most recent": synthetic ADDED for what exists now.
                initial = []
                for stored in self.store.items(t.rt, t.namespace):
                    wire = self.to_wire(t, stored)
                    if selector.matches(wire):
                        initial.append({"type": "ADDED", "object": wire})
                return initial, self.store.rv
            try:
                cursor = int(rv_param)
            except ValueError:
                raise ApiError(400, f"invalid resourceVersion {rv_param!r}") from None
            if cursor < self.store.oldest:
                raise ApiError.expired(cursor, self.store.oldest + 1)
            return [], cursor

    def watch_event(self, t: Target, selector: Selector, ev: WriteEvent) -> dict[str, Any] | None:
        """What one watcher sees of one write: field/label selector transitions turn into
        ADDED/DELETED like the watch cache does; None when the watcher sees nothing."""
        if ev.rt.key != t.rt.key:
            return None
        if t.namespace is not None and (ev.obj.get("metadata") or {}).get("namespace") != t.namespace:
            return None
        now = self.to_wire(t, ev.obj)
        if ev.type == "DELETED":
            return {"type": "DELETED", "object": now} if selector.matches(now) else None
        now_ok = selector.matches(now)
        was_ok = ev.prev is not None and selector.matches(self.to_wire(t, ev.prev))
        if now_ok:
            return {"type": "MODIFIED" if was_ok else "ADDED", "object": now}
        if was_ok:
            # Stopped matching: the watcher gets DELETED with the previous content at this rv.
            gone = self.to_wire(t, ev.prev or {})
            gone.setdefault("metadata", {})["resourceVersion"] = str(ev.rv)
            return {"type": "DELETED", "object": gone}
        return None


def _json_loads(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8") or "null")
