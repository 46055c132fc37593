"""Load for reliability tests and the soak benchmark: pollers, the soak scenario, and the soak
itself (the real ``demo`` CLI in a subprocess under concurrent scrapers and a /readyz poller).

The suite runs a short soak (tests/test_reliability.py: every request answered, every body
parses, taints come and go); the long one with its growth bounds (RSS, threads, open files) is
a benchmark: ``python bench/soak.py``. Both call ``run_soak``.
"""

from __future__ import annotations

import gzip
import http.client
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kit_helpers import fetch, free_port, stop_process, wait_until
from prometheus_client.parser import text_string_to_metric_families

from drasim.scenario import bundled_scenarios, parse_scenario


def parse(body: bytes) -> dict[str, list[tuple[dict, float]]]:
    """Every sample of an exposition, by name. Raises if the text does not parse."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


class Poller(threading.Thread):
    """Calls ``fn`` back to back until stopped; ``fn`` returns a label that is counted
    (e.g. "200", "503", "unparsable"); an exception is counted under its type name."""

    def __init__(self, name: str, fn: Callable[[], str]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.results: Counter[str] = Counter()
        self.errors: list[str] = []
        self._halt = threading.Event()
        self.paused = threading.Lock()  # held around each call: hold it to pause between calls

    def run(self) -> None:
        while not self._halt.is_set():
            with self.paused:
                try:
                    self.results[self.fn()] += 1
                except Exception as e:  # a failed request is a result to report
                    self.results[type(e).__name__] += 1
                    if len(self.errors) < 5:
                        self.errors.append(repr(e))

    def stop(self) -> Counter[str]:
        self._halt.set()
        self.join(timeout=30)
        assert not self.is_alive(), f"{self.name} did not stop"
        return self.results


def proc_stats(pid: int) -> tuple[int, int, int]:
    """(VmRSS in KiB, threads, open file descriptors) of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["VmRSS"][0]), int(fields["Threads"][0]), len(os.listdir(f"/proc/{pid}/fd"))


def soak_scenario(seconds: float, scale: float) -> dict:
    """The bundled failure-storm node (8 GPUs, 8 pods, 8 claims) with faults all along the
    soak instead of only in its first 25 s: every kind of episode (hung driver call, GPU lost,
    growing uncorrectable ECC, a recovery action asked by the driver) in the warm-up, then one
    every 12 s, each ending in a reset; and an informational XID every 4 s. Each GPU fails
    twice at most, so none becomes sticky: taints come and go for the whole run."""
    sc = yaml.safe_load(bundled_scenarios()["failure-storm"].read_text())
    starts = [20, 80, 140, 200] + [300 + 120 * k for k in range(12)]  # simulated seconds
    faults: list[dict] = []
    for k, at in enumerate(starts):
        gpu, end = f"gpu{k % 8}", at + 25
        kind = ("hang", "lost", "ecc_uncorrectable", "recovery_action")[k % 4]
        if kind == "hang":
            faults.append({"kind": "hang", "gpu": gpu, "at": at, "until": end})
        elif kind == "lost":
            faults += [{"kind": "xid", "gpu": gpu, "at": at, "code": 79}, {"kind": "lost", "gpu": gpu, "at": at, "until": end}]
        elif kind == "ecc_uncorrectable":
            faults += [{"kind": "xid", "gpu": gpu, "at": at, "code": 48}, {"kind": "ecc_uncorrectable", "gpu": gpu, "at": at, "until": end, "rate_per_minute": 30}]
        else:
            faults.append({"kind": "recovery_action", "gpu": gpu, "at": at, "until": end, "code": 1})
        faults.append({"kind": "reset", "gpu": gpu, "at": end})
    info = (13, 31, 43, 45, 63, 68, 69, 92, 94, 154)
    faults += [{"kind": "xid", "gpu": f"gpu{k % 8}", "at": 10 + 40 * k, "code": info[k % len(info)]} for k in range(int(seconds * scale / 40) + 10)]
    sc["faults"] = faults
    sc["name"] = "soak"
    return sc


@dataclass
class SoakResult:
    scrapes: Counter[str]  # all scrapers together, by outcome
    per_scraper: list[Counter[str]]
    readyz: Counter[str]
    errors: list[list[str]]  # per poller, the first few exceptions
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # (s since load began, RSS KiB, threads, fds)
    log: str = ""  # the demo's stderr (JSON log lines)


def run_soak(workdir: Path, seconds: float, *, scrapers: int = 10, scale: float = 10.0, sample_every: float = 5.0,
             demo_args: tuple[str, ...] = ()) -> SoakResult:
    """The demo CLI on the soak scenario under ``scrapers`` keep-alive scrapers (every other one
    asking for gzip) and a /readyz poller, for ``seconds`` of wall time once /readyz answers."""
    scenario = workdir / "soak.yaml"
    scenario.write_text(yaml.safe_dump(soak_scenario(seconds, scale)))
    parse_scenario(yaml.safe_load(scenario.read_text()), "soak")  # a valid scenario, or fail here
    port = free_port()
    out, err = open(workdir / "stdout", "w"), open(workdir / "stderr", "w")  # noqa: SIM115 - closed in the finally below, once the demo has stopped
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--interval", "0.2", "demo", "--time-scale", f"{scale:g}", "--listen", f"127.0.0.1:{port}",
         "--scenario", str(scenario), "--log-format", "json", *demo_args],
        stdout=out, stderr=err, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, f"demo exited with {proc.returncode}: {(workdir / 'stderr').read_text()[-2000:]}"
        return fetch(base + "/readyz", timeout=2)[0] == 200

    def scraper(gzipped: bool) -> Callable[[], str]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # keep-alive, like Prometheus

        def once() -> str:
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if gzipped else {})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                return str(resp.status)
            if resp.getheader("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            m = parse(body)  # raises (counted as an error) if the body does not parse
            return "200" if m.get("gpu_up") else "no gpu_up"

        return once

    pollers = [Poller(f"scraper-{i}", scraper(gzipped=i % 2 == 0)) for i in range(scrapers)]
    pollers.append(Poller("readyz", lambda: str(fetch(base + "/readyz", timeout=30)[0])))
    samples: list[tuple[float, int, int, int]] = []
    try:
        wait_until(ready, timeout=60, interval=0.2, message="demo /readyz", ignore=(OSError,))
        for p in pollers:
            p.start()
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < seconds:
            assert proc.poll() is None, f"demo exited with {proc.returncode}"
            samples.append((round(t, 1), *proc_stats(proc.pid)))
            time.sleep(sample_every)  # a measuring cadence, not a wait for anything
        samples.append((round(time.monotonic() - t0, 1), *proc_stats(proc.pid)))
    finally:
        results = [p.stop() for p in pollers if p.ident]
        stop_process(proc, timeout=20)
        out.close()
        err.close()
    return SoakResult(
        scrapes=sum(results[:scrapers], Counter()), per_scraper=results[:scrapers], readyz=results[scrapers] if len(results) > scrapers else Counter(),
        errors=[p.errors for p in pollers], samples=samples, log=(workdir / "stderr").read_text(),
    )
