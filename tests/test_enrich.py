"""Host enrichment of the requests local senders give the agent: resources gain the host's identity, the rest of
the request (spans, points, fields this protobuf version does not know) passes through byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from spikehound.agent.enrich import SENDER_HOST_KEY, Enricher
from spikehound.otlp import PayloadError

IDENTITY = {"host.name": "gpu-node-3", "host.id": "4f1c", "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}


def plain(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [plain(v) for v in value.array_value.values]
    return getattr(value, which)


def attributes(resource: Resource) -> dict[str, Any]:
    return {kv.key: plain(kv.value) for kv in resource.attributes}


def resource(**attrs: str) -> Resource:
    r = Resource()
    for key, value in attrs.items():
        r.attributes.add(key=key.replace("_", ".")).value.string_value = value
    return r


def traces(*resources: Resource | None, spans: int = 3) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for n, res in enumerate(resources):
        rs = request.resource_spans.add(schema_url=f"https://schema/{n}")
        if res is not None:
            rs.resource.CopyFrom(res)
        scope = rs.scope_spans.add()
        scope.scope.name = f"lib-{n}"
        for i in range(spans):
            sp = scope.spans.add(name=f"op-{n}-{i}", trace_id=bytes([n + 1]) * 16, span_id=bytes([i + 1]) * 8,
                                 start_time_unix_nano=1, end_time_unix_nano=2)
            sp.attributes.add(key="model.name").value.string_value = "llama"
    return request


def test_every_resource_gets_the_host_identity_and_a_differing_sender_host_is_kept_aside():
    request = traces(resource(service_name="api", host_name="container-7f"),
                     resource(service_name="model", host_name="gpu-node-3", host_id="set-by-sender"),
                     None)
    payload, count = Enricher(IDENTITY).traces(request.SerializeToString())
    assert count == 9
    out = ExportTraceServiceRequest.FromString(payload)
    first, second, third = (attributes(rs.resource) for rs in out.resource_spans)
    assert first == {"service.name": "api", "host.name": "gpu-node-3", SENDER_HOST_KEY: "container-7f",
                     "host.id": "4f1c", "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}
    assert second == {"service.name": "model", "host.name": "gpu-node-3", "host.id": "set-by-sender",
                      "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}  # the sender's own host.id is left alone
    assert third == {"host.name": "gpu-node-3", "host.id": "4f1c", "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}
    # Everything but the resources is untouched.
    for before, after in zip(request.resource_spans, out.resource_spans, strict=True):
        assert after.schema_url == before.schema_url
        assert [ss.SerializeToString() for ss in after.scope_spans] == [
            ss.SerializeToString() for ss in before.scope_spans]


def test_fields_unknown_to_this_protobuf_version_pass_through():
    request = traces(resource(service_name="api"))
    rs = request.resource_spans[0].SerializeToString()
    # Field 50 (varint 7), field 51 (fixed32), field 52 (fixed64), field 53 (bytes): from a newer OTLP, say.
    unknown = b"\x90\x03\x07" + b"\x9d\x03" + bytes(4) + b"\xa1\x03" + bytes(8) + b"\xaa\x03\x02hi"
    entry = rs + unknown
    payload = b"\x0a" + bytes([len(entry) & 0x7F | 0x80, len(entry) >> 7]) + entry
    assert len(entry) < 1 << 14
    out, count = Enricher(IDENTITY).traces(payload)
    assert count == 3
    assert out.endswith(unknown)
    assert attributes(ExportTraceServiceRequest.FromString(out).resource_spans[0].resource)["host.name"] == "gpu-node-3"


def test_a_resource_sent_in_two_parts_is_merged_as_protobuf_does():
    rs = traces(resource(service_name="api")).resource_spans[0].SerializeToString()
    second = resource(host_name="container-1").SerializeToString()
    entry = rs + b"\x0a" + bytes([len(second)]) + second  # a second resource field: merged into the first
    payload = b"\x0a" + bytes([len(entry) & 0x7F | 0x80, len(entry) >> 7]) + entry
    expected = ExportTraceServiceRequest.FromString(payload).resource_spans[0].resource
    out = ExportTraceServiceRequest.FromString(Enricher(IDENTITY).traces(payload)[0])
    assert attributes(expected) == {"service.name": "api", "host.name": "container-1"}
    assert attributes(out.resource_spans[0].resource) == {"service.name": "api", "host.name": "gpu-node-3",
                                                          SENDER_HOST_KEY: "container-1", "host.id": "4f1c",
                                                          "nvidia.gpu.uuids": ["GPU-1", "GPU-2"]}


def test_requests_with_groups_are_enriched_by_re_encoding():
    rs = traces(resource(service_name="api")).resource_spans[0].SerializeToString()
    entry = rs + b"\xa3\x03\x08\x01\xa4\x03"  # an unknown group (field 52) holding a varint field
    payload = b"\x0a" + bytes([len(entry) & 0x7F | 0x80, len(entry) >> 7]) + entry
    out, count = Enricher(IDENTITY).traces(payload)
    assert count == 3
    assert attributes(ExportTraceServiceRequest.FromString(out).resource_spans[0].resource)["host.name"] == "gpu-node-3"


def test_the_same_resource_again_is_enriched_alike_and_others_are_not_confused():
    enricher = Enricher(IDENTITY)
    api, model = traces(resource(service_name="api")), traces(resource(service_name="model"))
    outs = [ExportTraceServiceRequest.FromString(enricher.traces(r.SerializeToString())[0]) for r in (api, model, api)]
    names = [attributes(o.resource_spans[0].resource)["service.name"] for o in outs]
    assert names == ["api", "model", "api"]
    assert outs[0] == outs[2]


def test_metrics_requests_are_enriched_and_their_points_counted():
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.CopyFrom(resource(service_name="model"))
    metric = rm.scope_metrics.add().metrics.add(name="vllm.queue.size")
    for value in (1.0, 2.0):
        metric.gauge.data_points.add(as_double=value, time_unix_nano=5)
    payload, count = Enricher(IDENTITY).metrics(request.SerializeToString())
    out = ExportMetricsServiceRequest.FromString(payload)
    assert count == 2
    assert attributes(out.resource_metrics[0].resource)["host.name"] == "gpu-node-3"
    assert out.resource_metrics[0].scope_metrics == request.resource_metrics[0].scope_metrics


@pytest.mark.parametrize("payload", [b"\x0a\xff\xff\xff\xff\x0f\x01\x02", b"\x0a\x03\x0a\x05ab"])
def test_malformed_requests_are_refused(payload):
    with pytest.raises(PayloadError, match="invalid OTLP protobuf"):
        Enricher(IDENTITY).traces(payload)
