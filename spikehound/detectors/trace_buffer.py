"""A bounded buffer of recent traces, assembled from spans as they are committed.

Attribution needs whole traces of the last window or two: the slow ones of a
spike window, and a few normal ones to learn what normal looks like. Storage
has them too, but reading them back on the writer thread would slow ingest;
keeping a compact copy of the recent ones is cheaper. Each span is held as a
plain tuple (no attributes, no payload), about 300 bytes plus its name where
that is longer than 64 characters (a service and host are one string per
process, shared). The buffer is bounded by a span count and by those bytes
(so long span names cannot hold gigabytes): when either is exceeded, the
oldest traces (by first arrival) go first, whole, and are counted.

>>> from spikehound.model import SpanKind, StatusCode
>>> def span(trace, i, parent=None):
...     return Span(trace_id=bytes([trace]) * 16, span_id=bytes([i]) * 8, parent_span_id=parent,
...                 service="svc", host="h1", name=f"op{i}", kind=SpanKind.INTERNAL,
...                 start_unix_nano=0, end_unix_nano=10, status=StatusCode.UNSET)
>>> buf = TraceBuffer(max_spans=3)
>>> _ = buf.add([span(1, 1), span(1, 2, bytes([1]) * 8), span(2, 3)])
>>> _ = buf.add([span(3, 4)])  # full: trace 1 (two spans) is evicted whole
>>> buf.spans, buf.evicted_traces, [s.name for s in buf.trace(bytes([2]) * 16)]
(2, 1, ['op3'])
>>> buf.trace(bytes([1]) * 16)
[]

A span seen again (a retried export) is buffered once, and left out of what add() returns:

>>> buf = TraceBuffer(max_spans=50)
>>> _ = buf.add([span(1, 1)])
>>> [s.name for s in buf.add([span(1, 1), span(1, 2), span(1, 2), span(2, 3)])]
['op2', 'op3']
>>> big = [span(5, i) for i in range(1, 20)]  # past _SCAN_SPANS a trace's span ids are kept in a set
>>> len(buf.add(big)), len(buf.add(big)), buf.spans
(19, 0, 22)
>>> buf.bytes == 22 * RECORD_BYTES + 19 * SPAN_ID_BYTES
True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from spikehound.model import Span, SpanKind, StatusCode

__all__ = ["TraceBuffer"]

# (span_id, parent_span_id, service, name, kind, start, end, host)
Record = tuple[bytes, bytes | None, str, str, int, int, int, str | None]
SPAN_ID_BYTES = 90  # a span id in a trace's id set (see add): the bytes object and its set slot
_SCAN_SPANS = 16  # a trace of at most this many buffered spans is scanned for a repeat instead of given a set
RECORD_BYTES = 300  # a record's tuple, ids, times, list slot and a short name; a longer name counts on top
SHORT_NAME = 64
MAX_CALLEES = 64  # where one request went is named by a few; a request that fans out wider is not read further


class TraceBuffer:
    """Recent traces by trace id, bounded by ``max_spans`` and ``max_bytes`` (estimated) in total."""

    def __init__(self, max_spans: int = 200_000, max_bytes: int = 128 * 2**20) -> None:
        if max_spans < 1 or max_bytes < 1:
            raise ValueError("max_spans and max_bytes must be at least 1")
        self.max_spans = max_spans
        self.max_bytes = max_bytes
        self.spans = 0
        self.bytes = 0
        self.evicted_traces = 0
        # Insertion order is first arrival: the first key is always the oldest trace. An OrderedDict, because
        # a plain dict finds its first key by skipping the slots of every key deleted before it, which made
        # evicting from the front cost more than everything else ingest does.
        self._traces: OrderedDict[bytes, list[Record]] = OrderedDict()
        self._long_names: dict[bytes, int] = {}  # trace id -> characters in its names longer than SHORT_NAME
        # trace id -> (children by parent span id, service by span id); valid until the next add()
        self._index: dict[bytes, tuple[dict[bytes, list[Record]], dict[bytes, str]]] = {}
        # trace id -> (start of its buffered part, its services); valid until the next add(), like _index:
        # detection asks them of the same traces many times between two adds
        self._summary: dict[bytes, tuple[int, frozenset[str]]] = {}
        # trace id -> its span ids, for a trace of more than _SCAN_SPANS buffered spans (see add); dropped with
        # the trace. Its size is counted in ``bytes`` (SPAN_ID_BYTES a span).
        self._ids: dict[bytes, set[bytes]] = {}

    def add(self, spans: Sequence[Span]) -> Sequence[Span]:
        """Buffer ``spans``; return them less those whose (trace id, span id) was buffered already or came
        earlier in ``spans`` (a retried export whose commit succeeded but whose answer was lost): ``spans``
        itself when none repeats.

        The check rides on the look-up of each span's trace that buffering does anyway: a span of a trace
        first seen in this call is taken as new (a repeat within one export is a sender's bug, not a retry,
        and most spans of a batch are of such traces); one of a trace with few buffered spans is compared
        with them; a larger trace gets a set of its span ids, counted in ``bytes`` (SPAN_ID_BYTES a span)
        and dropped with the trace.
        """
        traces, ids = self._traces, self._ids
        fresh: set[bytes] = set()  # traces first seen in this call
        if self._index:
            self._index = {}
        if self._summary:
            self._summary = {}
        long_names = self._long_names
        added = chars = id_bytes = 0
        out: list[Span] | None = None  # the fresh spans, made only once a repeat is found
        for i, s in enumerate(spans):
            trace_id = s.trace_id
            records = traces.get(trace_id)
            if records is None:
                traces[trace_id] = records = []
                fresh.add(trace_id)
            elif trace_id in fresh:
                pass
            elif len(records) <= _SCAN_SPANS:
                span_id = s.span_id
                repeat = False
                for r in records:
                    if r[0] == span_id:
                        repeat = True
                        break
                if repeat:
                    if out is None:
                        out = list(spans[:i])
                    continue
            else:
                seen = ids.get(trace_id)
                if seen is None:
                    ids[trace_id] = seen = {r[0] for r in records}
                    id_bytes += len(seen) * SPAN_ID_BYTES
                if s.span_id in seen:
                    if out is None:
                        out = list(spans[:i])
                    continue
                seen.add(s.span_id)
                id_bytes += SPAN_ID_BYTES
            if out is not None:
                out.append(s)
            name = s.name
            records.append((s.span_id, s.parent_span_id, s.service, name, int(s.kind), s.start_unix_nano,
                            s.end_unix_nano, s.host))
            if len(name) > SHORT_NAME:  # rare: counted per trace, so that evicting it need not read its names
                chars += len(name)
                long_names[trace_id] = long_names.get(trace_id, 0) + len(name)
            added += 1
        self.spans += added
        self.bytes += added * RECORD_BYTES + chars + id_bytes
        while (self.spans > self.max_spans or self.bytes > self.max_bytes) and traces:
            trace_id, evicted = traces.popitem(last=False)
            self.spans -= len(evicted)
            self.bytes -= len(evicted) * RECORD_BYTES + (long_names.pop(trace_id, 0) if long_names else 0)
            self.evicted_traces += 1
            if ids:
                seen = ids.pop(trace_id, None)
                if seen is not None:
                    self.bytes -= len(seen) * SPAN_ID_BYTES
        return spans if out is None else out

    def trace(self, trace_id: bytes) -> list[Span]:
        """The buffered spans of one trace as model spans (empty when unknown or evicted)."""
        return [Span(trace_id=trace_id, span_id=r[0], parent_span_id=r[1], service=r[2], name=r[3],
                     kind=SpanKind(r[4]), start_unix_nano=r[5], end_unix_nano=r[6], host=r[7],
                     status=StatusCode.UNSET, attributes={})
                for r in self._traces.get(trace_id, ())]

    def callees_of(self, trace_id: bytes, span_id: bytes) -> list[str]:
        """What the entry span ``span_id`` called itself: ``"service operation"`` of each SERVER span its own
        CLIENT spans reached (through its service's INTERNAL spans), or the CLIENT span's name where no
        server answered; each once. Empty when the trace is not buffered.

        This is where a request with a generic entry name (``/*``) went: for a gateway, the backend route.
        A span that claims to be its own ancestor (reused span ids) is walked once.
        """
        index = self._index.get(trace_id)
        if index is None:
            records = self._traces.get(trace_id)
            if not records:
                return []
            # Built once per trace between two add() calls: a trace of many generic entries asks many times.
            index = self._index[trace_id] = _index(records)
        children, service_of = index
        service = service_of.get(span_id)
        if service is None:
            return []
        out: dict[str, None] = {}
        seen = {span_id}
        stack = [span_id]
        while stack:
            for child in children.get(stack.pop(), ()):
                if len(out) >= MAX_CALLEES:
                    return list(out)
                if child[2] != service:
                    if child[4] == SpanKind.SERVER:  # called without a CLIENT span of its own (not instrumented)
                        out[f"{child[2]} {child[3]}"] = None
                    continue
                if child[4] == SpanKind.CLIENT:
                    answers = [c for c in children.get(child[0], ()) if c[4] == SpanKind.SERVER]
                    for name in [f"{a[2]} {a[3]}" for a in answers] or [child[3]]:
                        out[name] = None
                elif child[4] == SpanKind.INTERNAL and child[0] not in seen:
                    seen.add(child[0])
                    stack.append(child[0])
        return list(out)

    def trace_start(self, trace_id: bytes) -> int | None:
        """When the buffered part of a trace began (None when it is not buffered)."""
        summary = self._summarize(trace_id)
        return summary[0] if summary else None

    def touches(self, trace_id: bytes, service: str) -> bool:
        """Whether a buffered span of the trace belongs to ``service`` (False when the trace is unknown)."""
        summary = self._summarize(trace_id)
        return summary is not None and service in summary[1]

    def _summarize(self, trace_id: bytes) -> tuple[int, frozenset[str]] | None:
        summary = self._summary.get(trace_id)
        if summary is None:
            records = self._traces.get(trace_id)
            if not records:
                return None
            summary = self._summary[trace_id] = (min(r[5] for r in records), frozenset(r[2] for r in records))
        return summary

    def __contains__(self, trace_id: bytes) -> bool:
        return trace_id in self._traces

    def __len__(self) -> int:
        return len(self._traces)


def _index(records: list[Record]) -> tuple[dict[bytes, list[Record]], dict[bytes, str]]:
    children: dict[bytes, list[Record]] = {}
    service_of: dict[bytes, str] = {}
    for r in records:
        if r[1] is not None and r[1] != r[0]:  # a span that names itself its parent is no one's child
            children.setdefault(r[1], []).append(r)
        service_of[r[0]] = r[2]
    return children, service_of
