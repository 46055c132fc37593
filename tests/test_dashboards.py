"""Grafana dashboards: structure, and every query run by a real Prometheus against the demo.

Static checks (always): current schemaVersion, datasource as a variable everywhere, the node /
namespace / claim variables, unique ids, a grid without overlaps, variables used as regex matchers.

Live checks (need Debian's `prometheus`): the demo (`dra-gpu-exporter demo`, simulated node with an
XID 79 fault a simulated minute in, run at x20) is scraped every second by a real Prometheus that also loads
alerts/dra-gpu-exporter.rules.yml. Every panel query and every variable query is then sent to it
the way Grafana would (variables substituted, $__rate_interval resolved) and must parse and return
data over the run; every metric the dashboards and alerts name must have been exported; every alert
rule must evaluate without error on the real series.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kit_helpers import free_port, running_demo, wait_until  # tests/ is on sys.path
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, PrometheusServer, start_prometheus

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
RULES = REPO / "alerts" / "dra-gpu-exporter.rules.yml"
SCHEMA_VERSION = 42  # Grafana 12.x/13.x classic JSON model (@grafana/schema 13.2 default)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REQUIRED_VARIABLES = {
    "fleet-overview": {"datasource", "node"},
    "claim-drilldown": {"datasource", "node", "namespace", "claim"},
    "node-health": {"datasource", "node"},
    "showback": {"datasource", "node", "namespace", "claim"},
}
# Metrics the exporter only emits in situations the demo does not create.
ABSENT_IN_DEMO = {
    "dra_gpu_exporter_taint_suppressed_total": "only counted once a fault's rule is suppressed (budget, rate limit, kill switch)",
    "dra_device_reported_health": "opt-in (--kubelet-device-health, off by default: docs/deploy.md says why)",
}
SCRAPE_INTERVAL_S = 1
BUILTINS = {"__rate_interval": f"{4 * SCRAPE_INTERVAL_S}s", "__interval": f"{SCRAPE_INTERVAL_S}s"}
RANGE_BUILTINS = {"__range"}  # the dashboard's time range: set per query to the whole run
# An exporter metric's name; not a part of a recorded series' name (namespace:dra_..._joules:rate5m),
# which the rules make, not the exporter (the panel queries using one must still return data).
METRIC_TOKEN = re.compile(r"(?<![:\w])((?:gpu|dra)_[a-zA-Z0-9_]+)\b(?!:)")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dash: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in panels(dash):
        for target in panel.get("targets", []):
            yield panel, target


def variable_query(var: dict[str, Any]) -> str:
    q = var["query"]
    return q["query"] if isinstance(q, dict) else q


def all_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard stem, panel title, refId, expr) for every panel target."""
    out = []
    for path in DASHBOARDS:
        for panel, target in targets(load(path)):
            out.append((path.stem, panel["title"], target["refId"], target["expr"]))
    return out


def parse_label_values(query: str) -> tuple[str | None, str]:
    """label_values(selector, label) or label_values(label) -> (selector or None, label)."""
    m = re.fullmatch(r"label_values\((?:(.+),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)", query)
    assert m, f"unsupported variable query {query!r}"
    return m.group(1), m.group(2)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace $var and ${var} the way Grafana interpolates a Prometheus query."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"unresolved variable in {expr!r}"
    return expr


# --- static structure -------------------------------------------------------------------------


def test_the_shipped_dashboards_exist() -> None:
    assert {p.stem for p in DASHBOARDS} == set(REQUIRED_VARIABLES)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_metadata(path: Path) -> None:
    dash = load(path)
    assert dash["schemaVersion"] == SCHEMA_VERSION
    assert dash["title"].startswith("DRA GPU exporter / ")
    assert "dra-gpu-exporter" in dash["tags"]
    assert 0 < len(dash["uid"]) <= 40 and re.fullmatch(r"[a-z0-9-]+", dash["uid"])
    assert dash.get("id") is None, "exported dashboards must not carry a database id"


