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

from drasim.scenario import bundled_scenarios
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
        "--listen", "127.0.0.1:9999", "--interval", "0.5", "--backend", "amdsmi", "--taint-mode", "dry-run",
        "--log-format", "json", "--log-level", "debug", "--call-timeout", "1.5", "--per-process",
        "--pod-label-allowlist", "app, team ,app.kubernetes.io/name", "--dcgm-compat-labels",
        "--taint-rate-limit", "3", "--taint-hold-seconds", "60",
        "--node-name", "gpu-node-1", "--kubelet-socket", str(tmp_path / "kubelet.sock"), "--kubeconfig", str(kubeconfig),
    )
    assert (c.listen_host, c.listen_port) == ("127.0.0.1", 9999)
    assert c.interval == 0.5
    assert c.backend == "amdsmi"
    assert c.taint_mode is TaintMode.DRY_RUN
    assert (c.log_format, c.log_level) == ("json", "debug")
    assert c.call_timeout == 1.5
    assert c.per_process is True
    assert c.pod_label_allowlist == ("app", "team", "app.kubernetes.io/name")
    assert c.dcgm_compat_labels is True
    assert c.taint_rate_limit == 3
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
        "DCGM_COMPAT_LABELS": "true", "TAINT_RATE_LIMIT": "5", "EXCLUDE_METRICS": "dra_claim_pods, gpu_*_clock_hertz",
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
    assert (c.taint_rate_limit, c.taint_hold_seconds) == (5, 900)
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
        (["--pod-label-allowlist", "bad key!"], {}, "not a valid label key"),
        (["--exclude-metrics", "gpu_up,dra_claim_pod"], {}, "--exclude-metrics: 'dra_claim_pod' matches no metric"),
        ([], {"EXCLUDE_METRICS": "claims_*"},
         "matches no metric (names as in docs/metrics.md, e.g. dra_claim_pods or 'gpu_*_clock_hertz') "
         "(from DRA_GPU_EXPORTER_EXCLUDE_METRICS)"),
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


# Issue 15: problems the agent rides out at run time (the kubelet client retries) are not a
# reason to refuse the start; check_kubelet_socket still names them, and run_agent warns.
def test_kubelet_socket_that_is_a_regular_file(tmp_path):
    f = tmp_path / "kubelet.sock"
    f.write_text("")
    assert cfg("--kubelet-socket", str(f)).kubelet_socket == str(f)
    assert "exists but is not a unix socket" in (check_kubelet_socket(str(f)) or "")


def test_kubelet_socket_that_is_a_directory(tmp_path):
    assert cfg("--kubelet-socket", str(tmp_path)).kubelet_socket == str(tmp_path)
    assert "not a unix socket" in (check_kubelet_socket(str(tmp_path)) or "")


def test_kubelet_socket_under_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert cfg("--kubelet-socket", str(f / "kubelet.sock")).kubelet_socket == str(f / "kubelet.sock")
    assert "not a directory" in (check_kubelet_socket(str(f / "kubelet.sock")) or "")


def test_agent_starts_with_a_kubelet_socket_problem_it_tolerates(tmp_path):
    """Issue 15: the socket path is a regular file (the kubelet not up yet, a hostPath mounted
    wrong). The real entry point gets past configuration (no exit 2), warns once, and then
    fails only for the missing GPU library (exit 1) -- on a GPU node it would keep running."""
    f = tmp_path / "kubelet.sock"
    f.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRA_GPU_EXPORTER_")}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # no libnvidia-ml/libamd_smi here, whatever the host has
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--kubelet-socket", str(f), "--node-name", "n1", "--listen", "127.0.0.1:0", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a machine with a GPU library: the agent runs on
        proc.terminate()
        proc.wait(timeout=30)
        rc = None
    err = proc.stderr.read()
    proc.stderr.close()
    assert "kubelet_socket_problem" in err and "exists but is not a unix socket" in err, err
    assert rc != 2, err
    if rc == 1:  # no GPU library on this machine: the start failed for that reason only
        assert "start_failed" in err and "kubelet" not in err.split("start_failed", 1)[1], err


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
    # Issue 15: only a path no kubelet can ever listen on stops the start (a regular file in
    # its place is ridden out: test_agent_starts_with_a_kubelet_socket_problem_it_tolerates).
    r = _run(["--kubelet-socket", str(tmp_path / ("d" * 120) / "kubelet.sock")])
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "too long for a unix socket" in r.stderr


