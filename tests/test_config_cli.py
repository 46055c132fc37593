"""Flags, DRA_GPU_EXPORTER_* environment variables and validation of the command line.

A bad value must end the program with exactly one error line on stderr and exit code 2,
never a traceback; most cases run ``cli.main`` in-process, two run the real entry point.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import __version__
from exporter.cli import main
from exporter.config import (
    DEFAULT_KUBELET_SOCKET,
    ConfigError,
    TaintMode,
    build_parser,
    check_kubelet_socket,
    parse_interval,
    parse_listen,
    resolve,
)
from drasim.scenario import bundled_scenarios


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests must not see the developer's (or a pod's) configuration."""
    for k in list(os.environ):
        if k.startswith("DRA_GPU_EXPORTER_") or k in ("NODE_NAME",):
            monkeypatch.delenv(k)


def cfg(*argv: str):
    return resolve(build_parser().parse_args(list(argv)))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert lines[0].startswith("dra-gpu-exporter: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ defaults and flags


def test_defaults(monkeypatch):
    c = cfg()
    assert (c.listen_host, c.listen_port) == ("0.0.0.0", 9402)
    assert c.kubelet_socket == DEFAULT_KUBELET_SOCKET
    assert c.backend == "auto"
    assert c.interval == 5.0
    assert c.taint_mode is TaintMode.ENFORCE
    assert c.kubeconfig is None
    assert c.node_name == socket.gethostname().lower()


def test_every_flag_on_the_command_line(tmp_path):
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    c = cfg(
        "--listen", "127.0.0.1:9999", "--interval", "0.5", "--backend", "sim", "--taint-mode", "dry-run",
        "--log-format", "json", "--log-level", "debug", "--call-timeout", "1.5", "--per-process",
        "--pod-label-allowlist", "app, team ,app.kubernetes.io/name", "--dcgm-compat-labels",
        "--taint-rate-limit", "3", "--taint-budget-fraction", "0.1", "--taint-hold-seconds", "60",
        "--node-name", "gpu-node-1", "--kubelet-socket", str(tmp_path / "kubelet.sock"), "--kubeconfig", str(kubeconfig),
    )
    assert (c.listen_host, c.listen_port) == ("127.0.0.1", 9999)
    assert c.interval == 0.5
    assert c.backend == "sim"
    assert c.taint_mode is TaintMode.DRY_RUN
    assert (c.log_format, c.log_level) == ("json", "debug")
    assert c.call_timeout == 1.5
    assert c.per_process is True
    assert c.pod_label_allowlist == ("app", "team", "app.kubernetes.io/name")
    assert c.dcgm_compat_labels is True
    assert c.taint_rate_limit == 3
    assert c.taint_budget_fraction == 0.1
    assert c.taint_hold_seconds == 60
    assert c.node_name == "gpu-node-1"
    assert c.kubelet_socket == str(tmp_path / "kubelet.sock")
    assert c.kubeconfig == str(kubeconfig)


def test_every_flag_from_the_environment(monkeypatch, tmp_path):
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    env = {
        "LISTEN": "[::1]:9500", "INTERVAL": "2.5", "BACKEND": "nvml", "TAINT_MODE": "shadow", "LOG_FORMAT": "console",
        "LOG_LEVEL": "WARNING", "CALL_TIMEOUT": "0.25", "PER_PROCESS": "yes", "POD_LABEL_ALLOWLIST": "team",
        "DCGM_COMPAT_LABELS": "true", "TAINT_RATE_LIMIT": "5", "TAINT_BUDGET_FRACTION": "0.2", "EXCLUDE_METRICS": "dra_claim_pods, gpu_*_clock_hertz",
        "TAINT_HOLD_SECONDS": "900", "NODE_NAME": "node-b", "KUBELET_SOCKET": str(tmp_path / "k.sock"),
        "KUBECONFIG": str(kubeconfig),
    }
    for k, v in env.items():
        monkeypatch.setenv("DRA_GPU_EXPORTER_" + k, v)
    c = cfg()
    assert (c.listen_host, c.listen_port) == ("::1", 9500)
    assert c.interval == 2.5 and c.backend == "nvml" and c.taint_mode is TaintMode.SHADOW
    assert (c.log_format, c.log_level) == ("console", "warning")
    assert c.call_timeout == 0.25 and c.per_process is True and c.dcgm_compat_labels is True
    assert c.pod_label_allowlist == ("team",)
    assert c.exclude_metrics == {"dra_claim_pods", "gpu_sm_clock_hertz", "gpu_memory_clock_hertz"}
    assert (c.taint_rate_limit, c.taint_budget_fraction, c.taint_hold_seconds) == (5, 0.2, 900)
    assert c.node_name == "node-b"
    assert c.kubelet_socket == str(tmp_path / "k.sock")
    assert c.kubeconfig == str(kubeconfig)


def test_flag_wins_over_environment(monkeypatch):
    monkeypatch.setenv("DRA_GPU_EXPORTER_INTERVAL", "9")
    monkeypatch.setenv("DRA_GPU_EXPORTER_DCGM_COMPAT_LABELS", "false")
    c = cfg("--interval", "3", "--dcgm-compat-labels")
    assert c.interval == 3.0
    assert c.dcgm_compat_labels is True


def test_node_name_from_downward_api_env(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "worker-7")
    assert cfg().node_name == "worker-7"
    # the explicit flag (or its env var) still wins over the downward-API variable
    assert cfg("--node-name", "worker-8").node_name == "worker-8"


def test_boolean_env_spellings(monkeypatch):
    for text, want in [("1", True), ("on", True), ("TRUE", True), ("0", False), ("no", False), ("off", False)]:
        monkeypatch.setenv("DRA_GPU_EXPORTER_PER_PROCESS", text)
        assert cfg().per_process is want, text


def test_demo_defaults_and_flags(tmp_path):
    c = cfg("demo")
    assert c.backend == "sim"
    assert c.interval == 1.0
    assert (c.listen_host, c.listen_port) == ("127.0.0.1", 9402)  # a demo is not exposed to the network
    sc = tmp_path / "s.yaml"
    sc.write_text("gpus: [{name: a}]\n")
    c = cfg("demo", "--scenario", str(sc), "--time-scale", "60", "--listen", "127.0.0.1:0")
    assert c.scenario == str(sc) and c.time_scale == 60.0 and c.listen_port == 0


def test_flags_before_the_demo_subcommand_are_kept():
    # argparse copies a subparser's defaults over the parent's values unless told not to.
    assert cfg("--interval", "2", "demo").interval == 2.0
    assert cfg("--interval", "2", "demo", "--interval", "3").interval == 3.0
    assert cfg("--taint-mode", "off", "demo").taint_mode is TaintMode.OFF


# ------------------------------------------------------------------ parsers


@pytest.mark.parametrize(
    "text,want",
    [("0.0.0.0:9402", ("0.0.0.0", 9402)), (":9402", ("0.0.0.0", 9402)), ("[::]:80", ("::", 80)), ("localhost:0", ("localhost", 0))],
)
def test_parse_listen_ok(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["9402", "host:", "host:port", "1.2.3.4:99999", "[zz]:1", "a b:1", ""])
def test_parse_listen_rejects(text):
    with pytest.raises(ConfigError, match="--listen"):
        parse_listen(text)


@pytest.mark.parametrize("text", ["0", "0.01", "3601", "nan", "inf", "-1", "five"])
def test_parse_interval_rejects(text):
    with pytest.raises(ConfigError, match="--interval"):
        parse_interval(text)


# ------------------------------------------------------------------ errors: one line, exit 2


@pytest.mark.parametrize(
    "argv,env,fragment",
    [
        (["--interval", "abc"], {}, "--interval 'abc'"),
        (["--interval", "0"], {}, "between 0.05 and 3600"),
        (["--listen", "nonsense"], {}, "expected HOST:PORT"),
        (["--call-timeout", "-1"], {}, "--call-timeout"),
        (["--taint-budget-fraction", "1.5"], {}, "--taint-budget-fraction"),
        (["--pod-label-allowlist", "bad key!"], {}, "not a valid label key"),
        (["--exclude-metrics", "gpu_up,dra_claim_pod"], {}, "--exclude-metrics: 'dra_claim_pod' matches no metric"),
        ([], {"EXCLUDE_METRICS": "claims_*"}, "matches no metric (names as in the README's metric table, e.g. dra_claim_pods or 'gpu_*_clock_hertz') (from DRA_GPU_EXPORTER_EXCLUDE_METRICS)"),
        (["--node-name", "Not_A_Node"], {}, "not a valid Kubernetes node name"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], {}, "--kubeconfig /nonexistent/kubeconfig: no such file"),
        (["demo", "--scenario", "/nonexistent/scenario.yaml"], {}, "--scenario /nonexistent/scenario.yaml: no such file"),
        (["demo", "--time-scale", "0"], {}, "--time-scale"),
        ([], {"INTERVAL": "fast"}, "(from DRA_GPU_EXPORTER_INTERVAL)"),
        ([], {"BACKEND": "cuda"}, "--backend 'cuda'"),
        ([], {"TAINT_MODE": "always"}, "expected off, dry-run, shadow or enforce"),
        ([], {"PER_PROCESS": "maybe"}, "expected true or false"),
        ([], {"LOG_LEVEL": "loud"}, "--log-level"),
        (["demo"], {"SCENARIO": "/nonexistent.yaml"}, "(from DRA_GPU_EXPORTER_SCENARIO)"),
    ],
)
def test_bad_values_give_one_line_and_exit_2(capsys, monkeypatch, argv, env, fragment):
    for k, v in env.items():
        monkeypatch.setenv("DRA_GPU_EXPORTER_" + k, v)
    assert main(argv) == 2
    assert fragment in one_error_line(capsys)


