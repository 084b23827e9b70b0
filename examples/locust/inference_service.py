"""An OpenTelemetry-instrumented inference service to load-test: spikehound's demo stack behind HTTP.

    python examples/locust/inference_service.py --port 8080 --otlp 127.0.0.1:4317 --version 1.5.0

``POST /v1/predict`` with ``{"user_id": N}`` runs one request through the demo's
stack (gateway -> preprocess with a feature lookup in SQLite -> model server ->
postprocess), each service traced with the OpenTelemetry SDK under
``service.version`` = ``--version`` and exported over OTLP/gRPC to ``--otlp``
(a spikehound agent or collector). ``GET /healthz`` answers 200. SIGTERM (or
Ctrl-C) stops taking requests, flushes the spans and exits.

Run it from spikehound's virtual environment (it needs the OpenTelemetry SDK and exporter).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from inference_stack import InferenceStack  # beside this file


def make_handler(stack: InferenceStack) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200 if self.path == "/healthz" else 404, {"status": "ok"})

        def do_POST(self) -> None:
            if self.path != "/v1/predict":
                self._answer(404, {"error": "POST /v1/predict"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                user_id = int(body.get("user_id", 0))
            except (ValueError, AttributeError):
                self._answer(400, {"error": 'send {"user_id": N}'})
                return
            stack.request(user_id)
            self._answer(200, {"user_id": user_id, "prediction": "ok"})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the load test's own output

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8080, help="HTTP port on 127.0.0.1 (default 8080)")
    p.add_argument("--otlp", default="127.0.0.1:4317", help="OTLP/gRPC endpoint (default 127.0.0.1:4317)")
    p.add_argument("--version", default="dev", help="service.version of every service (default dev)")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="inference-service-"))
    stack = InferenceStack(args.otlp, workdir / "features.db", version=args.version)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(stack))
    server.daemon_threads = True

    def stop(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"inference service {args.version} on http://127.0.0.1:{args.port}, spans to {args.otlp}", flush=True)
    server.serve_forever()
    server.server_close()
    stack.shutdown()  # flushes the spans
    return 0


if __name__ == "__main__":
    sys.exit(main())
