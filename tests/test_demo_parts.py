"""The demo's own parts on loopback: its webhook receiver, its delaying TCP proxy, its open-loop load generator."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

from harness.daemons import free_port
from harness.waiting import eventually
from spikehound.demo.alerts import WebhookReceiver, describe
from spikehound.demo.load import OpenLoopLoad

ALERT = {  # Alertmanager's webhook payload, version 4, plus the spikehound section
    "version": "4", "groupKey": "{}:{service=\"gateway\"}", "status": "firing", "receiver": "demo",
    "groupLabels": {"service": "gateway"}, "commonLabels": {}, "commonAnnotations": {},
    "externalURL": "http://127.0.0.1:8470",
    "alerts": [{"status": "firing", "labels": {"alertname": "P99Spike", "service": "gateway",
                                               "operation": "POST /v1/predict"},
                "annotations": {"summary": "p99 335 ms against 65 ms"}, "startsAt": "2026-11-30T14:16:58Z",
                "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://127.0.0.1:8470/", "fingerprint": "ab12"}],
    "spikehound": {"spike": {"id": "92151da17f51d4d9", "causes": [
        {"kind": "network", "summary": "The hop gateway -> model-server (POST /infer) spent 218.3 ms in the network."},
    ]}},
}


class _Slow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay = 0.3

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = _answer


@pytest.fixture
def slow_server() -> Iterator[tuple[int, type[_Slow]]]:
    handler = type("Slow", (_Slow,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


def test_the_webhook_receiver_shows_an_alertmanager_shaped_alert_and_refuses_garbage():
    receiver = WebhookReceiver().start()
    try:
        assert requests.post(receiver.url, json=ALERT, timeout=5).status_code == 200
        assert requests.post(receiver.url, data=b"{not json", timeout=5).status_code == 400
        received = receiver.drain()
    finally:
        receiver.stop()
    assert received == [ALERT]
    assert receiver.rejected == 1
    assert describe(received[0]) == [
        "firing gateway POST /v1/predict: p99 335 ms against 65 ms",
        "  cause: The hop gateway -> model-server (POST /infer) spent 218.3 ms in the network."]


def test_the_delay_proxy_passes_bytes_through_and_holds_them_while_its_fault_is_on(slow_server):
    upstream_port, handler = slow_server
    handler.delay = 0.0
    listen, control = free_port(), free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "spikehound.demo.delay_proxy", "--listen", f"127.0.0.1:{listen}",
                              "--upstream", f"127.0.0.1:{upstream_port}", "--control", f"127.0.0.1:{control}",
                              "--delay-ms", "300"])
    try:
        eventually(lambda: requests.get(f"http://127.0.0.1:{control}/healthz", timeout=1), "the proxy to come up",
                   timeout=30)
        with requests.Session() as session:  # one kept-alive connection through the proxy, as the gateway has
            assert session.get(f"http://127.0.0.1:{listen}/", timeout=5).text == "ok"
            assert requests.post(f"http://127.0.0.1:{control}/fault", json={"on": True}, timeout=5).json()["fault"]
            started = time.monotonic()
            assert session.get(f"http://127.0.0.1:{listen}/", timeout=5).text == "ok"
            held = time.monotonic() - started
            requests.post(f"http://127.0.0.1:{control}/fault", json={"on": False}, timeout=5)
            assert session.get(f"http://127.0.0.1:{listen}/", timeout=5).text == "ok"
        assert requests.post(f"http://127.0.0.1:{control}/fault", data=b"nope", timeout=5).status_code == 400
    finally:
        proxy.terminate()
        proxy.wait(10)
    assert held >= 0.3  # a lower bound: the proxy held the request for its delay


def test_the_load_generator_keeps_its_arrival_rate_when_the_server_is_slow(slow_server):
    port, handler = slow_server
    handler.delay = 0.3
    load = OpenLoopLoad("127.0.0.1", port, "/", rate=40, body=lambda i: {"i": i}, senders=64)
    load.start()
    # Until 60 are sent (1.5 s of schedule), not for 1.5 s of wall clock: a loaded host may run the scheduler late,
    # and it catches up rather than sending fewer.
    eventually(lambda: load.sent >= 60, "60 requests sent", timeout=60, every=0.05)
    in_flight = load.sent - load.stats(600).completed
    load.stop()
    stats = load.stats(600)
    # A closed loop of a few users would have a few in flight; the open loop sends on schedule, whatever the
    # server's delay (0.3 s at 40/s: about 12 at once), and all are answered.
    assert in_flight >= 5, in_flight
    assert stats.sent >= 60
    assert stats.completed == stats.sent and stats.errors == 0
    assert stats.p50_ms >= 300  # latency counted from when each request was due, server time included
