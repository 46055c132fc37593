"""Generate the plain manifests from the Helm chart, so that the two can never drift.

    .venv/bin/python tools/render_manifest.py           # write
    .venv/bin/python tools/render_manifest.py --check   # exit 1 and say what differs

What it does, with the real Helm engine (helm-python-sdk, Helm v4 as a library):

1. copies the repository's alerts/*.rules.yml and dashboards/*.json into the chart's files/
   (Helm's .Files cannot read outside the chart directory);
2. renders the chart with its default values plus namespace.create=true as release
   "dra-gpu-exporter" in namespace "dra-gpu-exporter" and writes daemonset.yaml: the core, which
   applies on a bare cluster;
3. renders the Prometheus Operator objects (ServiceMonitor, PrometheusRule) into
   deploy/prometheus-operator.yaml, for clusters with those CRDs.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "dra-gpu-exporter"
RELEASE = "dra-gpu-exporter"
NAMESPACE = "dra-gpu-exporter"
MANIFEST = REPO / "daemonset.yaml"
OPERATOR_MANIFEST = REPO / "deploy" / "prometheus-operator.yaml"
# Values of the plain manifest: the chart's defaults, and the Namespace, which kubectl cannot
# create the way `helm install --create-namespace` does.
MANIFEST_VALUES: dict[str, Any] = {"namespace": {"create": True}}
OPERATOR_VALUES: dict[str, Any] = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
OPERATOR_TEMPLATES = ("templates/10-servicemonitor.yaml", "templates/12-prometheusrule.yaml")
# The chart's copies of files kept elsewhere in the repository: (source glob, chart folder).
COPIES = (("alerts", "*.rules.yml", "files/alerts"), ("dashboards", "*.json", "files/dashboards"))

MANIFEST_HEADER = """\
# dra-gpu-exporter: everything a cluster operator applies to run the node agent.
# GENERATED from deploy/helm/dra-gpu-exporter by tools/render_manifest.py: edit the chart, then
# run `.venv/bin/python tools/render_manifest.py` (tests/test_chart.py fails while they differ).
#
#   kubectl apply --server-side -f daemonset.yaml
#   kubectl apply --server-side -f deploy/prometheus-operator.yaml   # only with the Prometheus Operator
#
# Requires Kubernetes >= 1.34 (resource.k8s.io/v1 served). DeviceTaintRules need 1.35+ with the
# DRADeviceTaintRules gate, 1.36 with the v1beta2 API enabled, or 1.37 (v1); without them the agent
# exports metrics and Events only. See docs/deploy.md for device access, TLS, and troubleshooting.
"""

OPERATOR_HEADER = """\
# dra-gpu-exporter: the Prometheus Operator objects (ServiceMonitor, PrometheusRule), kept out of
# daemonset.yaml so that the core applies on a cluster without these CRDs.
# GENERATED from deploy/helm/dra-gpu-exporter by tools/render_manifest.py; do not edit.
#
#   kubectl apply --server-side -f deploy/prometheus-operator.yaml
"""


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE,
           namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path (relative to the chart, e.g. templates/07-daemonset.yaml) -> rendered text.
    Values are checked against values.schema.json first, as `helm install` does."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        merged = chart.merge_values(values or {})
        chart.validate_schema(merged)
        out = chart.render(values=values or {}, name=release, namespace=namespace, is_install=True)
    prefix = f"{chart_name()}/"
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in out.items()}


def chart_name() -> str:
    return CHART.name


def join(rendered: dict[str, str], templates: list[str], header: str) -> str:
    """The templates' text in order, as one multi-document YAML file."""
    parts = [header]
    for name in templates:
        text = rendered[name].strip("\n")
        if text:
            parts.append(text + "\n")
    return "".join(parts)


def expected_copies() -> dict[Path, bytes]:
    out: dict[Path, bytes] = {}
    for src_dir, pattern, dest in COPIES:
        for src in sorted((REPO / src_dir).glob(pattern)):
            out[CHART / dest / src.name] = src.read_bytes()
    return out


def expected_manifests() -> dict[Path, str]:
    core = render(MANIFEST_VALUES)
    core_templates = sorted(k for k in core if k.startswith("templates/") and k not in OPERATOR_TEMPLATES)
    operator = render({**MANIFEST_VALUES, **OPERATOR_VALUES})
    return {
        MANIFEST: join(core, core_templates, MANIFEST_HEADER),
        OPERATOR_MANIFEST: join(operator, list(OPERATOR_TEMPLATES), OPERATOR_HEADER),
    }


def stale_copies() -> list[Path]:
    """Files in the chart's copy folders that no longer have a source."""
    expected = expected_copies()
    return [p for _, _, dest in COPIES for p in sorted((CHART / dest).glob("*")) if p not in expected]


def differences() -> list[str]:
    """What `--check` reports: one line per file that is not what this script would write."""
    out = []
    for path, data in expected_copies().items():
        if not path.exists() or path.read_bytes() != data:
            out.append(f"{_rel(path)}: differs from its source")
    out += [f"{_rel(p)}: has no source any more" for p in stale_copies()]
    # Manifests are rendered from the chart as it is on disk now, copies included.
    for path, text in expected_manifests().items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), _rel(path),
                                        "rendered", lineterm="", n=1)
            out.append("\n".join(list(diff)[:40]))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def write() -> None:
    for _, _, dest in COPIES:
        (CHART / dest).mkdir(parents=True, exist_ok=True)
    for path in stale_copies():
        path.unlink()
    for path, data in expected_copies().items():
        if not path.exists() or path.read_bytes() != data:
            shutil.copyfile(_source_of(path), path)
    for path, text in expected_manifests().items():
        path.write_text(text)


def _source_of(copy: Path) -> Path:
    for src_dir, _, dest in COPIES:
        if copy.parent == CHART / dest:
            return REPO / src_dir / copy.name
    raise KeyError(copy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="report differences instead of writing")
    args = p.parse_args(argv)
    if args.check:
        diffs = differences()
        for d in diffs:
            print(d)
        return 1 if diffs else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
