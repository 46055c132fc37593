"""Composition: the one place that builds the agent's parts and says how they connect.

``compose`` builds the health engine, the starvation probe, the sources (each behind its
collector, in cycle order), one shared API ``Discovery``, the outputs (renderer, billing
counters, remediator, the HTTP endpoint's factory) and hands the agent immutable ``Sources``
and ``Outputs``; nothing reaches back into a built object. ``build_agent`` is ``compose`` for a
real node: the kubelet's socket, the API server the configuration names, the flag's backend.

Adding a source is one new module (the source and its ``Collector``, beside each other) and one
line below, where the collectors are listed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import structlog

from .agent import Agent, Outputs, Sources
from .clock import SYSTEM, Clock
from .collect import Collector
from .config import Config, TaintMode
from .devices.base import DeviceBackend
from .devices.collector import DeviceCollector
from .devices.select import make_backend
from .health.engine import HealthEngine, HealthPolicy
from .health.starvation import StarvationMonitor
from .kubelet.client import PodResourcesClient
from .kubelet.collector import KubeletCollector, PodResources
from .metrics.render import Renderer
from .metrics.server import MetricsServer
from .metrics.webconfig import load_web_config
from .model.inputs import NeededClaims
from .model.processes import ProcessCollector
from .model.usage import UsageAccountant

if TYPE_CHECKING:  # the Kubernetes parts are imported only when an API is configured
    from .k8s.connection import ApiClient
    from .k8s.discovery import Discovery
    from .k8s.taintrules import TaintRuleClient
    from .remediation.adoption import BootIdentity
    from .remediation.contract import Budget, KillSwitch, RemediationPolicy, RuleFeed
    from .remediation.engine import Remediator

log = structlog.get_logger(__name__)


def build_agent(
    cfg: Config,
    backend: DeviceBackend | None = None,
    clock: Clock = SYSTEM,
    health_policy: HealthPolicy | None = None,
    remediation_resync: float = 30.0,
) -> Agent:
    """The agent of a real node: ``cfg``'s backend (or ``backend``), the kubelet at
    ``cfg.kubelet_socket``, the API server ``cfg`` or the environment names (none: no DRA
    attribution, no remediation)."""
    api = None
    if cfg.kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST") or os.environ.get("KUBECONFIG"):
        # The kubernetes client costs a quarter of the start-up imports: only load it when
        # connect() has a configuration to try (its own checks decide; this only skips the
        # import when none of its sources is set).
        from .k8s.connection import connect

        api = connect(cfg.kubeconfig)
    if api is None:
        log.warning("no_kubernetes_api",
                    hint="no kubeconfig and not in a cluster: DRA attribution and remediation are off")
    return compose(cfg, backend or make_backend(cfg.backend), kubelet=PodResourcesClient(cfg.kubelet_socket), api=api,
                   clock=clock, health_policy=health_policy, remediation_resync=remediation_resync)


def compose(
    cfg: Config,
    backend: DeviceBackend,
    *,
    kubelet: PodResources | None = None,
    api: ApiClient | None = None,
    clock: Clock = SYSTEM,
    health_policy: HealthPolicy | None = None,
    remediation_resync: float = 30.0,
) -> Agent:
    """The agent from its parts: ``backend`` always; the kubelet's PodResources and the API
    server when given (tests and rigs leave them out)."""
    health = HealthEngine(clock, health_policy or HealthPolicy(clear_hold=cfg.fault_clear_seconds,
                                                               stuck_after=cfg.stuck_reading_seconds))
    # The agent's own CPU starvation is told apart from stuck device calls: a lag of half a
    # deadline is starvation, and one keeps the agent "starved" long enough for a call that
    # was only slow to come back once the agent runs again.
    starvation = StarvationMonitor(threshold=max(0.05, cfg.call_timeout / 2), window=max(10.0, 5 * cfg.call_timeout))
    devices = DeviceCollector(backend, health, starvation, call_timeout=cfg.call_timeout, hung_after=cfg.hung_after)
    discovery = _discovery(api)
    # The sources after the devices, in cycle order (a collector reads what those before it
    # found): one line each.
    collectors: list[Collector[object]] = []
    if kubelet is not None:
        collectors.append(KubeletCollector(kubelet))
    if api is not None and discovery is not None:
        collectors += _api_collectors(cfg, api, discovery)
    after_join: list[Collector[object]] = [ProcessCollector()] if cfg.per_process else []
    remediation = None
    if api is not None and cfg.taint_mode != TaintMode.OFF:
        remediation = build_remediator(cfg, api, health, clock, remediation_resync, discovery=discovery)
    outputs = Outputs(
        health=health, starvation=starvation, renderer=Renderer(), usage=UsageAccountant(),
        # opened by Agent.start (serve=True) with the agent's probes, before the sources start
        serve=lambda ready, alive: MetricsServer(
            cfg.listen_host, cfg.listen_port, ready, liveness=alive,
            web_config=load_web_config(cfg.web_config_file) if cfg.web_config_file else None,
        ),
        remediation=remediation,
    )
    return Agent(cfg, Sources(devices, tuple(collectors), tuple(after_join)), outputs, clock=clock)


def _discovery(api: ApiClient | None) -> Discovery | None:
    """One cache of the API server's discovery answers for every part that asks (slices,
    claims, DeviceTaintRules): they change only on control-plane upgrades."""
    if api is None:
        return None
    from .k8s.discovery import Discovery

    return Discovery(api)


def _api_collectors(cfg: Config, api: ApiClient, discovery: Discovery) -> list[Collector[object]]:
    """The Kubernetes API's sources: this node's ResourceSlices (watched), the claims its pods
    hold that the join needs (fetched, see NeededClaims), its Pods (listed, when labels or per-process
    attribution want them; watched with --kubelet-device-health)."""
    # (imported here: only an agent with an API server pays for the kubernetes client)
    from .k8s.claims import ClaimCache
    from .k8s.collectors import ClaimCollector, PodCollector, SliceCollector
    from .k8s.podhealth import PodWatcher, ReportedHealthCollector
    from .k8s.pods import NodePods
    from .k8s.slices import SliceWatcher

    # API calls made inside a cycle get deadline lanes of their own, like device calls: a slow
    # or black-holed API server (30 s read timeout per request) must not stall the cycle.
    deadline = max(cfg.call_timeout, 0.5)
    out: list[Collector[object]] = [
        SliceCollector(SliceWatcher(api, cfg.node_name, discovery=discovery)),
        ClaimCollector(ClaimCache(api, discovery=discovery), NeededClaims(every=cfg.kubelet_device_health), deadline),
    ]
    # The kubelet's device health comes from a watch of the node's pods, which then also serves
    # labels and per-process attribution (one read of the pods, not a list beside a watch).
    watched = PodWatcher(api, cfg.node_name) if cfg.kubelet_device_health else None
    pods = bool(cfg.per_process or cfg.pod_label_allowlist)
    if pods:
        out.append(PodCollector(watched or NodePods(api, cfg.node_name), deadline))
    if watched is not None:
        out.append(ReportedHealthCollector(watched, counted=not pods))
    return out


def agent_namespace() -> str:
    """The agent's namespace (downward API POD_NAMESPACE): where the budget and node state live."""
    return os.environ.get("POD_NAMESPACE", "").strip() or "dra-gpu-exporter"


