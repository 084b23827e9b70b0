"""Traces no instrumentation would make (a span that is its own ancestor, reused span ids, a request that calls
ten thousand things) are stored, and detection goes on; a detector bug costs one batch's detection, never its
storage or the loop. Real collector, real OTLP/HTTP."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from harness.api_client import get_json
from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.collector.local_detection import LocalDetection
from tests.support.otlp_requests import assert_still_serving, post, request, span

MS = 1_000_000


@pytest.fixture
def quick_collector(tmp_path: Path) -> Iterator[CollectorThread]:
    """Windows of one second, closed half a second after the input stops."""
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__window_seconds=1,
                                          collector__allowed_lateness_seconds=0.5)) as running:
        yield running


@pytest.fixture
def in_process_collector(tmp_path: Path) -> Iterator[CollectorThread]:
    """As ``quick_collector``, with the detectors in the collector's process, where a test can reach them."""
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__window_seconds=1,
                                          collector__allowed_lateness_seconds=0.5,
                                          detection__own_process=False)) as running:
        yield running


def wait_for_windows(c: CollectorThread, more_than: float, timeout: float = 60) -> float:
    """The closed-window count once it passes ``more_than``: the writer thread got through the detectors."""
    def closed() -> tuple[float] | None:
        count = c.metric("spikehound_latency_windows_closed_total")
        return (count,) if count > more_than else None  # in a tuple, so that a count of 0 counts as found

    (count,) = eventually(closed, "a window to close (else the detectors are stuck)", timeout)
    return count


def generic_entry_with_a_cycle(trace_id: bytes) -> list[dict]:
    """A ``GET`` entry (no route, so it is named by what it called) whose INTERNAL children are each other's
    parents, plus a span that names itself its parent."""
    now = time.time_ns()
    root, a, b, selfish = (os.urandom(8) for _ in range(4))
    times = {"start_time_unix_nano": now - 50 * MS, "end_time_unix_nano": now}
    return [span(trace_id, name="GET", span_id=root, **times),
            span(trace_id, name="loop-a", kind=1, span_id=a, parent_span_id=b, **times),
            span(trace_id, name="loop-b", kind=1, span_id=b, parent_span_id=a, **times),
            span(trace_id, name="loop-root", kind=1, span_id=a, parent_span_id=root, **times),  # reuses a's id
            span(trace_id, name="selfish", kind=1, span_id=selfish, parent_span_id=selfish, **times)]


def test_a_trace_that_is_its_own_ancestor_is_stored_and_detection_goes_on(quick_collector: CollectorThread):
    c = quick_collector
    trace_id = os.urandom(16)
    r = post(c, request(*generic_entry_with_a_cycle(trace_id)).SerializeToString())
    assert r.status_code == 200, r.content
    answer = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert (answer.rejected_spans, answer.error_message) == (1, "span 4 (selfish): parent_span_id is the span's own id")
    wait_for_windows(c, 0)  # the entry's window was named by walking the cycle, and closed

    spans = get_json(f"{c.api}/api/v1/traces/{trace_id.hex()}")["spans"]
    names = sorted(s["name"] for s in spans)  # of two spans with one id, the trace shows one
    assert names in (["GET", "loop-a", "loop-b"], ["GET", "loop-b", "loop-root"])
    assert c.metric("spikehound_detector_errors_total", part="detectors") == 0
    assert_still_serving(c)


def test_a_request_that_fans_out_to_ten_thousand_calls_is_named_by_a_few(quick_collector: CollectorThread):
    """Each of 2,000 generic entries of one trace asks where it went: the trace is indexed once, not 2,000
    times, and the name lists a few callees and a count."""
    c = quick_collector
    trace_id, now = os.urandom(16), time.time_ns()
    times = {"start_time_unix_nano": now - 50 * MS, "end_time_unix_nano": now}
    root = os.urandom(8)
    spans = [span(trace_id, name="GET", span_id=root, **times)]
    entries = [os.urandom(8) for _ in range(2_000)]
    spans += [span(trace_id, name="GET", kind=2, span_id=e, parent_span_id=root, **times) for e in entries]
    spans += [span(trace_id, name=f"call-{i}", kind=3, parent_span_id=root, **times) for i in range(10_000)]
    r = post(c, request(*spans).SerializeToString())
    assert r.status_code == 200, r.content
    wait_for_windows(c, 0)

    points = get_json(f"{c.api}/api/v1/latency", service="bad-input-svc")
    names = {p["operation"] for p in points["points"]}
    assert "GET -> call-0, call-1, call-10, call-11 (+60)" in names  # 64 callees read, four shown
    assert c.metric("spikehound_detector_errors_total", part="detectors") == 0
    assert_still_serving(c)


def test_a_detector_failure_costs_that_batch_its_detection_not_its_storage(in_process_collector: CollectorThread,
                                                                           caplog: pytest.LogCaptureFixture):
    """A bug the input sets off (injected here: the one fake) is counted and logged once; the sender is told
    its spans are stored, they are, and the next batch is detected as usual."""
    c = in_process_collector
    assert isinstance(c.collector.detection, LocalDetection)
    detection = c.collector.detection.driver.detection
    calls = []

    def failing_add(spans, points):
        calls.append(len(spans))
        raise RuntimeError("a detector bug")

    detection.add = failing_add
    caplog.set_level(logging.ERROR, logger="spikehound.collector.detection")
    first, second = os.urandom(16), os.urandom(16)
    for trace_id in (first, second):
        assert post(c, request(span(trace_id)).SerializeToString()).status_code == 200
    assert calls and c.metric("spikehound_detector_errors_total", part="detectors") == len(calls)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "spikehound_detector_errors_total" in tracebacks[0].getMessage()
    assert tracebacks[0].getMessage().startswith("the detectors failed on a batch (stored anyway)")
    for trace_id in (first, second):
        assert len(get_json(f"{c.api}/api/v1/traces/{trace_id.hex()}")["spans"]) == 1

    del detection.add  # the bug is gone: the class's own add again
    closed = c.metric("spikehound_latency_windows_closed_total")
    assert_still_serving(c)
    wait_for_windows(c, closed)
    assert requests.get(f"{c.api}/readyz", timeout=5).status_code == 200


def test_a_failing_commit_hook_costs_its_own_figures_only(quick_collector: CollectorThread,
                                                        caplog: pytest.LogCaptureFixture):
    """A hook told of every committed batch (span and resource metrics) that raises: the sender still gets
    its 200 and its spans are served; the failure is counted under its own part."""
    c = quick_collector

    def failing_hook(batch):
        raise ValueError("a metrics bug")

    c.collector.pipeline.commit_hooks.add(failing_hook)
    caplog.set_level(logging.ERROR, logger="spikehound.collector.detection")
    trace_id = os.urandom(16)
    assert post(c, request(span(trace_id)).SerializeToString()).status_code == 200
    assert len(get_json(f"{c.api}/api/v1/traces/{trace_id.hex()}")["spans"]) == 1
    assert c.metric("spikehound_detector_errors_total", part="metrics") >= 1
    assert c.metric("spikehound_detector_errors_total", part="detectors") == 0
    assert [r.getMessage().split(" failed")[0] for r in caplog.records if r.exc_info] == [
        "a commit hook (span or resource metrics)"]
    wait_for_windows(c, 0)  # detection goes on behind the failing hook
