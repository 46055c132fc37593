"""CHANGELOG.md covers the metric contract (issue 15): every metric the exporter serves and every
series the shipped recording rules publish is named there, so none is added or renamed silently."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from exporter.catalog import CATALOG

REPO = Path(__file__).resolve().parent.parent
CHANGELOG = (REPO / "CHANGELOG.md").read_text()


def test_every_metric_is_in_the_changelog() -> None:
    missing = [m.name for m in CATALOG if f"`{m.name}`" not in CHANGELOG]
    assert not missing, f"add these to CHANGELOG.md (Unreleased, Added): {missing}"


def test_every_recorded_series_is_in_the_changelog() -> None:
    for path in sorted((REPO / "alerts").glob("*.rules.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    assert f"`{rule['record']}`" in CHANGELOG, f"{path.name}: {rule['record']} missing from CHANGELOG.md"


def test_changelog_has_an_unreleased_section_before_the_releases() -> None:
    heads = re.findall(r"^## (.+)$", CHANGELOG, flags=re.M)
    assert heads[0] == "Unreleased" and "0.1.0" in heads
