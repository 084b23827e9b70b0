"""The JSON forms of spans, causes and spikes that the REST API serves and the notifiers send.

Plain functions of the model, with no web framework, so that whatever needs a spike as JSON (a route, a
webhook body) imports this module alone.

>>> from spikehound.model import Cause, CauseKind
>>> cause_json(Cause(kind=CauseKind.SPAN, score=0.8, summary="resize +40 ms", service="preprocess"))["kind"]
'span'
"""

from __future__ import annotations

from typing import Any

from spikehound.model import Cause, Span, Spike
from spikehound.timefmt import rfc3339


def span_json(s: Span) -> dict[str, Any]:
    return {
        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
        "parent_span_id": s.parent_span_id.hex() if s.parent_span_id else None,
        "service": s.service, "host": s.host, "name": s.name, "kind": s.kind.name,
        "start": rfc3339(s.start_unix_nano), "start_unix_nano": s.start_unix_nano,
        "duration_ns": s.duration_ns, "status": s.status.name, "attributes": s.attributes,
        "resource": s.resource, "events": s.events,
    }


def cause_json(c: Cause) -> dict[str, Any]:
    return {"kind": str(c.kind), "service": c.service, "operation": c.operation, "peer_service": c.peer_service,
            "host": c.host, "resource": c.resource, "score": c.score, "baseline": c.baseline,
            "observed": c.observed, "unit": c.unit, "summary": c.summary}


def spike_json(s: Spike) -> dict[str, Any]:
    return {"id": s.id, "service": s.service, "operation": s.operation, "peer_service": s.peer_service,
            "state": s.state, "start": rfc3339(s.start_unix_nano), "end": rfc3339(s.end_unix_nano),
            "p99_ms": s.p99_ns / 1e6, "baseline_p99_ms": s.baseline_p99_ns / 1e6,
            "causes": [cause_json(c) for c in s.causes],
            "exemplar_trace_ids": [t.hex() for t in s.exemplar_trace_ids],
            "affected_streams": [{"service": a.service, "operation": a.operation, "peer_service": a.peer_service,
                                  "start": rfc3339(a.start_unix_nano),
                                  "last_anomalous_end": rfc3339(a.last_anomalous_end_unix_nano),
                                  "p99_ms": a.p99_ns / 1e6, "baseline_p99_ms": a.baseline_p99_ns / 1e6,
                                  "evidence": a.evidence, "slow_requests": a.slow_requests}
                                 for a in s.affected]}
