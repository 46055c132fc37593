"""The node's boot identity: which boot of the machine this agent runs in, and since when.

A reboot resets every GPU, so a rule whose fault was recorded under another boot has had the
reset its fatal condition waits for (issue 26). Linux gives each boot a random UUID
(``/proc/sys/kernel/random/boot_id``, the host's value inside a container: the file is not
namespaced) and the boot time (``btime`` in ``/proc/stat``, seconds since the epoch).

A driver reload is not a boot and cannot be proven the same way: see the README ("What the agent
can prove after a restart").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
STAT = Path("/proc/stat")


@dataclass(frozen=True)
class BootIdentity:
    boot_id: str = ""  # "" when unknown: nothing is proven by it
    booted_at: float | None = None  # epoch seconds; None when unknown

    def reset_since(self, boot_id: str, first_seen: float | None) -> bool:
        """Whether a fault recorded under ``boot_id`` (or, unannotated, first seen at
        ``first_seen``) has had a reboot since: another boot, or a fault older than this boot."""
        if boot_id:
            return bool(self.boot_id) and boot_id != self.boot_id
        return first_seen is not None and self.booted_at is not None and first_seen < self.booted_at


def read_boot_identity(boot_id: Path = BOOT_ID, stat: Path = STAT) -> BootIdentity:
    """This node's boot, from procfs; what cannot be read stays unknown (and proves nothing)."""
    ident, booted = "", None
    try:
        ident = boot_id.read_text().strip()
    except OSError as e:
        log.warning("boot_id_unreadable", path=str(boot_id), error=str(e))
    try:
        for line in stat.read_text().splitlines():
            if line.startswith("btime "):
                booted = float(line.split()[1])
                break
    except (OSError, ValueError, IndexError) as e:
        log.warning("boot_time_unreadable", path=str(stat), error=str(e))
    return BootIdentity(ident, booted)
