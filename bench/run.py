"""Benchmarks for docs/performance.md. Not tests: numbers, printed as a table.

    python bench/run.py [scrape] [cycle] [gzip] [nvml] [xid] [soak] [series]   (default: all)
    python bench/run.py soak --cycles 10000

Runs on a simulated node of 64 devices (8 full GPUs + 8 GPUs with 7 MIG instances each),
256 pods and 512 claims, with the real agent, real HTTP server, real gRPC kubelet and real
HTTP Kubernetes API emulation. Results are written to bench/results/latest.json too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the kubelet emulation's gRPC core logs to stderr by itself
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from agent_process import published, rendered, rss_mb, serve_static  # noqa: E402
from scrape_attack import LOAD_START_METHOD  # noqa: E402

from drasim.backend import SimClock  # noqa: E402
from drasim.scenario import parse_scenario  # noqa: E402
from exporter.config import Config, TaintMode  # noqa: E402
from exporter.health.engine import HealthPolicy  # noqa: E402
from exporter.logs import configure  # noqa: E402

RESULTS: dict = {}


def big_scenario(pods: int = 256, claims: int = 512, fault: bool = False, scale: int = 1) -> dict:
    """The dense node: 8 full GPUs + 8 GPUs of 7 MIG instances (64 devices) per ``scale``."""
    gpus = []
    n = 8 * scale
    for i in range(n):
        gpus.append({"name": f"full{i}", "utilization": {"pattern": "sine", "base": 0.5, "amplitude": 0.4, "period": 60}, "memory_used": 0.5})
    for i in range(n):
        gpus.append({"name": f"mig{i}", "mig": [{"profile": "1g.10gb", "placement_start": s, "utilization": 0.3, "memory_used": 0.2} for s in range(7)]})
    refs = [f"full{i}" for i in range(n)] + [f"mig{i}:1g.10gb:{s}" for i in range(n) for s in range(7)]
    assert len(refs) == 64 * scale
    cl = [{"namespace": f"ns{(c // 2) % 16}", "name": f"claim-{c}", "devices": [refs[c % len(refs)]]} for c in range(claims)]
    per_pod = claims // pods
    pod_list = []
    for p in range(pods):
        mine = [cl[p * per_pod + k] for k in range(per_pod)]
        ns = mine[0]["namespace"]
        mine = [c for c in mine if c["namespace"] == ns]
        pod_list.append({"namespace": ns, "name": f"pod-{p}", "labels": {"app": f"a{p % 7}"}, "containers": [{"name": "main", "claims": [c["name"] for c in mine]}]})
    sc = {"name": "bench-64", "node": "bench-node", "gpus": gpus, "claims": cl, "pods": pod_list}
    if fault:
        sc["faults"] = []
    return sc


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100.0 * (len(xs) - 1))))
    return xs[k]


class Node:
    """A simulated node with the real agent wired to an in-process kubelet and API server."""

    def __init__(self, scenario: dict, interval: float = 1.0, taint_mode: TaintMode = TaintMode.ENFORCE, time_scale: float = 1.0, policy: HealthPolicy | None = None, hold: float = 1800.0) -> None:
        from drasim.demo import DemoCluster

        self.sc = parse_scenario(scenario)
        self.clock = SimClock(time_scale)
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-"))
        self.cluster = DemoCluster(self.sc, self.clock, self.workdir)
        self.cluster.start()
        cfg = Config(
            listen_host="127.0.0.1",
            listen_port=0,
            node_name=self.sc.node,
            kubelet_socket=self.cluster.socket,
            kubeconfig=str(self.cluster.kubeconfig),
            backend="sim",
            interval=interval,
            taint_mode=taint_mode,
            taint_hold_seconds=hold,
        )
        # The one simulated-node rig (drasim.node.SimulatedNode, under the demo's cluster) builds the agent.
        self.backend = self.cluster.backend
        self.agent = self.cluster.build_agent(cfg, health_policy=policy, remediation_resync=1.0)

    def start(self, serve: bool = True) -> None:
        self.agent.start(serve=serve)

    def stop(self) -> None:
        self.cluster.stop()  # the agent first, then the kubelet and the API server


# --------------------------------------------------------------------------- scrape


def _scraper(url: str, n: int, q: mp.Queue) -> None:
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", u.path)
        r = conn.getresponse()
        r.read()
        lat.append(time.perf_counter() - t0)
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}")
    q.put(lat)


def _load(url: str, concurrency: int, per_client: int) -> list[float]:
    ctx = mp.get_context(LOAD_START_METHOD)  # not fork: see bench/scrape_attack.py
    q = ctx.Queue()
    procs = [ctx.Process(target=_scraper, args=(url, per_client, q)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    out: list[float] = []
    for _ in procs:
        out.extend(q.get(timeout=300))
    for p in procs:
        p.join()
    return out


def bench_scrape(requests: int = 2000, first_rounds: int = 50) -> None:
    node = Node(big_scenario())
    node.start()
    try:
        body = rendered(node.agent).body
        serve_static(node.agent.server, body)
        base = node.agent.server.url
        rows = []
        # Each cycle is rendered by the first scrape that wants it (exporter/metrics/server.py).
        for conc in (1, 10):
            per = max(50, requests // conc)
            _load(base + "/metrics", conc, 20)  # warm up
            _load(base + "/static", conc, 20)
            # Alternate the two in rounds: run one after the other, whichever goes second
            # meets a different machine (caches, the sampler's phase) and the tail shows it.
            m: list[float] = []
            s: list[float] = []
            rounds = 4
            for _ in range(rounds):
                m += _load(base + "/metrics", conc, max(1, per // rounds))
                s += _load(base + "/static", conc, max(1, per // rounds))
            rows.append(
                {
                    "concurrency": conc,
                    "requests": len(m),
                    "metrics_p50_ms": pct(m, 50) * 1e3,
                    "metrics_p99_ms": pct(m, 99) * 1e3,
                    "static_p50_ms": pct(s, 50) * 1e3,
                    "static_p99_ms": pct(s, 99) * 1e3,
                    "ratio_p99": pct(m, 99) / pct(s, 99),
                }
            )
        RESULTS["scrape"] = {"body_bytes": len(body), "devices": 64, "rows": rows}
        print(f"\nscrape: body {len(body)} bytes, 64 devices / 256 pods / 512 claims")
        print("| scrapers | requests | /metrics p50 | /metrics p99 | static p50 | static p99 | p99 ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['requests']} | {r['metrics_p50_ms']:.2f} ms | {r['metrics_p99_ms']:.2f} ms "
                  f"| {r['static_p50_ms']:.2f} ms | {r['static_p99_ms']:.2f} ms | {r['ratio_p99']:.2f} |")
    finally:
        node.stop()
    bench_first_scrape(first_rounds)


def bench_first_scrape(rounds: int = 50) -> None:
    """What a scrape pays for render on demand: a cycle (run by hand), then one Prometheus-like
    scrape (gzip OpenMetrics, fresh connection), which renders and compresses the cycle, then a
    second scrape of the same cycle (the bytes made), and the same-size static body."""
    from scraper import HEADERS

    node = Node(big_scenario(), interval=3600)
    node.start()
    try:
        import http.client

        srv = node.agent.server
        serve_static(srv, rendered(node.agent).openmetrics_gzipped)

        def get(path: str) -> float:
            t0 = time.perf_counter()
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            try:
                c.request("GET", path, headers=HEADERS)
                r = c.getresponse()
                r.read()
                assert r.status == 200, r.status
            finally:
                c.close()
            return time.perf_counter() - t0

        first, second, static, render = [], [], [], []
        for _ in range(rounds):
            node.agent.run_cycle()
            r0 = node.agent.expositions.renders
            first.append(get("/metrics"))
            assert node.agent.expositions.renders == r0 + 1  # this scrape rendered the cycle
            second.append(get("/metrics"))
            static.append(get("/static"))
            node.agent.run_cycle()  # the render alone, for scale: a fresh cycle rendered on the render thread
            c0 = time.process_time()
            node.agent.expositions.exposition()
            render.append(time.process_time() - c0)
        row = {"rounds": rounds, "first_p50_ms": pct(first, 50) * 1e3, "first_p99_ms": pct(first, 99) * 1e3, "second_p50_ms": pct(second, 50) * 1e3,
               "second_p99_ms": pct(second, 99) * 1e3, "static_p50_ms": pct(static, 50) * 1e3, "static_p99_ms": pct(static, 99) * 1e3, "render_cpu_p50_ms": pct(render, 50) * 1e3}
        RESULTS["first_scrape"] = row
        print(f"\nfirst scrape after a cycle (dense node, gzip OpenMetrics, {rounds} cycles, one scraper): renders the cycle: p50 {row['first_p50_ms']:.2f} / p99 "
              f"{row['first_p99_ms']:.2f} ms; the same cycle again: {row['second_p50_ms']:.2f} / {row['second_p99_ms']:.2f} ms; static body of the same size: "
              f"{row['static_p50_ms']:.2f} / {row['static_p99_ms']:.2f} ms; the render alone: {row['render_cpu_p50_ms']:.2f} ms CPU")
    finally:
        node.stop()


# --------------------------------------------------------------------------- cycle


def _agent_process(sc: dict, mode: str, cycles: int, cpu_seconds: float, cpu_seconds_5s: float = 0.0, scrape_every: float = 15.0) -> dict:
    """Run bench/agent_process.py (the agent alone) against a kubelet and API emulation hosted
    here; its one JSON line of measurements."""
    import subprocess

    from drasim.demo import DemoCluster

    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    (workdir / "scenario.json").write_text(json.dumps(sc))
    cluster = DemoCluster(parse_scenario(sc), SimClock(1.0), workdir)
    cluster.start()
    try:
        cmd = [sys.executable, str(ROOT / "bench" / "agent_process.py"), "--mode", mode, "--scenario", str(workdir / "scenario.json"), "--socket", cluster.socket,
               "--kubeconfig", str(cluster.kubeconfig), "--cycles", str(cycles), "--cpu-seconds", str(cpu_seconds), "--scrape-every", str(scrape_every)]
        if cpu_seconds_5s:
            cmd += ["--cpu-seconds-5s", str(cpu_seconds_5s)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"agent process failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        cluster.stop()


def eight_gpus() -> dict:
    sc = big_scenario(pods=32, claims=32)
    sc["gpus"] = sc["gpus"][:8]
    sc["claims"] = [dict(c, devices=[f"full{i % 8}"]) for i, c in enumerate(sc["claims"])]
    return sc


def bench_cycle(cycles: int = 200, cpu_seconds: float = 20.0, scales: tuple[int, ...] = (1, 2, 4), cpu_seconds_5s: float = 60.0, scrape_every: float = 15.0) -> None:
    """Cycle CPU of the agent alone, in its own process (bench/agent_process.py --mode cycle):
    the kubelet and API emulations it talks to run here, in the parent, and their cost is not
    counted. 8 GPUs, and the dense node at 1x, 2x, 4x (64 devices / 256 pods / 512 claims each).

    The agent renders a cycle only when a scrape asks for it, so every CPU figure comes with a
    scraper (its own process, Prometheus's request: gzip OpenMetrics through the real HTTP
    server): one scrape every ``scrape_every`` s (a usual Prometheus interval), and the worst
    case, a scrape after every cycle. At a 1 s cadence for every node; at the default 5 s too for
    the 8-GPU and the dense 1x node (PRODUCT's targets are stated for those). Cycle CPU p50/p99
    is a cycle with its render (as if every cycle were scraped)."""
    rows = []
    cases = [("8 GPUs, 32 pods, 32 claims", 8, eight_gpus())] + [
        (f"dense {k}x: {64 * k} devices, {256 * k} pods, {512 * k} claims", 64 * k, big_scenario(pods=256 * k, claims=512 * k, scale=k)) for k in scales
    ]
    for label, devices, sc in cases:
        r = _agent_process(sc, "cycle", cycles, cpu_seconds, cpu_seconds_5s if devices <= 64 else 0.0, scrape_every)
        # allocatable devices (full GPUs and MIG instances); the agent also enumerates MIG parents
        r["enumerated"], r["devices"], r["case"] = r["devices"], devices, label
        rows.append(r)
    dense = rows[1]  # the top-level keys: the dense node at 1x
    RESULTS["cycle"] = {"devices": dense["devices"], "cycle_p99_ms": dense["cycle_wall_p99_ms"], "cycle_cpu_p50_ms": dense["cycle_cpu_p50_ms"], "scrape_every_s": scrape_every,
                        "eight_gpus_cpu_percent_1s": rows[0]["cpu_percent_1s_interval"], "eight_gpus_cpu_percent_5s": rows[0].get("cpu_percent_5s_interval"),
                        "dense_cpu_percent_1s": dense["cpu_percent_1s_interval"], "dense_cpu_percent_1s_every_cycle": dense["cpu_percent_1s_every_cycle_interval"], "rows": rows}
    print(f"\ncycle, agent alone in its own process (process CPU time of all its threads; cycle CPU includes the cycle's render; CPU % at a 1 s cadence and at the "
          f"default 5 s, with one gzip OpenMetrics scrape every {scrape_every:g} s, and with a scrape after every cycle):")
    print("| node | series | cycle CPU p50 / p99 (render p50) | CPU at 1 s, scrape / 15 s | at 1 s, scrape every cycle | at 5 s, scrape / 15 s | at 5 s, scrape every cycle "
          "| gzip per scraped cycle | first /metrics after exec | first /readyz |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cpu(r: dict, key: str, digits: int) -> str:
        v = r.get(f"cpu_percent_{key}_interval")
        return "—" if v is None else f"{v:.{digits}f} % ({r[f'renders_{key}']} renders / {r[f'scrapes_{key}']} scrapes)" if r.get(f"renders_{key}") is not None else f"{v:.{digits}f} %"

    for r in rows:
        print(
            f"| {r['case']} | {r['series']} | {r['cycle_cpu_p50_ms']:.1f} / {r['cycle_cpu_p99_ms']:.1f} ms ({r['render_cpu_p50_ms']:.1f}) | {cpu(r, '1s', 2)} | {cpu(r, '1s_every_cycle', 2)} "
            f"| {cpu(r, '5s', 3)} | {cpu(r, '5s_every_cycle', 3)} | {r['gzip_openmetrics_ms']:.1f} ms | {r['first_metrics_since_exec_s']:.2f} s | {r['first_readyz'].splitlines()[0]} |"
        )


def bench_gzip(rounds: int = 30) -> None:
    """CPU and size of gzip levels on the dense node's body (how GZIP_LEVEL was chosen)."""
    import gzip

    node = Node(big_scenario(), interval=3600)
    node.start(serve=False)
    try:
        node.agent.run_cycle()
        body = rendered(node.agent).openmetrics
    finally:
        node.stop()
    rows = []
    for level in (1, 3, 5, 6, 9):
        cpu = []
        for _ in range(rounds):
            c0 = time.process_time()
            out = gzip.compress(body, compresslevel=level)
            cpu.append(time.process_time() - c0)
        rows.append({"level": level, "cpu_ms": pct(cpu, 50) * 1e3, "bytes": len(out)})
    RESULTS["gzip"] = {"body_bytes": len(body), "rows": rows}
    print(f"\ngzip of the dense node's body ({len(body)} bytes):", ", ".join(f"level {r['level']}: {r['cpu_ms']:.1f} ms -> {r['bytes']} B" for r in rows))


# --------------------------------------------------------------------------- nvml overhead


def bench_nvml(reads: int = 300, rounds: int = 5) -> None:
    """Python overhead of the NVML backend over the raw library calls it makes, 8 GPUs.

    The fake library (tests/fakes/fake_nvml.py) does no driver work, only its own Python
    bookkeeping, so what is measured is Python: the fake, pynvml's ctypes marshalling, and our
    backend. "raw" is exactly the pynvml calls one backend read makes, in a tight loop, results
    unread; "backend" is NvmlBackend.read(); overhead = backend/raw - 1. Backend and raw run in
    alternating rounds and each keeps its fastest round, so a noisy neighbour hurts neither side.
    """
    try:
        from fakes.fake_nvml import FakeGpu, FakeNvml, installed  # type: ignore
    except Exception as e:  # pragma: no cover
        print(f"\nnvml: skipped ({e})")
        return
    import pynvml

    from exporter.devices.nvml import FIELD_REQUESTS, NvmlBackend

    fake = FakeNvml([FakeGpu(uuid=f"GPU-00000000-0000-0000-0000-{i:012d}", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", minor=i) for i in range(8)])
    with installed(fake) as lib:
        b = NvmlBackend(processes=False, gpm=False)
        b.open()
        devs = b.enumerate()
        for d in devs:
            b.read(d)  # warm caches (unsupported fields, handles)
        calls_before = dict(lib.counts)
        for d in devs:
            b.read(d)
        per_read_calls = {k: (v - calls_before.get(k, 0)) / len(devs) for k, v in lib.counts.items() if v - calls_before.get(k, 0)}
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(len([d for d in devs if not d.is_partition]))]
        requests = list(FIELD_REQUESTS)

        def backend(_h):
            for d in devs:
                b.read(d)

        def raw(_h):  # exactly the calls of one backend read, per GPU
            for h in handles:
                pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                pynvml.nvmlDeviceGetUtilizationRates(h)
                pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
                pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)
                pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
                pynvml.nvmlDeviceGetFieldValues(h, requests)

        def per_metric(_h):  # the counters alone, one FieldValues call per counter
            for h in handles:
                for req in requests:
                    pynvml.nvmlDeviceGetFieldValues(h, [req])

        best: dict[str, float] = {}
        for _ in range(rounds):
            for fn in (backend, raw, per_metric):
                t0 = time.perf_counter()
                for _ in range(reads):
                    fn(None)
                us = (time.perf_counter() - t0) / (reads * len(handles)) * 1e6
                best[fn.__name__] = min(best.get(fn.__name__, us), us)
        b.close()
    n = RESULTS["nvml"] = {"backend_us": best["backend"], "raw_us": best["raw"], "per_metric_us": best["per_metric"], "reads": reads, "rounds": rounds, "calls_per_read": per_read_calls}
    n["overhead"] = n["backend_us"] / n["raw_us"] - 1
    print(f"\nnvml (8 GPUs, fake library, pure Python cost): backend read {n['backend_us']:.1f} us/device, the same raw calls {n['raw_us']:.1f} us/device, overhead {n['overhead'] * 100:.0f}%")
    print(f"  {len(FIELD_REQUESTS)} counters: one FieldValues call (part of raw) vs one call per counter: {n['per_metric_us']:.1f} us/device")
    print("  library calls per backend read:", {k: round(v, 2) for k, v in sorted(per_read_calls.items())})


# --------------------------------------------------------------------------- xid -> rule


def bench_xid(samples: int = 200) -> None:
    """Time from an XID event delivered by the device library to the DeviceTaintRule existing in
    the API server (a real HTTP round trip through the remediation engine).

    Between samples the GPU is reset and the agent removes its own rule (hold 0): each XID is new
    evidence, nothing is deleted behind the agent's back, and the next sample starts once the
    rule is gone from the API server and from the remediator's report. Only public parts are
    used (the wiring, the health engine, the report), so the loop cannot race the remediator's
    internals. The rails are opened wide (no rate limit, budget or node-wide verdict: one GPU
    after another) and no GPU turns sticky."""
    import dataclasses

    from k8s_helpers import wait_until  # type: ignore

    from exporter.devices.model import DeviceEvent, EventKind

    policy = HealthPolicy(clear_hold=0.0, sticky_after=10**9)
    node = Node(big_scenario(), interval=1.0, hold=0.0, policy=policy)
    cfg = dataclasses.replace(node.agent.cfg, taint_rate_limit=1000, taint_budget_max=1000, node_failure_fraction=1.01)
    node.agent = node.cluster.build_agent(cfg, health_policy=policy, remediation_resync=1.0)
    lat = []
    node.start(serve=False)
    try:
        rem = node.agent.out.remediation
        api = node.cluster.api
        wait_until(lambda: rem.passes > 0, timeout=60, message="the remediator's first pass")

        def rule_of(dev: str) -> bool:
            return any(r["spec"]["deviceSelector"]["device"] == dev for r in api.list("resource.k8s.io", "devicetaintrules"))

        gpus = [g for g in node.sc.gpus if not g.mig]
        for i in range(samples):
            g = gpus[i % len(gpus)]
            t0 = time.perf_counter()
            node.agent.health.on_event(DeviceEvent(uuid=g.uuid, kind=EventKind.XID, code=79))
            wait_until(lambda: rule_of(g.device_name), timeout=60, interval=0.0005, message="the rule")  # noqa: B023 - polled in this iteration
            lat.append(time.perf_counter() - t0)
            node.agent.health.on_event(DeviceEvent(uuid=g.uuid, kind=EventKind.RESET))  # clears at once (clear_hold 0)
            wait_until(lambda: not api.list("resource.k8s.io", "devicetaintrules") and not rem.report().rules, timeout=60, interval=0.002,
                       message="the rule removed by the agent")
        RESULTS["xid"] = {"samples": len(lat), "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "max_ms": max(lat) * 1e3}
        r = RESULTS["xid"]
        print(f"\nXID event -> DeviceTaintRule in the API server: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms ({r['samples']} samples)")
    finally:
        node.stop()


# --------------------------------------------------------------------------- soak


def bench_soak(cycles: int = 10000, cpu_seconds: float = 30.0, dense: bool = True) -> None:
    """RSS after start and after N cycles, and CPU at a 1 s interval, of the agent alone: it
    runs in its own process (bench/agent_process.py) while this process hosts the kubelet and
    API emulations it talks to. 8 GPUs (32 pods), and the dense node."""
    cases = [("8 GPUs, 32 pods, 32 claims", eight_gpus())] + ([("dense: 64 devices, 256 pods, 512 claims", big_scenario())] if dense else [])
    rows = []
    for label, sc in cases:
        r = _agent_process(sc, "soak", cycles, cpu_seconds)
        r["case"] = label
        rows.append(r)
        _print_soak(label, r, cycles, cpu_seconds)
    RESULTS["soak"] = {**rows[0], "rows": rows}  # top-level keys: 8 GPUs


def _print_soak(label: str, r: dict, cycles: int, cpu_seconds: float) -> None:
    print(f"\nsoak, agent alone in its own process ({label}): interpreter {r['interpreter_mb']:.1f} MB, after imports {r['after_imports_mb']:.1f} MB")
    print(f"  RSS {r['rss_start_mb']:.1f} MB after start, {r['rss_end_mb']:.1f} MB after {cycles} cycles (marks {r['rss_marks_mb']}), peak {r['peak_rss_mb']:.1f} MB; {cycles} cycles took {r['cycles_seconds']:.1f} s")
    print(f"  CPU at 1 s interval: {r['cpu_percent_1s_interval']:.2f}% of one core over {cpu_seconds:.0f} s")


# --------------------------------------------------------------------------- series


# A cardinality-conscious selection: per-claim families that can be derived from others in
# PromQL (claim pods and memory size from dra_device_allocation_info joined with the device
# series, claim power likewise) and the clock families. Each dra_claim_* family costs one series
# per claim.
LEAN_EXCLUDE = "dra_claim_pods,dra_claim_memory_total_bytes,dra_claim_power_watts,gpu_*_clock_hertz,gpu_clock_event_reasons"


def bench_series() -> None:
    from exporter.config import parse_exclude_metrics
    from exporter.metrics.render import Renderer

    node = Node(big_scenario(), interval=3600)
    node.start(serve=False)
    try:
        states = published(node.agent)
        for _ in range(2):  # the billing counters appear with the second reading of the GPUs' energy
            node.clock.advance_to(node.clock.now() + 5.0)
            node.agent.run_cycle()
        last = states[-1]  # the whole state a scrape renders (billing, self-metrics)
        out = {}
        lean = parse_exclude_metrics(LEAN_EXCLUDE)
        for label, compat, allow, excluded in (
            ("default", False, (), frozenset()),
            ("with pod labels", False, ("app",), frozenset()),
            ("dcgm-compat labels", True, (), frozenset()),
            ("lean (--exclude-metrics)", False, (), lean),
            ("lean, no per-pod billing", False, (), parse_exclude_metrics(LEAN_EXCLUDE + ",dra_pod_*")),
        ):
            state = dataclasses.replace(last, pod_label_allowlist=allow, dcgm_compat=compat, excluded=excluded)
            body = Renderer().render(state).body.decode()
            n = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
            out[label] = n
        RESULTS["series"] = out
        RESULTS["series_lean_exclude"] = LEAN_EXCLUDE
        print("\nseries per node (64 devices, 256 pods, 512 claims):", out)
        for label, n in out.items():
            print(f"  10,000 nodes at 15 s scrapes, {label}: {n * 10000 / 15:,.0f} samples/s ({n * 10000:,} active series)")
    finally:
        node.stop()


# --------------------------------------------------------------------------- churn


def bench_churn(steps: int = 400, rate: float = 80.0, hold: float = 2.0, interval: float = 0.5, scrape_every: float = 2.0) -> None:
    """A batch node that churns (issue 33): 8 GPUs, ``rate`` new jobs a second (a pod and a DRA
    claim with new names each, drasim.churn), each holding a GPU for ``hold`` seconds, a cycle
    every ``interval`` of simulated time driven by hand, a scrape every ``scrape_every``.
    In one process with the kubelet and API emulations (their threads' CPU counts too): process
    CPU per cycle (the cycle and its share of the scrapes) before and after the series cap
    binds, series, RSS, cycles that took less than the interval, requests per new claim, and
    the jobs that held a GPU for two intervals but were never billed."""
    import re
    import urllib.request

    from drasim.churn import Churn
    from drasim.node import SimulatedNode

    sc = parse_scenario(eight_gpus())
    clock = SimClock(1.0)
    node = SimulatedNode(sc, clock, request_log_size=10_000_000, kubelet_qps=None)
    node.start()
    clock.pause()
    agent = node.start_agent(interval=3600.0, taint_mode=TaintMode.OFF)
    seconds = re.compile(r'^dra_claim_device_seconds_total\{claim="([^"]+)",namespace="batch"[^}]*\} ([0-9.e+-]+)$', re.M)
    try:
        deadline = time.monotonic() + 60
        while not agent.src.get("slices").watcher.synced and time.monotonic() < deadline:
            time.sleep(0.05)
        acc = agent.out.usage
        churn = Churn(node, per_step=max(1, round(rate * interval)), hold_steps=max(2, round(hold / interval)))
        node.api.clear_requests()
        rows, billed, rss0 = [], set(), rss_mb()
        every = max(1, round(scrape_every / interval))
        for step in range(steps):
            churn.step()
            clock.advance_to(clock.now() + interval)
            c0, w0 = time.process_time(), time.perf_counter()
            agent.run_cycle()
            wall = time.perf_counter() - w0
            series = None
            if step % every == every - 1:
                with urllib.request.urlopen(agent.server.url + "/metrics", timeout=30) as resp:
                    text = resp.read().decode()
                series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
                billed.update(m.group(1) for m in seconds.finditer(text) if float(m.group(2)) > 0)
            rows.append((time.process_time() - c0, wall, series, acc.retained_series))
        bound = next((i for i, r in enumerate(rows) if r[3] >= acc.max_series * 0.98), None)
        settle = max(1, steps // 10)
        before = [r[0] for r in rows[settle:bound or steps // 2]]
        after = [r[0] for r in rows[(bound or steps // 2) + settle:]]
        reqs = [r for r in node.api.requests if not r.watch]
        claims_n = len(churn.jobs)
        held = [j for j in churn.jobs if j.left is not None and j.left - j.started >= 2]
        lost = [j.claim for j in held if j.claim not in billed]
        out = {
            "steps": steps, "interval_s": interval, "claims_per_s": rate, "hold_s": hold, "new_claims": claims_n,
            "cap_series": acc.max_series, "cap_bound_at_step": bound,
            "cpu_per_cycle_before_ms": 1e3 * sum(before) / max(1, len(before)),
            "cpu_per_cycle_after_ms": 1e3 * sum(after) / max(1, len(after)),
            "series_max": max((r[2] for r in rows if r[2] is not None), default=0),
            "retained_series_max": max(r[3] for r in rows),
            "rss_start_mb": rss0, "rss_end_mb": rss_mb(), "rss_peak_mb": rss_mb("VmHWM"),
            "cycles_on_time": sum(1 for r in rows if r[1] < interval) / len(rows),
            "requests_per_new_claim": len(reqs) / max(1, claims_n),
            "claim_requests_per_new_claim": sum(1 for r in reqs if "/resourceclaims" in r.path) / max(1, claims_n),
            "jobs_held_two_intervals": len(held), "jobs_never_billed": len(lost),
        }
    finally:
        node.stop()
    RESULTS["churn"] = out
    ratio = out["cpu_per_cycle_after_ms"] / max(1e-9, out["cpu_per_cycle_before_ms"])
    print(f"\nchurn, in-process (8 GPUs, {rate:g} claims/s held {hold:g} s, cycle every {interval:g} s, scrape every {scrape_every:g} s, {steps} cycles):")
    print(f"  CPU per cycle {out['cpu_per_cycle_before_ms']:.1f} ms before the cap binds (step {bound}), {out['cpu_per_cycle_after_ms']:.1f} ms after "
          f"({ratio:.2f}x); series max {out['series_max']} (retained {out['retained_series_max']}, cap {out['cap_series']}); "
          f"RSS {out['rss_start_mb']:.1f} -> {out['rss_end_mb']:.1f} MB (peak {out['rss_peak_mb']:.1f}); cycles shorter than the interval "
          f"{100 * out['cycles_on_time']:.0f} %; API requests per new claim {out['requests_per_new_claim']:.2f} "
          f"(claims {out['claim_requests_per_new_claim']:.2f}); jobs never billed {out['jobs_never_billed']} of {out['jobs_held_two_intervals']}")


def bench_churn_alone(seconds: float = 120.0, rate: float = 80.0, hold: float = 2.0, interval: float = 0.5) -> None:
    """The churn of ``bench_churn`` in real time with the agent alone in its own process
    (bench/agent_process.py --mode churn, its own interval, a scrape every 2 s): its RSS, its
    descriptors and threads, and the API requests per new claim, while this process hosts the
    kubelet and API emulations and starts ``rate`` jobs a second, each held ``hold`` seconds."""
    import subprocess

    from drasim.churn import Churn
    from drasim.node import SimulatedNode

    sc = eight_gpus()
    node = SimulatedNode(parse_scenario(sc), SimClock(1.0), request_log_size=10_000_000, kubelet_qps=None)
    node.start()
    try:
        (node.workdir / "scenario.json").write_text(json.dumps(sc))
        cmd = [sys.executable, str(ROOT / "bench" / "agent_process.py"), "--mode", "churn", "--scenario",
               str(node.workdir / "scenario.json"), "--socket", node.socket, "--kubeconfig", str(node.kubeconfig),
               "--interval", str(interval), "--seconds", str(seconds), "--scrape-every", "2"]
        agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        churn = Churn(node, per_step=max(1, round(rate * interval)), hold_steps=max(2, round(hold / interval)))
        node.api.clear_requests()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds - 2 * interval and agent.poll() is None:
            churn.step()
            time.sleep(max(0.0, t0 + churn.steps * interval - time.monotonic()))
        out_text, _ = agent.communicate(timeout=seconds + 120)
        if agent.returncode != 0:
            raise SystemExit(f"agent process failed ({agent.returncode})")
        out = json.loads(out_text.strip().splitlines()[-1])
        reqs = [r for r in node.api.requests if not r.watch]
        out.update(new_claims=len(churn.jobs), requests_per_new_claim=len(reqs) / max(1, len(churn.jobs)))
    finally:
        node.stop()
    RESULTS["churn_alone"] = out
    print(f"\nchurn, the agent alone ({seconds:g} s, {rate:g} claims/s held {hold:g} s, interval {interval:g} s): "
          f"RSS {out['start']['rss_mb']:.1f} MB at start, max {out['rss_max_mb']:.1f} MB (peak {out['peak_rss_mb']:.1f}), "
          f"{out['end']['rss_mb']:.1f} MB at the end; descriptors {out['start']['fds']} -> {out['end']['fds']}, "
          f"threads {out['start']['threads']} -> {out['end']['threads']}; {out['cycles']} cycles; "
          f"{out['new_claims']} new claims, {out['requests_per_new_claim']:.2f} API requests each")


def main() -> None:
    ap = argparse.ArgumentParser(description="Benchmarks for docs/performance.md.")
    ap.add_argument("which", nargs="*", metavar="BENCH", help="scrape, scrape-attack, cycle, gzip, nvml, xid, soak, series, churn, churn-alone "
                    "(default: all but scrape-attack and churn-alone)")
    ap.add_argument("--cycles", type=int, default=10000, help="soak: cycles between the two RSS readings")
    ap.add_argument("--requests", type=int, default=2000, help="scrape: requests per concurrency level")
    ap.add_argument("--cpu-seconds", type=float, default=30.0, help="soak: window for the CPU reading")
    ap.add_argument("--scales", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 2, 4), help="cycle: the dense node's sizes (default 1,2,4)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmarks run, numbers mean nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest.json")
    a = ap.parse_args()
    if a.quick:
        a.cycles, a.requests, a.cpu_seconds = 100, 60, 1.0
    configure("json", "error")
    fns = {
        "scrape": lambda: bench_scrape(a.requests, 5 if a.quick else 50),
        "scrape-attack": lambda: __import__("scrape_attack").bench(Node, big_scenario(), pct, RESULTS, a.requests, *((200, 20, 2, 2) if a.quick else ())),
        "cycle": lambda: bench_cycle(10 if a.quick else 200, 2.0 if a.quick else 20.0, (1,) if a.quick else a.scales, 5.0 if a.quick else 60.0, 1.0 if a.quick else 15.0),
        "gzip": lambda: bench_gzip(3 if a.quick else 30),
        "nvml": lambda: bench_nvml(*((10, 1) if a.quick else ())),
        "xid": lambda: bench_xid(4 if a.quick else 200),
        "soak": lambda: bench_soak(a.cycles, a.cpu_seconds, dense=not a.quick),
        "series": bench_series,
        "churn": lambda: bench_churn(*((12, 10.0) if a.quick else ())),
        "churn-alone": lambda: bench_churn_alone(*((10.0,) if a.quick else ())),
    }
    unknown = [w for w in a.which if w not in fns]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(fns)}")
    # the attack (minutes) and the agent alone under churn (real time) run when named
    for w in a.which or [f for f in fns if f not in ("scrape-attack", "churn-alone")]:
        fns[w]()
    RESULTS["machine"] = {"load_after": os.getloadavg(), "cpus": os.cpu_count(), "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d"), "quick": a.quick}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(RESULTS, indent=2, default=float))


if __name__ == "__main__":
    main()
