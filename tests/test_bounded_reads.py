"""Every API answer is read with a size bound (issue 13): a huge list response and a watch
stream that never sends a newline are cut off at the bound, the request fails like any
transport failure (so callers back off and retry), and memory does not grow with the attack.

The hostile server is a raw socket server: it sends what no real API server would.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from exporter.k8s import connection
from exporter.k8s.connection import ApiError, ResponseTooLarge, get_json, stream_watch
from tests.k8s_helpers import api_client

LIMIT = 256 * 1024


@contextmanager
def hostile_server(head: bytes, body_chunk: bytes, chunks: int) -> Iterator[tuple[str, list[int]]]:
    """Answers every request with ``head`` and then ``chunks`` times ``body_chunk`` (or until
    the client hangs up); reports how many bytes it managed to send per connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    sent: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    conn.recv(65536)
                    conn.sendall(head)
                    n = 0
                    for _ in range(chunks):
                        conn.sendall(body_chunk)
                        n += len(body_chunk)
                except OSError:
                    pass
                sent.append(n)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", sent
    finally:
        stop.set()
        srv.close()
        t.join(5)


def _peak_during(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_a_huge_list_response_is_cut_at_the_bound() -> None:
    # Chunked, no Content-Length: the client only learns the size by reading.
    chunk = b"1000\r\n" + b"x" * 0x1000 + b"\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    with hostile_server(head, chunk, chunks=100_000) as (url, _sent):  # 400 MB on offer
        api = api_client(url)
        errors: list[ApiError] = []

        def attempt() -> None:
            try:
                get_json(api, "/apis/resource.k8s.io/v1/resourceslices", max_bytes=LIMIT)
            except ApiError as e:
                errors.append(e)

        peak = _peak_during(attempt)
    assert len(errors) == 1 and isinstance(errors[0], ResponseTooLarge), errors
    assert errors[0].retryable, "an oversized answer is retried with backoff like a transport failure"
    assert "exceeds" in str(errors[0])
    # Memory held is bounded by the limit (plus the client's buffers), not by what was offered.
    assert peak < 8 * LIMIT, peak


def test_a_declared_oversized_body_is_refused_before_reading() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
    with hostile_server(head, b"{", chunks=1) as (url, _), pytest.raises(ResponseTooLarge, match="declared"):
        get_json(api_client(url), "/api/v1/nodes/n1", max_bytes=LIMIT)


def test_a_watch_line_without_newline_is_cut_at_the_bound() -> None:
    chunk = b"1000\r\n" + b"y" * 0x1000 + b"\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    with hostile_server(head, chunk, chunks=100_000) as (url, _):
        api = api_client(url)
        errors: list[ApiError] = []

        def attempt() -> None:
            try:
                for _ in stream_watch(api, "/api/v1/nodes", timeout=30, max_line=LIMIT):
                    pass
            except ApiError as e:
                errors.append(e)

        peak = _peak_during(attempt)
    assert len(errors) == 1 and isinstance(errors[0], ResponseTooLarge), errors
    assert "watch event line" in str(errors[0])
    assert peak < 8 * LIMIT, peak


def test_the_defaults_are_bounds_not_infinity() -> None:
    assert 0 < connection.MAX_WATCH_LINE_BYTES <= connection.MAX_RESPONSE_BYTES <= 256 * 1024 * 1024
