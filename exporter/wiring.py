"""Build an Agent from a Config: the real sources for a node, the same ones the demo uses."""

from __future__ import annotations

import os
import time
from typing import Callable

import structlog

from .agent import Agent, Sources
from .config import Config, TaintMode
from .devices.base import DeviceBackend
from .devices.select import make_backend
from .health.engine import HealthPolicy
from .kubelet.client import PodResourcesClient
from .model.processes import process_memory

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
        from .remediation.engine import Remediator

        src.remediation = Remediator(cfg, api, agent.health, src.slices, clock=clock, resync=remediation_resync)
    return agent
