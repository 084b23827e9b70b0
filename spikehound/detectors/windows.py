"""Event-time latency windows: spans in, closed per-stream windows out.

Two kinds of stream are cut into windows (see :mod:`spikehound.detectors.streams`):
**entry streams**, one per (service, operation) of entry spans (trace roots
and SERVER spans), and **hop streams**, one per caller -> callee edge measured
on the caller's CLIENT spans. A CLIENT span is joined to its callee by the
SERVER span whose parent it is, which may arrive before or after it; the join
is made when the CLIENT span's window closes, so the order of arrival does not
matter. Where no SERVER span answers (a database, an uninstrumented service)
the hop is named by what the CLIENT span says it called. An entry operation
with a generic name (``/*``, ``HTTP GET``) is split by route: its
``http.route``/``url.template`` when it has one, else the operations its own
calls reached, which ``route_of`` (given by the engine) reads off the trace.

Windows are aligned to the Unix epoch and cut by span **end** time, so a
request belongs to the window in which it finished, which is when its latency
became visible to the caller. Each request counts once per stream and window:
a trace that calls the same edge five times in a loop is one request of that
edge (its slowest call), so that one slow trace cannot pose as five.

Windows close on a watermark that follows the largest end time seen minus an
allowed lateness, never on a wall clock. This module reads no clock at all:
when input goes idle the caller says so through ``close(idle_advance_ns=...)``.
The same input therefore gives the same windows whether it arrives live, out
of order within the lateness, or as a fast replay of yesterday's capture.

Quantiles use the nearest-rank method, so every reported p50/p95/p99 is a
latency some request really had, never an interpolation between two.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from typing import TypeVar

from spikehound.detectors.streams import (
    UNINSTRUMENTED,
    StreamKey,
    is_generic_operation,
    peer_label,
    route_attribute,
    split_operation,
)
from spikehound.model import LatencyWindow, Span, SpanKind

__all__ = ["LatencyWindows", "RouteOf", "Sample", "nearest_rank", "remember"]

Sample = tuple[int, bytes, bytes, int]  # (duration ns, trace id, span id, end ns)
# An open window's requests of one stream, as columns: durations, trace ids, span ids, ends. Columns, not a
# tuple per request: a catch-up holds hundreds of thousands of requests, and a small object each (a tuple,
# two ints) left Python's heap in pieces after they were freed.
Columns = tuple[array, list[bytes], list[bytes], array]
# The calls of one (caller, CLIENT span name, what it said it called, whether that names a place) in a window.
HopKey = tuple[str, str, str | None, bool]
# (trace id, entry span id) -> the operations the entry's own calls reached, for splitting a generic entry
RouteOf = Callable[[bytes, bytes], list[str]]
_GENERIC_CACHE_LIMIT = 4096
_REREAD_LABEL = 64  # of the calls of a (caller, name) that always says the same, one in this many is read again
_TRUSTED_ANSWERED = 8  # calls of one (caller, name) answered in a row: later ones are not asked where they went
_NEVER_ANSWERED = 3  # calls of one (caller, name) left unanswered in a row: later ones are named at once
_SEVERAL = ("", "")  # in _answered_by: the calls of a (caller, name) were answered by more than one callee
_EXACT: dict[float, tuple[int, int]] = {}  # quantile -> (numerator, denominator), for nearest_rank
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def nearest_rank(sorted_values: Sequence[T], q: float) -> T:
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
    exact = _EXACT.get(q)
    if exact is None:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        # Exact decimal arithmetic: 0.57 * 100 is 56.99999999999999 in floats, which would pick the wrong rank.
        fraction = Fraction(repr(float(q)))
        exact = (fraction.numerator, fraction.denominator)
        if len(_EXACT) < 64:
            _EXACT[q] = exact
    rank = -(-exact[0] * n // exact[1])  # ceil(q * n) in integers
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
        Most distinct streams tracked at once; spans of further new streams are counted in
        ``overflow_spans`` and dropped.
    hops
        Whether hop streams (CLIENT spans, by callee) are cut as well as entry streams.
    route_of
        How a generic entry with no route attribute is split (None: it is not split).

    Example (1 s windows, no lateness allowed):

    >>> from spikehound.model import SpanKind, StatusCode
    >>> def span(i, start_ms, end_ms, kind=SpanKind.SERVER, parent=None, service="gateway", name="POST /predict",
    ...          trace=None):
    ...     return Span(trace_id=bytes([trace or i]) * 16, span_id=bytes([i]) * 8, parent_span_id=parent,
    ...                 service=service, host=None, name=name, kind=kind, start_unix_nano=start_ms * 1_000_000,
    ...                 end_unix_nano=end_ms * 1_000_000, status=StatusCode.UNSET, attributes={})
    >>> lw = LatencyWindows(window_ns=1_000_000_000, allowed_lateness_ns=0)
    >>> lw.add([span(1, 100, 120), span(2, 200, 260), span(3, 900, 1_100)])
    >>> [(w.start_unix_nano, w.count, w.p99_ns) for w in lw.close()]
    [(0, 2, 60000000)]
    >>> lw.open_windows, lw.streams
    (1, 1)
    >>> [(w.start_unix_nano, w.count, w.max_ns) for w in lw.flush()]
    [(1000000000, 1, 200000000)]

    A CLIENT span is a hop of its caller, named by the SERVER span that answered it:

    >>> lw = LatencyWindows(window_ns=1_000_000_000, allowed_lateness_ns=0)
    >>> call = span(4, 10, 90, SpanKind.CLIENT, bytes([9]) * 8, name="HTTP GET")
    >>> answer = span(5, 20, 80, SpanKind.SERVER, call.span_id, service="model", name="GET /infer", trace=4)
    >>> lw.add([answer, call])
    >>> [(w.peer_service, w.service, w.operation, w.max_ns) for w in lw.flush()]
    [(None, 'model', 'GET /infer', 60000000), ('gateway', 'model', 'GET /infer', 80000000)]
    """

    hold: int | None = None  # class default for checkpoints from before the hold existed

    def __init__(
        self,
        window_ns: int = 10_000_000_000,
        allowed_lateness_ns: int = 5_000_000_000,
        max_streams: int = 10_000,
        hops: bool = True,
        route_of: RouteOf | None = None,
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
        self.hops = hops
        self.route_of = route_of
        # Windows with fewer requests count each trace once (its slowest call): they are judged request by
        # request, where a loop of calls in one slow trace must not pose as many. Busier ones are judged by
        # their p99, where it changes nothing, and skip the cost.
        self.dedupe_below = 400
        # What these four learned of a (caller, CLIENT span name) is kept for at most max_streams of them, the
        # oldest forgotten first (see remember): a flood of one-off names must not fill them for good.
        # (caller, CLIENT span name) -> how many of its calls in a row nobody answered (a database)
        self._never_answered: dict[tuple[str, str], int] = {}
        # (caller, CLIENT span name) -> how many of its calls in a row were answered
        self._answered_run: dict[tuple[str, str], int] = {}
        # (caller, CLIENT span name) -> [what it said it called, names a place, said so in a row, calls since
        # it was last read]
        self._labels: dict[tuple[str, str], list] = {}
        # (caller, CLIENT span name) -> the callee (service, operation) that answers its calls, or _SEVERAL. A call
        # of it left unanswered is one whose answer did not come in time (late past the lateness, lost), not a
        # call into an uninstrumented place: it is counted where its calls go, never in a stream of odd names.
        self._answered_by: dict[tuple[str, str], tuple[str, str]] = {}
        self.unjoined_calls = 0  # ... left out instead, where several callees answer them: where it went is unknown
        # (caller, CLIENT span name) -> what its last unanswered call said it called, where it said something;
        # attribution reads it: a slow query's time was added in the database.
        self.unanswered_peer: dict[tuple[str, str], str] = {}
        # Labels of unanswered calls that name a kind of thing (``mysql``), not a place: no locus (bounded).
        self.kinds: set[str] = set()

        self.late_spans = 0
        self.overflow_spans = 0
        # window start -> stream -> its requests. Keyed by start first so that closing walks only the few oldest
        # starts, not every stream.
        self._open: dict[int, dict[StreamKey, Columns]] = {}
        # Samples whose stream is known only when their window closes: CLIENT spans (by the callee that
        # answered them, window start -> their caller's key -> its calls) and generic entries without a route
        # (by where they went, window start -> records).
        self._hops_open: dict[int, dict[HopKey, Columns]] = {}
        self._generic_open: dict[int, list[tuple[int, bytes, bytes, int, str, str, bool]]] = {}
        # Records that could not be named when their window closed, waiting for the next (see _name_late_streams):
        # window start -> (generic entries, hops).
        self._second_chance: dict[int, tuple[list[tuple[int, bytes, bytes, int, str, str, bool]],
                                             list[tuple[int, bytes, bytes, int, str, str, str | None, bool]]]] = {}
        # SERVER spans by their parent (the CLIENT span that called them), bucketed by their own end window so
        # that the old ones go a window at a time: bucket start -> trace id + parent span id -> (service, operation).
        self._callees: dict[int, dict[bytes, tuple[str, str]]] = {}
        # Known streams -> largest end time seen on them. This is what the cardinality limit counts. A
        # stream is forgotten in close() once its last span ended more than 2 windows before the watermark;
        # by then it cannot have an open window. The table is thus bounded by max_streams and sheds streams
        # that went quiet.
        self._streams: dict[StreamKey, int] = {}
        self._roots: set[StreamKey] = set()  # streams of trace roots: what users see
        self._generic: dict[str, bool] = {}  # operation name -> is_generic_operation (a bounded cache)
        self._callee_names: dict[tuple[str, str], tuple[str, str]] = {}  # (service, name) -> itself, shared
        self._max_end: int | None = None
        # Stored so that an idle advance is never undone by the next add(): a window once emitted must
        # stay closed.
        self._watermark: int | None = None
        self._forgot_at = -(2**62)  # the watermark at the last sweep for quiet streams
        # While the collector catches up (a backlog after a storage outage or a restart), the watermark is
        # capped here: windows ending after it stay open, and a span is late only against it. None: no cap.
        self.hold: int | None = None

    def __getstate__(self) -> dict[str, object]:
        # route_of reads the engine's trace buffer, which is not part of a checkpoint: the engine sets it again.
        # A hold belongs to the collector's catch-up, which a restart begins again from its own state.
        return {**self.__dict__, "route_of": None, "hold": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        # A checkpoint from before callees were remembered starts without them.
        self.__dict__.update({"_answered_by": {}, "unjoined_calls": 0, **state})

    # -- input -------------------------------------------------------------

    def add(self, spans: Iterable[Span]) -> None:
        """Account the entry and CLIENT spans of ``spans`` into their open windows."""
        # The hot path of ingest: everything it touches is bound to a local name first.
        window_ns, lateness, hops = self.window_ns, self.allowed_lateness_ns, self.hops
        server, client = SpanKind.SERVER, SpanKind.CLIENT
        open_, streams, generic, callees = self._open, self._streams, self._generic, self._callees
        hops_open, answered, labels, names = self._hops_open, self._answered_run, self._labels, self._callee_names
        max_end, watermark, late = self._max_end, self._watermark, 0
        hold = self.hold
        for span in spans:
            kind, parent = span.kind, span.parent_span_id
            if kind == client:
                if not hops:
                    continue
            elif kind != server and parent is not None:
                continue  # an INTERNAL (or messaging) child: part of some entry's time, no stream of its own
            end = span.end_unix_nano
            if max_end is None or end > max_end:
                max_end = end
                if watermark is None or end - lateness > watermark:
                    watermark = end - lateness
            start = end - end % window_ns
            if parent is not None and hops and kind == server:
                # Remembered even when late: it names the hop of its caller, which may still be open.
                bucket = callees.get(start)
                if bucket is None:
                    callees[start] = bucket = {}
                # Keyed by trace and parent: span ids are unique only within a trace, and another sender's
                # reused id must not rename someone else's hop.
                callee = (span.service, span.name)
                # One shared (service, name) per callee, not one per span: a catch-up holds these by the
                # hundred thousand (a bounded cache, like _generic).
                shared = names.get(callee)
                if shared is None:
                    if len(names) >= _GENERIC_CACHE_LIMIT:
                        names.clear()
                    names[callee] = shared = callee
                bucket[span.trace_id + parent] = shared
            if watermark is not None and start + window_ns <= watermark and (hold is None or start + window_ns <= hold):
                # Its window is closed (maybe already emitted): counting it now would change a result that
                # was already reported.
                late += 1
                continue
            # A span whose clock stepped back (end < start) has no real latency to report; 0 keeps quantiles
            # meaningful instead of negative.
            duration = end - span.start_unix_nano
            if duration < 0:
                duration = 0
            name = span.name
            if kind == client:
                # What it says it called names a call nobody answers (a database), so that calls from many
                # services into one database name one place. Reading it decodes the span's attributes, the
                # dearest thing here: skipped for calls of a (caller, name) whose recent calls were answered.
                # A call that always says the same (a query into one database) is read one time in
                # _REREAD_LABEL once it said it _TRUSTED_ANSWERED times in a row.
                calls = (span.service, name)
                if answered.get(calls, 0) >= _TRUSTED_ANSWERED:
                    peer, place = None, False
                else:
                    memo = labels.get(calls)
                    if memo is not None and memo[2] >= _TRUSTED_ANSWERED and memo[3] % _REREAD_LABEL:
                        memo[3] += 1
                        peer, place = memo[0], memo[1]
                    else:
                        peer, place = peer_label(span.attributes)
                        if memo is None:
                            remember(labels, calls, [peer, place, 1, 1], self.max_streams)
                        elif memo[0] == peer:
                            memo[2] += 1
                            memo[3] += 1
                        else:
                            memo[0], memo[1], memo[2], memo[3] = peer, place, 1, 1
                pending = hops_open.get(start)
                if pending is None:
                    hops_open[start] = pending = {}
                key = (span.service, name, peer, place)
                held = pending.get(key)
                if held is None:
                    pending[key] = held = _columns()
                held[0].append(duration)
                held[1].append(span.trace_id)
                held[2].append(span.span_id)
                held[3].append(end)
                continue
            is_generic = generic.get(name)
            if is_generic is None:
                is_generic = self._is_generic(name)
            if is_generic:
                route = route_attribute(span.attributes)
                if route is None:
                    self._generic_open.setdefault(start, []).append(
                        (duration, span.trace_id, span.span_id, end, span.service, name, parent is None))
                    continue
                name = split_operation(name, route=route)
            stream = (span.service, name, None)  # equal to, and hashed like, StreamKey(service, name)
            last = streams.get(stream)
            if last is None:
                if len(streams) >= self.max_streams:
                    self.overflow_spans += 1
                    continue
                streams[stream] = end  # type: ignore[index]
                if parent is None:
                    self._roots.add(stream)  # type: ignore[arg-type]
            elif end > last:
                streams[stream] = end  # type: ignore[index]
            by_stream = open_.get(start)
            if by_stream is None:
                open_[start] = by_stream = {}
            held = by_stream.get(stream)  # type: ignore[call-overload]
            if held is None:
                by_stream[stream] = held = _columns()  # type: ignore[index]
            held[0].append(duration)
            held[1].append(span.trace_id)
            held[2].append(span.span_id)
            held[3].append(end)
        self._max_end, self._watermark = max_end, watermark
        self.late_spans += late

    # -- output ------------------------------------------------------------

    def close(self, idle_advance_ns: int = 0) -> list[LatencyWindow]:
        """Emit and forget every window whose end is at or before the watermark.

        ``idle_advance_ns`` moves the watermark further than the data alone
        would, for when input has gone idle (the caller measures idleness on
        its own clock). The advanced watermark is kept: it never moves back.
        Windows come sorted by (start, stream).
        """
        if idle_advance_ns < 0:
            raise ValueError("idle_advance_ns must not be negative")
        if self._max_end is None:
            return []
        candidate = self._max_end - self.allowed_lateness_ns + idle_advance_ns
        if self._watermark is None or candidate > self._watermark:
            self._watermark = candidate
        watermark = self.watermark
        assert watermark is not None
        closing = sorted(s for s in self._starts() if s + self.window_ns <= watermark)
        out = self._emit(closing)
        # Streams go quiet a window at a time: look at every stream only when the watermark enters a new window.
        if watermark // self.window_ns != self._forgot_at // self.window_ns:
            self._forgot_at = watermark
            self._forget_quiet(watermark)
        return out

    def flush(self) -> list[LatencyWindow]:
        """Emit every open window (shutdown, end of a replay).

        The watermark moves past the last emitted window, so spans arriving
        afterwards for those windows count as late instead of reopening them.
        """
        starts: list[int] = []
        out: list[LatencyWindow] = []
        while pending := sorted(self._starts()):  # a second chance may add the window after the last
            out += self._emit(pending)
            starts += pending
        if starts:
            last_end = starts[-1] + self.window_ns
            if self._watermark is None or last_end > self._watermark:
                self._watermark = last_end
        if self._watermark is not None:
            self._forget_quiet(self._watermark)
        return out

    def limit(self, latest_ns: int) -> bool:
        """Bring event time back to at most ``latest_ns`` (a clock plus its skew); True when it had run past.

        For a checkpoint taken after a span from a wrong clock moved the watermark years ahead: its windows
        (beyond ``latest_ns``) are dropped, and the watermark starts again from the latest span still held in
        an open window (or from the next span, when none is): the windows that wrong watermark closed
        were closed by nothing real.
        """
        if (self._max_end is None or self._max_end <= latest_ns) and (
                self._watermark is None or self._watermark <= latest_ns - self.allowed_lateness_ns):
            return False
        for pending in (self._open, self._hops_open, self._generic_open, self._callees, self._second_chance):
            for start in [s for s in pending if s >= latest_ns]:
                del pending[start]
        ends = [max(held[3]) for by_window in (*self._open.values(), *self._hops_open.values())
                for held in by_window.values()]
        ends += [record[3] for records in self._generic_open.values() for record in records]
        self._max_end = max(ends, default=None)
        self._watermark = None if self._max_end is None else self._max_end - self.allowed_lateness_ns
        for stream, last in self._streams.items():
            self._streams[stream] = min(last, latest_ns)
        return True

    # -- introspection -----------------------------------------------------

    @property
    def open_windows(self) -> int:
        """Number of (stream, window) pairs still open (those still to be named count once per window)."""
        return (sum(len(by_stream) for by_stream in self._open.values())
                + len(self._hops_open.keys() | self._generic_open.keys()))

    @property
    def streams(self) -> int:
        """Number of streams currently counted against ``max_streams``."""
        return len(self._streams)

    @property
    def watermark(self) -> int | None:
        """Current event-time watermark in ns (None before the first span), capped by ``hold``."""
        if self.hold is not None and self._watermark is not None and self._watermark > self.hold:
            return self.hold
        return self._watermark

    @property
    def earliest_open_ns(self) -> int | None:
        """The start of the earliest window still open (None when none is)."""
        return min(self._starts(), default=None)

    @property
    def data_watermark(self) -> int | None:
        """The watermark the data alone (and idle advances) reached, ignoring ``hold``."""
        return self._watermark

    def is_root(self, stream: StreamKey) -> bool:
        """Whether ``stream`` is of trace roots (the requests users make)."""
        return stream in self._roots

    def stats(self) -> dict[str, int | None]:
        """Counters for health reporting."""
        return {
            "open_windows": self.open_windows,
            "streams": self.streams,
            "late_spans": self.late_spans,
            "overflow_spans": self.overflow_spans,
            "unjoined_calls": self.unjoined_calls,
            "watermark": self._watermark,
        }

    # -- internals ---------------------------------------------------------

    def _starts(self) -> set[int]:
        return self._open.keys() | self._hops_open.keys() | self._generic_open.keys() | self._second_chance.keys()

    def _is_generic(self, name: str) -> bool:
        known = self._generic.get(name)
        if known is None:
            if len(self._generic) >= _GENERIC_CACHE_LIMIT:
                self._generic.clear()  # a storm of one-off names must not grow it
            known = self._generic[name] = is_generic_operation(name)
        return known

    def _admit(self, stream: StreamKey, end: int, root: bool = False) -> bool:
        """Count ``stream`` against the limit as it is named at close time; False when it does not fit."""
        last = self._streams.get(stream)
        if last is None:
            if len(self._streams) >= self.max_streams:
                self.overflow_spans += 1
                return False
            self._streams[stream] = end
            if root:
                self._roots.add(stream)
        elif end > last:
            self._streams[stream] = end
        return True

    def _name_late_streams(self, start: int, by_stream: dict[StreamKey, list[Sample]]) -> None:
        """Name the hops and generic entries of window ``start`` and add them to ``by_stream``.

        What cannot be named yet (a CLIENT span nobody answered, a generic entry whose calls are not
        buffered) gets a second chance a window later: the callee's exporter may send on a slower schedule
        than the caller's. It is then counted in that later window, under the right name; what is still
        unnamed then is named by what it says it called.
        """
        w = self.window_ns
        later = self._second_chance.setdefault(start + w, ([], []))
        retried = self._second_chance.pop(start, ([], []))
        named: dict[tuple[str, str, str | None], list[Sample]] = {}
        roots: set[tuple[str, str, str | None]] = set()
        route_of, answered_by = self.route_of, self._answered_by
        for chance, records in enumerate((self._generic_open.pop(start, ()), retried[0])):
            for record in records:
                duration, trace_id, span_id, end, service, name, root = record
                callees = route_of(trace_id, span_id) if route_of is not None else []
                unknown = False
                if callees and answered_by:
                    callees, unknown = _usual_callees(answered_by, service, callees)
                if (not callees or unknown) and chance == 0 and route_of is not None:
                    later[0].append(record)
                    continue
                if unknown:  # a call whose answer never came, of a name several callees answer: no route
                    self.unjoined_calls += 1
                    continue
                stream = (service, split_operation(name, callees=callees), None)
                named.setdefault(stream, []).append((duration, trace_id, span_id, end))
                if root:
                    roots.add(stream)
        # A CLIENT span is answered by a SERVER span that ended in its own window or near it (up to two
        # windows back, or one ahead when the callee's clock runs ahead).
        empty: dict[bytes, tuple[str, str]] = {}
        here, before, ahead, long_before = (self._callees.get(b, empty) for b in (start, start - w, start + w,
                                                                                    start - 2 * w))
        unanswered, never, answered = UNINSTRUMENTED, self._never_answered, self._answered_run
        for chance, records in enumerate((_hop_records(self._hops_open.pop(start, {})), retried[1])):
            for record in records:
                duration, trace_id, span_id, end, caller, name, peer, place = record
                calls = (caller, name)
                key = trace_id + span_id
                callee = here.get(key) or before.get(key) or ahead.get(key) or long_before.get(key)
                if callee is None:
                    # A call that was never answered (a database) need not wait for a second chance.
                    if chance == 0 and never.get(calls, 0) < _NEVER_ANSWERED:
                        later[1].append(record)
                        continue
                    if chance == 1:
                        remember(never, calls, never.get(calls, 0) + 1, self.max_streams)
                    answered.pop(calls, None)  # its next calls are read again
                    usual = answered_by.get(calls)
                    if usual == _SEVERAL:  # its answer did not come, and several callees answer such calls
                        self.unjoined_calls += 1
                        continue
                    if usual is not None:  # its answer did not come: counted where its calls go
                        stream = (usual[0], usual[1], caller)
                    else:
                        stream = (peer or unanswered, name, caller)
                        if place:
                            remember(self.unanswered_peer, calls, peer, self.max_streams)
                        elif peer != unanswered and len(self.kinds) < self.max_streams:
                            self.kinds.add(peer)
                else:
                    if never:
                        never.pop(calls, None)
                    usual = answered_by.get(calls)
                    if usual is None:
                        remember(answered_by, calls, callee, self.max_streams)
                    elif usual != callee and usual != _SEVERAL:
                        answered_by[calls] = _SEVERAL
                    run = answered.get(calls)
                    if run is None:
                        remember(answered, calls, 1, self.max_streams)
                    elif run < _TRUSTED_ANSWERED:
                        answered[calls] = run + 1
                    stream = (callee[0], callee[1], caller)
                samples = named.get(stream)
                if samples is None:
                    named[stream] = samples = []
                samples.append((duration, trace_id, span_id, end))
        if not later[0] and not later[1]:
            del self._second_chance[start + w]
        for stream, samples in named.items():
            if len(samples) < self.dedupe_below:
                samples = _slowest_per_trace(samples)
            if self._admit(StreamKey(*stream), samples[-1][3], stream in roots):  # a recent end is enough here
                by_stream.setdefault(StreamKey(*stream), []).extend(samples)
            else:
                self.overflow_spans += len(samples) - 1  # _admit counted one

    def _emit(self, starts: Sequence[int]) -> list[LatencyWindow]:
        out: list[LatencyWindow] = []
        for start in starts:
            by_stream = {stream: list(zip(*held, strict=True)) for stream, held in self._open.pop(start, {}).items()}
            self._name_late_streams(start, by_stream)
            for stream in sorted(by_stream, key=lambda k: (k[0], k[1], k[2] or "")):
                samples = by_stream[stream]
                if len(samples) < self.dedupe_below and stream not in self._roots and stream[2] is None:
                    samples = _slowest_per_trace(samples)  # a root is one per trace already; hops were done
                samples.sort()
                out.append(
                    LatencyWindow(
                        service=stream[0],
                        operation=stream[1],
                        start_unix_nano=start,
                        end_unix_nano=start + self.window_ns,
                        count=len(samples),
                        p50_ns=nearest_rank(samples, 0.50)[0],
                        p95_ns=nearest_rank(samples, 0.95)[0],
                        p99_ns=nearest_rank(samples, 0.99)[0],
                        max_ns=samples[-1][0],
                        samples=tuple(samples),
                        peer_service=stream[2],
                    )
                )
            # Callees are looked up up to two windows back; older ones can no longer be asked for.
            for bucket in [b for b in self._callees if b < start - 2 * self.window_ns]:
                del self._callees[bucket]
        return out

    def _forget_quiet(self, watermark: int) -> None:
        horizon = watermark - 2 * self.window_ns
        quiet = [stream for stream, last_end in self._streams.items() if last_end < horizon]
        for stream in quiet:
            del self._streams[stream]
            self._roots.discard(stream)
        for bucket in [b for b in self._callees if b < horizon - 2 * self.window_ns]:
            del self._callees[bucket]


def remember(table: dict[K, V], key: K, value: V, limit: int) -> None:
    """``table[key] = value``, forgetting the oldest entries first so that it keeps at most ``limit`` keys.

    >>> seen = {"a": 1, "b": 2}
    >>> remember(seen, "c", 3, limit=2); seen
    {'b': 2, 'c': 3}
    >>> remember(seen, "b", 5, limit=2); seen  # a key it holds is updated in place
    {'b': 5, 'c': 3}
    """
    if key not in table:
        while len(table) >= limit:  # more than one only after a restart with a lower limit
            del table[next(iter(table))]
    table[key] = value


def _columns() -> Columns:
    """Empty columns for one stream's (or one caller's calls') requests in an open window."""
    return array("q"), [], [], array("q")


def _usual_callees(answered_by: dict[tuple[str, str], tuple[str, str]], service: str,
                   callees: list[str]) -> tuple[list[str], bool]:
    """Where an entry's calls went, each unanswered CLIENT name of ``service`` that is answered as a rule
    named by its callee; and whether one of them is answered by several callees (where it went is unknown).

    >>> _usual_callees({("gw", "HTTP GET"): ("order", "GET /o"), ("gw", "HTTP POST"): _SEVERAL}, "gw",
    ...                ["HTTP GET", "pay POST /p"])
    (['order GET /o', 'pay POST /p'], False)
    >>> _usual_callees({("gw", "HTTP POST"): _SEVERAL}, "gw", ["HTTP POST"])[1]
    True
    """
    out, unknown = [], False
    for callee in callees:
        usual = answered_by.get((service, callee))
        if usual is None:
            out.append(callee)
        elif usual == _SEVERAL:
            unknown = True
        else:
            out.append(f"{usual[0]} {usual[1]}")
    return out, unknown


def _hop_records(by_key: dict[HopKey, Columns]) -> Iterator[tuple[int, bytes, bytes, int, str, str, str | None, bool]]:
    """A window's calls as records: (duration, trace id, span id, end, caller, name, peer, names a place)."""
    for (caller, name, peer, place), (durations, traces, spans, ends) in by_key.items():
        for duration, trace_id, span_id, end in zip(durations, traces, spans, ends, strict=True):
            yield duration, trace_id, span_id, end, caller, name, peer, place


def _slowest_per_trace(samples: list[Sample]) -> list[Sample]:
    """One sample per trace: its slowest (a loop of calls over one edge is one request of it)."""
    slowest: dict[bytes, Sample] = {}
    for sample in samples:
        seen = slowest.get(sample[1])
        if seen is None or sample[0] > seen[0]:
            slowest[sample[1]] = sample
    return samples if len(slowest) == len(samples) else list(slowest.values())
