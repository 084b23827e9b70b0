"""A bounded buffer of recent traces, assembled from spans as they are committed.

Attribution needs whole traces of the last window or two: the slow ones of a
spike window, and a few normal ones to learn what normal looks like. Storage
has them too, but reading them back on the writer thread would slow ingest;
keeping a compact copy of the recent ones is cheaper. Each span is held as a
plain tuple (no attributes, no payload), about 300 bytes plus its name, and the
buffer is bounded by a span count and by those bytes (estimated from the name
lengths, so long span names cannot hold gigabytes): when either is exceeded, the
oldest traces (by first arrival) go first, whole, and are counted.

>>> from spikehound.model import SpanKind, StatusCode
>>> def span(trace, i, parent=None):
...     return Span(trace_id=bytes([trace]) * 16, span_id=bytes([i]) * 8, parent_span_id=parent,
...                 service="svc", host="h1", name=f"op{i}", kind=SpanKind.INTERNAL,
...                 start_unix_nano=0, end_unix_nano=10, status=StatusCode.UNSET)
>>> buf = TraceBuffer(max_spans=3)
>>> buf.add([span(1, 1), span(1, 2, bytes([1]) * 8), span(2, 3)])
>>> buf.add([span(3, 4)])  # full: trace 1 (two spans) is evicted whole
>>> buf.spans, buf.evicted_traces, [s.name for s in buf.trace(bytes([2]) * 16)]
(2, 1, ['op3'])
>>> buf.trace(bytes([1]) * 16)
[]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from operator import itemgetter

from spikehound.model import Span, SpanKind, StatusCode

__all__ = ["TraceBuffer"]

# (span_id, parent_span_id, service, name, kind, start, end, host)
Record = tuple[bytes, bytes | None, str, str, int, int, int, str | None]
RECORD_BYTES = 300  # a record's tuple, ids, times and list slot; its name is counted by length on top
_NAME = itemgetter(3)  # a span's name may be its own string; its service and host are one per process, shared


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

    def add(self, spans: Iterable[Span]) -> None:
        traces = self._traces
        added = chars = 0
        for s in spans:
            records = traces.get(s.trace_id)
            if records is None:
                traces[s.trace_id] = records = []
            name = s.name
            records.append((s.span_id, s.parent_span_id, s.service, name, int(s.kind), s.start_unix_nano,
                            s.end_unix_nano, s.host))
            chars += len(name)
            added += 1
        self.spans += added
        self.bytes += added * RECORD_BYTES + chars
        while (self.spans > self.max_spans or self.bytes > self.max_bytes) and traces:
            evicted = traces.popitem(last=False)[1]
            self.spans -= len(evicted)
            self.bytes -= len(evicted) * RECORD_BYTES + sum(map(len, map(_NAME, evicted)))
            self.evicted_traces += 1

    def trace(self, trace_id: bytes) -> list[Span]:
        """The buffered spans of one trace as model spans (empty when unknown or evicted)."""
        return [Span(trace_id=trace_id, span_id=r[0], parent_span_id=r[1], service=r[2], name=r[3],
                     kind=SpanKind(r[4]), start_unix_nano=r[5], end_unix_nano=r[6], host=r[7],
                     status=StatusCode.UNSET, attributes={})
                for r in self._traces.get(trace_id, ())]

    def callees_of(self, trace_id: bytes, span_id: bytes) -> list[str]:
        """What the entry span ``span_id`` called itself: ``"service operation"`` of each SERVER span its own
        CLIENT spans reached (through its service's INTERNAL spans), or the CLIENT span's name where no
        server answered. Empty when the trace is not buffered.

        This is where a request with a generic entry name (``/*``) went: for a gateway, the backend route.
        """
        records = self._traces.get(trace_id)
        if not records:
            return []
        children: dict[bytes, list[Record]] = {}
        service = None
        for r in records:
            if r[1] is not None:
                children.setdefault(r[1], []).append(r)
            if r[0] == span_id:
                service = r[2]
        if service is None:
            return []
        out: list[str] = []
        stack = [span_id]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child[2] != service:
                    if child[4] == SpanKind.SERVER:  # called without a CLIENT span of its own (not instrumented)
                        out.append(f"{child[2]} {child[3]}")
                    continue
                if child[4] == SpanKind.CLIENT:
                    answers = [c for c in children.get(child[0], ()) if c[4] == SpanKind.SERVER]
                    out += [f"{a[2]} {a[3]}" for a in answers] or [child[3]]
                elif child[4] == SpanKind.INTERNAL:
                    stack.append(child[0])
        return out

    def __contains__(self, trace_id: bytes) -> bool:
        return trace_id in self._traces

    def __len__(self) -> int:
        return len(self._traces)
