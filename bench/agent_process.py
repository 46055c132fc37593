"""The agent alone in its own process, for the RSS and CPU numbers (run by ``bench/run.py soak``).

The benchmark's parent process hosts the kubelet (gRPC) and the Kubernetes API (HTTP)
emulations; this process holds only what a DaemonSet pod holds: the agent, its HTTP server,
its watchers and remediation, with the simulated backend standing in for the device library.
It prints one JSON line with its measurements.

    python bench/agent_process.py --scenario S.json --socket K.sock --kubeconfig KC --cycles N
    python bench/agent_process.py ... --mode cycle --cycles 200 --cpu-seconds 20

``--mode soak`` (default): RSS after start and after N cycles run back to back (each rendered,
as if scraped), then CPU at the agent's own 1 s interval with a Prometheus-like scraper.
``--mode cycle``: the CPU of each of N cycles and of its render (process CPU time, all the
agent's threads: device lanes, watchers, HTTP server), then CPU at a 1 s cadence, and with
``--cpu-seconds-5s W`` at the default 5 s interval too (a window of W seconds).

The agent renders a cycle's metrics only when something asks for them (``Expositions`` in
exporter/metrics/server.py), so CPU at a cadence means nothing without scrapes. Each cadence window runs with
a scraper in a process of its own (bench/scraper.py: Prometheus's headers, gzip OpenMetrics,
through the agent's real HTTP server): one scrape every ``--scrape-every`` seconds (15, a usual
Prometheus interval), and the worst case, one scrape per cycle (half-way between two cycles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb(key: str = "VmRSS") -> float:
    """Resident set size now (VmRSS) or this process's peak (VmHWM). Not ru_maxrss: Linux
    carries that across fork and exec, so it would report the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100.0 * (len(xs) - 1))))]


def rendered(agent):
    """The exposition of the agent's newest cycle, rendered now if it is not yet: what a scrape
    makes the agent do."""
    return agent.expositions.exposition()


def published(agent) -> list:
    """The states the agent publishes from now on, newest last (what a scrape would render)."""
    states: list = []
    publish = agent.expositions.publish

    def keep(state) -> None:
        states[:] = [state]
        publish(state)

    agent.expositions.publish = keep
    return states


def serve_static(server, body: bytes) -> None:
    """Serve ``body`` at /static on the agent's own server (behind the same auth, headers and
    connection handling as /metrics): the baseline a scrape's latency is compared with."""
    from exporter.metrics.server import CONTENT_TYPE
    from exporter.metrics.web import Response

    async def static(req):
        return Response(200, body, [("Content-Type", CONTENT_TYPE)])

    server.routes["/static"] = static


