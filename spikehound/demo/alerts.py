"""The demo's local webhook receiver: alerts from the collector, shown as they arrive.

The collector's webhook notifier posts Alertmanager's webhook payload
(version 4: ``status``, ``alerts[]`` with ``labels``, ``annotations``,
``startsAt``, ...) plus a ``spikehound`` section with the spike and its ranked
causes. :func:`describe` turns one body into the lines the demo prints; it
reads only what is there, so it shows any Alertmanager-shaped body.

>>> describe({"version": "4", "status": "firing", "alerts": [{"status": "firing",
...     "labels": {"service": "gateway", "operation": "POST /v1/predict"},
...     "annotations": {"summary": "p99 80 ms against 30 ms"}}],
...     "spikehound": {"causes": [{"summary": "Span resize of preprocess took 30 ms."}]}})
['firing gateway POST /v1/predict: p99 80 ms against 30 ms', '  cause: Span resize of preprocess took 30 ms.']
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def describe(body: dict[str, Any]) -> list[str]:
    """The lines to print for one webhook body."""
    lines = []
    for alert in body.get("alerts") or [{}]:
        labels = alert.get("labels") or {}
        annotations = alert.get("annotations") or {}
        what = " ".join(x for x in (labels.get("service"), labels.get("operation")) if x) or labels.get(
            "alertname", "alert")
        text = annotations.get("summary") or annotations.get("description") or ""
        lines.append(f"{alert.get('status') or body.get('status', '?')} {what}: {text}".rstrip(": "))
    section = body.get("spikehound") or {}
    spike = section.get("spike") if isinstance(section.get("spike"), dict) else {}
    causes = section.get("causes") or spike.get("causes") or []
    if causes and isinstance(causes[0], dict) and causes[0].get("summary"):
        lines.append(f"  cause: {causes[0]['summary']}")
    return lines


class WebhookReceiver:
    """An HTTP server on loopback that queues every JSON body POSTed to ``/alerts``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        self.rejected = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length))
                    if not isinstance(body, dict):
                        raise ValueError("not a JSON object")
                except ValueError:
                    receiver.rejected += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                if self.path != "/alerts":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.received.put(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/alerts"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def drain(self) -> list[dict[str, Any]]:
        """Every body received since the last call."""
        out = []
        while True:
            try:
                out.append(self.received.get_nowait())
            except queue.Empty:
                return out
