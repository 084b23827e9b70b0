"""The JSON form of spans, causes and spikes: written for the REST API, the webhook body and the alert groups'
saved state, and read back by whatever then reasons about them (the demo judging the API's answers, alerting
restoring its groups). Plain functions of the model, with no web framework.

Reading is exact: times keep every digit (RFC 3339 with nanoseconds) and the ``*_ms`` fields are
nanoseconds divided by 10**6. Fields an older writer left out take their defaults.

>>> cause = cause_from_json({"kind": "network", "service": "model-server", "operation": "POST /infer",
...                          "peer_service": "gateway", "score": 0.8, "summary": "hop +60 ms"})
>>> cause.kind is CauseKind.NETWORK, cause.peer_service, cause.host
(True, 'gateway', None)
>>> cause_from_json({"kind": "gpu", "score": 1.0, "summary": ""})
Traceback (most recent call last):
...
ValueError: 'gpu' is not a valid CauseKind
"""

from __future__ import annotations

from typing import Any

from spikehound.model import AffectedStream, Cause, CauseKind, Span, Spike
from spikehound.timefmt import parse_time, rfc3339
from spikehound.units import MS


def cause_from_json(doc: dict[str, Any]) -> Cause:
    """One of a spike's ``causes``; ValueError when its kind is not a :class:`CauseKind`."""
    return Cause(kind=CauseKind(doc["kind"]), score=doc["score"], summary=doc["summary"], service=doc.get("service"),
                 operation=doc.get("operation"), peer_service=doc.get("peer_service"), host=doc.get("host"),
                 resource=doc.get("resource"), baseline=doc.get("baseline"), observed=doc.get("observed"),
                 unit=doc.get("unit"))


def affected_from_json(doc: dict[str, Any]) -> AffectedStream:
    """One of a spike's ``affected_streams``."""
    return AffectedStream(service=doc["service"], operation=doc["operation"], peer_service=doc.get("peer_service"),
                          start_unix_nano=parse_time(doc["start"]),
                          last_anomalous_end_unix_nano=parse_time(doc["last_anomalous_end"]),
                          p99_ns=ns_of_ms(doc["p99_ms"]), baseline_p99_ns=ns_of_ms(doc["baseline_p99_ms"]),
                          evidence=doc["evidence"], slow_requests=doc.get("slow_requests", 0))


def spike_from_json(doc: dict[str, Any]) -> Spike:
    """The spike of the API's JSON (which does not say when the detector opened it: ``detected_unix_nano`` None)."""
    end = doc.get("end")
    return Spike(id=doc["id"], service=doc["service"], operation=doc["operation"], state=doc["state"],
                 start_unix_nano=parse_time(doc["start"]), end_unix_nano=parse_time(end) if end else None,
                 p99_ns=ns_of_ms(doc["p99_ms"]), baseline_p99_ns=ns_of_ms(doc["baseline_p99_ms"]),
                 causes=tuple(cause_from_json(c) for c in doc["causes"]),
                 exemplar_trace_ids=tuple(bytes.fromhex(t) for t in doc.get("exemplar_trace_ids", ())),
                 peer_service=doc.get("peer_service"),
                 affected=tuple(affected_from_json(a) for a in doc.get("affected_streams", ())),
                 recurrence_of=doc.get("recurrence_of"), occurrence=doc.get("occurrence", 1),
                 first_start_unix_nano=parse_time(doc["first_start"]) if doc.get("first_start") else None)


def ns_of_ms(ms: float) -> int:
    """Nanoseconds from the API's milliseconds (written as ns / 10**6, so rounding recovers them)."""
    return round(ms * MS)


# --- written -----------------------------------------------------------------------------------


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
                                 for a in s.affected],
            "recurrence_of": s.recurrence_of, "occurrence": s.occurrence,
            "first_start": rfc3339(s.first_start_unix_nano)}
