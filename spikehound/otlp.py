"""OTLP conversion: protobuf/JSON requests in, model records out (and back).

Decoding validates each span or point on its own: one bad record is rejected
with a reason and the rest of the request is kept, so the receivers can answer
with ``partial_success`` instead of losing a whole batch.

>>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
>>> req = ExportTraceServiceRequest()
>>> rs = req.resource_spans.add()
>>> kv = rs.resource.attributes.add(key="service.name"); kv.value.string_value = "gateway"
>>> sp = rs.scope_spans.add().spans.add(trace_id=b"\\x01" * 16, span_id=b"\\x02" * 8, name="GET /",
...                                     start_time_unix_nano=1, end_time_unix_nano=2)
>>> sp.span_id = b"\\x02" * 4
>>> decoded = decode_spans(req)
>>> len(decoded.spans), decoded.rejected, decoded.errors[0]
(0, 1, 'span 0 (GET /): span_id must be 8 bytes, got 4')
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from google.protobuf import duration_pb2, json_format
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from spikehound.model import MetricKind, MetricPoint, Span, SpanKind, StatusCode

UNKNOWN_SERVICE = "unknown_service"
MAX_ERRORS_KEPT = 5  # a partial_success message names the first few problems, not thousands

_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)
_KINDS = {0: SpanKind.INTERNAL, 1: SpanKind.INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT,
          4: SpanKind.PRODUCER, 5: SpanKind.CONSUMER}
_STATUSES = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}
_NO_RECORDED_VALUE = 1  # DataPointFlags.FLAG_NO_RECORDED_VALUE_MASK
MAX_TIME_NS = (1 << 63) - 1  # times are stored as signed 64-bit integers
# Storage indexes service and host names as VARCHAR(255): a longer one would read differently in the trace
# and in the lists of services and hosts.
MAX_RESOURCE_NAME_LENGTH = 255


class PayloadError(ValueError):
    """The request as a whole cannot be read (garbage bytes, broken JSON)."""


def retry_trailers(rpc_code: int, message: str, retry_after: int) -> tuple[tuple[str, bytes], ...]:
    """gRPC trailing metadata asking an OTLP exporter to retry after ``retry_after`` seconds.

    The ``google.rpc.RetryInfo`` goes in ``grpc-status-details-bin`` (gRPC's rich error
    model) and in ``google.rpc.retryinfo-bin``, where the Python SDK's exporter reads it.
    ``rpc_code`` is a ``google.rpc.Code`` (8 RESOURCE_EXHAUSTED, 14 UNAVAILABLE).
    """
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_after))
    status = status_pb2.Status(code=rpc_code, message=message)
    status.details.add().Pack(info)
    return (("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", info.SerializeToString()))


def trailer_retry_delay(trailers: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The seconds a ``google.rpc.RetryInfo`` in gRPC trailing metadata asks for (as ``retry_trailers`` puts it in
    ``grpc-status-details-bin``); None when there is none.

    >>> trailer_retry_delay(retry_trailers(8, "queue full", 2)), trailer_retry_delay(None)
    (2.0, None)
    """
    for key, value in trailers or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


@dataclass(frozen=True, slots=True)
class Limits:
    """How much of each record the collector keeps, in the spirit of OpenTelemetry's attribute limits.

    Longer strings are cut to ``name`` or ``value`` characters (by character, so never inside a UTF-8
    sequence), bytes values to ``value`` bytes; the attributes of a span, resource, scope or metric point
    beyond the first ``attributes`` are dropped (added to the OTLP ``dropped_attributes_count`` where the
    record has one). Service and host names are cut at ``resource_name``.

    >>> Limits(name=2000).resource_name
    255
    """

    name: int = 1024  # span, event, scope and metric names, attribute keys
    value: int = 4096  # string and bytes attribute values (each element of an array or map), status messages
    attributes: int = 128  # attributes per span, resource, scope and metric point (events and links keep theirs)

    @property
    def resource_name(self) -> int:
        return min(self.name, MAX_RESOURCE_NAME_LENGTH)


