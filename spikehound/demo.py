"""``spikehound demo``: a collector on a temporary SQLite database and a small instrumented inference stack.

The stack is real OpenTelemetry SDK code: a gateway calls a preprocessing
service (which looks features up in a real SQLite database) and a model
server (queue wait, forward pass), then postprocesses; each service has its
own tracer provider, service name and host, and exports over OTLP/gRPC to a
collector started as a child process, exactly as a deployment would. At the
end the demo reads per-operation p50/p95/p99 back from the REST API.

It imports nothing of the collector: it talks to it over OTLP and HTTP only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SERVICES = {  # service -> host it runs on
    "gateway": "demo-edge-1",
    "preprocess": "demo-cpu-1",
    "model-server": "demo-gpu-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(api: str, path: str, **params: Any) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{api}{path}{'?' + query if query else ''}", timeout=10) as response:
        return json.load(response)


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


def _start_collector(workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    api_port, grpc_port, http_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS": "1",
           "SPIKEHOUND_COLLECTOR_WINDOW_SECONDS": "5", "SPIKEHOUND_DATA_DIR": str(workdir)}
    log = open(workdir / "collector.log", "wb")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen([sys.executable, "-m", "spikehound.cli", "collector",
                             "--db", f"sqlite:///{workdir / 'spikehound.db'}",
                             "--api", f"127.0.0.1:{api_port}", "--otlp-grpc", f"127.0.0.1:{grpc_port}",
                             "--otlp-http", f"127.0.0.1:{http_port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    api = f"http://127.0.0.1:{api_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode}; see {workdir / 'collector.log'}")
        with contextlib.suppress(OSError):
            if _get(api, "/readyz")["status"] == "ready":
                return proc, api, f"127.0.0.1:{grpc_port}"
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("collector was not ready within 60 s")


def run_demo(requests: int = 600, keep: bool = False, rate: float = 40.0, concurrency: int = 8) -> int:
    """Run the demo; return the exit status (non-zero when the collector lost or mangled data)."""
    workdir = Path(tempfile.mkdtemp(prefix="spikehound-demo-"))
    print(f"spikehound demo: working in {workdir}")
    proc, api, grpc_endpoint = _start_collector(workdir)
    print(f"  collector ready: API {api}, OTLP/gRPC {grpc_endpoint}, SQLite {workdir / 'spikehound.db'}")
    try:
        stack = InferenceStack(grpc_endpoint, workdir / "features.db")
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for i in range(requests):  # steady open-loop load: one request every 1/rate seconds
                time.sleep(max(0.0, started + i / rate - time.monotonic()))
                futures.append(pool.submit(stack.request, i))
                if (i + 1) % 100 == 0 or i + 1 == requests:
                    print(f"  sent {i + 1}/{requests} requests ({(i + 1) / (time.monotonic() - started):.0f}/s)")
            for future in futures:
                future.result()
        stack.shutdown()
        print("  waiting for the last event-time windows to close ...")
        status = _report(api, requests)
        if keep:
            print(f"collector keeps running at {api} (Ctrl-C to stop)")
            with contextlib.suppress(KeyboardInterrupt):
                proc.wait()
        return status
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _report(api: str, requests: int) -> int:
    deadline = time.monotonic() + 30
    rows: list[tuple[str, str, int, float, float, float]] = []
    while time.monotonic() < deadline:
        rows = []
        for entry in _get(api, "/api/v1/services")["services"]:
            for point in _get(api, "/api/v1/latency", service=entry["service"], since="0")["points"]:
                rows.append((entry["service"], point["operation"], point["count"], point["p50_ms"],
                             point["p95_ms"], point["p99_ms"]))
        if sum(r[2] for r in rows if r[1] == "POST /v1/predict") >= requests:
            break
        time.sleep(0.5)
    merged: dict[tuple[str, str], list[tuple[int, float, float, float]]] = {}
    for service, operation, count, p50, p95, p99 in rows:
        merged.setdefault((service, operation), []).append((count, p50, p95, p99))
    print()
    print(f"{'SERVICE':<14}{'OPERATION':<20}{'REQUESTS':>9}{'WINDOWS':>9}{'p50 ms':>9}{'p95 ms':>9}{'worst p99':>11}")
    for (service, operation), windows in sorted(merged.items()):
        total = sum(w[0] for w in windows)
        p50 = sorted(w[1] for w in windows)[len(windows) // 2]
        p95 = sorted(w[2] for w in windows)[len(windows) // 2]
        print(f"{service:<14}{operation:<20}{total:>9}{len(windows):>9}{p50:>9.2f}{p95:>9.2f}"
              f"{max(w[3] for w in windows):>11.2f}")
    counted = sum(w[0] for w in merged.get(("gateway", "POST /v1/predict"), []))
    print(f"\n(p50/p95 columns: median over the windows; every number read back from {api}/api/v1/latency)")
    if counted != requests:
        print(f"FAIL: the collector counted {counted} gateway requests, the stack sent {requests}")
        return 1
    print(f"OK: all {requests} requests are in the collector's latency windows")
    return 0
