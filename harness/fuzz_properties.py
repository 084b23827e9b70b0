"""The fuzzed properties: generated hostile input never crashes, stalls or 5xx's spikehound.

Each property is a :class:`Property`: a hypothesis strategy and a check of one input that either returns
what happened (``"refused"``, ``"stored"``, a status code ...) or raises. ``tests/test_fuzz.py`` runs a few
dozen inputs of each in ``make test`` (what each covers is said there); ``benchmarks/fuzz.py`` runs the same
properties over 100,000 inputs.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import json
import math
import re
import string
import struct
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from signal import SIGALRM, alarm
from signal import signal as set_handler
from typing import Any

import grpc
import requests
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import status_pb2
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from harness.api_client import ApiClient, get_json
from harness.daemons import CollectorThread
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from spikehound import cli
from spikehound.collector.analysis import parse_selection
from spikehound.collector.rest.common import ApiError, whole_number
from spikehound.collector.rest.jaeger import go_duration_ns, parse_trace_id
from spikehound.model import MetricKind, SpanKind, StatusCode
from spikehound.otlp import (
    MAX_TIME_NS,
    UNKNOWN_SERVICE,
    Limits,
    PayloadError,
    attributes,
    count_items,
    decode_metrics,
    decode_spans,
    parse_metrics_request,
    parse_trace_request,
)
from spikehound.timefmt import MAX_NS, MIN_NS, parse_time
from spikehound.units import NS


@dataclass(frozen=True, slots=True)
class Property:
    """One fuzzed property: inputs from ``strategy``; ``check`` returns an outcome label or raises."""

    name: str
    strategy: SearchStrategy[Any]
    check: Callable[[Any], str]


class Stalled(Exception):
    """One input took longer than any input should: spikehound looped or crawled on it."""


def run(prop: Property, max_examples: int, seen: Callable[[str], None] | None = None, *,
        random_seed: int | None = None, stall_seconds: int = 0, **overrides: Any) -> Counter[str]:
    """Check ``prop`` on ``max_examples`` generated inputs under the loaded hypothesis profile (or its
    ``overrides``), from ``random_seed`` when given; return how often each outcome came (a failed check
    raises); ``seen`` is told each input's outcome. With
    ``stall_seconds`` (main thread only) an input that takes longer fails as Stalled instead of hanging."""

    def stalled(*_: Any) -> None:
        raise Stalled(f"one input took over {stall_seconds} s")

    def checked(value: Any) -> str:
        try:
            return prop.check(value)
        except Exception as exc:
            exc.add_note(f"input: {value!r}"[:3000])  # hypothesis cannot print every input
            raise

    def check(value: Any) -> None:
        if not stall_seconds:
            outcome = checked(value)
        else:
            set_handler(SIGALRM, stalled)
            alarm(stall_seconds)
            try:
                outcome = checked(value)
            finally:
                alarm(0)
        outcomes[outcome] += 1
        if seen is not None:
            seen(outcome)

    outcomes: Counter[str] = Counter()
    test = settings(max_examples=max_examples, **overrides)(given(prop.strategy)(check))
    (test if random_seed is None else seed(random_seed)(test))()
    return outcomes


def mostly(good: SearchStrategy[Any], bad: SearchStrategy[Any]) -> SearchStrategy[Any]:
    """``good`` five times in six: enough records pass validation for their invariants to be checked."""
    return st.sampled_from([True, True, True, True, True, False]).flatmap(lambda ok: good if ok else bad)


# --- OTLP messages ---------------------------------------------------------------------------------------------

# Short strings (cheap) and now and then one long enough to pass any limit, in any script.
TEXT = st.one_of(st.text(max_size=12), st.just(""),
                 st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(100, 5_000)))
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
# Times as senders get them wrong: zero, now, the edges of what storage holds, anything a fixed64 holds.
NOW_NS = 1_767_225_600 * NS
TIMES = mostly(st.integers(NOW_NS - 10**12, NOW_NS + 10**12), st.one_of(
    st.just(0), UINT64, st.sampled_from([1, MAX_TIME_NS - 1, MAX_TIME_NS, MAX_TIME_NS + 1, 2**64 - 1])))
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)


def ids(size: int) -> SearchStrategy[bytes]:
    """An id of ``size`` bytes, or all zeroes, empty, or of the wrong length."""
    return mostly(st.binary(min_size=size, max_size=size).map(lambda b: b if any(b) else b"\1" + b[1:]),
                  st.one_of(st.just(bytes(size)), st.just(b""), st.binary(max_size=2 * size + 1)))


def _leaf(kind: str, value: Any) -> AnyValue:
    v = AnyValue()
    if kind != "empty":
        setattr(v, kind, value)
    return v


LEAVES = st.one_of(
    st.builds(_leaf, st.just("string_value"), TEXT), st.builds(_leaf, st.just("int_value"), INT64),
    st.builds(_leaf, st.just("double_value"), DOUBLES), st.builds(_leaf, st.just("bool_value"), st.booleans()),
    st.builds(_leaf, st.just("bytes_value"), st.binary(max_size=40)), st.builds(_leaf, st.just("empty"), st.none()))


def _array(values: list[AnyValue]) -> AnyValue:
    v = AnyValue()
    v.array_value.values.extend(values)
    return v


def _kvlist(pairs: list[tuple[str, AnyValue]]) -> AnyValue:
    v = AnyValue()
    for key, item in pairs:
        v.kvlist_value.values.add(key=key).value.CopyFrom(item)
    return v


def _deep(depth: int, leaf: AnyValue) -> AnyValue:
    """``leaf`` under ``depth`` levels of alternating maps and arrays (deeper only on the wire: ``_deep_wire``)."""
    v = leaf
    for level in range(depth):
        v = _kvlist([("k", v)]) if level % 2 else _array([v])
    return v


def _any_containers(kids: SearchStrategy[AnyValue]) -> SearchStrategy[AnyValue]:
    return st.one_of(st.builds(_array, st.lists(kids, max_size=4)),
                     st.builds(_kvlist, st.lists(st.tuples(TEXT, kids), max_size=4)))


ANY_VALUES = st.one_of(
    st.recursive(LEAVES, _any_containers, max_leaves=5),
    st.builds(_deep, st.integers(5, 20), LEAVES),
    st.builds(lambda n, leaf: _array([leaf] * n), st.integers(50, 300), LEAVES))  # wide
ATTRIBUTES = st.lists(st.tuples(TEXT, ANY_VALUES), max_size=3)
# Where the limits count attributes (spans, resources, scopes, points): now and then more than LIMITS allows.
MANY_ATTRIBUTES = ATTRIBUTES | st.builds(lambda n, value: [(f"k{i}", value) for i in range(n)],
                                         st.integers(20, 160), LEAVES)


def _set_attributes(target: Any, pairs: list[tuple[str, AnyValue]]) -> None:
    for key, value in pairs:
        target.add(key=key).value.CopyFrom(value)


def _unknown_field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One field unknown to the message (numbers past the schema's), encoded by hand."""
    tag = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return tag + _varint(int.from_bytes(payload[:8].ljust(1, b"\0"), "little"))
    if wire_type == 1:
        return tag + payload[:8].ljust(8, b"\0")
    if wire_type == 5:
        return tag + payload[:4].ljust(4, b"\0")
    return tag + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


