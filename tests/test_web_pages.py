"""The web pages over HTTP: what they show, what they refuse, how the token works, and that they escape.

A real collector serves pages from real spikes (``tests/support/web_scenarios.py``); the
browser tests (``test_web_browser.py``) drive the same pages in Chromium.
"""

from __future__ import annotations

import hashlib
import html
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.api_client import ApiClient, get_json, request, wait_json
from harness.daemons import CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.long_trace import long_trace
from spikehound.collector.web import session
from spikehound.collector.web.routes import STATIC
from spikehound.collector.web.waterfall import layout
from spikehound.model import Span, SpanKind, StatusCode
from spikehound.otlp import encode_spans
from spikehound.units import NS
from tests.support.query_plans import FULL_SCAN, plan_of
from tests.support.storage_data import T0
from tests.support.web_scenarios import (
    EVIL_ATTRIBUTE,
    EVIL_SERVICE,
    EVIL_SPAN,
    START_S,
    SpikeData,
    collector_on_copy,
    scenarios,
    spike_database,
)

pytestmark = pytest.mark.slow
TOKEN = "page-secret-7"


@pytest.fixture(scope="module")
def data() -> SpikeData:
    return spike_database()


@pytest.fixture(scope="module")
def site(data: SpikeData, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorThread]:
    with collector_on_copy(data, tmp_path_factory.mktemp("open")) as collector:
        yield collector


@pytest.fixture(scope="module")
def guarded(data: SpikeData, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorThread]:
    with collector_on_copy(data, tmp_path_factory.mktemp("guarded"), collector__api_token=TOKEN) as collector:
        yield collector


def get(base: str, path: str, **kwargs: Any) -> requests.Response:
    return requests.get(base + path, timeout=30, allow_redirects=False, **kwargs)


def rows_of(page: str, table_class: str) -> list[str]:
    """The text of each body row of the table with ``table_class``, tags stripped, entities decoded."""
    table = re.search(rf'<table class="{table_class}">(.*?)</table>', page, re.S)
    assert table, f"no {table_class} table"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1).split("<tbody>", 1)[1], re.S)
    return [html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r))).strip() for r in rows]


# --- what the pages show ---------------------------------------------------------------------


def test_the_overview_lists_every_stream_with_its_newest_percentiles(site: CollectorThread):
    page = get(site.api, "/ui/")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    rows = rows_of(page.text, "streams")
    latency = get_json(f"{site.api}/api/v1/latency", service="gateway", operation="POST /v1/predict",
                       since="0")["points"]
    newest = latency[-1]
    gateway = next(r for r in rows if r.startswith("gateway POST /v1/predict"))
    # The newest window's p99 as the page writes it (one decimal under 100 ms), and a request rate.
    assert f"{newest['p99_ms']:.1f} ms" in gateway or f"{newest['p99_ms']:.0f} ms" in gateway, gateway
    assert re.search(r" \d+(\.\d+)? \d+ days ago", gateway), gateway  # req/s, then the window's age
    assert any(r.startswith("model-server /infer") for r in rows)


def test_the_spike_list_filters_by_service_state_and_time(site: CollectorThread, data: SpikeData):
    everything = rows_of(get(site.api, "/ui/spikes").text, "spikes")
    assert len(everything) == len(get_json(f"{site.api}/api/v1/spikes")["spikes"]) >= 2

    # A service finds the spikes that moved one of its streams: the slow query's, led by the gateway.
    preprocess = rows_of(get(site.api, "/ui/spikes?service=preprocess").text, "spikes")
    assert len(preprocess) == 1 and " gateway POST /v1/predict " in preprocess[0], preprocess
    assert "No spike matches" in get(site.api, "/ui/spikes?state=open").text

    # The hostile scenario starts an hour after the first: a range from half an hour in holds only its spikes.
    later = rows_of(get(site.api, "/ui/spikes?since=2026-01-01T00:30:00Z").text, "spikes")
    assert later and all(r.startswith("2026-01-01 01:") for r in later)
    earlier = rows_of(get(site.api, "/ui/spikes?since=0&until=2026-01-01T00:30:00Z").text, "spikes")
    assert len(earlier) + len(later) == len(everything)


