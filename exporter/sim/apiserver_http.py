"""The HTTP side of the fake API server: routing, responses, chunked watch streams.

Functions take the FakeApiServer whose state (registry, store, faults, served versions,
watch bookkeeping) they act on; the handler classes plug them into http.server.
"""

from __future__ import annotations

import base64
import json
import math
import select
import socket
import struct
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import structlog

from .apiserver_catalog import GroupVersion, api_group, api_group_list, api_resource_list
from .apiserver_faults import RequestRecord
from .apiserver_registry import Target
from .apiserver_selectors import Selector
from .apiserver_store import ApiError

if TYPE_CHECKING:
    from .apiserver import FakeApiServer

log = structlog.get_logger(__name__)

_OPEN_PATHS = ("/healthz", "/livez", "/readyz", "/version")
_TRUE = ("1", "true", "True")


class ApiHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: "FakeApiServer"

    def shutdown_request(self, request: Any) -> None:
        # A socket marked for reset is closed without the FIN that shutdown() would send; with
        # SO_LINGER 0 the peer then sees ECONNRESET, like a crashed server or a dropped link.
        if _take_reset(self.app, request):
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
        _track(self.server.app, self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            _track(self.server.app, self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the request log and structlog replace stderr lines

    def do_GET(self) -> None:
        handle(self.server.app, self, "GET")

    def do_POST(self) -> None:
        handle(self.server.app, self, "POST")

    def do_PUT(self) -> None:
        handle(self.server.app, self, "PUT")

    def do_PATCH(self) -> None:
        handle(self.server.app, self, "PATCH")

    def do_DELETE(self) -> None:
        handle(self.server.app, self, "DELETE")


def _track(app: FakeApiServer, conn: socket.socket, add: bool) -> None:
    with app._conn_lock:
        if add:
            app._connections.add(conn)
        else:
            app._connections.discard(conn)


def _mark_reset(app: FakeApiServer, h: ApiRequestHandler) -> None:
    try:
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    h.close_connection = True
    with app._conn_lock:
        app._resets.add(id(h.connection))


def _take_reset(app: FakeApiServer, conn: socket.socket) -> bool:
    with app._conn_lock:
        if id(conn) in app._resets:
            app._resets.discard(id(conn))
            return True
        return False


# ------------------------------------------------------------ HTTP


def handle(app: FakeApiServer, h: ApiRequestHandler, method: str) -> None:
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
    rec = app.faults.record(RequestRecord(method, path, query, _parse_body(raw), is_watch))
    try:
        decision = app.faults.decide(method, path, is_watch)
        if decision.delay and app._stopping.wait(decision.delay):
            _mark_reset(app, h)
            return
        if decision.outage == "reset":
            _mark_reset(app, h)
            return
        if decision.outage == "503":
            raise ApiError(503, "the server is currently unable to handle the request",
                           reason="ServiceUnavailable")
        if decision.fail is not None:
            rule = decision.fail
            raise ApiError(rule.code, rule.message or f"injected failure ({rule.code})",
                           retry_after=rule.retry_after)
        if app.require_token and path not in _OPEN_PATHS:
            auth = h.headers.get("Authorization", "")
            if auth != f"Bearer {app.require_token}":
                raise ApiError(401, "Unauthorized")
        _route(app, h, method, path, query, raw, rec)
    except ApiError as err:
        headers = {"Retry-After": str(math.ceil(err.retry_after))} if err.retry_after is not None else {}
        _send(app, h, rec, err.code, err.status(), headers)
    except (BrokenPipeError, ConnectionResetError):
        h.close_connection = True
    except Exception as exc:  # a bug here must answer 500, not kill the connection thread
        log.exception("apiserver.internal_error", method=method, path=path, error=str(exc))
        try:
            _send(app, h, rec, 500, ApiError(500, f"internal error: {exc}").status())
        except OSError:
            h.close_connection = True


def _send(app: FakeApiServer, h: ApiRequestHandler, rec: RequestRecord, code: int, body: Any,
          headers: dict[str, str] | None = None, content_type: str = "application/json") -> None:
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    # Record the status before the client can read the response: a test that has its answer
    # must find the request logged with its status, not still 0.
    app.faults.set_status(rec, code)
    h.send_response(code)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    h.send_header("Audit-Id", str(uuid.uuid4()))
    h.send_header("Cache-Control", "no-cache, private")
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)


def _version_doc(app: FakeApiServer) -> dict[str, str]:
    r = app.release
    return {"major": "1", "minor": str(r), "emulationMajor": "1", "emulationMinor": str(r),
            "minCompatibilityMajor": "1", "minCompatibilityMinor": str(r - 1),
            "gitVersion": f"v1.{r}.0", "gitCommit": "0" * 40, "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25.0", "compiler": "gc",
            "platform": "linux/amd64"}


def _find_gv(app: FakeApiServer, group: str, version: str) -> GroupVersion | None:
    for gv in app._gvs:
        if gv.group == group and gv.version == version:
            return gv
    return None


def _route(app: FakeApiServer, h: ApiRequestHandler, method: str, path: str, query: dict[str, str], raw: bytes,
           rec: RequestRecord) -> None:
    not_found = ApiError(404, "the server could not find the requested resource")
    if path in ("/healthz", "/livez", "/readyz"):
        _send(app, h, rec, 200, b"ok", content_type="text/plain; charset=utf-8")
        return
    if method == "GET" and path == "/version":
        _send(app, h, rec, 200, _version_doc(app))
        return
    if method == "GET" and path == "/api":
        host = app.url.split("//", 1)[-1]
        _send(app, h, rec, 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs":
                                 [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]})
        return
    if method == "GET" and path == "/apis":
        _send(app, h, rec, 200, api_group_list(app._gvs))
        return
    segs = [s for s in path.split("/") if s]
    if segs[:1] == ["api"] and len(segs) >= 2:
        group, version, rest = "", segs[1], segs[2:]
    elif segs[:1] == ["apis"] and len(segs) == 2:
        if method == "GET" and any(gv.group == segs[1] for gv in app._gvs):
            _send(app, h, rec, 200, api_group(segs[1], app._gvs))
            return
        raise not_found
    elif segs[:1] == ["apis"] and len(segs) >= 3:
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        raise not_found
    gv = _find_gv(app, group, version)
    if gv is None:
        raise not_found
    if not rest:
        if method != "GET":
            raise ApiError(405, f"{method} is not allowed on {path}")
        _send(app, h, rec, 200, api_resource_list(gv))
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
    _dispatch(app, h, method, t, query, raw, rec, watch_path)


