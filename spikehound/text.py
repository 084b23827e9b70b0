"""Untrusted text made safe to show: names, summaries and errors that came from spans, senders or the API.

>>> printable("gateway\\x1b[2J\\x1b]0;pwned\\x07"), printable("a\\u202eb\\tc")
('gateway\\\\x1b[2J\\\\x1b]0;pwned\\\\x07', 'a\\\\u202eb\\\\x09c')
"""

from __future__ import annotations

import re

__all__ = ["printable", "recurrence"]

# C0 and C1 controls (ESC and CSI start ANSI sequences; CR and BS overwrite), DEL, and the bidirectional
# overrides that reorder what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: object, limit: int | None = None) -> str:
    """``text`` with each control character shown as an escape (so a service name cannot recolour, retitle or
    rewrite a terminal or a log line), cut to ``limit`` characters first when given."""
    value = str(text) if limit is None else str(text)[:limit]
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", value)


def recurrence(occurrence: int, since_first_ns: int) -> str:
    """How a return of a fault is told: which time this is, and how long since the first one began.

    >>> recurrence(2, 7 * 60 * 10**9), recurrence(3, 25 * 60 * 10**9 + 1), recurrence(11, 90 * 10**9)
    ('2nd time in 7 min', '3rd time in 25 min', '11th time in 2 min')
    """
    suffix = "th" if 10 <= occurrence % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(occurrence % 10, "th")
    minutes = max(round(since_first_ns / 60e9), 1)
    return f"{occurrence}{suffix} time in {minutes} min"