UNKNOWN_FIELDS = st.builds(_unknown_field, st.integers(100, 2**29 - 1), st.sampled_from([0, 1, 2, 5]),
                           st.binary(max_size=12))


SOME = mostly(st.integers(1, 2), st.just(0))  # how many resources, scopes, records: now and then none


@st.composite
def resources(draw: st.DrawFn, target: Any) -> None:
    """Fill a resource: service.name and host.name of any type (or missing, or long), other attributes."""
    for key in ("service.name", "host.name"):
        kind = draw(mostly(st.just("string"), st.sampled_from(["missing", "other"])))
        if kind == "string":
            target.attributes.add(key=key).value.string_value = draw(TEXT)
        elif kind == "other":
            target.attributes.add(key=key).value.CopyFrom(draw(ANY_VALUES))
    _set_attributes(target.attributes, draw(MANY_ATTRIBUTES))


@st.composite
def timing(draw: st.DrawFn) -> tuple[int, int]:
    """(start, end): mostly in order, else reversed or both anything."""
    start = draw(TIMES)
    shape = draw(mostly(st.just("ordered"), st.sampled_from(["reversed", "free"])))
    if shape == "ordered":
        return start, min(start + draw(st.integers(0, 10**10)), 2**64 - 1)
    if shape == "reversed":
        return start, max(start - draw(st.integers(1, 10**10)), 0)
    return start, draw(TIMES)


@st.composite
def spans(draw: st.DrawFn) -> trace_pb2.Span:
    """A span: mostly valid, else with the ids and times validation must refuse; any name, kind, status,
    attributes, events, links, and now and then a field from a newer schema."""
    start, end = draw(timing())
    sp = trace_pb2.Span(trace_id=draw(ids(16)), span_id=draw(ids(8)), parent_span_id=draw(ids(8)),
                        name=draw(TEXT), kind=draw(st.integers(-3, 9)), start_time_unix_nano=start,
                        end_time_unix_nano=end, trace_state=draw(TEXT), flags=draw(st.integers(0, 2**32 - 1)))
    _set_attributes(sp.attributes, draw(MANY_ATTRIBUTES))
    if draw(st.booleans()):
        sp.status.code = draw(st.integers(-2, 5))
        sp.status.message = draw(TEXT)
    for _ in range(draw(st.integers(0, 1))):
        event = sp.events.add(name=draw(TEXT), time_unix_nano=draw(TIMES))
        _set_attributes(event.attributes, draw(ATTRIBUTES))
    for _ in range(draw(st.integers(0, 1))):
        link = sp.links.add(trace_id=draw(ids(16)), span_id=draw(ids(8)))
        _set_attributes(link.attributes, draw(ATTRIBUTES))
    if draw(st.booleans()):
        sp.MergeFromString(draw(UNKNOWN_FIELDS))
    return sp


@st.composite
def number_points(draw: st.DrawFn) -> metrics_pb2.NumberDataPoint:
    """A gauge or sum point: any time, value (NaN, infinite, none), flags and attributes."""
    dp = metrics_pb2.NumberDataPoint(time_unix_nano=draw(TIMES), start_time_unix_nano=draw(TIMES),
                                     flags=draw(mostly(st.just(0), st.sampled_from([1, 2, 2**32 - 1]))))
    value = draw(mostly(st.sampled_from(["double", "int"]), st.just("none")))
    if value == "double":
        dp.as_double = draw(DOUBLES)
    elif value == "int":
        dp.as_int = draw(INT64)
    _set_attributes(dp.attributes, draw(MANY_ATTRIBUTES))
    return dp


