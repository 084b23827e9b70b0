"""The agent as it runs on a host: ``spikehound agent`` in a child process between real senders and a real collector.

Senders are the OpenTelemetry SDK's own exporters (gRPC, HTTP/protobuf) and
hand-made OTLP requests; the collector runs on SQLite. What is checked is what
a user sees: the collector's API and database, the agent's /metrics and log,
and the answers senders get.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import sqlite3
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from harness.api_client import ApiClient, get_json, wait_json
from harness.daemons import AgentProcess, CollectorProcess, CollectorThread, collector_config
from harness.waiting import eventually
from spikehound import __version__
from spikehound.agent.enrich import machine_id
from tests.support.sdk_traffic import SdkApp, send_spans, trace_request

HOST = "gpu-node-3"
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
# The outage the agent rides out: 15 s spills requests to disk, restarts the agent in the middle of it and
# drains afterwards, all that is asserted; SPIKEHOUND_TEST_OUTAGE_SECONDS=600 is the ten-minute run of
# docs/operations.md.
OUTAGE_SECONDS = float(os.environ.get("SPIKEHOUND_TEST_OUTAGE_SECONDS", "15"))


# --- helpers ------------------------------------------------------------------------------------


def wait_trace(api: str, trace_id: str, spans: int, timeout: float = 60) -> dict[str, Any]:
    return wait_json(f"{api}/api/v1/traces/{trace_id}", lambda body: len(body["spans"]) == spans, timeout,
                     what=f"trace {trace_id} with {spans} spans in the collector")


def retry_info(exc: grpc.RpcError, code: int = code_pb2.RESOURCE_EXHAUSTED) -> float | None:
    """The RetryInfo delay in an error's ``grpc-status-details-bin`` trailer (as in test_overload), if its
    status has ``code``."""
    details = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if details is None:
        return None
    status = status_pb2.Status.FromString(details)
    info = error_details_pb2.RetryInfo()
    if status.code != code or not any(d.Unpack(info) for d in status.details):
        return None
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def plain(value: AnyValue) -> Any:
    """A scalar OTLP attribute value as Python."""
    which = value.WhichOneof("value")
    return getattr(value, which) if which else None


def stored_span_counts(db: Path, service: str) -> tuple[Counter[tuple[str, str]], bool]:
    """(trace id, span id) -> how often the collector's SQLite database holds it; and whether it keeps a row per span.

    With a row per span (table ``spans``) the database itself must hold each span once. When spans are kept
    as the blocks they arrived in (``span_blocks``), a replayed request may be stored twice by design and the
    readers serve each span once: the API check (``served_span_counts``) is what counts there.
    """
    counts: Counter[tuple[str, str]] = Counter()
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "spans" in tables:
            for trace_id, span_id, n in conn.execute(
                    "SELECT lower(hex(trace_id)), lower(hex(span_id)), count(*) FROM spans WHERE service = ? "
                    "GROUP BY trace_id, span_id", (service,)):
                counts[trace_id, span_id] = n
            repeated = conn.execute("SELECT count(*) FROM spans WHERE service = ? GROUP BY span_id "
                                    "HAVING count(*) > 1", (service,)).fetchall()
            assert not repeated, f"{len(repeated)} span ids are stored more than once"
            return counts, True
        for (payload,) in conn.execute("SELECT payload FROM span_blocks"):
            for rs in ExportTraceServiceRequest.FromString(payload).resource_spans:
                if {kv.key: plain(kv.value) for kv in rs.resource.attributes}.get("service.name") != service:
                    continue
                for ss in rs.scope_spans:
                    counts.update((sp.trace_id.hex(), sp.span_id.hex()) for sp in ss.spans)
    return counts, False


def served_span_counts(api: str, trace_ids: set[str]) -> Counter[tuple[str, str]]:
    """(trace id, span id) -> how often the collector's API serves it in its trace."""
    counts: Counter[tuple[str, str]] = Counter()
    with requests.Session() as session:
        client = ApiClient(api, session=session)
        for trace_id in trace_ids:
            r = client.get(f"/api/v1/traces/{trace_id}")
            if r.status_code == 200:
                counts.update((trace_id, span["span_id"]) for span in r.json()["spans"])
    return counts


