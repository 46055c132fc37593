"""Fault injection and the request log of the fake API server (thread-safe)."""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

LOG_LIMIT = 50_000  # requests remembered for tests; older ones are dropped


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None  # parsed JSON (or raw text) of the request body, None when empty
    watch: bool = False
    status: int = 0  # 0 when no response was sent (connection reset)
    user: str = ""  # who asked: the bearer token (the emulation has no authentication to map it)


@dataclass
class _Rule:
    method: str  # upper case or "*"
    path: re.Pattern[str]
    remaining: int
    watch: bool | None  # None: watches and plain requests alike
    code: int = 0
    seconds: float = 0.0
    retry_after: float | None = None
    message: str | None = None

    def matches(self, method: str, path: str, watch: bool) -> bool:
        if self.remaining <= 0:
            return False
        if self.method not in ("*", method):
            return False
        if self.watch is not None and self.watch != watch:
            return False
        return self.path.search(path) is not None


@dataclass
class Decision:
    """What to do with one request before it reaches the API."""

    delay: float = 0.0
    outage: str | None = None  # "503" | "reset"
    fail: _Rule | None = None


@dataclass
class FaultInjector:
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _outage: str | None = None
    _failures: list[_Rule] = field(default_factory=list)
    _delays: list[_Rule] = field(default_factory=list)
    # Bounded: the demo runs for days and records every request (tests read at most a few
    # thousand); a plain list grew ~1 GB a day under Prometheus scrapes.
    log_size: int = LOG_LIMIT
    _log: deque[RequestRecord] = field(init=False)

    def __post_init__(self) -> None:
        self._log = deque(maxlen=self.log_size)

    # ------------------------------------------------------------ configuration

    def set_outage(self, mode: str | None) -> None:
        if mode not in (None, "503", "reset"):
            raise ValueError("outage mode is '503' or 'reset'")
        with self._lock:
            self._outage = mode

    def add_failure(self, method: str, path_regex: str, code: int, count: int,
                    retry_after: float | None, message: str | None, watch: bool | None) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        rule = _Rule(method.upper(), re.compile(path_regex), count, watch, code=code,
                     retry_after=retry_after, message=message)
        with self._lock:
            self._failures.append(rule)

    def add_delay(self, method: str, path_regex: str, seconds: float, count: int, watch: bool | None) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        rule = _Rule(method.upper(), re.compile(path_regex), count, watch, seconds=seconds)
        with self._lock:
            self._delays.append(rule)

    def clear(self) -> None:
        with self._lock:
            self._outage = None
            self._failures.clear()
            self._delays.clear()

    @property
    def outage(self) -> str | None:
        with self._lock:
            return self._outage

    # ------------------------------------------------------------ per request

    def decide(self, method: str, path: str, watch: bool) -> Decision:
        """Consume the first matching delay and failure rule (each counts down once)."""
        decision = Decision()
        with self._lock:
            decision.outage = self._outage
            for rule in self._delays:
                if rule.matches(method, path, watch):
                    rule.remaining -= 1
                    decision.delay = rule.seconds
                    break
            for rule in self._failures:
                if rule.matches(method, path, watch):
                    rule.remaining -= 1
                    decision.fail = rule
                    break
            self._delays = [r for r in self._delays if r.remaining > 0]
            self._failures = [r for r in self._failures if r.remaining > 0]
        return decision

    def record(self, rec: RequestRecord) -> RequestRecord:
        with self._lock:
            self._log.append(rec)
        return rec

    def set_status(self, rec: RequestRecord, status: int) -> None:
        with self._lock:
            rec.status = status

    def log(self) -> list[RequestRecord]:
        with self._lock:
            return [RequestRecord(r.method, r.path, dict(r.query), r.body, r.watch, r.status,
                                  r.user) for r in self._log]

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()
