"""Command-line and environment configuration.

Every flag can also be set as ``DRA_GPU_EXPORTER_<FLAG>`` (upper case, dashes as underscores);
a flag on the command line wins over the environment. Bad values end the program with one
clear line and exit code 2 (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import enum
import fnmatch
import ipaddress
import os
import re
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from . import __version__

ENV_PREFIX = "DRA_GPU_EXPORTER_"
DEFAULT_KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_LISTEN = "0.0.0.0:9402"


class TaintMode(str, enum.Enum):
    OFF = "off"  # no remediation at all
    DRY_RUN = "dry-run"  # decide, log and export, never write
    SHADOW = "shadow"  # write rules with effect None (Kubernetes reports what would be evicted)
    ENFORCE = "enforce"  # write rules with the tier's effect


# What str.splitlines() splits at, and other control characters: escaped in messages.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


MESSAGE_LIMIT = 500  # characters of an error message; the rest is counted, not shown


def one_line(message: str) -> str:
    """``message`` with line breaks and control characters escaped, and at most MESSAGE_LIMIT
    characters: errors stay one readable line even when they quote a huge input."""
    message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), message)
    if len(message) > MESSAGE_LIMIT:
        message = f"{message[:MESSAGE_LIMIT]}... ({len(message) - MESSAGE_LIMIT} more characters)"
    return message


class ConfigError(ValueError):
    """A configuration value is unusable. The message is shown to the user as is, on one line:
    some messages quote a path verbatim, and a path may hold a newline."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


@dataclass(frozen=True)
class Config:
    listen_host: str = "0.0.0.0"
    listen_port: int = 9402
    node_name: str = ""
    kubelet_socket: str = DEFAULT_KUBELET_SOCKET
    kubeconfig: str | None = None
    backend: str = "auto"
    interval: float = 5.0
    taint_mode: TaintMode = TaintMode.ENFORCE
    log_format: str = "auto"
    log_level: str = "info"
    call_timeout: float = 2.0  # deadline for one device read (all its library calls)
    # attribution and cardinality
    per_process: bool = False  # needs hostPID; maps PIDs to pods through /proc/<pid>/cgroup
    pod_label_allowlist: tuple[str, ...] = ()  # pod labels exported on dra_pod_labels
    dcgm_compat_labels: bool = False  # add pod/namespace/container/dra_* labels to device series
    exclude_metrics: frozenset[str] = frozenset()  # catalog names never exported (--exclude-metrics)
    # remediation safety
    taint_rate_limit: int = 2  # new NoExecute rules per node per rate window
    taint_rate_window: float = 600.0
    taint_budget_fraction: float = 0.05  # cluster-wide share of GPUs under NoExecute
    taint_budget_max: int = 16
    taint_hold_seconds: float = 1800.0  # healthy time before a rule steps down
    node_failure_fraction: float = 0.5  # more than this share of a node's GPUs failing together = node fault
    # remediation timing (team remediation, issue 16): every delay a fault goes through
    taint_settle_seconds: float = 2.0  # a new fatal fault is NoSchedule this long before NoExecute
    node_fault_window: float = 2.0  # failures this close together count as one node-wide event
    # health evidence (team health): how long a device call must stay stuck before the device
    # counts as hung (driver_hung, fatal), and how long a fatal fault stays after a GPU reset
    hung_after: float = 30.0
    fault_clear_seconds: float = 120.0
    # HTTP endpoint: TLS, client certificates, basic auth (exporter-toolkit format)
    web_config_file: str | None = None
    # demo only
    scenario: str | None = None
    time_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"))


def parse_listen(value: str) -> tuple[str, int]:
    # A host name or IPv4 address is letters, digits, dots, dashes (and underscores, which
    # /etc/hosts tolerates); anything else (a NUL, a slash) could only fail later, at bind time,
    # with exit code 1 instead of this one line.
    m = re.fullmatch(r"(?:\[(?P<v6>[^\]]*)\]|(?P<host>[A-Za-z0-9._-]*)):(?P<port>\d{1,5})", value.strip())
    if not m:
        raise ConfigError(f"--listen {value!r}: expected HOST:PORT, e.g. 0.0.0.0:9402 or [::]:9402")
    if m.group("v6") is not None:
        # an address check, not a character class: [::ffff:1.2.3.4] and [fe80::1%eth0] are
        # fine, [1:2:3:4:5:6:7:8:9] is not; ipaddress takes any scope id, an interface does not
        try:
            ipaddress.IPv6Address(m.group("v6"))
            ok = re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]{1,15})?", m.group("v6")) is not None
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--listen {value!r}: {m.group('v6')!r} is not an IPv6 address")
    host = m.group("v6") or m.group("host") or "0.0.0.0"
    port = int(m.group("port"))
    if not 0 <= port <= 65535:
        raise ConfigError(f"--listen {value!r}: port must be 0..65535")
    return host, port