def agent_idle(agent: AgentProcess) -> bool:
    """Nothing queued in memory or on disk."""
    m = agent.metrics()
    return (m[("spikehound_agent_spool_requests", ())] == 0 and m[("spikehound_agent_queue_memory_bytes", ())] == 0)


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Makes agents (not started) in the test's directory; kills whatever is still running at the end."""
    made: list[AgentProcess] = []

    def make(collector: str, *, interval: float | None = None, **env: str) -> AgentProcess:
        agent = AgentProcess(collector, tmp_path, interval=interval,
                             env={"SPIKEHOUND_AGENT_HOST_NAME": HOST, **env})
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.kill()


@pytest.fixture
def collector_process(tmp_path: Path) -> Iterator[CollectorProcess]:
    """A collector child process on SQLite, not started yet (its ports are chosen already)."""
    proc = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path)
    try:
        yield proc
    finally:
        proc.kill()


# --- a: end to end ----------------------------------------------------------------------------


def test_sdk_spans_through_the_agent_carry_the_host_and_its_metrics(sqlite_collector: CollectorThread, agents):
    api = sqlite_collector.api
    agent = agents(sqlite_collector.grpc_endpoint, interval=0.5).start()

    # The gRPC app runs in a container: its own host.name is kept aside, the host's replaces it.
    by_grpc = send_spans(GrpcSpanExporter(endpoint=agent.grpc_endpoint, insecure=True),
                         {"service.name": "llm-grpc", "host.name": "container-abc", "service.version": "2.1"})
    by_http = send_spans(HttpSpanExporter(endpoint=f"{agent.http_endpoint}/v1/traces"), {"service.name": "llm-http"})
    assert len(by_grpc.acked) == len(by_grpc.spans) == 12 and not by_grpc.failed
    assert len(by_http.acked) == len(by_http.spans) == 12 and not by_http.failed

    for recording, service in ((by_grpc, "llm-grpc"), (by_http, "llm-http")):
        trace_ids = {format(s.context.trace_id, "032x") for s in recording.spans}
        assert len(trace_ids) == 4
        for trace_id in trace_ids:
            body = wait_trace(api, trace_id, 3)
            sent = {format(s.context.span_id, "016x"): s for s in recording.spans
                    if format(s.context.trace_id, "032x") == trace_id}
            for span in body["spans"]:
                original = sent[span["span_id"]]
                assert (span["service"], span["host"], span["name"]) == (service, HOST, original.name)
                assert span["start_unix_nano"] == original.start_time
                assert span["resource"].get("host.id") == machine_id()  # None only where the host has no machine id
                if service == "llm-grpc":
                    assert span["resource"]["spikehound.sender.host.name"] == "container-abc"
                    assert span["resource"]["service.version"] == "2.1"
                else:
                    assert "spikehound.sender.host.name" not in span["resource"]

    # OTLP/HTTP JSON goes through the agent too (converted to protobuf on the way).
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    now = time.time_ns()
    doc = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-app"}}]},
        "scopeSpans": [{"spans": [{"traceId": trace_id, "spanId": span_id, "name": "lookup", "kind": 3,
                                   "startTimeUnixNano": str(now - 4_000_000), "endTimeUnixNano": str(now),
                                   "attributes": [{"key": "rows", "value": {"intValue": "7"}}]}]}]}]}
    r = requests.post(f"{agent.http_endpoint}/v1/traces", data=json.dumps(doc),
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    (span,) = wait_trace(api, trace_id, 1)["spans"]
    assert (span["span_id"], span["host"], span["kind"], span["duration_ns"]) == (span_id, HOST, "CLIENT", 4_000_000)
    assert span["attributes"] == {"rows": 7}

    # The host's own CPU, memory and network readings, under the same host name.
    wanted = {"system.cpu.utilization", "system.memory.utilization", "system.network.io"}

    def host_listed() -> dict[str, Any] | None:
        hosts = get_json(f"{api}/api/v1/hosts")["hosts"]
        mine = [h for h in hosts if h["host"] == HOST]
        return mine[0] if mine and wanted <= set(mine[0]["metrics"]) else None

    eventually(host_listed, f"{HOST} with {sorted(wanted)} in /api/v1/hosts", 20)
    memory = get_json(f"{api}/api/v1/metrics", host=HOST, name="system.memory.utilization")
    values = [p["value"] for s in memory["series"] for p in s["points"]]
    assert values and all(0 < v <= 1 for v in values), values
    assert all(s["host"] == HOST and s["unit"] == "1" for s in memory["series"])
    assert agent.metric("spikehound_agent_received_total", signal="spans", protocol="grpc") == 12
    assert agent.metric("spikehound_agent_received_total", signal="spans", protocol="http") == 13
    eventually(lambda: agent.metric("spikehound_agent_forwarded_total", signal="spans") == 25,
               "the agent counts 25 forwarded spans", 10)
    assert agent.terminate(30) == 0, agent.log_tail()


# --- b: a collector outage with an agent restart in the middle -----------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300 + 3 * OUTAGE_SECONDS)
def test_collector_outage_and_agent_restart_lose_no_acknowledged_span(collector_process: CollectorProcess, agents,
                                                                     tmp_path: Path):
    collector = collector_process.start()
    # A small memory queue, so that the outage spills to disk; a short drain, so the restart is quick.
    agent = agents(collector.grpc_endpoint, SPIKEHOUND_AGENT_MEMORY_QUEUE_BYTES="200000",
                   SPIKEHOUND_AGENT_DRAIN_SECONDS="2").start()
    app = SdkApp(agent.grpc_endpoint, "outage-app").start()
    try:
        eventually(lambda: agent.metric("spikehound_agent_forwarded_total", signal="spans") >= 600,
                   "spans forwarded before the outage", 30)

        # The collector goes away for the outage.
        assert collector.terminate(30) == 0, collector.log_tail()
        outage_started = time.monotonic()
        eventually(lambda: agent.metric("spikehound_agent_spool_requests") > 0,
                   "requests spilled to the agent's disk spool", OUTAGE_SECONDS / 2)
        assert agent.metric("spikehound_agent_spilled_requests_total") > 0
        assert agent.metric("spikehound_agent_collector_up") == 0

        # ... and the agent restarts in the middle of it, with spilled data on disk.
        eventually(lambda: agent.metric("spikehound_agent_spool_requests") >= 5,
                   "a few requests in the spool", OUTAGE_SECONDS / 2)
        acked_before_restart = len(app.recording.acked)
        assert agent.terminate(60) == 0, agent.log_tail()
        assert "left in the disk spool for the next start" in agent.log_text(), agent.log_tail()
        agent.start()
        assert "spooled on disk from an earlier run; forwarding them first" in agent.log_text(), agent.log_tail()
        assert agent.metric("spikehound_agent_spool_requests") > 0
        assert agent.metric("spikehound_agent_spool_bytes") > 0
        # The application's exporter rode out the restart: exports are acknowledged again.
        eventually(lambda: len(app.recording.acked) > acked_before_restart + 300,
                   "the SDK acknowledged by the restarted agent", 30)
        eventually(lambda: agent.metric("spikehound_agent_spilled_requests_total") > 0,
                   "the restarted agent spilling behind the old spool", 60)
        assert agent.metric("spikehound_agent_forwarded_total", signal="spans") == 0  # still no collector

        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - outage_started)))  # the outage the issue asks for
        assert agent.running, agent.log_tail()
        spooled = agent.metric("spikehound_agent_spool_requests"), agent.metric("spikehound_agent_spool_bytes")
        collector.start()
        back = time.monotonic()

        # The agent catches up on its own, then the application stops and the last spans go through.
        eventually(lambda: agent.metric("spikehound_agent_spool_requests") == 0,
                   "the spool drained after the collector came back", max(120.0, OUTAGE_SECONDS), every=0.5)
        # Shown with -s (the ten-minute run of docs/operations.md reads its figures here).
        print(f"\noutage {OUTAGE_SECONDS:.0f} s: {spooled[0]:.0f} requests ({spooled[1] / 1e6:.1f} MB) spooled; "
              f"drained {time.monotonic() - back:.1f} s after the collector came back")
    finally:
        app.stop()

    acked, failed = app.recording.acked, app.recording.failed
    assert len(acked) > 1000
    # Nothing left to forward and every acknowledged span stored, waited for as such: not as a forwarded count
    # that stood still for a second, which a collector slower than that on a loaded host would fool.
    eventually(lambda: agent_idle(agent), "the agent's queues empty", 60)
    db = tmp_path / "spikehound.db"
    eventually(lambda: not acked - stored_span_counts(db, "outage-app")[0].keys(), "every acknowledged span stored",
               60)

    stored, row_per_span = stored_span_counts(tmp_path / "spikehound.db", "outage-app")
    missing = acked - stored.keys()
    assert not missing, f"{len(missing)} of {len(acked)} spans the agent acknowledged are not in the database"
    # Anything else stored is from an export the SDK saw fail (e.g. cut off by the restart), never made up;
    # when no export failed, what is stored is exactly what was acknowledged.
    assert stored.keys() - acked <= failed
    if row_per_span:
        twice = {k: n for k, n in stored.items() if n != 1}
        assert not twice, f"{len(twice)} spans stored more than once"
    served = served_span_counts(collector.api, {trace_id for trace_id, _ in acked})
    assert not acked - served.keys(), f"{len(acked - served.keys())} acknowledged spans not served by the API"
    twice = {k: n for k, n in served.items() if n != 1}
    assert not twice, f"{len(twice)} spans served more than once, e.g. {next(iter(twice.items()), None)}"
    assert agent.metric("spikehound_agent_dropped_total", signal="spans") == 0
    print(f"{len(acked)} spans acknowledged by the agent, each stored and served exactly once")
    assert agent.terminate(30) == 0, agent.log_tail()
    assert collector.terminate(30) == 0, collector.log_tail()


