"""XID classification: which tier an NVIDIA XID puts a GPU in.

Tiers follow NVIDIA's XID catalog resolution buckets (RESET_GPU / RESTART_BM are fatal or
degraded, RESTART_APP / IGNORE informational;
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), DCGM's health-watch
FAIL list (https://github.com/NVIDIA/DCGM/blob/master/modules/health/DcgmHealthWatch.cpp), and
the XIDs the device plugin treats as application errors, 13, 31, 43, 45, 68 and 109
(https://github.com/NVIDIA/k8s-device-plugin/blob/main/internal/rm/health.go).
"""

from __future__ import annotations

from .model import Scope, Tier

# The device is unusable or data is at risk: reset or power cycle needed.
FATAL_XIDS = frozenset({48, 64, 79, 95, 119, 120, 140, 143})
# Unreliable, needs a reset soon: stop placing new work there.
DEGRADED_XIDS = frozenset({46, 62, 74, 109, 110, 136, 155, 156, 158} | set(range(144, 151)))
# Application-level or benign: a bad kernel, a page fault in user code, bookkeeping events.
INFORMATIONAL_XIDS = frozenset({13, 31, 43, 45, 63, 68, 69, 92, 94, 154})


def classify_xid(xid: int) -> Tier:
    if xid in FATAL_XIDS:
        return Tier.FATAL
    if xid in DEGRADED_XIDS:
        return Tier.DEGRADED
    # Unknown XIDs are informational: tainting on a code we cannot interpret would evict
    # workloads on guesswork. Repeats still escalate (see HealthPolicy).
    return Tier.INFORMATIONAL


# XIDs about hardware every MIG instance shares (the bus, the GSP, memory ECC and row
# remapping, NVLink, the recovery action): they take the whole GPU down even when NVML
# attaches a GPU/compute instance id to the event. NVML attributes an XID to an instance only
# when it can (nvmlEventData_t: "If MIG is enabled and nvmlEventTypeXidCriticalError event is
# attributable to a GPU instance, stores a valid GPU instance ID", else 0xFFFFFFFF); every XID
# in the fatal or degraded tier is GPU-wide by its meaning in NVIDIA's XID catalog
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: RESET_GPU / RESTART_BM
# buckets), as are 63 (row remap / page retirement recorded), 92 (high single-bit ECC rate) and
# 154 (the GPU's recovery action changed).
GPU_WIDE_XIDS = FATAL_XIDS | DEGRADED_XIDS | frozenset({63, 92, 154})


def xid_scope(xid: int) -> Scope:
    """What an XID that NVML attributed to a MIG instance takes down.

    Application-class XIDs (13, 31, 43, 45, 68, 69, 94 contained ECC, unknown codes) stay on
    the instance they were attributed to: the MIG fault-isolation boundary contains them, and
    NVIDIA's own DRA driver books them on the MIG device resolved from (GPU, GI, CI).
    """
    return Scope.GPU if xid in GPU_WIDE_XIDS else Scope.INSTANCE