def test_bad_filters_and_unknown_ids_get_a_page_that_says_why_and_are_counted(site: CollectorThread):
    before = site.metric("spikehound_web_rejected_requests_total", reason="bad_request")
    bad = get(site.api, "/ui/spikes?since=yesterday")
    assert bad.status_code == 400 and "neither RFC 3339 nor unix seconds" in html.unescape(bad.text)
    assert get(site.api, "/ui/spikes?since=2000&until=1000").status_code == 400
    assert get(site.api, "/ui/traces/not-a-trace").status_code == 400
    assert site.metric("spikehound_web_rejected_requests_total", reason="bad_request") == before + 3

    not_found = site.metric("spikehound_web_rejected_requests_total", reason="not_found")
    missing = get(site.api, "/ui/spikes/0123456789abcdef")
    assert missing.status_code == 404 and "There is no spike" in html.unescape(missing.text)
    assert get(site.api, "/ui/traces/" + "ab" * 16).status_code == 404
    assert site.metric("spikehound_web_rejected_requests_total", reason="not_found") == not_found + 2
    # A trace id typed into the header's box finds the trace page.
    found = get(site.api, "/ui/traces?id=" + "AB" * 16)
    assert found.status_code == 303 and found.headers["Location"] == "/ui/traces/" + "ab" * 16


def test_the_spike_page_links_every_cause_to_its_evidence(site: CollectorThread, data: SpikeData):
    spike = data.gpu_spike
    page = get(site.api, f"/ui/spikes/{spike['id']}").text
    causes = re.findall(r'<li id="cause-(\d+)">(.*?)</li>', page, re.S)
    assert len(causes) == len(spike["causes"]) >= 2
    for (rank, body), cause in zip(causes, spike["causes"], strict=True):
        assert html.escape(cause["summary"], quote=False) in body
        links = re.findall(r'<a href="#([^"]+)">', body.split('class="evidence"', 1)[1])
        assert links, f"cause {rank} links to no evidence"
        for anchor in links:  # every link lands on something on the page
            assert f'id="{anchor}"' in page, anchor
    top = spike["causes"][0]
    # The top cause is the GPU: its first link is the GPU utilization chart of its host.
    assert top["resource"] == "hw.gpu.utilization" and top["host"] == "gpu-2"
    first = re.search(r'class="evidence">evidence: <a href="#([^"]+)">([^<]+)</a>', causes[0][1])
    assert first and first.group(2) == "GPU utilization on gpu-2"
    # The span cause points at the forward pass in the slowest trace, marked as grown on the critical path.
    forward = next(c for c in spike["causes"] if c["kind"] == "span")
    assert forward["operation"] == "forward"
    row = re.search(r'<div id="s-([0-9a-f]{16})" class="([^"]+)"[^>]*>\s*<span class="name">.*?</span> forward', page)
    assert row and {"cp", "grown", "cause"} <= set(row.group(2).split())


def test_spikehound_spike_prints_the_page_url(site: CollectorThread, data: SpikeData):
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent))
    assert exe
    done = subprocess.run([exe, "spike", data.gpu_spike["id"], "--api-url", site.api], capture_output=True,
                          text=True, timeout=60, check=True)
    url = f"{site.api}/ui/spikes/{data.gpu_spike['id']}"
    assert f"  page  {url}" in done.stdout.splitlines()
    assert get(url, "").status_code == 200


# --- escaping and headers ----------------------------------------------------------------------


