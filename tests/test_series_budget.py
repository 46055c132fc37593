"""The series budget (docs/performance.md, "Series budget") holds for the two benchmark nodes.

docs/performance.md states a ceiling of series per physical GPU, per GPU partition, per claim, per pod and
per node. This test reads those ceilings from that document, runs the real agent (production wiring,
billing counters included) on the benchmark's 8-GPU node and its dense node (bench/run.py:
`eight_gpus`, `big_scenario`), scrapes its /metrics over HTTP after two cycles, sorts every
series into those kinds by its family, and fails when a kind is over its ceiling: a change that
adds series has to change the stated budget first. Its worked totals for both nodes are
checked against the ceilings too.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from kit_helpers import fetch

from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import parse_scenario
from exporter.config import TaintMode

REPO = Path(__file__).resolve().parent.parent
PERFORMANCE = REPO / "docs" / "performance.md"
KINDS = ("physical GPU", "GPU partition", "claim", "pod", "node")


def bench_run() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_run_for_budget", REPO / "bench" / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def section() -> str:
    return PERFORMANCE.read_text().split("## Series budget", 1)[1].split("\n#", 1)[0]


def ceilings() -> dict[str, tuple[int, int, int]]:
    """kind -> (series each, per device held, per container and device) from docs/performance.md's table."""
    out = {}
    for line in section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in KINDS and re.search(r"\d", cells[1]):
            nums = [int(n) for n in re.findall(r"\d+", cells[1])]
            out[cells[0]] = (nums + [0, 0])[:3] if cells[0] == "pod" else (nums[0], 0, 0)
    assert set(out) == set(KINDS), f"docs/performance.md's series budget table names {sorted(out)}"
    return out


def kind_of(family: str) -> str:
    if family.startswith("gpu_"):
        return "device"
    if family.startswith("dra_claim_"):
        return "claim"
    if family.startswith("dra_pod_") or family == "dra_device_allocation_info":
        return "pod"
    return "node"


def measure(raw: dict) -> tuple[dict[str, int], dict[str, int]]:
    """(series by kind, units by kind) of a scenario's agent after two cycles."""
    sc = parse_scenario(raw)
    clock = SimClock(1.0)
    clock.pause()
    with SimulatedNode(sc, clock) as node:
        node.start()
        agent = node.start_agent(interval=3600.0, taint_mode=TaintMode.ENFORCE)
        for _ in range(2):  # a second cycle: the billing counters have an interval behind them
            clock.advance_to(clock.now() + 5)
            agent.run_cycle()
        snap = agent.snapshot
        assert snap is not None and agent.server is not None
        status, body = fetch(f"{agent.server.url}/metrics")
        assert status == 200
    families: Counter[str] = Counter()
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            families[re.sub(r"_(bucket|sum|count)$", "", name) if "detection_to_taint" in name else name] += 1
    series: Counter[str] = Counter()
    for fam, n in families.items():
        series[kind_of(fam)] += n
    pods = {(a.namespace, a.pod) for a in snap.allocations}
    pod_devices = {(a.namespace, a.pod, a.uuid) for a in snap.allocations if a.uuid}
    rows = {(a.namespace, a.pod, a.container, a.uuid) for a in snap.allocations}
    units = {
        "physical GPU": sum(1 for d in snap.devices if not d.identity.is_partition),
        "GPU partition": sum(1 for d in snap.devices if d.identity.is_partition),
        "claim": len(snap.claims),
        "pod": len(pods),
        "pod devices": len(pod_devices),
        "pod rows": len(rows),
    }
    return dict(series), units


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return bench_run()


@pytest.mark.parametrize("which", ["eight_gpus", "big_scenario"])
def test_series_stay_within_the_stated_budget(bench: ModuleType, which: str) -> None:
    series, units = measure(getattr(bench, which)())
    c = ceilings()
    device_budget = c["physical GPU"][0] * units["physical GPU"] + c["GPU partition"][0] * units["GPU partition"]
    pod_budget = c["pod"][0] * units["pod"] + c["pod"][1] * units["pod devices"] + c["pod"][2] * units["pod rows"]
    got = {k: series.get(k, 0) for k in ("device", "claim", "pod", "node")}
    print(f"{which}: series {got} (total {sum(got.values())}), units {units}")
    assert got["device"] <= device_budget, f"device series {got['device']} over the budget {device_budget}"
    assert got["claim"] <= c["claim"][0] * units["claim"], f"claim series {got['claim']} over the budget"
    assert got["pod"] <= pod_budget, f"pod series {got['pod']} over the budget {pod_budget}"
    assert got["node"] <= c["node"][0], f"node-level series {got['node']} over the budget {c['node'][0]}"


def test_the_readmes_worked_totals_follow_from_the_ceilings() -> None:
    c = ceilings()
    # | node | GPUs | partitions | claims | pods | devices held per pod | budget | ... |
    rows = [line for line in section().splitlines() if line.count("|") == 9 and re.match(r"\| [^|]*\| \d", line)]
    assert len(rows) == 2, rows
    for line in rows:
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        gpus, parts, claims, pods, held, budget = (int(x.replace(",", "")) for x in cells[1:7])
        want = c["physical GPU"][0] * gpus + c["GPU partition"][0] * parts + c["claim"][0] * claims + (c["pod"][0] + (c["pod"][1] + c["pod"][2]) * held) * pods + c["node"][0]
        assert budget == want, f"docs/performance.md: {cells[0]} budget {budget}, the ceilings make {want}"
