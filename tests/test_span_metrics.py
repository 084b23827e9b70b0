"""The metrics dashboards and alert rules read, on a real collector's /metrics, fed by the real OTel SDK.

Span metrics must look exactly like the OpenTelemetry Collector spanmetrics connector's (so that Jaeger's
Monitor tab and existing dashboards work unchanged); resource samples appear under the seed article's names;
spike state is read from storage.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from harness.daemons import CollectorThread, collector_config
from harness.scrape import Samples, parse, sample, scrape, scrape_text
from harness.waiting import eventually
from spikehound.collector.detection_worker import span_counter
from spikehound.collector.span_metrics import SpanMetrics
from spikehound.model import Cause, CauseKind, Span, SpanKind, Spike, StatusCode
from spikehound.storage.engine import make_engine
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.otel_send import MS, sample_provider, send_durations, timed_span, tracer_provider

CONNECTOR_LES = ["2", "4", "6", "8", "10", "50", "100", "200", "400", "800", "1000", "1400", "2000", "5000",
                 "10000", "15000", "+Inf"]
def families(metrics: SpanMetrics) -> list[Metric]:
    """The span metrics' families as a scraper parses them."""
    return list(text_string_to_metric_families(metrics.exposition().decode()))


def wait_metric(api: str, name: str, expected: float, timeout: float = 60, **labels: str) -> Samples:
    def reached() -> Samples:
        samples = scrape(api)
        seen = sample(samples, name, **labels)
        assert seen == expected, f"{name}{labels} is {seen}, expected {expected}"  # chained to the timeout
        return samples

    return eventually(reached, f"{name}{labels} to be {expected}", timeout)


def test_spans_become_the_spanmetrics_connector_series(sqlite_collector):
    api, endpoint = sqlite_collector.api, sqlite_collector.grpc_endpoint
    t0 = time.time_ns() - 60 * 1_000_000_000
    durations_ms = [1, 3, 7, 50, 120, 900, 20_000]  # 50 ms lands in le="50": bucket bounds are inclusive
    provider = tracer_provider(endpoint, "llm-gateway", host="gpu-host-3")
    tracer = provider.get_tracer("test")
    for i, ms in enumerate(durations_ms):
        root = timed_span(tracer, "POST /v1/chat", t0 + i * 30_000 * MS, ms * MS, kind=trace.SpanKind.SERVER)
        if i < 2:  # a failing feature lookup inside two of the requests: a CLIENT span, not an entry span
            timed_span(tracer, "GET /features", t0 + i * 30_000 * MS, (5 + 7 * i) * MS,
                       kind=trace.SpanKind.CLIENT, parent=root, error=True)
        if i == 2:
            timed_span(tracer, "tokenize", t0 + i * 30_000 * MS, 2 * MS, kind=trace.SpanKind.INTERNAL,
                       parent=root, ok=True)
    provider.shutdown()

    server = {"service_name": "llm-gateway", "span_name": "POST /v1/chat", "span_kind": "SPAN_KIND_SERVER",
              "status_code": "STATUS_CODE_UNSET"}
    samples = wait_metric(api, "traces_span_metrics_calls_total", 7, **server)
    text = scrape_text(api)
    samples = parse(text)
    assert "# TYPE traces_span_metrics_calls_total counter" in text
    assert "# TYPE traces_span_metrics_duration_milliseconds histogram" in text

    buckets = {dict(labels)["le"]: v for (name, labels), v in samples.items()
               if name == "traces_span_metrics_duration_milliseconds_bucket"
               and set(server.items()) <= set(labels)}
    assert list(buckets) == CONNECTOR_LES  # the connector's default bounds, written as Go writes them
    assert [buckets[le] for le in ("2", "4", "8", "50", "100", "200", "1000", "15000", "+Inf")] == \
        [1, 2, 3, 4, 4, 5, 6, 6, 7]
    assert sample(samples, "traces_span_metrics_duration_milliseconds_count", **server) == 7
    assert sample(samples, "traces_span_metrics_duration_milliseconds_sum", **server) == pytest.approx(
        sum(durations_ms))

    client = {"service_name": "llm-gateway", "span_name": "GET /features", "span_kind": "SPAN_KIND_CLIENT",
              "status_code": "STATUS_CODE_ERROR"}
    assert sample(samples, "traces_span_metrics_calls_total", **client) == 2
    assert sample(samples, "traces_span_metrics_duration_milliseconds_sum", **client) == pytest.approx(5 + 12)
    internal = {"service_name": "llm-gateway", "span_name": "tokenize", "span_kind": "SPAN_KIND_INTERNAL",
                "status_code": "STATUS_CODE_OK"}
    assert sample(samples, "traces_span_metrics_calls_total", **internal) == 1

    # The seed's histogram: entry spans only, in seconds, per service, operation and host.
    entry = {"service": "llm-gateway", "operation": "POST /v1/chat", "host": "gpu-host-3"}
    assert sample(samples, "model_inference_latency_seconds_count", **entry) == 7
    assert sample(samples, "model_inference_latency_seconds_sum", **entry) == pytest.approx(sum(durations_ms) / 1e3)
    assert sample(samples, "model_inference_latency_seconds_bucket", le="0.1", **entry) == 4
    assert not [k for k in samples if k[0].startswith("model_inference") and ("operation", "GET /features") in k[1]]


