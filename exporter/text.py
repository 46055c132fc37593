"""Text for one log field or one error line: the product's one way of squeezing a message onto
a line.

Errors quote what the user or a library gave us: a path may hold a newline, a library's
exception text may span lines ("Error code:\\n\\t2 | ..."), an input quoted back may be huge. A log
line or an ``error:`` line must stay one readable line all the same. Imports nothing, so every
layer may use it.
"""

from __future__ import annotations

import re

MESSAGE_LIMIT = 500  # characters of a message; the rest is counted, not shown

# What str.splitlines() splits at, and other control characters: escaped, so that they stay
# visible (a path's newline is part of the path) without breaking the line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(message: str | BaseException, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` as one line of at most ``limit`` characters (plus a note of how many more).

    A string (a message we composed, quoting input verbatim) keeps every character: line breaks
    and control characters are escaped. An exception's text (a library's prose, laid out over
    lines) has its whitespace runs collapsed to single spaces; an exception without text is
    named by its type."""
    if isinstance(message, BaseException):
        message = " ".join(str(message).split()) or type(message).__name__
    message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), message)
    if len(message) > limit:
        message = f"{message[:limit]}... ({len(message) - limit} more characters)"
    return message
