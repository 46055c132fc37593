"""The showback demo (drasim/scenarios/showback.yaml) scraped by a real Prometheus with the shipped
rules: the billing counters per claim and pod, the per-namespace recording rules and every query
of dashboards/showback.json answer for a shared claim, a MIG GPU split between two namespaces and
batch jobs whose claims come and go.

Debian's `prometheus` scrapes `dra-gpu-exporter demo --scenario showback` (x10 simulated time)
every second. Waits are bounded polls for data; the checks are on values, never on timing: the
splits are exact on the exporter's own counters (equal halves of the shared claim, 4/7 against
3/7 of the MIG GPU) and Prometheus's rates and roll-ups keep those proportions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kit_helpers import Samples, free_port, running_demo, scrape_samples
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, PrometheusServer, start_prometheus
from test_dashboards import BUILTINS, SCRAPE_INTERVAL_S, load, substitute, targets

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "drasim" / "scenarios" / "showback.yaml"
DASHBOARD = REPO / "dashboards" / "showback.json"
RULES = REPO / "alerts" / "dra-gpu-exporter.rules.yml"
NAMESPACES = {"ml", "inference", "analytics", "batch", "research", "legacy"}

pytestmark = pytest.mark.prometheus


@pytest.fixture(scope="module")
def showback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusServer, float, str]]:
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS_REASON)
    node = str(yaml.safe_load(SCENARIO.read_text())["node"])
    port = free_port()
    start = time.time()
    # Prometheus first, so it sees the demo from its first second. x10 with a 0.25 s cycle: 2.5
    # simulated seconds a cycle, each 60 s batch job seen by ~24 cycles.
    with (
        start_prometheus(
            [f"127.0.0.1:{port}"], tmp_path_factory.mktemp("prometheus"), scrape_interval=f"{SCRAPE_INTERVAL_S}s",
            rule_files=[RULES], target_labels={"node": node},
        ) as server,
        running_demo(port, "--scenario", str(SCENARIO), "--time-scale", "10", "--interval", "0.25",
                     "--log-format", "json", "--log-level", "warning", cwd=REPO),
    ):
        server.wait_for_targets_up()
        # job-1 ran from 10 s to 70 s (simulated), job-2 from 80 s: once job-2 has energy, job-1's
        # claim is gone from the node and only its kept series tells what it used. increase()
        # (the panels') needs two samples of job-2 with energy between them; on a busy machine the
        # first scrape of job-2 may already show energy, so wait for the increase, not the value.
        server.wait_for_query('increase(dra_claim_energy_joules_total{claim="job-2"}[10m]) > 0', timeout=120)
        for ns in sorted(NAMESPACES):
            server.wait_for_query(f'namespace:dra_pod_energy_joules:rate5m{{namespace="{ns}"}} > 0', timeout=60)
        yield server, start, f"http://127.0.0.1:{port}"


def by(m: Samples, name: str, label: str) -> dict[str, float]:
    return {labels[label]: v for labels, v in m.get(name, [])}


def panel_query(title: str, ref: str = "A") -> str:
    for panel, target in targets(load(DASHBOARD)):
        if panel["title"] == title and target["refId"] == ref:
            return str(target["expr"])
    raise KeyError(title)


def run(server: PrometheusServer, start: float, expr: str, **chosen: str) -> list[dict[str, Any]]:
    end = time.time()
    values = {**BUILTINS, "__range": f"{int(end - start) + 1}s", "node": ".*", "namespace": ".*", "claim": ".*", **chosen}
    return server.query(substitute(expr, values), at=end)


def test_exporter_counters_split_exactly(showback: Any) -> None:
    _, _, url = showback
    m = scrape_samples(url)
    claims = by(m, "dra_claim_energy_joules_total", "claim")
    pods = by(m, "dra_pod_energy_joules_total", "pod")
    seconds = by(m, "dra_claim_device_seconds_total", "claim")
    # the shared claim: one claim, its energy halved between its two pods (a sidecar is no third pod)
    assert claims["shared-train"] > 0 and pods["trainer-a"] == pods["trainer-b"] == claims["shared-train"] / 2
    # the MIG GPU: 4g and 3g instances held since the first cycle get 4/7 and 3/7 of it
    assert math.isclose(seconds["mig-large"] / seconds["mig-small"], 4 / 3, rel_tol=1e-9)
    assert math.isclose(claims["mig-large"] / claims["mig-small"], 4 / 3, rel_tol=1e-9)
    # churn: job-1 ended before job-2 began and still has its series, with what it used
    assert claims["job-1"] > 0 and seconds["job-1"] > 0
    assert not [labels for labels, _ in m["dra_device_allocation_info"] if labels["claim"] == "job-1"]
    # the device-plugin pod is billed like any holder; the free GPU is nobody's
    assert pods["dp-job"] > 0
    shares = {(labels["pod"], labels["rule"]): v for labels, v in m["dra_pod_device_share_ratio"]}
    assert shares[("trainer-a", "equal")] == shares[("trainer-b", "equal")] == 0.5
    assert shares[("server", "equal")] == shares[("dp-job", "equal")] == 1.0


def test_namespace_roll_ups_answer_for_every_namespace(showback: Any) -> None:
    server, _, _ = showback
    energy = {r["metric"]["namespace"]: float(r["value"][1]) for r in server.query("namespace:dra_pod_energy_joules:rate5m")}
    claims_energy = {r["metric"]["namespace"]: float(r["value"][1]) for r in server.query("namespace:dra_claim_energy_joules:rate5m")}
    gpus = {r["metric"]["namespace"]: float(r["value"][1]) for r in server.query("namespace:dra_claim_device_seconds:rate5m")}
    assert set(energy) == NAMESPACES and all(v > 0 for v in energy.values())
    assert set(claims_energy) == NAMESPACES - {"legacy"}  # a device-plugin pod has no claim
    # one series per namespace, node and claim labels aggregated away
    assert all(set(r["metric"]) == {"__name__", "namespace"} for r in server.query("namespace:dra_pod_device_seconds:rate5m"))
    # the recorded rates keep the MIG split: both instances' counters move in lockstep
    assert math.isclose(gpus["inference"] / gpus["analytics"], 4 / 3, rel_tol=1e-6)


def test_every_showback_query_answers(showback: Any) -> None:
    server, start, _ = showback
    for panel, target in targets(load(DASHBOARD)):
        result = run(server, start, target["expr"])
        assert result, f"{panel['title']} / {target['refId']}: no data"


def test_showback_panels_by_namespace_and_claim(showback: Any) -> None:
    server, start, _ = showback
    energy = {r["metric"]["namespace"]: float(r["value"][1]) for r in run(server, start, panel_query("Energy by namespace (time range)"))}
    assert set(energy) == NAMESPACES and all(v > 0 for v in energy.values())
    hours = {r["metric"]["namespace"]: float(r["value"][1]) for r in run(server, start, panel_query("GPU-hours by namespace (time range)"))}
    assert set(hours) == NAMESPACES and all(v > 0 for v in hours.values())
    # per claim, the ended job included; narrowed to one claim, only that claim
    per_claim = {r["metric"]["claim"]: float(r["value"][1]) for r in run(server, start, panel_query("Energy and GPU-hours per claim (time range)"))}
    assert {"shared-train", "mig-large", "mig-small", "job-1", "job-2", "idle-notebook"} <= set(per_claim)
    one = run(server, start, panel_query("Energy and GPU-hours per claim (time range)", "B"), namespace="batch", claim="job-1")
    assert [r["metric"]["claim"] for r in one] == ["job-1"] and float(one[0]["value"][1]) > 0
    top = {r["metric"]["claim"] for r in run(server, start, panel_query("Top 10 claims by energy (time range)"))}
    assert "shared-train" in top
    idle = {r["metric"]["claim"] for r in run(server, start, panel_query("Idle allocated GPUs (under 5 % over the last hour)"))}
    assert idle == {"idle-notebook"}
    shared = {r["metric"]["pod"] for r in run(server, start, panel_query("Shared devices and their split"))}
    assert shared == {"trainer-a", "trainer-b"}
