"""The benchmark command keeps working: `bench/run.py --quick` runs every benchmark at tiny sizes.

No numbers are judged here (performance lives in bench/ and docs/performance.md); this only proves the
documented command runs end to end and reports every measurement docs/performance.md's table quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_benchmark_run_reports_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    # 1 and 10 scrapers, every cycle rendered by the first scrape that wants it
    assert [row["concurrency"] for row in r["scrape"]["rows"]] == [1, 10]
    assert all(row["metrics_p99_ms"] > 0 and row["static_p99_ms"] > 0 for row in r["scrape"]["rows"])
    # what the first scrape after a cycle pays for rendering it
    assert r["first_scrape"]["rounds"] == 5 and r["first_scrape"]["first_p99_ms"] > 0 and r["first_scrape"]["render_cpu_p50_ms"] > 0
    assert r["cycle"]["devices"] == 64 and r["cycle"]["cycle_p99_ms"] > 0
    # the cycle is measured in the agent's own process: 8 GPUs, then the dense node
    assert [row["devices"] for row in r["cycle"]["rows"]] == [8, 64]
    assert all(row["cycle_cpu_p99_ms"] > 0 and row["series"] > 0 for row in r["cycle"]["rows"])
    # the 8-GPU node at 1 s and at the default 5 s interval (PRODUCT's targets)
    assert r["cycle"]["eight_gpus_cpu_percent_1s"] > 0 and r["cycle"]["eight_gpus_cpu_percent_5s"] > 0
    # every CPU window ran with its scraper (rendering happens on demand): a Prometheus-like one,
    # and one scrape per cycle; each cycle's render is counted in the cycle's CPU
    for row in r["cycle"]["rows"]:
        assert row["render_cpu_p50_ms"] > 0 and row["cycle_cpu_p50_ms"] > row["render_cpu_p50_ms"]
        for key in ("1s", "1s_every_cycle", "5s", "5s_every_cycle"):
            assert row[f"cpu_percent_{key}_interval"] > 0 and row[f"scrapes_{key}"] >= 1 and 1 <= row[f"renders_{key}"] <= row[f"cpu_window_{key}_s"]
    assert [row["level"] for row in r["gzip"]["rows"]] == [1, 3, 5, 6, 9]
    # the raw baseline makes exactly the library calls one backend read makes
    assert r["nvml"]["calls_per_read"]["nvmlDeviceGetFieldValues"] == 1.0
    assert r["nvml"]["raw_us"] > 0 and r["nvml"]["backend_us"] > 0
    assert r["xid"]["samples"] == 4
    soak = r["soak"]
    assert soak["devices"] == 8 and soak["cycles"] == 100 and len(soak["rss_marks_mb"]) == 5
    assert 0 < soak["rss_start_mb"] <= soak["peak_rss_mb"]
    assert r["series"]["lean (--exclude-metrics)"] < r["series"]["default"] < r["series"]["with pod labels"] < r["series"]["dcgm-compat labels"]
    churn = r["churn"]  # every job of two intervals billed; the retained series under the cap
    assert churn["jobs_held_two_intervals"] > 0 and churn["jobs_never_billed"] == 0
    assert 0 < churn["retained_series_max"] <= churn["cap_series"] and churn["cpu_per_cycle_before_ms"] > 0
    assert r["machine"]["quick"] is True
    # the printed table names each part (docs/performance.md quotes this output)
    assert "scrape:" in done.stdout and "soak, agent alone" in done.stdout and "cycle, agent alone" in done.stdout


@pytest.mark.slow
def test_churn_with_the_agent_alone_reports_its_rss_descriptors_and_requests(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "churn-alone", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())["churn_alone"]
    assert r["new_claims"] > 0 and r["cycles"] > 0 and r["rss_max_mb"] >= r["start"]["rss_mb"] > 0
    # whole-GPU claims on a node whose slices are published: no claim is read
    assert r["requests_per_new_claim"] <= 0.1
    assert r["end"]["threads"] <= r["start"]["threads"] + 2  # flat: none per job (a pool may start one)


def test_unknown_benchmark_name_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "scrap"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown benchmark(s) scrap" in done.stderr