@dataclass(slots=True)
class Decoded:
    """Result of decoding one export request."""

    spans: list[Span] = field(default_factory=list)
    points: list[MetricPoint] = field(default_factory=list)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    # The request re-encoded with exactly the accepted spans (what storage keeps), set by decode_spans.
    payload: bytes = b""
    # What was cut to the Limits: field (span_name, attribute_value, attributes_dropped, ...) -> how many.
    truncated: dict[str, int] = field(default_factory=dict)
    # Spans and points refused for ending after the receiver's clock plus the allowed skew, by (service, host).
    future: dict[tuple[str, str | None], int] = field(default_factory=dict)

    def reject(self, message: str) -> None:
        self.rejected += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(message)

    @property
    def accepted(self) -> int:
        return len(self.spans) + len(self.points)

    @property
    def error_message(self) -> str:
        more = self.rejected - len(self.errors)
        return "; ".join(self.errors) + (f"; and {more} more" if more > 0 else "")


# --- attribute values -------------------------------------------------------------------------


def any_value(v: AnyValue) -> Any:
    """Convert an OTLP AnyValue to plain Python (bytes become lowercase hex)."""
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return v.int_value
    if which == "double_value":
        return v.double_value
    if which == "bool_value":
        return v.bool_value
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if which == "bytes_value":
        return v.bytes_value.hex()
    return None


def attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def set_any_value(target: AnyValue, value: Any) -> None:
    """Fill an OTLP AnyValue from plain Python (the inverse of ``any_value``)."""
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, list | tuple):
        for item in value:
            set_any_value(target.array_value.values.add(), item)
    elif isinstance(value, dict):
        for key, item in value.items():
            set_any_value(target.kvlist_value.values.add(key=key).value, item)
    elif value is not None:
        target.string_value = str(value)


