"""Connection to the Kubernetes API and raw JSON requests over it.

The official ``kubernetes`` package does the hard parts (kubeconfig and in-cluster loading, TLS,
client certificates, token refresh for projected service-account tokens and exec plugins), but
its typed models are not used: the agent talks to whichever resource.k8s.io version is served
(v1, v1beta2, v1beta1, v1alpha3), and a model generated for one release rejects or drops fields
of another. So requests go through ``ApiClient.param_serialize`` / ``call_api`` (which apply the
auth settings) and responses are decoded as plain JSON here.

Every failure surfaces as :class:`ApiError`: HTTP errors with the status code and the
``Status`` object's reason and message, transport failures (refused, reset, timed out, TLS) as
:class:`ApiUnavailable` with ``status == 0``. Callers therefore need exactly one ``except``.
"""

from __future__ import annotations

import email.utils
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from ..clock import SYSTEM
from ..text import one_line

log = structlog.get_logger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "JSON",
    "JSON_PATCH",
    "MERGE_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "ApiClient",
    "ApiError",
    "ApiUnavailable",
    "KubeconfigError",
    "ResponseTooLarge",
    "WatchStream",
    "connect",
    "get_json",
    "request_json",
    "stream_watch",
]

ApiClient = k8s_client.ApiClient

#: (connect, read) seconds for ordinary requests; a scrape-driven agent must never hang on the API
DEFAULT_TIMEOUT: tuple[float, float] = (5.0, 30.0)
#: how much longer than the server-side ``timeoutSeconds`` the client waits for a watch byte before
#: declaring the connection dead (servers send bookmarks; a silent TCP drop sends nothing)
WATCH_READ_GRACE = 30.0
#: Largest response body read into memory (after decompression). A node-scoped list is a few
#: hundred KiB; an answer larger than this is a broken or hostile server, not data to hold.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: Largest single watch event line (one object); a stream that never sends a newline is cut here.
MAX_WATCH_LINE_BYTES = 16 * 1024 * 1024
#: Largest error body read (a Status object is a few hundred bytes).
MAX_ERROR_BYTES = 1024 * 1024

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

_IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"

Timeout = float | tuple[float, float] | None
Query = Mapping[str, Any] | Sequence[tuple[str, Any]] | None


class KubeconfigError(Exception):
    """The kubeconfig (or in-cluster configuration) cannot be used. One-line message."""


@dataclass(eq=False)  # exceptions compare and hash by identity
class ApiError(Exception):
    """A request to the API failed. ``status`` is the HTTP code, 0 when no response came back."""

    status: int
    reason: str
    message: str
    retry_after: float | None = None  # seconds, from a Retry-After header (429, 503)
    body: dict[str, Any] | None = None  # the decoded Status object, when there was one

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}" if self.status else f"{self.reason}: {self.message}"

    @property
    def retryable(self) -> bool:
        """Worth retrying after a backoff: no response, throttled, or a server-side failure."""
        return self.status == 0 or self.status == 429 or self.status >= 500

    @property
    def gone(self) -> bool:
        """410 Gone / Expired: the resourceVersion is too old, the caller must relist."""
        return self.status == 410


class ApiUnavailable(ApiError):
    """No HTTP response at all: connection refused or reset, timeout, TLS failure."""


class ResponseTooLarge(ApiUnavailable):
    """The server sent more than the bound allows (a body, or one watch line): the connection is
    dropped and the request counts as failed, so callers retry it with their usual backoff."""


def _too_large(what: str, limit: int) -> ResponseTooLarge:
    return ResponseTooLarge(status=0, reason="ResponseTooLarge",
                            message=f"{what} exceeds {limit} bytes; connection dropped")


def _drop(raw: Any) -> None:
    try:
        raw.close()
    except Exception:  # already closed or released: nothing left to free
        pass


