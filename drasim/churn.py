"""A batch node that churns: short jobs (one pod, one DRA claim, new names and UIDs each time)
arriving on a simulated node's GPUs at a rate and leaving after a hold, through the same two
peers the agent reads (the kubelet's PodResources answer and the API emulation's claims and
pods; a job that left is deleted from the API as a real one is).

    churn = Churn(node, per_step=4, hold_steps=3)
    for _ in range(n):
        churn.step()            # a step is one agent interval: 4 new jobs, the jobs of 3 steps ago go
        node.agent.run_cycle()
"""

from __future__ import annotations

import dataclasses
from collections import deque

from . import objects
from .node import SimulatedNode
from .scenario import ClaimSpec, ContainerSpec, PodSpec

NAMESPACE = "batch"


@dataclasses.dataclass
class Job:
    claim: str
    pod: str
    gpu: str
    started: int  # the step it arrived at
    left: int | None = None  # the step it was gone at


class Churn:
    """See the module doc. ``per_step`` jobs arrive per step on the scenario's full GPUs in turn,
    each holding one for ``hold_steps`` steps. Every job ever started is in ``jobs``."""

    def __init__(self, node: SimulatedNode, per_step: int, hold_steps: int) -> None:
        self.node, self.per_step, self.hold_steps = node, per_step, hold_steps
        self.gpus = [g.name for g in node.scenario.gpus if not g.mig]
        self.steps = 0
        self.jobs: list[Job] = []
        self._live: deque[Job] = deque()
        self._base = node.scenario  # the scenario's own claims and pods stay as they are

    def step(self) -> None:
        """One interval: the jobs whose hold is over leave, ``per_step`` new ones arrive."""
        api, ns = self.node.api, NAMESPACE
        while self._live and self.steps - self._live[0].started >= self.hold_steps:
            job = self._live.popleft()
            job.left = self.steps
            api.delete("resource.k8s.io", "resourceclaims", job.claim, ns)
            api.delete("", "pods", job.pod, ns)
        new = []
        for _ in range(self.per_step):
            n = len(self.jobs)
            new.append(Job(claim=f"job-{n}", pod=f"job-{n}-pod", gpu=self.gpus[n % len(self.gpus)], started=self.steps))
            self.jobs.append(new[-1])
        self._live += new
        base = self._base
        sc = dataclasses.replace(base, claims=base.claims + tuple(ClaimSpec(ns, j.claim, (j.gpu,)) for j in self._live))
        pods = [PodSpec(ns, j.pod, (ContainerSpec("main", claims=(j.claim,)),)) for j in self._live]
        new_pods = pods[len(pods) - len(new):]
        fresh = dataclasses.replace(base, claims=sc.claims[len(sc.claims) - len(new):])
        for obj in [*objects.resource_claims(fresh, new_pods), *(objects.pod_object(sc, p) for p in new_pods)]:
            api.apply(obj)
        self.node.scenario = sc
        self.node.kubelet.set_pods(objects.kubelet_pods(sc, [*base.pods, *pods]))
        self.steps += 1
