"""Scrape latency with and without an attack on the endpoint (bench/run.py scrape-attack).

Ten scrapers (processes, keep-alive connections) alternate between /metrics and /static (the
same bytes served without negotiation: the baseline), first on a quiet server, then while an
attacker process holds thousands of idle connections, slow-header senders and oversized heads
(re-opening what the server cuts), then while flooders hammer /metrics. Scraper errors
(a refused or reset scrape) are counted, not hidden. The numbers are wall-clock latencies on
whatever machine runs this: on a shared 2-core box they move with the neighbours.
"""

from __future__ import annotations

import http.client
import multiprocessing as mp
import selectors
import socket
import threading
import time
from collections.abc import Callable

# Load processes start from multiprocessing's fork server, not by fork(): this process runs
# threads (the agent, grpcio's server for the kubelet emulation), and a child forked while one
# of them holds a lock can hang; once a scraper did, with grpcio's threads restarted in it.
LOAD_START_METHOD = "forkserver"


def _go_on(stop: mp.Event) -> bool:
    """A load process's loop condition: not told to stop, and the process that started it still
    alive (a benchmark killed by a test's timeout sends no stop: its load must not outlive it)."""
    parent = mp.parent_process()
    return not stop.is_set() and (parent is None or parent.is_alive())


def _scraper(host: str, port: int, path: str, n: int, q: mp.Queue) -> None:
    lat, errors = [], 0
    conn = http.client.HTTPConnection(host, port, timeout=10)
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            conn.request("GET", path, headers={"Accept-Encoding": "gzip"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors += 1
                continue
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=10)
            continue
        lat.append(time.perf_counter() - t0)
    q.put((lat, errors))


def _load(host: str, port: int, path: str, concurrency: int, per_client: int) -> tuple[list[float], int]:
    ctx = mp.get_context(LOAD_START_METHOD)
    q = ctx.Queue()
    procs = [ctx.Process(target=_scraper, args=(host, port, path, per_client, q)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    out: list[float] = []
    errors = 0
    for _ in procs:
        lat, err = q.get(timeout=600)
        out.extend(lat)
        errors += err
    for p in procs:
        p.join()
    return out, errors


REOPEN_PER_SECOND = 1000


def _attacker(host: str, port: int, idle: int, slow: int, bombs: int, stop: mp.Event, out: mp.Queue) -> None:
    """Hold ``idle`` idle connections, ``slow`` slow-header senders (a byte a second) and
    ``bombs`` connections sending 256 KiB heads; re-open each one the server closes, at most
    REOPEN_PER_SECOND (held connections, not a connect flood: that one is the kernel's to
    absorb, and it costs the server an accept and a close per connection, within its CPU share)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, idle + slow + bombs + 256)), hard))
    sel = selectors.DefaultSelector()
    kinds: dict[socket.socket, str] = {}
    opened = 0

    def open_one(kind: str) -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        kinds[s] = kind
        sel.register(s, selectors.EVENT_READ, kind)
        opened += 1

    for kind, n in (("idle", idle), ("slow", slow), ("bomb", bombs)):
        for _ in range(n):
            open_one(kind)
    last_dribble = 0.0
    to_reopen: list[str] = []
    tokens, last = 0.0, time.monotonic()
    while _go_on(stop):
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                if s.recv(65536):
                    continue
            except OSError:
                pass
            sel.unregister(s)
            to_reopen.append(kinds.pop(s))
            s.close()
        now = time.monotonic()
        tokens, last = min(REOPEN_PER_SECOND / 5, tokens + (now - last) * REOPEN_PER_SECOND), now
        k = min(len(to_reopen), int(tokens))
        for kind in to_reopen[:k]:
            open_one(kind)
        del to_reopen[:k]
        tokens -= k
        now = time.monotonic()
        if now - last_dribble >= 1.0:
            last_dribble = now
            for s, kind in list(kinds.items()):
                try:
                    if kind == "slow":
                        s.send(b"X")
                    elif kind == "bomb":
                        s.send(b"GET / HTTP/1.1\r\nX: " + b"A" * 262144)
                except OSError:
                    pass
    out.put(opened)
    for s in kinds:
        s.close()


def _flooder(host: str, port: int, threads: int, stop: mp.Event) -> None:
    def hammer() -> None:
        while _go_on(stop):
            c = http.client.HTTPConnection(host, port, timeout=10)
            try:
                while _go_on(stop):
                    c.request("GET", "/metrics")
                    c.getresponse().read()
            except (OSError, http.client.HTTPException):
                pass
            finally:
                c.close()

    ts = [threading.Thread(target=hammer, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def requesters(host: str, port: int, clients: int, path: str, stop: mp.Event, out: mp.Queue, progress: mp.Value | None = None) -> None:
    """``clients`` connections that keep requesting ``path`` (like ``wrk -c``): each sends a
    request, reads the whole answer, and sends the next on the same connection; one the server
    closes (or refuses, or resets) is re-opened at once. One process, one selector, so a thousand
    clients cost one core at most. Puts (answers read, connections lost) on ``out`` at the end;
    ``progress`` (if given) counts answers as they come."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, clients + 256)), hard))
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, bytearray] = {}
    answered = lost = 0

    def open_one() -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        bufs[s] = bytearray()
        sel.register(s, selectors.EVENT_WRITE)  # writable: connected, send the first request

    def drop(s: socket.socket) -> None:
        sel.unregister(s)
        bufs.pop(s, None)
        s.close()

    for _ in range(clients):
        open_one()
    while _go_on(stop):
        for key, events in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                if events & selectors.EVENT_WRITE:
                    s.send(request)
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                chunk = s.recv(262144)
            except OSError:
                chunk = b""
            if not chunk:
                lost += 1
                drop(s)
                open_one()
                continue
            buf = bufs[s]
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            lines = bytes(buf[:end]).lower().split(b"\r\n")
            length = next((int(line[15:]) for line in lines if line.startswith(b"content-length:")), 0)
            if len(buf) < end + 4 + length:
                continue
            answered += 1
            if progress is not None:
                with progress.get_lock():
                    progress.value += 1
            del buf[: end + 4 + length]
            if b"connection: close" in lines:
                drop(s)
                open_one()
            else:
                try:
                    s.send(request)
                except OSError:
                    lost += 1
                    drop(s)
                    open_one()
    out.put((answered, lost))
    for s in list(bufs):
        s.close()


def bench(node_factory: Callable, scenario: dict, pct: Callable, results: dict, requests: int = 2000, idle: int = 3000, slow: int = 300, bombs: int = 20, flood_threads: int = 16) -> None:
    from agent_process import rendered, serve_static  # (bench/ is on the path: run by bench/run.py)

    node = node_factory(scenario)
    node.start()
    ctx = mp.get_context(LOAD_START_METHOD)
    try:
        server = node.agent.server
        serve_static(server, rendered(node.agent).gzipped)
        host, port = "127.0.0.1", server.port
        conc, per = 10, max(20, requests // 10)
        rows = []

        def measure(label: str, extra: dict) -> None:
            _load(host, port, "/metrics", conc, 10)  # warm up
            m, s, em, es = [], [], 0, 0
            for _ in range(4):  # alternate: neither side always meets the same machine state
                lat, err = _load(host, port, "/metrics", conc, max(1, per // 4))
                m += lat
                em += err
                lat, err = _load(host, port, "/static", conc, max(1, per // 4))
                s += lat
                es += err
            dev = node.agent.status.get("devices")
            st = server.stats()
            rows.append({
                "load": label, "requests": len(m), "errors": em + es,
                "metrics_p50_ms": pct(m, 50) * 1e3, "metrics_p99_ms": pct(m, 99) * 1e3,
                "static_p50_ms": pct(s, 50) * 1e3, "static_p99_ms": pct(s, 99) * 1e3,
                "ratio_p99": pct(m, 99) / pct(s, 99),
                "device_collection_ms": dev.duration * 1e3 if dev else None,
                "connections_open": st.connections_open, "evicted": st.evicted, "refused": st.refused,
                "timeouts": dict(st.timed_out), **extra,
            })

        measure("quiet", {})
        stop, out = ctx.Event(), ctx.Queue()
        att = ctx.Process(target=_attacker, args=(host, port, idle, slow, bombs, stop, out))
        att.start()
        time.sleep(3)  # let the attack build up to the connection ceiling
        try:
            measure(f"{idle} idle + {slow} slow + {bombs} header-bomb connections", {})
        finally:
            stop.set()
            opened = out.get(timeout=120)
            att.join(60)
        rows[-1]["attack_connections_opened"] = opened
        stop = ctx.Event()
        fl = ctx.Process(target=_flooder, args=(host, port, flood_threads, stop))
        fl.start()
        time.sleep(1)
        try:
            measure(f"flood: {flood_threads} keep-alive clients hammering /metrics", {})
        finally:
            stop.set()
            fl.join(60)
            if fl.is_alive():
                fl.terminate()
        gz = len(rendered(node.agent).gzipped)
        results["scrape_attack"] = {"scrapers": conc, "body_bytes_gzip": gz, "rows": rows}
        print(f"\nscrape under attack: 10 scrapers (gzip), body {gz} bytes gzipped, 64 devices")
        print("| load | requests | errors | /metrics p50 | /metrics p99 | static p50 | static p99 | p99 ratio | device collection |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            dc = f"{r['device_collection_ms']:.1f} ms" if r["device_collection_ms"] is not None else "-"
            print(f"| {r['load']} | {r['requests']} | {r['errors']} | {r['metrics_p50_ms']:.2f} ms | {r['metrics_p99_ms']:.2f} ms | {r['static_p50_ms']:.2f} ms | {r['static_p99_ms']:.2f} ms | {r['ratio_p99']:.2f} | {dc} |")
        st = server.stats()
        print(f"  server: {st.evicted} idle connections evicted, {st.refused} refused, timeouts {dict(st.timed_out)}, limit {st.connection_limit}")
    finally:
        node.stop()
