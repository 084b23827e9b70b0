"""The shared data model: what every part of spikehound passes around.

Spans and metric points arrive over OTLP and are converted once (see
``spikehound.otlp``) into these small, immutable records. Storage writes them,
detectors read them, the API serialises them. Times are integers in
nanoseconds since the Unix epoch (event time, as the sender stamped them).

>>> s = Span(trace_id=bytes(15) + b"\\x01", span_id=bytes(7) + b"\\x02", parent_span_id=None,
...          service="gateway", host="gpu-1", name="POST /predict", kind=SpanKind.SERVER,
...          start_unix_nano=1_000, end_unix_nano=5_000_000, status=StatusCode.UNSET, attributes={})
>>> s.is_entry, s.duration_ns
(True, 4999000)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PERIOD_NS = 52_631_578  # 1 s / 19 Hz: a profile sample's time when its producer gives no period

AttributeValue = str | bool | int | float | list[Any] | dict[str, Any] | bytes | None


class SpanKind(enum.IntEnum):
    """OTLP span kinds with their wire numbers; UNSPECIFIED is read as INTERNAL."""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3
    PRODUCER = 4
    CONSUMER = 5


class StatusCode(enum.IntEnum):
    """OTLP span status codes with their wire numbers."""

    UNSET = 0
    OK = 1
    ERROR = 2


_new = object.__new__


class Span:
    """One finished span, as stored and analysed.

    ``host`` is the resource's ``host.name`` (None when the sender did not say);
    ``resource`` holds the other resource attributes (service.version, ...) and
    is shared by all spans of one process. ``message`` is the span's OTLP
    protobuf message as received (``raw`` its encoding): the hot ingest path
    keeps it instead of decoding every attribute, and ``attributes``/``events``
    are read from it on first use.
    """

    __slots__ = ("_attributes", "_events", "end_unix_nano", "host", "kind", "message", "name", "parent_span_id",
                 "raw", "resource", "service", "span_id", "start_unix_nano", "status", "trace_id")

    def __init__(self, *, trace_id: bytes, span_id: bytes, parent_span_id: bytes | None, service: str,
                 host: str | None, name: str, kind: SpanKind, start_unix_nano: int, end_unix_nano: int,
                 status: StatusCode, attributes: dict[str, Any] | None = None,
                 resource: dict[str, Any] | None = None, events: list[dict[str, Any]] | None = None,
                 raw: bytes = b"", message: Any = None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.service = service
        self.host = host
        self.name = name
        self.kind = kind
        self.start_unix_nano = start_unix_nano
        self.end_unix_nano = end_unix_nano
        self.status = status
        self.resource = resource if resource is not None else {}
        self.raw = raw
        self.message = message
        self._attributes = attributes
        self._events = events
        if not raw and message is None and attributes is None:
            self._attributes = {}

    @classmethod
    def received(cls, trace_id: bytes, span_id: bytes, parent_span_id: bytes | None, service: str,
                 host: str | None, name: str, kind: SpanKind, start_unix_nano: int, end_unix_nano: int,
                 status: StatusCode, resource: dict[str, Any], message: Any) -> Span:
        """A span fresh off the wire, its details left in ``message``.

        The ingest hot path builds one per span received; assigning the slots
        directly takes half the time of the keyword constructor (0.9 against
        1.8 us a span), about 4 % of the collector's whole cost per span.
        """
        span = _new(cls)
        span.trace_id = trace_id
        span.span_id = span_id
        span.parent_span_id = parent_span_id
        span.service = service
        span.host = host
        span.name = name
        span.kind = kind
        span.start_unix_nano = start_unix_nano
        span.end_unix_nano = end_unix_nano
        span.status = status
        span.resource = resource
        span.raw = b""
        span.message = message
        span._attributes = None
        span._events = None
        return span

    @property
    def attributes(self) -> dict[str, Any]:
        if self._attributes is None:
            self._decode_raw()
        return self._attributes  # type: ignore[return-value]

    @property
    def events(self) -> list[dict[str, Any]]:
        if self._events is None:
            if self.raw or self.message is not None:
                self._decode_raw()
            else:
                self._events = []
        return self._events  # type: ignore[return-value]

    def _decode_raw(self) -> None:
        from spikehound.otlp import decode_span_details  # the model stays importable without protobuf

        attributes, events = decode_span_details(self.message if self.message is not None else self.raw)
        if self._attributes is None:
            self._attributes = attributes
        if self._events is None:
            self._events = events

    @property
    def duration_ns(self) -> int:
        return self.end_unix_nano - self.start_unix_nano

    @property
    def is_entry(self) -> bool:
        """Entry spans start a latency stream: trace roots and SERVER spans."""
        return self.parent_span_id is None or self.kind == SpanKind.SERVER

    def __repr__(self) -> str:
        return (f"Span({self.service}/{self.name} trace={self.trace_id.hex()} span={self.span_id.hex()} "
                f"{self.duration_ns / 1e6:.3f} ms)")


class MetricKind(enum.IntEnum):
    """How a sample's value is to be read."""

    GAUGE = 1  # a reading at an instant (utilization, temperature)
    SUM_CUMULATIVE = 2  # a running total since start_unix_nano (bytes sent, errors)
    SUM_DELTA = 3  # the amount since the previous point