@pytest.mark.parametrize("argv", [["--backend", "cuda"], ["--taint-mode", "always"], ["--no-such-flag"], ["demo", "--bogus"]])
def test_argparse_errors_are_one_line_too(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    line = one_error_line(capsys)
    assert "see --help" in line


def test_kubelet_socket_that_is_a_regular_file(capsys, tmp_path):
    f = tmp_path / "kubelet.sock"
    f.write_text("")
    assert main(["--kubelet-socket", str(f)]) == 2
    assert "exists but is not a unix socket" in one_error_line(capsys)


def test_kubelet_socket_that_is_a_directory(capsys, tmp_path):
    assert main(["--kubelet-socket", str(tmp_path)]) == 2
    assert "not a unix socket" in one_error_line(capsys)


def test_kubelet_socket_under_a_regular_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["--kubelet-socket", str(f / "kubelet.sock")]) == 2
    assert "not a directory" in one_error_line(capsys)


def test_kubelet_socket_path_too_long_for_sun_path(capsys, tmp_path):
    long = tmp_path / ("d" * 120) / "kubelet.sock"
    assert main(["--kubelet-socket", str(long)]) == 2
    assert "too long for a unix socket" in one_error_line(capsys)


def test_missing_kubelet_socket_is_not_fatal(tmp_path):
    # The kubelet may come up after the agent; device metrics are served meanwhile.
    assert check_kubelet_socket(str(tmp_path / "later.sock")) == "missing"
    assert cfg("--kubelet-socket", str(tmp_path / "later.sock")).kubelet_socket == str(tmp_path / "later.sock")