def remediation_policy(cfg: Config, resync: float = 30.0) -> RemediationPolicy:
    """What the remediator is told, from the agent's flags (it never sees the whole Config)."""
    from .remediation.contract import RemediationPolicy

    return RemediationPolicy(
        node=cfg.node_name, mode=cfg.taint_mode, hold=cfg.taint_hold_seconds, settle=cfg.taint_settle_seconds,
        node_fault_window=cfg.node_fault_window, node_failure_fraction=cfg.node_failure_fraction,
        rate_limit=cfg.taint_rate_limit,
        rate_window=cfg.taint_rate_window, interval=cfg.interval, resync=resync,
        eviction_grace=cfg.eviction_grace_seconds,
    )


def build_remediator(
    cfg: Config,
    api: ApiClient,
    health: HealthEngine,
    clock: Clock = SYSTEM,
    resync: float = 30.0,
    *,
    watch: bool = True,
    rules: TaintRuleClient | None = None,
    budget: Budget | None = None,
    boot: BootIdentity | None = None,
    node_state: bool = True,
    discovery: Discovery | None = None,
) -> Remediator:
    """The remediator with its cluster parts: this node's rules and kill-switch label watched
    (``watch``; without, listed and read every ``resync`` s: a rig's "not seen yet"), the cluster
    budget object (or ``budget``), the node's state ConfigMap, the node's boot identity (read
    from procfs unless given)."""
    # (imported here, like the other Kubernetes parts: only an agent with an API pays for them)
    from .k8s.budget import ClusterBudget
    from .k8s.claims import ClaimCache
    from .k8s.discovery import Discovery
    from .k8s.events import EventRecorder
    from .k8s.feeds import ListedRules, PolledKillSwitch, WatchedKillSwitch, WatchedRules
    from .k8s.nodestate import NodeState
    from .k8s.pods import PodFacts
    from .k8s.taintrules import TaintRuleClient
    from .remediation.adoption import read_boot_identity
    from .remediation.engine import Remediator

    ns, node = agent_namespace(), cfg.node_name
    discovery = discovery or Discovery(api)  # a remediator built alone (a rig): one of its own
    rules = rules or TaintRuleClient(api, discovery)
    feed: RuleFeed = WatchedRules(api, node, rules) if watch else ListedRules(rules, node, resync)
    kill: KillSwitch = WatchedKillSwitch(api, node) if watch else PolledKillSwitch(api, node, resync)
    # The budget object the installer created in the agent's namespace: read (through a watch by
    # name) only while a fault domain wants a slot, written with optimistic concurrency.
    budget = budget or ClusterBudget(api, ns, taint_budget_max=cfg.taint_budget_max, clock=clock)
    return Remediator(
        remediation_policy(cfg, resync), health, rules, EventRecorder(api, node, clock), feed, kill, budget,
        node_state=NodeState(api, ns, node) if node_state else None, boot=boot or read_boot_identity(), clock=clock,
        pods=PodFacts(api, claims=lambda: ClaimCache(api, discovery=discovery)),
    )
