"""Adds what the host knows about itself to every request's resource, and counts the items.

The agent is the host: ``host.name`` is set to the agent's host name (a
different value sent by the application, e.g. a container's hostname, is kept
as ``spikehound.sender.host.name``), ``host.id`` to the machine id, and
``nvidia.gpu.uuids`` lists the GPUs the host has, so the collector can join
spans with the host's GPU samples. Spans and points are otherwise untouched.

>>> from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
>>> req = ExportTraceServiceRequest()
>>> _ = req.resource_spans.add().scope_spans.add().spans.add(name="infer")
>>> payload, count = Enricher({"host.name": "gpu-1"}).traces(req.SerializeToString())
>>> count, ExportTraceServiceRequest.FromString(payload).resource_spans[0].resource.attributes[0].key
(1, 'host.name')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from spikehound.otlp import PayloadError, count_items, set_any_value

SENDER_HOST_KEY = "spikehound.sender.host.name"


def machine_id() -> str | None:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return None


class Enricher:
    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = {k: v for k, v in identity.items() if v not in (None, "", [])}

    def _enrich(self, resource: Resource) -> None:
        present = {kv.key: i for i, kv in enumerate(resource.attributes)}
        sent_host = present.get("host.name")
        if sent_host is not None:
            value = resource.attributes[sent_host].value.string_value
            if value and value != self.identity.get("host.name"):
                set_any_value(resource.attributes.add(key=SENDER_HOST_KEY).value, value)
        for key, value in self.identity.items():
            index = present.get(key)
            if index is None:
                set_any_value(resource.attributes.add(key=key).value, value)
            elif key == "host.name":
                resource.attributes[index].value.Clear()
                set_any_value(resource.attributes[index].value, value)

    def traces(self, payload: bytes) -> tuple[bytes, int]:
        """Enriched serialized request and its span count; PayloadError when unreadable."""
        request = ExportTraceServiceRequest()
        _parse(request, payload)
        for rs in request.resource_spans:
            self._enrich(rs.resource)
        return request.SerializeToString(), count_items(request)

    def metrics(self, payload: bytes) -> tuple[bytes, int]:
        request = ExportMetricsServiceRequest()
        _parse(request, payload)
        for rm in request.resource_metrics:
            self._enrich(rm.resource)
        return request.SerializeToString(), count_items(request)


def _parse(request: Any, payload: bytes) -> None:
    try:
        request.ParseFromString(payload)
    except Exception as exc:  # protobuf raises DecodeError or RuntimeError depending on the backend
        raise PayloadError(f"invalid OTLP protobuf: {exc or 'cannot be decoded'}") from None
