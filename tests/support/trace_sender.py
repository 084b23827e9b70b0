"""An SDK application sending traces through an agent, and the check that each trace is whole in one share."""

from __future__ import annotations

import threading
import time
from collections import Counter

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tests.support.sdk_traffic import Recording


class TraceSender:
    """An SDK application sending traces of five spans through the agent; a trace's spans leave in several
    export requests (children end 30 ms apart, the processor exports every 50 ms)."""

    def __init__(self, endpoint: str) -> None:
        self.recording = Recording(GrpcSpanExporter(endpoint=endpoint, insecure=True, timeout=10))
        self.provider = TracerProvider(resource=Resource.create({"service.name": "router-test"}))
        self.provider.add_span_processor(BatchSpanProcessor(self.recording, schedule_delay_millis=50))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trace-sender", daemon=True)

    def _run(self) -> None:
        tracer = self.provider.get_tracer("router-test")
        while not self._stop.is_set():
            with tracer.start_as_current_span("POST /v1/generate", kind=trace.SpanKind.SERVER):
                for step in ("tokenize", "prefill", "decode", "detokenize"):
                    with tracer.start_as_current_span(step):
                        time.sleep(0.03)

    def send(self, traces: int) -> None:
        """``traces`` traces at once, exported before this returns."""
        tracer = self.provider.get_tracer("router-test")
        for _ in range(traces):
            with tracer.start_as_current_span("POST /v1/generate", kind=trace.SpanKind.SERVER):
                for step in ("prefill", "decode"):
                    with tracer.start_as_current_span(step):
                        pass
        self.provider.force_flush()

    def start(self) -> TraceSender:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.provider.shutdown()

    def sent(self) -> set[tuple[str, str]]:
        assert not self.recording.failed
        return self.recording.acked


def whole_traces(stored: dict[str, set[tuple[str, str]]]) -> dict[str, str]:
    """trace id -> the one collector holding it; fails when a span is stored twice or a trace split."""
    where: dict[str, str] = {}
    seen: Counter[tuple[str, str]] = Counter()
    for name, spans in stored.items():
        seen.update(spans)
        for trace_id, _ in spans:
            assert where.setdefault(trace_id, name) == name, f"trace {trace_id} split: {where[trace_id]} and {name}"
    assert not [span for span, n in seen.items() if n > 1], "spans stored by two collectors"
    return where