def _read_bounded(resp: Any, limit: int) -> bytes:
    """Read a response body, refusing to hold more than ``limit`` bytes of it (decoded)."""
    raw = getattr(resp, "response", None)
    if raw is None or not hasattr(raw, "read"):
        data = resp.read() or b""  # not a streaming response (tests' stand-ins): already in memory
        if len(data) > limit:
            raise _too_large("response body", limit)
        return data
    declared = (raw.headers or {}).get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        _drop(raw)
        raise _too_large(f"response body ({declared} bytes declared)", limit)
    buf = bytearray()
    while True:
        chunk = raw.read(65536, decode_content=True)
        if not chunk:
            return bytes(buf)
        buf.extend(chunk)
        if len(buf) > limit:
            _drop(raw)
            raise _too_large("response body", limit)


# --------------------------------------------------------------------------- connecting


# Connections to the API server the agent may use at once: 8 claim fetches at start-up
# (claims.FETCH_PARALLEL), 4 watches (its ResourceSlices, its Node, its own DeviceTaintRules and,
# while a slot is wanted, the budget) and one each for the pods list, a rule write, an Event and
# a pod read (evictions).
POOL_CONNECTIONS = 16


def connect(kubeconfig: str | None) -> ApiClient | None:
    """Build an API client, or ``None`` when there is no configuration to use.

    Order (the product contract): an explicit kubeconfig path; else the in-cluster service
    account when running in a pod; else ``$KUBECONFIG``; else ``None`` (the agent then runs
    without Kubernetes features). An explicit or ``$KUBECONFIG`` file that cannot be loaded
    raises :class:`KubeconfigError` -- the user asked for it, silently ignoring it would hide a
    mistake. Nothing is sent to the server here.
    """
    cfg = k8s_client.Configuration()
    if kubeconfig:
        _load_kubeconfig(kubeconfig, cfg, "--kubeconfig")
        source = kubeconfig
    elif os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(_IN_CLUSTER_TOKEN):
        try:
            # kubernetes ships py.typed, but its config loaders have no annotations
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise KubeconfigError(f"in-cluster configuration unusable: {one_line(exc)}") from exc
        source = "in-cluster"
    elif os.environ.get("KUBECONFIG"):
        # KUBECONFIG may be a list; the first existing file is the conventional choice here
        paths = [p for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
        path = next((p for p in paths if os.path.exists(p)), paths[0] if paths else "")
        _load_kubeconfig(path, cfg, "$KUBECONFIG")
        source = path
    else:
        log.info("k8s_no_config", detail="no --kubeconfig, not in a cluster, no $KUBECONFIG")
        return None
    # urllib3's default Retry silently re-sends on 429/503 with Retry-After, sleeping inside
    # the request where stop() cannot interrupt it and hiding throttling from the callers'
    # own backoff. Keep only quick reconnects; status handling is ours.
    cfg.retries = urllib3.Retry(
        total=3, connect=3, read=0, status=0, other=0, redirect=3,
        raise_on_status=False, respect_retry_after_header=False,
    )
    # The client's default pool is 5 connections per CPU the *node* has (10 on a 2-core node),
    # less than the agent keeps in use at once there; urllib3 then discards the surplus after
    # each burst and the next burst opens new TCP and TLS connections to the API server.
    cfg.connection_pool_maxsize = POOL_CONNECTIONS
    api = ApiClient(configuration=cfg)
    api.user_agent = "dra-gpu-exporter"
    log.info("k8s_connected", source=source, host=cfg.host)
    return api


def _load_kubeconfig(path: str, cfg: k8s_client.Configuration, what: str) -> None:
    if not os.path.exists(path):
        raise KubeconfigError(f"{what} {path}: file does not exist")
    try:
        # kubernetes ships py.typed, but its config loaders have no annotations
        k8s_config.load_kube_config(config_file=path, client_configuration=cfg,
                                    persist_config=False)  # type: ignore[no-untyped-call]
    except Exception as exc:  # ConfigException, YAML errors, bad base64 ... all mean "unusable"
        raise KubeconfigError(f"{what} {path}: {one_line(exc)}") from exc
    if not cfg.host:
        raise KubeconfigError(f"{what} {path}: no server address in the current context")


# --------------------------------------------------------------------------- requests


def _query_items(query: Query) -> list[tuple[str, Any]]:
    if not query:
        return []
    items = list(query.items()) if isinstance(query, Mapping) else list(query)
    return [(k, v) for k, v in items if v is not None]


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    value = (headers or {}).get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        # An HTTP-date: a wall date, turned into a delay once, as it is read.
        return max(0.0, parsed.timestamp() - SYSTEM.wall()) if parsed else None


def _error_from_response(status: int, http_reason: str, data: bytes, headers: Any) -> ApiError:
    body: dict[str, Any] | None = None
    try:
        decoded = json.loads(data.decode("utf-8", errors="replace")) if data else None
        body = decoded if isinstance(decoded, dict) else None
    except ValueError:
        body = None
    reason = http_reason or "Error"
    message = " ".join(data.decode("utf-8", errors="replace").split())[:300] if data else ""
    if body is not None:
        reason = str(body.get("reason") or reason)
        message = str(body.get("message") or message)
    return ApiError(status=status, reason=reason, message=message, retry_after=_retry_after(headers), body=body)


def _send(
    client: ApiClient,
    method: str,
    path: str,
    query: Query,
    body: Any,
    content_type: str | None,
    timeout: Timeout,
) -> Any:
    """Send one request; return the raw RESTResponse (body not read) or raise ApiError."""
    headers = {"Accept": JSON}
    if content_type and body is not None:
        headers["Content-Type"] = content_type
    try:
        req = client.param_serialize(
            method=method,
            resource_path=path,
            query_params=_query_items(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = client.call_api(*req, _request_timeout=timeout)
    except ApiException as exc:  # the REST layer's own failures (TLS errors) come as status 0
        if exc.status:
            raise ApiError(status=exc.status, reason=str(exc.reason or "Error"), message=one_line(exc)) from exc
        raise ApiUnavailable(status=0, reason="TransportError", message=one_line(exc)) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise ApiUnavailable(status=0, reason=type(exc).__name__, message=one_line(exc)) from exc
    if not 200 <= resp.status <= 299:
        try:
            data = _read_bounded(resp, MAX_ERROR_BYTES)
        except (urllib3.exceptions.HTTPError, OSError, ResponseTooLarge):
            data = b""
        raise _error_from_response(resp.status, resp.reason or "", data, resp.headers)
    return resp


def request_json(
    client: ApiClient,
    method: str,
    path: str,
    query: Query = None,
    body: Any = None,
    content_type: str = JSON,
    timeout: Timeout = DEFAULT_TIMEOUT,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """One API request with a JSON (or patch) body; returns the decoded JSON object.

    ``content_type`` selects the patch flavour for PATCH (``MERGE_PATCH``, ``JSON_PATCH`` with a
    list body, ``STRATEGIC_MERGE_PATCH``). An empty 2xx body decodes to ``{}``. A body larger
    than ``max_bytes`` (default :data:`MAX_RESPONSE_BYTES`) raises :class:`ResponseTooLarge`.
    """
    resp = _send(client, method.upper(), path, query, body, content_type, timeout)
    try:
        data = _read_bounded(resp, MAX_RESPONSE_BYTES if max_bytes is None else max_bytes)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise ApiUnavailable(status=0, reason=type(exc).__name__, message=one_line(exc)) from exc
    if not data.strip():
        return {}
    try:
        decoded = json.loads(data)
    except ValueError as exc:
        raise ApiError(status=resp.status, reason="BadResponse",
                       message=f"response is not JSON: {one_line(exc)}") from exc
    if not isinstance(decoded, dict):
        raise ApiError(status=resp.status, reason="BadResponse",
                       message=f"expected a JSON object, got {type(decoded).__name__}")
    return decoded


def get_json(client: ApiClient, path: str, query: Query = None, timeout: Timeout = DEFAULT_TIMEOUT,
             max_bytes: int | None = None) -> dict[str, Any]:
    """GET ``path`` and return the decoded JSON object (bounded like :func:`request_json`)."""
    return request_json(client, "GET", path, query=query, timeout=timeout, max_bytes=max_bytes)


# --------------------------------------------------------------------------- watch


class WatchStream:
    """An open watch: iterate for events, ``close()`` from any thread to stop it.

    Each event is the decoded JSON line, ``{"type": ..., "object": {...}}``. A line that is not
    a JSON object is yielded as ``{"type": "UNDECODABLE", "object": None, "raw": <text>}`` so the
    caller can count it without losing the stream. The iterator ends when the server closes
    the watch (its ``timeoutSeconds`` elapsed) and raises :class:`ApiUnavailable` when the
    connection breaks or stays silent past the read timeout.
    """

    def __init__(self, resp: Any, max_line: int | None = None) -> None:
        self._resp = resp
        self._closed = threading.Event()
        self._max_line = MAX_WATCH_LINE_BYTES if max_line is None else max_line

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        raw = self._resp.response
        # shutdown() wakes a read blocked in another thread; close() alone may not
        try:
            raw.shutdown()
        except Exception:  # already released, or an urllib3 without shutdown(): close still works
            pass
        try:
            raw.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _chunks(self) -> Iterator[bytes]:
        raw = self._resp.response
        if raw.chunked and raw.supports_chunked_reads():
            yield from raw.read_chunked(decode_content=True)
            return
        # Not chunked (HTTP/1.0 style, close-delimited): read1 returns what has arrived instead
        # of blocking until a full buffer, so events are seen as they come.
        while True:
            data = raw.read1(65536, decode_content=True)
            if not data:
                return
            yield data

    def __iter__(self) -> Iterator[dict[str, Any]]:
        buf = bytearray()
        try:
            for chunk in self._chunks():
                buf.extend(chunk)
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line = bytes(buf[:nl]).strip()
                    del buf[: nl + 1]
                    if line:
                        yield _decode_event(line)
                if len(buf) > self._max_line:
                    # One event bigger than any object we could use: a server that never sends
                    # a newline would otherwise grow this buffer until the OOM killer comes.
                    raise _too_large("watch event line", self._max_line)
            tail = bytes(buf).strip()
            if tail:
                yield _decode_event(tail)
        except ResponseTooLarge:
            raise
        except (urllib3.exceptions.HTTPError, OSError, ValueError, AttributeError) as exc:
            if self._closed.is_set():
                return  # closed on purpose: a clean end, not an error
            raise ApiUnavailable(status=0, reason=type(exc).__name__, message=one_line(exc)) from exc
        finally:
            self.close()


def _decode_event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        return {"type": "UNDECODABLE", "object": None, "raw": line.decode("utf-8", errors="replace")[:300]}
    return event


def stream_watch(client: ApiClient, path: str, query: Query = None, timeout: float = 300.0,
                 max_line: int | None = None) -> WatchStream:
    """Open a watch on ``path`` (a collection URL) and return the event stream.

    ``watch=true`` is added, and ``timeoutSeconds=timeout`` unless the query sets it, so the
    server ends the watch cleanly; the client-side read timeout is that plus a grace period, so a
    connection that dies without a FIN is noticed too. Raises :class:`ApiError` when the server
    refuses the watch (e.g. 410 Gone for a too-old resourceVersion).
    """
    items = [(k, v) for k, v in _query_items(query) if k != "watch"]
    items.append(("watch", "true"))
    server_timeout = next((float(v) for k, v in items if k == "timeoutSeconds"), None)
    if server_timeout is None:
        server_timeout = max(1.0, float(timeout))
        items.append(("timeoutSeconds", int(server_timeout)))
    resp = _send(client, "GET", path, items, None, None, (DEFAULT_TIMEOUT[0], server_timeout + WATCH_READ_GRACE))
    return WatchStream(resp, max_line)
