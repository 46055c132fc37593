"""Suite-wide set-up.

Logs go through the agent's own configuration from the start, so a line written by a
background thread lands in the running test's captured stderr (shown with its failure) instead
of structlog's default stdout logger, which prints straight to the terminal between dots.
"""

from __future__ import annotations

from exporter.logs import configure


def pytest_configure(config) -> None:  # pytest's hook signature
    configure("json", "info")
