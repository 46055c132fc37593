"""The collector seam: what every source implements, beside the source itself.

node_exporter's answer to "add a source" is one collector per file behind ``Update(ch) error``,
timed and reported by the framework. This is ours:

* a :class:`Collector` has a ``name`` (the ``collector`` label of
  ``dra_gpu_exporter_collector_duration_seconds`` / ``_success``) and a typed :class:`Slot` it
  fills; ``collect(found)`` returns its typed result, reading what the collectors before it
  found this cycle (the claims collector reads the kubelet's claim references);
* a source that answers with data it knows to be incomplete or old raises :class:`Degraded`
  carrying that data: the agent uses it and reports the collector as failed;
* ``keep_for`` says how long the agent keeps the last good result standing in when ``collect``
  fails outright (a kubelet restart must not blank the dashboards; a failed device enumeration
  keeps the devices it knew);
* ``stats()`` reports the source's own request counters in one shape (:class:`SourceStats`),
  which the renderer exports as self-metrics.

The agent iterates the collectors it is given (exporter/wiring.py decides which, in order),
times each, keeps last-good data and answers /readyz from their status; it knows no source by
name. Nothing here imports a source: this module sits at the base of the import layers so every
source can implement it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

import structlog

__all__ = ["Collector", "CollectorStatus", "Degraded", "Gathered", "Slot", "SourceStats"]

log = structlog.get_logger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, eq=False)
class Slot(Generic[T_co]):
    """A typed key of a cycle's findings: ``found.get(KUBELET)`` is a ``PodResourcesSnapshot``.
    Compared by identity: each source module defines its slot once."""

    name: str

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Gathered:
    """What one cycle's collectors found so far, by slot. Immutable: :meth:`with_value` makes the
    next one, so a collector can only read what came before it."""

    __slots__ = ("_fresh", "_values")

    def __init__(self, values: Mapping[Slot[object], object] | None = None,
                 fresh: frozenset[Slot[object]] = frozenset()) -> None:
        self._values: dict[Slot[object], object] = dict(values or {})
        self._fresh = fresh

    def get(self, slot: Slot[T]) -> T | None:
        """The slot's value this cycle (fresh or kept from an earlier one), None when there is none."""
        # Values enter only through with_value(slot: Slot[T], value: T): the pairing is typed there.
        return cast("T | None", self._values.get(slot))

    def fresh(self, slot: Slot[object]) -> bool:
        """Whether the slot's value was collected this cycle (a Degraded result counts), not kept."""
        return slot in self._fresh

    def with_value(self, slot: Slot[T], value: T | None, fresh: bool) -> Gathered:
        values = dict(self._values)
        if value is None:
            values.pop(slot, None)
        else:
            values[slot] = value
        return Gathered(values, self._fresh | {slot} if fresh and value is not None else self._fresh - {slot})


class Degraded(Exception, Generic[T]):
    """Raised by a collector that still has a usable (possibly stale or partial) ``result``."""

    def __init__(self, message: str, result: T) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class SourceStats:
    """A source's own counters since start, in the one shape every source reports.

    ``requests``: calls made to the peer by verb (``list``, ``get``, ``watch``; a paginated list
    counts once); ``errors``: failed calls and broken streams; ``relists``: lists after the first
    (410 Gone, recovery); ``watch_restarts``: watches opened after the first; ``malformed``:
    objects or events that could not be parsed and were skipped.
    """

    requests: Mapping[str, int] = field(default_factory=dict)
    errors: int = 0
    relists: int = 0
    watch_restarts: int = 0
    malformed: int = 0


@dataclass
class CollectorStatus:
    """A collector's last run, as /readyz and the self-metrics report it (kept by the agent)."""

    duration: float = 0.0
    success: bool = False
    error: str = ""
    last_success: float | None = None  # monotonic

    def failed(self, name: str, duration: float, error: Exception, degraded: bool = False) -> None:
        """``degraded``: the source still answered, with data it knows to be old or incomplete."""
        self.duration = duration
        if self.success or self.error != str(error):  # logged when it starts or changes, not every cycle
            log.warning("collector_degraded" if degraded else "collector_failed", collector=name, error=str(error))
        self.success, self.error = False, str(error)

    def succeeded(self, name: str, duration: float) -> None:
        self.duration = duration
        if not self.success and self.error:
            log.info("collector_recovered", collector=name)
        self.success, self.error, self.last_success = True, "", time.monotonic()


class Collector(abc.ABC, Generic[T_co]):
    """One source, as the agent sees it. Subclasses set ``slot`` (and with it ``name``) and
    implement :meth:`collect`; the rest has do-nothing defaults."""

    #: seconds the last good result stands in while collect() fails (0: not at all)
    keep_for: float = 0.0

    def __init__(self, slot: Slot[T_co]) -> None:
        self.slot = slot

    @property
    def name(self) -> str:
        return self.slot.name

    @abc.abstractmethod
    def collect(self, found: Gathered) -> T_co:
        """This cycle's result; raise :class:`Degraded` with usable data, or any exception
        without (the agent logs it, reports the collector failed and goes on)."""

    def start(self) -> None:
        """Start background work (a watch) before the first cycle."""

    def await_first(self, deadline: float) -> None:
        """Before the first cycle: wait (until ``time.monotonic()`` reaches ``deadline`` at most)
        for data that is on its way, so the first cycle does not publish a gap."""

    def stop(self) -> None:
        """Stop background work and release the source; called once, at the agent's stop."""

    def stats(self) -> SourceStats | None:
        """The source's request counters; None when it keeps none."""
        return None

    def problems(self) -> list[str]:
        """Lines for /readyz beyond the collector's own error (hung calls, ...)."""
        return []
