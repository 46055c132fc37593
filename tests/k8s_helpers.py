"""Helpers for tests that talk to the in-process Kubernetes API server over real HTTP.

    from k8s_helpers import running_apiserver, api_client, wait_until  # tests/ is on sys.path

    with running_apiserver("1.34", bookmark_interval=0.05) as server:
        api = api_client(server.url)
        ...
        wait_until(lambda: server.open_watches == 1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client

from drasim import objects
from drasim.apiserver import FakeApiServer
from drasim.scenario import Scenario

T = TypeVar("T")


@contextmanager
def running_apiserver(version: str = "1.37", **kwargs: Any) -> Iterator[FakeApiServer]:
    """A started FakeApiServer (kwargs go to its constructor), stopped on exit."""
    server = FakeApiServer(kubernetes_version=version, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def publish_scenario(server: FakeApiServer, sc: Scenario) -> None:
    """Store what the cluster holds for a scenario's node: the Node, its ResourceSlice, the
    claims and the pods (all of them, as if every pod were running)."""
    server.apply(objects.node(sc))
    server.apply(objects.resource_slice(sc))
    for c in objects.resource_claims(sc, list(sc.pods)):
        server.apply(c)
    for pod in sc.pods:
        server.apply(objects.pod_object(sc, pod))


def write_kubeconfig(path: str | Path, url: str, token: str = "test-token",
                     namespace: str = "default", context: str = "fake") -> Path:
    """A kubeconfig with one cluster/user/context pointing at `url` with a bearer token."""
    path = Path(path)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context,
                                                   "namespace": namespace}}],
        "current-context": context,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def api_client(url: str, token: str | None = None) -> client.ApiClient:
    """An official-client ApiClient for `url` (optionally with a bearer token)."""
    cfg = client.Configuration()
    cfg.host = url
    if token is not None:
        cfg.api_key = {"BearerToken": token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(cfg)


def call_json(api: client.ApiClient, method: str, path: str, query: dict[str, Any] | None = None,
              body: Any = None, content_type: str | None = None) -> tuple[int, Any]:
    """Raw request through the official client's transport: (status, parsed JSON body).

    Does not raise on error statuses, so tests can assert on the metav1.Status itself.
    """
    headers = {"Accept": "application/json"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    elif body is not None:
        headers["Content-Type"] = "application/json"
    params = [(k, v) for k, v in (query or {}).items()]
    request = api.param_serialize(method, path, query_params=params, header_params=headers, body=body)
    resp = api.call_api(*request)
    data = resp.read()
    try:
        return resp.status, json.loads(data) if data else None
    except ValueError:
        return resp.status, data.decode("utf-8", errors="replace")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01,
               message: str = "condition") -> T:
    """Poll `predicate` until it returns something truthy (which is returned), or fail the
    test after `timeout` seconds. A deadline, not a sleep: it returns as soon as it can."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