@dataclass(slots=True, frozen=True)
class MetricPoint:
    """One resource sample, keyed by host, metric name and point attributes.

    >>> MetricPoint(host="gpu-1", name="hw.gpu.utilization", attributes={"hw.id": "GPU-0"},
    ...             time_unix_nano=10, value=0.93, kind=MetricKind.GAUGE, unit="1").value
    0.93
    """

    host: str
    name: str
    attributes: dict[str, Any]
    time_unix_nano: int
    value: float
    kind: MetricKind
    unit: str = ""
    start_unix_nano: int = 0


@dataclass(slots=True, frozen=True)
class LatencyWindow:
    """The latency of one stream over one closed event-time window.

    An entry stream is (service, operation) with ``peer_service`` None; a hop stream is measured on the
    CLIENT spans of ``peer_service`` (the caller) calling ``service``'s ``operation`` (the callee).
    ``samples`` holds the window's requests as ``(duration_ns, trace_id, span_id, end_unix_nano)``,
    slowest last, for the detectors (low-traffic merging, exemplars, attribution); it is not stored.
    """

    service: str
    operation: str
    start_unix_nano: int
    end_unix_nano: int
    count: int
    p50_ns: int
    p95_ns: int
    p99_ns: int
    max_ns: int
    samples: tuple[tuple[int, bytes, bytes, int], ...] = field(default=(), compare=False, repr=False)
    peer_service: str | None = None


Frame = tuple[str, str, int]  # (function, file, line) of one frame of a call stack


@dataclass(slots=True, frozen=True)
class ProfileStack:
    """How often one call stack of one process was sampled over one window: what the agent's profiler sends.

    ``frames`` run root first, as folded stacks do. ``kind`` says what was sampled: ``cpu`` counts threads
    on a CPU (the profiler skips idle ones), ``wall`` counts every thread, idle or not. ``service`` is the
    service whose spans the process exports, "" when the agent could not tell.

    >>> ProfileStack(host="gpu-1", service="preprocess", pid=42, process="python3", start_unix_nano=0,
    ...              end_unix_nano=10**10, frames=(("handle", "stack.py", 210), ("burn_cpu", "stack.py", 180)),
    ...              samples=57).frames[-1][0]
    'burn_cpu'
    """

    host: str
    service: str
    pid: int
    process: str
    start_unix_nano: int
    end_unix_nano: int
    frames: tuple[Frame, ...]
    samples: int
    kind: str = "cpu"
    period_ns: int = DEFAULT_PERIOD_NS  # the time one sample stands for


class CauseKind(enum.StrEnum):
    """What a cause blames; the one list of kinds (config checks, alert matchers and the API's enum read it)."""

    SPAN = "span"
    SERVICE = "service"
    NETWORK = "network"
    RESOURCE = "resource"


@dataclass(slots=True, frozen=True)
class Cause:
    """One ranked explanation of a spike; fields that do not apply are None.

    For ``NETWORK`` causes, ``service``/``operation`` name the callee and
    ``peer_service`` the caller. ``score`` is the share (0..1) of the added
    latency this cause explains.
    """

    kind: CauseKind
    score: float
    summary: str
    service: str | None = None
    operation: str | None = None
    peer_service: str | None = None
    host: str | None = None
    resource: str | None = None
    baseline: float | None = None
    observed: float | None = None
    unit: str | None = None


@dataclass(slots=True, frozen=True)
class AffectedStream:
    """One latency stream an incident moved, with its own numbers; times are event time (ns).

    ``peer_service`` is None for an entry stream (``service``'s ``operation``) and the caller for a hop
    stream (the caller's CLIENT spans calling ``service``'s ``operation``). ``evidence`` is the most the
    stream's tests said against normal, in ``-log10`` odds.
    """

    service: str
    operation: str
    peer_service: str | None
    start_unix_nano: int
    last_anomalous_end_unix_nano: int
    p99_ns: int
    baseline_p99_ns: int
    evidence: float
    slow_requests: int = 0


@dataclass(slots=True, frozen=True)
class Spike:
    """A p99 spike: one incident, led by its most user-facing stream, open until it resolves.

    ``service``/``operation``/``peer_service`` name the leading stream (``peer_service`` set: a hop, as
    in :class:`AffectedStream`); ``affected`` lists every stream the incident moved, the leader first.
    Times are event time (ns).
    """

    id: str
    service: str
    operation: str
    state: str  # "open" | "resolved"
    start_unix_nano: int
    end_unix_nano: int | None
    p99_ns: int
    baseline_p99_ns: int
    causes: tuple[Cause, ...] = ()
    exemplar_trace_ids: tuple[bytes, ...] = ()
    detected_unix_nano: int | None = None  # the event-time watermark at which the detector opened it
    peer_service: str | None = None
    affected: tuple[AffectedStream, ...] = ()
    # A return of an earlier spike at the same place (within detection's recurrence window): the first spike
    # of the chain, and which occurrence this is (1 for a first spike).
    recurrence_of: str | None = None
    occurrence: int = 1
    first_start_unix_nano: int | None = None  # a return: the start of the chain's first spike