def parse_interval(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise ConfigError(f"--interval {value!r}: expected a number of seconds, e.g. 5 or 0.5") from None
    if not (0.05 <= v <= 3600):
        raise ConfigError(f"--interval {value!r}: must be between 0.05 and 3600 seconds")
    return v


def _positive_float(flag: str, value: str, lo: float, hi: float) -> float:
    try:
        v = float(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected a number") from None
    if not (lo <= v <= hi):
        raise ConfigError(f"{flag} {value!r}: must be between {lo:g} and {hi:g}")
    return v


def _is_file(path: str) -> bool:
    # Path.is_file() swallows only ENOENT, ENOTDIR, EBADF and ELOOP: a name too long
    # (ENAMETOOLONG) or a directory we may not search (EACCES) raised OSError, a traceback
    try:
        return Path(path).is_file()
    except OSError:
        return False


def check_kubelet_socket(path: str) -> str | None:
    """Return a problem description, or None when the socket looks usable.

    "missing" means the socket does not exist (yet). Only the problems of
    :func:`kubelet_socket_unusable` stop the agent at start; the rest are problems the agent
    rides out at run time (the kubelet client retries with backoff, device metrics keep being
    served, the kubelet collector reports failure), so start-up only warns about them.
    """
    if (fatal := kubelet_socket_unusable(path)) is not None:
        return fatal
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        return "missing"
    except PermissionError:
        return f"--kubelet-socket {path}: permission denied"
    except NotADirectoryError:
        return f"--kubelet-socket {path}: a parent of this path is not a directory"
    except OSError as e:  # ELOOP, ENAMETOOLONG, ...: say what, never a traceback
        return f"--kubelet-socket {path}: {e.strerror or e}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"--kubelet-socket {path}: exists but is not a unix socket"
    if not os.access(path, os.R_OK | os.W_OK):
        return f"--kubelet-socket {path}: not readable/writable by this user (uid {os.getuid()})"
    return None


def kubelet_socket_unusable(path: str) -> str | None:
    """A problem with the socket *path* that no change on the node can fix (so waiting for
    the kubelet would wait forever): the one kind of kubelet-socket problem worth exit 2."""
    if not path:
        return "--kubelet-socket: empty path"
    # sockaddr_un.sun_path holds 107 bytes plus a NUL: a longer path can never be connected to,
    # so waiting for the kubelet to create it would wait forever.
    try:
        encoded = os.fsencode(os.path.abspath(path))
    except UnicodeEncodeError:  # a lone surrogate: no file system name
        return f"--kubelet-socket {path!r}: not a valid path"
    if len(encoded) > 107:
        return f"--kubelet-socket {path}: path too long for a unix socket (at most 107 bytes)"
    if b"\0" in encoded:  # stat() raises ValueError for it, not OSError
        return f"--kubelet-socket {path!r}: not a valid path (NUL byte)"
    return None


KUBECONFIG_LIMIT = 4 << 20  # bytes; kubeconfigs with embedded certificates are a few KiB


def check_kubeconfig(path: str) -> None:
    """Fail with one clear line when ``path`` cannot be a kubeconfig: missing, a directory,
    unreadable, empty (``/dev/null``), or not a YAML mapping (``/etc/passwd``). The kubernetes
    client's own loader answers the last two with a Python type error or "file is empty"."""
    flag = f"--kubeconfig {path}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{flag}: no such file") from None
    except (OSError, ValueError) as e:  # ENOTDIR, EACCES, ELOOP, a NUL byte
        raise ConfigError(f"{flag}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{flag}: is a directory, not a kubeconfig file")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        # a FIFO or socket would block the read below, or never end
        raise ConfigError(f"{flag}: not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(KUBECONFIG_LIMIT + 1)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read: {e.strerror or e}") from None
    if len(data) > KUBECONFIG_LIMIT:
        raise ConfigError(f"{flag}: larger than {KUBECONFIG_LIMIT >> 20} MiB, not a kubeconfig")
    if not data.strip():
        raise ConfigError(f"{flag}: empty file, not a kubeconfig")
    import yaml  # only for this check; a dependency anyway (scenarios, manifests)

    hint = "expected YAML with clusters, contexts and users"
    try:
        doc = yaml.safe_load(data)
    except Exception as e:  # YAMLError, a huge integer, deep nesting...: all mean "not YAML we can use"
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{flag}: not valid YAML{where}; {hint}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag}: not a kubeconfig ({hint}, got {type(doc).__name__})")
    if doc.get("kind") != "Config" and not any(k in doc for k in ("clusters", "contexts", "users", "current-context")):
        raise ConfigError(f"{flag}: not a kubeconfig ({hint}; none of those keys is there)")


