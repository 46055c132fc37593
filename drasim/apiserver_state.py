"""The state of one fake API server, shared by its facade and its HTTP side.

``apiserver.py`` (the public ``FakeApiServer``: lifecycle, faults, direct store access) and
``apiserver_http.py`` (routing, responses, watch streams) both act on one ``ServerState``
through its public attributes and methods; neither module imports the other's internals.
"""

from __future__ import annotations

import socket
import struct
import threading

from .apiserver_catalog import GroupVersion
from .apiserver_faults import FaultInjector
from .apiserver_registry import Registry
from .apiserver_store import Store


class Connections:
    """Open client connections (so stop() can wake handler threads blocked on keep-alive reads)
    and the ones marked to be reset instead of closed. Guarded by its own lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._resets: set[int] = set()

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._open.add(conn)
            else:
                self._open.discard(conn)

    def open(self) -> list[socket.socket]:
        with self._lock:
            return list(self._open)

    def mark_reset(self, conn: socket.socket) -> None:
        """Close ``conn`` with a TCP RST (SO_LINGER 0) when its handler finishes: the peer sees
        ECONNRESET, like a crashed server or a dropped link."""
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        with self._lock:
            self._resets.add(id(conn))

    def take_reset(self, conn: socket.socket) -> bool:
        with self._lock:
            if id(conn) in self._resets:
                self._resets.discard(id(conn))
                return True
            return False


class Watches:
    """Bookkeeping of open watch streams. Guarded by the store's condition lock, which every
    write notifies: a stream waits on it for new events, and ``close_all`` wakes it the same way."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.epoch = 0  # bumped by close_all(); each stream remembers the epoch it started in
        self.close_mode = "end"  # how streams of an older epoch end: "end" | "reset"
        self._open = 0

    def close_all(self, mode: str) -> None:
        if mode not in ("end", "reset"):
            raise ValueError("mode is 'end' or 'reset'")
        with self._store.lock:
            self.close_mode = mode
            self.epoch += 1
            self._store.lock.notify_all()

    def opened(self) -> int:
        """Count a new stream; returns the epoch it belongs to."""
        with self._store.lock:
            self._open += 1
            return self.epoch

    def closed(self) -> None:
        with self._store.lock:
            self._open -= 1

    def count(self) -> int:
        with self._store.lock:
            return self._open


class ServerState:
    """Everything a request handler needs; the facade configures it, the HTTP side reads it."""

    def __init__(self, release: int, group_versions: list[GroupVersion], store: Store, registry: Registry,
                 faults: FaultInjector, *, bookmark_interval: float, default_watch_timeout: float,
                 require_token: str | None) -> None:
        self.release = release  # Kubernetes minor version, e.g. 34
        self.group_versions = group_versions  # served, in discovery order
        self.store = store
        self.registry = registry
        self.faults = faults
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.require_token = require_token
        self.stopping = threading.Event()
        self.connections = Connections()
        self.watches = Watches(store)
        self.url = ""
