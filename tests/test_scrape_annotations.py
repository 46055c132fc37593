"""docs/deploy.md "Annotation-based scraping", checked with a real Prometheus scraping the demo.

The common annotation job (the Prometheus example configuration's `kubernetes-pods`) copies the
scraped pod's namespace and name into `namespace` and `pod` and names the job `kubernetes-pods`.
Pointed at the agent, that puts the agent pod's identity on every series without a workload and
keeps the exporter-down alerts (job="dra-gpu-exporter") from ever firing. The docs give rules to
append to that job; this test takes them from the docs verbatim, appends them to the example
job's rules, and scrapes the demo twice: once with the example job alone (the control: the
problem is real) and once with the docs' rules (the fix works).

There is no Kubernetes service discovery here: a static target carries the same __meta_kubernetes_*
labels kubernetes_sd_configs would give the agent's pod, which relabeling sees the same way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from kit_helpers import fetch, free_port, stop_process, wait_until
from prom_helpers import NO_PROMETHEUS_REASON, PROMETHEUS, PrometheusServer

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS_REASON), pytest.mark.slow, pytest.mark.prometheus]

REPO = Path(__file__).resolve().parent.parent
AGENT_POD = "dra-gpu-exporter-x7k2p"
AGENT_NAMESPACE = "dra-gpu-exporter"

# The example annotation job's rules (Prometheus' documentation/examples/prometheus-kubernetes.yml).
EXAMPLE_RULES: list[dict[str, Any]] = [
    {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
    {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "action": "replace",
     "target_label": "__metrics_path__", "regex": "(.+)"},
    {"source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"], "action": "replace",
     "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2", "target_label": "__address__"},
    {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
    {"source_labels": ["__meta_kubernetes_namespace"], "action": "replace", "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "action": "replace", "target_label": "pod"},
]


def documented_fix() -> dict[str, Any]:
    """The YAML block of the docs' "Fix the labels inside the annotation job" item."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    section = doc[doc.index("### Annotation-based scraping"):]
    section = section[section.index("**Fix the labels inside the annotation job"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/deploy.md: no YAML block for the annotation job's fix"
    fix = yaml.safe_load(textwrap.dedent(block.group(1)))
    assert set(fix) == {"honor_labels", "relabel_configs"}
    return fix


def pod_target(port: int) -> dict[str, Any]:
    """The agent's pod as kubernetes_sd_configs (role: pod) presents it, after the DaemonSet's
    annotations and labels."""
    return {
        "targets": [f"127.0.0.1:{port}"],
        "labels": {
            "__meta_kubernetes_namespace": AGENT_NAMESPACE,
            "__meta_kubernetes_pod_name": AGENT_POD,
            "__meta_kubernetes_pod_node_name": "demo-node",
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": "dra-gpu-exporter",
            "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
            "__meta_kubernetes_pod_annotation_prometheus_io_port": str(port),
            "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        },
    }


@pytest.fixture
def demo():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}", "--time-scale", "20", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        wait_until(lambda: fetch(f"http://127.0.0.1:{port}/readyz", timeout=2)[0] == 200, 60, interval=0.2, message="demo /readyz", ignore=(OSError,))
        yield port
    finally:
        stop_process(proc, timeout=15)


@pytest.fixture
def prometheus(demo: int, tmp_path: Path):
    fix = documented_fix()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "control", "static_configs": [pod_target(demo)], "relabel_configs": EXAMPLE_RULES},
            {"job_name": "kubernetes-pods", "honor_labels": fix["honor_labels"], "static_configs": [pod_target(demo)],
             "relabel_configs": EXAMPLE_RULES + fix["relabel_configs"]},
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    server = PrometheusServer(url=f"http://127.0.0.1:{port}", config_path=config_path, data_dir=tmp_path / "tsdb",
                              log_path=log_path, process=process, _log_file=log_file)
    try:
        wait_until(lambda: fetch(f"{server.url}/-/ready", timeout=2)[0] == 200, 60, interval=0.2, message="prometheus /-/ready", ignore=(OSError,))
        yield server
    finally:
        server.stop()


def _labels(result: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [r["metric"] for r in result]


def test_documented_rules_keep_device_series_clean_and_the_job_label(prometheus: PrometheusServer) -> None:
    # The fixed job is the job the exporter-down alerts select.
    up = prometheus.wait_for_query('up{job="dra-gpu-exporter"} == 1', timeout=60)
    assert _labels(up)[0]["node"] == "demo-node"
    prometheus.wait_for_query('gpu_info{job="dra-gpu-exporter"}', timeout=60)
    prometheus.wait_for_query('dra_device_allocation_info{job="dra-gpu-exporter"}', timeout=60)
    prometheus.wait_for_query('gpu_info{job="control"}', timeout=60)

    # Control: the example job alone stamps the agent's pod on device series and misses the job.
    control = _labels(prometheus.query('gpu_info{job="control"}'))
    assert control and all(m.get("pod") == AGENT_POD and m.get("namespace") == AGENT_NAMESPACE for m in control)
    assert prometheus.query('up{job="kubernetes-pods"}') == []

    # Fixed: no series of the job carries the agent's pod or namespace ...
    assert prometheus.query(f'{{job="dra-gpu-exporter", pod="{AGENT_POD}"}}') == []
    assert prometheus.query(f'{{job="dra-gpu-exporter", namespace="{AGENT_NAMESPACE}"}}') == []
    assert all("pod" not in m and "namespace" not in m for m in _labels(prometheus.query('gpu_info{job="dra-gpu-exporter"}')))
    # ... while the workload labels the agent exports survive (honor_labels).
    held = _labels(prometheus.query('dra_device_allocation_info{job="dra-gpu-exporter", pod!=""}'))
    assert held and all(m["namespace"] != AGENT_NAMESPACE and m["pod"] != AGENT_POD for m in held)
