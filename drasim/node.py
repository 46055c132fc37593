"""One simulated node: the rig behind the demo, the tests and the benchmarks.

A scenario's GPUs through the simulated device backend, a real gRPC PodResources server on a
unix socket (``FakeKubelet``), the in-process Kubernetes API over real HTTP (``FakeApiServer``)
holding the node's Node, ResourceSlice, ResourceClaims and Pods, a kubeconfig pointing at it,
and the agent built by the production wiring (``exporter.wiring.build_agent``) around them.
Only the device backend is simulated; everything the agent talks to speaks the real protocol.

    with SimulatedNode(scenario, SimClock(20.0)) as node:
        node.start()                      # API server + kubelet up, the scenario's objects stored
        agent = node.start_agent(interval=0.1, taint_mode=TaintMode.ENFORCE)
        ...

``stop()`` (or leaving the ``with``) stops the agent, the kubelet and the API server and removes
the temporary directory.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from exporter.agent import Agent
from exporter.config import Config
from exporter.health.engine import HealthPolicy
from exporter.wiring import build_agent

from . import objects
from .apiserver import FakeApiServer
from .apiserver_faults import LOG_LIMIT
from .backend import SimBackend, SimClock
from .kubelet import KUBELET_QPS, FakeKubelet
from .scenario import PodSpec, Scenario


def write_kubeconfig(path: str | Path, url: str, token: str = "test-token", namespace: str = "default",
                     context: str = "sim") -> Path:
    """A kubeconfig with one cluster/user/context pointing at ``url`` with a bearer token."""
    path = Path(path)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
        "current-context": context,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def publish_scenario(api: FakeApiServer, sc: Scenario, pods: Iterable[PodSpec] | None = None) -> None:
    """Store what the cluster holds for a scenario's node: the agent's namespace and budget
    object (as the Helm chart installs them), the Node, its ResourceSlice, and the claims and Pod
    objects of ``pods`` (default: every pod, as if all were running)."""
    live = list(sc.pods if pods is None else pods)
    for obj in objects.agent_namespace_objects():
        api.apply(obj)
    api.apply(objects.node(sc))
    api.apply(objects.resource_slice(sc))
    for c in objects.resource_claims(sc, live):
        api.apply(c)
    for pod in live:
        api.apply(objects.pod_object(sc, pod))


class SimulatedNode:
    """See the module docstring. Not thread-safe: one owner drives it (the demo's main thread,
    a test, a benchmark)."""

    def __init__(
        self,
        scenario: Scenario,
        clock: SimClock | None = None,
        *,
        kubernetes_version: str = "1.37",
        bookmark_interval: float = 1.0,
        request_log_size: int = LOG_LIMIT,
        kubelet_qps: float | None = KUBELET_QPS,
        workdir: Path | None = None,
    ) -> None:
        self.scenario = scenario
        self.clock = clock or SimClock(1.0)
        # A short directory by default: a unix socket path is limited to 107 bytes.
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="dra-node-")) if workdir is None else workdir
        self.socket = str(self.workdir / "kubelet.sock")
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubelet = FakeKubelet(self.socket, qps=kubelet_qps)
        self.api = FakeApiServer(kubernetes_version, bookmark_interval=bookmark_interval,
                                 request_log_size=request_log_size)
        self.backend = SimBackend(scenario, self.clock)
        self.agent: Agent | None = None

    # -- the cluster around the agent ------------------------------------------------------------

    def start(self, *, pods: Iterable[PodSpec] | None = None, start_kubelet: bool = True,
              api_setup: Callable[[FakeApiServer], None] | None = None) -> None:
        """Start the API server (and the kubelet unless ``start_kubelet`` is False) with the
        scenario's objects: ``pods`` running (default all of them). ``api_setup`` runs on the
        started API server before the agent exists (faults, validators)."""
        url = self.api.start()
        write_kubeconfig(self.kubeconfig, url)
        live = list(self.scenario.pods if pods is None else pods)
        publish_scenario(self.api, self.scenario, live)
        self.kubelet.set_pods(objects.kubelet_pods(self.scenario, live))
        if start_kubelet:
            self.kubelet.start()
        if api_setup is not None:
            api_setup(self.api)

    def set_pods(self, pods: Iterable[PodSpec]) -> None:
        """What the kubelet reports and the claims the API server holds, changed together."""
        live = list(pods)
        self.kubelet.set_pods(objects.kubelet_pods(self.scenario, live))
        for c in objects.resource_claims(self.scenario, live):
            self.api.apply(c)

    def uuid(self, ref: str) -> str:
        """The device uuid of a scenario reference (``gpu1``, ``m0:3g.40gb:0``)."""
        return objects.device_uuid(self.scenario, ref)

    def device_name(self, ref: str) -> str:
        """The DRA device name of a scenario reference, as in the ResourceSlice."""
        return objects.device_name(self.scenario, ref)

    # -- the agent -------------------------------------------------------------------------------

    def config(self, **overrides: Any) -> Config:
        """A Config for an agent on this node (loopback listener on a free port); ``overrides``
        are Config fields."""
        base: dict[str, Any] = dict(
            listen_host="127.0.0.1", listen_port=0, node_name=self.scenario.node, kubelet_socket=self.socket,
            kubeconfig=str(self.kubeconfig), backend="sim",
        )
        base.update(overrides)
        return Config(**base)

    def build_agent(self, cfg: Config | None = None, *, health_policy: HealthPolicy | None = None,
                    remediation_resync: float = 30.0, **overrides: Any) -> Agent:
        """The agent, built by the production wiring around this node's peers, not started.
        ``cfg`` (e.g. the demo's own) is pointed at this node; otherwise ``config(**overrides)``."""
        if cfg is None:
            cfg = self.config(**overrides)
        else:
            cfg = dataclasses.replace(cfg, node_name=self.scenario.node, kubelet_socket=self.socket,
                                      kubeconfig=str(self.kubeconfig), **overrides)
        self.agent = build_agent(cfg, backend=self.backend, clock=self.clock, health_policy=health_policy,
                                 remediation_resync=remediation_resync)
        return self.agent

    def start_agent(self, cfg: Config | None = None, *, serve: bool = True, health_policy: HealthPolicy | None = None,
                    remediation_resync: float = 30.0, **overrides: Any) -> Agent:
        """``build_agent`` and start it (``serve``: its HTTP server too)."""
        agent = self.build_agent(cfg, health_policy=health_policy, remediation_resync=remediation_resync, **overrides)
        agent.start(serve=serve)
        return agent

    # -- lifecycle -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop whatever runs (agent first: it must not see its peers vanish mid-cycle as a fault
        worth logging) and remove the temporary directory. Safe to call twice."""
        try:
            if self.agent is not None:
                self.agent.stop()
                self.agent = None
        finally:
            self.kubelet.stop()
            self.api.stop()
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SimulatedNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