# --- c: the disk cap ------------------------------------------------------------------------------


@pytest.mark.slow
def test_full_spool_pushes_back_and_keeps_everything_it_acknowledged(collector_process: CollectorProcess, agents,
                                                                    tmp_path: Path):
    # The collector's port is chosen but nothing listens on it yet.
    agent = agents(collector_process.grpc_endpoint, SPIKEHOUND_AGENT_MEMORY_QUEUE_BYTES="20000",
                   SPIKEHOUND_AGENT_SPOOL_MAX_BYTES="300000").start()
    acked: dict[str, int] = {}  # trace id -> spans
    refused_spans = 0
    with grpc.insecure_channel(agent.grpc_endpoint) as channel:
        stub = TraceServiceStub(channel)
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the agent never pushed back"
            payload, trace_id = trace_request("capped-app", spans=20)
            try:
                stub.Export(ExportTraceServiceRequest.FromString(payload), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "full" in exc.details()
                assert retry_info(exc) is not None and retry_info(exc) >= 1
                refused_spans += 20
                break
            acked[trace_id.hex()] = 20
        assert len(acked) > 50  # memory and spool took a good number before pushing back

    spool_bytes = agent.metric("spikehound_agent_spool_bytes")
    assert 250_000 < spool_bytes <= 300_000

    payload, trace_id = trace_request("capped-app", spans=20)
    r = requests.post(f"{agent.http_endpoint}/v1/traces", data=payload,
                      headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    status = status_pb2.Status.FromString(r.content)
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and "full" in status.message
    refused_spans += 20
    trace_id = os.urandom(16).hex()
    spans = [{"traceId": trace_id, "spanId": os.urandom(8).hex(), "name": "x", "startTimeUnixNano": "1",
              "endTimeUnixNano": "2", "attributes": [{"key": "padding", "value": {"stringValue": "x" * 40}}]}
             for _ in range(40)]  # larger than the request just refused: there is no room for it either
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "j"}}]},
                              "scopeSpans": [{"spans": spans}]}]}
    r = requests.post(f"{agent.http_endpoint}/v1/traces", json=doc, timeout=5)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.json()["code"] == code_pb2.RESOURCE_EXHAUSTED
    refused_spans += 40

    assert agent.running
    assert agent.metric("spikehound_agent_refused_total", signal="spans") == refused_spans
    assert agent.metric("spikehound_agent_spool_bytes") <= 300_000
    assert requests.get(f"{agent.metrics_url}/healthz", timeout=5).status_code == 200

    # The collector appears on that port: everything acknowledged arrives, and the agent takes data again.
    collector_process.start()
    eventually(lambda: agent_idle(agent), "the agent's spool drained into the collector", 90, every=0.5)
    payload, trace_id = trace_request("capped-app", spans=20)
    r = requests.post(f"{agent.http_endpoint}/v1/traces", data=payload,
                      headers={"Content-Type": "application/x-protobuf"}, timeout=5)
    assert r.status_code == 200, r.content
    acked[trace_id.hex()] = 20
    eventually(lambda: agent_idle(agent), "the last request forwarded", 30)

    # The collector answers after committing: everything forwarded is in the database, and served once.
    stored = Counter(trace_id for trace_id, _ in stored_span_counts(tmp_path / "spikehound.db", "capped-app")[0])
    assert stored == acked  # every acknowledged request whole, and nothing of the refused ones
    served = served_span_counts(collector_process.api, set(acked))
    assert Counter(trace_id for trace_id, _ in served.elements()) == acked
    assert agent.terminate(30) == 0, agent.log_tail()
    assert collector_process.terminate(30) == 0


