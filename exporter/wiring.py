"""Build an Agent from a Config: the real sources for a node, the same ones the demo uses."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from .agent import Agent, Sources
from .config import Config, TaintMode
from .devices.base import DeviceBackend
from .devices.select import make_backend
from .health.engine import HealthPolicy
from .kubelet.client import PodResourcesClient
from .model.processes import process_memory

if TYPE_CHECKING:  # the Kubernetes parts are imported only when an API is configured
    from .health.engine import HealthEngine
    from .k8s.connection import ApiClient
    from .k8s.taintrules import TaintRuleClient
    from .remediation.boot import BootIdentity
    from .remediation.budget import Budget
    from .remediation.engine import Remediator
    from .remediation.policy import RemediationPolicy
    from .remediation.ports import KillSwitch, RuleFeed

log = structlog.get_logger(__name__)


def build_agent(
    cfg: Config,
    backend: DeviceBackend | None = None,
    clock: Callable[[], float] = time.time,
    health_policy: HealthPolicy | None = None,
    remediation_resync: float = 30.0,
) -> Agent:
    backend = backend or make_backend(cfg.backend)
    src = Sources(backend=backend, kubelet=PodResourcesClient(cfg.kubelet_socket))
    api = None
    if cfg.kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST") or os.environ.get("KUBECONFIG"):
        # The kubernetes client costs a quarter of the start-up imports: only load it when
        # connect() has a configuration to try (its own checks decide; this only skips the
        # import when none of its sources is set).
        from .k8s.connection import connect

        api = connect(cfg.kubeconfig)
    if api is None:
        log.warning("no_kubernetes_api", hint="no kubeconfig and not in a cluster: DRA attribution and remediation are off")
    else:
        from .k8s.claims import ClaimCache
        from .k8s.pods import NodePods
        from .k8s.slices import SliceWatcher

        src.slices = SliceWatcher(api, cfg.node_name)
        src.claims = ClaimCache(api)
        if cfg.per_process or cfg.pod_label_allowlist:
            src.pods = NodePods(api, cfg.node_name)
    if cfg.per_process:
        src.processes = process_memory
    agent = Agent(cfg, src, clock=clock, health_policy=health_policy)
    if api is not None and cfg.taint_mode != TaintMode.OFF:
        src.remediation = build_remediator(cfg, api, agent.health, clock, remediation_resync)
    return agent


def agent_namespace() -> str:
    """The agent's namespace (downward API POD_NAMESPACE): where the budget and node state live."""
    return os.environ.get("POD_NAMESPACE", "").strip() or "dra-gpu-exporter"


def remediation_policy(cfg: Config, resync: float = 30.0) -> RemediationPolicy:
    """What the remediator is told, from the agent's flags (it never sees the whole Config)."""
    from .remediation.policy import RemediationPolicy

    return RemediationPolicy(
        node=cfg.node_name, mode=cfg.taint_mode, hold=cfg.taint_hold_seconds, settle=cfg.taint_settle_seconds,
        node_fault_window=cfg.node_fault_window, node_failure_fraction=cfg.node_failure_fraction, rate_limit=cfg.taint_rate_limit,
        rate_window=cfg.taint_rate_window, interval=cfg.interval, resync=resync,
    )


def build_remediator(
    cfg: Config,
    api: ApiClient,
    health: HealthEngine,
    clock: Callable[[], float] = time.time,
    resync: float = 30.0,
    *,
    watch: bool = True,
    rules: TaintRuleClient | None = None,
    budget: Budget | None = None,
    boot: BootIdentity | None = None,
    node_state: bool = True,
) -> Remediator:
    """The remediator with its cluster parts: this node's rules and kill-switch label watched
    (``watch``; without, listed and read every ``resync`` s: a rig's "not seen yet"), the cluster
    budget object (or ``budget``), the node's state ConfigMap, the node's boot identity (read
    from procfs unless given)."""
    # (imported here, like the other Kubernetes parts: only an agent with an API pays for them)
    from .k8s.budget import ClusterBudget
    from .k8s.events import EventRecorder
    from .k8s.feeds import ListedRules, PolledKillSwitch, WatchedKillSwitch, WatchedRules
    from .k8s.nodestate import NodeState
    from .k8s.pods import PodFacts
    from .k8s.taintrules import TaintRuleClient
    from .remediation.boot import read_boot_identity
    from .remediation.engine import Remediator

    ns, node = agent_namespace(), cfg.node_name
    rules = rules or TaintRuleClient(api)
    feed: RuleFeed = WatchedRules(api, node, rules) if watch else ListedRules(rules, node, resync)
    kill: KillSwitch = WatchedKillSwitch(api, node) if watch else PolledKillSwitch(api, node, resync)
    # The budget object the installer created in the agent's namespace: read (through a watch by
    # name) only while a fault domain wants a slot, written with optimistic concurrency.
    budget = budget or ClusterBudget(api, ns, taint_budget_max=cfg.taint_budget_max, clock=clock)
    return Remediator(
        remediation_policy(cfg, resync), health, rules, EventRecorder(api, node), feed, kill, budget,
        node_state=NodeState(api, ns, node) if node_state else None, boot=boot or read_boot_identity(), clock=clock,
        pods=PodFacts(api),
    )
