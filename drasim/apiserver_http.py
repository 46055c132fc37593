"""The HTTP side of the fake API server: routing, responses, chunked watch streams.

Functions take the ServerState (apiserver_state.py: registry, store, faults, served versions,
open connections and watches) they act on; the handler classes plug them into http.server.
"""

from __future__ import annotations

import base64
import json
import math
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog

from .apiserver_catalog import GroupVersion, api_group, api_group_list, api_resource_list
from .apiserver_faults import RequestRecord
from .apiserver_registry import Target
from .apiserver_selectors import Selector
from .apiserver_state import ServerState
from .apiserver_store import ApiError

log = structlog.get_logger(__name__)

_OPEN_PATHS = ("/healthz", "/livez", "/readyz", "/version")
_TRUE = ("1", "true", "True")


class ApiHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    state: ServerState

    def shutdown_request(self, request: Any) -> None:
        # A socket marked for reset is closed without the FIN that shutdown() would send; with
        # SO_LINGER 0 the peer then sees ECONNRESET, like a crashed server or a dropped link.
        if self.state.connections.take_reset(request):
            try:
                request.close()
            except OSError:
                pass
            return
        super().shutdown_request(request)


class ApiRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ApiHTTPServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without NODELAY, Nagle holds the body
        # until the client's delayed ACK (~40 ms per request). Go's net/http sets it too.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.state.connections.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.state.connections.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log and structlog replace stderr lines

    def do_GET(self) -> None:
        handle(self.server.state, self, "GET")

    def do_POST(self) -> None:
        handle(self.server.state, self, "POST")

    def do_PUT(self) -> None:
        handle(self.server.state, self, "PUT")

    def do_PATCH(self) -> None:
        handle(self.server.state, self, "PATCH")

    def do_DELETE(self) -> None:
        handle(self.server.state, self, "DELETE")


def _mark_reset(state: ServerState, h: ApiRequestHandler) -> None:
    h.close_connection = True
    state.connections.mark_reset(h.connection)


# ------------------------------------------------------------ HTTP


def handle(state: ServerState, h: ApiRequestHandler, method: str) -> None:
    parts = urlsplit(h.path)
    path = parts.path.rstrip("/") or "/"
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    raw = b""
    length = h.headers.get("Content-Length") or "0"
    if not length.isdigit():
        h.send_error(400, "bad Content-Length")
        h.close_connection = True
        return
    if int(length):
        raw = h.rfile.read(int(length))
    is_watch = method == "GET" and (query.get("watch") in _TRUE or "/watch/" in path)
    auth = h.headers.get("Authorization", "")
    user = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
    rec = state.faults.record(RequestRecord(method, path, query, _parse_body(raw), is_watch, user=user))
    try:
        decision = state.faults.decide(method, path, is_watch)
        if decision.delay and state.stopping.wait(decision.delay):
            _mark_reset(state, h)
            return
        if decision.outage == "reset":
            _mark_reset(state, h)
            return
        if decision.outage == "503":
            raise ApiError(503, "the server is currently unable to handle the request",
                           reason="ServiceUnavailable")
        if decision.fail is not None:
            rule = decision.fail
            raise ApiError(rule.code, rule.message or f"injected failure ({rule.code})",
                           retry_after=rule.retry_after)
        if state.require_token and path not in _OPEN_PATHS and auth != f"Bearer {state.require_token}":
            raise ApiError(401, "Unauthorized")
        _route(state, h, method, path, query, raw, rec)
    except ApiError as err:
        headers = {"Retry-After": str(math.ceil(err.retry_after))} if err.retry_after is not None else {}
        _send(state, h, rec, err.code, err.status(), headers)
    except (BrokenPipeError, ConnectionResetError):
        h.close_connection = True
    except Exception as exc:  # a bug here must answer 500, not kill the connection thread
        log.exception("apiserver_internal_error", method=method, path=path, error=str(exc))
        try:
            _send(state, h, rec, 500, ApiError(500, f"internal error: {exc}").status())
        except OSError:
            h.close_connection = True


def _send(state: ServerState, h: ApiRequestHandler, rec: RequestRecord, code: int, body: Any,
          headers: dict[str, str] | None = None, content_type: str = "application/json") -> None:
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    # Record the status before the client can read the response: a test that has its answer
    # must find the request logged with its status, not still 0.
    state.faults.set_status(rec, code)
    h.send_response(code)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    h.send_header("Audit-Id", str(uuid.uuid4()))
    h.send_header("Cache-Control", "no-cache, private")
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)


def _version_doc(state: ServerState) -> dict[str, str]:
    r = state.release
    return {"major": "1", "minor": str(r), "emulationMajor": "1", "emulationMinor": str(r),
            "minCompatibilityMajor": "1", "minCompatibilityMinor": str(r - 1),
            "gitVersion": f"v1.{r}.0", "gitCommit": "0" * 40, "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25.0", "compiler": "gc",
            "platform": "linux/amd64"}


