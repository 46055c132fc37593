"""The Helm chart rendered by the real Helm engine (helm-python-sdk), for the manifest tests.

    from chart_render import render_docs, by_kind   # tests/ is on sys.path

    docs = render_docs({"serviceMonitor": {"enabled": True}})
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import render_manifest  # noqa: E402  (tools/render_manifest.py: one renderer for the script and the tests)

CHART = render_manifest.CHART
RELEASE = render_manifest.RELEASE
NAMESPACE = render_manifest.NAMESPACE


@functools.lru_cache(maxsize=64)
def _render(values_json: str, release: str, namespace: str) -> tuple[tuple[str, str], ...]:
    out = render_manifest.render(json.loads(values_json), release=release, namespace=namespace)
    return tuple(sorted(out.items()))


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text (cached per values)."""
    return dict(_render(json.dumps(values or {}, sort_keys=True), release, namespace))


def render_docs(values: dict[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name, text in sorted(render(values, **kw).items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]
