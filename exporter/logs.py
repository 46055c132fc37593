"""Structured logging: JSON lines in containers, readable key=value lines on a terminal.

Every module logs through ``structlog.get_logger(__name__)`` with an event name and fields,
so a log line can be found by its event and filtered by device, claim or rule.
"""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is *now*, not what it was at configure time (test
    runners and daemonisers swap it; a logger holding a closed stream would fail every call)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                           exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *([structlog.processors.format_exc_info] if fmt == "json" else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # structlog annotates TextIO but only print()s to the file (and keys a lock by it)
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # Library loggers (grpc, kubernetes' urllib3) go through stdlib logging: keep them quiet
    # unless debugging, and on stderr like ours.
    logging.basicConfig(level=logging.WARNING if level != "debug" else logging.DEBUG, stream=_CurrentStderr())