# ------------------------------------------------------------------ issue 15: newcomer papercuts


def test_agent_refuses_the_sim_backend_with_a_hint(capsys, monkeypatch):
    # Decision: the simulated backend is the demo's; the agent refuses it at parse time (exit 2)
    # and says where it works, instead of failing at start with exit 1.
    assert main(["--backend", "sim"]) == 2
    line = one_error_line(capsys)
    assert "--backend sim" in line and "dra-gpu-exporter demo" in line
    monkeypatch.setenv("DRA_GPU_EXPORTER_BACKEND", "sim")
    assert main([]) == 2
    assert "(from DRA_GPU_EXPORTER_BACKEND)" in one_error_line(capsys)


@pytest.mark.parametrize("backend", ["nvml", "amdsmi"])
def test_demo_refuses_a_real_backend_instead_of_ignoring_it(capsys, backend):
    assert main(["demo", "--backend", backend]) == 2
    line = one_error_line(capsys)
    assert f"--backend '{backend}'" in line and "simulates its GPUs" in line
    # before the subcommand too
    assert main(["--backend", backend, "demo"]) == 2
    one_error_line(capsys)


@pytest.mark.parametrize("backend", ["sim", "auto"])
def test_demo_takes_its_own_backend(backend):
    assert cfg("demo", "--backend", backend).backend == "sim"


def test_demo_scenario_by_bundled_name():
    from drasim.scenario import find_scenario

    c = cfg("demo", "--scenario", "small-node")
    assert c.scenario == "small-node"
    for name, path in bundled_scenarios().items():  # every name --list-scenarios prints
        assert find_scenario(name) == path


def test_demo_unknown_scenario_name_lists_the_bundled_ones(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--scenario", "no-such-node"]) == 2
    line = one_error_line(capsys)
    assert "no-such-node" in line and "small-node" in line and "mixed-node" in line


def test_a_file_wins_over_a_bundled_name(tmp_path, monkeypatch):
    from drasim.scenario import find_scenario

    monkeypatch.chdir(tmp_path)
    (tmp_path / "small-node").write_text("gpus: [{name: a}]\n")
    assert find_scenario("small-node") == Path("small-node")


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "no such file"),
        ("", "empty file, not a kubeconfig"),
        ("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n", "not a kubeconfig"),
        ("clusters: [unclosed\n", "not valid YAML at line"),
        ("- a\n- b\n", "got list"),
        ("foo: bar\n", "none of those keys"),
    ],
)
def test_kubeconfig_that_cannot_be_one_is_one_clear_line(capsys, tmp_path, content, fragment):
    path = tmp_path / "kc"
    if content is not None:
        path.write_text(content)
    assert main(["--kubeconfig", str(path)]) == 2
    line = one_error_line(capsys)
    assert fragment in line and str(path) in line
    assert "object" not in line and "item assignment" not in line  # no Python type error


def test_kubeconfig_etc_passwd_and_dev_null(capsys):
    # The two cases, verbatim: a Python type error and "no such file" before.
    assert main(["--kubeconfig", "/dev/null"]) == 2
    assert "/dev/null: empty file, not a kubeconfig" in one_error_line(capsys)
    if Path("/etc/passwd").is_file():
        assert main(["--kubeconfig", "/etc/passwd"]) == 2
        line = one_error_line(capsys)
        assert "/etc/passwd: not a kubeconfig" in line


def test_kubeconfig_directory(capsys, tmp_path):
    assert main(["--kubeconfig", str(tmp_path)]) == 2
    assert "is a directory" in one_error_line(capsys)


def test_settle_heap_takes_the_start_up_heap_out_of_the_collectors_reach() -> None:
    # run_agent calls it once the agent has started: later full collections then scan only
    # what cycles allocate, not the ~70,000 objects start-up built for the process's life.
    import gc

    from exporter.cli import settle_heap

    gc.unfreeze()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 10_000  # this test process's modules, classes, functions
        assert len(gc.get_objects()) < gc.get_freeze_count() // 10  # what a collection still scans
    finally:
        gc.unfreeze()