def _find_gv(state: ServerState, group: str, version: str) -> GroupVersion | None:
    for gv in state.group_versions:
        if gv.group == group and gv.version == version:
            return gv
    return None


def _route(state: ServerState, h: ApiRequestHandler, method: str, path: str, query: dict[str, str], raw: bytes,
           rec: RequestRecord) -> None:
    not_found = ApiError(404, "the server could not find the requested resource")
    if path in ("/healthz", "/livez", "/readyz"):
        _send(state, h, rec, 200, b"ok", content_type="text/plain; charset=utf-8")
        return
    if method == "GET" and path == "/version":
        _send(state, h, rec, 200, _version_doc(state))
        return
    if method == "GET" and path == "/api":
        host = state.url.split("//", 1)[-1]
        _send(state, h, rec, 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs":
                                 [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]})
        return
    if method == "GET" and path == "/apis":
        _send(state, h, rec, 200, api_group_list(state.group_versions))
        return
    segs = [s for s in path.split("/") if s]
    if segs[:1] == ["api"] and len(segs) >= 2:
        group, version, rest = "", segs[1], segs[2:]
    elif segs[:1] == ["apis"] and len(segs) == 2:
        if method == "GET" and any(gv.group == segs[1] for gv in state.group_versions):
            _send(state, h, rec, 200, api_group(segs[1], state.group_versions))
            return
        raise not_found
    elif segs[:1] == ["apis"] and len(segs) >= 3:
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        raise not_found
    gv = _find_gv(state, group, version)
    if gv is None:
        raise not_found
    if not rest:
        if method != "GET":
            raise ApiError(405, f"{method} is not allowed on {path}")
        _send(state, h, rec, 200, api_resource_list(gv))
        return
    watch_path = rest[0] == "watch"
    if watch_path:
        rest = rest[1:]
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces" and gv.find(rest[2]) is not None:
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise not_found
    rt = gv.find(rest[0])
    if rt is None or (namespace is not None and not rt.namespaced):
        raise not_found
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and not (sub == "status" and rt.status_subresource):
        raise not_found
    if rt.namespaced and name is not None and namespace is None:
        raise not_found
    t = Target(rt, version, namespace if rt.namespaced else None, name, sub)
    _dispatch(state, h, method, t, query, raw, rec, watch_path)


def _dispatch(state: ServerState, h: ApiRequestHandler, method: str, t: Target, query: dict[str, str], raw: bytes,
              rec: RequestRecord, watch_path: bool) -> None:
    dry_run = query.get("dryRun") == "All"
    if t.rt.namespaced and t.namespace is None and method == "DELETE":
        raise ApiError(405, "DELETE across all namespaces is not allowed")
    if method == "GET":
        try:
            selector = Selector.parse(query.get("labelSelector"), query.get("fieldSelector"))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if watch_path or query.get("watch") in _TRUE:
            if t.name is not None:  # legacy single-object watch
                selector = Selector(selector.labels, selector.fields + Selector.parse(
                    None, f"metadata.name={t.name}").fields)
                t = Target(t.rt, t.version, t.namespace)
            _serve_watch(state, h, t, selector, query, rec)
        elif t.name is not None:
            _send(state, h, rec, 200, state.registry.get(t))
        else:
            _serve_list(state, h, t, selector, query, rec)
    elif method == "POST" and t.name is None:
        _send(state, h, rec, 201, state.registry.create(t, _json_body(raw), dry_run))
    elif method == "PUT" and t.name is not None:
        _send(state, h, rec, 200, state.registry.update(t, _json_body(raw), dry_run))
    elif method == "PATCH" and t.name is not None:
        ctype = h.headers.get("Content-Type", "")
        obj = state.registry.patch(t, ctype, raw, dry_run, query.get("fieldManager"))
        _send(state, h, rec, 200, obj)
    elif method == "DELETE" and t.name is not None:
        options = _json_body(raw) if raw.strip() else None
        _send(state, h, rec, 200, state.registry.delete(t, options if isinstance(options, dict) else None, dry_run))
    elif method == "DELETE":
        try:
            selector = Selector.parse(query.get("labelSelector"), query.get("fieldSelector"))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        _send(state, h, rec, 200, state.registry.delete_collection(t, selector, dry_run))
    else:
        raise ApiError(405, f"{method} is not allowed here")


