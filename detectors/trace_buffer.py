"""A bounded buffer of recent traces, assembled from spans as they are committed.

Attribution needs whole traces of the last window or two: the slow ones of a
spike window, and a few normal ones to learn what normal looks like. Storage
has them too, but reading them back on the writer thread would slow ingest;
keeping a compact copy of the recent ones is cheaper. Each span is held as a
plain tuple (no attributes, no payload), about 300 bytes, and the buffer is
bounded by a span count: when full, the oldest traces (by first arrival) go
first, whole, and are counted.

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

from spikehound.model import Span, SpanKind, StatusCode

__all__ = ["TraceBuffer"]

# (span_id, parent_span_id, service, name, kind, start, end, host)
Record = tuple[bytes, bytes | None, str, str, int, int, int, str | None]


class TraceBuffer:
    """Recent traces by trace id, bounded by ``max_spans`` in total."""

    def __init__(self, max_spans: int = 200_000) -> None:
        if max_spans < 1:
            raise ValueError("max_spans must be at least 1")
        self.max_spans = max_spans
        self.spans = 0
        self.evicted_traces = 0
        # Insertion order is first arrival: the first key is always the oldest trace. An OrderedDict, because
        # a plain dict finds its first key by skipping the slots of every key deleted before it, which made
        # evicting from the front cost more than everything else ingest does.
        self._traces: OrderedDict[bytes, list[Record]] = OrderedDict()

    def add(self, spans: Iterable[Span]) -> None:
        traces = self._traces
        added = 0
        for s in spans:
            records = traces.get(s.trace_id)
            if records is None:
                traces[s.trace_id] = records = []
            records.append((s.span_id, s.parent_span_id, s.service, s.name, int(s.kind), s.start_unix_nano,
                            s.end_unix_nano, s.host))
            added += 1
        self.spans += added
        while self.spans > self.max_spans and traces:
            self.spans -= len(traces.popitem(last=False)[1])
            self.evicted_traces += 1

    def trace(self, trace_id: bytes) -> list[Span]:
        """The buffered spans of one trace as model spans (empty when unknown or evicted)."""
        return [Span(trace_id=trace_id, span_id=r[0], parent_span_id=r[1], service=r[2], name=r[3],
                     kind=SpanKind(r[4]), start_unix_nano=r[5], end_unix_nano=r[6], host=r[7],
                     status=StatusCode.UNSET, attributes={})
                for r in self._traces.get(trace_id, ())]

    def __contains__(self, trace_id: bytes) -> bool:
        return trace_id in self._traces

    def __len__(self) -> int:
        return len(self._traces)
