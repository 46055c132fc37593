"""HTTP/1.1 message syntax at the endpoint, as RFC 9112 says (h11 parses; the server adds the
refusals h11 leaves to it), against the real server on a real socket.

Each case sends raw bytes and reads everything the server sends until it closes, then splits
that into responses: a refused head gets exactly one 400 and the connection is closed, so no
byte after it can be read as another request (the request-smuggling class: a proxy in front
that reads the head differently would forward those bytes as a request of its own). Nothing is
timed; every read waits for the server's close, bounded by a generous deadline.
"""

from __future__ import annotations

import socket

import pytest
from kit_helpers import publish

from exporter.metrics.server import MetricsServer
from exporter.metrics.web import Limits, head_problem


@pytest.fixture(scope="module")
def server():
    s = MetricsServer("127.0.0.1", 0, lambda: (True, "ready"), limits=Limits(max_connections=16, idle_timeout=2.0, header_timeout=2.0))
    publish(s)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def exchange(s: MetricsServer, raw: bytes, heads: tuple[int, ...] = (), timeout: float = 60.0) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """Send ``raw``; (the responses, whether the server closed the connection), read until the
    server closes it (at the latest its idle timeout after the last answer). ``heads``: the
    positions of answers to HEAD requests, which have a Content-Length and no body."""
    c = socket.create_connection(("127.0.0.1", s.port), timeout=timeout)
    got = b""
    closed = False
    try:
        c.sendall(raw)
        while chunk := c.recv(65536):
            got += chunk
        closed = True
    except ConnectionResetError:
        closed = True
    finally:
        c.close()
    return parse_responses(got, heads), closed


def parse_responses(data: bytes, heads: tuple[int, ...] = ()) -> list[tuple[int, dict[str, str], bytes]]:
    out: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"an incomplete response head: {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = 0 if len(out) in heads else int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


OK = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"

REFUSED = {
    # RFC 9112 2.2: a recipient MAY take a bare LF as a line end; a server in front of which a
    # proxy may not is safer refusing it. Here the bare LF hides a Content-Length from a reader
    # that splits on CRLF, and shows it to one that does not.
    "bare LF before a header": b"GET /healthz HTTP/1.1\r\nHost: x\nContent-Length: 38\r\n\r\nGET /nothing HTTP/1.1\r\nHost: x\r\n\r\n",
    "bare LF line ends": b"GET /healthz HTTP/1.1\nHost: x\n\n",
    # RFC 9112 2.2: a bare CR must be refused or replaced by SP
    "bare CR in a header": b"GET /healthz HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
    "bare CR in a value": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\rc\r\n\r\n",
    # RFC 9110 5.1: a field name is a token
    "NUL in a field name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-\x00A: b\r\n\r\n",
    "TAB in a field name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-\tA: b\r\n\r\n",
    "space before the colon": b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n",
    # RFC 9112 5.2: a server must refuse obs-fold with 400 or replace it (h11 replaces)
    "obs-fold": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n",
    "obs-fold with a tab": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: b\r\n\tc\r\n\r\n",
    # RFC 9110 8.6 / RFC 9112 6.3: repeated or conflicting lengths
    "two equal Content-Lengths": b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\nGET /",
    "two different Content-Lengths": b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nGET /x",
    "a Content-Length list": b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\nGET /",
    # RFC 9112 3.2: an HTTP/1.1 request without Host
    "no Host": b"GET /healthz HTTP/1.1\r\n\r\n",
    "a request line with spaces in the target": b"GET /healthz now HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_head_rfc_9112_lets_us_refuse_gets_400_and_the_connection_closed(server, case):
    responses, closed = exchange(server, REFUSED[case] + OK)  # a valid request right behind it
    assert [r[0] for r in responses] == [400], (case, responses)
    assert closed and responses[0][1].get("connection") == "close"


def test_the_smuggling_case_from_the_issue_is_one_400():
    """Issue 25, item 7: with a bare LF before Content-Length the old parser answered the bytes
    after the head as a second request ([200, 404]) where h11 reads them as a body."""
    assert head_problem(REFUSED["bare LF before a header"].split(b"\r\n\r\n")[0] + b"\r\n\r\n") == "bare LF in the request head"
    for fine in (OK, b"GET / HTTP/1.0\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a b\tc\r\n\r\n"):
        assert head_problem(fine) is None


def test_content_length_with_transfer_encoding_is_answered_then_closed(server):
    """RFC 9112 6.1: a server may refuse such a request or go by Transfer-Encoding, and must close
    the connection after answering. Bodies are never read here: answered, closed, and the bytes
    after the head are never taken for a request."""
    raw = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + OK
    responses, closed = exchange(server, raw)
    assert [r[0] for r in responses] == [405] and closed and responses[0][1]["connection"] == "close"


def test_pipelined_requests_are_answered_in_order_on_one_connection(server):
    """RFC 9112 9.3.2: a server may process pipelined safe requests, and answers them in order."""
    raw = OK + b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n" + b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    responses, closed = exchange(server, raw, heads=(2,))
    assert [(r[0], r[2]) for r in responses] == [(200, b"ok\n"), (200, b"ready\n"), (200, b""), (404, b"not found\n")]
    assert int(responses[2][1]["content-length"]) == len(server.source.exposition().body)  # HEAD: the length, no body
    assert closed and responses[3][1]["connection"] == "close"
    assert all("connection" not in r[1] for r in responses[:3])  # kept alive until asked to close


def test_a_request_after_connection_close_is_not_answered(server):
    responses, closed = exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + OK)
    assert [r[0] for r in responses] == [200] and closed


def test_a_request_split_across_writes_is_one_request(server):
    c = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        for piece in (b"GET /hea", b"lthz HTTP/1.1\r\nHo", b"st: x\r\nConnection: cl", b"ose\r\n", b"\r\n"):
            c.sendall(piece)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
    finally:
        c.close()
    assert [(r[0], r[2]) for r in parse_responses(got)] == [(200, b"ok\n")]


def test_methods_are_case_sensitive(server):
    """RFC 9110 9.1: "get" is not GET."""
    responses, _ = exchange(server, b"get /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert [r[0] for r in responses] == [405]
