"""Sparse microservice traffic through a running collector: a delayed edge is one spike naming the hop, and
calm, lumpy traffic with lone stalls is no spike at all.

The traffic is the mesh generator's (harness/scenarios/mesh_traffic.py): about 45 user requests a minute through one
gateway with a generic entry name and ~40 services, many of them called a few times a minute, sent as real
OTLP/HTTP requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.daemons import CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.mesh_traffic import MeshFault, MeshTimeline, reach

pytestmark = pytest.mark.slow

NS = 1_000_000_000
TARGET = "ts-assurance-service"  # reached by about one user request in eleven: a few calls a minute


def _spikes(timeline: MeshTimeline, tmp_path: Path, timeout: float = 60) -> list[dict[str, Any]]:
    """Send the timeline; the spikes once detection has settled: no window open and every judged window written
    (``harness.daemons.detection_settled``)."""
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}")) as collector:
        send(collector.http_endpoint, scenario_requests(timeline))
        return collector.spikes_once_settled(timeout, done=lambda _: True)


def test_a_delay_in_front_of_a_sparse_service_is_one_spike_naming_the_hop_into_it(tmp_path: Path):
    assert 0.05 < reach()[TARGET] < 0.15
    onset = 22 * 60.0
    fault = MeshFault("delay", TARGET, onset_s=onset, duration_s=210.0, size_ms=1500.0)
    timeline = MeshTimeline(seed=41, hours=0.5, faults=[fault])
    spikes = _spikes(timeline, tmp_path)

    assert len(spikes) == 1, [(s["service"], s["operation"], s["start"]) for s in spikes]
    (spike,) = spikes
    top = spike["causes"][0]
    # The time was added in front of the service: the hop into it, not the callers that waited, nor the
    # service's own spans (which did not grow).
    assert (top["kind"], top["service"]) == ("network", TARGET), top
    moved = spike["affected_streams"]
    assert any(a["service"] == TARGET and a["peer_service"] for a in moved), moved
    assert spike["state"] == "resolved"


def test_calm_lumpy_traffic_with_lone_stalls_and_pauses_opens_no_spike(tmp_path: Path):
    # Four times the usual share of lone multi-second stalls, service pauses, a generic "/*" entry name.
    timeline = MeshTimeline(seed=42, hours=0.5, faults=[], stall_rate=1 / 100, generic_name="/*")
    assert _spikes(timeline, tmp_path) == []


def test_a_paused_service_holds_a_request_until_it_resumes_and_only_once():
    """The generator's calm pauses (a GC, a stalled disk): a call that reaches the service while it is paused
    waits until it resumes, then does its usual work; the work after its own calls began when those ended, and
    waits no more (a call into a service paused for 2.9 s once lasted 5.6 s: the wait was counted twice)."""
    timeline = MeshTimeline(seed=42, hours=1000 / 3600, faults=[], rate_per_min=600, stall_rate=0.0)
    start, length, service = next(p for p in timeline.pauses if p[2] == "ts-station-service")
    spans = [s for batch in timeline.batches() for s in batch.spans
             if s.service == service and s.kind.name == "SERVER"]
    resumed_ns = timeline.start_ns + int((start + length) * NS)
    paused_from_ns = timeline.start_ns + int(start * NS)
    calm = sorted(s.end_unix_nano - s.start_unix_nano for s in spans if s.end_unix_nano < paused_from_ns)
    held = [s for s in spans if paused_from_ns <= s.start_unix_nano < resumed_ns]
    assert len(held) >= 5 and len(calm) > 1000
    # Each held call ends after the pause, within its service's calm work (skew of a few ms aside) after it.
    longest_calm_ns = calm[-1]
    for s in held:
        assert resumed_ns - 50_000_000 <= s.end_unix_nano <= resumed_ns + longest_calm_ns, s
