"""The cluster-wide NoExecute budget: one ConfigMap, shared by every agent, changed only through
the API server's optimistic concurrency.

The installer (the Helm chart) creates ConfigMap ``dra-gpu-exporter-budget`` in the agents'
namespace and states its capacity there, so no agent ever counts the cluster's GPUs by listing
it. Data keys without a dot are the installer's:

* ``max_domains``: at most this many fault domains under NoExecute at once (0 or absent: no
  absolute cap);
* ``fraction`` and ``cluster_gpus``: at most ``floor(fraction * cluster_gpus)`` (at least 1)
  when ``cluster_gpus`` is above 0.

The capacity is the smallest cap stated; when the object states none, the agent's default
(``Config.taint_budget_max``, 16) applies. Every other key is one held slot, ``<node>.<fault domain>``
(the admission policy lets an agent add or remove only keys that start with its own node name
and a dot), its value the time it was taken.

A slot is taken and returned with a read followed by a PUT that carries the read's
``resourceVersion``: when another agent wrote in between, the server answers 409 and the agent
reads again. So agents faulting at the same moment can never take more slots than there are.
The object is read only when a domain is raised or lowered: it costs nothing at rest.

When the object cannot be read or written (missing, forbidden, API down) :class:`ApiError`
reaches the caller, which fails safe (NoSchedule, never NoExecute beyond the budget).

A node deleted while holding slots leaves its keys behind; they are freed by deleting those
keys (``kubectl edit configmap dra-gpu-exporter-budget``). An agent that restarts keeps its own
keys for the domains it still holds and frees the others as those domains step down.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable
from typing import Any

import structlog

from .connection import ApiClient, ApiError, get_json, request_json

log = structlog.get_logger(__name__)

BUDGET_NAME = "dra-gpu-exporter-budget"
CAPACITY_KEYS = ("max_domains", "fraction", "cluster_gpus")
TIMEOUT = (3.0, 5.0)
_KEY_BAD = re.compile(r"[^-._a-zA-Z0-9]")


def holder_key(holder: str) -> str:
    """A valid ConfigMap key for ``holder`` (``<node>.<domain>``); ConfigMap keys allow letters,
    digits, ``-``, ``_`` and ``.``, at most 253 characters."""
    return _KEY_BAD.sub("_", holder)[:253]


def capacity_of(data: dict[str, Any], default: int) -> int:
    """The budget the installer stated in ``data`` (see the module doc); ``default`` when none."""
    caps: list[int] = []
    try:
        max_domains = int(str(data.get("max_domains", "0")).strip() or 0)
    except ValueError:
        max_domains = 0
    if max_domains > 0:
        caps.append(max_domains)
    try:
        gpus = int(str(data.get("cluster_gpus", "0")).strip() or 0)
        fraction = float(str(data.get("fraction", "0")).strip() or 0)
    except ValueError:
        gpus, fraction = 0, 0.0
    if gpus > 0 and fraction > 0 and math.isfinite(fraction):
        caps.append(max(1, math.floor(fraction * gpus)))
    return min(caps) if caps else default


class ClusterBudget:
    """The :class:`exporter.remediation.budget.Budget` protocol on the shared ConfigMap."""

    def __init__(
        self,
        client: ApiClient,
        namespace: str,
        name: str = BUDGET_NAME,
        *,
        taint_budget_max: int = 16,
        attempts: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.default_capacity = taint_budget_max
        self.attempts = attempts
        self.clock = clock
        self.capacity = taint_budget_max  # as last read from the object
        self.conflicts = 0  # 409s met (another agent wrote first): for tests and debugging

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps/{self.name}"

    def _read(self) -> dict[str, Any]:
        obj = get_json(self.client, self._path, timeout=TIMEOUT)
        if not isinstance(obj.get("data"), dict):
            obj["data"] = {}
        self.capacity = capacity_of(obj["data"], self.default_capacity)
        return obj

    def _update(self, change: Callable[[dict[str, Any]], bool | None]) -> bool | None:
        """Read, apply ``change`` to the data (it returns the answer, or None for "write it and
        answer True"), PUT guarded by the read's resourceVersion; on 409 read again."""
        for attempt in range(self.attempts):
            obj = self._read()
            answer = change(obj["data"])
            if answer is not None:
                return answer  # nothing to write
            try:
                request_json(self.client, "PUT", self._path, body=obj, timeout=TIMEOUT)
                return True
            except ApiError as e:
                if e.status != 409:
                    raise
                self.conflicts += 1
                # Another agent wrote in between: read again, after a short jittered pause so
                # a crowd of agents does not retry in lockstep.
                time.sleep(random.uniform(0, 0.005 * min(attempt + 1, 20)))
        raise ApiError(status=409, reason="Conflict", message=f"budget {self.namespace}/{self.name}: still conflicting after {self.attempts} attempts")

    @staticmethod
    def _slots(data: dict[str, Any]) -> list[str]:
        return [k for k in data if "." in k]

    def take(self, holder: str) -> bool:
        key = holder_key(holder)

        def change(data: dict[str, Any]) -> bool | None:
            if key in data:
                return True  # already ours (a retry after a lost answer, or a restart)
            if len(self._slots(data)) >= self.capacity:
                return False
            data[key] = f"{self.clock():.0f}"
            return None

        taken = bool(self._update(change))
        # A full budget is told once per episode by the remediator (suppression, Event); asked
        # again on every pass, it would be a log line per pass here.
        (log.info if taken else log.debug)("budget_taken" if taken else "budget_full", holder=key, capacity=self.capacity)
        return taken

    def release(self, holder: str) -> None:
        key = holder_key(holder)

        def change(data: dict[str, Any]) -> bool | None:
            if key not in data:
                return True
            del data[key]
            return None

        self._update(change)
        log.info("budget_released", holder=key)

    def held(self, prefix: str | None = None) -> set[str]:
        data = self._read()["data"]
        return {k for k in self._slots(data) if prefix is None or k.startswith(prefix)}
