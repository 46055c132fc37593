"""Helpers for tests that talk to the in-process Kubernetes API server over real HTTP.

    from k8s_helpers import running_apiserver, api_client, wait_until  # tests/ is on sys.path

    with running_apiserver("1.34", bookmark_interval=0.05) as server:
        api = api_client(server.url)
        ...
        wait_until(lambda: server.open_watches == 1)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kit_helpers import wait_until  # noqa: F401 - re-exported: one definition, in the test kit
from kubernetes import client

from drasim.apiserver import FakeApiServer
from drasim.node import publish_scenario, write_kubeconfig  # noqa: F401 - re-exported: one definition, in the rig

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