def _serve_list(state: ServerState, h: ApiRequestHandler, t: Target, selector: Selector, query: dict[str, str],
                rec: RequestRecord) -> None:
    limit: int | None = None
    if query.get("limit"):
        try:
            limit = int(query["limit"])
        except ValueError:
            raise ApiError(400, f"invalid limit {query['limit']!r}") from None
    after: tuple[str, str] | None = None
    if query.get("continue"):
        try:
            token = json.loads(base64.urlsafe_b64decode(query["continue"].encode()))
            token_rv, after = int(token["rv"]), (token["start"][0], token["start"][1])
        except (ValueError, KeyError, TypeError, IndexError):
            raise ApiError(400, "invalid continue token") from None
        if token_rv < state.store.oldest:
            raise ApiError(410, "The provided continue parameter is too old to display a consistent "
                                "list result. You can start a new list without the continue parameter.",
                           reason="Expired")
    items, rv, last = state.registry.list(t, selector, limit if limit and limit > 0 else None, after)
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if last is not None:
        token = {"rv": rv, "start": list(last)}
        meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
    _send(state, h, rec, 200, {"kind": f"{t.rt.kind}List", "apiVersion": t.api_version,
                             "metadata": meta, "items": items})


# ------------------------------------------------------------ watch


def _serve_watch(state: ServerState, h: ApiRequestHandler, t: Target, selector: Selector, query: dict[str, str],
                 rec: RequestRecord) -> None:
    try:
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else state.default_watch_timeout
    except ValueError:
        raise ApiError(400, f"invalid timeoutSeconds {query['timeoutSeconds']!r}") from None
    bookmarks = query.get("allowWatchBookmarks") in _TRUE
    send_initial = query.get("sendInitialEvents") in _TRUE
    if send_initial and query.get("resourceVersionMatch") != "NotOlderThan":
        raise ApiError(422, "resourceVersionMatch: Forbidden: sendInitialEvents requires setting "
                            "resourceVersionMatch to NotOlderThan", reason="Invalid")
    expired: ApiError | None = None
    initial: list[dict[str, Any]] = []
    cursor = 0
    try:
        initial, cursor = state.registry.watch_start(t, selector,
                                                     None if send_initial else query.get("resourceVersion"))
    except ApiError as err:
        if err.code != 410:
            raise
        expired = err  # the real server answers 200 and sends the 410 as an ERROR event
    state.faults.set_status(rec, 200)  # before the client can see the answer (see _send)
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Audit-Id", str(uuid.uuid4()))
    h.send_header("Cache-Control", "no-cache, private")
    h.end_headers()
    h.close_connection = True
    epoch = state.watches.opened()
    try:
        _stream(state, h, t, selector, initial, cursor, expired, send_initial, bookmarks, timeout, epoch)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass  # the client went away
    finally:
        state.watches.closed()


def _stream(state: ServerState, h: ApiRequestHandler, t: Target, selector: Selector, initial: list[dict[str, Any]],
            cursor: int, expired: ApiError | None, send_initial: bool, bookmarks: bool,
            timeout: float, epoch: int) -> None:
    def write(events: list[dict[str, Any]]) -> None:
        if not events:
            return
        data = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in events)
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        h.wfile.flush()

    def bookmark(rv: int, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if annotations:
            meta["annotations"] = annotations
        return {"type": "BOOKMARK", "object": {"kind": t.rt.kind, "apiVersion": t.api_version, "metadata": meta}}

    if expired is not None:
        write([{"type": "ERROR", "object": expired.status()}])
        h.wfile.write(b"0\r\n\r\n")
        return
    write(initial)
    if send_initial:
        write([bookmark(cursor, {"k8s.io/initial-events-end": "true"})])
    now = time.monotonic()
    deadline = now + max(0.0, timeout)
    next_bookmark = now + state.bookmark_interval
    while True:
        out: list[dict[str, Any]] = []
        ending: str | None = None  # "end" | "reset"
        with state.store.lock:
            while True:
                if state.stopping.is_set():
                    ending = "reset"
                    break
                if state.watches.epoch != epoch:
                    ending = state.watches.close_mode
                    break
                try:
                    events = state.store.events_after(cursor)
                except ApiError as err:
                    out.append({"type": "ERROR", "object": err.status()})
                    ending = "end"
                    break
                if events:
                    cursor = events[-1].rv
                    for ev in events:
                        seen = state.registry.watch_event(t, selector, ev)
                        if seen is not None:
                            out.append(seen)
                    if out:
                        break
                now = time.monotonic()
                if now >= deadline:
                    ending = "end"
                    break
                if bookmarks and now >= next_bookmark:
                    out.append(bookmark(cursor))
                    next_bookmark = now + state.bookmark_interval
                    break
                wake = min(deadline, next_bookmark) if bookmarks else deadline
                # Wake at least every 0.25 s to notice a client that hung up.
                state.store.lock.wait(min(wake - now, 0.25))
                if _peer_closed(h.connection):
                    return
        if ending == "reset":
            _mark_reset(state, h)
            return
        write(out)
        if ending == "end":
            h.wfile.write(b"0\r\n\r\n")
            return


def _peer_closed(conn: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _parse_body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8") or "null")
    except ValueError as exc:
        raise ApiError(400, f"error decoding request body: {exc}") from None
