"""dcgm-exporter compatibility (issue 15): the recording rules in alerts/dcgm-compat.rules.yml.

* promtool: the rules check clean with lint, their unit tests pass, and the same tests fail
  against rules that compute nothing (the tests observe the rules);
* the PrometheusRule wrapper holds the same groups;
* docs/migrating-from-dcgm-exporter.md marks as provided exactly the DCGM series the rules record;
* a real Prometheus scrapes the running demo with the rules loaded and every query of NVIDIA's
  dcgm-exporter dashboard (Grafana 12239, queries recorded with their source in
  tests/fixtures/dcgm-exporter-dashboard-12239.json) whose fields the doc marks as provided
  returns data. Waits are bounded polls for data; nothing is timed.

Run ``python tests/test_dcgm_compat.py --write-prometheusrule`` to regenerate the wrapper.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "dcgm-compat.rules.yml"
WRAPPER = REPO / "alerts" / "dcgm-compat.prometheusrule.yaml"
UNIT_TEST = REPO / "alerts" / "tests" / "dcgm-compat.test.yml"
DOC = REPO / "docs" / "migrating-from-dcgm-exporter.md"
DASHBOARD = REPO / "tests" / "fixtures" / "dcgm-exporter-dashboard-12239.json"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's `prometheus` package (CI does)")

WRAPPER_HEADER = """\
# PrometheusRule (Prometheus Operator) wrapping alerts/dcgm-compat.rules.yml unchanged: the
# dcgm-exporter compatibility recording rules (docs/migrating-from-dcgm-exporter.md).
# tests/test_dcgm_compat.py fails if the two drift apart; regenerate with
#   python tests/test_dcgm_compat.py --write-prometheusrule
# Many Prometheus Operator installs only load rules whose labels match the Prometheus object's
# ruleSelector (kube-prometheus-stack: release: <helm release name>); add that label here.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: dra-gpu-exporter-dcgm-compat
  namespace: dra-gpu-exporter
  labels:
    app.kubernetes.io/name: dra-gpu-exporter
    app.kubernetes.io/part-of: dra-gpu-exporter
