"""`bench/run.py scrape-attack --quick` runs end to end (numbers are not judged here: they live in
docs/performance.md, measured on a named machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_scrape_attack_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "scrape-attack", "--quick", "--out", str(out)], capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["scrape_attack"]["rows"]
    assert [r["load"].split()[0] for r in rows] == ["quiet", "200", "flood:"]
    assert all(r["requests"] > 0 and r["metrics_p99_ms"] > 0 and r["static_p99_ms"] > 0 for r in rows)
    assert rows[1]["attack_connections_opened"] >= 222
    assert "scrape under attack:" in done.stdout
