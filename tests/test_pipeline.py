"""``spikehound analyze pipeline``: where the time goes, for median requests and for p99 requests.

The stack of ``tests.support.serving_stack`` with preprocessing that is quick (1 ms)
except for 3 % of requests, where image decode and resize take 40 ms more; the
forward pass takes 8 ms. The median request spends most of its time in the
model; the p99 request spends most of it in preprocessing.
"""

from __future__ import annotations

import pytest

from harness.api_client import ApiClient
from harness.daemons import CollectorThread
from spikehound.detectors.breakdown import pipeline_breakdown
from spikehound.detectors.path_time import Stage
from tests.support.cli import spikehound, unix
from tests.support.serving_stack import Latency, VersionedStack, drive

TAIL_HEAVY = Latency(preprocess_ms=1.0, forward_ms=8.0, stall_fraction=0.0, slow_fraction=0.03, slow_extra_ms=40.0)


@pytest.fixture
def tail_heavy(sqlite_collector: CollectorThread) -> tuple[CollectorThread, int, int]:
    since, until = drive([VersionedStack(sqlite_collector.grpc_endpoint, "3.1", seed=9, latency=TAIL_HEAVY)], 600)
    return sqlite_collector, since, until


def test_preprocessing_dominates_the_p99_breakdown_but_not_the_median(tail_heavy):
    collector, since, until = tail_heavy
    body = ApiClient(collector.api, timeout=60).get_json(
        "/api/v1/analyze/pipeline", service="gateway", since=unix(since), until=unix(until))
    (op,) = body["operations"]
    assert (op["operation"], op["requests"]) == ("POST /v1/predict", 600)
    stages = {s["label"]: s for s in op["stages"]}
    pre, forward = stages["preprocess: preprocess"], stages["model-server: forward"]

    assert op["stages"][0]["label"] == "preprocess: preprocess"  # ranked by p99 share
    assert pre["p99"]["share"] > 0.6 and pre["median"]["share"] < 0.15
    assert forward["median"]["share"] > 0.6 and forward["p99"]["share"] < 0.3
    assert max(op["stages"], key=lambda s: s["median"]["share"])["label"] == "model-server: forward"
    assert sum(s["p99"]["share"] for s in op["stages"]) == pytest.approx(1.0)
    network = [s for s in op["stages"] if s["kind"] == "network"]
    assert {s["peer_service"] for s in network} == {"gateway"}
    services = {s["service"]: s for s in op["services"]}
    assert set(services) == {"gateway", "preprocess", "model-server", "network"}
    assert services["preprocess"]["p99"]["share"] > 0.6
    assert op["headline"].startswith("p99 requests (7, from ")
    assert "in preprocess: preprocess (median requests: " in op["headline"]
    assert op["headline"].endswith("in model-server: forward")


def test_the_cli_shows_it_at_a_glance(tail_heavy):
    collector, since, until = tail_heavy
    out = spikehound("analyze", "pipeline", "--api", collector.api, "--service", "gateway", "--since", unix(since),
                     "--until", unix(until))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("p99 requests (7, from ") and "in preprocess: preprocess" in lines[1]
    first_stage = lines[4]
    assert first_stage.startswith("preprocess: preprocess") and "#" * 12 in first_stage


def test_the_median_and_p99_groups():
    fast, slow = Stage("span", "svc", "fast"), Stage("span", "svc", "slow")
    requests_ = [(10, {fast: 10})] * 199 + [(100, {slow: 100})]
    b = pipeline_breakdown("svc", "op", requests_, min_group=1)
    assert (b.median_count, b.tail_count, b.tail_latency_ns) == (20, 3, (10, 100))
    assert pipeline_breakdown("svc", "op", []) is None
    (only,) = pipeline_breakdown("svc", "op", [(5, {fast: 5})]).stages
    assert only.median_share == only.tail_share == 1.0
