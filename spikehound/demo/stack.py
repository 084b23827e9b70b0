"""The demo's inference stack: three services, each its own process, traced with the OpenTelemetry SDK.

::

    python -m spikehound.demo.stack gateway --port P --preprocess URL --model-server URL
    python -m spikehound.demo.stack preprocess --port P --features PATH [--burn-ms MS]
    python -m spikehound.demo.stack model-server --port P [--slowdown X]

A request to the gateway (``POST /v1/predict``) calls preprocess
(``POST /preprocess``: the user's features from the feature store, a real
SQLite database, then a CPU-bound ``resize``), then the model server
(``POST /infer``: wait for the GPU, then the ``forward`` pass on it), then
postprocesses. Trace context crosses the processes in W3C ``traceparent``
headers; every call is a CLIENT span on the caller and a SERVER span on the
callee, as the OpenTelemetry HTTP instrumentations make them. The SDK is
configured from the standard ``OTEL_*`` variables (see
:mod:`spikehound.demo.telemetry`), pointing at the agent.

Each service answers ``GET /healthz`` and switches its own fault with
``POST /fault`` ``{"on": true|false}``: preprocess burns ``--burn-ms`` more CPU
per request; the model server's (simulated) GPU is clock-throttled.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from spikehound.demo import feature_store, gpu_sim, telemetry

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class Service:
    """What every service shares: a tracer, outbound calls with context propagation, its fault switch."""

    def __init__(self, name: str) -> None:
        from opentelemetry import trace

        self.name = name
        self.tracer_provider = telemetry.tracer_provider()
        self.tracer = self.tracer_provider.get_tracer("spikehound.demo")
        self.trace = trace
        self.fault = False
        self.on_fault: Callable[[bool], None] = lambda on: None
        self.routes: dict[str, Handler] = {}
        self.closers: list[Callable[[], Any]] = [self.tracer_provider.shutdown]
        self._connections = threading.local()

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def call(self, base_url: str, path: str, body: dict[str, Any], peer: str) -> dict[str, Any]:
        """POST JSON to another service under a CLIENT span, carrying the trace context."""
        from opentelemetry.propagate import inject

        url = urllib.parse.urlsplit(base_url)
        with self.tracer.start_as_current_span(f"POST {path}", kind=self.trace.SpanKind.CLIENT, attributes={
                "http.request.method": "POST", "server.address": url.hostname or "", "server.port": url.port or 80,
                "url.full": base_url + path, "peer.service": peer}) as span:
            headers = {"Content-Type": "application/json"}
            inject(headers)
            status, payload = self._post(url.hostname or "127.0.0.1", url.port or 80, path, json.dumps(body), headers)
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, f"HTTP {status}"))
                raise RuntimeError(f"{peer} answered {status}")
            return json.loads(payload)

    def _post(self, host: str, port: int, path: str, body: str, headers: dict[str, str]) -> tuple[int, bytes]:
        # One keep-alive connection per (thread, upstream); a connection the other side closed is reopened once.
        pool: dict[tuple[str, int], http.client.HTTPConnection] = self._connections.__dict__.setdefault("pool", {})
        for attempt in (1, 2):
            conn = pool.get((host, port))
            if conn is None:
                conn = pool[(host, port)] = http.client.HTTPConnection(host, port, timeout=30)
            try:
                conn.request("POST", path, body=body, headers=headers)
                response = conn.getresponse()
                return response.status, response.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                del pool[(host, port)]
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def serve(self, port: int) -> None:
        """Serve until SIGTERM or until the demo that started us is gone; then flush the spans."""
        service = self

        class RequestHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._reply(200, {"status": "ok", "service": service.name, "fault": service.fault})
                else:
                    self._reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                from opentelemetry.propagate import extract

                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._reply(400, {"error": "body is not JSON"})
                    return
                if self.path == "/fault":
                    service.fault = bool(body.get("on"))
                    service.on_fault(service.fault)
                    self._reply(200, {"service": service.name, "fault": service.fault})
                    return
                handler = service.routes.get(self.path)
                if handler is None:
                    self._reply(404, {"error": "not found"})
                    return
                with service.tracer.start_as_current_span(
                        f"POST {self.path}", context=extract(self.headers), kind=service.trace.SpanKind.SERVER,
                        attributes={"http.request.method": "POST", "url.path": self.path}) as span:
                    try:
                        result, status = handler(body), 200
                    except Exception as exc:  # an upstream failed: answer 502, never die
                        span.set_status(service.trace.Status(service.trace.StatusCode.ERROR, str(exc)))
                        result, status = {"error": str(exc)}, 502
                    span.set_attribute("http.response.status_code", status)
                self._reply(status, result)

        server = ThreadingHTTPServer(("127.0.0.1", port), RequestHandler, bind_and_activate=False)
        server.daemon_threads = True
        # socketserver's default listen backlog of 5 drops SYNs in a burst: 1 s retransmits, not the demo's faults.
        server.request_queue_size = 256
        server.server_bind()
        server.server_activate()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        parent = os.getppid()
        while not stop.wait(0.5):
            if os.getppid() != parent:  # the demo was killed: do not outlive it
                break
        server.shutdown()
        for close in self.closers:  # flushes the spans and metrics still batched
            close()


def burn_cpu(ms: float) -> int:
    """Real CPU work (a nearest-neighbour image resize in pure Python) until this thread used ``ms`` of CPU."""
    deadline = time.thread_time_ns() + int(ms * 1e6)
    image = [[(x * 7 + y * 13) % 256 for x in range(64)] for y in range(64)]
    rounds = 0
    while time.thread_time_ns() < deadline:
        resized = [[image[y * 64 // 96][x * 64 // 96] for x in range(96)] for y in range(96)]
        image = [[(v + 1) % 256 for v in row[:64]] for row in resized[:64]]
        rounds += 1
    return rounds


def gateway(args: argparse.Namespace) -> Service:
    svc = Service("gateway")

    def predict(body: dict[str, Any]) -> dict[str, Any]:
        features = svc.call(args.preprocess, "/preprocess", body, peer="preprocess")
        scores = svc.call(args.model_server, "/infer", features, peer="model-server")
        with svc.span("postprocess"):
            top = sorted(enumerate(scores["logits"]), key=lambda kv: -kv[1])[:5]
            burn_cpu(0.3)
        return {"user": body.get("user"), "top5": [i for i, _ in top]}

    svc.routes["/v1/predict"] = predict
    return svc


def preprocess(args: argparse.Namespace) -> Service:
    svc = Service("preprocess")
    store = feature_store.FeatureStore(Path(args.features))

    def handle(body: dict[str, Any]) -> dict[str, Any]:
        entity = str(body.get("user", ""))
        with svc.tracer.start_as_current_span(feature_store.SPAN_NAME, kind=svc.trace.SpanKind.CLIENT, attributes={
                "db.system": "sqlite", "db.operation.name": "SELECT", "db.collection.name": "features",
                "db.query.text": feature_store.QUERY}):
            embedding = store.lookup(entity)
        with svc.span("resize", **{"image.size": "224x224"}):
            burn_cpu(args.resize_ms + (args.burn_ms if svc.fault else 0.0))
        return {"user": entity, "batch": random.choice((1, 4, 8)), "features": list(embedding[:16])}

    svc.routes["/preprocess"] = handle
    return svc


def model_server(args: argparse.Namespace) -> Service:
    svc = Service("model-server")
    gpu = gpu_sim.SimulatedGpu(kernel_ms=args.kernel_ms, slowdown=args.slowdown)
    meters = telemetry.meter_provider()
    gpu_sim.report_metrics(gpu, meters)
    svc.closers.append(meters.shutdown)
    svc.on_fault = lambda on: setattr(gpu, "throttled", on)

    def infer(body: dict[str, Any]) -> dict[str, Any]:
        batch = int(body.get("batch") or 1)
        with svc.span("queue_wait", **{"batch.size": batch}):
            gpu.acquire()
        try:
            with svc.span("forward", **{"batch.size": batch, "hw.id": gpu_sim.DEVICE["hw.id"]}):
                gpu.execute(batch)
        finally:
            gpu.release()
        return {"logits": [((i * 31 + len(body.get("features", ()))) % 17) / 17 for i in range(10)]}

    svc.routes["/infer"] = infer
    return svc


def allow_tracer(pid: str | None) -> None:
    """Let process ``pid`` (the demo's agent) read this one's memory, for its sampling profiler.

    Under Yama's ``kernel.yama.ptrace_scope = 1`` a process may read only its descendants unless the target
    names it with ``PR_SET_PTRACER``; the agent is these services' sibling. Elsewhere (no Yama, root, an agent
    with CAP_SYS_PTRACE) the call is not needed, and its refusal is ignored.
    """
    if not pid or not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_ptracer = 0x59616D61
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, int(pid), 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikehound.demo.stack", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="service", required=True)
    p = sub.add_parser("gateway")
    p.add_argument("--preprocess", required=True, help="preprocess base URL")
    p.add_argument("--model-server", required=True, help="model-server base URL (the demo puts a proxy here)")
    p.set_defaults(build=gateway)
    p = sub.add_parser("preprocess")
    p.add_argument("--features", required=True, help="feature store SQLite file")
    p.add_argument("--resize-ms", type=float, default=2.0, help="CPU per request normally")
    p.add_argument("--burn-ms", type=float, default=10.0, help="extra CPU per request under the fault")
    p.set_defaults(build=preprocess)
    p = sub.add_parser("model-server")
    p.add_argument("--kernel-ms", type=float, default=6.0, help="device time of a forward pass at batch 0")
    p.add_argument("--slowdown", type=float, default=8.0, help="how much slower kernels run while throttled")
    p.set_defaults(build=model_server)
    for p in sub.choices.values():
        p.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    allow_tracer(os.environ.get("SPIKEHOUND_DEMO_TRACER_PID"))
    args.build(args).serve(args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
