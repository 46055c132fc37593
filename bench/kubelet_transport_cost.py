"""CPU per kubelet List call: the h2-based transport against the hand-written one it replaced.

    python bench/kubelet_transport_cost.py [--commit 0101393] [--cadence-calls 30]

Both transports run in this process, against the same grpcio kubelet emulation (drasim), on
the same answers (an 8-GPU node's 32 pods, the dense node's 256 pods and 512 claims): back to
back in alternating blocks, then interleaved at a cadence (one call of each every 0.5 s: cold
caches, as the agent's 1 s and 5 s intervals see them). CPU is the calling thread's own
(time.thread_time): neither transport has threads, and the server's threads are not counted.
The hand-written transport is read from git at ``--commit`` (the last commit that had it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drasim.kubelet import FakeKubelet, claim, container, pod  # noqa: E402
from exporter.kubelet import transport as h2_transport  # noqa: E402

LIST = "/v1.PodResourcesLister/List"
MAX = 16 * 1024 * 1024


def old_transport(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:exporter/kubelet/transport.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="old-transport-")) / "handwritten_transport.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("handwritten_transport", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pods(n: int, claims_per_pod: int) -> list:
    return [
        pod(f"ns{i % 16}", f"pod-{i}", [container("main", claims=[claim(f"ns{i % 16}", f"claim-{i}-{k}", [("gpu.nvidia.com", "node-a", f"gpu-{(i + k) % 64}", None)]) for k in range(claims_per_pod)])])
        for i in range(n)
    ]


def per_call_us(conn, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        conn.call(LIST, b"", 5.0)
    return (time.thread_time() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default="0101393")
    ap.add_argument("--calls", type=int, default=2000, help="back to back, per transport")
    ap.add_argument("--cadence-calls", type=int, default=30, help="at a cadence, per transport")
    a = ap.parse_args()
    old = old_transport(a.commit)
    kinds = {"h2": h2_transport.UnaryConnection, "hand-written": old.UnaryConnection}
    sock = str(Path(tempfile.mkdtemp(prefix="ktc-", dir="/tmp")) / "k.sock")
    with FakeKubelet(sock, qps=None) as kubelet:
        for label, answer in (("8 GPUs: 32 pods, 32 claims", pods(32, 1)), ("dense: 256 pods, 512 claims", pods(256, 2))):
            kubelet.set_pods(answer)
            conns = {k: cls(sock, 5.0, MAX) for k, cls in kinds.items()}
            for conn in conns.values():
                per_call_us(conn, 50)  # warm
            block = 200
            back: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(max(1, a.calls // block)):
                for k, conn in conns.items():
                    back[k].append(per_call_us(conn, block))
            cadence: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(a.cadence_calls):
                for k, conn in conns.items():
                    time.sleep(0.5)
                    cadence[k].append(per_call_us(conn, 1))
            for conn in conns.values():
                conn.close()
            print(f"\n{label}")
            print("| transport | back to back, us per call (median of blocks) | every 0.5 s, us per call (median) | at 5 s: % of a core |")
            print("|---|---|---|---|")
            for k in kinds:
                b = sorted(back[k])[len(back[k]) // 2]
                c = sorted(cadence[k])[len(cadence[k]) // 2]
                print(f"| {k} | {b:.0f} | {c:.0f} | {c / 5e6 * 100:.4f} % |")


if __name__ == "__main__":
    main()
