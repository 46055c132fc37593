"""Command-line and environment configuration: one table of flags, and what it generates.

Each flag is one row of :data:`FLAGS` (name, parser and validation, default, the demo's default
where it differs, help text, the reference's meaning). The row generates its argparse argument, its
environment variable ``DRA_GPU_EXPORTER_<FLAG>`` (upper case, dashes as underscores), its
``Config`` default and its line in the configuration reference (docs/configuration.md)
(``python tools/config_reference.py`` rewrites that table; tests/test_readme_config.py keeps it equal).

A flag on the command line wins over the environment. Bad values end the program with one clear
line and exit code 2 (argparse's convention), never a traceback.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

from . import __version__, constants
from .reasons import TaintMode as TaintMode  # remediation's modes, which --taint-mode parses into (re-exported)
from .text import one_line

ENV_PREFIX = "DRA_GPU_EXPORTER_"
DEFAULT_KUBELET_SOCKET = constants.KUBELET_SOCKET
AGENT, DEMO = "agent", "demo"  # the two commands: `dra-gpu-exporter` and `dra-gpu-exporter demo`


class ConfigError(ValueError):
    """A configuration value is unusable. The message is shown to the user as is, on one line:
    some messages quote a path verbatim, and a path may hold a newline."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


# --------------------------------------------------------------------------------------------
# Parsers: text (from the command line or the environment) -> value. Each takes the flag it
# reads (``--interval``) so that its errors name it first.
# --------------------------------------------------------------------------------------------

T = TypeVar("T")


def parse_listen(value: str, flag: str = "--listen") -> tuple[str, int]:
    # A host name or IPv4 address is letters, digits, dots, dashes (and underscores, which
    # /etc/hosts tolerates); anything else (a NUL, a slash) could only fail later, at bind time,
    # with exit code 1 instead of this one line.
    m = re.fullmatch(r"(?:\[(?P<v6>[^\]]*)\]|(?P<host>[A-Za-z0-9._-]*)):(?P<port>\d{1,5})", value.strip())
    if not m:
        raise ConfigError(f"{flag} {value!r}: expected HOST:PORT, e.g. 0.0.0.0:9402 or [::]:9402")
    if m.group("v6") is not None:
        # an address check, not a character class: [::ffff:1.2.3.4] and [fe80::1%eth0] are
        # fine, [1:2:3:4:5:6:7:8:9] is not; ipaddress takes any scope id, an interface does not
        try:
            ipaddress.IPv6Address(m.group("v6"))
            ok = re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]{1,15})?", m.group("v6")) is not None
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"{flag} {value!r}: {m.group('v6')!r} is not an IPv6 address")
    host = m.group("v6") or m.group("host") or "0.0.0.0"
    port = int(m.group("port"))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag} {value!r}: port must be 0..65535")
    return host, port


