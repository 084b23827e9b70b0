"""Untrusted text made safe to show: names, summaries and errors that came from spans, senders or the API.

>>> printable("gateway\\x1b[2J\\x1b]0;pwned\\x07"), printable("a\\u202eb\\tc")
('gateway\\\\x1b[2J\\\\x1b]0;pwned\\\\x07', 'a\\\\u202eb\\\\x09c')
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 and C1 controls (ESC and CSI start ANSI sequences; CR and BS overwrite), DEL, and the bidirectional
# overrides that reorder what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: object, limit: int | None = None) -> str:
    """``text`` with each control character shown as an escape (so a service name cannot recolour, retitle or
    rewrite a terminal or a log line), cut to ``limit`` characters first when given."""
    value = str(text) if limit is None else str(text)[:limit]
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", value)
