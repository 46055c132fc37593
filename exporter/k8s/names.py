"""Names this agent writes into the cluster. Changing any of them orphans existing rules.

They live in the k8s layer because the API clients (rules, Events, the node-state ConfigMap)
write them; the remediator uses them from here. The ValidatingAdmissionPolicy in the chart checks
the same domain, prefix and labels.
"""

from __future__ import annotations

import hashlib
import re

DOMAIN = "dra-gpu-exporter.io"
TAINT_DOMAIN = f"gpu-health.{DOMAIN}"  # taint keys: gpu-health.dra-gpu-exporter.io/<tier>
NAME_PREFIX = "dra-gpu-exporter-"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "dra-gpu-exporter"
NODE_LABEL = f"{DOMAIN}/node"
TIER_LABEL = f"{DOMAIN}/tier"
STICKY_LABEL = f"{DOMAIN}/sticky"
KILL_SWITCH_LABEL = f"{DOMAIN}/remediation"  # node label; value "disabled" stops new actions
UNMANAGED_ANNOTATION = f"{DOMAIN}/managed"  # rule annotation; "false" = hands off
UUID_ANNOTATION = f"{DOMAIN}/gpu-uuid"
REASON_ANNOTATION = f"{DOMAIN}/reason"
EVIDENCE_ANNOTATION = f"{DOMAIN}/evidence"
FIRST_SEEN_ANNOTATION = f"{DOMAIN}/first-seen"
# What a rule stands for, read back on start so a restart forgets nothing (issue 16):
TIER_ANNOTATION = f"{DOMAIN}/tier"  # the health tier the rule was written for
RESET_REQUIRED_ANNOTATION = f"{DOMAIN}/reset-required"  # "true": only an observed GPU reset clears it
GPU_ANNOTATION = f"{DOMAIN}/physical-gpu"  # the fault domain (physical GPU uuid) the rule belongs to
SCOPE_ANNOTATION = f"{DOMAIN}/scope"  # "gpu" (the whole domain) or "instance" (one MIG device)
# The node's boot (/proc/sys/kernel/random/boot_id) the rule's fault was recorded under (issue 26):
# a rule adopted under another boot has seen its GPU reset, by the reboot.
BOOT_ID_ANNOTATION = f"{DOMAIN}/boot-id"
NODE_STATE_PREFIX = "dra-gpu-exporter-node-"  # ConfigMap per node: state that outlives the process
REPORTING_CONTROLLER = f"{DOMAIN}/agent"


def rule_name(node: str, driver: str, pool: str, device: str) -> str:
    """A DNS-subdomain name, unique per (node, driver, pool, device), at most 253 characters.

    Rules are cluster-scoped, so the name must be unique cluster-wide; a hash of the full key
    keeps truncated names distinct.
    """
    digest = hashlib.sha256(f"{driver}/{pool}/{device}".encode()).hexdigest()[:10]
    body = re.sub(r"[^a-z0-9.-]+", "-", f"{node}-{device}".lower()).strip("-.")
    room = 253 - len(NAME_PREFIX) - len(digest) - 1
    return f"{NAME_PREFIX}{body[:room].rstrip('-.')}-{digest}"


def taint_key(tier: str) -> str:
    """The key of this agent's taints: one per tier."""
    return f"{TAINT_DOMAIN}/{tier}"


def label_value(s: str) -> str:
    """Squeeze ``s`` into a valid label value (<= 63 chars, alphanumeric ends)."""
    v = re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:63]
    return v.strip("_.-")


def node_state_name(node: str) -> str:
    """The per-node state ConfigMap's name (the VAP allows only the agent's own node's)."""
    return f"{NODE_STATE_PREFIX}{node}"[:253]
