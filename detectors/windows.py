"""Event-time latency windows: entry spans in, closed per-stream windows out.

A *stream* is one (service, operation) of entry spans (trace roots and SERVER
spans, see :attr:`spikehound.model.Span.is_entry`); the operation is the span
name. Windows are aligned to the Unix epoch and cut by span **end** time, so a
request belongs to the window in which it finished, which is when its latency
became visible to the caller.

Windows close on a watermark that follows the largest end time seen minus an
allowed lateness, never on a wall clock. This module reads no clock at all:
when input goes idle the caller says so through ``close(idle_advance_ns=...)``.
The same input therefore gives the same windows whether it arrives live, out
of order within the lateness, or as a fast replay of yesterday's capture.

Quantiles use the nearest-rank method, so every reported p50/p95/p99 is a
latency some request really had, never an interpolation between two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

from spikehound.model import LatencyWindow, Span, SpanKind

__all__ = ["LatencyWindows", "nearest_rank"]

Stream = tuple[str, str]


def nearest_rank(sorted_values: Sequence[int], q: float) -> int:
    """The q-quantile of ascending ``sorted_values`` by the nearest-rank method.

    The result is ``sorted_values[ceil(q * n) - 1]`` (index clamped to the
    list), always one of the observed values.

    >>> nearest_rank(list(range(1, 101)), 0.99), nearest_rank(list(range(1, 101)), 0.5)
    (99, 50)
    >>> nearest_rank([7], 0.0), nearest_rank([10, 20, 30, 40], 0.95)
    (7, 40)
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("nearest_rank of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    # Exact decimal arithmetic: 0.57 * 100 is 56.99999999999999 in floats,
    # which would pick the wrong rank.
    rank = math.ceil(Fraction(repr(float(q))) * n)
    return sorted_values[min(max(rank - 1, 0), n - 1)]


class LatencyWindows:
    """Per-stream latency windows over event time, closed by a watermark.

    Parameters
    ----------
    window_ns
        Window length; windows are ``[k * window_ns, (k + 1) * window_ns)`` by span end time.
    allowed_lateness_ns
        How far behind the largest end time seen a span may arrive and still count.
    max_streams
        Most distinct (service, operation) streams tracked at once; spans of
        further new streams are counted in ``overflow_spans`` and dropped.

    Example (1 s windows, no lateness allowed):

    >>> from spikehound.model import SpanKind, StatusCode
    >>> def entry(i, start_ms, end_ms):
    ...     return Span(trace_id=bytes(16), span_id=i.to_bytes(8, "big"), parent_span_id=None,
    ...                 service="gateway", host=None, name="POST /predict", kind=SpanKind.SERVER,
    ...                 start_unix_nano=start_ms * 1_000_000, end_unix_nano=end_ms * 1_000_000,
    ...                 status=StatusCode.UNSET, attributes={})
    >>> lw = LatencyWindows(window_ns=1_000_000_000, allowed_lateness_ns=0)
    >>> lw.add([entry(1, 100, 120), entry(2, 200, 260), entry(3, 900, 1_100)])
    >>> [(w.start_unix_nano, w.count, w.p99_ns) for w in lw.close()]
    [(0, 2, 60000000)]
    >>> lw.open_windows, lw.streams
    (1, 1)
    >>> [(w.start_unix_nano, w.count, w.max_ns) for w in lw.flush()]
    [(1000000000, 1, 200000000)]
    """

    def __init__(
        self,
        window_ns: int = 10_000_000_000,
        allowed_lateness_ns: int = 5_000_000_000,
        max_streams: int = 10_000,
    ) -> None:
        if window_ns <= 0:
            raise ValueError("window_ns must be positive")
        if allowed_lateness_ns < 0:
            raise ValueError("allowed_lateness_ns must not be negative")
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.window_ns = window_ns
        self.allowed_lateness_ns = allowed_lateness_ns
        self.max_streams = max_streams

        self.late_spans = 0
        self.overflow_spans = 0
        # window start -> stream -> (duration ns, trace id, span id). Keyed by start first
        # so that closing walks only the few oldest starts, not every stream.
        self._open: dict[int, dict[Stream, list[tuple[int, bytes, bytes]]]] = {}
        # Known streams -> largest end time seen on them. This is what the
        # cardinality limit counts. A stream is forgotten in close() once its
        # last span ended more than 2 windows before the watermark; by then it
        # cannot have an open window (an open window ends after the watermark,
        # so its spans ended less than one window before it). The table is thus
        # bounded by max_streams and sheds streams that went quiet.
        self._streams: dict[Stream, int] = {}
        self._max_end: int | None = None
        # Stored so that an idle advance is never undone by the next add():
        # a window once emitted must stay closed.
        self._watermark: int | None = None
        self._forgot_at = -(2**62)  # the watermark at the last sweep for quiet streams

    # -- input -------------------------------------------------------------

    def add(self, spans: Iterable[Span]) -> None:
        """Account the entry spans of ``spans`` into their open windows."""
        window_ns, server = self.window_ns, SpanKind.SERVER
        for span in spans:
            if span.parent_span_id is not None and span.kind != server:  # not an entry span (Span.is_entry)
                continue
            end = span.end_unix_nano
            if self._max_end is None or end > self._max_end:
                self._max_end = end
                candidate = end - self.allowed_lateness_ns
                if self._watermark is None or candidate > self._watermark:
                    self._watermark = candidate
            start = end // window_ns * window_ns
            watermark = self._watermark
            if watermark is not None and start + window_ns <= watermark:
                # Its window is closed (maybe already emitted): counting it now
                # would change a result that was already reported.
                self.late_spans += 1
                continue
            stream = (span.service, span.name)
            last = self._streams.get(stream)
            if last is None:
                if len(self._streams) >= self.max_streams:
                    self.overflow_spans += 1
                    continue
                self._streams[stream] = end
            elif end > last:
                self._streams[stream] = end
            # A span whose clock stepped back (end < start) has no real latency
            # to report; 0 keeps quantiles meaningful instead of negative.
            duration = max(end - span.start_unix_nano, 0)
            self._open.setdefault(start, {}).setdefault(stream, []).append((duration, span.trace_id, span.span_id))

    # -- output ------------------------------------------------------------

    def close(self, idle_advance_ns: int = 0) -> list[LatencyWindow]:
        """Emit and forget every window whose end is at or before the watermark.

        ``idle_advance_ns`` moves the watermark further than the data alone
        would, for when input has gone idle (the caller measures idleness on
        its own clock). The advanced watermark is kept: it never moves back.
        Windows come sorted by (start, service, operation).
        """
        if idle_advance_ns < 0:
            raise ValueError("idle_advance_ns must not be negative")
        if self._max_end is None:
            return []
        candidate = self._max_end - self.allowed_lateness_ns + idle_advance_ns
        if self._watermark is None or candidate > self._watermark:
            self._watermark = candidate
        watermark = self._watermark
        closing = sorted(s for s in self._open if s + self.window_ns <= watermark)
        out = self._emit(closing)
        # Streams go quiet a window at a time: look at every stream only when the watermark enters a new window.
        if watermark // self.window_ns != self._forgot_at // self.window_ns:
            self._forgot_at = watermark
            self._forget_quiet_streams(watermark)
        return out

    def flush(self) -> list[LatencyWindow]:
        """Emit every open window (shutdown, end of a replay).

        The watermark moves past the last emitted window, so spans arriving
        afterwards for those windows count as late instead of reopening them.
        """
        starts = sorted(self._open)
        out = self._emit(starts)
        if starts:
            last_end = starts[-1] + self.window_ns
            if self._watermark is None or last_end > self._watermark:
                self._watermark = last_end
        if self._watermark is not None:
            self._forget_quiet_streams(self._watermark)
        return out

    # -- introspection -----------------------------------------------------

    @property
    def open_windows(self) -> int:
        """Number of (stream, window) pairs still open."""
        return sum(len(by_stream) for by_stream in self._open.values())

    @property
    def streams(self) -> int:
        """Number of streams currently counted against ``max_streams``."""
        return len(self._streams)

    @property
    def watermark(self) -> int | None:
        """Current event-time watermark in ns (None before the first entry span)."""
        return self._watermark

    def stats(self) -> dict[str, int | None]:
        """Counters for health reporting."""
        return {
            "open_windows": self.open_windows,
            "streams": self.streams,
            "late_spans": self.late_spans,
            "overflow_spans": self.overflow_spans,
            "watermark": self._watermark,
        }

    # -- internals ---------------------------------------------------------

    def _emit(self, starts: Sequence[int]) -> list[LatencyWindow]:
        out: list[LatencyWindow] = []
        for start in starts:
            by_stream = self._open.pop(start)
            for (service, operation) in sorted(by_stream):
                samples = sorted(by_stream[(service, operation)])
                values = [d for d, _, _ in samples]
                out.append(
                    LatencyWindow(
                        service=service,
                        operation=operation,
                        start_unix_nano=start,
                        end_unix_nano=start + self.window_ns,
                        count=len(values),
                        p50_ns=nearest_rank(values, 0.50),
                        p95_ns=nearest_rank(values, 0.95),
                        p99_ns=nearest_rank(values, 0.99),
                        max_ns=values[-1],
                        samples=tuple(samples),
                    )
                )
        return out

    def _forget_quiet_streams(self, watermark: int) -> None:
        horizon = watermark - 2 * self.window_ns
        quiet = [stream for stream, last_end in self._streams.items() if last_end < horizon]
        for stream in quiet:
            del self._streams[stream]
