"""What the remediator reads from the cluster about its own node: its DeviceTaintRules (typed) and
the node's remediation kill switch.

Production reads both through node-scoped watches (:class:`WatchedRules`, :class:`WatchedKillSwitch`:
nothing is asked at rest). The listed and polled variants ask every ``resync`` seconds instead;
they exist for rigs that need "the agent has not seen it yet" (a rule created behind its back
is met as a 409) and are never wired into the agent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..constants import API_TIMEOUT
from . import names
from .connection import ApiClient, ApiError, get_json
from .taintrules import TaintRule, TaintRuleClient, parse_rule
from .watch import NodeWatch, OwnedRuleWatch

Listener = Callable[[], None]


def _disabled(labels: dict[str, str]) -> bool:
    return str(labels.get(names.KILL_SWITCH_LABEL, "")).lower() == "disabled"


class WatchedRules:
    """This node's rules from an :class:`OwnedRuleWatch`, opened in the served DeviceTaintRule
    version once discovery has found it (the first :meth:`current` call)."""

    lags = True  # a rule created a moment ago may not be in the watch's cache yet

    def __init__(self, client: ApiClient, node: str, rules: TaintRuleClient) -> None:
        self._client, self._node, self._rules = client, node, rules
        self._watch: OwnedRuleWatch | None = None
        self._on_change: Listener | None = None
        self._lock = threading.Lock()

    def start(self, on_change: Listener) -> None:
        with self._lock:
            self._on_change = on_change

    def stop(self) -> None:
        with self._lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def current(self) -> list[TaintRule] | None:
        """The rules as the watch holds them; None until its first list. Raises
        TaintRulesUnavailable when no version is served (the watch is then not opened)."""
        with self._lock:
            watch = self._watch
            if watch is None:
                watch = self._watch = OwnedRuleWatch(self._client, self._node, self._rules.served().version,
                                                     on_change=self._on_change)
                watch.start()
        if not watch.synced:
            return None
        return [r for r in map(parse_rule, watch.objects().values()) if r is not None]


class ListedRules:
    """This node's rules, listed (node-scoped label selector) every ``resync`` seconds."""

    lags = False  # a list is the server's truth: a rule it lacks is gone

    def __init__(self, rules: TaintRuleClient, node: str, resync: float) -> None:
        self._rules, self._node = rules, node
        self.resync = resync
        self._last = -float("inf")

    def start(self, on_change: Listener) -> None:
        """(Nothing to start: it is asked when a pass looks.)"""

    def stop(self) -> None:
        """(Nothing to stop.)"""

    def current(self) -> list[TaintRule] | None:
        """None while the next list is not due."""
        if time.monotonic() - self._last < self.resync:
            return None
        out = self._rules.list_rules(self._node)
        self._last = time.monotonic()
        return out


class WatchedKillSwitch:
    """The node's kill-switch label from a :class:`NodeWatch` (field selector on the node's name)."""

    def __init__(self, client: ApiClient, node: str) -> None:
        self._watch = NodeWatch(client, node)

    def start(self, on_change: Listener) -> None:
        self._watch.on_change = on_change
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()

    def disabled(self) -> bool | None:
        """None until the Node has been listed."""
        return _disabled(self._watch.labels()) if self._watch.synced else None


class PolledKillSwitch:
    """The node's kill-switch label, read with a GET of the Node every ``resync`` seconds."""

    def __init__(self, client: ApiClient, node: str, resync: float) -> None:
        self._client, self._node, self.resync = client, node, resync
        self._last = -float("inf")

    def start(self, on_change: Listener) -> None:
        """(Nothing to start.)"""

    def stop(self) -> None:
        """(Nothing to stop.)"""

    def disabled(self) -> bool | None:
        """None while the next read is not due; a missing Node has no kill switch."""
        if time.monotonic() - self._last < self.resync:
            return None
        try:
            node = get_json(self._client, f"/api/v1/nodes/{self._node}", timeout=API_TIMEOUT)
        except ApiError as e:
            if e.status != 404:
                raise
            node = {}
        self._last = time.monotonic()
        labels = (node.get("metadata") or {}).get("labels") or {}
        return _disabled(labels if isinstance(labels, dict) else {})
