"""Write the README's configuration table from the flag table (exporter/config.py, FLAGS), so
that the two can never drift.

    .venv/bin/python tools/readme_config.py           # rewrite the table in README.md
    .venv/bin/python tools/readme_config.py --check   # exit 1 and show the difference

Only the table under "## Configuration" is generated; the prose around it is written by hand.
tests/test_readme_config.py fails when the README's table is not what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from exporter.config import readme_table

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SECTION = "\n## Configuration\n"
HEADER = "| flag | default | meaning |\n"


class NoTable(ValueError):
    pass


def table_span(text: str) -> tuple[int, int]:
    """Where the configuration table is in ``text``: from its header line to the end of its
    last row (the first line after it that is not a table row)."""
    section = text.find(SECTION)
    if section < 0:
        raise NoTable("README.md has no '## Configuration' section")
    end_of_section = text.find("\n## ", section + len(SECTION))
    start = text.find(HEADER, section, None if end_of_section < 0 else end_of_section)
    if start < 0:
        raise NoTable(f"the '## Configuration' section has no table starting {HEADER.strip()!r}")
    end = start
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1
    return start, end


def with_table(text: str) -> str:
    """``text`` (the README) with its configuration table as the flag table generates it."""
    start, end = table_span(text)
    return text[:start] + readme_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if README.md's table is stale")
    args = p.parse_args(argv)
    old = README.read_text()
    new = with_table(old)
    if new == old:
        return 0
    if args.check:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "README.md", "README.md (generated)"))
        return 1
    README.write_text(new)
    print("README.md: configuration table rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
