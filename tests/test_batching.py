"""``spikehound analyze batching``: a batching experiment replayed into a real collector, the sweet spot found.

A model server instrumented with the OpenTelemetry SDK runs batch sizes 1, 4,
8, 16 and 32 one after another, as a batching experiment does: batches run
back to back, a forward pass of ``8 + 1.5 b`` ms (log-normal spread), so
latency grows with the batch size and throughput (b per forward pass)
saturates. The GPU's ``hw.gpu.utilization`` samples go in over OTLP/gRPC like
an agent's (the GPU is the part this machine lacks). The p99 per batch size is
known from the model: about 12, 17, 25, 39 and 68 ms.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from harness.api_client import ApiClient
from harness.daemons import CollectorThread, collector_config
from spikehound.detectors.batching import BatchRequest, analyze_batching, batch_requests
from spikehound.model import Span, StatusCode
from spikehound.model import SpanKind as ModelKind
from tests.support.cli import spikehound, unix

MS = 1_000_000
NS = 1_000_000_000
SIZES = (1, 4, 8, 16, 32)
UTILIZATION = {1: 0.35, 4: 0.62, 8: 0.78, 16: 0.88, 32: 0.93}


def forward_ms(batch: int) -> float:
    return 8 + 1.5 * batch


def run_experiment(endpoint: str, start: int, seconds: float = 3.0, seed: int = 3) -> tuple[int, int, list[tuple]]:
    """Every batch size for ``seconds`` of event time; returns the range and the GPU samples (host, t, value)."""
    rng = random.Random(seed)
    provider = TracerProvider(resource=Resource.create({"service.name": "model-server", "host.name": "gpu-1",
                                                        "service.version": "2.0"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                   max_queue_size=100_000))
    tracer = provider.get_tracer("model-server")
    samples: list[tuple[str, int, float]] = []
    t = start
    for size in SIZES:
        end_of_run = t + int(seconds * NS)
        samples += [("gpu-1", s, UTILIZATION[size] + rng.uniform(-0.02, 0.02)) for s in range(t, end_of_run, NS // 2)]
        while t < end_of_run:  # batches back to back
            forward = int(forward_ms(size) * rng.lognormvariate(0, 0.08) * MS)
            for _ in range(size):
                arrived = t - rng.randrange(500_000)
                server = tracer.start_span("POST /infer", kind=SpanKind.SERVER, start_time=arrived)
                inner = tracer.start_span("forward", context=trace.set_span_in_context(server), start_time=t,
                                          attributes={"batch.size": size, "model.name": "resnet50"})
                inner.end(t + forward)
                server.end(t + forward + 200_000)
            t += forward + 100_000
        health = tracer.start_span("GET /healthz", kind=SpanKind.SERVER, start_time=t)  # no batch size
        health.end(t + MS)
        t += NS
    samples += [("gpu-2", s, 0.05) for s in range(start, t, NS)]  # a host that served none of these requests
    provider.shutdown()
    return start, t, samples


def send_gpu_samples(endpoint: str, samples: list[tuple[str, int, float]]) -> None:
    req = ExportMetricsServiceRequest()
    for host in sorted({h for h, _, _ in samples}):
        rm = req.resource_metrics.add()
        rm.resource.attributes.add(key="host.name").value.string_value = host
        metric = rm.scope_metrics.add().metrics.add(name="hw.gpu.utilization", unit="1")
        for _, t, value in (s for s in samples if s[0] == host):
            point = metric.gauge.data_points.add(time_unix_nano=t, as_double=value)
            point.attributes.add(key="hw.id").value.string_value = f"GPU-{host}"
    with grpc.insecure_channel(endpoint) as channel:
        metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(req, timeout=30)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("batching") / "spikehound.db"
    with CollectorThread(collector_config(f"sqlite:///{db}")) as collector:
        since, until, samples = run_experiment(collector.grpc_endpoint, time.time_ns() - 60 * NS)
        send_gpu_samples(collector.grpc_endpoint, samples)
        yield collector, since, until


def batching(collector: CollectorThread, since: int, until: int, **params: str) -> dict:
    return ApiClient(collector.api, timeout=60).get_json(
        "/api/v1/analyze/batching", service="model-server", since=unix(since), until=unix(until), **params)


@pytest.mark.parametrize(("target_ms", "sweet_spot"), [(30, "8"), (50, "16")])
def test_the_recommendation_is_the_known_sweet_spot(experiment, target_ms, sweet_spot):
    collector, since, until = experiment
    report = batching(collector, since, until, p99_target=str(target_ms))
    assert report["recommended"] == sweet_spot
    assert report["reference"] == "1"
    groups = {g["batch"]: g for g in report["groups"]}
    gain = groups[sweet_spot]["throughput_rps"] / groups["1"]["throughput_rps"]
    assert report["throughput_gain"] == pytest.approx(gain) and gain > 3
    assert report["message"].startswith(f"batch size {sweet_spot}: p99")
    assert report["message"].endswith(f"{gain:.1f}x the throughput of batch size 1")


def test_latency_grows_throughput_saturates_and_gpu_utilization_is_joined(experiment):
    collector, since, until = experiment
    report = batching(collector, since, until)
    assert [g["batch"] for g in report["groups"]] == ["1", "4", "8", "16", "32"]
    assert report["recommended"] is None and "p99 target" in report["message"]
    assert report["requests_without_attribute"] == 5
    p99 = [g["p99_ms"] for g in report["groups"]]
    rate = [g["throughput_rps"] for g in report["groups"]]
    assert p99 == sorted(p99) and p99[0] < 15 and p99[-1] > 55
    for size, g in zip(SIZES, report["groups"], strict=True):
        assert g["throughput_rps"] == pytest.approx(1000 * size / (forward_ms(size) + 0.1), rel=0.1)
        assert g["gpu_utilization"] == pytest.approx(UTILIZATION[size], abs=0.03)
        assert g["hosts"] == ["gpu-1"] and g["count"] >= 300 and g["enough_data"]
    assert rate[2] / rate[0] > 3 and rate[4] / rate[3] < 1.2  # the gain flattens out


def test_the_cli_prints_the_table_and_the_advice(experiment):
    collector, since, until = experiment
    out = spikehound("analyze", "batching", "--api", collector.api, "--service", "model-server",
                     "--p99-target", "30ms", "--since", unix(since), "--until", unix(until))
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if line.startswith("BATCH"))
    assert header.split()[:6] == ["BATCH", "REQUESTS", "P50", "MS", "P95", "MS"]
    assert "recommendation for a p99 target of 30 ms: batch size 8: p99" in out.stdout
    assert "5 requests had no batch.size attribute" in out.stdout


def test_the_batch_size_is_found_below_the_entry_span_of_the_same_service():
    def span(i: int, parent: int | None, service: str, attrs: dict) -> Span:
        return Span(trace_id=b"\x01" * 16, span_id=bytes([i]) * 8, parent_span_id=parent and bytes([parent]) * 8,
                    service=service, host="gpu-1", name=f"op{i}",
                    kind=ModelKind.SERVER if i in (1, 3) else ModelKind.INTERNAL,
                    start_unix_nano=i, end_unix_nano=100, status=StatusCode.UNSET, attributes=attrs)

    trace_spans = [span(1, None, "model", {}), span(2, 1, "model", {"batch.size": 8}),
                   span(3, 1, "other", {"batch.size": 2}), span(4, 3, "other", {})]
    found, missing = batch_requests([trace_spans], "model")
    assert [r.batch for r in found] == ["8"] and missing == 0
    found, missing = batch_requests([trace_spans], "other")
    assert [r.batch for r in found] == ["2"]
    report = analyze_batching([BatchRequest("big", 1, 0, 1, None)] * 200, {}, p99_target_ns=10)
    assert report.recommended is None and "no numeric batch size" in report.message
