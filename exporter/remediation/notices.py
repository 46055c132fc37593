"""What the remediator tells people about what it held back: one Warning Event and one count per
episode, and the writes the API server refused.

* :class:`Notices`: a (device, suppression) episode is told once, in a ``HealthRemediationSuppressed``
  Event on the Node, and counted once in ``dra_gpu_exporter_taint_suppressed_total``. The only
  place the counter is counted, and only with a :class:`~exporter.reasons.Suppression`, so the
  metric's documented reasons (from the same enum) are all the reasons it can carry.
* :class:`Refusals`: a write the server refused (401, 403, 422...) or whose name is taken is held
  for the policy's ``refused_retry`` unless the decision changes; each held write is one line of
  ``/readyz`` and fails the remediation collector.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import structlog

from ..reasons import Suppression

log = structlog.get_logger(__name__)

Key = tuple[str, str, str]  # a device's (driver, pool, device), or a node-wide key below
NO_API_KEY = ("api", "", "")  # the cluster-wide "no DeviceTaintRule API"
NODE_KEY = ("node", "", "")  # node-wide episodes
BUDGET_KEY = ("budget", "", "")  # "the budget object cannot be read"
Signature = tuple[str, str, str]  # (action, effect, tier) of a decision


class Notices:
    def __init__(self, tell: Callable[[str], None]) -> None:
        self._tell = tell  # a Warning Event on the Node
        self._told: set[tuple[Key, str]] = set()
        self.suppressed: Counter[str] = Counter()

    def announce(self, key: Key, what: Suppression, note: str) -> None:
        what = Suppression(what)  # a stray string fails here, in tests, not in a dashboard
        tag = (key, what.value)
        if tag in self._told:
            return
        self._told.add(tag)
        self.suppressed[what.value] += 1
        log.warning("remediation_suppressed", what=what.value, device=key[2] or None, note=note)
        self._tell(note)

    def over(self, key: Key, what: Suppression | None = None) -> None:
        """The episode is over (one suppression, or every one of the key): a new one is news."""
        if not self._told:
            return
        if what is not None:
            self._told.discard((key, what.value))
        else:
            self._told = {tag for tag in self._told if tag[0] != key}


class Refusals:
    def __init__(self) -> None:
        self._held: dict[Key, tuple[Signature, float, str]] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, key: Key, sig: Signature, until: float, line: str) -> None:
        self._held[key] = (sig, until, line)

    def holds(self, key: Key, sig: Signature, now: float) -> bool:
        """Whether this decision was refused before and is not to be asked again yet; a held
        write whose decision changed, or whose hold is over, is let go."""
        held = self._held.get(key)
        if held is None:
            return False
        if held[0] == sig and now < held[1]:
            return True
        del self._held[key]
        return False

    def clear(self) -> None:
        """Ask every held write again at the next pass."""
        self._held.clear()

    def lines(self) -> tuple[str, ...]:
        return tuple(v[2] for _, v in sorted(self._held.items()))
