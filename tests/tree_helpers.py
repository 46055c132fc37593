"""Walking JSON-like trees (dicts and lists), for the fuzz tests that mutate one place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def tree_paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path in ``obj``, the root ``()`` first: dict keys and list indexes."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from tree_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from tree_paths(v, prefix + (i,))