# --- d: bad input -----------------------------------------------------------------------------------

GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01\x02"  # field 1, length-delimited, with a length far past the end


def test_bad_input_is_refused_with_a_reason_and_counted(sqlite_collector: CollectorThread, agents):
    agent = agents(sqlite_collector.grpc_endpoint).start()
    post = requests.Session()
    try:
        for path in ("/v1/traces", "/v1/metrics"):
            r = post.post(f"{agent.http_endpoint}{path}", data=GARBAGE,
                          headers={"Content-Type": "application/x-protobuf"}, timeout=5)
            assert r.status_code == 400
            status = status_pb2.Status.FromString(r.content)
            assert status.code == code_pb2.INVALID_ARGUMENT and "invalid OTLP protobuf" in status.message
        r = post.post(f"{agent.http_endpoint}/v1/traces", data=b'{"resourceSpans": [', timeout=5,
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert r.headers["Content-Type"].startswith("application/json")  # answered in the request's encoding
        assert r.json()["code"] == code_pb2.INVALID_ARGUMENT and "invalid JSON" in r.json()["message"]
        r = post.post(f"{agent.http_endpoint}/v1/traces", data=b"\x1f\x8b\x08\x00garbage", timeout=5,
                      headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
        assert r.status_code == 400 and "gzip" in status_pb2.Status.FromString(r.content).message
        r = post.post(f"{agent.http_endpoint}/v1/traces", data=b"spans please", timeout=5,
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "text/plain" in r.json()["message"]

        with grpc.insecure_channel(agent.grpc_endpoint) as channel:
            for method in (TRACE_METHOD, METRICS_METHOD):
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(method)(GARBAGE, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "invalid OTLP protobuf" in info.value.details()

            assert agent.metric("spikehound_agent_invalid_requests_total", protocol="http") == 5
            assert agent.metric("spikehound_agent_invalid_requests_total", protocol="grpc") == 2
            assert agent.metric("spikehound_agent_received_total") == 0

            # Still serving, over both protocols, and what it accepts arrives.
            payload, by_http = trace_request("after-garbage", spans=2)
            r = post.post(f"{agent.http_endpoint}/v1/traces", data=payload,
                          headers={"Content-Type": "application/x-protobuf"}, timeout=5)
            assert r.status_code == 200
            assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 0
            payload, by_grpc = trace_request("after-garbage", spans=3)
            channel.unary_unary(TRACE_METHOD)(payload, timeout=5)
    finally:
        post.close()
    assert agent.running
    wait_trace(sqlite_collector.api, by_http.hex(), 2)
    wait_trace(sqlite_collector.api, by_grpc.hex(), 3)
    assert agent.metric("spikehound_agent_received_total", signal="spans") == 5


# --- e: the agent's own samples go out as OTLP metrics with their own resource --------------------


class RecordingRelay:
    """A real OTLP/gRPC hop between agent and collector that keeps a copy of every metrics request it passes on."""

    def __init__(self, upstream: str) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self._channel = grpc.insecure_channel(upstream)
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        handlers = []
        for method in (TRACE_METHOD, METRICS_METHOD):
            service, name = method.strip("/").split("/")
            handlers.append(grpc.method_handlers_generic_handler(service, {name: grpc.unary_unary_rpc_method_handler(
                self._relay(method))}))
        self._server.add_generic_rpc_handlers(handlers)

    def _relay(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        upstream = self._channel.unary_unary(method)

        def relay(payload: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                answer = upstream(payload, timeout=10)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())
            if method == METRICS_METHOD:
                self.metrics.append(ExportMetricsServiceRequest.FromString(payload))  # list.append is atomic
            return answer

        return relay

    def __enter__(self) -> RecordingRelay:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None).wait(5)
        self._channel.close()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def test_agent_metrics_go_out_as_otlp_with_their_own_resource(sqlite_collector: CollectorThread, agents):
    with RecordingRelay(sqlite_collector.grpc_endpoint) as relay:
        agent = agents(relay.endpoint, interval=0.2).start()
        eventually(lambda: len(relay.metrics) >= 15, "15 metrics requests from the agent", 20)
        assert agent.terminate(30) == 0, agent.log_tail()

    series: dict[tuple[str, tuple[tuple[str, Any], ...]], list[tuple[int, float]]] = {}  # -> [(time, value)]
    for request in relay.metrics:
        for rm in request.resource_metrics:
            resource = {kv.key: plain(kv.value) for kv in rm.resource.attributes}
            assert resource["service.name"] == "spikehound-agent"
            assert resource["service.version"] == __version__
            assert resource["host.name"] == HOST
            assert resource.get("host.id") == machine_id()
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in getattr(m, m.WhichOneof("data")).data_points:
                        key = (m.name, tuple(sorted((kv.key, plain(kv.value)) for kv in p.attributes)))
                        series.setdefault(key, []).append((p.time_unix_nano, getattr(p, p.WhichOneof("value"))))

    memory = series[("system.memory.utilization", (("system.memory.state", "used"),))]
    assert len(memory) >= 10
    for key, points in series.items():
        times = [t for t, _ in points]
        assert times == sorted(times) and len(set(times)) == len(times), f"{key}: times not increasing"
    # One reading per interval: the samples are paced by a monotonic clock, not bunched or skipped.
    steps = [(b - a) / 1e9 for (a, _), (b, _) in itertools.pairwise(memory)]
    assert 0.15 <= statistics.median(steps) <= 0.3, steps
    network = [points for (name, _), points in series.items() if name == "system.network.io"]
    assert network and all([v for _, v in p] == sorted(v for _, v in p) for p in network)  # cumulative counters

    # The collector stored them under the agent's host, in time order, as many as it was sent.
    body = get_json(f"{sqlite_collector.api}/api/v1/metrics", host=HOST, name="system.memory.utilization")
    (stored,) = body["series"]
    assert len(stored["points"]) == len(memory)
    assert [p["t"] for p in stored["points"]] == sorted(p["t"] for p in stored["points"])


# --- f: a disk that refuses the spool ------------------------------------------------------------

FILE_LIMIT = 120_000  # bytes a spool segment may reach while the "disk is full"


@pytest.mark.slow
def test_a_full_disk_answers_unavailable_and_loses_nothing_acknowledged(collector_process: CollectorProcess, agents):
    # The collector is away, so requests spill to the spool. Then the agent's RLIMIT_FSIZE (prlimit) stops the
    # spool segment from growing: the kernel refuses the write (EFBIG) after writing what fits, as a full disk
    # does (ENOSPC). The agent must cut the partial record off, answer UNAVAILABLE / 503 with a retry delay,
    # keep serving, and take data again once there is room.
    agent = agents(collector_process.grpc_endpoint, interval=5.0, SPIKEHOUND_AGENT_MEMORY_QUEUE_BYTES="20000").start()
    assert agent.proc is not None
    _, hard = resource.prlimit(agent.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(agent.proc.pid, resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    post = requests.Session()
    headers = {"Content-Type": "application/x-protobuf"}
    acked: dict[str, int] = {}  # trace id -> spans
    for _ in range(200):
        payload, trace_id = trace_request("disk-full-app", spans=20)
        r = post.post(f"{agent.http_endpoint}/v1/traces", data=payload, headers=headers, timeout=10)
        if r.status_code != 200:
            break
        acked[trace_id.hex()] = 20
    else:
        pytest.fail("the agent never refused a request")
    assert r.status_code == 503, r.content
    assert int(r.headers["Retry-After"]) >= 1
    status = status_pb2.Status.FromString(r.content)
    assert status.code == code_pb2.UNAVAILABLE and "disk spool cannot be written" in status.message
    assert len(acked) > 20  # memory and spool took a good number first

    with grpc.insecure_channel(agent.grpc_endpoint) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(TRACE_METHOD)(trace_request("disk-full-app", spans=20)[0], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (retry_info(info.value, code_pb2.UNAVAILABLE) or 0) >= 1

    assert agent.running and requests.get(f"{agent.metrics_url}/healthz", timeout=5).status_code == 200
    assert agent.metric("spikehound_agent_spool_write_errors_total") >= 2
    assert agent.metric("spikehound_agent_unavailable_total", signal="spans") == 40
    assert 0 < agent.metric("spikehound_agent_spool_requests") <= len(acked) + 10  # own samples may be there too
    assert agent.metric("spikehound_agent_spool_bytes") <= FILE_LIMIT

    # Room on the disk again: the next request is taken, and everything acknowledged reaches the collector.
    resource.prlimit(agent.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
    payload, trace_id = trace_request("disk-full-app", spans=20)
    assert post.post(f"{agent.http_endpoint}/v1/traces", data=payload, headers=headers, timeout=10).ok
    post.close()
    acked[trace_id.hex()] = 20
    collector_process.start()
    eventually(lambda: agent_idle(agent), "the agent's spool drained into the collector", 90, every=0.5)
    served = served_span_counts(collector_process.api, set(acked))
    assert Counter(trace_id for trace_id, _ in served.elements()) == acked  # every acked request whole, once
    assert agent.metric("spikehound_agent_spool_corrupt_records_total") == 0  # the partial records were cut off
    assert agent.log_text().count("the disk refused") == 1, agent.log_text()  # one ERROR for the episode
    assert agent.terminate(30) == 0, agent.log_tail()
    assert collector_process.terminate(30) == 0


# --- g: requests larger than the collector takes ---------------------------------------------------

COLLECTOR_LIMIT = 64 * 1024


@pytest.fixture
def small_collector(tmp_path: Path) -> Iterator[CollectorThread]:
    """A collector that takes requests of at most COLLECTOR_LIMIT bytes (collector.max_request_bytes)."""
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__max_request_bytes=COLLECTOR_LIMIT)
    with CollectorThread(cfg) as running:
        yield running


def memory_points(api: str) -> int:
    body = get_json(f"{api}/api/v1/metrics", host=HOST, name="system.memory.utilization")
    return sum(len(s["points"]) for s in body["series"])


@pytest.mark.slow
def test_requests_over_the_collectors_limit_are_split_and_never_stall_the_agent(small_collector: CollectorThread,
                                                                              agents):
    # The application sends a request just under the collector's limit, which the agent's enrichment pushes
    # over, and small ones that merging would push over too. The agent learns the limit from the refusal,
    # splits, and everything arrives; its own metrics keep flowing. A span alone over the limit is refused to
    # its sender (partial_success), counted, and logged once per sender.
    api = small_collector.api
    agent = agents(small_collector.grpc_endpoint, interval=0.5).start()
    with grpc.insecure_channel(agent.grpc_endpoint) as channel:
        export = channel.unary_unary(TRACE_METHOD)
        near, near_id = trace_request("llm-server", spans=400, size=COLLECTOR_LIMIT - 16)
        export(near, timeout=10)
        small = [trace_request("llm-server", spans=100) for _ in range(3)]
        for payload, _ in small:
            export(payload, timeout=10)
        wait_trace(api, near_id.hex(), 400, timeout=30)
        for _, trace_id in small:
            wait_trace(api, trace_id.hex(), 100, timeout=30)
        assert agent.metric("spikehound_agent_forward_max_request_bytes") == COLLECTOR_LIMIT  # learned
        assert agent.metric("spikehound_agent_split_requests_total", signal="spans") >= 1
        assert agent.metric("spikehound_agent_forward_failures_total", reason="too_large") >= 1
        assert agent.metric("spikehound_agent_forwarded_total", signal="spans") == 700

        # Now the agent knows the limit: a span alone over it is refused to its sender, the rest taken.
        mixed = ExportTraceServiceRequest.FromString(trace_request("llm-server", spans=3)[0])
        spans = mixed.resource_spans[0].scope_spans[0].spans
        spans[1].attributes[0].value.string_value = "x" * COLLECTOR_LIMIT
        r = requests.post(f"{agent.http_endpoint}/v1/traces", data=mixed.SerializeToString(), timeout=10,
                          headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200
        partial = ExportTraceServiceResponse.FromString(r.content).partial_success
        assert partial.rejected_spans == 1 and f"larger than the {COLLECTOR_LIMIT} bytes" in partial.error_message
        wait_trace(api, spans[0].trace_id.hex(), 2)
        with pytest.raises(grpc.RpcError) as info:
            export(trace_request("llm-server", spans=1, padding=COLLECTOR_LIMIT)[0], timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in info.value.details()
    assert agent.metric("spikehound_agent_dropped_total", signal="spans", reason="too_large") == 2

    # The agent's own samples keep arriving all along.
    before = memory_points(api)
    eventually(lambda: memory_points(api) >= before + 2, "more of the agent's own samples", 20)
    assert agent.metric("spikehound_agent_forward_stalled_seconds") == 0

    log = agent.log_text()
    assert f"requests over {COLLECTOR_LIMIT} bytes are split" in log
    dropped = [line for line in log.splitlines() if "ERROR" in line and "dropped" in line]
    assert len(dropped) == 1 and "'llm-server'" in dropped[0], log  # once per sender, not per span
    assert agent.terminate(30) == 0, agent.log_tail()
