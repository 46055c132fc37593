"""Escaping of names, label values and help text in the two exposition formats.

The renderer (exporter.metrics.render) formats samples itself, so it needs these few rules; they
are written here from the format specifications instead of borrowed from prometheus_client's
private helpers, whose names and signatures change between releases (0.22 and 0.23 added them,
and an allowed release without them made the agent fail at import). prometheus_client's public
``generate_latest`` (both formats) stays the oracle: tests/test_render_oracle.py compares the
renderer's bytes with the library's, names, help and label values included.

The rules:

* Label values, in both formats (Prometheus text format 0.0.4, "Text format details"; OpenMetrics
  1.0, ``escaped-string``): backslash, double quote and line feed are written ``\\\\``, ``\\"``
  and ``\\n``; any other UTF-8 text passes unchanged.
* HELP text: in the text format 0.0.4 only backslash and line feed are escaped; OpenMetrics 1.0
  escapes the double quote too (its HELP is an ``escaped-string`` like a label value).
* Names. Prometheus 3 allows any UTF-8 name; a client that writes the classic formats escapes a
  name outside the legacy character sets (metric ``[a-zA-Z_:][a-zA-Z0-9_:]*``, label
  ``[a-zA-Z_][a-zA-Z0-9_]*``) with the "underscores" scheme, the one prometheus_client uses by
  default (Prometheus' ``model.UnderscoreEscaping``): every character outside the set, and a
  leading digit, becomes ``_``. Legacy names are unchanged. One difference between the formats,
  kept because it is what the library writes: in OpenMetrics sample lines prometheus_client
  escapes the sample name with the *label* character set, so a ``:`` there becomes ``_`` while
  the HELP, TYPE and UNIT lines keep it.

One deliberate difference from prometheus_client 0.26: its legacy-name check is a regular
expression ending in ``$``, which also matches before a trailing line feed, so a name ending
in ``\\n`` is written raw and breaks the line-based format. Here a line feed is never a name
character and becomes ``_``. No name the agent builds can contain one (pod label keys are
sanitized, catalog names are fixed).
"""

from __future__ import annotations

import re

# A character the "underscores" scheme replaces: outside the legacy set, or a digit in first place.
# ``^`` without MULTILINE matches only at the start of the string.
_NOT_METRIC_NAME_CHAR = re.compile(r"^[0-9]|[^a-zA-Z0-9_:]")
_NOT_LABEL_NAME_CHAR = re.compile(r"^[0-9]|[^a-zA-Z0-9_]")


def metric_name(name: str) -> str:
    """A metric name as written in the text format's lines and OpenMetrics' HELP/TYPE/UNIT lines."""
    return _NOT_METRIC_NAME_CHAR.sub("_", name)


def openmetrics_sample_name(name: str) -> str:
    """A sample name as prometheus_client writes it at the start of an OpenMetrics sample line
    (the label character set: ``:`` becomes ``_`` too)."""
    return _NOT_LABEL_NAME_CHAR.sub("_", name)


def label_name(name: str) -> str:
    """A label name, both formats."""
    return _NOT_LABEL_NAME_CHAR.sub("_", name)


def label_value(value: str) -> str:
    """A label value between its double quotes, both formats."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def help_text(doc: str) -> str:
    """HELP text in the text format 0.0.4 (the double quote is not escaped there)."""
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def help_openmetrics(doc: str) -> str:
    """HELP text in OpenMetrics 1.0 (an escaped-string, like a label value)."""
    return label_value(doc)
