"""What a collector serves of the spans its senders were told were stored, how an agent's queues stand, and the
retry answer a collector gives a raw OTLP export: the checks the fault tests share."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path

import grpc
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.api_client import ApiClient
from harness.daemons import AgentProcess
from spikehound.otlp import trailer_retry_delay

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def served_span_counts(api: str, trace_ids: Iterable[str]) -> Counter[tuple[str, str]]:
    """(trace id, span id) -> how often the collector's API serves it in its trace (each GET must answer 200 or
    404, as documented)."""
    counts: Counter[tuple[str, str]] = Counter()
    with requests.Session() as session:
        client = ApiClient(api, session=session)
        for trace_id in set(trace_ids):
            r = client.get(f"/api/v1/traces/{trace_id}")
            assert r.status_code in (200, 404), f"GET /api/v1/traces/{trace_id} answered {r.status_code}: {r.text}"
            if r.status_code == 200:
                counts.update((trace_id, span["span_id"]) for span in r.json()["spans"])
    return counts


def assert_served_once(api: str, acked: set[tuple[str, str]]) -> None:
    """Every acknowledged (trace id, span id) is served, and none of those traces' spans twice."""
    served = served_span_counts(api, {trace_id for trace_id, _ in acked})
    missing = acked - served.keys()
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged spans are not served, e.g. {min(missing)}"
    twice = {k: n for k, n in served.items() if n != 1}
    assert not twice, f"{len(twice)} spans served more than once, e.g. {min(twice.items())}"


def agent_idle(agent: AgentProcess) -> bool:
    """Nothing queued in the agent's memory or on its disk."""
    m = agent.metrics()
    return m[("spikehound_agent_spool_requests", ())] == 0 and m[("spikehound_agent_queue_memory_bytes", ())] == 0


def grpc_export(endpoint: str, payload: bytes, timeout: float = 10) -> tuple[grpc.StatusCode, float | None]:
    """Export one encoded ExportTraceServiceRequest over gRPC: the status code and the RetryInfo delay (None
    without one)."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            channel.unary_unary(TRACE_METHOD)(payload, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), trailer_retry_delay(exc.trailing_metadata())  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, None


def http_export(endpoint: str, payload: bytes, session: requests.Session | None = None,
                timeout: float = 10) -> requests.Response:
    """POST one encoded ExportTraceServiceRequest to an OTLP/HTTP receiver (``endpoint``: its base URL)."""
    return (session or requests).post(f"{endpoint}/v1/traces", data=payload, headers=PROTOBUF, timeout=timeout)


def stored_spans(db: Path) -> set[tuple[str, str]]:
    """(trace id, span id) of every span a collector's SQLite database holds (a replayed block counts once)."""
    if not db.exists():
        return set()
    found: set[tuple[str, str]] = set()
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            rows = conn.execute("SELECT payload FROM span_blocks").fetchall()
        except sqlite3.OperationalError:  # not migrated yet
            return set()
    for (payload,) in rows:
        for rs in ExportTraceServiceRequest.FromString(payload).resource_spans:
            for ss in rs.scope_spans:
                found.update((sp.trace_id.hex(), sp.span_id.hex()) for sp in ss.spans)
    return found
