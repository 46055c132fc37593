"""Every file a doc or a comment points at exists in this repository: the repository stands
alone (no references to notes outside it, no renamed or deleted files left behind)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A path into one of the repository's top-level folders, with a file extension.
PATH = re.compile(r"(?<![\w./-])((?:tests|docs|bench|exporter|drasim|deploy|alerts|dashboards|tools|\.ci)/[\w./-]*\w\.(?:py|md|yaml|yml|json|proto|toml|txt|pyi))\b")
# Documents that never were in this repository.
OUTSIDE = re.compile(r"\bPRODUCT\.md\b|(?<![\w/])reference/[\w-]+\.md|/work/shared")


# Files that name paths on purpose that must not exist (.dockerignore cases).
SKIP = {"test_dockerfile.py", Path(__file__).name}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml", "*.yml", "*.toml", "Dockerfile"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in out if (REPO / f).is_file()]


def test_referenced_files_exist() -> None:
    missing = []
    for f in tracked():
        if f.name in SKIP:
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for ref in PATH.findall(line):
                if "*" in ref or "<" in ref:
                    continue
                if not (REPO / ref).exists():
                    missing.append(f"{f.relative_to(REPO)}:{n}: {ref}")
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def test_no_references_outside_the_repository() -> None:
    hits = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in tracked() if f.name not in SKIP
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)