def test_markup_from_senders_is_escaped_on_every_page(site: CollectorThread, data: SpikeData):
    spike = data.hostile_spike
    assert EVIL_SPAN in spike["causes"][0]["summary"]  # the hostile name is the top cause's span
    trace_id = spike["exemplar_trace_ids"][0]
    pages = {path: get(site.api, path).text for path in
             ("/ui/", "/ui/spikes", f"/ui/spikes/{spike['id']}", f"/ui/traces/{trace_id}",
              f"/ui/spikes?service={requests.utils.quote(EVIL_SERVICE)}")}
    for path, text in pages.items():
        for markup in (EVIL_SPAN, EVIL_ATTRIBUTE, EVIL_SERVICE, "<img", "<svg", "<script>alert"):
            assert markup not in text, f"{path} carries {markup!r} unescaped"
    assert html.escape(EVIL_SPAN) in pages[f"/ui/spikes/{spike['id']}"]
    assert html.escape(EVIL_SERVICE) in pages["/ui/"]
    # Attribute keys and values of the hostile span, on the trace page.
    assert html.escape(EVIL_ATTRIBUTE) in pages[f"/ui/traces/{trace_id}"]
    # The chart data is JSON inside a script element: nothing in it can close the element.
    block = re.search(r'<script type="application/json" id="chart-data">(.*?)</script>',
                      pages[f"/ui/spikes/{spike['id']}"], re.S)
    assert block and "<" not in block.group(1)


def test_pages_forbid_inline_script_and_framing(site: CollectorThread):
    for path in ("/ui/", "/ui/login", "/ui/static/spikehound.js"):
        headers = get(site.api, path).headers
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
    assert get(site.api, "/ui/").headers["Cache-Control"] == "no-store"
    assert "Content-Security-Policy" not in request("GET", f"{site.api}/api/v1/spikes").headers  # JSON as it was


def test_every_asset_is_served_by_the_collector(site: CollectorThread):
    page = get(site.api, "/ui/").text
    assets = re.findall(r'(?:src|href)="([^"#?]+\.(?:js|css))(?:\?v=[^"]+)?"', page)
    assert len(assets) == 4
    for asset in assets:
        assert asset.startswith("/ui/static/")
        response = get(site.api, asset)
        assert response.status_code == 200 and len(response.content) > 1000
    assert not re.search(r'(?:src|href)="(?:https?:)?//', page)  # no CDN, no other site


def test_the_vendored_chart_library_is_the_recorded_release():
    readme = (STATIC / "vendor" / "README.md").read_text()
    sums = dict(line.split()[::-1] for line in re.findall(r"^[0-9a-f]{64}  \S+$", readme, re.M))
    assert set(sums) == {"uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"}
    for name, digest in sums.items():
        assert hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest() == digest, name
    assert "v1.6.32" in (STATIC / "vendor" / "uPlot.iife.min.js").read_text()[:100]


# --- the token -------------------------------------------------------------------------------


