"""Units of time, defined once: every timestamp and duration inside spikehound is integer nanoseconds.

>>> 3 * NS + 250 * MS
3250000000
>>> 1_500_000 / MS  # a duration in milliseconds, for a person to read
1.5
"""

from __future__ import annotations

NS = 1_000_000_000  # nanoseconds in a second
MS = 1_000_000  # nanoseconds in a millisecond
