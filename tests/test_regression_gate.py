"""``spikehound compare`` end to end: OpenTelemetry SDK services -> a real collector -> REST API -> exit code.

The services are ``tests.support.serving_stack``: real SDK tracers and OTLP/gRPC
exporters, with latencies from a seeded model (see its docstring for why not
``time.sleep``). Version B adds 15 ms to preprocessing for 5 % of requests, so
its p99 grows while its median does not.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.api_client import ApiClient, request
from harness.daemons import CollectorProcess, CollectorThread
from tests.support.cli import NS, spikehound, unix
from tests.support.serving_stack import Latency, VersionedStack, drive

SLOWER = Latency().slower_preprocessing(fraction=0.05, extra_ms=15.0)






def window(since: int, until: int) -> list[str]:
    return ["--since", unix(since), "--until", unix(until)]


def versions_a_and_slower_b(collector: CollectorProcess, a: str, b: str, requests: int, seed: int) -> tuple[int, int]:
    """Version ``a`` and, side by side, version ``b`` with the slower preprocessing tail."""
    return drive([VersionedStack(collector.grpc_endpoint, a, seed=seed),
                  VersionedStack(collector.grpc_endpoint, b, seed=seed + 1, latency=SLOWER)], requests)


def compare_cli(collector: CollectorProcess, baseline: str, candidate: str, since: int, until: int,
                *extra: str) -> subprocess.CompletedProcess[str]:
    return spikehound("compare", "--api", collector.api, "--baseline", baseline, "--candidate", candidate,
                      *window(since, until), *extra)


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    workdir = tmp_path_factory.mktemp("gate")
    collector = CollectorProcess(f"sqlite:///{workdir / 'spikehound.db'}", workdir).start()
    yield collector
    collector.terminate()


@pytest.mark.slow
def test_a_slower_preprocessing_tail_fails_the_gate_and_names_the_span(gate: CollectorProcess, tmp_path: Path):
    since, until = versions_a_and_slower_b(gate, "1.4.2", "1.5.0", 800, seed=1)

    table = compare_cli(gate, "1.4.2", "1.5.0", since, until)
    assert table.returncode == 1, table.stdout + table.stderr
    assert "p99 regression in 2 operations" in table.stdout
    assert "gateway POST /v1/predict: p99" in table.stdout
    assert "the span that grew: preprocess: preprocess" in table.stdout

    report = json.loads(compare_cli(gate, "1.4.2", "1.5.0", since, until, "--format", "json").stdout)
    gateway = next(op for op in report["operations"] if op["service"] == "gateway")
    assert gateway["regression"] and gateway["grew"]["name"] == "preprocess"
    assert 10 < gateway["grew"]["p99_growth_ms"] < 20  # the 15 ms that was added
    lo, hi = gateway["delta"]["p50"]["ms_ci"]
    assert lo <= 0.0 <= hi  # the median did not move
    model = next(op for op in report["operations"] if op["service"] == "model-server")
    assert model["judged"] and not model["regression"]
    assert report["baseline"]["selector"] == "1.4.2" and report["candidate"]["path_traces"] == 800

    # The same comparison against a saved baseline.
    saved = tmp_path / "baseline.json"
    assert spikehound("baseline", "save", "--api", gate.api, "--select", "1.4.2", "-o", str(saved),
                      *window(since, until)).returncode == 0
    from_file = spikehound("compare", "--api", gate.api, "--baseline-file", str(saved), "--candidate", "1.5.0",
                           "--format", "json", *window(since, until))
    assert from_file.returncode == 1
    assert json.loads(from_file.stdout)["operations"] == report["operations"]


@pytest.mark.slow
def test_identical_versions_pass_in_at_least_19_of_20_seeded_runs(gate: CollectorProcess):
    """The false-failure check. Every run is fresh traffic: version A and version C (the same build) each send
    400 requests drawn with that run's seeds, and the comparison's bootstrap takes the run's seed too."""
    exits = []
    for run in range(20):
        since, until = drive([VersionedStack(gate.grpc_endpoint, f"a-{run}", seed=1000 + run),
                              VersionedStack(gate.grpc_endpoint, f"c-{run}", seed=2000 + run)], 400)
        body = ApiClient(gate.api, timeout=60).get_json(
            "/api/v1/compare", baseline=f"a-{run}", candidate=f"c-{run}", since=unix(since), until=unix(until),
            seed=str(run))
        assert [op["judged"] for op in body["operations"]] == [True, True, True]
        exits.append(body["exit_code"])
    assert exits.count(0) >= 19, exits
    assert set(exits) <= {0, 1}


