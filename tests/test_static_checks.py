"""Static checks run by the suite (issue 11), both configured in pyproject.toml: ruff on the
product, the simulator, the tests and the benchmarks (`ruff check exporter drasim tests bench`),
and `mypy --strict` on the product and the simulator (`mypy`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> list[str]:
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return [exe]


def test_ruff_finds_nothing_in_the_product_the_simulator_the_tests_and_the_benchmarks() -> None:
    out = subprocess.run([*_tool("ruff"), "check", "--output-format", "concise", "exporter", "drasim", "tests", "bench"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_finds_nothing_in_the_product_and_the_simulator() -> None:
    # --no-incremental: no cache directory is written into the checkout (CI runs a clean clone)
    out = subprocess.run([*_tool("mypy"), "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_log_event_is_one_snake_case_name() -> None:
    """One log-event naming style (issue 11): ``log.info("kubelet_socket_missing", ...)``, never
    dotted or spaced names, so logs can be filtered and alerted on by event."""
    import re

    call = re.compile(r"""\b(?:log|_log|logger)\.(?:debug|info|warning|error|exception|critical)\(\s*["']([^"']*)["']""")
    bad = []
    for path in sorted([*ROOT.glob("exporter/**/*.py"), *ROOT.glob("drasim/**/*.py")]):
        for event in call.findall(path.read_text()):
            if not re.fullmatch(r"[a-z][a-z0-9_]*", event):
                bad.append(f"{path.relative_to(ROOT)}: {event!r}")
    assert not bad, bad