def parse_interval(value: str, flag: str = "--interval") -> float:
    try:
        v = float(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected a number of seconds, e.g. 5 or 0.5") from None
    if not (0.05 <= v <= 3600):
        raise ConfigError(f"{flag} {value!r}: must be between 0.05 and 3600 seconds")
    return v


@dataclass(frozen=True)
class Number:
    """A number between ``lo`` and ``hi`` (NaN and infinities are outside every range)."""

    lo: float
    hi: float

    def __call__(self, value: str, flag: str) -> float:
        try:
            v = float(value)
        except ValueError:
            raise ConfigError(f"{flag} {value!r}: expected a number") from None
        if not (self.lo <= v <= self.hi):
            raise ConfigError(f"{flag} {value!r}: must be between {self.lo:g} and {self.hi:g}")
        return v


@dataclass(frozen=True)
class Count:
    """A whole number between ``lo`` and ``hi``: a count of things, where 0.5 must not quietly
    become 0 (for --taint-rate-limit, no taints at all)."""

    lo: int
    hi: int

    def __call__(self, value: str, flag: str) -> int:
        n = Number(self.lo, self.hi)(value, flag)
        if n != int(n):
            raise ConfigError(f"{flag} {value!r}: expected a whole number")
        return int(n)


@dataclass(frozen=True)
class Choice(Generic[T]):
    """One of ``choices`` (also argparse's choices on the command line), converted by ``then``;
    ``fold_case``: the environment may spell it in any case (the command line may not)."""

    choices: tuple[str, ...]
    then: Callable[[str], T]
    fold_case: bool = False

    def __call__(self, value: str, flag: str) -> T:
        v = value.lower() if self.fold_case else value
        if v not in self.choices:
            raise ConfigError(f"{flag} {value!r}: expected {', '.join(self.choices[:-1])} or {self.choices[-1]}")
        return self.then(v)


_BOOL = {
    "1": True, "true": True, "yes": True, "on": True,
    "0": False, "false": False, "no": False, "off": False, "": False,
}


def parse_bool(value: str, flag: str) -> bool:
    try:
        return _BOOL[value.strip().lower()]
    except KeyError:
        raise ConfigError(f"{flag} {value!r}: expected true or false") from None


def _agent_backend(v: str) -> str:
    if v == "sim":
        raise ConfigError(
            "--backend sim: the simulated backend runs only under `dra-gpu-exporter demo`; "
            "the agent takes auto, nvml or amdsmi"
        )
    return v


def _demo_backend(v: str) -> str:
    if v not in ("sim", "auto"):
        # The demo's GPUs are simulated; a real backend would be quietly ignored.
        raise ConfigError(
            f"--backend {v!r}: the demo simulates its GPUs (backend sim); to read this node's GPUs run the agent: "
            f"dra-gpu-exporter --backend {v}"
        )
    return "sim"


def parse_label_allowlist(value: str, flag: str = "--pod-label-allowlist") -> tuple[str, ...]:
    keys: list[str] = []
    exported: dict[str, str] = {}
    for k in (k.strip() for k in value.split(",")):
        if not k or k in keys:  # a repeated key would be a repeated label on dra_pod_labels
            continue
        if not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?", k):
            raise ConfigError(f"{flag}: {k!r} is not a valid label key")
        # dra_pod_labels exports each key as label_<key with [^a-zA-Z0-9_] as _>: two keys
        # with one name would silently show only one of the two values
        name = "label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)
        if name in exported:
            raise ConfigError(f"{flag}: {exported[name]!r} and {k!r} would both be exported as {name}")
        exported[name] = k
        keys.append(k)
    return tuple(keys)


def parse_exclude_metrics(value: str, flag: str = "--exclude-metrics") -> frozenset[str]:
    """Names and shell patterns -> the catalog names they match. A pattern that matches
    nothing is a typo, and a typo here would silently keep the series it meant to drop."""
    from .catalog import BY_NAME

    out: set[str] = set()
    for pattern in (p.strip() for p in value.split(",")):
        if not pattern:
            continue
        hits = fnmatch.filter(BY_NAME, pattern)
        if not hits:
            raise ConfigError(
                f"{flag}: {pattern!r} matches no metric (names as in docs/metrics.md, "
                "e.g. dra_claim_pods or 'gpu_*_clock_hertz')"
            )
        out.update(hits)
    return frozenset(out)


def parse_node_name(value: str, flag: str = "--node-name") -> str:
    """A Kubernetes node name, or "" (then resolve() takes the host name)."""
    if value and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
        raise ConfigError(f"{flag} {value!r}: not a valid Kubernetes node name")
    return value


def _is_file(path: str) -> bool:
    # Path.is_file() swallows only ENOENT, ENOTDIR, EBADF and ELOOP: a name too long
    # (ENAMETOOLONG) or a directory we may not search (EACCES) raised OSError, a traceback
    try:
        return Path(path).is_file()
    except OSError:
        return False


def parse_web_config_file(value: str, flag: str = "--web-config-file") -> str | None:
    """Only that it exists here ("" means none): its contents are checked by the CLI
    (exporter.metrics.webconfig, a layer config must not import), before anything starts, with
    the same exit code 2."""
    if value == "":
        return None
    if not _is_file(value):
        raise ConfigError(f"{flag} {value}: no such file")
    return value


def parse_scenario(value: str, flag: str = "--scenario") -> str:
    # A bundled scenario's name (as --list-scenarios prints it) is looked up by the demo;
    # anything that looks like a path must be a file.
    if not _is_file(value) and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise ConfigError(f"{flag} {value}: no such file")
    return value


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


def parse_kubelet_socket(value: str, flag: str = "--kubelet-socket") -> str:
    # Only a path that can never work stops the start; a missing socket, a wrong file type or
    # permissions are ridden out at run time (cli.run_agent warns about them).
    if (problem := kubelet_socket_unusable(value)) is not None:
        raise ConfigError(problem)
    return value


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


def parse_kubeconfig(value: str, flag: str = "--kubeconfig") -> str:
    check_kubeconfig(value)
    return value


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def _show(value: object) -> str:
    """A default as --help and docs/configuration.md write it."""
    if value is None or value in ((), frozenset(), ""):
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _host_port(hp: tuple[str, int]) -> str:
    return f"[{hp[0]}]:{hp[1]}" if ":" in hp[0] else f"{hp[0]}:{hp[1]}"


@dataclass(frozen=True)
class Flag(Generic[T]):
    """One flag: everything the command line, the environment, ``Config`` and docs/configuration.md say
    about it."""

    name: str  # "call-timeout": --call-timeout, DRA_GPU_EXPORTER_CALL_TIMEOUT, Config.call_timeout
    parse: Callable[[str, str], T]  # (text, "--call-timeout") -> value; ConfigError names the flag
    default: T  # Config's default
    help: str  # --help, without the default (added)
    doc: str  # docs/configuration.md's "meaning" column (Markdown)
    metavar: str | None = None
    demo: T | None = None  # the demo's default, where it differs from the agent's
    demo_parse: Callable[[str, str], T] | None = None  # the demo's parser, where it differs
    commands: tuple[str, ...] = (AGENT, DEMO)  # the commands that take it
    switch: bool = False  # on the command line, the flag alone means true
    fields: tuple[str, ...] = ()  # Config fields a tuple value fills, in order (default: the field of its name)
    shown: str | None = None  # the default in words (Markdown), where the value does not say it
    show: Callable[[T], str] = _show  # the default as text, where _show does not do
    fallback_env: str | None = None  # read when neither the flag nor its own variable gives a value

    @property
    def option(self) -> str:
        return "--" + self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def choices(self) -> tuple[str, ...]:
        return self.parse.choices if isinstance(self.parse, Choice) else ()

    def parser(self, command: str) -> Callable[[str, str], T]:
        return self.demo_parse if command == DEMO and self.demo_parse is not None else self.parse

    def default_for(self, command: str) -> T:
        return self.demo if command == DEMO and self.demo is not None else self.default

    def assign(self, value: T) -> Iterator[tuple[str, object]]:
        """(Config field, value) pairs for ``value``."""
        if not self.fields:
            yield self.dest, value
        else:
            assert isinstance(value, tuple) and len(value) == len(self.fields), (self.name, value)
            yield from zip(self.fields, value, strict=True)

    def default_text(self, command: str) -> str:
        """The default for ``command``, plain text (for --help)."""
        if self.shown is not None:
            return self.shown.replace("`", "")
        return self.show(self.default_for(command))


_SECONDS_A_WEEK = 7 * 86400
_FLAG = "flag"  # the key of a flag's row in a Config field's metadata


def flag(name: str, parse: Callable[[str, str], T], default: T, **row: Any) -> Any:
    """A ``Config`` field that a flag sets, with the flag's row (see :class:`Flag`): the field's
    default is the flag's (for a flag that fills several fields, its first part)."""
    f = Flag(name, parse, default, **row)
    return field(default=default[0] if f.fields else default, metadata={_FLAG: f})  # type: ignore[index]


@dataclass(frozen=True)
class Config:
    """The agent's and the demo's configuration. A field that a flag sets declares the flag's row
    right here; the rows, in this order, are :data:`FLAGS` (the order of --help, of validation, with
    several bad values the first reported, and of docs/configuration.md)."""

    listen_host: str = flag(
        "listen", parse_listen, ("0.0.0.0", 9402), demo=("127.0.0.1", 9402), metavar="HOST:PORT", show=_host_port,
        fields=("listen_host", "listen_port"),
        help="address for /metrics, /healthz, /readyz",
        doc="`/metrics`, `/healthz`, `/readyz`; HOST is a host name, an IPv4 address or a bracketed IPv6 address "
        "(`[::]:9402`)",
    )
    listen_port: int = 9402  # set by --listen, with listen_host
    interval: float = flag(
        "interval", parse_interval, 5.0, demo=1.0, metavar="SECONDS",
        help="collection interval, float seconds",
        doc="collection interval (float)",
    )
    backend: str = flag(
        "backend", Choice(("auto", "nvml", "amdsmi", "sim"), _agent_backend), "auto",
        demo="sim", demo_parse=Choice(("auto", "nvml", "amdsmi", "sim"), _demo_backend),
        help="device library: auto, nvml or amdsmi; sim (simulated GPUs) is the demo's",
        doc="device library; `auto` picks what the machine has; `sim` is the demo's (the agent refuses it, exit 2; "
        "the demo refuses the others)",
    )
    taint_mode: TaintMode = flag(
        "taint-mode", Choice(tuple(m.value for m in TaintMode), TaintMode), TaintMode.ENFORCE,
        help="remediation mode",
        doc="remediation mode (see [Health and remediation](health-and-remediation.md), \"Modes\")",
    )
    log_format: str = flag(
        "log-format", Choice(("auto", "json", "console"), str), "auto",
        help="auto: JSON unless stderr is a terminal",
        doc="structured logs: JSON lines, or key=value lines for a terminal; `auto`: JSON when stderr is not a "
        "terminal",
    )
    log_level: str = flag(
        "log-level", Choice(("debug", "info", "warning", "error"), str, fold_case=True), "info",
        help="log level",
        doc="least severe level logged (the environment may write it in upper case)",
    )
    call_timeout: float = flag(
        "call-timeout", Number(0.01, 600), 2.0, metavar="SECONDS",
        help="deadline for reading one device",
        doc="deadline for reading one device; a read that misses it has no data that cycle (`gpu_up 0`, read error "
        "`late`), which alone is no fault",
    )
    per_process: bool = flag(
        "per-process", parse_bool, False, switch=True,
        help="per-process (per-pod) GPU memory; needs hostPID",
        doc="per-pod GPU memory from NVML process accounting; needs `hostPID: true`",
    )
    pod_label_allowlist: tuple[str, ...] = flag(
        "pod-label-allowlist", parse_label_allowlist, tuple[str, ...](), metavar="K1,K2",
        help="pod labels exported on dra_pod_labels",
        doc="pod labels exported on `dra_pod_labels` (opt-in cardinality)",
    )
    kubelet_device_health: bool = flag(
        "kubelet-device-health", parse_bool, False, switch=True,
        help="watch this node's pods for the kubelet's device health (KEP-4680) on dra_device_reported_health; "
        "needs pods list/watch",
        doc="watch this node's pods and export the device health the kubelet reports in their status (KEP-4680) on "
        "`dra_device_reported_health`, beside the agent's own; needs RBAC `list`/`watch` on pods "
        "(see [Deploying](deploy.md#kubelet-reported-device-health))",
    )
    exclude_metrics: frozenset[str] = flag(
        "exclude-metrics", parse_exclude_metrics, frozenset[str](), metavar="NAME,GLOB",
        help="metrics never exported, by name or shell pattern (e.g. 'dra_claim_memory_*')",
        doc="metrics never exported, by name or shell pattern (`'dra_claim_memory_*'`); a pattern that matches no "
        "metric is an error. The cardinality control: each `dra_claim_*` family costs one series per claim "
        "(see [Performance](performance.md#series-budget))",
    )
    dcgm_compat_labels: bool = flag(
        "dcgm-compat-labels", parse_bool, False, switch=True,
        help="add dcgm-exporter's pod/namespace/container/dra_* labels to device series",
        doc="add dcgm-exporter's `pod`, `namespace`, `container`, `dra_*` labels to device series (one series per "
        "holder, as dcgm-exporter does)",
    )
    taint_rate_limit: int = flag(
        "taint-rate-limit", Count(0, 1000), 2, metavar="N",
        help="new NoExecute rules per node per 10 minutes",
        doc="new NoExecute rules per node per 10 minutes (a whole number)",
    )
    taint_hold_seconds: float = flag(
        "taint-hold-seconds", Number(0, _SECONDS_A_WEEK), 1800.0, metavar="S",
        help="healthy time before a rule steps down",
        doc="healthy time before a rule steps down one level",
    )
    taint_settle_seconds: float = flag(
        "taint-settle-seconds", Number(0, 600), 2.0, metavar="S",
        help="a new fatal fault is NoSchedule this long, then NoExecute unless the node-wide test trips",
        doc="a new fatal fault gets NoSchedule at once and NoExecute after this long, unless the node-wide test trips "
        "within it (the raise waits for the longer of this and `--node-fault-window`)",
    )
    node_fault_window: float = flag(
        "node-fault-window", Number(0, 600), 2.0, metavar="S",
        help="GPU failures this close together count together for the node-wide test",
        doc="GPU failures at most this far apart count together: more than half of the node's GPUs failing within it "
        "is a node-wide fault (NoSchedule only)",
    )
    eviction_grace_seconds: float = flag(
        "eviction-grace-seconds", Number(0, _SECONDS_A_WEEK), 60.0, metavar="S",
        help="a pod still on a NoExecute device this long after its taint (and its toleration) is looked up and told "
        "in a Warning Event",
        doc="a pod still holding a device this long after the agent's NoExecute taint (after its `tolerationSeconds`, "
        "if it tolerates it) is read by name and a Warning Event `GPUEvictionOverdue` says why it stays (an "
        "extended-resource claim, a toleration, a controller)",
    )
    hung_after: float = flag(
        "hung-after", Number(0, 3600), 30.0, metavar="SECONDS",
        help="a device call stuck this long, while the agent itself gets CPU, makes the device driver_hung (fatal)",
        doc="a device call still stuck this long, while the agent itself gets CPU, makes the device `driver_hung` "
        "(fatal); `0`: at the first missed deadline",
    )
    fault_clear_seconds: float = flag(
        "fault-clear-seconds", Number(0, _SECONDS_A_WEEK), 120.0, metavar="SECONDS",
        help="a fatal fault clears this long after a GPU reset, a polled fault this long after it was last seen",
        doc="a fatal fault clears this long after a GPU reset has been observed; a polled fault (lost, hung, remap "
        "pending) this long after it was last seen",
    )
    stuck_reading_seconds: float = flag(
        "stuck-reading-seconds", Number(0, _SECONDS_A_WEEK), 600.0, metavar="SECONDS",
        help="a reading frozen this long while the GPU reports activity raises reading_stuck (degraded, never "
        "tainted); 0: off",
        doc="a reading frozen this long while the GPU reports activity (energy flat under power; profiling ratios at "
        "exactly 0 while utilization is at least 50 %) raises `reading_stuck` (degraded, never tainted); `0` turns "
        "the check off",
    )
    web_config_file: str | None = flag(
        "web-config-file", parse_web_config_file, None, metavar="PATH",
        help="TLS, client-certificate and basic-auth settings for the HTTP endpoint, in the Prometheus "
        "exporter-toolkit format",
        doc="TLS (certificates re-read when they change), client certificates, bcrypt basic auth and response headers "
        "for the HTTP endpoint, in the Prometheus exporter-toolkit's format (see "
        "[docs/deploy.md](deploy.md#tls-and-authentication)); a bad file is exit 2 with one line",
    )
    node_name: str = flag(
        "node-name", parse_node_name, "", commands=(AGENT,), metavar="NAME", fallback_env="NODE_NAME",
        shown="env `NODE_NAME`, else the host name",
        help="this node's name",
        doc="this node (pool name and slice field selector)",
    )
    kubelet_socket: str = flag(
        "kubelet-socket", parse_kubelet_socket, constants.KUBELET_SOCKET, commands=(AGENT,), metavar="PATH",
        help="PodResources socket",
        doc="PodResources API; a missing socket (or a wrong file there) is logged and retried, not fatal; only a path "
        "no socket can have is exit 2",
    )
    kubeconfig: str | None = flag(
        "kubeconfig", parse_kubeconfig, None, commands=(AGENT,), metavar="PATH",
        shown="in-cluster, then `KUBECONFIG`",
        help="kubeconfig; none found: no Kubernetes API features",
        doc="none found: runs without DRA attribution and remediation; a file that is no kubeconfig is exit 2",
    )
    scenario: str = flag(
        "scenario", parse_scenario, "mixed-node", commands=(DEMO,), metavar="FILE|NAME",
        help="scenario file (YAML or JSON) or a bundled scenario's name (see --list-scenarios)",
        doc="the demo's node: a scenario file (YAML or JSON, format in [docs/scenarios.md](scenarios.md)) or a "
        "bundled scenario by the name `--list-scenarios` prints",
    )
    time_scale: float = flag(
        "time-scale", Number(0.01, 10000), 1.0, commands=(DEMO,), metavar="X",
        help="simulated seconds per real second",
        doc="simulated seconds per real second",
    )
    # Not flags: remediation tunables that tests and benchmarks set.
    taint_rate_window: float = 600.0  # seconds: --taint-rate-limit's window
    taint_budget_max: int = 16  # domains under NoExecute when the budget ConfigMap states none
    node_failure_fraction: float = 0.5  # more than this share of a node's GPUs failing together = node fault

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"


FLAGS: tuple[Flag[Any], ...] = tuple(f.metadata[_FLAG] for f in fields(Config) if _FLAG in f.metadata)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (like every other configuration error), not
    the whole usage text followed by the message."""

    def error(self, message: str) -> NoReturn:
        # one line even when it quotes an unrecognized argument with a newline in it
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def _add_flags(p: argparse.ArgumentParser, command: str) -> None:
    for flag in FLAGS:
        if command not in flag.commands:
            continue
        text = f"{flag.help} (default {flag.default_text(command)})".replace("%", "%%")  # argparse %-formats help
        if flag.switch:
            p.add_argument(flag.option, action="store_const", const="true", help=text)
        else:
            # Values stay text here: resolve() parses the command line and the environment alike.
            p.add_argument(flag.option, metavar=flag.metavar, choices=flag.choices or None, help=text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dra-gpu-exporter",
        description="GPU metrics attributed to DRA ResourceClaims, GPU health and DeviceTaintRule remediation. "
        f"Every flag can be set as an environment variable {ENV_PREFIX}<FLAG>.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_flags(p, AGENT)
    sub = p.add_subparsers(dest="command")
    # SUPPRESS: a flag the subcommand does not see must not be reset to None by it, so
    # "dra-gpu-exporter --interval 2 demo" keeps the 2 (argparse copies subparser defaults
    # over the parent's values otherwise).
    d = sub.add_parser(
        DEMO, help="run the embedded simulated node (GPUs, kubelet, Kubernetes API)", argument_default=argparse.SUPPRESS
    )
    _add_flags(d, DEMO)
    # a question, not configuration: no environment variable, no Config field
    d.add_argument("--list-scenarios", action="store_true", help="list the bundled scenarios and exit")
    return p


def resolve(ns: argparse.Namespace) -> Config:
    """Merge flags over environment over defaults (the demo's where it has its own), and validate."""
    command = DEMO if getattr(ns, "command", None) == DEMO else AGENT
    kw: dict[str, Any] = {}
    for flag in FLAGS:
        if command not in flag.commands:
            continue  # the agent ignores --scenario, the demo --kubeconfig (before `demo`) and their variables
        text, source = _given(ns, flag)
        if text is None:
            kw.update(flag.assign(flag.default_for(command)))
            continue
        try:
            kw.update(flag.assign(flag.parser(command)(text, flag.option)))
        except ConfigError as e:
            if source is None:
                raise
            # A value from the environment is reported under its flag's name; say where it came
            # from, or the user looks for a flag that is not on the command line.
            raise ConfigError(f"{e} (from {source})") from None
    if command == AGENT and not kw["node_name"]:  # none given: the host's, as the kubelet names its node
        kw["node_name"] = socket.gethostname().lower()
    return Config(**kw)


def _given(ns: argparse.Namespace, flag: Flag[Any]) -> tuple[str | None, str | None]:
    """The flag's text and the environment variable it came from (None: the command line):
    the flag, else its DRA_GPU_EXPORTER_ variable; when both are empty, the flag's
    ``fallback_env`` (the downward API's NODE_NAME)."""
    v: str | None = getattr(ns, flag.dest, None)
    source = None
    if v is None and (v := os.environ.get(flag.env)) is not None:
        source = flag.env
    if not v and flag.fallback_env and (fv := os.environ.get(flag.fallback_env)):
        return fv, flag.fallback_env
    return v, source


# --------------------------------------------------------------------------------------------
# The configuration reference's table (tools/config_reference.py writes it into docs/configuration.md)
# --------------------------------------------------------------------------------------------


def _md_code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def readme_table() -> str:
    """The Markdown table of every flag, as docs/configuration.md shows it."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in FLAGS:
        syntax = f.metavar or "|".join(f.choices)
        flag = _md_code(f"{f.option} {syntax}" if syntax and not f.switch else f.option)
        if f.shown is not None:
            default = f.shown
        else:
            text = f.show(f.default)
            default = text if text in ("none", "off", "on") else _md_code(text)
        if f.demo is not None and f.demo != f.default:
            default += f" (demo: {_md_code(f.show(f.demo))})"
        doc = f.doc if f.commands != (DEMO,) else f"`demo` only: {f.doc}"
        rows.append(f"| {flag} | {default} | {doc} |")
    return "\n".join(rows) + "\n"