def test_dashboard_uids_are_unique() -> None:
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_datasource_is_a_variable_everywhere(path: Path) -> None:
    dash = load(path)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE, var["name"]
    for panel in panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_templated_variables(path: Path) -> None:
    dash = load(path)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert REQUIRED_VARIABLES[path.stem] <= set(variables)
    for name in REQUIRED_VARIABLES[path.stem] - {"datasource"}:
        var = variables[name]
        assert var["type"] == "query"
        assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
        assert variable_query(var).startswith("label_values(")
    # Every variable a query uses is defined, and used as a regex matcher (multi-value selections
    # are interpolated as a|b|c).
    defined = set(variables)
    for panel, target in targets(dash):
        for name in re.findall(r"\$\{?([a-zA-Z_][a-zA-Z0-9_]*)", target["expr"]):
            if name.startswith("__"):
                assert name in BUILTINS or name in RANGE_BUILTINS, f"{panel['title']}: unsupported builtin ${name}"
                continue
            assert name in defined, f"{panel['title']}: ${name} is not defined"
            assert f'=~"${name}"' in target["expr"], f"{panel['title']}: ${name} must be used with =~"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_panel_ids_and_grid(path: Path) -> None:
    dash = load(path)
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in panels(dash):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


# --- live: the demo scraped by a real Prometheus ----------------------------------------------


def _scenario(name: str = "mixed-node") -> tuple[Path, str]:
    """The bundled scenario's file and node name (``demo --list-scenarios``)."""
    listing = subprocess.run(
        [sys.executable, "-m", "exporter", "demo", "--list-scenarios"],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    ).stdout
    paths = dict(line.split("\t", 1) for line in listing.splitlines() if "\t" in line)
    path = Path(paths[name].strip())
    return path, str(yaml.safe_load(path.read_text())["node"])


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusServer, float]]:
    """Prometheus first (so it sees the demo from its first second), then the demo.

    Yields the server and the wall-clock start of the run, for range queries over all of it.
    """
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS_REASON)
    scenario, node = _scenario()
    port = free_port()
    start = time.time()
    # The ServiceMonitor copies the pod's node name into `node` on the target; do the same here.
    with (
        start_prometheus(
            [f"127.0.0.1:{port}"],
            tmp_path_factory.mktemp("prometheus"),
            scrape_interval=f"{SCRAPE_INTERVAL_S}s",
            rule_files=[RULES],
            target_labels={"node": node},
        ) as server,
        # x20: the scenario's XID 79 (1 simulated minute in) lands 3 s after start and the GPU is
        # lost until 9 s, several scrapes wide. 0.5 s collection keeps up with the faster clock.
        running_demo(port, "--scenario", str(scenario), "--time-scale", "20", "--interval", "0.5",
                     "--log-format", "json", "--log-level", "warning", cwd=REPO),
    ):
        server.wait_for_targets_up()
        # The fault, and enough samples for rate windows.
        server.wait_for_query('count(max_over_time(gpu_health_condition{tier="fatal"}[5m])) > 0', timeout=60)
        server.wait_for_query('gpu_xid_errors_total{xid="79"}', timeout=60)
        server.wait_for_query('count_over_time(up{job="dra-gpu-exporter"}[5m]) >= 8', timeout=60)
        # rate() needs two samples: the lost GPU's read-error counter appears with the fault,
        # so wait for its second scrape instead of hoping the panels run late enough.
        server.wait_for_query('count_over_time(gpu_read_errors_total[5m]) >= 2', timeout=60)
        yield server, start


def _window(prom: tuple[PrometheusServer, float]) -> tuple[PrometheusServer, float, float]:
    server, start = prom
    return server, start, time.time()


def _has_data(server: PrometheusServer, expr: str, start: float, end: float) -> bool:
    return any(series["values"] for series in server.query_range(expr, start, end, SCRAPE_INTERVAL_S))