def test_a_real_unix_socket_is_accepted(tmp_path):
    path = str(tmp_path / "k.sock")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(path)
        assert check_kubelet_socket(path) is None
    finally:
        s.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read and write any socket")
def test_unwritable_socket_is_rejected(tmp_path):
    path = str(tmp_path / "k.sock")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(path)
        os.chmod(path, 0)
        assert "not readable/writable" in (check_kubelet_socket(path) or "")
    finally:
        s.close()


def test_invalid_scenario_content_is_one_line(capsys, tmp_path):
    sc = tmp_path / "broken.yaml"
    sc.write_text("gpus:\n  - name: a\n    memory: lots\n")
    assert main(["demo", "--scenario", str(sc)]) == 2
    line = one_error_line(capsys)
    assert "gpus[0].memory" in line and "lots" in line


# ------------------------------------------------------------------ informational commands


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"dra-gpu-exporter {__version__}"


def test_list_scenarios(capsys):
    assert main(["demo", "--list-scenarios"]) == 0
    out = capsys.readouterr().out
    listed = dict(line.split("\t") for line in out.splitlines())
    assert set(listed) == set(bundled_scenarios())
    assert {"mixed-node", "small-node", "mig-8gpu", "failure-storm"} <= set(listed)
    assert all(Path(p).is_file() for p in listed.values())


# ------------------------------------------------------------------ the real entry point


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "exporter", *argv], capture_output=True, text=True, timeout=60, env=e)


def test_entry_point_bad_env_value():
    r = _run([], {"DRA_GPU_EXPORTER_TAINT_MODE": "sometimes"})
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "dra-gpu-exporter: error: --taint-mode 'sometimes': expected off, dry-run, shadow or enforce (from DRA_GPU_EXPORTER_TAINT_MODE)"
    ]
    assert r.stdout == ""


def test_entry_point_unusable_socket(tmp_path):
    f = tmp_path / "not-a-socket"
    f.write_text("x")
    r = _run(["--kubelet-socket", str(f)])
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "is not a unix socket" in r.stderr