def test_with_a_token_the_pages_need_it_too(guarded: CollectorThread, data: SpikeData):
    page = f"/ui/spikes/{data.gpu_spike['id']}"
    refused = get(guarded.api, page)
    assert refused.status_code == 401 and 'name="token"' in refused.text
    assert "GPU" not in refused.text and f'name="next" value="{page}"' in refused.text  # nothing of the spike
    assert get(guarded.api, "/").status_code == 303  # the redirect to the overview tells nothing
    wrong = get(guarded.api, page + "?token=guess")
    assert wrong.status_code == 401 and "not the collector" in html.unescape(wrong.text)
    assert guarded.metric("spikehound_web_rejected_requests_total", reason="wrong_token") >= 1

    # A link with the token trades it for a session cookie and takes the token out of the address.
    traded = get(guarded.api, page + "?token=" + TOKEN + "&x=1")
    assert traded.status_code == 303 and traded.headers["Location"] == page + "?x=1"
    cookie = traded.headers["Set-Cookie"]
    assert TOKEN not in cookie
    assert all(part in cookie for part in ("HttpOnly", "SameSite=Lax", "Path=/ui/", "Max-Age=43200"))
    jar = {session.COOKIE: traded.cookies[session.COOKIE]}
    assert get(guarded.api, page, cookies=jar).status_code == 200
    # The cookie opens the pages, not the API; the API's bearer token opens both.
    bearer = ApiClient(guarded.api, headers={"Authorization": f"Bearer {TOKEN}"})  # the document needs the token
    assert bearer.request("GET", "/api/v1/spikes", cookies=jar, headers={"Authorization": None}).status_code == 401
    assert get(guarded.api, page, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    # A cookie made up without the token, or an old one, is refused.
    forged = session.issue("another-token", now=time.time())
    assert get(guarded.api, page, cookies={session.COOKIE: forged}).status_code == 401
    stale = session.issue(TOKEN, now=time.time() - session.SESSION_SECONDS - 5)
    assert get(guarded.api, page, cookies={session.COOKIE: stale}).status_code == 401
    # Style sheets and scripts hold nothing secret: the login page needs them.
    assert get(guarded.api, "/ui/static/spikehound.css").status_code == 200


def test_the_login_form_sets_the_session_and_goes_back_where_it_came_from(guarded: CollectorThread):
    form = {"token": TOKEN, "next": "/ui/spikes?state=open"}
    done = requests.post(f"{guarded.api}/ui/login", data=form, timeout=10, allow_redirects=False)
    assert done.status_code == 303 and done.headers["Location"] == "/ui/spikes?state=open"
    assert session.COOKIE in done.cookies
    # Never to another site.
    away = requests.post(f"{guarded.api}/ui/login", data={"token": TOKEN, "next": "//evil.example/ui/"}, timeout=10,
                         allow_redirects=False)
    assert away.headers["Location"] == "/ui/"
    bad = requests.post(f"{guarded.api}/ui/login", data={"token": "nope", "next": "/ui/"}, timeout=10,
                        allow_redirects=False)
    assert bad.status_code == 401 and session.COOKIE not in bad.cookies
    out = requests.post(f"{guarded.api}/ui/logout", timeout=10, allow_redirects=False)
    assert out.status_code == 303 and 'spikehound_session=""' in out.headers["Set-Cookie"]


# --- the pages' queries use indexes (SQLite's plans) -----------------------------------------


def test_the_pages_queries_are_served_by_indexes(planned):  # planned: tests/conftest.py
    reader, statements = planned
    for call, required in (
            (lambda: reader.recent_windows(300 * 10**9),
             ["operations USING COVERING INDEX", "SEARCH latency_windows USING COVERING INDEX "
              "ix_latency_windows_service_start (service=?)", "(service=? AND start_ns>?)"]),
            (lambda: reader.host_series("gpu-1", ["hw.gpu.utilization"], T0, T0 + 3600 * 10**9),
             ["SEARCH metric_series USING INDEX", "(host=? AND name=?)",
              "SEARCH metric_points USING INDEX", "(series_id=? AND t_ns>? AND t_ns<?)"])):
        text = plan_of(reader.engine, statements, call)
        assert not FULL_SCAN.search(text), text
        for fragment in required:
            assert fragment in text, f"expected {fragment!r} in the plan:\n{text}"


# --- large traces ----------------------------------------------------------------------------


def test_a_two_thousand_span_trace_folds_its_repeated_steps_into_one_row():
    w = layout(long_trace(bytes(15) + b"\x07", 0))
    assert len(w.rows) == 2000 and w.path_count == 2000
    groups = [i for i in w.items if i.is_group]
    assert len(w.items) < 20 and len(groups) == 1
    steps = groups[0]
    assert (steps.span.name, steps.count, len(steps.rows)) == ("decode_step", 993, 1986)
    assert steps.on_path and {r.group for r in steps.rows} == {steps}
    # A span folded into the group is found at the group's row.
    assert w.find("model-server", "sample_token").anchor == steps.anchor


def test_a_spike_page_shows_the_critical_path_of_a_wide_trace_first():
    # A fan-out of 1,000 differently named calls: nothing to fold, so the page keeps the critical path and fills
    # up to its limit with the rest, in tree order; the trace page has them all.
    root = Span(trace_id=bytes(16), span_id=b"\x01" * 8, parent_span_id=None, service="gateway", host=None,
                name="POST /search", kind=SpanKind.SERVER, start_unix_nano=0, end_unix_nano=1_000_000_000,
                status=StatusCode.UNSET, attributes={})
    shards = [Span(trace_id=bytes(16), span_id=(i + 2).to_bytes(8, "big"), parent_span_id=root.span_id,
                   service="index", host=None, name=f"shard-{i}", kind=SpanKind.CLIENT, start_unix_nano=i * 1000,
                   end_unix_nano=500_000_000 + (400_000_000 if i == 999 else i), status=StatusCode.UNSET,
                   attributes={}) for i in range(1000)]
    w = layout([root, *shards])
    items, hidden = w.shown(400)
    assert len(items) == 400 and hidden == 601
    assert [i.span.name for i in items if i.on_path] == ["POST /search", "shard-999"]
    assert items[1].span.name == "shard-0"  # then the rest in order


def test_the_trace_page_folds_repeated_spans_until_asked(site: CollectorThread):
    # Sent now, stamped in the first minute of the data: stored as a late trace, counted in no window.
    trace_id = "5e" * 16
    send(site.http_endpoint, [("traces", encode_spans(long_trace(bytes.fromhex(trace_id), (START_S + 10) * NS))
                               .SerializeToString())])
    folded = get(site.api, f"/ui/traces/{trace_id}").text
    # The waterfall, its 14 spans that stand alone, and one row for 993 decode steps with their sampling spans.
    assert folded.count('id="span-') == 1 + 15 and "decode_step <span class=\"times\">&times; 993</span>" in folded
    expand = re.search(r'href="/ui/traces/(?:5e)+\?expand=([0-9a-f]{16})#span-\1"', folded)
    assert expand, "the folded row links to its unfolded members"
    unfolded = get(site.api, f"/ui/traces/{trace_id}?expand={expand.group(1)}").text
    assert unfolded.count('id="span-') == 1 + 2001  # the waterfall; 14 spans, the open group and its 1,986 spans
    assert unfolded.count("<details") == 2001


def test_an_open_spike_comes_first_on_the_overview(tmp_path: Path):
    sc = scenarios()[0]
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'open.db'}")) as collector:
        # Up to 25 s into the fault: the spike is open by then (one window plus the lateness).
        send(collector.http_endpoint, scenario_requests(sc)[:2 * (int(sc.onset_s) + 25)])
        # ... and its causes re-ranked by the windows sent after its first minute (the detection process judges
        # a few commits behind what was acknowledged).
        wait_json(f"{collector.api}/api/v1/spikes",
                  lambda body: any(s["causes"] and s["causes"][0]["summary"].startswith("GPU utilization (GPU-2) fell")
                                   for s in body["spikes"]),
                  what="a spike to open, its top cause the GPU's utilization", state="open")
        page = get(collector.api, "/ui/").text
    open_section = page.split("<h2>Streams now</h2>")[0]
    assert "No spike is open" not in open_section and "GPU utilization (GPU-2) fell" in html.unescape(open_section)
    streams = rows_of(page, "streams")
    spiking = [r for r in streams if r.endswith("open spike")]
    assert spiking and streams[:len(spiking)] == spiking  # the streams with an open spike lead the table
    assert any(r.startswith("gateway POST /v1/predict") for r in spiking)


def test_the_spike_page_lists_the_streams_the_spike_moved(site: CollectorThread, data: SpikeData):
    spike = data.gpu_spike
    assert len(spike["affected_streams"]) >= 2
    page = html.unescape(get(site.api, f"/ui/spikes/{spike['id']}").text)
    assert "Streams it moved" in page
    for stream in spike["affected_streams"]:
        caller = f"{stream['peer_service']} → " if stream["peer_service"] else ""
        assert f"{caller}{stream['service']} <b>{stream['operation']}</b>" in page, stream