@pytest.mark.prometheus
@pytest.mark.parametrize("dashboard,title,ref,expr", all_queries(), ids=lambda v: str(v)[:60])
def test_panel_query_parses_and_returns_data(prom: Any, dashboard: str, title: str, ref: str, expr: str) -> None:
    server, start, end = _window(prom)
    values = {**BUILTINS, "__range": f"{int(end - start) + 1}s", "node": ".*", "namespace": ".*", "claim": ".*"}
    query = substitute(expr, values)
    result = server.query_range(query, start, end, SCRAPE_INTERVAL_S)  # raises on a parse error
    metrics = set(METRIC_TOKEN.findall(expr))
    if metrics and metrics <= set(ABSENT_IN_DEMO):
        return
    assert any(s["values"] for s in result), f"{dashboard} / {title} / {ref}: no data for {query}"


@pytest.mark.prometheus
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_variable_queries_return_values(prom: Any, path: Path) -> None:
    server, start, _ = _window(prom)
    for var in load(path)["templating"]["list"]:
        if var["type"] != "query":
            continue
        selector, label = parse_label_values(variable_query(var))
        match = [substitute(selector, {"node": ".*", "namespace": ".*"})] if selector else []
        assert server.label_values(label, match, start=start), f"{path.stem}: ${var['name']} has no values"


@pytest.mark.prometheus
def test_claim_drilldown_with_one_claim_selected(prom: Any) -> None:
    # Pick a real claim the way a user would (node → namespace → claim) and check every panel of
    # the drill-down narrows to it and still has data.
    server, start, end = _window(prom)
    dash = load(REPO / "dashboards" / "claim-drilldown.json")
    variables = {v["name"]: v for v in dash["templating"]["list"]}

    def choices(name: str, chosen: dict[str, str]) -> list[str]:
        selector, label = parse_label_values(variable_query(variables[name]))
        match = [substitute(selector, chosen)] if selector else []
        return server.label_values(label, match, start=start)

    node = choices("node", {})[0]
    assert "ml" in choices("namespace", {"node": node})
    assert "shared-gpu" in choices("claim", {"node": node, "namespace": "ml"})
    values = {**BUILTINS, "__range": f"{int(end - start) + 1}s", "node": node, "namespace": "ml", "claim": "shared-gpu"}
    for panel, target in targets(dash):
        expr = target["expr"]
        if "$claim" not in expr:
            continue
        result = server.query_range(substitute(expr, values), start, end, SCRAPE_INTERVAL_S)
        assert result, f"{panel['title']}: no data for claim ml/shared-gpu"
        for series in result:
            assert series["metric"].get("claim", "shared-gpu") == "shared-gpu", panel["title"]
    # The shared claim is reported once, with both pods.
    pods = server.query(f'dra_claim_pods{{node="{node}", namespace="ml", claim="shared-gpu"}}')
    assert [float(p["value"][1]) for p in pods] == [2.0]


@pytest.mark.prometheus
def test_every_metric_in_dashboards_and_alerts_is_exported(prom: Any) -> None:
    server, start, _ = _window(prom)
    exported = server.metric_names(start=start)
    referenced: dict[str, str] = {}
    for dashboard, title, _ref, expr in all_queries():
        for name in METRIC_TOKEN.findall(expr):
            referenced.setdefault(name, f"{dashboard} / {title}")
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            for name in METRIC_TOKEN.findall(rule["expr"]):
                referenced.setdefault(name, f"rule {rule.get('alert') or rule['record']}")
    missing = {name: where for name, where in referenced.items() if name not in exported and name not in ABSENT_IN_DEMO}
    assert not missing, f"referenced but never exported by the demo: {missing}"


@pytest.mark.prometheus
def test_alert_rules_evaluate_cleanly_on_demo_data(prom: Any) -> None:
    server, _, _ = _window(prom)

    def evaluated() -> list[dict[str, Any]] | None:
        rules = server.rules()
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_until(evaluated, 60, interval=0.2, message="every alert rule evaluated once", ignore=(Exception,))
    names = {r["name"] for r in rules}
    assert len(names) == len(rules) == sum(
        len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"]
    )
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad
