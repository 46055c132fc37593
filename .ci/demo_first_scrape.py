"""Start `dra-gpu-exporter demo` with the interpreter running this script, wait for a scrape in
which every collector succeeded (devices, kubelet, the Kubernetes API's slices and claims,
remediation: each talks to its peer through a runtime dependency) and device and claim series
are served, with /readyz 200; then stop it with SIGINT (a user's Ctrl-C) and check
that it exits cleanly. Used by .ci/floors to show the agent starts and serves with every runtime
dependency at its floor. Every wait is bounded; exit status 0 only if all of that happened."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

DEADLINE_S = 180.0  # generous: CI machines are shared; a healthy demo answers within seconds
WANTED = {"gpu_up", "dra_claim_utilization_ratio"}  # a device series and an attributed claim series
COLLECTORS = {"devices", "kubelet", "slices", "claims", "remediation"}  # dra_gpu_exporter_collector_success{collector=...}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    with tempfile.TemporaryFile() as log:
        ok = False
        proc = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}"], stdout=log, stderr=log, env=env)
        try:
            found: set[str] = set()
            ready = False
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                        body = r.read().decode()
                    samples = [s for fam in text_string_to_metric_families(body) for s in fam.samples]
                    succeeded = {s.labels["collector"] for s in samples if s.name == "dra_gpu_exporter_collector_success" and s.value == 1}
                    found = {s.name for s in samples} & WANTED | ({"collectors"} if succeeded >= COLLECTORS else set())
                    with urllib.request.urlopen(base + "/readyz", timeout=10) as r:
                        ready = r.status == 200
                    if found == WANTED | {"collectors"} and ready:
                        break
                except OSError:
                    ready = False  # not listening yet, or /readyz 503 (HTTPError is an OSError)
                time.sleep(0.2)
            ok = found == WANTED | {"collectors"} and ready
            print(
                f"demo: /readyz {'200' if ready else 'never 200'}; collectors {sorted(COLLECTORS)} "
                f"{'all succeeded' if 'collectors' in found else 'NOT all succeeded'}; series {sorted(WANTED)} {'served' if found >= WANTED else 'MISSING'}"
                + ("" if ok else f" (exit status so far: {proc.poll()})")
            )
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if not ok or code != 0:
                log.seek(0)
                sys.stdout.write(log.read().decode(errors="replace")[-6000:])
        print(f"demo: exit status {code} after SIGINT")
        return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
