"""The service the Locust example load-tests: gateway -> preprocess -> model server, traced in one process.

Each service has its own OpenTelemetry tracer provider, ``host.name`` and
``service.version``, and exports over OTLP/gRPC, as a deployment would; the
work is real but small (a SQLite feature lookup, a little CPU, short sleeps
for the model's queue and forward pass). ``inference_service.py`` puts it
behind HTTP.
"""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SERVICES = {  # service -> host it runs on
    "gateway": "demo-edge-1",
    "preprocess": "demo-cpu-1",
    "model-server": "demo-gpu-1",
}


class InferenceStack:
    """gateway -> preprocess (+ feature lookup) -> model-server -> postprocess, traced with the OTel SDK."""

    def __init__(self, otlp_endpoint: str, feature_db: Path, seed: int = 7, version: str = "demo-1") -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.providers: list[TracerProvider] = []
        self.tracers = {}
        for service, host in SERVICES.items():
            provider = TracerProvider(resource=Resource.create(
                {"service.name": service, "host.name": host, "service.version": version}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True),
                                                           schedule_delay_millis=500))
            self.providers.append(provider)
            self.tracers[service] = provider.get_tracer("spikehound.demo")
        self.feature_db = feature_db
        self._local = threading.local()
        self._random = random.Random(seed)
        with sqlite3.connect(feature_db) as db:
            db.execute("CREATE TABLE IF NOT EXISTS features (user_id INTEGER PRIMARY KEY, vector TEXT)")
            db.executemany("INSERT OR REPLACE INTO features VALUES (?, ?)",
                           [(i, json.dumps([i % 7, i % 11, i % 13])) for i in range(2000)])

    def _db(self) -> sqlite3.Connection:
        if not hasattr(self._local, "db"):
            self._local.db = sqlite3.connect(self.feature_db)
        return self._local.db

    @contextlib.contextmanager
    def _hop(self, caller: str, callee: str, route: str) -> Iterator[None]:
        """A CLIENT span on the caller and the SERVER span of the callee under it."""
        from opentelemetry.trace import SpanKind

        with self.tracers[caller].start_as_current_span(f"POST {route}", kind=SpanKind.CLIENT,
                                                        attributes={"peer.service": callee}):
            time.sleep(0.0005)  # loopback network
            with self.tracers[callee].start_as_current_span(f"POST {route}", kind=SpanKind.SERVER):
                yield

    def request(self, user_id: int) -> None:
        from opentelemetry.trace import SpanKind

        gateway, pre, model = (self.tracers[s] for s in SERVICES)
        with gateway.start_as_current_span("POST /v1/predict", kind=SpanKind.SERVER,
                                           attributes={"http.request.method": "POST", "model.name": "resnet50"}):
            with self._hop("gateway", "preprocess", "/preprocess"):
                with pre.start_as_current_span("feature_lookup", kind=SpanKind.CLIENT,
                                               attributes={"db.system": "sqlite", "db.operation.name": "SELECT"}):
                    self._db().execute("SELECT vector FROM features WHERE user_id = ?", (user_id,)).fetchone()
                with pre.start_as_current_span("resize"):
                    sum(i * i for i in range(3000))  # a little real CPU work
            batch = self._random.choice([1, 4, 8])
            with self._hop("gateway", "model-server", "/infer"):
                with model.start_as_current_span("queue_wait", attributes={"batch.size": batch}):
                    time.sleep(self._random.expovariate(1 / 0.002))
                with model.start_as_current_span("forward", attributes={"batch.size": batch}):
                    time.sleep(0.004 + 0.0005 * batch)
            with gateway.start_as_current_span("postprocess"):
                time.sleep(0.001)

    def shutdown(self) -> None:
        for provider in self.providers:
            provider.shutdown()
