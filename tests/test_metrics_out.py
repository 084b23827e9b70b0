"""The agent's samples -> OTLP metrics encoding, checked against what the OpenTelemetry SDK's MeterProvider makes.

The agent encodes its samples directly (the SDK's collect and encode cost ten times more CPU, see
spikehound/agent/metrics_out.py); these tests hold it to the SDK's output for the same readings, field by field, using
real host samples from this machine and the real SDK with its own OTLP encoder.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from spikehound.agent.metrics_out import SCOPE, MetricsBridge
from spikehound.agent.sample import Kind, Sample
from spikehound.agent.samplers.cpu import CpuSampler
from spikehound.agent.samplers.network import NetworkSampler

IDENTITY = {"service.name": "spikehound-agent", "host.name": "gpu-node-3", "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}
# The resource attribute the SDK draws at random per Resource.create: present in both, never equal.
RANDOM_KEYS = {"service.instance.id"}


def host_samples() -> list[Sample]:
    """Two ticks of the real CPU and network samplers (the second has rates and utilizations), plus GPU-like ones."""
    cpu, network = CpuSampler(), NetworkSampler(interfaces=["lo"])
    cpu.start(), network.start()
    cpu.sample(), network.sample()
    time.sleep(0.2)
    samples = cpu.sample() + network.sample()
    gpu = {"hw.id": "GPU-1", "gpu.index": 0, "hw.name": "NVIDIA H100"}
    samples += [Sample("hw.power", 412.5, "W", gpu), Sample("nvidia.gpu.xid.errors", 2, "{error}", gpu, Kind.COUNTER),
                Sample("hw.gpu.memory.usage", 1 << 33, "By", {**gpu, "process.pid": 4242})]
    return samples


def sdk_request(samples: list[Sample]) -> ExportMetricsServiceRequest:
    """What the SDK's MeterProvider makes of the samples: one observable instrument per name, as the agent had."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource.create(IDENTITY), metric_readers=[reader],
                             exemplar_filter=AlwaysOffExemplarFilter())
    meter = provider.get_meter(SCOPE)
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    for name, group in by_name.items():
        def observe(_options: CallbackOptions, group: list[Sample] = group) -> Iterable[Observation]:
            return [Observation(s.value, s.attributes) for s in group]

        create = meter.create_observable_counter if group[0].kind is Kind.COUNTER else meter.create_observable_gauge
        create(name, callbacks=[observe], unit=group[0].unit)
    request = encode_metrics(reader.get_metrics_data())
    provider.shutdown()
    return request


def plain(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return tuple(plain(v) for v in value.array_value.values)
    return getattr(value, which)


def normalised(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    """Everything a consumer reads, with times reduced to whether they are set."""
    (rm,) = request.resource_metrics
    (sm,) = rm.scope_metrics
    metrics = {}
    for m in sm.metrics:
        kind = m.WhichOneof("data")
        data = getattr(m, kind)
        points = {}
        for p in data.data_points:
            attributes = tuple(sorted((kv.key, plain(kv.value)) for kv in p.attributes))
            points[attributes] = (p.WhichOneof("value"), getattr(p, p.WhichOneof("value")), p.time_unix_nano > 0,
                                  p.start_time_unix_nano > 0, len(p.exemplars), p.flags)
        temporality = (data.aggregation_temporality, data.is_monotonic) if kind == "sum" else None
        metrics[m.name] = (m.unit, m.description, kind, temporality, points)
    return {"resource": {kv.key: plain(kv.value) for kv in rm.resource.attributes if kv.key not in RANDOM_KEYS},
            "resource_keys": sorted(kv.key for kv in rm.resource.attributes),
            "scope": (sm.scope.name, sm.scope.version),
            "schema_urls": (rm.schema_url, sm.schema_url), "metrics": metrics}


def test_requests_match_the_sdk_meter_provider_for_real_host_samples():
    samples = host_samples()
    assert {s.kind for s in samples} == {Kind.GAUGE, Kind.COUNTER}
    sent: list[tuple[bytes, int]] = []
    MetricsBridge(IDENTITY, lambda payload, points: sent.append((payload, points)) or True).export(samples)
    ((payload, points),) = sent
    ours, sdk = normalised(ExportMetricsServiceRequest.FromString(payload)), normalised(sdk_request(samples))
    assert ours["metrics"].keys() == sdk["metrics"].keys()
    for name in sdk["metrics"]:
        assert ours["metrics"][name] == sdk["metrics"][name], name
    assert ours == sdk
    assert points == len(samples)
    assert ours["metrics"]["system.network.io"][3] == (2, True)  # cumulative, monotonic
    assert ours["metrics"]["nvidia.gpu.xid.errors"][4][(("gpu.index", 0), ("hw.id", "GPU-1"),
                                                        ("hw.name", "NVIDIA H100"))][:2] == ("as_int", 2)


def test_cumulative_points_keep_the_start_of_their_series_and_gauges_have_none():
    bridge = MetricsBridge(IDENTITY, lambda payload, points: True)
    tick = [Sample("system.network.io", 100.0, "By", {"network.io.direction": "receive"}, Kind.COUNTER),
            Sample("system.memory.utilization", 0.5, "1", {"system.memory.state": "used"})]
    first = bridge.encode(tick, now_ns=1_000)
    later = bridge.encode(tick, now_ns=2_000)
    counter = [r.resource_metrics[0].scope_metrics[0].metrics[0].sum.data_points[0] for r in (first, later)]
    assert [(p.start_time_unix_nano, p.time_unix_nano) for p in counter] == [(1_000, 1_000), (1_000, 2_000)]
    gauge = later.resource_metrics[0].scope_metrics[0].metrics[1].gauge.data_points[0]
    assert (gauge.start_time_unix_nano, gauge.time_unix_nano) == (0, 2_000)


def test_a_missing_reading_sends_nothing_stale_and_a_full_queue_is_counted():
    sent: list[ExportMetricsServiceRequest] = []
    accept = True

    def sink(payload: bytes, points: int) -> bool:
        if accept:
            sent.append(ExportMetricsServiceRequest.FromString(payload))
        return accept

    bridge = MetricsBridge(IDENTITY, sink)
    bridge.export([Sample("hw.power", 300.0, "W", {"hw.id": "GPU-1"}),
                   Sample("hw.power", 310.0, "W", {"hw.id": "GPU-2"})])
    bridge.export([Sample("hw.power", 305.0, "W", {"hw.id": "GPU-1"})])  # GPU-2's sampler timed out
    bridge.export([])
    assert len(sent) == 2
    assert [len(r.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points) for r in sent] == [2, 1]
    accept = False
    bridge.export([Sample("hw.power", 305.0, "W", {"hw.id": "GPU-1"})])
    assert bridge.refused_points == 1
