"""A wrong clock never switches detection off: spans and samples dated after the collector's clock plus
``collector.max_clock_skew_seconds`` are refused and counted by sender, and a checkpoint whose event time ran
ahead (taken before that rule) is brought back at start.
"""

from __future__ import annotations

import time
from pathlib import Path

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.detectors.engine import CHECKPOINT_FORMAT, DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import MetricKind, MetricPoint, Span, SpanKind, StatusCode
from spikehound.otlp import encode_points, encode_spans
from spikehound.storage import checkpoints
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade

NS = 1_000_000_000
MS = 1_000_000
YEAR_2200 = 7_258_118_400 * NS
PROTOBUF = {"Content-Type": "application/x-protobuf"}

_ids = iter(range(1, 10**9))


def _span(end_ns: int, service: str = "api", host: str = "good-clock") -> Span:
    i = next(_ids)
    return Span(trace_id=i.to_bytes(16, "big"), span_id=i.to_bytes(8, "big"), parent_span_id=None, service=service,
                host=host, name="GET /x", kind=SpanKind.SERVER, start_unix_nano=end_ns - 20 * MS, end_unix_nano=end_ns,
                status=StatusCode.UNSET)


def _post(collector: CollectorThread, spans: list[Span]) -> ExportTraceServiceResponse:
    r = requests.post(f"{collector.http_endpoint}/v1/traces", data=encode_spans(spans).SerializeToString(),
                      headers=PROTOBUF, timeout=10)
    assert r.status_code in (200, 400), r.text
    return ExportTraceServiceResponse.FromString(r.content) if r.status_code == 200 else r


def _closed_windows_move(collector: CollectorThread) -> bool:
    """Spans of the last minute, second by second: do their windows close (is detection on)?"""
    before = collector.metric("spikehound_latency_windows_closed_total")
    now = time.time_ns()
    for second in range(60, 0, -1):
        _post(collector, [_span(now - second * NS)])
    return eventually(lambda: collector.metric("spikehound_latency_windows_closed_total") > before,
                      "a latency window to close", every=0.2)


def test_a_span_from_a_wrong_clock_is_refused_counted_and_changes_nothing(tmp_path: Path):
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}")) as collector:
        answer = _post(collector, [_span(time.time_ns() - 90 * NS), _span(YEAR_2200, "billing", "fast-clock")])
        assert answer.partial_success.rejected_spans == 1
        assert "clock" in answer.partial_success.error_message
        assert collector.metric("spikehound_ingest_future_records_total", signal="spans", service="billing",
                                host="fast-clock") == 1
        # A sample from the same future is refused as well.
        point = MetricPoint(host="fast-clock", name="system.cpu.utilization", attributes={"cpu.mode": "busy"},
                            time_unix_nano=YEAR_2200, value=0.5, kind=MetricKind.GAUGE, unit="1")
        r = requests.post(f"{collector.http_endpoint}/v1/metrics", data=encode_points([point]).SerializeToString(),
                          headers=PROTOBUF, timeout=10)
        assert r.status_code == 400 and "clock" in r.text
        # Detection goes on: the watermark did not jump to the year 2200.
        assert _closed_windows_move(collector)
        assert collector.metric("spikehound_latency_late_spans_total") == 0


def test_a_checkpoint_whose_event_time_ran_ahead_is_brought_back_at_start(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    # The state a collector saved after a span from the year 2200 got through (before such spans were refused).
    poisoned = DetectionEngine(DetectionSettings())
    poisoned.add([_span(time.time_ns() - 30 * NS), _span(YEAR_2200)])
    poisoned.advance()
    engine = make_engine(url)
    upgrade(engine)
    checkpoints.save(engine, "detection", CHECKPOINT_FORMAT, poisoned.snapshot())
    engine.dispose()
    with CollectorThread(collector_config(url)) as collector:
        assert _closed_windows_move(collector)
        assert collector.metric("spikehound_latency_late_spans_total") == 0
