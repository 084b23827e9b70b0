"""Numbers no one meant: every query parameter out of range, in another script's digits or past what storage
holds is a 400 naming the parameter, never a 500 with a traceback (REST API, Jaeger API, analyses, alerts,
the pages' session cookie). Real collector, real HTTP."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import requests

from harness.api_client import request
from harness.daemons import CollectorThread, collector_config

OLDEST = "1677-09-21T00:12:44Z"  # a second after the first time a signed 64-bit nanosecond count holds

# (path with query, the parameter the error must name)
REST = [
    ("/api/v1/latency?service=a&until=99999999999999999999", "until"),
    ("/api/v1/latency?service=a&since=1677-01-01T00:00:00Z", "since"),
    ("/api/v1/spikes?since=%D9%A1%D9%A7%D9%A0%D9%A0", "since"),  # Arabic-Indic digits
    ("/api/v1/spikes?limit=%C2%B2", "limit"),  # superscript two: str.isdigit() says yes, int() says no
    ("/api/v1/spikes?limit=%D9%A1", "limit"),
    ("/api/v1/spikes?limit=99999999999999999999", "limit"),
    ("/api/v1/alerts/outbox?limit=%C2%B2", "limit"),
    ("/api/v1/alerts/outbox/99999999999999999999", "notification id"),
    ("/api/v1/alerts/outbox/%C2%B2", "notification id"),
    ("/api/v1/alerts/outbox/99999999999999999999/retry", "notification id"),
    ("/api/v1/compare?baseline=1&candidate=2&max_traces=%C2%B2", "max_traces"),
    ("/api/v1/compare?baseline=1&candidate=2&min_requests=99999999999999999999", "min_requests"),
    ("/api/v1/compare?baseline=1&candidate=2&since=9223372036854775807", "since"),
    ("/api/v1/profile?select=1677-01-01T00:00:00Z..2000-01-01T00:00:00Z", "select"),
    ("/api/v1/analyze/batching?service=a&min_requests=%C2%B2", "min_requests"),
]
JAEGER = [
    ("/api/traces?service=a&end=99999999999999999999", "end"),
    ("/api/traces?service=a&end=9223372036854775807", "end"),
    ("/api/traces?service=a&start=-99999999999999999999", "start"),
    ("/api/traces?service=a&start=%D9%A1%D9%A2", "start"),
    ("/api/traces?service=a&limit=-1", "limit"),
    ("/api/traces?service=a&minDuration=99999999999999999999h", "minDuration"),
    ("/api/traces?service=a&maxDuration=" + "9" * 400 + "h", "maxDuration"),
    ("/api/dependencies?lookback=9223372036854775807", "lookback"),
    ("/api/dependencies?endTs=99999999999999999999", "endTs"),
    ("/api/dependencies?endTs=-9223372036854775807", "endTs"),
]


def _post_or_get(url: str) -> requests.Response:
    if url.endswith("/retry"):
        return requests.post(url, timeout=30)
    return requests.get(url, timeout=30)


@pytest.mark.parametrize(("path", "names"), REST, ids=[p for p, _ in REST])
def test_out_of_range_rest_parameters_are_400_naming_them(sqlite_collector: CollectorThread, path: str, names: str,
                                                          caplog: pytest.LogCaptureFixture):
    r = _post_or_get(sqlite_collector.api + path)
    assert r.status_code == 400, r.text
    assert names in r.json()["error"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


@pytest.mark.parametrize(("path", "names"), JAEGER, ids=[p[:70] for p, _ in JAEGER])
def test_out_of_range_jaeger_parameters_are_400_naming_them(sqlite_collector: CollectorThread, path: str, names: str,
                                                            caplog: pytest.LogCaptureFixture):
    r = requests.get(sqlite_collector.api + path, timeout=30)
    assert r.status_code == 400, r.text
    (error,) = r.json()["errors"]
    assert error["code"] == 400 and names in error["msg"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def test_the_edges_of_what_storage_holds_are_still_answered(sqlite_collector: CollectorThread):
    api = sqlite_collector.api
    # The default range is the hour before until: before the oldest time it begins at the oldest.
    for path in (f"/api/v1/latency?service=a&until={OLDEST}", f"/api/v1/metrics?host=h&until={OLDEST}",
                 f"/api/v1/compare?baseline=1&candidate=2&until={OLDEST}", f"/ui/spikes?until={OLDEST}",
                 "/api/v1/metrics?host=h&until=2262-04-11T23:47:16Z", f"/api/v1/spikes?since={OLDEST}",
                 "/api/traces?service=a&start=-9223372036854775&end=0",
                 "/api/dependencies?endTs=0&lookback=9223372036854"):
        assert requests.get(api + path, timeout=30).status_code == 200, path


def test_a_silence_past_what_storage_holds_is_refused(sqlite_collector: CollectorThread):
    r = request("POST", f"{sqlite_collector.api}/api/v1/silences", json={
        "matchers": {"service": "gateway"}, "starts_at": "2262-04-01T00:00:00Z", "duration_seconds": 86400 * 365})
    assert r.status_code == 400 and "ends_at" in r.json()["error"]


def test_a_forged_session_cookie_is_a_login_page_not_a_500(tmp_path: Path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__api_token="page-t0ken")
    with CollectorThread(cfg) as c:
        # '²' passes str.isdigit() and fails int(); sent as the UTF-8 a hand-made client would send.
        r = requests.get(f"{c.api}/ui/", headers={"Cookie": "spikehound_session=².00".encode()}, timeout=5)
        assert r.status_code == 401 and "<form" in r.text
