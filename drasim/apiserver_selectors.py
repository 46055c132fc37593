"""Label and field selectors with the grammar and matching rules of kube-apiserver.

Pure functions: parse once per request, then match objects (plain JSON dicts).
Parse errors raise ValueError; the server turns them into 400 BadRequest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_KEY = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_KEY_RE = re.compile(rf"^{_KEY}$")
_VALUE_RE = re.compile(rf"^{_VALUE}$")
_SET_RE = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_CMP_RE = re.compile(rf"^({_KEY})\s*(==|=|!=|>|<)\s*(\S*)$")
_NOT_EXISTS_RE = re.compile(rf"^!\s*({_KEY})$")


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "in":
            return present and value in self.values
        # != and notin also match objects that lack the label (labels.Selector semantics).
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "notin":
            return not present or value not in self.values
        if self.op in ("gt", "lt"):
            if not present:
                return False
            try:
                have = int(str(value))
            except ValueError:
                return False
            want = int(self.values[0])
            return have > want if self.op == "gt" else have < want
        raise AssertionError(self.op)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses ("a in (x,y),b" -> 2 parts)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parenthesis in label selector {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced parenthesis in label selector {text!r}")
    parts.append("".join(current))
    return parts


def _check_value(value: str, whole: str) -> str:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise ValueError(f"invalid label value: {value!r} in selector {whole!r}")
    return value


def parse_label_selector(text: str | None) -> tuple[LabelRequirement, ...]:
    if text is None or not text.strip():
        return ()
    reqs: list[LabelRequirement] = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise ValueError(f"empty requirement in label selector {text!r}")
        if m := _NOT_EXISTS_RE.match(part):
            reqs.append(LabelRequirement(m.group(1), "!"))
        elif m := _SET_RE.match(part):
            values = tuple(_check_value(v.strip(), text) for v in m.group(3).split(","))
            reqs.append(LabelRequirement(m.group(1), m.group(2), values))
        elif m := _CMP_RE.match(part):
            key, op, value = m.group(1), m.group(2), m.group(3)
            if op in (">", "<"):
                try:
                    int(value)
                except ValueError:
                    raise ValueError(f"{op} needs an integer in label selector {text!r}") from None
                reqs.append(LabelRequirement(key, "gt" if op == ">" else "lt", (value,)))
            else:
                reqs.append(LabelRequirement(key, "!=" if op == "!=" else "=", (_check_value(value, text),)))
        elif _KEY_RE.match(part):
            reqs.append(LabelRequirement(part, "exists"))
        else:
            raise ValueError(f"unable to parse requirement {part!r} in label selector {text!r}")
    return tuple(reqs)


def labels_match(reqs: tuple[LabelRequirement, ...], obj: dict[str, Any]) -> bool:
    if not reqs:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


# ---------------------------------------------------------------- field selectors


@dataclass(frozen=True)
class FieldRequirement:
    path: str  # dotted, e.g. "spec.nodeName"
    equal: bool  # True for = and ==, False for !=
    value: str


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(value: str) -> str:
    out: list[str] = []
    it = iter(value)
    for ch in it:
        if ch == "\\":
            nxt = next(it, None)
            if nxt is None or nxt not in "\\,=!":
                raise ValueError(f"invalid escape sequence in field selector value {value!r}")
            out.append(nxt)
        else:
            out.append(ch)
    return "".join(out)


def _find_operator(term: str) -> tuple[int, str] | None:
    i = 0
    while i < len(term):
        ch = term[i]
        if ch == "\\":
            i += 2
            continue
        for op in ("!=", "==", "="):
            if term.startswith(op, i):
                return i, op
        i += 1
    return None


def parse_field_selector(text: str | None) -> tuple[FieldRequirement, ...]:
    if text is None or not text.strip():
        return ()
    reqs: list[FieldRequirement] = []
    for term in _split_unescaped(text, ","):
        if not term:
            continue
        found = _find_operator(term)
        if found is None:
            raise ValueError(f"invalid selector: {text!r}; can't understand {term!r}")
        pos, op = found
        path = term[:pos].strip()
        if not path:
            raise ValueError(f"invalid selector: {text!r}; empty field name in {term!r}")
        reqs.append(FieldRequirement(path, op != "!=", _unescape(term[pos + len(op):])))
    return tuple(reqs)


def field_value(obj: dict[str, Any], path: str) -> str:
    """The string a field selector compares: "" when missing, bools as true/false."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
        if cur is None:
            return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    if isinstance(cur, (str, int, float)):
        return str(cur)
    return ""


def fields_match(reqs: tuple[FieldRequirement, ...], obj: dict[str, Any]) -> bool:
    return all((field_value(obj, r.path) == r.value) == r.equal for r in reqs)


@dataclass(frozen=True)
class Selector:
    labels: tuple[LabelRequirement, ...] = ()
    fields: tuple[FieldRequirement, ...] = ()

    @classmethod
    def parse(cls, label_selector: str | None, field_selector: str | None) -> Selector:
        return cls(parse_label_selector(label_selector), parse_field_selector(field_selector))

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        return labels_match(self.labels, obj) and fields_match(self.fields, obj)
