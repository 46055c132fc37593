"""Write the configuration reference's table (docs/configuration.md) from the flag table
(exporter/config.py, FLAGS), so that the two can never drift.

    .venv/bin/python tools/config_reference.py           # rewrite the table in docs/configuration.md
    .venv/bin/python tools/config_reference.py --check   # exit 1 and show the difference

Only the flag table is generated; the prose around it is written by hand.
tests/test_readme_config.py fails when the document's table is not what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from exporter.config import readme_table

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "configuration.md"
NAME = "docs/configuration.md"
HEADER = "| flag | default | meaning |\n"


class NoTable(ValueError):
    pass


def table_span(text: str) -> tuple[int, int]:
    """Where the flag table is in ``text``: from its header line to the end of its last row (the
    first line after it that is not a table row)."""
    start = text.find(HEADER)
    if start < 0 or (start > 0 and text[start - 1] != "\n"):
        raise NoTable(f"{NAME} has no table starting {HEADER.strip()!r}")
    end = start
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1
    return start, end


def with_table(text: str) -> str:
    """``text`` (the document) with its flag table as the flag table generates it."""
    start, end = table_span(text)
    return text[:start] + readme_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--check", action="store_true", help=f"change nothing; exit 1 if {NAME}'s table is stale")
    args = p.parse_args(argv)
    old = DOC.read_text()
    new = with_table(old)
    if new == old:
        return 0
    if args.check:
        diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), NAME, f"{NAME} (generated)")
        sys.stdout.writelines(diff)
        return 1
    DOC.write_text(new)
    print(f"{NAME}: configuration table rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
