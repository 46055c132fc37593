"""`dra-gpu-exporter demo` end to end: the real entry point in a subprocess, scraped over HTTP,
stopped with SIGINT like a user's Ctrl-C. Every wait is bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kit_helpers import fetch, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

from drasim.scenario import bundled_scenarios


class Demo:
    """The demo as a child process; stdout lines are collected by a thread as they come."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._banner = threading.Event()
        self.stderr_path = tmp_path / "demo.stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
        with open(self.stderr_path, "wb") as err:  # logs go to a file: a full pipe would block the demo
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{self.port}", *args],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl-C"):
                self._banner.set()
        self._banner.set()

    def wait(self, predicate, timeout: float, what: str):
        """``predicate``'s first truthy value; fails at once if the demo exits. A refused
        connection (the server is not up yet) counts as "not yet"."""

        def check():
            if self.proc.poll() is not None:
                raise AssertionError(f"demo exited with {self.proc.returncode} while waiting for {what}:\n" + self.output())
            return predicate()

        try:
            return wait_until(check, timeout, interval=0.05, message=what, ignore=(OSError,))
        except TimeoutError as e:
            raise AssertionError(f"{e}:\n" + self.output()) from None

    def banner_dir(self) -> Path:
        assert self._banner.wait(60), "no banner:\n" + self.output()
        m = next((re.search(r"kubelet socket:\s+(\S+)", line) for line in self.lines if "kubelet socket:" in line), None)
        assert m, "banner without the kubelet socket:\n" + self.output()
        return Path(m.group(1)).parent

    def output(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-4000:] if self.stderr_path.exists() else ""
        return "\n".join(self.lines) + "\n--- stderr (tail) ---\n" + err

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"demo did not stop within {timeout}s after signal {sig}:\n" + self.output()) from None


def samples(body: bytes) -> list:
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


@pytest.mark.slow
def test_demo_serves_the_mixed_node_and_stops_cleanly(tmp_path):
    demo = Demo(tmp_path, "--time-scale", "60")
    try:
        workdir = demo.banner_dir()
        assert workdir.is_dir() and workdir.name.startswith("dra-demo-")
        demo.wait(lambda: fetch(demo.url + "/readyz")[0] == 200, 60, "/readyz 200")

        def scraped():
            status, body = fetch(demo.url + "/metrics")
            s = samples(body) if status == 200 else []
            # wait for a cycle that saw the claims (the slice watch is asynchronous)
            return s if any(x.name == "dra_claim_devices" for x in s) else None

        s = demo.wait(scraped, 60, "claims in /metrics")
    finally:
        rc = demo.stop(signal.SIGINT)

    def find(name, **labels):
        return [x for x in s if x.name == name and all(x.labels.get(k) == v for k, v in labels.items())]

    # devices: 5 GPUs, one of them with two MIG instances
    infos = find("gpu_info")
    assert len(infos) == 7
    assert sum(1 for x in infos if x.labels["mig_profile"] == "3g.40gb") == 2
    assert all(x.labels["node"] == "demo-node" for x in s)
    # allocations: the shared claim is held by two pods ...
    shared = find("dra_device_allocation_info", claim="shared-gpu")
    assert {x.labels["pod"] for x in shared} == {"trainer-a", "trainer-b"}
    assert len({x.labels["uuid"] for x in shared}) == 1 and shared[0].labels["uuid"].startswith("GPU-")
    # ... and appears once in every dra_claim_* family
    for fam in ("dra_claim_devices", "dra_claim_pods", "dra_claim_healthy", "dra_claim_memory_used_bytes"):
        assert len(find(fam, namespace="ml", claim="shared-gpu")) == 1, fam
    assert find("dra_claim_pods", claim="shared-gpu")[0].value == 2
    assert find("dra_claim_devices", claim="shared-gpu")[0].value == 1
    # MIG claims resolve to MIG instances, the device-plugin pod to its GPU
    mig = find("dra_device_allocation_info", claim="mig-a")
    assert len(mig) == 1 and mig[0].labels["uuid"].startswith("MIG-")
    dp = find("dra_device_allocation_info", pod="dp-job")
    assert len(dp) == 1 and dp[0].labels["claim"] == "" and dp[0].labels["driver"] == "nvidia.com/gpu"
    assert find("dra_gpu_exporter_collector_success", collector="kubelet")[0].value == 1

    # a clean exit on Ctrl-C, and the temporary directory (socket, kubeconfig) is gone
    assert rc == 0, demo.output()
    assert not workdir.exists()
    assert "demo stopped; temporary files removed" in demo.lines
    assert "Traceback" not in demo.output()


@pytest.mark.slow
def test_demo_runs_the_mig_heavy_scenario_and_stops_on_sigterm(tmp_path):
    demo = Demo(tmp_path, "--scenario", str(bundled_scenarios()["mig-8gpu"]), "--time-scale", "10")
    try:
        workdir = demo.banner_dir()

        def scraped():
            status, body = fetch(demo.url + "/metrics")
            s = samples(body) if status == 200 else []
            return s if sum(1 for x in s if x.name == "dra_claim_devices") == 24 else None

        s = demo.wait(scraped, 60, "all 24 claims in /metrics")
    finally:
        rc = demo.stop(signal.SIGTERM)  # the kubelet stops pods with SIGTERM
    assert rc == 0, demo.output()
    assert not workdir.exists()
    assert sum(1 for x in s if x.name == "gpu_info") == 8 + 28
    pair = [x for x in s if x.name == "dra_claim_devices" and x.labels["claim"] == "mig-pair"]
    assert len(pair) == 1 and pair[0].value == 2
    # every allocated device resolved to a local device
    assert all(x.labels["uuid"] for x in s if x.name == "dra_device_allocation_info")
    assert not [x for x in s if x.name == "dra_unresolved_devices" and x.value > 0]


@pytest.mark.slow
def test_ctrl_c_during_start_up_still_cleans_up(tmp_path):
    demo = Demo(tmp_path, "--time-scale", "60")
    try:
        # the in-process API server is up, the agent is not yet: interrupt right there
        demo.wait(lambda: "apiserver_started" in demo.stderr_path.read_text(errors="replace"), 60, "API server start")
    finally:
        rc = demo.stop(signal.SIGINT)
    assert rc == 0, demo.output()
    assert "Traceback" not in demo.output()
    assert "demo stopped; temporary files removed" in demo.lines
    workdir = demo.banner_dir()
    assert not workdir.exists()