def test_series_beyond_the_limit_are_aggregated_into_the_overflow_series_and_counted(tmp_path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__span_metrics_max_series=3)
    with CollectorThread(cfg) as collector:
        start = time.time_ns() - 10 * 1_000_000_000
        provider = tracer_provider(collector.grpc_endpoint, "router")
        tracer = provider.get_tracer("test")
        for i in range(10):  # ten span names (think: an id in the name), two spans each
            for j in range(2):
                timed_span(tracer, f"GET /users/{i}", start + (2 * i + j) * MS, 3 * MS)
        provider.shutdown()
        samples = wait_metric(collector.api, "spikehound_span_metrics_overflow_spans_total", 14, set="spanmetrics")

    named = [v for (name, labels), v in samples.items()
             if name == "traces_span_metrics_calls_total" and ("service_name", "router") in labels]
    assert sorted(named) == [2, 2, 2]
    assert sample(samples, "traces_span_metrics_calls_total", otel_metric_overflow="true") == 14
    assert sample(samples, "traces_span_metrics_duration_milliseconds_bucket", otel_metric_overflow="true",
                 le="4") == 14
    assert sample(samples, "spikehound_span_metrics_overflow_spans_total", set="model_inference") == 14
    assert sample(samples, "model_inference_latency_seconds_count", otel_metric_overflow="true") == 14


def test_span_metrics_can_be_switched_off(tmp_path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__span_metrics=False)
    with CollectorThread(cfg) as collector:
        send_durations(collector.grpc_endpoint, "quiet", "GET /", [MS] * 5, time.time_ns() - 1_000_000_000)
        samples = wait_metric(collector.api, "spikehound_ingest_stored_total", 5, signal="spans")
    assert not [k for k in samples if k[0].startswith(("traces_span_metrics", "model_inference"))]


def test_resource_samples_appear_under_the_seed_names(sqlite_collector):
    io = {"n": 0}

    def network() -> list[tuple[float, dict]]:
        io["n"] += 1
        return [(1000.0 * io["n"], {"network.interface.name": "eth0", "network.io.direction": "transmit"}),
                (5000.0, {"network.interface.name": "eth0", "network.io.direction": "receive"})]

    provider = sample_provider(sqlite_collector.grpc_endpoint, "gpu-host-9", {
        "hw.gpu.utilization": ("1", lambda: [(0.12, {"hw.id": "GPU-aaaa", "gpu.index": 0}),
                                             (0.93, {"hw.id": "GPU-bbbb", "gpu.index": 1}),
                                             (0.5, {"hw.id": "GPU-aaaa", "gpu.index": 0, "hw.gpu.task": "decoder"})]),
        "system.cpu.load_average.1m": ("{thread}", lambda: [(3.5, {})]),
    }, counters={"system.network.io": ("By", network)})
    try:
        samples = wait_metric(sqlite_collector.api, "cpu_load_average", 3.5, host="gpu-host-9")
        samples = wait_metric(sqlite_collector.api, "network_io_bytes_total", 5000, host="gpu-host-9",
                              interface="eth0", direction="receive")
    finally:
        provider.shutdown()
    assert sample(samples, "gpu_utilization_percentage", host="gpu-host-9", gpu="0", gpu_uuid="GPU-aaaa") == \
        pytest.approx(12.0)
    assert sample(samples, "gpu_utilization_percentage", host="gpu-host-9", gpu="1", gpu_uuid="GPU-bbbb") == \
        pytest.approx(93.0)
    assert len([k for k in samples if k[0] == "gpu_utilization_percentage"]) == 2  # the decoder engine is not it
    assert sample(samples, "network_io_bytes_total", host="gpu-host-9", interface="eth0", direction="transmit") >= 1000


def _spike(spike_id: str, service: str, state: str, causes: tuple[Cause, ...]) -> Spike:
    start = time.time_ns() - 60 * 1_000_000_000
    return Spike(id=spike_id, service=service, operation="POST /v1/chat", state=state, start_unix_nano=start,
                 end_unix_nano=None if state == "open" else start + 30 * 1_000_000_000, p99_ns=900 * MS,
                 baseline_p99_ns=120 * MS, causes=causes)


