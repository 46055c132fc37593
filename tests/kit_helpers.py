"""The test kit: waiting, fetching and process helpers every test uses (tests/ is on sys.path).

    from kit_helpers import fetch, wait_until

    status, body = fetch(agent.server.url + "/readyz")
    wait_until(lambda: server.open_watches == 1, message="the watch")

The simulated node the agent tests run against is ``drasim.node.SimulatedNode`` (the same rig
the demo and the benchmarks use).

Waits are for a state or an event, bounded by a generous deadline (the suite runs on busy
2-core machines): a wait returns as soon as the state is reached, so a long deadline costs
nothing when the test passes and only says how long to keep trying before calling it a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from exporter.devices.model import DeviceIdentity, Vendor
from exporter.metrics.render import Exposition, Renderer, RenderState
from exporter.metrics.server import Expositions, MetricsServer

T = TypeVar("T")

DEADLINE = 30.0  # seconds: the default for any wait (generous on purpose, see the module docstring)


def wait_until(
    check: Callable[[], T | None],
    timeout: float = DEADLINE,
    interval: float = 0.02,
    message: str = "condition",
    *,
    ignore: tuple[type[BaseException], ...] = (),
    fatal: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``check`` until it returns something truthy, and return that.

    An exception of a type in ``ignore`` (and not in ``fatal``) counts as "not yet", e.g.
    ``ignore=(OSError,)`` while a server is still starting; the last one is reported if the
    deadline passes. Any other exception propagates at once (an assert inside ``check`` fails
    the test right away). Raises TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except fatal:
            raise
        except ignore as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {message}{detail}")
        time.sleep(interval)


def fetch(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url``: (status, body) for any HTTP status, 4xx/5xx included. A connection that
    fails (refused, reset, timed out) raises OSError."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the caller retries if it gets taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:  # type: ignore[type-arg]
    """Ctrl-C a process (the demo cleans up on SIGINT), kill it if it does not end in
    ``timeout`` seconds; its exit code."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def gpu(i: int, *, serial: int = 0) -> DeviceIdentity:
    """The identity of a node's ``i``-th full GPU, an 80 GiB H100: uuid ``GPU-<serial><i>-...``
    (another ``serial``: another board in the same slot), PCI bus 0x18 + ``i``, index and minor ``i``."""
    return DeviceIdentity(
        uuid=f"GPU-{serial:04d}{i:04d}-0000-0000-0000-000000000000", vendor=Vendor.NVIDIA, model="NVIDIA H100 80GB HBM3",
        pci_bus_id=f"0000:{0x18 + i:02x}:00.0", index=i, minor=i, memory_total_bytes=80 * 2**30,
    )


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape_samples(url: str) -> Samples:
    """GET ``url``/metrics (it must answer 200) and parse it (:func:`parse_samples`)."""
    status, raw = fetch(f"{url}/metrics")
    assert status == 200, status
    return parse_samples(raw.decode())


def parse_samples(body: str) -> Samples:
    """An exposition parsed with prometheus_client's parser: sample name -> [(labels, value), ...]."""
    out: Samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@contextmanager
def running_demo(port: int, *args: str, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> Iterator[subprocess.Popen]:  # type: ignore[type-arg]
    """``python -m exporter demo --listen 127.0.0.1:PORT ARGS`` until the block ends (Ctrl-C,
    then kill), entered once its /readyz says ready. A demo that exits first fails at once with
    the end of its stderr, which goes to a file (a pipe nobody reads could fill and stall it)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}", *args],
            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=None if env is None else dict(env), cwd=cwd,
        )

        def ready() -> bool:
            if proc.poll() is not None:
                err.seek(0)
                raise RuntimeError(f"demo exited with {proc.returncode}: {err.read().decode(errors='replace')[-2000:]}")
            return fetch(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200

        try:
            wait_until(ready, 60, interval=0.2, message="demo /readyz", ignore=(Exception,), fatal=(RuntimeError,))
            yield proc
        finally:
            stop_process(proc, timeout=15)


class _Given:
    """A renderer whose every render is the same exposition (a test serving given bytes)."""

    def __init__(self, exposition: Exposition) -> None:
        self.exposition = exposition

    def render(self, state: RenderState) -> Exposition:
        return self.exposition


def publish(server: MetricsServer, what: RenderState | Exposition | None = None) -> Expositions:
    """Serve ``what`` at ``server``'s /metrics as the agent serves a cycle: a state is rendered
    when scraped, an exposition served as given; by default a state of one cycle. What /metrics
    serves is then ``server.source.exposition()``."""
    what = RenderState(cycles=1) if what is None else what
    cache = Expositions(_Given(what) if isinstance(what, Exposition) else Renderer())
    cache.publish(what if isinstance(what, RenderState) else RenderState())
    server.serve_from(cache)
    return cache