@st.composite
def metrics(draw: st.DrawFn) -> metrics_pb2.Metric:
    """A metric: mostly a gauge or a sum (of any temporality), else a type that is no resource sample, or none."""
    metric = metrics_pb2.Metric(name=draw(TEXT), unit=draw(TEXT), description=draw(TEXT))
    kind = draw(mostly(st.sampled_from(["gauge", "sum"]),
                       st.sampled_from(["histogram", "summary", "exponential_histogram", "none"])))
    if kind in ("gauge", "sum"):
        data = getattr(metric, kind)
        data.SetInParent()
        data.data_points.extend(draw(st.lists(number_points(), min_size=draw(SOME), max_size=3)))
        if kind == "sum":
            data.aggregation_temporality = draw(mostly(st.sampled_from([1, 2]), st.integers(-1, 3)))
            data.is_monotonic = draw(st.booleans())
    elif kind != "none":
        data = getattr(metric, kind)
        data.SetInParent()
        for _ in range(draw(st.integers(0, 2))):
            data.data_points.add(time_unix_nano=draw(TIMES))
    return metric


@st.composite
def export_requests(draw: st.DrawFn, message: type[Message], fields: tuple[str, str, str],
                    records: SearchStrategy[Message]) -> Message:
    """An export request of ``records`` under resources and scopes of any shape; ``fields`` names where they go
    (``resource_spans``, ``scope_spans``, ``spans`` for traces)."""
    resources_field, scopes_field, records_field = fields
    req = message()
    for _ in range(draw(SOME)):
        resource = getattr(req, resources_field).add()
        draw(resources(resource.resource))
        for _ in range(draw(SOME)):
            scoped = getattr(resource, scopes_field).add()
            scoped.scope.name, scoped.scope.version = draw(TEXT), draw(TEXT)
            _set_attributes(scoped.scope.attributes, draw(MANY_ATTRIBUTES))
            getattr(scoped, records_field).extend(draw(st.lists(records, min_size=draw(SOME), max_size=3)))
    return req


def trace_requests() -> SearchStrategy[ExportTraceServiceRequest]:
    return export_requests(ExportTraceServiceRequest, ("resource_spans", "scope_spans", "spans"), spans())


def metric_requests() -> SearchStrategy[ExportMetricsServiceRequest]:
    return export_requests(ExportMetricsServiceRequest, ("resource_metrics", "scope_metrics", "metrics"), metrics())


def _ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _wire_span(extra: bytes) -> bytes:
    """A traces request with one valid span followed by the fields ``extra``, which an in-memory message could
    not hold (invalid UTF-8, nesting past protobuf's depth limit), so they are made on the wire."""
    span = trace_pb2.Span(trace_id=b"\1" * 16, span_id=b"\2" * 8, start_time_unix_nano=1,
                          end_time_unix_nano=2).SerializeToString() + extra
    return _ld(1, _ld(2, _ld(2, span)))  # resource_spans { scope_spans { spans { ... } } }


def _deep_wire(depth: int) -> bytes:
    """A span attribute (field 9) whose AnyValue nests ``depth`` maps and arrays, encoded by hand."""
    value = _ld(1, b"leaf")  # string_value
    for level in range(depth):
        value = _ld(6, _ld(1, _ld(1, b"k") + _ld(2, value))) if level % 2 else _ld(5, _ld(1, value))
    return _ld(9, _ld(1, b"deep") + _ld(2, value))


INVALID_UTF8 = st.sampled_from([b"\xff", b"name \xc3", b"\xed\xa0\x80", b"\xc0\xaf"])