def measure_cycles(agent, cycles: int, cpu_seconds: float, cpu_seconds_5s: float = 0.0, scrape_every: float = 15.0) -> dict:
    """CPU of each cycle with its render (every cycle scraped: the PRODUCT's cycle budget),
    and CPU at a 1 s cadence (and at 5 s, the default interval, when ``cpu_seconds_5s``), for
    this (the agent's) process alone, with a Prometheus-like scraper and with a scrape per cycle."""
    for _ in range(10):  # warm: caches, connections, the renderer's series
        agent.run_cycle()
        rendered(agent)
    # Each cycle is asked for here, its render counted apart from the cycle.
    cpu, wall, render = [], [], []
    for _ in range(cycles):
        c0, w0 = time.process_time(), time.perf_counter()
        agent.run_cycle()
        c1 = time.process_time()
        rendered(agent)
        cpu.append(time.process_time() - c0)
        render.append(time.process_time() - c1)
        wall.append(time.perf_counter() - w0)
    # One scrape's compression of the format Prometheus asks for (made once per scraped cycle
    # at most, by the first scrape that wants it).
    import gzip

    body = rendered(agent).openmetrics
    gz = []
    for _ in range(20):
        c0 = time.process_time()
        gzip.compress(body, compresslevel=1, mtime=0)
        gz.append(time.process_time() - c0)
    body = rendered(agent).body
    out = {
        "cycles": cycles,
        "cycle_cpu_p50_ms": pct(cpu, 50) * 1e3,  # the cycle and its render
        "cycle_cpu_p99_ms": pct(cpu, 99) * 1e3,
        "render_cpu_p50_ms": pct(render, 50) * 1e3,  # of which the render (0 before render on demand: inside the cycle)
        "cycle_wall_p50_ms": pct(wall, 50) * 1e3,
        "cycle_wall_p99_ms": pct(wall, 99) * 1e3,
        "gzip_openmetrics_ms": pct(gz, 50) * 1e3,
        "series": sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#")),
        "body_bytes": len(body),
        "scrape_every_s": scrape_every,
    }
    url = agent.server.url + "/metrics"
    # 1 s cadence, as the agent's own sampler loop runs it (fixed rate): with a Prometheus-like
    # scraper over a whole number of its periods, then with a scrape after every cycle.
    prom_window = max(cpu_seconds, 4 * scrape_every)
    out.update(cadence(agent, url, prom_window, 1.0, scrape_every, "1s"))
    out.update(cadence(agent, url, cpu_seconds, 1.0, 1.0, "1s_every_cycle"))
    if cpu_seconds_5s:
        out.update(cadence(agent, url, max(cpu_seconds_5s, 4 * scrape_every), 5.0, scrape_every, "5s"))
        out.update(cadence(agent, url, max(cpu_seconds_5s / 2, 10.0), 5.0, 5.0, "5s_every_cycle"))
    return out


def cadence(agent, url: str, seconds: float, interval: float, scrape_every: float, key: str) -> dict:
    """CPU % of this process over ``seconds`` of cycles every ``interval`` s while bench/scraper.py
    scrapes ``url`` every ``scrape_every`` s; per thread CPU; the scrapes' latencies."""
    import subprocess

    agent.run_cycle()  # one cycle first, outside the window
    start = time.time() + 1.0  # the scraper's interpreter starts meanwhile
    scraper = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scraper.py"), url, "--every", str(scrape_every), "--start-at", str(start),
                                "--until", str(start + seconds)], stdout=subprocess.PIPE, text=True)
    time.sleep(max(0.0, start - time.time()))
    ondemand = agent.expositions
    renders0 = ondemand.renders
    threads0 = _thread_cpu()
    c0, w0 = time.process_time(), time.perf_counter()
    at_cadence(agent, seconds, interval)
    share = (time.process_time() - c0) / (time.perf_counter() - w0)
    by_thread = _thread_cpu_since(threads0)
    out, _ = scraper.communicate(timeout=120)
    scrapes = json.loads(out.strip().splitlines()[-1])
    if scrapes["statuses"] not in ([], [200]):
        raise SystemExit(f"scraper got HTTP {scrapes['statuses']}")
    lat = scrapes["latencies_s"]
    return {
        f"cpu_percent_{key}_interval": share * 100,
        f"cpu_window_{key}_s": seconds,
        f"scrapes_{key}": len(lat),
        f"scrape_{key}_p50_ms": pct(lat, 50) * 1e3 if lat else None,
        f"scrape_{key}_max_ms": max(lat) * 1e3 if lat else None,
        f"renders_{key}": ondemand.renders - renders0,
        f"cadence_{key}_threads_cpu_s": by_thread,
    }


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per native thread of this process, by name (C library threads included):
    from ``schedstat`` (nanoseconds) where the kernel has it, else ``stat`` (10 ms ticks)."""
    out: dict[str, float] = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        name = head.split("(", 1)[1]
        fields = rest.split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        out[f"{names.get(int(tid), name)}/{tid}"] = seconds
    return out


def _thread_cpu_since(before: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread used since ``before`` (a _thread_cpu() reading), busy ones only."""
    now = _thread_cpu()
    return {k: round(v - before.get(k, 0.0), 4) for k, v in now.items() if v - before.get(k, 0.0) >= 0.0001}


