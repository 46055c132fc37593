"""Build an Agent from a Config: the real sources for a node, the same ones the demo uses."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from .agent import Agent, Sources
from .config import Config, TaintMode
from .devices.base import DeviceBackend
from .devices.select import make_backend
from .health.engine import HealthPolicy
from .kubelet.client import PodResourcesClient
from .model.processes import process_memory

if TYPE_CHECKING:  # the Kubernetes parts are imported only when an API is configured
    from .k8s.connection import ApiClient
    from .remediation.engine import Remediator

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
        src.remediation = build_remediator(cfg, api, agent, clock, remediation_resync)
    return agent


def agent_namespace() -> str:
    """The agent's namespace (downward API POD_NAMESPACE): where the budget and node state live."""
    return os.environ.get("POD_NAMESPACE", "").strip() or "dra-gpu-exporter"


def build_remediator(cfg: Config, api: ApiClient, agent: Agent, clock: Callable[[], float], resync: float) -> Remediator:
    """The remediator with its cluster parts: the node's rules and kill-switch label watched, the
    cluster budget object, the node's state ConfigMap."""
    # (imported here, like the other Kubernetes parts: only an agent with an API pays for them)
    from .k8s.budget import ClusterBudget
    from .k8s.watch import NodeWatch, OwnedRuleWatch
    from .remediation.engine import Remediator
    from .remediation.state import NodeState

    ns = agent_namespace()
    kw: dict[str, Any] = {"node_state": NodeState(api, ns, cfg.node_name)}
    # The budget object the installer created in the agent's namespace: read and written only
    # when a fault domain is raised to NoExecute or lowered, with optimistic concurrency.
    kw["budget"] = ClusterBudget(api, ns, taint_budget_max=cfg.taint_budget_max)
    # This node's rules and its kill-switch label are watched (node-scoped selectors), not polled.
    kw["node_watch"] = NodeWatch(api, cfg.node_name)
    kw["owned_rules"] = lambda version: OwnedRuleWatch(api, cfg.node_name, version)
    return Remediator(cfg, api, agent.health, agent.src.slices, clock=clock, resync=resync, **kw)
