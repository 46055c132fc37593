"""Static checks run by the suite (issue 11): ruff on the product, the simulator, the tests and
the benchmarks (`ruff check exporter drasim tests bench`, configured in pyproject.toml).

`mypy --strict` is configured in pyproject.toml but not yet clean; it joins this file once it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return [exe]


def test_ruff_finds_nothing_in_the_product_the_simulator_the_tests_and_the_benchmarks() -> None:
    out = subprocess.run([*_ruff(), "check", "--output-format", "concise", "exporter", "drasim", "tests", "bench"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
