"""What the remediator is told to do: the numbers of its rails and timers, as plain data.

Built from the agent's flags by :func:`exporter.wiring.remediation_policy`; the remediator never
sees the whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TaintMode


@dataclass(frozen=True)
class RemediationPolicy:
    node: str
    mode: TaintMode = TaintMode.ENFORCE
    hold: float = 1800.0  # healthy time before a rule steps down one level (--taint-hold-seconds)
    settle: float = 2.0  # a new fatal fault is NoSchedule this long before NoExecute
    node_fault_window: float = 2.0  # failures this close together are judged together
    node_failure_fraction: float = 0.5  # more than this share of the node's GPUs: a node fault
    rate_limit: int = 2  # new NoExecute fault domains per node per rate window
    rate_window: float = 600.0
    interval: float = 5.0  # seconds between passes while something is watched over (at most QUIET_PASS)
    resync: float = 30.0  # seconds between passes while the node is quiet
    refused_retry: float = 300.0  # a write the API server refused is asked again after this
    # a pod still on a NoExecute device this long after the taint (plus its toleration, or its
    # deletion) is looked at and told in a Warning Event (exporter.remediation.evictions)
    eviction_grace: float = 60.0

    @property
    def dry_run(self) -> bool:
        return self.mode == TaintMode.DRY_RUN
