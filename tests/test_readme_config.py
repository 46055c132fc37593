"""The flag table (exporter/config.py, FLAGS) is the one place a flag is written: its argparse
argument, its DRA_GPU_EXPORTER_ variable, its Config default, the demo's default and the
configuration reference (docs/configuration.md) all come from its row. These tests hold each of those to the row."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from exporter.config import AGENT, DEMO, ENV_PREFIX, FLAGS, Config, TaintMode, build_parser, readme_table, resolve

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "configuration.md"
REGENERATE = "run `.venv/bin/python tools/config_reference.py` to rewrite docs/configuration.md's table from the flags"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(ENV_PREFIX) or k == "NODE_NAME":
            monkeypatch.delenv(k)


# ------------------------------------------------------------------ the configuration reference


def test_readme_configuration_table_is_the_flag_table() -> None:
    readme = DOC.read_text()
    tool = _tool()
    start, end = tool.table_span(readme)
    assert readme[start:end] == readme_table(), f"docs/configuration.md's table differs from the flag table: {REGENERATE}"


def test_the_tool_rewrites_a_stale_table_and_nothing_else() -> None:
    tool = _tool()
    readme = DOC.read_text()
    start, end = tool.table_span(readme)
    rows = readme[start:end].splitlines(True)
    # a row lost, a default edited by hand, a row added by hand
    stale = readme[:start] + "".join(rows[:3] + rows[4:]).replace("`0.0.0.0:9402`", "`0.0.0.0:9400`") + "| `--old` | x | y |\n" + readme[end:]
    assert tool.with_table(stale) == tool.with_table(readme)
    assert tool.with_table(readme)[:start] == readme[:start]  # the prose is the document's own
    assert tool.with_table(readme)[start + len(readme_table()) :] == readme[end:]


def test_every_flag_has_a_readme_row() -> None:
    table = readme_table()
    for flag in FLAGS:
        assert f"| `{flag.option}" in table, flag.name


# ------------------------------------------------------------------ argparse, environment, Config

# One value each flag accepts, other than its default (switches: on).
VALUES = {
    "listen": "127.0.0.1:9999", "interval": "2.5", "backend": "nvml", "taint-mode": "shadow", "log-format": "json",
    "log-level": "debug", "call-timeout": "1.5", "per-process": "true", "pod-label-allowlist": "app,team",
    "kubelet-device-health": "true",
    "exclude-metrics": "dra_claim_pods", "dcgm-compat-labels": "true", "taint-rate-limit": "3",
    "taint-hold-seconds": "60", "taint-settle-seconds": "5", "node-fault-window": "7",
    "hung-after": "10", "fault-clear-seconds": "600", "eviction-grace-seconds": "90", "stuck-reading-seconds": "900", "web-config-file": __file__, "node-name": "gpu-node-9",
    "kubelet-socket": "/run/kubelet.sock", "kubeconfig": None, "scenario": "small-node", "time-scale": "30",
}
NOT_FLAGS = {"taint_rate_window", "taint_budget_max", "node_failure_fraction"}  # tunables for tests and benchmarks


def _command(flag) -> list[str]:
    return [] if AGENT in flag.commands else [DEMO]


def _argv(flag, value: str) -> list[str]:
    cmd = _command(flag)
    return [*cmd, flag.option] if flag.switch else [*cmd, f"{flag.option}={value}"]


def test_every_flag_has_an_example_value() -> None:
    assert set(VALUES) == {f.name for f in FLAGS}


def test_config_defaults_are_the_tables() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    set_by_flags: set[str] = set()
    for flag in FLAGS:
        for name, value in flag.assign(flag.default):
            assert fields[name] == value, f"Config.{name} defaults to {fields[name]!r}, the --{flag.name} row to {value!r}"
            set_by_flags.add(name)
    assert set(fields) - set_by_flags == NOT_FLAGS, "a Config field without a flag row (or a row without a field)"


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_each_flag_from_the_command_line_and_from_its_variable(flag, monkeypatch, tmp_path) -> None:
    value = VALUES[flag.name]
    if value is None:  # a kubeconfig: a file that must look like one
        value = str(tmp_path / "kubeconfig")
        Path(value).write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    cmd = _command(flag)
    default = resolve(build_parser().parse_args(cmd))
    from_argv = resolve(build_parser().parse_args(_argv(flag, value)))
    assert from_argv != default, f"{flag.option} {value} changed nothing"
    monkeypatch.setenv(flag.env, value)
    assert flag.env == ENV_PREFIX + flag.name.upper().replace("-", "_")
    assert resolve(build_parser().parse_args(cmd)) == from_argv, f"{flag.env} and {flag.option} differ"


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The agent's parser and the demo subcommand's."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices[DEMO]


def test_parsers_take_exactly_the_tables_flags() -> None:
    parser, demo = _parsers()
    for p, command, extra in ((parser, AGENT, {"--version"}), (demo, DEMO, {"--list-scenarios"})):
        options = {o for a in p._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
        assert options == {f.option for f in FLAGS if command in f.commands} | extra, command


def test_demo_defaults_are_the_tables_demo_column() -> None:
    agent, demo = resolve(build_parser().parse_args([])), resolve(build_parser().parse_args([DEMO]))
    columns = [f for f in FLAGS if f.demo is not None]
    assert {f.name for f in columns} == {"listen", "interval", "backend"}
    for flag in columns:
        assert flag.demo != flag.default, flag.name
        for name, value in flag.assign(flag.demo):
            assert getattr(demo, name) == value, name
        for name, value in flag.assign(flag.default):
            assert getattr(agent, name) == value, name
    assert demo.taint_mode is TaintMode.ENFORCE  # no demo column: the agent's default


def test_help_states_each_default() -> None:
    parser, demo = _parsers()
    for p, command in ((parser, AGENT), (demo, DEMO)):
        actions = {a.option_strings[0]: a for a in p._actions if a.option_strings}
        for flag in FLAGS:
            if command in flag.commands:
                assert (actions[flag.option].help or "").endswith(f"(default {flag.default_text(command)})"), (command, flag.name)
    # the demo's own defaults, not the agent's
    assert "(default 127.0.0.1:9402)" in " ".join(demo.format_help().split())
    assert "(default 0.0.0.0:9402)" in " ".join(parser.format_help().split())


def test_the_tool_checks_the_committed_readme() -> None:
    import subprocess

    tool = str(REPO / "tools" / "config_reference.py")
    r = subprocess.run([sys.executable, tool, "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + "\n" + REGENERATE
