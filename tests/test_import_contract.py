"""The import contract (pyproject.toml, [tool.importlinter]; docs/architecture.md explains it).

import-linter (PyPI `import-linter`, in the test extras) builds the import graph of `exporter`
and `drasim` (every import, including ones inside functions) and checks: the product never
imports the simulator, no cycles between sibling packages/modules, the layer order
sources -> health -> model -> outputs -> agent/wiring/cli, and an API emulation that knows
nothing of the product. The second test shows the contract has teeth: the same check on a copy
of the code with one bad import added fails, naming the broken contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the contract on the packages under ``root``: PYTHONPATH puts them ahead of the
    installed (editable) ones, so the copy is what gets analysed."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", CHECK], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contract_holds() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
    # Every contract ran (a contract silently dropped from pyproject.toml would not be noticed otherwise).
    for name in ("never imports the simulator", "No import cycles", "sources -> health -> model", "API emulation"):
        assert name in result.stdout, name


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for pkg in ("exporter", "drasim"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # a cycle: the device layer reaching back up to the agent that drives it
        ("exporter/devices/base.py", "from exporter import agent", "No import cycles between sibling packages or modules"),
        # a lower layer importing a higher one without a cycle, hidden in a function
        ("exporter/health/xid.py", "def _f():\n    from exporter.metrics import render", "sources -> health -> model -> outputs"),
        # the product depending on the simulator
        ("exporter/metrics/server.py", "import drasim.backend", "never imports the simulator"),
        # the API emulation depending on the product
        ("drasim/apiserver_store.py", "from exporter.k8s import model", "API emulation knows nothing of the product"),
    ],
)
def test_a_reintroduced_bad_import_breaks_the_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy(tmp_path)
    assert lint(root).returncode == 0  # the copy itself is clean: the added line is what breaks it
    target = root / module
    target.write_text(target.read_text() + "\n\n" + line + "  # reintroduced by the test\n")
    result = lint(root)
    assert result.returncode != 0, result.stdout[-4000:]
    assert f"{broken}" in result.stdout.split("Broken contracts", 1)[-1], result.stdout[-4000:]
