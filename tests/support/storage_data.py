"""Records to store, the same in every storage test: spans, host samples, latency windows and spikes, at fixed
event times (``T0``) and arrival time (``NOW``) far from today, with ids made from small numbers."""

from __future__ import annotations

from typing import Any

from spikehound.model import (
    Cause,
    CauseKind,
    LatencyWindow,
    MetricKind,
    MetricPoint,
    Span,
    SpanKind,
    Spike,
    StatusCode,
)

MS = 1_000_000
S = 1_000_000_000
T0 = 1_700_000_000 * S  # event time of the test data
NOW = 1_750_000_000 * S  # arrival (wall clock) of the test data
FOREVER = 2**62


def tid(n: int) -> bytes:
    """A trace id made from ``n``."""
    return n.to_bytes(16, "big")


def sid(n: int) -> bytes:
    """A span id made from ``n``."""
    return n.to_bytes(8, "big")


def make_span(trace: int, span: int, parent: int | None = None, *, service: str = "gateway", host: str | None = "gpu-1",
              name: str = "POST /predict", kind: SpanKind = SpanKind.SERVER, start: int = T0, duration: int = 5 * MS,
              status: StatusCode = StatusCode.UNSET, attributes: dict[str, Any] | None = None,
              events: list[dict[str, Any]] | None = None, resource: dict[str, Any] | None = None) -> Span:
    """Span ``span`` of trace ``trace`` (child of ``parent``), 5 ms from ``T0`` on gateway unless told."""
    return Span(trace_id=tid(trace), span_id=sid(span), parent_span_id=sid(parent) if parent else None,
                service=service, host=host, name=name, kind=kind, start_unix_nano=start,
                end_unix_nano=start + duration, status=status, attributes=attributes or {}, events=events or [],
                resource=resource or {})


def point(t: int, value: float, *, host: str = "gpu-1", name: str = "hw.gpu.utilization",
          attributes: dict[str, Any] | None = None, unit: str = "1") -> MetricPoint:
    """A GPU utilization sample of gpu-1's GPU-0 unless told."""
    return MetricPoint(host=host, name=name, attributes=attributes if attributes is not None else {"hw.id": "GPU-0"},
                       time_unix_nano=t, value=value, kind=MetricKind.GAUGE, unit=unit)


def window(start: int, p99_ms: float, *, service: str = "gateway", operation: str = "POST /predict",
           count: int = 100) -> LatencyWindow:
    """A 10 s window of ``count`` requests whose p99 is ``p99_ms`` (the other quantiles below it)."""
    p99 = int(p99_ms * MS)
    return LatencyWindow(service=service, operation=operation, start_unix_nano=start, end_unix_nano=start + 10 * S,
                         count=count, p50_ns=p99 // 4, p95_ns=p99 // 2, p99_ns=p99, max_ns=p99 + MS)


def causes(n: int) -> tuple[Cause, ...]:
    """``n`` causes of every kind, in rank order (scores falling)."""
    kinds = [CauseKind.SPAN, CauseKind.NETWORK, CauseKind.RESOURCE, CauseKind.SERVICE]
    return tuple(Cause(kind=kinds[i % 4], score=round(0.9 / (i + 1), 6), summary=f"cause number {i}",
                       service="model" if i % 4 != 2 else None, operation=f"op-{i}",
                       peer_service="gateway" if i % 4 == 1 else None, host="gpu-1" if i % 4 == 2 else None,
                       resource="hw.gpu.utilization" if i % 4 == 2 else None,
                       baseline=10.0 + i if i % 3 else None, observed=100.5 + i if i % 3 else None,
                       unit="ms" if i % 4 != 2 else "1")
                 for i in range(n))


SPIKES = (
    Spike(id="a1", service="gateway", operation="POST /predict", state="resolved", start_unix_nano=T0,
          end_unix_nano=T0 + 60 * S, p99_ns=900 * MS, baseline_p99_ns=100 * MS, causes=causes(12),
          exemplar_trace_ids=(tid(1), tid(2))),
    Spike(id="b2", service="preprocess", operation="tokenize", state="open", start_unix_nano=T0 + 60 * S,
          end_unix_nano=None, p99_ns=50 * MS, baseline_p99_ns=5 * MS, causes=causes(1),
          exemplar_trace_ids=(tid(3),)),
    Spike(id="c3", service="gateway", operation="POST /predict", state="open", start_unix_nano=T0 + 120 * S,
          end_unix_nano=None, p99_ns=700 * MS, baseline_p99_ns=100 * MS, causes=()),
)
