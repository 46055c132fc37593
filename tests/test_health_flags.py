"""The health evidence flags: --hung-after and --fault-clear-seconds, from the command line and
the environment, validated, and reaching the agent's health policy."""

from __future__ import annotations

import pytest

from drasim.backend import SimBackend, SimClock
from drasim.scenario import parse_scenario
from exporter.config import ENV_PREFIX, ConfigError, build_parser, resolve
from exporter.wiring import compose


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith(ENV_PREFIX) or k == "NODE_NAME":
            monkeypatch.delenv(k, raising=False)


def cfg(*argv: str):
    return resolve(build_parser().parse_args(["--kubelet-socket", "/nonexistent/kubelet.sock", *argv]))


def test_defaults_and_flags(monkeypatch):
    c = cfg()
    assert (c.hung_after, c.fault_clear_seconds) == (30.0, 120.0)
    c = cfg("--hung-after", "5", "--fault-clear-seconds", "600")
    assert (c.hung_after, c.fault_clear_seconds) == (5.0, 600.0)
    monkeypatch.setenv(ENV_PREFIX + "HUNG_AFTER", "0")
    monkeypatch.setenv(ENV_PREFIX + "FAULT_CLEAR_SECONDS", "30")
    c = cfg()
    assert (c.hung_after, c.fault_clear_seconds) == (0.0, 30.0)


@pytest.mark.parametrize("argv", [["--hung-after", "-1"], ["--hung-after", "soon"], ["--fault-clear-seconds", "1e9"]])
def test_bad_values_are_one_clear_error(argv):
    with pytest.raises(ConfigError, match=argv[0]):
        cfg(*argv)


def test_fault_clear_seconds_is_the_health_engines_clear_hold():
    sc = parse_scenario({"node": "n", "gpus": [{"name": "g"}]})
    agent = compose(cfg("--fault-clear-seconds", "42"), SimBackend(sc, SimClock(1.0)))
    assert agent.health.policy.clear_hold == 42.0
