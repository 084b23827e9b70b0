"""Export requests cut at wire level, without decoding them: to a size limit, and by the owner of each trace.

The agent accepts no request it could not forward: one that is larger than the collector takes once enriched
(``ForwardQueue.max_request_bytes``) is cut by resource, scope and span (or data point) into requests that fit
(``split_request``). A single span or point larger than the limit cannot be split; it is dropped, counted,
reported to the sender in ``partial_success`` and logged (``DropLog``: at most once per sender every ten
minutes). With several collectors a trace request is cut into one request per collector that owns some of its
traces (``partition_request``). Both walk the encoded message and copy only the bytes of the pieces.

>>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
>>> req = ExportTraceServiceRequest()
>>> for name in ("a", "b", "c"):
...     _ = req.resource_spans.add().scope_spans.add().spans.add(name=name * 40)
>>> [n for _, n in split_request(Signal.TRACES, req.SerializeToString(), 100).pieces]
[2, 1]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from spikehound.agent.spool import Signal
from spikehound.protowire import LEN, Field, WireError, encode_varint, fields

log = logging.getLogger("spikehound.agent.request_split")

ITEMS = {Signal.TRACES: "spans", Signal.METRICS: "data points", Signal.PROFILES: "profile stacks"}
DROP_LOG_SECONDS = 600.0  # one ERROR line per sender at most this often
_MAX_SENDERS_LOGGED = 1000


# How OTLP export requests nest: a message's repeated field -> the shape of its entries. An empty shape is a
# span or data point, which cannot be split.
Shape = Mapping[int, "Shape"]
_LEAF: Shape = {}
_POINTS: Shape = {1: _LEAF}  # Gauge, Sum, Histogram, ExponentialHistogram, Summary: data_points
_SHAPES: dict[Signal, Shape] = {
    Signal.TRACES: {1: {2: {2: _LEAF}}},  # resource_spans -> scope_spans -> spans
    # resource_metrics -> scope_metrics -> metrics -> gauge, sum, histogram, exponential_histogram, summary
    Signal.METRICS: {1: {2: {2: {5: _POINTS, 7: _POINTS, 9: _POINTS, 10: _POINTS, 11: _POINTS}}}},
    # resource_profiles -> scope_profiles -> profiles -> samples; the request's dictionary (field 2) is not in
    # the shape, so every piece repeats it whole and the pieces' indices stay valid.
    Signal.PROFILES: {1: {2: {2: {2: _LEAF}}}},
}


@dataclass(frozen=True, slots=True)
class Dropped:
    """Spans or points that could not be split to fit: one span or point alone is over the limit."""

    sender: str  # the service.name of their resource
    items: int
    size: int  # bytes of the smallest part that still did not fit


@dataclass(slots=True)
class Split:
    pieces: list[tuple[bytes, int]] = field(default_factory=list)  # (request, spans or points in it)
    dropped: list[Dropped] = field(default_factory=list)

    @property
    def dropped_items(self) -> int:
        return sum(d.items for d in self.dropped)


def split_request(signal: Signal, payload: bytes, max_bytes: int, items: int = 0) -> Split:
    """``payload`` as requests of at most ``max_bytes`` each, cut between resources, scopes and spans (or points).

    Each piece repeats the resource and scope of what it holds; order is kept. What cannot be made to fit is
    listed in ``dropped``. ``items`` (the request's count) is what is dropped when the request cannot be walked.
    """
    out = Split()
    try:
        out.pieces = _cut(memoryview(payload), _SHAPES[signal], max_bytes, out.dropped, None)
    except (WireError, IndexError):  # groups or a damaged encoding: nothing to cut along
        out.pieces, out.dropped = [], [Dropped("unknown", items, len(payload))]
    return out


def _cut(msg: memoryview, shape: Shape, limit: int, dropped: list[Dropped],
         sender: str | None) -> list[tuple[bytes, int]]:
    """The message ``msg`` as messages of at most ``limit`` bytes that hold its entries between them."""
    if len(msg) <= limit:
        return [(bytes(msg), _count(msg, shape))]
    if not shape:
        dropped.append(Dropped(sender or "unknown", 1, len(msg)))
        return []
    header, nested = _layout(msg, shape)
    room = limit - sum(len(h) for h in header)
    entries: list[tuple[bytes | memoryview, int]] = []
    for f in nested:
        child, value = shape[f.number], msg[f.value:f.end]
        if f.end - f.start <= room:
            entries.append((msg[f.start:f.end], _count(value, child)))
            continue
        who = sender if sender is not None else _service_name(value)  # the top level's entries are resources
        key = encode_varint(f.number << 3 | LEN)
        inner = room - len(key) - len(encode_varint(max(room, 0)))
        if inner <= 0:  # the resource or scope alone leaves no room for what it holds
            dropped.append(Dropped(who, _count(value, child), len(value)))
            continue
        entries += [(key + encode_varint(len(sub)) + sub, n) for sub, n in _cut(value, child, inner, dropped, who)]
    return _pack(b"".join(header), entries, limit)


def _layout(msg: memoryview, shape: Shape) -> tuple[list[memoryview], list[Field]]:
    """The fields of ``msg`` every piece of it repeats (its header), and its entries (the fields ``shape`` nests)."""
    header: list[memoryview] = []
    nested: list[Field] = []
    for f in fields(msg):
        if f.wire == LEN and f.number in shape:
            nested.append(f)
        else:
            header.append(msg[f.start:f.end])
    return header, nested


def partition_request(payload: bytes, owner_of: Callable[[bytes], str]) -> dict[str, tuple[bytes, int]]:
    """A trace request as one request per owner of its spans' trace ids: owner -> (request, spans).

    ``owner_of`` is asked once per distinct trace id. Each piece repeats the resource and scope of what it
    holds, in order; a resource or scope whose spans all have one owner is kept as it was encoded, and so
    is the whole request when it has one owner. Raises WireError or IndexError on an encoding it cannot walk.

    >>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    >>> req = ExportTraceServiceRequest()
    >>> scope = req.resource_spans.add().scope_spans.add()
    >>> for trace in (b"a", b"b", b"a"):
    ...     _ = scope.spans.add(trace_id=trace * 16, name="x")
    >>> pieces = partition_request(req.SerializeToString(), lambda trace_id: trace_id[:1].decode())
    >>> {owner: n for owner, (_, n) in pieces.items()}
    {'a': 2, 'b': 1}
    """
    owners: dict[bytes, str] = {}

    def span_owner(span: memoryview) -> str:
        trace_id = _trace_id(span)
        owner = owners.get(trace_id)
        if owner is None:
            owner = owners[trace_id] = owner_of(trace_id)
        return owner

    return {owner: (bytes(piece), n)
            for owner, (piece, n) in _partition(memoryview(payload), _SHAPES[Signal.TRACES], span_owner).items()}


def _trace_id(span: memoryview) -> bytes:
    if len(span) >= 18 and span[0] == 0x0A and span[1] == 16:  # as SDKs encode it: field 1 first, 16 bytes
        return bytes(span[2:18])
    for f in fields(span):
        if f.number == 1 and f.wire == LEN:  # Span.trace_id, first as every SDK encodes it
            return bytes(span[f.value:f.end])
    return b""


def _partition(msg: memoryview, shape: Shape, owner_of: Callable[[memoryview], str]
               ) -> dict[str, tuple[bytes | memoryview, int]]:
    """``msg`` as one message per owner of its leaves, each with the header of ``msg``."""
    if not shape:
        return {owner_of(msg): (msg, 1)}
    header, nested = _layout(msg, shape)
    groups: dict[str, list[tuple[bytes | memoryview, int]]] = {}
    kept = True  # every entry went whole to one owner
    for f in nested:
        child = shape[f.number]
        if not child:  # a span: no message of its own to build
            groups.setdefault(owner_of(msg[f.value:f.end]), []).append((msg[f.start:f.end], 1))
            continue
        parts = _partition(msg[f.value:f.end], child, owner_of)
        if len(parts) == 1:
            ((owner, (_, n)),) = parts.items()
            groups.setdefault(owner, []).append((msg[f.start:f.end], n))
            continue
        kept = False
        key = encode_varint(f.number << 3 | LEN)
        for owner, (sub, n) in parts.items():
            groups.setdefault(owner, []).append((key + encode_varint(len(sub)) + sub, n))
    if kept and len(groups) == 1:
        ((owner, entries),) = groups.items()
        return {owner: (msg, sum(n for _, n in entries))}
    head = b"".join(header)
    return {owner: (b"".join([head, *(e for e, _ in entries)]), sum(n for _, n in entries))
            for owner, entries in groups.items()}


def _pack(header: bytes, entries: list[tuple[bytes | memoryview, int]], limit: int) -> list[tuple[bytes, int]]:
    """Entries, in order, into as few messages of at most ``limit`` bytes as they fit, each with ``header``."""
    pieces: list[tuple[bytes, int]] = []
    current: list[bytes | memoryview] = []
    size, count = len(header), 0
    for encoded, n in entries:
        if current and size + len(encoded) > limit:
            pieces.append((b"".join([header, *current]), count))
            current, size, count = [], len(header), 0
        current.append(encoded)
        size += len(encoded)
        count += n
    if current:
        pieces.append((b"".join([header, *current]), count))
    return pieces


def _count(msg: memoryview, shape: Shape) -> int:
    if not shape:
        return 1
    return sum(_count(msg[f.value:f.end], shape[f.number]) for f in fields(msg) if f.wire == LEN and f.number in shape)


def request_sender(payload: bytes) -> str:
    """The ``service.name`` of a request's first resource."""
    try:
        first = next((f for f in fields(payload) if f.number == 1 and f.wire == LEN), None)
    except (WireError, IndexError):
        return "unknown"
    return "unknown" if first is None else _service_name(memoryview(payload)[first.value:first.end])


def request_resource(payload: bytes) -> Resource:
    """The resource of a request's first ResourceSpans / ResourceMetrics entry (empty when it has none)."""
    resource = Resource()
    try:
        first = next((f for f in fields(payload) if f.number == 1 and f.wire == LEN), None)
        if first is not None:
            entry = memoryview(payload)[first.value:first.end]
            for f in fields(entry):
                if f.number == 1 and f.wire == LEN:
                    resource.MergeFromString(bytes(entry[f.value:f.end]))
    except (WireError, IndexError, DecodeError):
        return Resource()
    return resource


def _service_name(entry: memoryview) -> str:
    """The ``service.name`` of a ResourceSpans / ResourceMetrics entry's resource."""
    try:
        for f in fields(entry):
            if f.number == 1 and f.wire == LEN:
                for kv in Resource.FromString(bytes(entry[f.value:f.end])).attributes:
                    if kv.key == "service.name" and kv.value.string_value:
                        return kv.value.string_value
    except (WireError, IndexError, DecodeError):
        pass
    return "unknown"


class DropLog:
    """ERROR lines for what was dropped as too large: a sender's first at once, then one per ``interval``."""

    def __init__(self, interval: float = DROP_LOG_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._senders: dict[tuple[Signal, str], tuple[float, int]] = {}  # -> (last logged, dropped since)

    def report(self, signal: Signal, dropped: list[Dropped], limit: int, where: str) -> None:
        now = self._clock()
        for d in dropped:
            key = (signal, d.sender)
            last, suppressed = self._senders.get(key, (None, 0))
            if last is not None and now - last < self.interval:
                self._senders[key] = (last, suppressed + d.items)
                continue
            if len(self._senders) >= _MAX_SENDERS_LOGGED:  # many senders: forget the old ones, bounded
                self._senders.clear()
            self._senders[key] = (now, 0)
            log.error("%s: dropped %d %s from service %r: %d bytes that cannot be split, over the %d bytes the "
                      "collector accepts in one request%s", where, d.items, ITEMS[signal], d.sender, d.size, limit,
                      f" ({suppressed} more dropped from it since the last report)" if suppressed else "")
