"""reading_stuck: a reading that stops moving while the device says it is working.

A frozen telemetry stream looks like an idle GPU (NVIDIA/dcgm-exporter#662: profiling ratios at 0
for weeks on busy GPUs). Two readings are watched, per device:

* **energy**: the energy counter has not changed since a reading taken under power (> 0 W at
  every reading since) at least ``after`` seconds ago;
* **profiling**: every GPM/activity ratio the device reports has been exactly 0 for that long
  while its utilization stayed at ``busy`` or more (a running kernel keeps SMs active).

Either clears at the first reading that moves. The result is an *advisory* condition
(``DeviceHealth.advisories``): about the telemetry, not the GPU, so never a taint and never
``gpu_healthy`` 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import structlog

from ..devices.model import DeviceReading
from .model import READING_STUCK, Condition, Tier

log = structlog.get_logger(__name__)


@dataclass
class StuckReadings:
    """One device's reading_stuck evidence. Guarded by the health engine's lock."""

    energy_mark: tuple[float, float] | None = None  # (energy value, since when it stood still under power)
    profile_zero_since: float | None = None  # since when every profiling ratio was 0 on a busy device
    found: dict[str, Condition] = field(default_factory=dict)  # "energy" | "profiling" -> condition

    def observe(self, uuid: str, r: DeviceReading, now: float, after: float, busy: float) -> None:
        if after <= 0:
            return
        found: dict[str, str] = {}
        e, w = r.energy_joules, r.power_watts
        if e is None or w is None or not w > 0:
            self.energy_mark = None
        elif self.energy_mark is None or self.energy_mark[0] != e:
            self.energy_mark = (e, now)
        elif now - self.energy_mark[1] >= after:
            found["energy"] = (f"energy counter stuck at {e:g} J for {now - self.energy_mark[1]:.0f}s while drawing "
                               f"{w:g} W")
        util = r.utilization_ratio
        ratios = [x for x in (r.sm_active_ratio, r.sm_occupancy_ratio, r.tensor_active_ratio,
                              r.dram_active_ratio) if x is not None]
        if util is not None and util >= busy and ratios and not any(ratios):
            if self.profile_zero_since is None:
                self.profile_zero_since = now
            elif now - self.profile_zero_since >= after:
                found["profiling"] = (f"profiling ratios at exactly 0 for {now - self.profile_zero_since:.0f}s while "
                                      f"utilization is {util:.0%}")
        else:
            self.profile_zero_since = None
        self._set(uuid, found, now)

    def forget(self, uuid: str) -> None:
        """No reading, no verdict on the readings: a stuck streak starts again when they come back."""
        self.energy_mark, self.profile_zero_since = None, None
        self._set(uuid, {}, 0.0)

    def _set(self, uuid: str, found: dict[str, str], now: float) -> None:
        for reading in [k for k in self.found if k not in found]:
            del self.found[reading]
            log.info("reading_moving_again", uuid=uuid, reading=reading)
        for reading, evidence in found.items():
            old = self.found.get(reading)
            if old is None:
                log.warning("reading_stuck", uuid=uuid, reading=reading, evidence=evidence)
                self.found[reading] = Condition(uuid=uuid, tier=Tier.DEGRADED, reason=READING_STUCK, since=now,
                                                last_seen=now, evidence=evidence)
            else:
                self.found[reading] = replace(old, last_seen=now, evidence=evidence)

    def advisories(self) -> tuple[Condition, ...]:
        """One reading_stuck condition per device (one gpu_health_condition series), naming every
        reading that is stuck, since the first of them."""
        if not self.found:
            return ()
        conds = [self.found[k] for k in sorted(self.found)]
        if len(conds) == 1:
            return (conds[0],)
        first = min(conds, key=lambda c: c.since)
        return (replace(first, last_seen=max(c.last_seen for c in conds),
                        evidence="; ".join(c.evidence for c in conds)),)
