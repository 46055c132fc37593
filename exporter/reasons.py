"""Remediation's vocabulary that the layers below it name: its modes and why it held back.

``TaintMode`` is what ``--taint-mode`` selects (exporter/config.py parses into it, and config sits
below remediation). ``Suppression`` holds the ``reason`` values of
``dra_gpu_exporter_taint_suppressed_total``: one enum, used by the code that counts a suppression
and by the metric's help text, so the documented values cannot drift from the ones the agent
emits. Each value is also what a ``HealthRemediationSuppressed`` Event is about. Changing a value
renames a series users alert on.
"""

from __future__ import annotations

import enum


class TaintMode(str, enum.Enum):
    OFF = "off"  # no remediation at all
    DRY_RUN = "dry-run"  # decide, log and export, never write
    SHADOW = "shadow"  # write rules with effect None (Kubernetes reports what would be evicted)
    ENFORCE = "enforce"  # write rules with the tier's effect


class Suppression(str, enum.Enum):
    BUDGET = "budget"  # cluster-wide NoExecute budget used up: effect None (NoSchedule without None)
    BUDGET_UNAVAILABLE = "budget_unavailable"  # the budget object cannot be read or updated: NoSchedule (fail safe)
    RATE_LIMIT = "rate_limit"  # too many new NoExecute rules on this node in the window: NoSchedule
    NODE_FAULT = "node_fault"  # most of the node's GPUs failed at once: NoSchedule only
    KILL_SWITCH = "kill_switch"  # the node carries the kill-switch label: no writes
    UNMANAGED = "unmanaged"  # the rule is annotated managed=false: hands off
    API_REJECTED = "api_rejected"  # the API server refused a write (admission policy, validation)
    NAME_CONFLICT = "name_conflict"  # a rule with our deterministic name exists and is not ours
    NO_API = "no_api"  # the cluster serves no DeviceTaintRule version: metrics and Events only


def documented() -> str:
    """The values, comma-separated, for help texts."""
    return ", ".join(s.value for s in Suppression)