def test_a_tiny_sample_exits_2_and_says_why(gate: CollectorProcess):
    since, until = versions_a_and_slower_b(gate, "tiny-a", "tiny-b", 20, seed=5)
    result = compare_cli(gate, "tiny-a", "tiny-b", since, until)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "too little data to judge" in result.stdout
    assert "the baseline has 20 requests and the candidate has 20 requests, fewer than 100" in result.stdout

    nothing = compare_cli(gate, "tiny-a", "9.9.9", since, until)
    assert nothing.returncode == 2
    assert "no requests match the candidate (9.9.9)" in nothing.stdout


def test_when_compare_cannot_run_it_exits_3_with_the_reason(gate: CollectorProcess, tmp_path: Path):
    bad = spikehound("compare", "--api", gate.api, "--baseline", "a..b", "--candidate", "1.0")
    assert bad.returncode == 3 and "baseline: 'a' is neither RFC 3339 nor unix seconds" in bad.stderr
    closed = spikehound("compare", "--api", "http://127.0.0.1:9", "--baseline", "1.0", "--candidate", "1.1")
    assert closed.returncode == 3 and "cannot reach the collector API" in closed.stderr
    (tmp_path / "junk.json").write_text('{"format": "something else"}')
    junk = spikehound("compare", "--api", gate.api, "--baseline-file", str(tmp_path / "junk.json"),
                      "--candidate", "1.0")
    assert junk.returncode == 3 and "not a spikehound latency profile" in junk.stderr
    assert spikehound("compare", "--api", gate.api, "--candidate", "1.0").returncode == 3


@pytest.mark.parametrize(("query", "needle"), [
    ("candidate=1.0", "baseline is required"),
    ("baseline=1.0&candidate==x", "candidate: '=x': a selection by attribute is KEY=VALUE"),
    ("baseline=1.0&candidate=2.0&max_regression=lots", "max_regression must be a number"),
    ("baseline=1.0&candidate=2.0&min_requests=0", "min_requests must be a whole number"),
    ("baseline=1700000100..1700000000&candidate=2.0", "start must be before its end"),
])
def test_bad_compare_requests_say_what_is_wrong(gate: CollectorProcess, query: str, needle: str):
    r = request("GET", f"{gate.api}/api/v1/compare?{query}")
    assert r.status_code == 400 and needle in r.json()["error"]


def test_compare_by_time_window_on_each_database(collector: CollectorThread):
    """Before and after a deploy of the same label, chosen by time window; SQLite and PostgreSQL."""
    before = drive([VersionedStack(collector.grpc_endpoint, "same", seed=7)], 300, start_ns=time.time_ns() - 10 * NS)
    after = drive([VersionedStack(collector.grpc_endpoint, "same", seed=8, latency=SLOWER)], 300, start_ns=before[1])
    body = ApiClient(collector.api, timeout=60).get_json(
        "/api/v1/compare", baseline=f"{unix(before[0])}..{unix(before[1])}",
        candidate=f"{unix(after[0])}..{unix(after[1])}")
    assert body["exit_code"] == 1, body["message"]
    gateway = next(op for op in body["operations"] if op["service"] == "gateway")
    assert gateway["baseline"]["count"] == gateway["candidate"]["count"] == 300
    assert gateway["grew"]["label"] == "preprocess: preprocess"


def test_answers_match_the_openapi_document(gate: CollectorProcess):
    since, until = versions_a_and_slower_b(gate, "doc-a", "doc-b", 150, seed=30)
    api = ApiClient(gate.api, timeout=60)  # holds each answer to the operation's schema in the served document
    window_params = {"since": unix(since), "until": unix(until)}
    for path, params in (
            ("/api/v1/compare", {"baseline": "doc-a", "candidate": "doc-b"}),
            ("/api/v1/profile", {"select": "doc-a"}),
            ("/api/v1/analyze/pipeline", {"service": "gateway", "select": "doc-b"}),
            ("/api/v1/analyze/batching", {"service": "model-server", "p99_target": "50"})):
        body = api.get_json(path, **params, **window_params)  # raises unless 200 and valid against the schema
        assert body, f"{path} answered an empty document"
