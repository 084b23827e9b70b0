"""An acknowledged span survives the collector being killed (SIGKILL) or stopped (SIGTERM) mid-ingest.

The senders are two applications on the real OpenTelemetry SDK
(BatchSpanProcessor + OTLP/gRPC exporter); a wrapper remembers every span of an
export the collector answered with success. After the collector dies it is
started again on the same database, and every one of those spans must be
served by its API.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.api_client import ApiClient
from harness.daemons import CollectorProcess
from tests.support.sdk_traffic import SdkTraffic

# CollectorProcess.start leaves its log file to the garbage collector; the fixture collects it under this filter.
pytestmark = pytest.mark.slow

MIN_ACKED = 400


@pytest.fixture
def collector_process(db_url: str, tmp_path: Path) -> Iterator[CollectorProcess]:
    proc = CollectorProcess(db_url, tmp_path)
    try:
        yield proc
    finally:
        proc.kill()


def assert_all_stored(api: str, acked: set[tuple[str, str]]) -> None:
    """Every acknowledged span is served by the API of the restarted collector."""
    by_trace: dict[str, set[str]] = {}
    for trace_id, span_id in acked:
        by_trace.setdefault(trace_id, set()).add(span_id)
    missing = 0
    with requests.Session() as session:
        client = ApiClient(api, session=session)
        for trace_id, span_ids in by_trace.items():
            r = client.get(f"/api/v1/traces/{trace_id}")
            stored = {s["span_id"] for s in r.json()["spans"]} if r.status_code == 200 else set()
            missing += len(span_ids - stored)
    assert missing == 0, f"{missing} of {len(acked)} acknowledged spans are not in the database"


def start_traffic(c: CollectorProcess) -> list[SdkTraffic]:
    return [SdkTraffic(c.grpc_endpoint, "app-a").start(), SdkTraffic(c.grpc_endpoint, "app-b").start()]


def stop_traffic(apps: list[SdkTraffic]) -> set[tuple[str, str]]:
    """Stop both applications and return every span the collector acknowledged."""
    for app in apps:
        app.stop()
    return set().union(*(app.recorder.acked for app in apps))


def test_sigkill_loses_no_acknowledged_span(collector_process: CollectorProcess):
    c = collector_process.start()
    assert c.proc is not None
    killed = threading.Event()

    def kill_once_enough(count: int) -> None:
        # Right after an acknowledgement, while the other application's export is in flight:
        # the worst moment for a collector that answers before its commit is durable.
        if count >= MIN_ACKED and not killed.is_set():
            c.proc.send_signal(signal.SIGKILL)
            killed.set()

    apps = start_traffic(c)
    try:
        apps[0].recorder.on_ack = kill_once_enough
        assert killed.wait(30), f"only {len(apps[0].recorder.acked)} spans acknowledged in 30 s"
        assert c.proc.wait(10) == -signal.SIGKILL
    finally:
        acked = stop_traffic(apps)
    assert len(acked) > 200
    assert all(app.recorder.acked for app in apps)

    c.start()
    assert_all_stored(c.api, acked)
    assert c.terminate(15) == 0, c.log_tail()


def test_sigterm_exits_cleanly_and_keeps_every_acknowledged_span(collector_process: CollectorProcess):
    c = collector_process.start()
    apps = start_traffic(c)
    try:
        for app in apps:
            app.wait_acked(MIN_ACKED // 2)
        started = time.monotonic()
        status = c.terminate(15)  # raises TimeoutExpired past 15 s
        assert status == 0, c.log_tail()
        assert time.monotonic() - started < 15
    finally:
        acked = stop_traffic(apps)
    assert len(acked) > 200

    c.start()
    assert_all_stored(c.api, acked)
    assert c.terminate(15) == 0, c.log_tail()