def _set_attributes(target: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        set_any_value(target.add(key=key).value, value)


# --- limits -----------------------------------------------------------------------------------


class _Fit:
    """Cuts the records of one request to ``Limits`` in place, counting each cut in ``counts`` by field.

    Every method returns True when it changed the message (the stored encoding must then be redone).
    """

    def __init__(self, limits: Limits, counts: dict[str, int]) -> None:
        self.limits = limits
        self.counts = counts
        # An encoding no longer than this holds no string over a limit, so most records are passed on their
        # size alone (upb computes it in C); only larger ones are walked.
        self.text_gate = min(limits.name, limits.value)
        # ... and one no longer than this no more attributes than allowed: an attribute takes 2 bytes at least.
        self.count_gate = 2 * limits.attributes

    def text(self, value: str, limit: int, kind: str) -> str | None:
        """``value`` cut to ``limit`` characters, counted; None when it fits."""
        if len(value) <= limit:
            return None
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return value[:limit]

    def span(self, sp: trace_pb2.Span) -> bool:
        limits = self.limits
        changed = self.attributes(sp.attributes, sp)
        if (cut := self.text(sp.name, limits.name, "span_name")) is not None:
            sp.name, changed = cut, True
        if (cut := self.text(sp.status.message, limits.value, "status_message")) is not None:
            sp.status.message, changed = cut, True
        for event in sp.events:
            if (cut := self.text(event.name, limits.name, "event_name")) is not None:
                event.name, changed = cut, True
            changed |= self.attributes(event.attributes, None, cap=False)
        for link in sp.links:  # events and links keep all their attributes, cut in length (bounded by the request)
            changed |= self.attributes(link.attributes, None, cap=False)
        return changed

    def resource(self, resource: Any) -> bool:
        """A resource: service and host names at ``resource_name``, then its attributes.

        The service and host names say whose records these are, so they are never among the attributes
        dropped over the limit, wherever the sender put them: the limit counts the other attributes.
        """
        kvs = resource.attributes
        changed = self._cap_keeping_names(kvs, resource)
        for kv in kvs:
            kind = _RESOURCE_NAMES.get(kv.key)
            if (kind is not None and kv.value.WhichOneof("value") == "string_value"
                    and (cut := self.text(kv.value.string_value, self.limits.resource_name, kind)) is not None):
                kv.value.string_value, changed = cut, True
        return self.attributes(kvs, resource, cap=False) or changed

    def _cap_keeping_names(self, kvs: Any, resource: Any) -> bool:
        """Drop the resource attributes past the first ``attributes`` that are not service or host names."""
        most = self.limits.attributes
        if len(kvs) <= most:
            return False
        kept: list[KeyValue] = []
        others = 0
        for kv in kvs:
            if kv.key in _RESOURCE_NAMES or others < most:
                others += kv.key not in _RESOURCE_NAMES
                kept.append(KeyValue(key=kv.key, value=kv.value))  # a copy: the originals go with the del below
        extra = len(kvs) - len(kept)
        if not extra:
            return False
        del kvs[:]
        kvs.extend(kept)
        resource.dropped_attributes_count += extra
        self.counts["attributes_dropped"] = self.counts.get("attributes_dropped", 0) + extra
        return True

    def scope(self, scope: Any) -> bool:
        changed = self.attributes(scope.attributes, scope)
        for name in ("name", "version"):
            if (cut := self.text(getattr(scope, name), self.limits.name, "scope_name")) is not None:
                setattr(scope, name, cut)
                changed = True
        return changed

    def attributes(self, kvs: Any, owner: Any, cap: bool = True) -> bool:
        """Keys and values of ``kvs`` cut; with ``cap``, attributes beyond the limit dropped (into ``owner``'s
        ``dropped_attributes_count`` when it has one)."""
        limits = self.limits
        changed = False
        extra = len(kvs) - limits.attributes
        if cap and extra > 0:
            del kvs[limits.attributes:]
            if owner is not None:
                owner.dropped_attributes_count += extra
            self.counts["attributes_dropped"] = self.counts.get("attributes_dropped", 0) + extra
            changed = True
        gate = self.text_gate
        for kv in kvs:
            if kv.ByteSize() <= gate:
                continue
            # service.name and host.name stay whole, whatever the name limit: they say whose record it is.
            if kv.key not in _RESOURCE_NAMES and (cut := self.text(kv.key, limits.name, "attribute_key")) is not None:
                kv.key, changed = cut, True
            changed |= self.value(kv.value)
        return changed

    def value(self, v: AnyValue) -> bool:
        which = v.WhichOneof("value")
        limit = self.limits.value
        if which == "string_value":
            if (cut := self.text(v.string_value, limit, "attribute_value")) is not None:
                v.string_value = cut
                return True
        elif which == "bytes_value":
            if len(v.bytes_value) > limit:
                self.counts["attribute_value"] = self.counts.get("attribute_value", 0) + 1
                v.bytes_value = v.bytes_value[:limit]
                return True
        elif which == "array_value":
            changed = False
            for item in v.array_value.values:
                changed |= self.value(item)
            return changed
        elif which == "kvlist_value":
            return self.attributes(v.kvlist_value.values, None, cap=False)
        return False


_RESOURCE_NAMES = {"service.name": "service_name", "host.name": "host_name"}


# --- traces -----------------------------------------------------------------------------------


def parse_trace_request(body: bytes, *, json: bool = False) -> ExportTraceServiceRequest:
    """Parse an OTLP/HTTP traces body; raise PayloadError with a reason when unreadable."""
    req = ExportTraceServiceRequest()
    parse_body(req, body, json, _TRACE_ID_PATHS)
    return req


def decode_spans(req: ExportTraceServiceRequest, body: bytes | None = None, *,
                 trace_id: bytes | None = None, limits: Limits | None = None,
                 not_after_ns: int = MAX_TIME_NS) -> Decoded:
    """Validate and convert every span of a request (only those of ``trace_id`` when given).

    A span ending after ``not_after_ns`` (the receivers pass their clock plus
    ``collector.max_clock_skew_seconds``) is refused: its sender's clock is wrong, and event time taken
    from it would close no window for years. Refusals by clock are counted per (service, host) in
    ``future``.

    With ``limits`` (what the receivers pass) longer names and values are cut and surplus attributes
    dropped in the request itself, counted in ``truncated``, so that storage, the detectors and the API all
    see the same bounded strings. ``payload`` of the result is ``body`` (the request as received) when every
    span is valid and nothing was cut, else the request re-encoded with the valid spans as cut.
    """
    out = Decoded()
    spans = out.spans
    index = 0
    invalid: list[tuple[int, int, int]] = []  # (resource, scope, span) positions of rejected spans
    received, kinds, statuses = Span.received, _KINDS, _STATUSES
    internal, unset = SpanKind.INTERNAL, StatusCode.UNSET
    fit = _Fit(limits, out.truncated) if limits is not None else None
    text_gate, count_gate = (fit.text_gate, fit.count_gate) if fit is not None else (0, 0)
    max_attributes = limits.attributes if limits is not None else 0
    byte_size = trace_pb2.Span.ByteSize  # unbound: saves an attribute look-up a span
    cut = False  # whether the request was changed by ``fit``
    for ri, rs in enumerate(req.resource_spans):
        if fit is not None:
            cut |= fit.resource(rs.resource)
        resource, service, host = _resource_of(rs.resource, limits.resource_name if limits is not None else None)
        for si, ss in enumerate(rs.scope_spans):
            if fit is not None:
                cut |= fit.scope(ss.scope)
            for pi, sp in enumerate(ss.spans):
                # Hot path: read each field once and check inline; _span_problem words the rare failure.
                tid, span_id, parent = sp.trace_id, sp.span_id, sp.parent_span_id
                if trace_id is not None and tid != trace_id:
                    continue
                start, end = sp.start_time_unix_nano, sp.end_time_unix_nano
                if (len(tid) != 16 or len(span_id) != 8 or (parent and (len(parent) != 8 or parent == span_id))
                        or tid == _ZERO_TRACE or span_id == _ZERO_SPAN
                        or not start or end < start or end > not_after_ns):
                    problem = _span_problem(sp)
                    if problem is None:  # well formed, but dated after the clock allows
                        problem = f"it ends {_future(end, not_after_ns)}"
                        out.future[(service, host)] = out.future.get((service, host), 0) + 1
                    out.reject(f"span {index} ({sp.name[:80]}): {problem}")
                    invalid.append((ri, si, pi))
                else:
                    if fit is not None:
                        # The size alone clears nearly every span; only a larger one is walked.
                        size = byte_size(sp)
                        if size > text_gate or (size > count_gate and len(sp.attributes) > max_attributes):
                            cut |= fit.span(sp)
                    # Positional and without HasField: an absent status reads as code 0, UNSET.
                    spans.append(received(tid, span_id, parent or None, service, host, sp.name,
                                          kinds.get(sp.kind, internal), start, end,
                                          statuses.get(sp.status.code, unset), resource, sp))
                index += 1
    if trace_id is None:
        if invalid:
            out.payload = _without(req, invalid)
        else:
            out.payload = body if body is not None and not cut else req.SerializeToString()
    return out


def _resource_of(resource: Any, name_limit: int | None) -> tuple[dict[str, Any], str, str | None]:
    """A resource's attributes without its service and host names, and those names (cut to ``name_limit``).

    An empty host name is none; another type than a string (a number, a list, bytes as hex) names them by its
    text, cut like a string.
    """
    attrs = attributes(resource.attributes)
    service = str(attrs.pop("service.name", None) or UNKNOWN_SERVICE)
    host = attrs.pop("host.name", None) or None
    if host is not None:
        host = str(host)
    if name_limit is not None:
        service = service[:name_limit]
        host = host[:name_limit] if host is not None else None
    return attrs, service, host


def spans_of_block(payload: bytes) -> list[Span]:
    """The spans of a stored span block (an encoded ExportTraceServiceRequest).

    A block holds what ``decode_spans`` accepted and cut to the limits (its ``payload``), so it is read
    without checking each span again: this runs once for every span committed (the detection process, the
    cluster's leader, a replay), and the checks took a quarter of it.

    >>> from spikehound.model import Span, SpanKind, StatusCode
    >>> span = Span(trace_id=b"t" * 16, span_id=b"s" * 8, parent_span_id=None, service="gw", host=None,
    ...             name="GET /", kind=SpanKind.SERVER, start_unix_nano=1, end_unix_nano=5, status=StatusCode.OK)
    >>> [(s.service, s.name, s.kind, s.end_unix_nano - s.start_unix_nano)
    ...  for s in spans_of_block(encode_spans([span]).SerializeToString())]
    [('gw', 'GET /', <SpanKind.SERVER: 2>, 4)]
    """
    received, kinds, statuses = Span.received, _KINDS, _STATUSES
    internal, unset = SpanKind.INTERNAL, StatusCode.UNSET
    spans: list[Span] = []
    append = spans.append
    for rs in ExportTraceServiceRequest.FromString(payload).resource_spans:
        resource, service, host = _resource_of(rs.resource, None)
        for ss in rs.scope_spans:
            for sp in ss.spans:
                append(received(sp.trace_id, sp.span_id, sp.parent_span_id or None, service, host, sp.name,
                                kinds.get(sp.kind, internal), sp.start_time_unix_nano, sp.end_time_unix_nano,
                                statuses.get(sp.status.code, unset), resource, sp))
    return spans


def spans_of_trace(payload: bytes, trace_id: bytes) -> list[Span]:
    """The valid spans of ``trace_id`` in an encoded ExportTraceServiceRequest (a stored span block)."""
    return decode_spans(ExportTraceServiceRequest.FromString(payload), trace_id=trace_id).spans


def _without(req: ExportTraceServiceRequest, positions: list[tuple[int, int, int]]) -> bytes:
    """The request encoded without the spans at ``positions``."""
    kept = ExportTraceServiceRequest()
    kept.CopyFrom(req)
    for ri, si, pi in reversed(positions):  # from the back, so earlier positions stay valid
        del kept.resource_spans[ri].scope_spans[si].spans[pi]
    return kept.SerializeToString()


def _future(time_ns: int, not_after_ns: int) -> str:
    return (f"{(time_ns - not_after_ns) / 1e9:.0f} s after the collector's clock allows (its clock plus "
            "collector.max_clock_skew_seconds): the sender's clock is wrong")


def _span_problem(sp: trace_pb2.Span) -> str | None:
    if len(sp.trace_id) != 16:
        return f"trace_id must be 16 bytes, got {len(sp.trace_id)}"
    if sp.trace_id == _ZERO_TRACE:
        return "trace_id is all zeroes"
    if len(sp.span_id) != 8:
        return f"span_id must be 8 bytes, got {len(sp.span_id)}"
    if sp.span_id == _ZERO_SPAN:
        return "span_id is all zeroes"
    if sp.parent_span_id and len(sp.parent_span_id) != 8:
        return f"parent_span_id must be empty or 8 bytes, got {len(sp.parent_span_id)}"
    if sp.parent_span_id == sp.span_id:  # a loop no walk over the trace's tree may follow
        return "parent_span_id is the span's own id"
    if not sp.start_time_unix_nano or not sp.end_time_unix_nano:
        return "start and end time are required"
    if sp.end_time_unix_nano > MAX_TIME_NS:
        return f"end time {sp.end_time_unix_nano} is beyond the year 2262"
    if sp.end_time_unix_nano < sp.start_time_unix_nano:
        return (f"end time {sp.end_time_unix_nano} is before start time {sp.start_time_unix_nano}")
    return None


def _event(e: trace_pb2.Span.Event) -> dict[str, Any]:
    return {"name": e.name, "time_unix_nano": e.time_unix_nano, "attributes": attributes(e.attributes)}


def decode_span_details(raw: bytes | trace_pb2.Span) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Attributes and events of a span from its OTLP message or encoding (``Span.message``/``Span.raw``)."""
    sp = raw if isinstance(raw, trace_pb2.Span) else trace_pb2.Span.FromString(raw)
    return attributes(sp.attributes), [_event(e) for e in sp.events]


def encode_span(s: Span) -> trace_pb2.Span:
    """The OTLP message of one span (ids, timing, status, attributes, events)."""
    if s.message is not None:
        out = trace_pb2.Span()
        out.CopyFrom(s.message)
    elif s.raw:
        out = trace_pb2.Span.FromString(s.raw)
    else:
        out = trace_pb2.Span(trace_id=s.trace_id, span_id=s.span_id, name=s.name, kind=int(s.kind),
                             start_time_unix_nano=s.start_unix_nano, end_time_unix_nano=s.end_unix_nano)
        out.status.code = int(s.status)
        _set_attributes(out.attributes, s.attributes)
        for e in s.events:
            ev = out.events.add(name=e["name"], time_unix_nano=e["time_unix_nano"])
            _set_attributes(ev.attributes, e.get("attributes") or {})
    out.parent_span_id = s.parent_span_id or b""
    return out


def encode_spans(spans: Iterable[Span]) -> ExportTraceServiceRequest:
    """Build an OTLP request from spans, one ResourceSpans per (service, host, resource)."""
    req = ExportTraceServiceRequest()
    groups: dict[tuple[str, str | None, bytes], Any] = {}
    for s in spans:
        key = (s.service, s.host, orjson.dumps(s.resource, option=orjson.OPT_SORT_KEYS))
        scope = groups.get(key)
        if scope is None:
            rs = req.resource_spans.add()
            _set_attributes(rs.resource.attributes, {"service.name": s.service, **s.resource})
            if s.host is not None:
                set_any_value(rs.resource.attributes.add(key="host.name").value, s.host)
            scope = groups[key] = rs.scope_spans.add()
        scope.spans.append(encode_span(s))
    return req


# --- metrics ----------------------------------------------------------------------------------


def parse_metrics_request(body: bytes, *, json: bool = False) -> ExportMetricsServiceRequest:
    """Parse an OTLP/HTTP metrics body; raise PayloadError with a reason when unreadable."""
    req = ExportMetricsServiceRequest()
    parse_body(req, body, json, _METRIC_ID_PATHS)
    return req


def decode_metrics(req: ExportMetricsServiceRequest, body: bytes | None = None, *,
                   limits: Limits | None = None, not_after_ns: int = MAX_TIME_NS) -> Decoded:
    """Convert gauge and sum points into resource samples keyed by ``host.name``.

    Histograms and summaries are not resource samples: they are rejected with a
    reason (reported back through ``partial_success``), never silently dropped.
    ``body`` is accepted for symmetry with ``decode_spans``; samples are stored as rows.
    ``limits`` cut host and metric names and point attributes as in ``decode_spans``, and a point dated after
    ``not_after_ns`` is refused as a span ending then is.
    """
    out = Decoded()
    fit = _Fit(limits, out.truncated) if limits is not None else None
    for rm in req.resource_metrics:
        if fit is not None:
            fit.resource(rm.resource)
        resource = attributes(rm.resource.attributes)
        host = resource.get("host.name")
        if isinstance(host, str) and limits is not None:  # bytes come as hex: cut that text like a string
            host = host[:limits.resource_name]
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if fit is not None:
                    _fit_metric(fit, metric)
                which = metric.WhichOneof("data")
                if which == "gauge":
                    kind, data_points = MetricKind.GAUGE, metric.gauge.data_points
                elif which == "sum":
                    temporality = metric.sum.aggregation_temporality
                    if temporality not in (1, 2):
                        for _ in metric.sum.data_points:
                            out.reject(f"metric {metric.name[:80]}: sum without aggregation temporality")
                        continue
                    kind = MetricKind.SUM_CUMULATIVE if temporality == 2 else MetricKind.SUM_DELTA
                    data_points = metric.sum.data_points
                else:
                    count = len(getattr(metric, which).data_points) if which else 0
                    for _ in range(max(count, 1)):
                        out.reject(f"metric {metric.name[:80]}: type {which or 'empty'} is not a resource sample")
                    continue
                if not host or not isinstance(host, str):
                    for _ in data_points:
                        out.reject(f"metric {metric.name[:80]}: resource has no host.name attribute")
                    continue
                for dp in data_points:
                    if dp.flags & _NO_RECORDED_VALUE:
                        continue
                    number = dp.WhichOneof("value")
                    if number is None:
                        out.reject(f"metric {metric.name[:80]}: data point without a value")
                        continue
                    if not dp.time_unix_nano or dp.time_unix_nano > MAX_TIME_NS:
                        out.reject(f"metric {metric.name[:80]}: data point time {dp.time_unix_nano} is missing or "
                                   "beyond the year 2262")
                        continue
                    if dp.time_unix_nano > not_after_ns:
                        out.reject(f"metric {metric.name[:80]}: data point dated "
                                   f"{_future(dp.time_unix_nano, not_after_ns)}")
                        out.future[(UNKNOWN_SERVICE, host)] = out.future.get((UNKNOWN_SERVICE, host), 0) + 1
                        continue
                    value = float(dp.as_double if number == "as_double" else dp.as_int)
                    if not math.isfinite(value):  # NaN or infinite: no detector can learn from it, JSON cannot say it
                        out.reject(f"metric {metric.name[:80]}: value {value} is not a finite number")
                        continue
                    out.points.append(MetricPoint(
                        host=host,
                        name=metric.name,
                        attributes=attributes(dp.attributes),
                        time_unix_nano=dp.time_unix_nano,
                        value=value,
                        kind=kind,
                        unit=metric.unit,
                        start_unix_nano=dp.start_time_unix_nano,
                    ))
    return out


def _fit_metric(fit: _Fit, metric: Any) -> None:
    """A metric's name, unit and the attributes of its gauge or sum points cut to ``fit``'s limits."""
    if (cut := fit.text(metric.name, fit.limits.name, "metric_name")) is not None:
        metric.name = cut
    if (cut := fit.text(metric.unit, fit.limits.name, "metric_unit")) is not None:
        metric.unit = cut
    which = metric.WhichOneof("data")
    if which in ("gauge", "sum"):
        for dp in getattr(metric, which).data_points:
            size = dp.ByteSize()
            if size > fit.text_gate or (size > fit.count_gate and len(dp.attributes) > fit.limits.attributes):
                fit.attributes(dp.attributes, None)


def encode_points(points: Iterable[MetricPoint]) -> ExportMetricsServiceRequest:
    """Build an OTLP request from resource samples: one ResourceMetrics per host, one metric per (name, kind).

    The inverse of ``decode_metrics`` (replays and tests send generated samples with it).

    >>> req = encode_points([MetricPoint(host="gpu-1", name="hw.gpu.utilization", attributes={"hw.id": "GPU-0"},
    ...                                  time_unix_nano=10, value=0.5, kind=MetricKind.GAUGE, unit="1")])
    >>> [(p.host, p.name, p.value) for p in decode_metrics(req).points]
    [('gpu-1', 'hw.gpu.utilization', 0.5)]
    """
    req = ExportMetricsServiceRequest()
    hosts: dict[str, Any] = {}
    metrics: dict[tuple[str, str, MetricKind, str], Any] = {}
    for p in points:
        scope = hosts.get(p.host)
        if scope is None:
            rm = req.resource_metrics.add()
            set_any_value(rm.resource.attributes.add(key="host.name").value, p.host)
            scope = hosts[p.host] = rm.scope_metrics.add()
        key = (p.host, p.name, p.kind, p.unit)
        data = metrics.get(key)
        if data is None:
            metric = scope.metrics.add(name=p.name, unit=p.unit)
            if p.kind == MetricKind.GAUGE:
                data = metric.gauge
            else:
                data = metric.sum
                data.is_monotonic = True
                data.aggregation_temporality = 2 if p.kind == MetricKind.SUM_CUMULATIVE else 1
            metrics[key] = data
        dp = data.data_points.add(time_unix_nano=p.time_unix_nano, start_time_unix_nano=p.start_unix_nano,
                                  as_double=p.value)
        _set_attributes(dp.attributes, p.attributes)
    return req


def count_items(req: ExportTraceServiceRequest | ExportMetricsServiceRequest) -> int:
    """Spans or data points in a request, without decoding them (cheap: for early refusals)."""
    if isinstance(req, ExportTraceServiceRequest):
        return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    total = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                total += len(getattr(m, which).data_points) if which else 0
    return total


# --- parsing ----------------------------------------------------------------------------------

# Where OTLP/JSON carries ids: hex strings there, base64 in protobuf's JSON mapping.
_TRACE_ID_PATHS = (
    ("resourceSpans", "scopeSpans", "spans", ("traceId", "spanId", "parentSpanId")),
    ("resourceSpans", "scopeSpans", "spans", "links", ("traceId", "spanId")),
)
_METRIC_ID_PATHS = tuple(
    ("resourceMetrics", "scopeMetrics", "metrics", kind, "dataPoints", "exemplars", ("traceId", "spanId"))
    for kind in ("gauge", "sum", "histogram", "exponentialHistogram")
)


def parse_body(req: Any, body: bytes, json: bool, id_paths: tuple[tuple[Any, ...], ...]) -> None:
    """Fill ``req`` from an OTLP/HTTP body (protobuf, or JSON with hex ids at ``id_paths``); PayloadError if not."""
    if json:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise PayloadError(f"invalid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise PayloadError("invalid OTLP/JSON: the body must be a JSON object")
        for path in id_paths:
            for holder in _walk(doc, path[:-1]):
                for key in path[-1]:
                    _hex_to_base64(holder, key)
        try:
            json_format.ParseDict(doc, req, ignore_unknown_fields=True)
        except (json_format.ParseError, TypeError, ValueError) as exc:
            # Cut: protobuf quotes the offending value whole, and a gRPC status message must stay within
            # the 16 KiB of metadata clients accept (past it they see RESOURCE_EXHAUSTED, and retry).
            raise PayloadError(f"invalid OTLP/JSON: {str(exc)[:300]}") from None
    else:
        try:
            req.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise PayloadError(f"invalid OTLP protobuf: {exc or 'cannot be decoded'}") from None


def _snake(key: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


def _walk(node: Any, path: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    if not path:
        if isinstance(node, dict):
            yield node
        return
    if not isinstance(node, dict):
        return
    child = node.get(path[0], node.get(_snake(path[0])))
    for item in child if isinstance(child, list) else [child] if isinstance(child, dict) else []:
        yield from _walk(item, path[1:])


def _hex_to_base64(holder: dict[str, Any], key: str) -> None:
    for k in (key, _snake(key)):
        value = holder.get(k)
        if isinstance(value, str) and value:
            try:
                holder[k] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise PayloadError(f"invalid OTLP/JSON: {k} {value[:40]!r} is not hex") from None
