"""The HTTP server's own counters, as a plain value the renderer can read.

A leaf module (no imports from the server or the renderer) so render.py can name the type
without importing the server, which imports render.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HttpStats:
    connections_open: int = 0
    connection_limit: int = 0
    refused: int = 0  # closed at once: at the ceiling with no idle connection to give way
    evicted: int = 0  # idle connections closed to make room for a new one at the ceiling
    tls_failed: int = 0  # handshakes that failed (plain HTTP to the TLS port, bad client cert)
    timed_out: Mapping[str, int] = field(default_factory=dict)  # phase -> count
    requests: Mapping[str, int] = field(default_factory=dict)  # status code -> count
