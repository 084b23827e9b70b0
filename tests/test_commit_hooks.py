"""A hook told of every committed batch (span and resource metrics) that raises costs its own figures only: the
batch is on disk, so its sender is answered with success, the failure is counted and logged, and the data is
served."""

from __future__ import annotations

import logging
import os

import pytest
import requests

from harness.api_client import get_json
from harness.daemons import CollectorThread
from harness.waiting import eventually
from spikehound.collector.commit_hooks import CommitHooks
from spikehound.storage.writer import WriteBatch
from tests.support.otlp_requests import post, request, span


def test_a_raising_hook_is_reported_and_the_next_one_still_runs():
    failures: list[Exception] = []
    told: list[WriteBatch] = []

    def raising(batch: WriteBatch) -> None:
        raise ValueError("a metrics bug")

    hooks = CommitHooks(on_failure=failures.append)
    hooks.add(raising)
    hooks.add(told.append)
    batch = WriteBatch()
    hooks.run(batch)  # does not raise

    assert [str(e) for e in failures] == ["a metrics bug"] and told == [batch]


def test_a_failing_report_does_not_raise_either(caplog: pytest.LogCaptureFixture):
    def raising(_: object) -> None:
        raise ValueError("a metrics bug")

    hooks = CommitHooks(on_failure=raising)
    hooks.add(raising)
    hooks.run(WriteBatch())

    assert "reporting it failed too" in caplog.text


def test_the_sender_of_a_batch_a_hook_failed_on_gets_its_success_and_its_spans_are_served(
        sqlite_collector: CollectorThread, caplog: pytest.LogCaptureFixture):
    c = sqlite_collector
    calls: list[int] = []

    def failing_hook(batch: WriteBatch) -> None:
        calls.append(batch.span_count)  # its decoded spans stay in the detection process's
        raise RuntimeError("a metrics bug")

    assert c.collector.pipeline is not None
    c.collector.pipeline.commit_hooks.add(failing_hook)
    caplog.set_level(logging.ERROR)
    trace_ids = [os.urandom(16) for _ in range(2)]
    for trace_id in trace_ids:
        r = post(c, request(span(trace_id)).SerializeToString())
        assert r.status_code == 200, r.content  # not 503: the batch was committed before the hook ran

    assert sum(calls) == 2
    assert c.metric("spikehound_detector_errors_total", part="metrics") == len(calls)
    assert c.metric("spikehound_storage_write_errors_total") == 0
    assert requests.get(f"{c.api}/readyz", timeout=5).status_code == 200
    for trace_id in trace_ids:
        spans = get_json(f"{c.api}/api/v1/traces/{trace_id.hex()}")["spans"]
        assert len(spans) == 1
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1  # one traceback per kind, not one per batch
    assert logged[0].getMessage().startswith("a commit hook (span or resource metrics) failed on a batch")
    eventually(lambda: c.metric("spikehound_ingest_stored_total", signal="spans") >= 2, "both batches counted")
