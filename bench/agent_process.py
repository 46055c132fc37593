"""The agent alone in its own process, for the RSS and CPU numbers (run by ``bench/run.py soak``).

The benchmark's parent process hosts the kubelet (gRPC) and the Kubernetes API (HTTP)
emulations; this process holds only what a DaemonSet pod holds: the agent, its HTTP server,
its watchers and remediation, with the simulated backend standing in for the device library.
It prints one JSON line with its measurements.

    python bench/agent_process.py --scenario S.json --socket K.sock --kubeconfig KC --cycles N
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--cpu-seconds", type=float, default=30.0)
    a = ap.parse_args()

    # The kubernetes client imports kubernetes_validate (and jsonschema with it) whenever it is
    # installed. Only the test extras install it; the image does not. Hide it so this process
    # holds what a production pod holds.
    sys.modules["kubernetes_validate"] = None  # type: ignore[assignment]
    interpreter_mb = rss_mb()

    from exporter.config import Config, TaintMode
    from drasim.backend import SimBackend, SimClock
    from exporter.logs import configure
    from drasim.scenario import parse_scenario
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
        interval=1.0,
        taint_mode=TaintMode.ENFORCE,
    )
    agent = build_agent(cfg, backend=SimBackend(sc, clock), clock=clock.epoch)
    imported_mb = rss_mb()
    agent.start()
    try:
        for _ in range(20):
            agent.run_cycle()
        start_mb = rss_mb()
        marks = []
        t0 = time.perf_counter()
        for i in range(a.cycles):
            agent.run_cycle()
            if (i + 1) % max(1, a.cycles // 5) == 0:
                marks.append(round(rss_mb(), 1))
        cycles_s = time.perf_counter() - t0
        end_mb = rss_mb()
        # CPU at the real 1 s interval: only the agent's own threads run in this window.
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(a.cpu_seconds)
        cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
        out = {
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