spec:
"""


def render_wrapper(rules_text: str) -> str:
    lines = rules_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "\n".join(("  " + line) if line.strip() else "" for line in lines[start:])
    return WRAPPER_HEADER + body + "\n"


def recorded() -> list[str]:
    return [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r]


def dcgm_series() -> set[str]:
    return {n for n in recorded() if n.startswith("DCGM_")}


def doc_table() -> dict[str, str]:
    """DCGM field -> status, from the doc's field table (a row may name several fields)."""
    section = DOC.read_text().split("## Field by field", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        if not line.startswith("| `DCGM_"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`(DCGM_[A-Z0-9_]+)`", cells[0]):
            out[name] = cells[-1]
    return out


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


# ---------------------------------------------------------------- promtool


@needs_promtool
def test_rules_check_clean_with_lint() -> None:
    r = promtool("check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(recorded())} rules found" in r.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    r = promtool("test", "rules", str(UNIT_TEST))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_unit_tests_fail_against_rules_that_compute_nothing(tmp_path: Path) -> None:
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule["expr"] = f"({rule['expr']}) and on() vector(0) > 1"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(groups))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / UNIT_TEST.name).write_text(UNIT_TEST.read_text())
    r = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests" / UNIT_TEST.name)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "SUCCESS" not in r.stdout and "FAILED" in r.stdout + r.stderr, r.stdout + r.stderr


@needs_promtool
def test_wrapper_groups_check_clean(tmp_path: Path) -> None:
    extracted = tmp_path / "from-prometheusrule.yml"
    extracted.write_text(yaml.safe_dump(yaml.safe_load(WRAPPER.read_text())["spec"]))
    r = promtool("check", "rules", "--lint=all", "--lint-fatal", str(extracted))
    assert r.returncode == 0, r.stdout + r.stderr


def test_wrapper_holds_the_rules_file_unchanged() -> None:
    wrapper = yaml.safe_load(WRAPPER.read_text())
    assert (wrapper["apiVersion"], wrapper["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert wrapper["spec"] == yaml.safe_load(RULES.read_text()), "run python tests/test_dcgm_compat.py --write-prometheusrule"
    assert WRAPPER.read_text() == render_wrapper(RULES.read_text())


def test_every_recorded_dcgm_series_is_unit_tested() -> None:
    tested = UNIT_TEST.read_text()
    missing = [n for n in dcgm_series() if not re.search(rf"\b{n}\b", tested)]
    assert not missing, f"no promtool unit test mentions {missing}"


# ---------------------------------------------------------------- the doc's table


def test_doc_marks_provided_exactly_what_the_rules_record() -> None:
    table = doc_table()
    provided = {n for n, status in table.items() if status.startswith("provided")}
    assert provided == dcgm_series()
    # everything dcgm-exporter enables by default is in the table, provided or not
    defaults = {
        "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES",
    }  # etc/default-counters.csv at NVIDIA/dcgm-exporter d5e5f51
    assert defaults <= set(table), defaults - set(table)
    for name, status in table.items():
        assert status.startswith(("provided", "not available")), (name, status)


def test_doc_names_files_that_exist() -> None:
    for ref in re.findall(r"`((?:alerts|tests|docs|dashboards)/[^`*<> ]+)`", DOC.read_text()):
        assert (REPO / ref).exists(), ref


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def covered_panels() -> list[dict]:
    provided = {n for n, s in doc_table().items() if s.startswith("provided")}
    return [p for p in dashboard()["panels"] if set(re.findall(r"\bDCGM_[A-Z0-9_]+", p["expr"])) <= provided]


def test_the_doc_covers_every_panel_of_the_dashboard() -> None:
    # All eight panels of 12239 use provided fields; if a field's status changed, the test
    # below would silently check fewer panels.
    assert len(covered_panels()) == len(dashboard()["panels"]) == 8


# ---------------------------------------------------------------- a real Prometheus on the demo


@pytest.mark.slow
@pytest.mark.prometheus
def test_the_dcgm_dashboard_gets_data_from_the_demo(tmp_path: Path) -> None:
    from kit_helpers import fetch, free_port, stop_process, wait_until
    from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, start_prometheus

    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS_REASON)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        wait_until(lambda: fetch(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200, 60, interval=0.2, message="demo /readyz", ignore=(OSError,))
        with start_prometheus([f"127.0.0.1:{port}"], tmp_path, scrape_interval="1s", rule_files=[RULES]) as prom:
            prom.wait_for_targets_up(timeout=60)
            # The dashboard's variables, as Grafana fills them ("All" selects every value).
            values = {}
            for var in dashboard()["variables"]:
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]).groups()
                found = wait_until(lambda: prom.label_values(label, match=[metric]), 60, interval=0.2, message=var["query"], ignore=(Exception,))  # noqa: B023 - polled in this iteration
                # regex-escaped, and the backslashes doubled inside a PromQL string, as Grafana does
                values[var["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in found) + ")"
            assert sorted(prom.label_values("gpu", match=["DCGM_FI_DEV_GPU_TEMP"])) == ["0", "1", "2", "3", "4"]
            for panel in covered_panels():
                expr = panel["expr"].replace("$instance", values["instance"]).replace("$gpu", values["gpu"])
                rows = prom.wait_for_query(expr, timeout=60)
                assert rows, panel["title"]
            # the demo's shared claim: one series per pod, with dcgm-exporter's pod and DRA labels
            shared = prom.wait_for_query('DCGM_FI_DEV_FB_USED{dra_claim_name="shared-gpu"}', timeout=30)
            assert {r["metric"]["pod"] for r in shared} and all(r["metric"]["namespace"] == "ml" for r in shared)
            # MIG instances: UUID and gpu are their parent GPU's (gpu_info's index), GPU_I_ID is set
            mig = prom.wait_for_query('DCGM_FI_DEV_FB_USED{GPU_I_PROFILE!=""}', timeout=30)
            gpus = {r["metric"]["UUID"]: r["metric"]["gpu"] for r in prom.query('DCGM_FI_DEV_FB_USED{GPU_I_PROFILE=""}')}
            assert len({r["metric"]["uuid"] for r in mig}) == 2 and all(r["metric"]["GPU_I_ID"] for r in mig)
            assert all(r["metric"]["uuid"] != r["metric"]["UUID"] and gpus[r["metric"]["UUID"]] == r["metric"]["gpu"] for r in mig), mig
            # every provided field has data in the demo, except what the simulated GPUs lack (an
            # occupancy counter) and the XID count, which exists once the scripted XID has come
            names = prom.metric_names()
            assert dcgm_series() - names <= {"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_FI_PROF_SM_OCCUPANCY"}, dcgm_series() - names
        assert proc.poll() is None, "the demo kept running"
    finally:
        stop_process(proc, timeout=15)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-prometheusrule"]:
        WRAPPER.write_text(render_wrapper(RULES.read_text()))
        print(f"wrote {WRAPPER.relative_to(REPO)}")
    else:
        sys.exit("usage: python tests/test_dcgm_compat.py --write-prometheusrule")
