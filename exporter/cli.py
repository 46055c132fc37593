"""Entry point: ``dra-gpu-exporter [flags]`` runs the agent, ``dra-gpu-exporter demo`` the simulated node."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from importlib.metadata import entry_points
from typing import Protocol, cast

import structlog

from . import __version__
from .config import Config, ConfigError, build_parser, check_kubelet_socket, resolve
from .logs import configure
from .text import one_line

log = structlog.get_logger("exporter")


def _fail(msg: str, code: int = 2) -> int:
    print(f"dra-gpu-exporter: error: {msg}", file=sys.stderr)
    return code


# The simulator (package ``drasim``) is a separate package of the same distribution that depends on
# the product, never the reverse: it registers the ``demo`` subcommand under this entry-point group
# and the product finds it by name. The container image leaves the simulator out.
DEMO_GROUP = "dra_gpu_exporter.commands"


class DemoCommand(Protocol):
    """What the ``demo`` entry point provides (``drasim.demo``)."""

    def list_scenarios(self) -> int: ...

    def run_demo(self, cfg: Config) -> int: ...


def load_demo() -> DemoCommand | str:
    """The registered ``demo`` command, or why there is none (one line for the user)."""
    found = entry_points(group=DEMO_GROUP, name="demo")
    if not found:
        return (
            "the demo needs the simulator package (drasim), which this installation does not register; "
            "install dra-gpu-exporter with pip (the container image leaves the simulator out), "
            "or in a source checkout re-run `pip install -e .`"
        )
    ep = next(iter(found))
    try:
        return cast(DemoCommand, ep.load())
    except ImportError as e:
        return (f"the demo needs the simulator package (drasim), which is not installed here ({e}); the container "
                "image leaves it out: run the demo from `pip install dra-gpu-exporter`")



def check_web_config(cfg: Config) -> str | None:
    """One line saying what is wrong with --web-config-file, or None (also when there is none)."""
    if not cfg.web_config_file:
        return None
    from .metrics.webconfig import WebConfigError, load_web_config

    try:
        load_web_config(cfg.web_config_file)
    except WebConfigError as e:
        return one_line(f"--web-config-file {cfg.web_config_file}: {e}")
    return None


# The DaemonSet's terminationGracePeriodSeconds is 10: the process must be gone before the
# kubelet's SIGKILL, whatever part of the shutdown hangs (a wedged driver call, a blocked stderr).
EXIT_DEADLINE = 8.0


def stop_on_signals(done: threading.Event, exit_deadline: float | None = None) -> None:
    """Set ``done`` on SIGINT or SIGTERM (the kubelet stops pods with SIGTERM). Main thread only.

    With ``exit_deadline``, a clean stop gets that many seconds; then, or at a second signal, the
    process ends at once. ``done`` is set before anything that can block (logging to a stalled
    stderr)."""

    def handler(signum: int, frame: object) -> None:
        if done.is_set() and exit_deadline is not None:
            os._exit(1)  # a second signal: the user means it
        done.set()
        if exit_deadline is not None:
            watchdog = threading.Timer(exit_deadline, os._exit, (1,))
            watchdog.daemon = True
            watchdog.start()
        log.info("signal_received", signal=signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    # The simulated kubelet's gRPC core (demo) logs to stderr by itself; our logs say what matters.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    ns = parser.parse_args(argv)
    demo: DemoCommand | None = None
    if ns.command == "demo":
        found = load_demo()
        if isinstance(found, str):
            return _fail(found)
        demo = found
        if getattr(ns, "list_scenarios", False):
            return demo.list_scenarios()
    try:
        cfg = resolve(ns)
    except ConfigError as e:
        return _fail(str(e))
    if (problem := check_web_config(cfg)) is not None:
        return _fail(problem)
    configure(cfg.log_format, cfg.log_level)
    if demo is not None:
        return demo.run_demo(cfg)
    return run_agent(cfg)


def settle_heap() -> None:
    """Take what start-up built (modules, classes, the first cycle's caches: ~70,000 objects
    that live as long as the process) out of the cyclic garbage collector's reach. Its full
    collections then scan only what later cycles allocate: on the dense bench node one took
    ~50 ms, every ~20 cycles (a quarter of a percent of a core at a 1 s interval)."""
    gc.collect()
    gc.freeze()


def run_agent(cfg: Config) -> int:
    from .wiring import build_agent

    log.info("starting", version=__version__, node=cfg.node_name, backend=cfg.backend, taint_mode=cfg.taint_mode.value)
    # The kubelet client rides these out (retries with backoff, device metrics keep flowing,
    # the kubelet collector reports the failure): say so once, do not refuse to start.
    problem = check_kubelet_socket(cfg.kubelet_socket)
    if problem == "missing":
        log.warning("kubelet_socket_missing", socket=cfg.kubelet_socket,
                    hint="waiting for the kubelet; device metrics are served meanwhile")
    elif problem:
        log.warning("kubelet_socket_problem", socket=cfg.kubelet_socket, problem=problem,
                    hint="retrying; pod attribution is off until it is fixed")
    try:
        agent = build_agent(cfg)
        agent.start()
    except Exception as e:  # start-up problems are the user's to fix: say what, not where
        log.error("start_failed", error=str(e))
        return _fail(str(e), 1)
    settle_heap()
    done = threading.Event()
    stop_on_signals(done, EXIT_DEADLINE)
    try:
        done.wait()
    finally:
        agent.stop()
        log.info("stopped")
    return 0
