"""An in-process Kubernetes API server over real HTTP, for the demo and the tests.

It speaks the kube-apiserver wire protocol that the official `kubernetes` client (and kubectl)
expect: discovery, JSON objects with resourceVersions, metav1.Status errors, list with label and
field selectors, chunked watch streams with bookmarks and 410 Gone, merge/JSON patches, and
per-release API versions of resource.k8s.io. On top it offers fault injection (outages, failing
or slow requests, dropped watches) and a request log for tests to assert on.

    server = FakeApiServer(kubernetes_version="1.34")
    url = server.start()
    ...
    server.stop()

Module layout: this facade; state (what the HTTP side acts on: store, registry, faults, open
connections and watches); http (routing, responses, watch streams); catalog (which versions
exist), store (revisions, history), registry (verbs), strategy (defaulting, validation), convert
(v1beta1 shapes), selectors, patch, faults.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import structlog

from .apiserver_catalog import (
    GroupVersion,
    ResourceType,
    available_group_versions,
    parse_release,
    served_group_versions,
    version_priority,
)
from .apiserver_faults import LOG_LIMIT, FaultInjector, RequestRecord
from .apiserver_http import ApiHTTPServer, ApiRequestHandler
from .apiserver_registry import Registry, Target, Validator
from .apiserver_selectors import Selector
from .apiserver_state import ServerState
from .apiserver_store import ApiError, Store

__all__ = ["ApiError", "FakeApiServer", "RequestRecord", "Validator"]

log = structlog.get_logger(__name__)


class FakeApiServer:
    """See the module docstring. All public methods are thread-safe."""

    def __init__(self, kubernetes_version: str = "1.37", served_versions: set[str] | None = None, *,
                 bookmark_interval: float = 1.0, history_size: int = 1000,
                 require_token: str | None = None, default_watch_timeout: float = 1800.0,
                 validator: Validator | None = None, request_log_size: int = LOG_LIMIT) -> None:
        """served_versions: "group/version" strings ("v1" for core) replacing the release's
        default set, e.g. {"v1", "resource.k8s.io/v1beta1"}; must exist in that release."""
        release = parse_release(kubernetes_version)
        store = Store(history_size)
        registry = Registry(store, release)
        registry.validator = validator
        self.kubernetes_version = f"1.{release}"
        # The HTTP side (apiserver_http) acts on this state; this class is the facade over it.
        self.state = ServerState(
            release, served_group_versions(release, served_versions), store, registry,
            FaultInjector(log_size=request_log_size),  # the newest requests, for tests
            bookmark_interval=bookmark_interval, default_watch_timeout=default_watch_timeout,
            require_token=require_token,
        )
        self._httpd: ApiHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def release(self) -> int:
        return self.state.release

    @property
    def store(self) -> Store:
        return self.state.store

    @property
    def registry(self) -> Registry:
        return self.state.registry

    @property
    def faults(self) -> FaultInjector:
        return self.state.faults

    @property
    def url(self) -> str:
        return self.state.url

    # ------------------------------------------------------------ lifecycle

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._httpd is not None:
            raise RuntimeError("already started")
        self.state.stopping.clear()
        httpd = ApiHTTPServer((host, port), ApiRequestHandler)
        httpd.state = self.state
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-apiserver", daemon=True)
        self._thread.start()
        bound_host, bound_port = httpd.server_address[:2]
        assert isinstance(bound_host, str)  # an AF_INET/AF_INET6 socket's name has a str host (typeshed allows bytes)
        self.state.url = f"http://{bound_host}:{bound_port}"
        log.info("apiserver_started", url=self.url, kubernetes=self.kubernetes_version,
                 served=self.served_versions)
        return self.url

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self.state.stopping.set()
        with self.store.lock:
            self.store.lock.notify_all()
        httpd.shutdown()
        for conn in self.state.connections.open():  # wake handler threads blocked on keep-alive reads
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        log.info("apiserver_stopped", url=self.url)

    def __enter__(self) -> FakeApiServer:
        if self._httpd is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def served_versions(self) -> list[str]:
        return [gv.group_version for gv in self.state.group_versions]

    # ------------------------------------------------------------ faults and the request log

    def outage(self, on: bool = True, mode: str = "503") -> None:
        """While on, every request fails: 503 ServiceUnavailable, or (mode="reset") the
        connection is reset without a response. Turning it on also drops open watches."""
        self.faults.set_outage(mode if on else None)
        if on:
            self.close_watches(mode="reset" if mode == "reset" else "end")

    def fail_next(self, method: str, path_regex: str, code: int, count: int = 1,
                  retry_after: float | None = None, message: str | None = None,
                  watch: bool | None = None) -> None:
        """The next `count` requests with this method ("*" for any) whose path matches
        `path_regex` (re.search on the path, without the query) get a Status error `code`,
        with a Retry-After header when given. watch=True/False limits it to watch or plain
        requests."""
        self.faults.add_failure(method, path_regex, code, count, retry_after, message, watch)

    def delay_next(self, path_regex: str, seconds: float, count: int = 1, method: str = "*",
                   watch: bool | None = None) -> None:
        """Hold the next `count` matching requests for `seconds` before serving them."""
        self.faults.add_delay(method, path_regex, seconds, count, watch)

    def clear_faults(self) -> None:
        self.faults.clear()

    def close_watches(self, mode: str = "end") -> None:
        """End every open watch stream: "end" finishes the chunked response cleanly (like a
        server-side timeout), "reset" drops the connection."""
        self.state.watches.close_all(mode)

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, oldest first."""
        return self.faults.log()

    def clear_requests(self) -> None:
        self.faults.clear_log()

    @property
    def open_watches(self) -> int:
        return self.state.watches.count()

    def set_validator(self, validator: Validator | None) -> None:
        """Install (or remove) a hook called with (apiVersion, kind, body) for the result of
        every create/update/patch sent over HTTP; if it raises, the request fails with 422."""
        with self.store.lock:
            self.registry.validator = validator

    # ------------------------------------------------------------ direct store access

    def compact(self) -> None:
        """Forget the event history: watches from any older resourceVersion get 410 Gone."""
        self.store.compact()

    @property
    def resource_version(self) -> str:
        with self.store.lock:
            return str(self.store.rv)

    def _resource(self, group: str, resource: str, version: str | None) -> Target:
        """The resource in `version`, or by default its most preferred served version
        (falling back to versions the release has but does not serve)."""
        candidates: list[tuple[int, int, GroupVersion, ResourceType]] = []
        served = {gv.group_version for gv in self.state.group_versions}
        for gv in available_group_versions(self.release):
            rt = gv.find(resource)
            if gv.group != group or rt is None or (version and gv.version != version):
                continue
            candidates.append((0 if gv.group_version in served else 1, version_priority(gv.version), gv, rt))
        if not candidates:
            raise ValueError(f"Kubernetes {self.kubernetes_version} has no resource {resource!r} "
                             f"in group {group!r}" + (f" version {version}" if version else ""))
        _, _, gv, rt = min(candidates, key=lambda c: (c[0], c[1]))
        return Target(rt, gv.version)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace `obj` (any shape its apiVersion allows, status included) straight
        in the store: a new resourceVersion and a watch event, no validation or faults."""
        api_version = obj.get("apiVersion") or ""
        group, _, version = api_version.rpartition("/")
        kind = obj.get("kind")
        for gv in available_group_versions(self.release):
            if gv.group == group and gv.version == version:
                for rt in gv.resources:
                    if rt.kind == kind:
                        return self.registry.apply_direct(Target(rt, version), obj)
        raise ValueError(f"Kubernetes {self.kubernetes_version} has no {kind} in {api_version!r}")

    def get(self, group: str, resource: str, name: str, namespace: str | None = None,
            version: str | None = None) -> dict[str, Any] | None:
        t = self._resource(group, resource, version)
        try:
            return self.registry.get(Target(t.rt, t.version, namespace or "", name))
        except ApiError:
            return None

    def list(self, group: str, resource: str, namespace: str | None = None, version: str | None = None,
             label_selector: str | None = None, field_selector: str | None = None) -> list[dict[str, Any]]:
        t = self._resource(group, resource, version)
        items, _, _ = self.registry.list(Target(t.rt, t.version, namespace),
                                         Selector.parse(label_selector, field_selector))
        return items

    def delete(self, group: str, resource: str, name: str, namespace: str | None = None) -> bool:
        """Remove immediately (finalizers are ignored); False when it did not exist."""
        t = self._resource(group, resource, None)
        return self.registry.delete_direct(Target(t.rt, t.version, namespace or "", name))
