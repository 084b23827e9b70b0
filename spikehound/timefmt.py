"""Time in and out of the API: RFC 3339 UTC strings or unix seconds in, RFC 3339 out.

>>> rfc3339(1_700_000_000_123_456_789)
'2023-11-14T22:13:20.123456789Z'
>>> rfc3339(-(2**63)), rfc3339(2**63 - 1)  # the ends of what storage holds
('1677-09-21T00:12:43.145224192Z', '2262-04-11T23:47:16.854775807Z')
>>> parse_time("2023-11-14T22:13:20.5Z"), parse_time("1700000000.5")
(1700000000500000000, 1700000000500000000)
"""

from __future__ import annotations

import functools
import re
import time
from datetime import datetime

from spikehound.units import NS

__all__ = ["MAX_NS", "MIN_NS", "NS", "parse_time", "rfc3339"]
# Times are stored as signed 64-bit nanoseconds: 1677-09-21 to 2262-04-11.
MIN_NS, MAX_NS = -(2**63), 2**63 - 1


def rfc3339(unix_nano: int | None) -> str | None:
    """Nanoseconds since the epoch as an RFC 3339 UTC string, keeping every digit."""
    if unix_nano is None:
        return None
    seconds, frac = divmod(unix_nano, NS)
    stamp = _second(seconds)
    return f"{stamp}.{frac:09d}Z" if frac else f"{stamp}Z"


@functools.lru_cache(maxsize=4096)
def _second(seconds: int) -> str:
    # The spike list formats thousands of times, most of them window starts: the same few seconds.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


# ASCII digits only: \d would also match other scripts' digits, which int() reads, or '²', which it refuses.
_UNIX = re.compile(r"^([0-9]{1,11})(?:\.([0-9]{1,9})[0-9]*)?$")
_FRACTION = re.compile(r"\.([0-9]+)")


def parse_time(text: str) -> int:
    """Unix seconds (int or decimal) or an RFC 3339 timestamp, as nanoseconds since the epoch."""
    value = text.strip()
    unix = _UNIX.match(value)
    if unix:
        return _in_range(int(unix[1]) * NS + int((unix[2] or "").ljust(9, "0")), text)
    # datetime keeps microseconds only: take the fraction out and add it back at full precision.
    fraction = _FRACTION.search(value)
    nanos = int(fraction[1][:9].ljust(9, "0")) if fraction else 0
    bare = _FRACTION.sub("", value, count=1).replace("z", "Z").replace("Z", "+00:00")
    try:
        if "." in bare:  # a second fraction: garbage that fromisoformat would half-read
            raise ValueError
        moment = datetime.fromisoformat(bare)
    except ValueError:
        raise ValueError(f"{text!r} is neither RFC 3339 nor unix seconds") from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone (use Z for UTC)")
    return _in_range(int(moment.timestamp()) * NS + nanos, text)


def _in_range(unix_nano: int, text: str) -> int:
    if not MIN_NS <= unix_nano <= MAX_NS:
        raise ValueError(f"{text!r} is out of range (1677-09-21 to 2262-04-11)")
    return unix_nano
