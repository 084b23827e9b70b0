"""A small inference stack for the regression-gate tests: real OpenTelemetry SDK services, modelled latency.

gateway (``POST /v1/predict``) -> preprocess (``POST /preprocess``, image decode
and resize in a ``preprocess`` span) -> model-server (``POST /infer``, a
``forward`` span) -> ``postprocess`` on the gateway. Each service has its own
tracer provider, host and ``service.version`` and exports over OTLP/gRPC to the
collector, as a deployment would; the spans are nested through the SDK's
context like any instrumented code.

Latency is not slept: it is drawn from a model seeded per run and given to the
SDK as span start and end times. On this project's shared 2-core machines,
``time.sleep`` timing showed a p99 scheduling noise of 20 to 40 ms that came
and went with the other work on the machine, which buries a 15 ms effect at
p99 one run and not the next. The model keeps realistic noise instead, known
and repeatable: log-normal stages, and rare stalls with a heavy (Pareto) tail
on any stage, as GC pauses and CPU contention give.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Tracer

HOSTS = {"gateway": "edge-1", "preprocess": "cpu-1", "model-server": "gpu-1"}
MS = 1_000_000


@dataclass(frozen=True)
class Latency:
    """Milliseconds of each stage; ``slow_*``: a share of requests whose preprocessing takes longer."""

    preprocess_ms: float = 2.0
    forward_ms: float = 5.0
    postprocess_ms: float = 0.5
    network_ms: float = 0.3
    spread: float = 0.25  # log-normal sigma of every stage
    stall_fraction: float = 0.015  # requests with a stall on one stage
    stall_ms: float = 2.0  # scale of a stall: stall_ms * Pareto(1.5), at most 50x
    slow_fraction: float = 0.0
    slow_extra_ms: float = 0.0

    def slower_preprocessing(self, fraction: float, extra_ms: float) -> Latency:
        return replace(self, slow_fraction=fraction, slow_extra_ms=extra_ms)


class VersionedStack:
    """The three services of one version, sending to ``endpoint``."""

    def __init__(self, endpoint: str, version: str, seed: int, latency: Latency = Latency()) -> None:
        self.version, self.latency = version, latency
        self.rng = random.Random(seed)
        self.providers: list[TracerProvider] = []
        self.tracers: dict[str, Tracer] = {}
        for service, host in HOSTS.items():
            provider = TracerProvider(resource=Resource.create(
                {"service.name": service, "host.name": host, "service.version": version}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                           max_queue_size=200_000, schedule_delay_millis=200))
            self.providers.append(provider)
            self.tracers[service] = provider.get_tracer("spikehound.tests")

    def _ns(self, ms: float) -> int:
        return int(ms * self.rng.lognormvariate(0.0, self.latency.spread) * MS)

    def _span(self, service: str, name: str, parent: Span | None, start: int, kind: SpanKind = SpanKind.INTERNAL,
              **attributes: object) -> Span:
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracers[service].start_span(name, context=context, kind=kind, start_time=start,
                                                attributes=attributes or None)

    def _call(self, caller: str, callee: str, route: str, parent: Span, start: int, work: str, work_ns: int) -> int:
        """CLIENT span on the caller, SERVER span on the callee, the callee's work span; returns the end."""
        net = self._ns(self.latency.network_ms)
        client = self._span(caller, f"POST {route}", parent, start, SpanKind.CLIENT, **{"peer.service": callee})
        server = self._span(callee, f"POST {route}", client, start + net // 2, SpanKind.SERVER)
        inner = self._span(callee, work, server, start + net // 2 + 20_000)
        inner.end(start + net // 2 + 20_000 + work_ns)
        server.end(start + net // 2 + 40_000 + work_ns)
        end = start + net + 40_000 + work_ns
        client.end(end)
        return end

    def request(self, start: int) -> int:
        """One request starting at ``start`` (unix ns); returns its end."""
        lat, rng = self.latency, self.rng
        pre, fwd, post = self._ns(lat.preprocess_ms), self._ns(lat.forward_ms), self._ns(lat.postprocess_ms)
        if rng.random() < lat.slow_fraction:
            pre += int(lat.slow_extra_ms * MS)
        if rng.random() < lat.stall_fraction:
            stall = int(lat.stall_ms * min(rng.paretovariate(1.5), 50.0) * MS)
            which = rng.randrange(3)
            pre, fwd, post = pre + stall * (which == 0), fwd + stall * (which == 1), post + stall * (which == 2)
        root = self._span("gateway", "POST /v1/predict", None, start, SpanKind.SERVER)
        t = self._call("gateway", "preprocess", "/preprocess", root, start + 100_000, "preprocess", pre)
        t = self._call("gateway", "model-server", "/infer", root, t + 50_000, "forward", fwd)
        self._span("gateway", "postprocess", root, t + 50_000).end(t + 50_000 + post)
        root.end(t + 100_000 + post)
        return t + 100_000 + post

    def shutdown(self) -> None:
        """Flush: the collector acknowledges only what it committed, so the spans are stored after this."""
        for provider in self.providers:
            provider.shutdown()


def drive(stacks: list[VersionedStack], requests: int, *, spacing_ms: float = 2.0, start_ns: int | None = None
          ) -> tuple[int, int]:
    """``requests`` requests to each stack, interleaved, one every ``spacing_ms`` of event time, from
    ``start_ns`` (default: so that they end about a second ago); returns the event-time range (ns) that
    holds them all."""
    first = start_ns if start_ns is not None else time.time_ns() - int((requests * spacing_ms + 1000) * MS)
    last = first
    for i in range(requests):
        for stack in stacks:
            last = max(last, stack.request(first + int(i * spacing_ms * MS)))
    for stack in stacks:
        stack.shutdown()
    return first, last + 1