@st.composite
def damaged(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` as sent, or cut short, with bytes flipped, or with more on the wire after it."""
    how = draw(st.sampled_from(["whole", "whole", "cut", "flip", "unknown", "raw_name", "deep"]))
    if how == "cut" and body:
        return body[:draw(st.integers(0, len(body) - 1))]
    if how == "flip" and body:
        out = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(0, len(out) - 1))] ^= draw(st.integers(1, 255))
        return bytes(out)
    if how == "unknown":
        return body + draw(UNKNOWN_FIELDS)
    if how == "raw_name":
        return body + _wire_span(_ld(5, draw(st.binary(max_size=12) | INVALID_UTF8)))  # the span's name
    if how == "deep":
        return body + _wire_span(_deep_wire(draw(st.integers(20, 400))))
    return body


def protobuf_bodies(requests_: SearchStrategy[Message]) -> SearchStrategy[bytes]:
    """Encoded requests from ``requests_``, some of them damaged."""
    return requests_.map(lambda r: r.SerializeToString()).flatmap(damaged)


# --- OTLP/JSON -------------------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), DOUBLES, st.text(max_size=10),
                         st.sampled_from(["99999999999999999999999", "-1", "1e309", "NaN", "", "0x10", "1.5",
                                          "18446744073709551616", "ffffffffffffffffffffffffffffffff"]))


def _json_containers(kids: SearchStrategy[Any]) -> SearchStrategy[Any]:
    return st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)


JSON_VALUES = st.recursive(JSON_SCALARS, _json_containers, max_leaves=6)
ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _span_nodes(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The spans and links of an OTLP/JSON traces document: where its ids are."""
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                yield span
                yield from span.get("links", [])


@st.composite
def json_node(draw: st.DrawFn, doc: Any) -> tuple[Any, Any] | None:
    """A (container, key or index) of ``doc``, found by a random walk down from the top (cheap on big documents)."""
    node, found = doc, None
    while isinstance(node, dict | list) and node:
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        found, node = (node, key), node[key]
        if draw(st.integers(0, 2)) == 0:  # stop here a third of the time: the top as likely as the leaves
            break
    return found


@st.composite
def json_bodies(draw: st.DrawFn, requests_: SearchStrategy[Message]) -> bytes:
    """OTLP/JSON as senders write it, right or wrong: ids as hex, base64 or junk, then some nodes
    replaced by values of the wrong type, removed, or renamed to snake_case."""
    doc = json_format.MessageToDict(draw(requests_))
    id_style = draw(mostly(st.sampled_from(["hex", "HEX"]), st.sampled_from(["base64", "odd"])))
    for holder in _span_nodes(doc):
        for key in ID_KEYS:
            if key in holder:
                raw = base64.b64decode(holder[key])
                holder[key] = {"hex": raw.hex(), "HEX": raw.hex().upper(), "base64": holder[key],
                               "odd": raw.hex()[1:]}[id_style]
    for _ in range(draw(st.integers(0, 3))):  # often none: well-formed OTLP/JSON
        picked = draw(json_node(doc))
        if picked is None:
            break
        holder, key = picked
        change = draw(st.sampled_from(["replace", "delete", "snake"]))
        if change == "replace":
            holder[key] = draw(JSON_VALUES)
        elif isinstance(holder, dict) and change == "delete":
            del holder[key]
        elif isinstance(holder, dict) and isinstance(key, str):
            holder[re.sub(r"([A-Z])", lambda m: "_" + m[1].lower(), key)] = holder.pop(key)
    # The standard library writes what orjson refuses to: integers past 64 bits, NaN, lone surrogates.
    return json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


def _deep_json(top: str, depth: int) -> bytes:
    """OTLP/JSON with a resource attribute nested ``depth`` maps deep (orjson stops at 1024, protobuf at 100)."""
    value = '{"kvlistValue": {"values": [{"key": "k", "value": ' * depth + '{"intValue": "1"}' + "}]}}" * depth
    return f'{{"{top}": [{{"resource": {{"attributes": [{{"key": "deep", "value": {value}}}]}}}}]}}'.encode()


DEEP_JSON = st.builds(_deep_json, st.sampled_from(["resourceSpans", "resourceMetrics"]), st.integers(20, 1100))
TOP_KEYS = st.sampled_from(["resourceSpans", "resourceMetrics", "resource_spans", "resourceLogs", "x"])
ANY_JSON = st.one_of(DEEP_JSON, st.one_of(JSON_VALUES, st.dictionaries(TOP_KEYS, JSON_VALUES, max_size=2)).map(
    lambda d: json.dumps(d).encode()))


# --- the decoders, as the receivers call them ----------------------------------------------------------------

# The receivers' limits as the configuration allows them (each at least 1), small ones often enough to cut.
LIMITS = st.builds(Limits, name=st.integers(1, 1100), value=st.integers(1, 5000), attributes=st.integers(1, 140))


# signal, body, whether it is JSON, the receivers' limits, the latest time they accept (their clock plus skew)
DecodeCase = tuple[str, bytes, bool, Limits, int]
NOT_AFTER = st.one_of(st.just(MAX_TIME_NS), st.integers(NOW_NS - 10**12, NOW_NS + 10**12))


def check_decode(case: DecodeCase) -> str:
    """The receivers' steps on one body: refused with PayloadError, or every record accounted for and valid."""
    signal, body, as_json, limits, not_after_ns = case
    parse = parse_trace_request if signal == "traces" else parse_metrics_request
    try:
        request = parse(body, json=as_json)
    except PayloadError as exc:
        assert str(exc), "a refusal needs a message for the 400"
        return "refused"
    items = count_items(request)
    resources_ = request.resource_spans if signal == "traces" else request.resource_metrics
    services, hosts = (_names(resources_, key, limits) for key in ("service.name", "host.name"))
    if signal == "traces":
        decoded = decode_spans(request, None if as_json else body, limits=limits, not_after_ns=not_after_ns)
        assert decoded.accepted + decoded.rejected == items, (decoded.accepted, decoded.rejected, items)
        for span in decoded.spans:
            assert_valid_span(span, limits)
            assert span.end_unix_nano <= not_after_ns
            # The sender's names survive every limit (cut to length, never dropped with surplus attributes).
            assert services is None or span.service in services, (span.service, services)
            assert hosts is None or span.host in hosts, (span.host, hosts)
        stored = decode_spans(ExportTraceServiceRequest.FromString(decoded.payload), limits=limits)
        assert [(s.trace_id, s.span_id) for s in stored.spans] == [(s.trace_id, s.span_id) for s in decoded.spans]
        assert stored.rejected == 0 and not stored.truncated, "storage must get exactly the spans accepted, as cut"
    else:
        expected = metric_outcomes(request)
        decoded = decode_metrics(request, None if as_json else body, limits=limits, not_after_ns=not_after_ns)
        assert decoded.accepted + decoded.rejected == expected, (decoded.accepted, decoded.rejected, expected,
                                                                 decoded.errors)
        for point in decoded.points:
            assert_valid_point(point, limits)
            assert point.time_unix_nano <= not_after_ns
            assert hosts is None or point.host in hosts, (point.host, hosts)
    assert bool(decoded.error_message) == bool(decoded.rejected)
    return "rejected" if decoded.rejected and not decoded.accepted else "accepted" if decoded.accepted else "empty"


def _names(resources_: Any, key: str, limits: Limits) -> set[str] | None:
    """The values decoded records must carry for the resource attribute ``key`` when every resource names
    itself with a string (cut to the limits of names and of values); None when one does not."""
    names = set()
    for r in resources_:
        value = next((kv.value for kv in reversed(r.resource.attributes) if kv.key == key), None)  # the last wins
        if value is None or value.WhichOneof("value") != "string_value" or not value.string_value:
            return None
        names.add(value.string_value[:min(limits.resource_name, limits.value)])
    return names


def metric_outcomes(req: ExportMetricsServiceRequest) -> int:
    """Records decode_metrics must account for (accept or reject): every point of a gauge or sum, less those
    flagged 'no recorded value' where the metric could be stored at all; one per other or empty metric at least."""
    total = 0
    for rm in req.resource_metrics:
        host = attributes(rm.resource.attributes).get("host.name")  # bytes come as hex text, and count
        has_host = isinstance(host, str) and bool(host)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                which = metric.WhichOneof("data")
                if which not in ("gauge", "sum"):
                    total += max(len(getattr(metric, which).data_points), 1) if which else 1
                    continue
                points = getattr(metric, which).data_points
                storable = has_host and (which == "gauge" or metric.sum.aggregation_temporality in (1, 2))
                total += sum(1 for dp in points if not (storable and dp.flags & 1))
    return total


def _assert_text(value: Any, limit: int) -> None:
    assert isinstance(value, str) and len(value) <= limit, (limit, value[:80] if isinstance(value, str) else value)


def _assert_attributes(attributes: dict[str, Any], limits: Limits, most: int | None) -> None:
    assert most is None or len(attributes) <= most
    for key, value in attributes.items():
        _assert_text(key, limits.name)
        _assert_value(value, limits)


def _assert_value(value: Any, limits: Limits) -> None:
    if isinstance(value, str):  # bytes come back as hex: two characters a byte
        assert len(value) <= 2 * limits.value
    elif isinstance(value, list):
        for item in value:
            _assert_value(item, limits)
    elif isinstance(value, dict):
        _assert_attributes(value, limits, None)


def assert_valid_span(span: Any, limits: Limits) -> None:
    """What the model promises of an accepted span (spikehound/model.py) and the limits promise of its text."""
    assert len(span.trace_id) == 16 and any(span.trace_id)
    assert len(span.span_id) == 8 and any(span.span_id)
    assert span.parent_span_id is None or (len(span.parent_span_id) == 8 and span.parent_span_id != span.span_id)
    assert 0 < span.start_unix_nano <= span.end_unix_nano <= MAX_TIME_NS
    assert isinstance(span.kind, SpanKind) and isinstance(span.status, StatusCode)
    _assert_text(span.name, limits.name)
    if span.service != UNKNOWN_SERVICE:  # the collector's own name for a span without one is never cut
        _assert_text(span.service, limits.resource_name)
    if span.host is not None:
        _assert_text(span.host, limits.resource_name)
    _assert_attributes(span.attributes, limits, limits.attributes)
    _assert_attributes(span.resource, limits, limits.attributes)
    for event in span.events:
        _assert_text(event["name"], limits.name)


def assert_valid_point(point: Any, limits: Limits) -> None:
    """What a stored resource sample promises: a host, a name, a time storage holds, a finite value."""
    _assert_text(point.host, limits.resource_name)
    assert point.host
    _assert_text(point.name, limits.name)
    _assert_text(point.unit, limits.name)
    assert 0 < point.time_unix_nano <= MAX_TIME_NS
    assert isinstance(point.value, float) and math.isfinite(point.value), point.value
    assert isinstance(point.kind, MetricKind)
    _assert_attributes(point.attributes, limits, limits.attributes)


def _cases(signal: str, bodies: SearchStrategy[bytes], as_json: bool) -> SearchStrategy[DecodeCase]:
    return st.tuples(st.just(signal), bodies, st.just(as_json), LIMITS, NOT_AFTER)


TRACE_PROTOBUF = Property("traces, protobuf", _cases("traces", protobuf_bodies(trace_requests()), False), check_decode)
TRACE_JSON = Property("traces, JSON", _cases("traces", mostly(json_bodies(trace_requests()), ANY_JSON), True),
                      check_decode)
METRIC_PROTOBUF = Property("metrics, protobuf", _cases("metrics", protobuf_bodies(metric_requests()), False),
                           check_decode)
METRIC_JSON = Property("metrics, JSON", _cases("metrics", mostly(json_bodies(metric_requests()), ANY_JSON), True),
                       check_decode)
ANY_BYTES = Property("arbitrary bytes, either signal, either encoding",
                     st.tuples(st.sampled_from(["traces", "metrics"]), st.binary(max_size=300), st.booleans(), LIMITS,
                               NOT_AFTER),
                     check_decode)

# --- recorded OTLP files --------------------------------------------------------------------------------------


def length_prefixed(bodies: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(b)) + b for b in bodies)


RECORDED_BODIES = st.one_of(protobuf_bodies(trace_requests()), protobuf_bodies(metric_requests()))
JSON_LINES = st.lists(st.one_of(json_bodies(trace_requests()), json_bodies(metric_requests()), ANY_JSON,
                                st.sampled_from([b"", b"   ", b'{"resourceLogs": []}', b"not json"])),
                      min_size=1, max_size=4).map(b"\n".join)
FILES = st.one_of(
    JSON_LINES,
    st.lists(RECORDED_BODIES, min_size=1, max_size=3).map(length_prefixed),
    st.lists(RECORDED_BODIES, min_size=1, max_size=3).map(length_prefixed).flatmap(damaged),
    RECORDED_BODIES,
    st.binary(max_size=300),
    st.one_of(JSON_LINES, RECORDED_BODIES).map(gzip.compress),  # the reader does not inflate: a clear refusal
)
_REFUSAL = re.compile(r"^spikehound replay: (?P<path>.+?): (line|message) \d+: \S")


def replay_check(workdir: Path) -> Callable[[bytes], str]:
    """``spikehound replay`` (in this process) on one recorded file: exit 0, or 2 naming the file and record."""

    def check(content: bytes) -> str:
        path = workdir / "recording.otlp"
        path.write_bytes(content)
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            status = cli.main(["replay", "--format", "json", str(path)])
        message = stderr.getvalue()
        if status == 2:
            refusal = _REFUSAL.match(message)
            assert refusal and refusal["path"] == str(path), message
            return "refused"
        assert status == 0, message
        assert message.startswith("replayed "), message
        return "replayed"

    return check


def replay_file_property(workdir: Path) -> Property:
    return Property("recorded OTLP files through spikehound replay", FILES, replay_check(workdir))


# --- query parameter parsers ----------------------------------------------------------------------------------


def _rfc3339(moment: datetime, fraction: str, zone: str) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + fraction + zone


OTHER_DIGITS = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=12)
DATES = st.builds(_rfc3339, st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)),
                  st.sampled_from(["", ".5", ".123456789", ".1234567891234", "."]),
                  st.sampled_from(["Z", "z", "+00:00", "-23:59", "+14:00", "", "+25:00", " UTC"]))
EDGE_DATES = st.sampled_from(["1677-09-21T00:12:43Z", "1677-09-21T00:12:44Z", "2262-04-11T23:47:16Z",
                              "2262-04-11T23:47:17Z", "1970-01-01T00:00:00Z", "0001-01-01T00:00:00Z",
                              "9999-12-31T23:59:59.999999999Z", "2024-02-30T00:00:00Z", "2024-13-01T00:00:00Z"])
NUMBERS = st.one_of(st.integers(-(10**30), 10**30).map(str), st.floats().map(str), st.floats().map(repr),
                    st.integers(0, 10**12).map(lambda n: f"{n}.{n}"), OTHER_DIGITS,
                    st.sampled_from(["", " ", "²", "1_000", "0x10", "1e3", "-0", "+5", "9" * 400, "NaN", "inf",
                                     "-inf", "00000000000000000001", "١٢٣", "1.", ".5", "5%", "50ms", "0.05s",
                                     "1..2", "..", "a=b", "=", "service.version=", "1h", "99999999999999999999h",
                                     ".5s", "1.5µs", "-1s", "1h-2m", "0", "-0", "+0", "true", "null", "[]", "{}"]))
VALUES = st.one_of(NUMBERS, DATES, EDGE_DATES, st.text(max_size=40),
                   st.builds(lambda a, b: f"{a}..{b}", st.one_of(NUMBERS, DATES), st.one_of(NUMBERS, DATES)))


def _rejects_with_value_error(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` that returns None where it refuses the text with a ValueError that says why."""

    def check(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            assert str(exc)
            return None

    return check


def check_parsers(text: str) -> str:
    """Every query parser on one string: a value in range, or a ValueError (ApiError for whole numbers)."""
    when = _rejects_with_value_error(parse_time)(text)
    assert when is None or (isinstance(when, int) and MIN_NS <= when <= MAX_NS)
    duration = _rejects_with_value_error(go_duration_ns)(text)
    assert duration is None or 0 <= duration <= MAX_NS
    trace_id = _rejects_with_value_error(parse_trace_id)(text)
    assert trace_id is None or len(trace_id) == 16
    selection = _rejects_with_value_error(lambda t: parse_selection(t, 0, 10))(text)
    assert selection is None or MIN_NS <= selection.since_ns < selection.until_ns <= MAX_NS
    try:
        number = whole_number(text, "n", 7, 1, 2**63 - 1)
    except ApiError as exc:
        assert exc.status == 400 and "n must be" in str(exc)
    else:
        assert 1 <= number <= 2**63 - 1 or (number == 7 and text == "")
    return "parsed" if when is not None else "refused"


PARSERS = Property("query parameter parsers", VALUES, check_parsers)


# --- a real collector ---------------------------------------------------------------------------------------

# The answers OTLP/HTTP documents (spikehound/collector/otlp_http.py): 429 and 503 only with a Retry-After.
OTLP_HTTP_STATUSES = {200, 400, 413, 415, 429, 503}
MEDIA = st.sampled_from(["application/x-protobuf", "application/protobuf", "application/json",
                         "application/json; charset=utf-8", "text/plain", ""])


def _otlp_bodies(signal: str) -> SearchStrategy[tuple[str, bytes]]:
    requests_ = trace_requests() if signal == "traces" else metric_requests()
    return st.one_of(st.tuples(st.just("application/x-protobuf"), protobuf_bodies(requests_)),
                     st.tuples(st.just("application/json"), json_bodies(requests_)),
                     st.tuples(MEDIA, st.binary(max_size=200)))


OTLP_POSTS = st.sampled_from(["traces", "metrics"]).flatmap(
    lambda signal: st.tuples(st.just(signal), _otlp_bodies(signal), st.sampled_from(["", "gzip", "br"])))


def otlp_http_check(http: str, session: requests.Session) -> Callable[[tuple[str, tuple[str, bytes], str]], str]:
    """POST one generated body: only documented answers, each in the encoding the sender used."""

    def check(case: tuple[str, tuple[str, bytes], str]) -> str:
        signal, (media, body), encoding = case
        headers = {"Content-Type": media} if media else {}
        if encoding:
            headers["Content-Encoding"] = encoding
        data = gzip.compress(body) if encoding == "gzip" else body
        r = session.post(f"{http}/v1/{signal}", data=data, headers=headers, timeout=60)
        assert r.status_code in OTLP_HTTP_STATUSES, (r.status_code, r.text[:300])
        if r.status_code in (429, 503):
            assert r.headers.get("Retry-After"), "a retry answer must say when"
        if r.status_code in (200, 400) and media.split(";")[0] in ("application/json", "application/x-protobuf"):
            as_json = media.startswith("application/json")
            answer: Message = (ExportTraceServiceResponse() if signal == "traces" else ExportMetricsServiceResponse()
                               ) if r.status_code == 200 else status_pb2.Status()
            if as_json:
                json_format.Parse(r.text, answer)
            else:
                answer.ParseFromString(r.content)
            assert r.status_code == 200 or answer.message  # type: ignore[attr-defined]
        return str(r.status_code)

    return check


GRPC_EXPORTS = {"traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"}
GRPC_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
GRPC_CALLS = st.sampled_from(["traces", "metrics"]).flatmap(
    lambda signal: st.tuples(st.just(signal), st.one_of(protobuf_bodies(trace_requests()),
                                                        protobuf_bodies(metric_requests()),
                                                        st.binary(max_size=200))))


def otlp_grpc_check(channel: grpc.Channel) -> Callable[[tuple[str, bytes]], str]:
    """Export one generated body over gRPC: OK, or INVALID_ARGUMENT with a message (or a retry code)."""

    def check(case: tuple[str, bytes]) -> str:
        signal, body = case
        export = channel.unary_unary(GRPC_EXPORTS[signal])  # raw bytes both ways, as a fuzzer sends them
        try:
            export(body, timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() in GRPC_CODES and exc.details(), (exc.code(), exc.details())
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:  # the collector's retry answers say when
                trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
                assert "google.rpc.retryinfo-bin" in trailers, (exc.code(), exc.details())
            return exc.code().name
        return "OK"

    return check


# Query parameters of every parser, with the words a 400 must use to name the parameter. The routes get the
# other parameters they require, naming data the collector holds.
QUERY_PARAMETERS: list[tuple[str, dict[str, str], str, str]] = [
    *(("/api/v1/latency", {"service": "gateway"}, p, p) for p in ("since", "until", "limit", "peer_service",
                                                                   "operation", "service")),
    *(("/api/v1/metrics", {"host": "gpu-1"}, p, p) for p in ("since", "until", "limit", "name")),
    *(("/api/v1/spikes", {}, p, p) for p in ("since", "until", "limit", "state", "service")),
    *(("/api/v1/compare", {"baseline": "1767225600..1767225630", "candidate": "1767225630..1767225660"}, p, p)
      for p in ("baseline", "candidate", "since", "until", "max_regression", "min_requests", "confidence",
                "replicates", "seed", "max_traces", "service", "operation")),
    *(("/api/v1/profile", {"select": "1767225600..1767225660"}, p, p) for p in ("select", "since", "until",
                                                                                 "max_traces")),
    *(("/api/v1/analyze/batching", {"service": "model-server"}, p, p)
      for p in ("service", "attribute", "p99_target", "select", "since", "until", "min_requests")),
    *(("/api/v1/analyze/pipeline", {"service": "gateway"}, p, p)
      for p in ("service", "operation", "select", "since", "until", "max_traces")),
    ("/api/v1/silences", {}, "state", "state"),
    *(("/api/v1/alerts/outbox", {}, p, p) for p in ("state", "limit")),
    *(("/api/traces", {"service": "gateway"}, p, p)
      for p in ("start", "end", "limit", "minDuration", "maxDuration", "tags", "tag", "operation", "traceID",
                "service")),
    *(("/api/dependencies", {}, p, p) for p in ("endTs", "lookback", "service")),
    *(("/ui/spikes", {}, p, p) for p in ("since", "until", "state", "service")),
    ("/ui/trace", {}, "id", "id"),
]
# Path parameters: the route with {} for the value, and the words of its 400.
PATH_PARAMETERS: list[tuple[str, str]] = [
    ("/api/v1/traces/{}", "trace id"), ("/api/v1/spikes/{}", "spike"), ("/api/v1/alerts/outbox/{}", "notification id"),
    ("/api/v1/silences/{}", "silence"), ("/api/traces/{}", "trace id"), ("/api/services/{}/operations", ""),
    ("/ui/traces/{}", ""), ("/ui/spikes/{}", ""),
]
# Raw percent-encoded bytes reach the server undecoded by the client: invalid UTF-8 included.
RAW_VALUES = st.binary(max_size=20).map(lambda b: urllib.parse.quote_from_bytes(b, safe=""))
QUERY_CASES = st.tuples(st.sampled_from(QUERY_PARAMETERS), st.one_of(VALUES.map(lambda v: urllib.parse.quote(
    v, safe="")), RAW_VALUES))
PATH_CASES = st.tuples(st.sampled_from(PATH_PARAMETERS), st.one_of(
    VALUES.map(lambda v: urllib.parse.quote(v, safe="")), RAW_VALUES, st.text(string.hexdigits, max_size=40)))


def _named(response: requests.Response, words: str) -> None:
    """A 400 from the API names what was wrong: ``{"error"}`` (REST) or ``{"errors": [{"msg"}]}`` (Jaeger)."""
    body = response.json()
    message = body["error"] if "error" in body else body["errors"][0]["msg"]
    assert words.lower() in message.lower(), (words, message)


def query_check(api: str, session: requests.Session) -> Callable[[tuple[tuple[str, dict[str, str], str, str],
                                                                       str]], str]:
    """GET a route with one generated parameter value: never a 5xx; an API 400 names the parameter."""

    def check(case: tuple[tuple[str, dict[str, str], str, str], str]) -> str:
        (path, fixed, name, words), value = case
        query = "&".join(f"{k}={urllib.parse.quote(v, safe='')}" for k, v in fixed.items() if k != name)
        r = session.get(f"{api}{path}?{query}&{name}={value}", timeout=120)
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if path.startswith("/api/"):
            assert r.headers["Content-Type"].startswith("application/json")
            if r.status_code == 400:
                _named(r, words)
        return str(r.status_code)

    return check


def path_check(api: str, session: requests.Session) -> Callable[[tuple[tuple[str, str], str]], str]:
    """GET a route with a generated path segment: never a 5xx."""

    def check(case: tuple[tuple[str, str], str]) -> str:
        (template, words), value = case
        r = session.get(api + template.format(value or "x"), timeout=60)
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code == 400 and template.startswith("/api/") and words:
            _named(r, words)
        if template.startswith("/api/v1/alerts/outbox/") and r.status_code == 200:  # a real one: retry it too
            assert session.post(api + template.format(value) + "/retry", timeout=60).status_code in (200, 409)
        return str(r.status_code)

    return check


SILENCE_FIELDS = st.sampled_from(["service", "operation", "cause_kind", "cause_service", "cause_resource"])
SILENCE_TIMES = st.one_of(VALUES, JSON_SCALARS)


@st.composite
def silences(draw: st.DrawFn) -> dict[str, Any]:
    """A silence as an SRE writes one: patterns, an end (or a duration), maybe a start, a comment."""
    matchers = draw(st.dictionaries(st.sampled_from(["service", "operation", "cause_service", "cause_resource"]),
                                    st.text(min_size=1, max_size=20), min_size=1, max_size=3))
    body: dict[str, Any] = {"matchers": matchers, "comment": draw(TEXT), "created_by": draw(TEXT)}
    now = int(time.time())
    if draw(st.booleans()):
        body["duration_seconds"] = draw(st.integers(1, 10**6) | st.floats(0.001, 10**6))
    else:
        body["ends_at"] = now + draw(st.integers(60, 10**6))
    if draw(st.booleans()):
        body["starts_at"] = draw(st.sampled_from([str(now), now, datetime.fromtimestamp(now, UTC).isoformat()]))
    return body


# Mostly well formed (each is created, read and ended), else any field of any type, any JSON, any bytes.
SILENCES = mostly(silences().map(lambda d: json.dumps(d).encode()), st.one_of(
    st.fixed_dictionaries({"matchers": st.dictionaries(SILENCE_FIELDS, st.one_of(TEXT, JSON_SCALARS), max_size=3)},
                          optional={"starts_at": SILENCE_TIMES, "ends_at": SILENCE_TIMES,
                                    "duration_seconds": st.one_of(JSON_SCALARS, NUMBERS), "comment": JSON_SCALARS,
                                    "created_by": JSON_SCALARS}).map(lambda d: json.dumps(d).encode()),
    ANY_JSON, st.binary(max_size=100)))


def silence_check(api: str, session: requests.Session) -> Callable[[bytes], str]:
    """POST a generated silence: 201 or a 400 with a reason; a created one is then read and ended."""

    client = ApiClient(api, timeout=60, session=session)  # every answer held to the served document

    def check(body: bytes) -> str:
        r = client.post("/api/v1/silences", data=body, headers={"Content-Type": "application/json"})
        assert r.status_code in (201, 400), (r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]
            return "400"
        silence = r.json()
        read = client.get_json(f"/api/v1/silences/{silence['id']}")
        # As created; only its state may have moved on (a silence of a millisecond has expired since).
        assert read | {"state": silence["state"]} == silence, (read, silence)
        ended = client.delete(f"/api/v1/silences/{silence['id']}")
        assert ended.status_code == 200 and ended.json()["state"] == "expired", ended.text[:300]
        return "201"

    return check


def collector_properties(c: CollectorThread | Any, session: requests.Session,
                         channel: grpc.Channel) -> list[Property]:
    """The properties that need a running collector ``c`` (anything with ``api`` and ``http_endpoint``)."""
    return [Property("OTLP/HTTP requests to a live collector", OTLP_POSTS, otlp_http_check(c.http_endpoint, session)),
            Property("OTLP/gRPC requests to a live collector", GRPC_CALLS, otlp_grpc_check(channel)),
            Property("query parameters over HTTP", QUERY_CASES, query_check(c.api, session)),
            Property("path parameters over HTTP", PATH_CASES, path_check(c.api, session)),
            Property("silences over HTTP", SILENCES, silence_check(c.api, session))]


def load_sample_data(http_endpoint: str, seconds: int = 40) -> None:
    """A little of the scenario suite's traffic (spans and samples) so the routes have data to answer with."""
    send(http_endpoint, scenario_requests(Scenario("steady", seed=2, minutes=seconds / 60)))


def assert_still_ingesting(http_endpoint: str, api: str) -> None:
    """After the fuzzing the collector is ready and stores a valid span: nothing disabled or stalled it."""
    assert requests.get(f"{api}/readyz", timeout=10).status_code == 200
    trace_id = bytes(range(1, 17))
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "after-fuzzing"
    now = time.time_ns()
    rs.scope_spans.add().spans.add(trace_id=trace_id, span_id=b"\1" * 8, name="GET /", start_time_unix_nano=now - 1000,
                                   end_time_unix_nano=now)
    r = requests.post(f"{http_endpoint}/v1/traces", data=req.SerializeToString(),
                      headers={"Content-Type": "application/x-protobuf"}, timeout=30)
    assert r.status_code == 200, r.text
    assert get_json(f"{api}/api/v1/traces/{trace_id.hex()}")["spans"][0]["service"] == "after-fuzzing"
