"""Overload: a tiny ingest queue under many concurrent senders over gRPC and HTTP.

Senders are told to come back later (RESOURCE_EXHAUSTED with RetryInfo, 429
with Retry-After), the collector process stays up with bounded memory, and
every request that was answered OK is in the database.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from harness.daemons import CollectorProcess
from harness.scrape import scrape

QUEUE_CAPACITY = 600
SPANS_PER_REQUEST = 512
SENDERS_PER_PROTOCOL = 4
BURST_SECONDS = 12.0
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

# CollectorProcess.start leaves its log file to the garbage collector; the fixture collects it under this filter.


def request_template() -> tuple[bytes, bytes]:
    """A 512-span request whose spans all carry one placeholder trace id, and that placeholder.

    Swapping the placeholder for a fresh id gives a new request without building it again,
    so the senders are fast enough to overload the collector.
    """
    placeholder = os.urandom(16)
    now = time.time_ns()
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "overload-svc"
    rs.resource.attributes.add(key="host.name").value.string_value = "load-host"
    scope = rs.scope_spans.add()
    for i in range(SPANS_PER_REQUEST):
        sp = scope.spans.add(trace_id=placeholder, span_id=(i + 1).to_bytes(8, "big"), name=f"op-{i % 8}",
                             kind=2, start_time_unix_nano=now - 5_000_000 + i, end_time_unix_nano=now + i)
        sp.attributes.add(key="request.index").value.int_value = i
    body = req.SerializeToString()
    assert body.count(placeholder) == SPANS_PER_REQUEST
    return body, placeholder


@dataclass(slots=True)
class Outcome:
    protocol: str
    trace_id: str
    result: str  # "ok", "retry_later" or what else came back
    retry_after: float | None = None


def grpc_sender(endpoint: str, template: bytes, placeholder: bytes, until: float, out: list[Outcome]) -> None:
    with grpc.insecure_channel(endpoint) as channel:
        export = channel.unary_unary(EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString)
        while time.monotonic() < until:
            trace_id = os.urandom(16)
            try:
                response = export(template.replace(placeholder, trace_id), timeout=15)
            except grpc.RpcError as exc:
                out.append(grpc_refusal(trace_id.hex(), exc))
                continue
            rejected = response.partial_success.rejected_spans
            out.append(Outcome("grpc", trace_id.hex(), "ok" if not rejected else f"partial {rejected}"))


def grpc_refusal(trace_id: str, exc: grpc.RpcError) -> Outcome:
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Outcome("grpc", trace_id, f"{exc.code()}: {exc.details()}")
    details = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if details is None:
        return Outcome("grpc", trace_id, "RESOURCE_EXHAUSTED without grpc-status-details-bin")
    status = status_pb2.Status.FromString(details)
    retry = error_details_pb2.RetryInfo()
    if status.code != code_pb2.RESOURCE_EXHAUSTED or not any(d.Unpack(retry) for d in status.details):
        return Outcome("grpc", trace_id, f"status details without RetryInfo: {status}")
    return Outcome("grpc", trace_id, "retry_later", retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9)


def http_sender(endpoint: str, template: bytes, placeholder: bytes, until: float, out: list[Outcome]) -> None:
    with requests.Session() as session:
        while time.monotonic() < until:
            trace_id = os.urandom(16)
            r = session.post(f"{endpoint}/v1/traces", data=template.replace(placeholder, trace_id),
                             headers={"Content-Type": "application/x-protobuf"}, timeout=15)
            if r.status_code == 200:
                rejected = ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans
                out.append(Outcome("http", trace_id.hex(), "ok" if not rejected else f"partial {rejected}"))
            elif r.status_code == 429 and r.headers.get("Retry-After", "").isdigit():
                status = status_pb2.Status.FromString(r.content)
                result = "retry_later" if status.code == code_pb2.RESOURCE_EXHAUSTED and status.message else \
                    f"429 with status {status}"
                out.append(Outcome("http", trace_id.hex(), result, float(r.headers["Retry-After"])))
            else:
                out.append(Outcome("http", trace_id.hex(), f"HTTP {r.status_code} {r.headers} {r.content[:200]!r}"))


def guarded(sender: Callable[..., None], protocol: str, out: list[Outcome]) -> Callable[..., None]:
    """Run a sender; an exception becomes an outcome the test reports instead of a dead thread."""
    def run(*args: object) -> None:
        try:
            sender(*args, out)
        except Exception as exc:
            out.append(Outcome(protocol, "", f"sender failed: {exc!r}"))
    return run


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture
def tiny_queue_collector(tmp_path: Path) -> Iterator[CollectorProcess]:
    env = {"SPIKEHOUND_COLLECTOR_QUEUE_CAPACITY": str(QUEUE_CAPACITY), "SPIKEHOUND_LOG_LEVEL": "warning"}
    proc = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path, env=env).start()
    try:
        yield proc
    finally:
        proc.kill()


def test_overload_is_refused_retryably_with_bounded_memory_and_no_lost_acks(
        tiny_queue_collector: CollectorProcess, tmp_path: Path):
    c = tiny_queue_collector
    assert c.proc is not None
    template, placeholder = request_template()
    outcomes: list[Outcome] = []  # list.append is atomic; each sender appends its own results
    start = time.monotonic()
    until = start + BURST_SECONDS
    senders = [threading.Thread(target=guarded(send, protocol, outcomes),
                                args=(endpoint, template, placeholder, until))
               for protocol, send, endpoint in (("grpc", grpc_sender, c.grpc_endpoint),
                                                ("http", http_sender, c.http_endpoint))
               for _ in range(SENDERS_PER_PROTOCOL)]
    for t in senders:
        t.start()

    # Watch the process while it is overloaded: RSS at the middle and at the end, queue never past capacity.
    rss_mid = rss_end = 0
    most_queued = 0.0
    while time.monotonic() < until:
        time.sleep(0.25)
        assert c.proc.poll() is None, f"collector died under load: {c.log_tail()}"
        if not rss_mid and time.monotonic() >= start + BURST_SECONDS / 2:
            rss_mid = rss_bytes(c.proc.pid)
        most_queued = max(most_queued, scrape(c.api)[("spikehound_ingest_queue_items", ())])
    rss_end = rss_bytes(c.proc.pid)
    for t in senders:
        t.join(30)
        assert not t.is_alive()

    # Still up and serving after the burst.
    assert c.proc.poll() is None, c.log_tail()
    assert requests.get(f"{c.api}/readyz", timeout=5).status_code == 200

    unexpected = [o for o in outcomes if o.result not in ("ok", "retry_later")]
    assert not unexpected, unexpected[:5]
    by = {(p, r): [o for o in outcomes if o.protocol == p and o.result == r]
          for p in ("grpc", "http") for r in ("ok", "retry_later")}
    for (protocol, result), got in by.items():
        assert got, f"no {result} answers over {protocol}: the test did not overload the collector"
    assert all(o.retry_after is not None and o.retry_after >= 1 for o in outcomes if o.result == "retry_later")

    assert most_queued <= QUEUE_CAPACITY
    assert rss_end <= rss_mid * 1.5 + 30 * 2**20, f"RSS grew from {rss_mid >> 20} MiB to {rss_end >> 20} MiB"

    acked = {o.trace_id for o in outcomes if o.result == "ok"}
    refused = {o.trace_id for o in outcomes if o.result == "retry_later"}
    metrics = scrape(c.api)
    dropped = metrics[("spikehound_ingest_dropped_total", (("reason", "queue_full"), ("signal", "spans")))]
    assert dropped == SPANS_PER_REQUEST * len(refused) > 0
    assert metrics[("spikehound_ingest_stored_total", (("signal", "spans"),))] == SPANS_PER_REQUEST * len(acked)

    # Every acknowledged request is in the database, whole; nothing of a refused one is.
    with sqlite3.connect(f"file:{tmp_path / 'spikehound.db'}?mode=ro", uri=True) as db:
        counts = dict(db.execute("SELECT lower(hex(t.trace_id)), sum(b.span_count) FROM trace_blocks t "
                                 "JOIN span_blocks b ON b.id = t.block_id GROUP BY t.trace_id"))
    missing = [t for t in acked if counts.get(t) != SPANS_PER_REQUEST]
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged requests not fully stored"
    assert not refused & counts.keys()
    assert counts.keys() == acked

    assert c.terminate(15) == 0, c.log_tail()
