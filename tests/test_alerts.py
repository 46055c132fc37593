"""Alert rules: promtool check (with lint), promtool unit tests, and coverage of every alert.

Needs Debian's `prometheus` package (promtool); CI installs it. Run
`python tests/test_alerts.py --write-prometheusrule` to regenerate alerts/prometheusrule.yaml
from alerts/dra-gpu-exporter.rules.yml.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "dra-gpu-exporter.rules.yml"
WRAPPER = REPO / "alerts" / "prometheusrule.yaml"
UNIT_TESTS = sorted((REPO / "alerts" / "tests").glob("*.yml"))
DEPLOY_DOC = REPO / "docs" / "deploy.md"
PROMTOOL = shutil.which("promtool")

_skip_without_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: install Debian's `prometheus` package (CI does)"
)


def needs_promtool(test: Any) -> Any:
    return pytest.mark.prometheus(_skip_without_promtool(test))

WRAPPER_HEADER = """\
# PrometheusRule (Prometheus Operator) wrapping alerts/dra-gpu-exporter.rules.yml unchanged.
# tests/test_alerts.py fails if the two drift apart; regenerate with
#   python tests/test_alerts.py --write-prometheusrule
# Many Prometheus Operator installs only load rules whose labels match the Prometheus object's
# ruleSelector (kube-prometheus-stack: release: <helm release name>); add that label here.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: dra-gpu-exporter
  namespace: dra-gpu-exporter
  labels:
    app.kubernetes.io/name: dra-gpu-exporter
    app.kubernetes.io/part-of: dra-gpu-exporter
spec:
"""


def render_wrapper(rules_text: str) -> str:
    """The PrometheusRule text: the rules file's `groups:` block, comments kept, under `spec:`."""
    lines = rules_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "\n".join(("  " + line) if line.strip() else "" for line in lines[start:])
    return WRAPPER_HEADER + body + "\n"


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def all_rules() -> list[dict[str, Any]]:
    """Alerting and recording rules (the billing roll-ups are recording rules)."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_rules_file_checks_clean_with_lint() -> None:
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(all_rules())} rules found" in output
    assert "WARNING" not in output.upper() and "duplicate" not in output.lower(), output


@needs_promtool
def test_prometheusrule_groups_check_clean(tmp_path: Path) -> None:
    extracted = tmp_path / "from-prometheusrule.yml"
    extracted.write_text(yaml.safe_dump(yaml.safe_load(WRAPPER.read_text())["spec"]))
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", str(extracted))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheusrule_wraps_the_rules_file_unchanged() -> None:
    wrapper = yaml.safe_load(WRAPPER.read_text())
    assert wrapper["apiVersion"] == "monitoring.coreos.com/v1"
    assert wrapper["kind"] == "PrometheusRule"
    assert wrapper["metadata"]["namespace"] == "dra-gpu-exporter"
    assert set(wrapper["spec"]) == {"groups"}
    assert wrapper["spec"] == yaml.safe_load(RULES.read_text()), (
        "alerts/prometheusrule.yaml is out of date: run python tests/test_alerts.py --write-prometheusrule"
    )
    assert WRAPPER.read_text() == render_wrapper(RULES.read_text())


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no alerts/tests/*.yml"
    result = promtool("test", "rules", *[str(p) for p in UNIT_TESTS])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS), result.stdout


@needs_promtool
def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    # The same tests against rules whose every threshold is unreachable must fail: proves the unit
    # tests actually observe the alerts rather than passing vacuously.
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule["expr"] = f"({rule['expr']}) and on() vector(0) > 1"
    broken = tmp_path / "dra-gpu-exporter.rules.yml"
    broken.write_text(yaml.safe_dump(groups))
    (tmp_path / "tests").mkdir()
    for path in UNIT_TESTS:
        (tmp_path / "tests" / path.name).write_text(path.read_text())
    result = promtool("test", "rules", *[str(tmp_path / "tests" / p.name) for p in UNIT_TESTS])
    assert result.returncode != 0
    assert "SUCCESS" not in result.stdout


def _unit_test_expectations() -> dict[str, dict[str, bool]]:
    """alertname -> {"fires": seen an eval expecting alerts, "quiet": seen an eval expecting none}."""
    seen: dict[str, dict[str, bool]] = {}
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                entry = seen.setdefault(check["alertname"], {"fires": False, "quiet": False})
                if check.get("exp_alerts"):
                    entry["fires"] = True
                else:
                    entry["quiet"] = True
    return seen


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_is_unit_tested_firing_and_quiet(rule: dict[str, Any]) -> None:
    seen = _unit_test_expectations().get(rule["alert"])
    assert seen is not None, f"{rule['alert']} has no promtool unit test"
    assert seen["fires"], f"{rule['alert']} is never tested firing"
    assert seen["quiet"], f"{rule['alert']} is never tested not firing"


def _doc_anchors() -> set[str]:
    anchors = set()
    for line in DEPLOY_DOC.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_has_severity_text_and_a_runbook(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    url = rule["annotations"]["runbook_url"]
    assert url.startswith("https://github.com/dra-gpu-exporter/dra-gpu-exporter/blob/main/docs/deploy.md#")
    anchor = url.rsplit("#", 1)[1]
    assert anchor in _doc_anchors(), f"docs/deploy.md has no heading for #{anchor}"


def test_deploy_doc_links_resolve() -> None:
    # Runbook links and the doc's own cross-references use GitHub's heading anchors.
    text = DEPLOY_DOC.read_text()
    anchors = _doc_anchors()
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links
    assert not [a for a in links if a not in anchors], "broken #anchors in docs/deploy.md"
    for ref in re.findall(r"`((?:deploy|alerts|dashboards|tests)/[^`*<> ]+)`", text):
        assert (REPO / ref).exists(), f"docs/deploy.md names {ref}, which does not exist"


def test_required_alerts_exist() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {
        "GPUUnhealthy",
        "GPUTainted",
        "GPUTaintBudgetExhausted",
        "DRAClaimIdle",
        "GPUMemoryNearlyFull",
        "GPUTemperatureHigh",
        "GPUXidErrorBurst",
        "DRAGPUExporterDown",
        "DRAGPUExporterStale",
        "DRAGPUExporterCollectorFailing",
    } <= names


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-prometheusrule"]:
        WRAPPER.write_text(render_wrapper(RULES.read_text()))
        print(f"wrote {WRAPPER.relative_to(REPO)}")
    else:
        sys.exit("usage: python tests/test_alerts.py --write-prometheusrule")


def test_the_cardinality_docs_name_every_metric_the_alerts_need() -> None:
    """docs/deploy.md tells users which metrics --exclude-metrics must keep for the alerts; an
    alert on a metric missing from that list would go silent for whoever trims by it."""
    section = DEPLOY_DOC.read_text().split("### Cardinality", 1)[1].split("\n#", 1)[0]
    keep = section.split("Keep what the shipped alerts use:", 1)[1]
    listed = set(re.findall(r"`((?:gpu|dra)_[a-z_]+)`", keep))
    used = {m for rule in alert_rules() for m in re.findall(r"\b((?:gpu|dra)_[a-z_]+)\b", rule["expr"])}
    self_metrics = {m for m in used if m.startswith("dra_gpu_exporter_")}
    assert "dra_gpu_exporter_*" in keep and self_metrics  # covered by the pattern
    assert listed == used - self_metrics
