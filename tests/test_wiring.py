"""Composition lives in exporter/wiring.py, and adding a source takes one module there.

* No module of the product but wiring.py constructs a source, a collector or an output (the
  agent, the health engine, the renderer, the HTTP endpoint, the remediator and its cluster
  parts): read from the code's syntax tree, so a part built anywhere else is named with its line.
* A source added the documented way (docs/architecture.md, "How to add a source"): one new
  module holding the source and its collector, one line in wiring.py building it where the
  collectors are listed (and its import). The test writes both into a copy of the code and runs
  that agent: the new collector is timed and reported, its counters are self-metrics, its failure
  is in /readyz and its last good value stands in, and the import contract still holds. The
  example ships nowhere but here.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What only wiring.py builds. Backends are made by exporter.devices.select.make_backend
# (the --backend choice), which wiring calls; the parts of a part (a feed's own watch) are that
# part's business.
SOURCES = {
    "DeviceCollector", "KubeletCollector", "SliceCollector", "ClaimCollector", "PodCollector", "ProcessCollector",
    "PodResourcesClient", "SliceWatcher", "ClaimCache", "NodePods", "PodWatcher", "ReportedHealthCollector",
}
OUTPUTS = {
    "Agent", "HealthEngine", "StarvationMonitor", "Renderer", "UsageAccountant", "MetricsServer", "Remediator",
    "TaintRuleClient", "ClusterBudget", "EventRecorder", "NodeState", "WatchedRules", "ListedRules",
    "WatchedKillSwitch", "PolledKillSwitch",
}


def constructions(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, class) of every call of one of ``names`` in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in names:
                out.append((node.lineno, name))
    return out


def test_only_wiring_constructs_sources_and_outputs() -> None:
    found = []
    for path in sorted((REPO / "exporter").rglob("*.py")):
        if path.name in ("api_pb2.py", "api_pb2_grpc.py") or path == REPO / "exporter" / "wiring.py":
            continue
        found += [f"{path.relative_to(REPO)}:{line}: {name}(...)" for line, name in constructions(path.read_text(), SOURCES | OUTPUTS)]
    assert not found, "built outside exporter/wiring.py:\n" + "\n".join(found)
    # ...and wiring.py does build them (the list above names real constructors)
    built = {name for _, name in constructions((REPO / "exporter" / "wiring.py").read_text(), SOURCES | OUTPUTS)}
    assert built == SOURCES | OUTPUTS, sorted((SOURCES | OUTPUTS) - built)


def test_the_check_sees_a_part_built_elsewhere() -> None:
    # what exporter/agent.py did before composition moved: the agent built its own health
    # engine and HTTP server
    planted = textwrap.dedent("""
        class Agent:
            def __init__(self, cfg, clock):
                self.health = HealthEngine(clock)
                self.server = metrics.server.MetricsServer(cfg.listen_host, cfg.listen_port, self.readiness)
    """)
    assert constructions(planted, SOURCES | OUTPUTS) == [(4, "HealthEngine"), (5, "MetricsServer")]


# ------------------------------------------------------------------ adding a source

EXAMPLE_MODULE = '''\
"""Example source: the host's uptime, read from a file (written by tests/test_wiring.py)."""

from __future__ import annotations

from pathlib import Path

from ..collect import Collector, Gathered, Slot, SourceStats

UPTIME: Slot[float] = Slot("uptime")


class UptimeCollector(Collector[float]):
    keep_for = 3600.0  # a failed read keeps the last uptime for an hour

    def __init__(self, path: str = "/proc/uptime") -> None:
        super().__init__(UPTIME)
        self.path = path
        self.reads = 0
        self.errors = 0

    def collect(self, found: Gathered) -> float:
        self.reads += 1
        try:
            return float(Path(self.path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            self.errors += 1
            raise

    def stats(self) -> SourceStats:
        return SourceStats(requests={"read": self.reads}, errors=self.errors)
'''

ANCHOR = "    collectors: list[Collector[object]] = []\n"
IMPORT_ANCHOR = "from .devices.select import make_backend\n"
NEW_LINE = "    collectors.append(UptimeCollector())\n"
NEW_IMPORT = "from .devices.uptime import UptimeCollector\n"

RUN = textwrap.dedent("""
    import json, sys, urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    from drasim.backend import SimBackend, SimClock
    from drasim.scenario import parse_scenario
    from exporter.config import Config
    from exporter.devices.uptime import UPTIME
    from exporter.wiring import compose

    sc = parse_scenario({"node": "n", "gpus": [{"name": "a"}]})
    cfg = Config(listen_host="127.0.0.1", listen_port=0, node_name="n", interval=3600.0)
    agent = compose(cfg, SimBackend(sc, SimClock(1e-6)))

    def uptime_series():
        body = urllib.request.urlopen(agent.server.url + "/metrics", timeout=30).read().decode()
        return {f"{s.name}{sorted(s.labels.items())}": s.value for f in text_string_to_metric_families(body) for s in f.samples
                if s.labels.get("collector") == "uptime" or s.labels.get("source") == "uptime"}

    agent.start()
    try:
        out = {"names": [c.name for c in agent.src.all], "ready": agent.readiness(), "value": agent.found.get(UPTIME), "metrics": uptime_series()}
        agent.src.get("uptime").path = "/nonexistent/uptime"
        agent.run_cycle()
        out.update(failed_ready=agent.readiness(), kept=agent.found.get(UPTIME), failed_metrics=uptime_series())
    finally:
        agent.stop()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_a_new_source_is_one_module_and_one_line_in_wiring(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for pkg in ("exporter", "drasim"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "exporter" / "devices" / "uptime.py").write_text(EXAMPLE_MODULE)
    wiring = root / "exporter" / "wiring.py"
    text = wiring.read_text()
    assert text.count(ANCHOR) == 1 and text.count(IMPORT_ANCHOR) == 1, "wiring.py's collector list moved: update the example"
    wiring.write_text(text.replace(IMPORT_ANCHOR, IMPORT_ANCHOR + NEW_IMPORT).replace(ANCHOR, ANCHOR + NEW_LINE))

    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["names"] == ["devices", "uptime"]  # collected after the devices, in the listed order
    assert out["ready"] == [True, "ready"]
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert 0 < out["value"] <= uptime
    m = out["metrics"]
    assert m["dra_gpu_exporter_collector_success[('collector', 'uptime'), ('node', 'n')]"] == 1
    assert "dra_gpu_exporter_collector_duration_seconds[('collector', 'uptime'), ('node', 'n')]" in m
    assert m["dra_gpu_exporter_source_requests_total[('node', 'n'), ('source', 'uptime'), ('verb', 'read')]"] == 1
    assert m["dra_gpu_exporter_source_errors_total[('node', 'n'), ('source', 'uptime')]"] == 0
    # the source fails: reported, in /readyz (device metrics still ready), last good value kept
    ready, body = out["failed_ready"]
    assert ready and body.startswith("ready (degraded)\nuptime: ") and "/nonexistent/uptime" in body
    assert out["kept"] == out["value"]
    failed = out["failed_metrics"]
    assert failed["dra_gpu_exporter_collector_success[('collector', 'uptime'), ('node', 'n')]"] == 0
    assert failed["dra_gpu_exporter_source_errors_total[('node', 'n'), ('source', 'uptime')]"] == 1

    # the import contract holds with the new module in place
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
    lint = subprocess.run([sys.executable, "-c", check], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert lint.returncode == 0 and "0 broken" in lint.stdout, lint.stdout[-4000:]
