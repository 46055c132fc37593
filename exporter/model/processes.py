"""Per-process GPU memory -> pods, through /proc/<pid>/cgroup.

NVML reports host PIDs (the driver ignores PID namespaces), so this needs the agent to run with
``hostPID: true``. A PID's cgroup path carries the pod UID (``.../pod<uid>/...`` with cgroupfs,
``...-pod<uid_with_underscores>.slice`` with systemd); matching it against the UIDs of this
node's pods names the pod. A PID we cannot map is counted under an empty pod, never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from ..collect import Collector, Gathered, Slot
from .snapshot import SNAPSHOT, Snapshot

_POD_UID_RE = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})"
)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in a /proc/<pid>/cgroup file's content, or None (not a pod's process)."""
    for line in text.splitlines():
        m = _POD_UID_RE.search(line)
        if m:
            return m.group(1).replace("_", "-").lower()
    return None


def pid_pod_uid(pid: int, proc_root: str = "/proc") -> str | None:
    try:
        return pod_uid_from_cgroup(Path(proc_root, str(pid), "cgroup").read_text())
    except OSError:
        return None  # the process ended, or /proc is not the host's


def process_memory(snap: Snapshot, proc_root: str = "/proc") -> dict[tuple[str, str, str], int]:
    """(uuid, namespace, pod) -> bytes, summed over each pod's processes on each device."""
    uids: Mapping[str, tuple[str, str]] = snap.pod_uids
    out: dict[tuple[str, str, str], int] = {}
    for d in snap.devices:
        r = d.reading
        if r is None or not r.ok:
            continue
        for pid, used in r.processes.items():
            uid = pid_pod_uid(pid, proc_root)
            ns, pod = uids.get(uid, ("", "")) if uid else ("", "")
            key = (d.uuid, ns, pod)
            out[key] = out.get(key, 0) + (used or 0)
    return out


ProcessMemory = Mapping[tuple[str, str, str], int]  # (uuid, namespace, pod) -> bytes
PROCESSES: Slot[ProcessMemory] = Slot("processes")


class ProcessCollector(Collector[ProcessMemory]):
    """Per-process attribution (``--per-process``): runs after the join, on its snapshot (the
    processes the device library reported, and the node's pod UIDs)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        super().__init__(PROCESSES)
        self.proc_root = proc_root

    def collect(self, found: Gathered) -> ProcessMemory:
        snap = found.get(SNAPSHOT)
        if snap is None:
            raise RuntimeError("no joined snapshot to attribute processes in")
        return process_memory(snap, self.proc_root)