def test_spike_state_is_read_from_storage(collector, db_url):
    gpu = Cause(kind=CauseKind.RESOURCE, score=0.8, summary="GPU utilization fell", host="gpu-1",
                resource="hw.gpu.utilization")
    net = Cause(kind=CauseKind.NETWORK, score=0.6, summary="gateway -> model-server hop slowed",
                service="model-server", peer_service="gateway")
    engine = make_engine(db_url)
    try:
        Writer(engine).write(WriteBatch(spikes=[_spike("s1", "llm", "open", (gpu, net)),
                                                _spike("s2", "llm", "resolved", (net,)),
                                                _spike("s3", "rerank", "open", ())]))
    finally:
        engine.dispose()
    samples = scrape(collector.api)
    assert sample(samples, "spikehound_open_spikes", service="llm") == 1
    assert sample(samples, "spikehound_open_spikes", service="rerank") == 1
    assert sample(samples, "spikehound_spikes_opened_total", cause_kind="resource") == 1
    assert sample(samples, "spikehound_spikes_opened_total", cause_kind="network") == 1
    assert sample(samples, "spikehound_spikes_opened_total", cause_kind="none") == 1
    assert sample(samples, "spikehound_spike_metrics_errors_total") == 0


def test_a_batch_the_span_metrics_cannot_read_is_counted_not_raised(caplog):
    metrics = SpanMetrics(max_series=10)
    metrics.add(SimpleNamespace(spans=[object()]))  # the commit hook must never fail a committed batch
    assert metrics.errors == 1
    assert "span metrics could not take a batch" in caplog.text



def test_series_that_went_quiet_are_dropped_so_that_new_names_get_series_again():
    """A flood of one-off names fills the series; ten minutes after it stopped, they go and new names fit."""
    now = [0.0]
    metrics = SpanMetrics(max_series=4, clock=lambda: now[0])

    def span(name: str) -> Span:
        return Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, parent_span_id=None, service="router", host=None,
                    name=name, kind=SpanKind.SERVER, start_unix_nano=0, end_unix_nano=3 * MS, status=StatusCode.OK)

    def named() -> set[str]:
        calls = next(iter(families(metrics)))
        return {s.labels["span_name"] for s in calls.samples if "span_name" in s.labels}

    metrics.add_spans([span("GET /health")] + [span(f"GET /users/{i}") for i in range(10)])
    assert named() == {"GET /health", "GET /users/0", "GET /users/1", "GET /users/2"}
    for minute in range(1, 25):  # /health keeps counting; the ids never come back
        now[0] = minute * 60.0
        metrics.add_spans([span("GET /health")])
    metrics.add_spans([span("GET /orders/{id}")])
    assert named() == {"GET /health", "GET /orders/{id}"}
    assert metrics.dropped_series == 6  # three names, each in both sets
    assert metrics.overflow_spans == 2 * 7  # the flood's names past the limit, in both sets


def test_counts_taken_from_the_detection_process_add_up_in_the_collector_within_its_bounds():
    """The detection process counts each commit's spans and the collector's instance adds them: the same series
    as counting there, keys past the collector's bound in its overflow series, and every span counted, also
    on steady traffic across the ten-minute sweeps of idle series (where a feed counts as much as the last)."""
    now = [0.0]

    def span(name: str, ms: int) -> Span:
        return Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, parent_span_id=None, service="router", host="h1",
                    name=name, kind=SpanKind.SERVER, start_unix_nano=0, end_unix_nano=ms * MS, status=StatusCode.OK)

    batches = [[span("GET /a", 3), span("GET /b", 70)], [span("GET /a", 900), span("GET /c", 5)]]
    batches += [[span("GET /a", 3), span("GET /b", 70)]] * 1800  # one commit a second for half an hour
    direct, added = SpanMetrics(max_series=2, clock=lambda: now[0]), SpanMetrics(max_series=2, clock=lambda: now[0])
    counting = span_counter(clock=lambda: now[0])
    for second, spans in enumerate(batches):
        now[0] = float(second)
        direct.add_spans(spans)
        counting.add_spans(spans)
        added.add_counts(counting.take_counts())
    assert counting.take_counts().calls == {}  # taking starts the counts again
    assert added.exposition() == direct.exposition()
    calls = next(iter(families(added)))
    assert sum(s.value for s in calls.samples) == 2 * len(batches)
    assert added.overflow_spans == direct.overflow_spans == 2  # GET /c in both sets
