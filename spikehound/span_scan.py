"""Read stored span blocks for analysis without decoding every span in full.

The regression gate and the serving analyses read every span of a time range,
and there can be millions. A ``SpanScan`` keeps only what they need:

* the duration of every entry span (roots and SERVER spans) that ends in the
  range, per (service, operation): a few integers per request;
* whole traces, as ``Span`` records, for critical paths: either every trace
  (``max_traces=None``, capped at ``max_spans``) or a uniform sample of
  ``max_traces`` of them: the traces with the smallest CRC-32 of their trace id
  (a bottom-k sample, so the same data always give the same sample, whatever
  the order blocks arrive in).

Resources are matched before their spans are looked at: a selection by
resource attribute (``service.version=1.4.2``) or by service skips the spans
of every other resource at the cost of reading its attributes once. Kept spans
carry no attributes except ``keep_attribute`` (the batch size, for batching),
and of their resource only the attributes a selection asked about.

>>> from spikehound.model import Span, SpanKind, StatusCode
>>> from spikehound.otlp import encode_spans
>>> def span(i, version):
...     return Span(trace_id=bytes([i]) * 16, span_id=bytes([i]) * 8, parent_span_id=None, service="gw",
...                 host="h1", name="GET /", kind=SpanKind.SERVER, start_unix_nano=100, end_unix_nano=100 + i,
...                 status=StatusCode.UNSET, resource={"service.version": version})
>>> block = encode_spans([span(1, "1.4.2"), span(2, "1.4.2"), span(3, "1.5.0")]).SerializeToString()
>>> old, new = SpanScan(0, 10**9, attribute=("service.version", "1.4.2")), SpanScan(0, 10**9, max_traces=1)
>>> scan_block(block, [old, new]); new.finish()
>>> old.durations, new.durations[("gw", "GET /")], len(new.traces())
({('gw', 'GET /'): [1, 2]}, [1, 2, 3], 1)
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spikehound.model import Span, SpanKind, StatusCode
from spikehound.otlp import UNKNOWN_SERVICE, any_value

__all__ = ["SpanScan", "attribute_text", "scan_block"]

_KINDS = {k.value: k for k in SpanKind}
_SERVER = SpanKind.SERVER.value
_NO_LIMIT = 1 << 33  # above every CRC-32


def attribute_text(value: Any) -> str:
    """An attribute value as a selector compares it: ``true``/``false`` for booleans, else ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class SpanScan:
    """What one selection collects while stored blocks stream past (see the module docstring)."""

    def __init__(self, since_ns: int, until_ns: int, *, attribute: tuple[str, str] | None = None,
                 service: str | None = None, max_traces: int | None = 5_000, max_spans: int = 2_000_000,
                 keep_attribute: str | None = None) -> None:
        self.since_ns, self.until_ns = since_ns, until_ns
        self.attribute, self.service = attribute, service
        self.max_traces, self.max_spans, self.keep_attribute = max_traces, max_spans, keep_attribute
        self._durations: dict[str, dict[str, list[int]]] = {}  # service -> operation -> durations
        self.spans = 0  # spans of matching resources
        self.truncated = False  # max_spans reached: later traces were not kept
        self._kept: dict[bytes, tuple[list[tuple[Any, ...]], int]] = {}
        self._kept_spans = 0
        self._limit = _NO_LIMIT  # traces whose key is above it are not kept

    def accepts(self, service: str, resource: dict[str, Any]) -> bool:
        if self.service is not None and service != self.service:
            return False
        if self.attribute is None:
            return True
        key, wanted = self.attribute
        value = service if key == "service.name" else resource.get(key)
        return value is not None and attribute_text(value) == wanted

    def traces(self) -> list[list[Span]]:
        """The kept traces as ``Span`` records, in trace-key order (deterministic)."""
        kinds, unset = _KINDS, StatusCode.UNSET
        return [[Span(trace_id=tid, span_id=span_id, parent_span_id=parent or None, service=service, host=host,
                      name=name, kind=kinds.get(kind, SpanKind.INTERNAL), start_unix_nano=start, end_unix_nano=end,
                      status=unset, attributes=attrs, resource=resource)
                 for span_id, parent, name, kind, start, end, service, host, attrs, resource in rows]
                for tid, (rows, _) in sorted(self._kept.items(), key=lambda item: item[1][1])]

    @property
    def sampled(self) -> bool:
        """True when traces were dropped to keep the sample at max_traces."""
        return self._limit != _NO_LIMIT

    def add(self, spans: Any, service: str, host: str | None, resource: dict[str, Any]) -> None:
        """Take the spans of one ScopeSpans of a matching resource (the hot loop: locals only)."""
        since, until, kept, keep, crc32 = self.since_ns, self.until_ns, self._kept, self.keep_attribute, zlib.crc32
        limit = -1 if self.truncated else self._limit
        by_name = self._durations.get(service)
        if by_name is None:
            by_name = self._durations[service] = {}
        added = 0
        for sp in spans:
            end = sp.end_time_unix_nano
            tid = sp.trace_id
            in_range = since <= end < until
            held = kept.get(tid)
            if held is None and in_range:
                key = crc32(tid)
                if key <= limit:
                    held = kept[tid] = ([], key)
            parent = sp.parent_span_id
            if in_range and (not parent or sp.kind == _SERVER):
                name = sp.name
                found = by_name.get(name)
                if found is None:
                    found = by_name[name] = []
                found.append(end - sp.start_time_unix_nano)
            if held is not None:  # a plain tuple now; a Span only if the trace is still in the sample at the end
                attrs = ({kv.key: any_value(kv.value) for kv in sp.attributes if kv.key == keep}
                         if keep is not None else {})
                held[0].append((sp.span_id, parent, sp.name, sp.kind, sp.start_time_unix_nano, end, service, host,
                                attrs, resource))
                added += 1
        self._kept_spans += added
        self.spans += len(spans)

    @property
    def durations(self) -> dict[tuple[str, str], list[int]]:
        """Durations (ns) of the entry spans ending in the range, per (service, operation)."""
        return {(service, name): values for service, names in self._durations.items()
                for name, values in names.items()}

    def settle(self) -> None:
        """Keep the sample bounded: called between blocks."""
        if self.max_traces is None:
            self.truncated = self._kept_spans >= self.max_spans
        elif len(self._kept) > self.max_traces + self.max_traces // 4:
            self._limit = sorted(key for _, key in self._kept.values())[self.max_traces - 1]
            self._kept = {tid: held for tid, held in self._kept.items() if held[1] <= self._limit}

    def finish(self) -> None:
        """Cut the sample to exactly max_traces (call once, after the last block)."""
        if self.max_traces is not None and len(self._kept) > self.max_traces:
            self._limit = sorted(key for _, key in self._kept.values())[self.max_traces - 1]
            self._kept = {tid: held for tid, held in self._kept.items() if held[1] <= self._limit}


def scan_block(payload: bytes, scans: Sequence[SpanScan]) -> None:
    """Feed one stored block (an encoded ExportTraceServiceRequest) to every scan whose selection matches."""
    req = ExportTraceServiceRequest.FromString(payload)
    wanted = {scan.attribute[0] for scan in scans if scan.attribute is not None}
    for rs in req.resource_spans:
        # Only the attributes a selection asks about are decoded: a block holds a dozen resources.
        service: Any = UNKNOWN_SERVICE
        host: Any = None
        resource: dict[str, Any] = {}
        for kv in rs.resource.attributes:
            key = kv.key
            if key == "service.name":
                service = any_value(kv.value) or UNKNOWN_SERVICE
            elif key == "host.name":
                host = any_value(kv.value)
            elif key in wanted:
                resource[key] = any_value(kv.value)
        service = service if isinstance(service, str) else str(service)
        host = host if isinstance(host, str) else None
        for scan in scans:
            if scan.accepts(service, resource):
                for ss in rs.scope_spans:
                    scan.add(ss.spans, service, host, resource)
    for scan in scans:
        scan.settle()