def _dispatch(app: FakeApiServer, h: ApiRequestHandler, method: str, t: Target, query: dict[str, str], raw: bytes,
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
            _serve_watch(app, h, t, selector, query, rec)
        elif t.name is not None:
            _send(app, h, rec, 200, app.registry.get(t))
        else:
            _serve_list(app, h, t, selector, query, rec)
    elif method == "POST" and t.name is None:
        _send(app, h, rec, 201, app.registry.create(t, _json_body(raw), dry_run))
    elif method == "PUT" and t.name is not None:
        _send(app, h, rec, 200, app.registry.update(t, _json_body(raw), dry_run))
    elif method == "PATCH" and t.name is not None:
        ctype = h.headers.get("Content-Type", "")
        obj = app.registry.patch(t, ctype, raw, dry_run, query.get("fieldManager"))
        _send(app, h, rec, 200, obj)
    elif method == "DELETE" and t.name is not None:
        options = _json_body(raw) if raw.strip() else None
        _send(app, h, rec, 200, app.registry.delete(t, options if isinstance(options, dict) else None, dry_run))
    elif method == "DELETE":
        try:
            selector = Selector.parse(query.get("labelSelector"), query.get("fieldSelector"))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        _send(app, h, rec, 200, app.registry.delete_collection(t, selector, dry_run))
    else:
        raise ApiError(405, f"{method} is not allowed here")


def _serve_list(app: FakeApiServer, h: ApiRequestHandler, t: Target, selector: Selector, query: dict[str, str],
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
        if token_rv < app.store.oldest:
            raise ApiError(410, "The provided continue parameter is too old to display a consistent "
                                "list result. You can start a new list without the continue parameter.",
                           reason="Expired")
    items, rv, last = app.registry.list(t, selector, limit if limit and limit > 0 else None, after)
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if last is not None:
        token = {"rv": rv, "start": list(last)}
        meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
    _send(app, h, rec, 200, {"kind": f"{t.rt.kind}List", "apiVersion": t.api_version,
                             "metadata": meta, "items": items})


# ------------------------------------------------------------ watch


def _serve_watch(app: FakeApiServer, h: ApiRequestHandler, t: Target, selector: Selector, query: dict[str, str],
                 rec: RequestRecord) -> None:
    try:
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else app.default_watch_timeout
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
        initial, cursor = app.registry.watch_start(t, selector, None if send_initial else query.get("resourceVersion"))
    except ApiError as err:
        if err.code != 410:
            raise
        expired = err  # the real server answers 200 and sends the 410 as an ERROR event
    app.faults.set_status(rec, 200)  # before the client can see the answer (see _send)
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Audit-Id", str(uuid.uuid4()))
    h.send_header("Cache-Control", "no-cache, private")
    h.end_headers()
    h.close_connection = True
    with app.store.lock:
        epoch = app._watch_epoch
        app._open_watches += 1
    try:
        _stream(app, h, t, selector, initial, cursor, expired, send_initial, bookmarks, timeout, epoch)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass  # the client went away
    finally:
        with app.store.lock:
            app._open_watches -= 1


def _stream(app: FakeApiServer, h: ApiRequestHandler, t: Target, selector: Selector, initial: list[dict[str, Any]],
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
    next_bookmark = now + app.bookmark_interval
    while True:
        out: list[dict[str, Any]] = []
        ending: str | None = None  # "end" | "reset"
        with app.store.lock:
            while True:
                if app._stopping.is_set():
                    ending = "reset"
                    break
                if app._watch_epoch != epoch:
                    ending = app._watch_close_mode
                    break
                try:
                    events = app.store.events_after(cursor)
                except ApiError as err:
                    out.append({"type": "ERROR", "object": err.status()})
                    ending = "end"
                    break
                if events:
                    cursor = events[-1].rv
                    for ev in events:
                        seen = app.registry.watch_event(t, selector, ev)
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
                    next_bookmark = now + app.bookmark_interval
                    break
                wake = min(deadline, next_bookmark) if bookmarks else deadline
                # Wake at least every 0.25 s to notice a client that hung up.
                app.store.lock.wait(min(wake - now, 0.25))
                if _peer_closed(h.connection):
                    return
        if ending == "reset":
            _mark_reset(app, h)
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
