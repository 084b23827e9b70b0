"""The overview's streams: each entry point's newest window and its request rate over the last minute.

>>> from spikehound.model import LatencyWindow
>>> def w(op, start, count):
...     return LatencyWindow("gateway", op, start * NS, (start + 10) * NS, count, 1, 2, 3, 4)
>>> now = streams_now([w("GET /a", 0, 50), w("GET /a", 50, 100), w("GET /b", 40, 5), w("GET /a", 60, 200)])
>>> [(s.window.operation, s.window.start_unix_nano // NS, s.rate) for s in now]
[('GET /a', 60, 5.0), ('GET /b', 40, 0.08333333333333333)]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spikehound.model import LatencyWindow
from spikehound.units import NS

RATE_NS = 60 * NS


@dataclass(slots=True, frozen=True)
class StreamNow:
    window: LatencyWindow  # the stream's newest window
    rate: float  # requests per second over the last minute of its service (quiet windows count as none)


def streams_now(windows: Iterable[LatencyWindow]) -> list[StreamNow]:
    """One row per (service, operation) of ``windows`` (each service's last minutes, oldest first)."""
    by_service: dict[str, list[LatencyWindow]] = {}
    for w in windows:
        by_service.setdefault(w.service, []).append(w)
    out: list[StreamNow] = []
    for service_windows in by_service.values():
        end = max(w.end_unix_nano for w in service_windows)
        since = max(end - RATE_NS, min(w.start_unix_nano for w in service_windows))
        seconds = max((end - since) / NS, 1e-9)
        newest: dict[str, LatencyWindow] = {}
        counts: dict[str, int] = {}
        for w in service_windows:
            newest[w.operation] = w
            if w.start_unix_nano >= since:
                counts[w.operation] = counts.get(w.operation, 0) + w.count
        out += [StreamNow(newest[op], counts.get(op, 0) / seconds) for op in sorted(newest)]
    return out