def _add_common(p: argparse.ArgumentParser, demo: bool = False) -> None:
    listen, interval = ("127.0.0.1:9402", "1") if demo else (DEFAULT_LISTEN, "5")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"address for /metrics, /healthz, /readyz (default {listen})")
    p.add_argument("--interval", metavar="SECONDS", help=f"collection interval, float seconds (default {interval})")
    backend_help = "device library; the demo simulates its GPUs (sim, the default)" if demo else "device library: auto, nvml or amdsmi (default auto; sim is the demo's)"
    p.add_argument("--backend", choices=["auto", "nvml", "amdsmi", "sim"], help=backend_help)
    p.add_argument("--taint-mode", choices=[m.value for m in TaintMode], help="remediation mode (default enforce)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], help="auto: JSON unless stderr is a terminal")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--call-timeout", metavar="SECONDS", help="deadline for reading one device (default 2)")
    p.add_argument("--per-process", action="store_const", const="true", help="per-process (per-pod) GPU memory; needs hostPID")
    p.add_argument("--pod-label-allowlist", metavar="K1,K2", help="pod labels exported on dra_pod_labels")
    p.add_argument("--exclude-metrics", metavar="NAME,GLOB", help="metrics never exported, by name or shell pattern (e.g. 'dra_claim_memory_*')")
    p.add_argument("--dcgm-compat-labels", action="store_const", const="true", help="add dcgm-exporter's pod/namespace/container/dra_* labels to device series")
    p.add_argument("--taint-rate-limit", metavar="N", help="new NoExecute rules per node per 10 minutes (default 2)")
    p.add_argument("--taint-budget-fraction", metavar="F", help="cluster share of GPUs under NoExecute before suppression (default 0.05)")
    p.add_argument("--taint-hold-seconds", metavar="S", help="healthy time before a rule steps down (default 1800)")
    # remediation timing (team remediation)
    p.add_argument("--taint-settle-seconds", metavar="S", help="a new fatal fault is NoSchedule this long, then NoExecute unless the node-wide test trips (default 2)")
    p.add_argument("--node-fault-window", metavar="S", help="GPU failures this close together count together for the node-wide test (default 2)")
    # health evidence
    p.add_argument("--hung-after", metavar="SECONDS", help="a device call stuck this long, while the agent itself gets CPU, makes the device driver_hung (fatal) (default 30)")
    p.add_argument("--fault-clear-seconds", metavar="SECONDS", help="a fatal fault clears this long after a GPU reset, a polled fault this long after it was last seen (default 120)")
    p.add_argument("--web-config-file", metavar="PATH", help="TLS, client-certificate and basic-auth settings for the HTTP endpoint, in the Prometheus exporter-toolkit format")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (like every other configuration error), not
    the whole usage text followed by the message."""

    def error(self, message: str) -> NoReturn:
        # one line even when it quotes an unrecognized argument with a newline in it
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dra-gpu-exporter",
        description="GPU metrics attributed to DRA ResourceClaims, GPU health and DeviceTaintRule remediation. "
        f"Every flag can be set as an environment variable {ENV_PREFIX}<FLAG>.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common(p)
    p.add_argument("--node-name", help="this node's name (env NODE_NAME)")
    p.add_argument("--kubelet-socket", metavar="PATH", help=f"PodResources socket (default {DEFAULT_KUBELET_SOCKET})")
    p.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig (default: in-cluster, then KUBECONFIG; none: no Kubernetes API features)")
    sub = p.add_subparsers(dest="command")
    # SUPPRESS: a flag the subcommand does not see must not be reset to None by it, so
    # "dra-gpu-exporter --interval 2 demo" keeps the 2 (argparse copies subparser defaults
    # over the parent's values otherwise).
    d = sub.add_parser(
        "demo", help="run the embedded simulated node (GPUs, kubelet, Kubernetes API)", argument_default=argparse.SUPPRESS
    )
    _add_common(d, demo=True)
    d.add_argument("--scenario", metavar="FILE|NAME", help="scenario file (YAML or JSON) or a bundled scenario's name (see --list-scenarios); default: mixed-node")
    d.add_argument("--time-scale", metavar="X", help="simulated seconds per real second (default 1)")
    d.add_argument("--list-scenarios", action="store_true", help="list the bundled scenarios and exit")
    return p


_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False}


def _bool(flag: str, value: str) -> bool:
    try:
        return _BOOL[value.strip().lower()]
    except KeyError:
        raise ConfigError(f"{flag} {value!r}: expected true or false") from None


def resolve(ns: argparse.Namespace) -> Config:
    """Merge flags over environment over defaults, and validate."""
    from_env: dict[str, str] = {}  # flag -> the environment variable its value came from

    def pick(name: str, fallback: str | None = None) -> str | None:
        """The flag, else its DRA_GPU_EXPORTER_ variable; when both are empty, ``fallback``
        (another variable, e.g. the downward API's NODE_NAME)."""
        v = getattr(ns, name.replace("-", "_"), None)
        if v is None and (v := _env(name)) is not None:
            from_env[name] = ENV_PREFIX + name.upper().replace("-", "_")
        if not v and fallback and (fv := os.environ.get(fallback)):
            from_env[name] = fallback
            return fv
        return v

    try:
        return _resolve(ns, pick)
    except ConfigError as e:
        # A value from the environment is reported under its flag's name; say where it came
        # from, or the user looks for a flag that is not on the command line.
        m = re.match(r"--([a-z-]+)", str(e))
        if m and m.group(1) in from_env:
            raise ConfigError(f"{e} (from {from_env[m.group(1)]})") from None
        raise


def _label_allowlist(value: str) -> tuple[str, ...]:
    keys: list[str] = []
    exported: dict[str, str] = {}
    for k in (k.strip() for k in value.split(",")):
        if not k or k in keys:  # a repeated key would be a repeated label on dra_pod_labels
            continue
        if not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?", k):
            raise ConfigError(f"--pod-label-allowlist: {k!r} is not a valid label key")
        # dra_pod_labels exports each key as label_<key with [^a-zA-Z0-9_] as _>: two keys
        # with one name would silently show only one of the two values
        name = "label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)
        if name in exported:
            raise ConfigError(f"--pod-label-allowlist: {exported[name]!r} and {k!r} would both be exported as {name}")
        exported[name] = k
        keys.append(k)
    return tuple(keys)


def parse_exclude_metrics(value: str) -> frozenset[str]:
    """Names and shell patterns -> the catalog names they match. A pattern that matches
    nothing is a typo, and a typo here would silently keep the series it meant to drop."""
    from .catalog import BY_NAME

    out: set[str] = set()
    for pattern in (p.strip() for p in value.split(",")):
        if not pattern:
            continue
        hits = fnmatch.filter(BY_NAME, pattern)
        if not hits:
            raise ConfigError(f"--exclude-metrics: {pattern!r} matches no metric (names as in the README's metric table, e.g. dra_claim_pods or 'gpu_*_clock_hertz')")
        out.update(hits)
    return frozenset(out)


def _resolve(ns: argparse.Namespace, pick: Callable[..., str | None]) -> Config:

    kw: dict[str, Any] = {}
    if (v := pick("listen")) is not None:
        kw["listen_host"], kw["listen_port"] = parse_listen(v)
    if (v := pick("interval")) is not None:
        kw["interval"] = parse_interval(v)
    if (v := pick("backend")) is not None:
        if v not in ("auto", "nvml", "amdsmi", "sim"):
            raise ConfigError(f"--backend {v!r}: expected auto, nvml, amdsmi or sim")
        kw["backend"] = v
    if (v := pick("taint-mode")) is not None:
        try:
            kw["taint_mode"] = TaintMode(v)
        except ValueError:
            raise ConfigError(f"--taint-mode {v!r}: expected off, dry-run, shadow or enforce") from None
    if (v := pick("log-format")) is not None:
        if v not in ("auto", "json", "console"):
            raise ConfigError(f"--log-format {v!r}: expected auto, json or console")
        kw["log_format"] = v
    if (v := pick("log-level")) is not None:
        if v.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"--log-level {v!r}: expected debug, info, warning or error")
        kw["log_level"] = v.lower()
    if (v := pick("call-timeout")) is not None:
        kw["call_timeout"] = _positive_float("--call-timeout", v, 0.01, 600)
    if (v := pick("per-process")) is not None:
        kw["per_process"] = _bool("--per-process", v)
    if (v := pick("pod-label-allowlist")) is not None:
        kw["pod_label_allowlist"] = _label_allowlist(v)
    if (v := pick("exclude-metrics")) is not None:
        kw["exclude_metrics"] = parse_exclude_metrics(v)
    if (v := pick("dcgm-compat-labels")) is not None:
        kw["dcgm_compat_labels"] = _bool("--dcgm-compat-labels", v)
    if (v := pick("taint-rate-limit")) is not None:
        n = _positive_float("--taint-rate-limit", v, 0, 1000)
        if n != int(n):  # a count of rules: 0.5 must not quietly become 0 (no taints at all)
            raise ConfigError(f"--taint-rate-limit {v!r}: expected a whole number")
        kw["taint_rate_limit"] = int(n)
    if (v := pick("taint-budget-fraction")) is not None:
        kw["taint_budget_fraction"] = _positive_float("--taint-budget-fraction", v, 0, 1)
    if (v := pick("taint-hold-seconds")) is not None:
        kw["taint_hold_seconds"] = _positive_float("--taint-hold-seconds", v, 0, 7 * 86400)
    # remediation timing (team remediation)
    if (v := pick("taint-settle-seconds")) is not None:
        kw["taint_settle_seconds"] = _positive_float("--taint-settle-seconds", v, 0, 600)
    if (v := pick("node-fault-window")) is not None:
        kw["node_fault_window"] = _positive_float("--node-fault-window", v, 0, 600)
    # health evidence
    if (v := pick("hung-after")) is not None:
        kw["hung_after"] = _positive_float("--hung-after", v, 0, 3600)
    if (v := pick("fault-clear-seconds")) is not None:
        kw["fault_clear_seconds"] = _positive_float("--fault-clear-seconds", v, 0, 7 * 86400)

    if (v := pick("web-config-file")) is not None and v != "":
        # only that it exists here: its contents are checked by the CLI (exporter.metrics.webconfig,
        # a layer config must not import), before anything starts, with the same exit code 2
        if not _is_file(v):
            raise ConfigError(f"--web-config-file {v}: no such file")
        kw["web_config_file"] = v

    demo = getattr(ns, "command", None) == "demo"
    if demo:
        if kw.get("backend", "sim") not in ("sim", "auto"):
            # The demo's GPUs are simulated; a real backend would be quietly ignored.
            raise ConfigError(f"--backend {kw['backend']!r}: the demo simulates its GPUs (backend sim); to read this node's GPUs run the agent: dra-gpu-exporter --backend {kw['backend']}")
        if (v := pick("scenario")) is not None:
            # A bundled scenario's name (as --list-scenarios prints it) is looked up by the
            # demo; anything that looks like a path must be a file.
            if not _is_file(v) and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
                raise ConfigError(f"--scenario {v}: no such file")
            kw["scenario"] = v
        if (v := pick("time-scale")) is not None:
            kw["time_scale"] = _positive_float("--time-scale", v, 0.01, 10000)
        kw["backend"] = "sim"
        kw.setdefault("interval", 1.0)
        if "listen_host" not in kw:
            kw["listen_host"], kw["listen_port"] = "127.0.0.1", 9402
        return Config(**kw)

    node = pick("node-name", fallback="NODE_NAME") or ""
    if node and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", node):
        raise ConfigError(f"--node-name {node!r}: not a valid Kubernetes node name")
    kw["node_name"] = node or socket.gethostname().lower()
    if kw.get("backend") == "sim":
        raise ConfigError("--backend sim: the simulated backend runs only under `dra-gpu-exporter demo`; the agent takes auto, nvml or amdsmi")
    if (v := pick("kubelet-socket")) is not None:
        kw["kubelet_socket"] = v
    # Only a path that can never work stops the start; a missing socket, a wrong file type or
    # permissions are ridden out at run time (cli.run_agent warns about them).
    problem = kubelet_socket_unusable(kw.get("kubelet_socket", DEFAULT_KUBELET_SOCKET))
    if problem:
        raise ConfigError(problem)
    if (v := pick("kubeconfig")) is not None:
        check_kubeconfig(v)
        kw["kubeconfig"] = v
    return Config(**kw)