def at_cadence(agent, seconds: float, interval: float = 1.0) -> None:
    """Run cycles at a fixed rate (every ``interval`` s) for ``seconds``, as the agent's own
    sampler does."""
    w0, next_at = time.perf_counter(), time.monotonic()
    while time.perf_counter() - w0 < seconds:
        agent.run_cycle()
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


def idle_threads(seconds: float) -> dict:
    """Process CPU while the agent runs no cycle: what its threads cost doing nothing."""
    before, c0, w0 = _thread_cpu(), time.process_time(), time.perf_counter()
    time.sleep(seconds)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"cpu_percent": 100 * cpu / wall, "seconds": wall, "threads_cpu_s": _thread_cpu_since(before)}


def process_age() -> float:
    """Seconds since this process was started (exec), from /proc: interpreter start included."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def churn_alone(agent, seconds: float, scrape_every: float) -> dict:
    """The agent at its own interval while the parent churns its node (bench/run.py churn):
    its RSS each second (the peak is the figure), and descriptors and threads at the start and
    the end (flat: none leaked per job), scraped every ``scrape_every`` s."""
    import urllib.request

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    start = {"rss_mb": rss_mb(), "fds": fds(), "threads": threading.active_count()}
    rss, t0, next_scrape = [], time.monotonic(), 0.0
    while (now := time.monotonic() - t0) < seconds:
        if now >= next_scrape:
            with urllib.request.urlopen(agent.server.url + "/metrics", timeout=30) as r:
                r.read()
            next_scrape += scrape_every
        rss.append(rss_mb())
        time.sleep(1.0)
    return {"start": start, "end": {"rss_mb": rss_mb(), "fds": fds(), "threads": threading.active_count()},
            "rss_max_mb": max(rss), "peak_rss_mb": rss_mb("VmHWM"), "cycles": agent.cycles}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--cpu-seconds", type=float, default=30.0)
    ap.add_argument("--mode", choices=("soak", "cycle", "churn"), default="soak")
    ap.add_argument("--interval", type=float, default=0.5, help="churn mode: the agent's own interval")
    ap.add_argument("--seconds", type=float, default=120.0, help="churn mode: how long to run at that interval")
    ap.add_argument("--cpu-seconds-5s", type=float, default=0.0, help="cycle mode: also CPU at a 5 s cadence (the default interval), over this window")
    ap.add_argument("--scrape-every", type=float, default=15.0, help="seconds between the Prometheus-like scraper's scrapes in the CPU windows")
    ap.add_argument("--profile", type=Path, help="cycle mode: profile the measured cycles (all threads, yappi) into this file")
    ap.add_argument("--idle-seconds", type=float, default=0.0, help="cycle mode: also report process CPU per thread while no cycle runs")
    ap.add_argument("--claims-ttl", type=float, default=None, help="diagnosis: override the ResourceClaim cache's TTL (re-fetch cost)")
    a = ap.parse_args()
    t_start = time.perf_counter()

    # The kubernetes client imports kubernetes_validate (and jsonschema with it) whenever it is
    # installed. Only the test extras install it; the image does not. Hide it so this process
    # holds what a production pod holds.
    sys.modules["kubernetes_validate"] = None  # type: ignore[assignment]
    interpreter_mb = rss_mb()

    from drasim.backend import SimBackend, SimClock
    from drasim.scenario import parse_scenario
    from exporter.cli import settle_heap
    from exporter.config import Config, TaintMode
    from exporter.logs import configure
    from exporter.wiring import build_agent

    configure("json", "error")
    sc = parse_scenario(json.loads(Path(a.scenario).read_text()))
    clock = SimClock(1.0)
    cfg = Config(
        listen_host="127.0.0.1",
        listen_port=0,
        node_name=sc.node,
        kubelet_socket=a.socket,
        kubeconfig=a.kubeconfig,
        backend="sim",
        # cycle mode drives the 1 s cadence itself, so that no sampler cycle lands inside a
        # measured one; soak mode keeps the agent's own 1 s loop running alongside.
        interval={"cycle": 3600.0, "churn": a.interval}.get(a.mode, 1.0),
        taint_mode=TaintMode.OFF if a.mode == "churn" else TaintMode.ENFORCE,
    )
    agent = build_agent(cfg, backend=SimBackend(sc, clock), clock=clock)
    imported_mb = rss_mb()
    if a.claims_ttl is not None and agent.src.get("claims") is not None:
        agent.src.get("claims").cache.ttl = a.claims_ttl
    agent.start()
    # agent.start() returns once the first cycle is published; its first scrape renders it
    started_s = time.perf_counter() - t_start
    import urllib.request

    with urllib.request.urlopen(agent.server.url + "/metrics", timeout=60) as r:  # a complete /metrics
        r.read()
    first_metrics_s = process_age()
    settle_heap()  # as exporter.cli.run_agent does after start-up
    ready = agent.readiness()
    try:
        if a.mode == "churn":
            print(json.dumps(churn_alone(agent, a.seconds, a.scrape_every)))
            return
        if a.mode == "cycle":
            if a.profile:
                import yappi
                from profile_agent import report

                for _ in range(10):
                    agent.run_cycle()
                    rendered(agent)
                yappi.set_clock_type("cpu")
                yappi.start(builtins=True)
                for _ in range(a.cycles):
                    agent.run_cycle()
                    rendered(agent)
                yappi.stop()
                text = f"{a.cycles} cycles back to back, each rendered (as if scraped)\n" + report(60)
                # ...and the agent at its 1 s cadence: what its other threads cost between cycles
                yappi.clear_stats()
                yappi.start(builtins=True)
                at_cadence(agent, 10.0)
                yappi.stop()
                a.profile.write_text(text + "\n\n10 s at a 1 s cadence\n" + report(40))
            out = measure_cycles(agent, a.cycles, a.cpu_seconds, a.cpu_seconds_5s, a.scrape_every)
            if a.idle_seconds:
                out["idle"] = idle_threads(a.idle_seconds)
            out.update(
                after_imports_mb=imported_mb,
                start_seconds=started_s,
                first_metrics_since_exec_s=first_metrics_s,
                first_readyz=ready[1],
                first_unresolved=dict(agent.snapshot.unresolved) if agent.snapshot else {},
                devices=len(agent.snapshot.devices) if agent.snapshot else 0,
            )
            print(json.dumps(out))
            return
        for _ in range(20):
            agent.run_cycle()
            rendered(agent)
        start_mb = rss_mb()
        marks = []
        t0 = time.perf_counter()
        for i in range(a.cycles):  # each cycle rendered, as if scraped: the renderer's caches turn over
            agent.run_cycle()
            rendered(agent)
            if (i + 1) % max(1, a.cycles // 5) == 0:
                marks.append(round(rss_mb(), 1))
        cycles_s = time.perf_counter() - t0
        end_mb = rss_mb()
        # CPU at the real 1 s interval: only the agent's own threads run in this window, and
        # a Prometheus-like scraper (its own process) every --scrape-every seconds.
        import subprocess

        start = time.time() + 1.0
        scraper = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scraper.py"), agent.server.url + "/metrics", "--every", str(a.scrape_every),
                                    "--start-at", str(start), "--until", str(start + a.cpu_seconds)], stdout=subprocess.PIPE, text=True)
        time.sleep(max(0.0, start - time.time()))
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(a.cpu_seconds)
        cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
        scrapes = json.loads(scraper.communicate(timeout=120)[0].strip().splitlines()[-1])["scrapes"]
        out = {
            "scrapes_in_cpu_window": scrapes,
            "scrape_every_s": a.scrape_every,
            "interpreter_mb": interpreter_mb,
            "after_imports_mb": imported_mb,
            "rss_start_mb": start_mb,
            "rss_end_mb": end_mb,
            "rss_marks_mb": marks,
            "peak_rss_mb": rss_mb("VmHWM"),
            "cycles": a.cycles,
            "cycles_seconds": cycles_s,
            "cpu_percent_1s_interval": cpu * 100,
            "cpu_window_s": a.cpu_seconds,
            "devices": len(agent.snapshot.devices) if agent.snapshot else 0,
        }
    finally:
        agent.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
