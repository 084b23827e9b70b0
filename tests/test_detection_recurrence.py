"""A fault that comes back is a new spike, and a spike ends about when its fault does.

The pieces (the evidence toward normal that ends a spike, what is kept from learning) are tested on their own;
then sparse microservice traffic (harness/scenarios/mesh_traffic.py: ~45 user requests a minute, the target
service sees about four calls a minute) runs through the engine, and once over OTLP through a running collector
that pages a webhook, in event time, so minutes of traffic take seconds.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from harness.daemons import AgentProcess, CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.mesh_traffic import MeshFault, MeshTimeline, reach
from harness.waiting import eventually
from spikehound.collector.alerts.routing import Router
from spikehound.config import AlertsConfig, ReceiverConfig, RouteConfig
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.sequential import RecoveryEvidence
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.stream_judge import StreamJudge
from spikehound.detectors.streams import StreamKey
from spikehound.model import LatencyWindow, Spike
from tests.support.alert_receivers import HookReceiver
from tests.support.alert_spikes import ended, spike

NS = 1_000_000_000
TARGET = "ts-assurance-service"  # reached by about one user request in eleven: about four calls a minute
ONSET = 20 * 60.0
LENGTH = 210.0
GAP = 180.0


def _returning(seed: int = 41) -> MeshTimeline:
    first = MeshFault("delay", TARGET, onset_s=ONSET, duration_s=LENGTH, size_ms=1500.0)
    again = MeshFault("delay", TARGET, onset_s=ONSET + LENGTH + GAP, duration_s=LENGTH, size_ms=1500.0)
    return MeshTimeline(seed=seed, hours=0.6, faults=[first, again])


def _through_engine(timeline: MeshTimeline) -> list[Spike]:
    engine = DetectionEngine(DetectionSettings())
    spikes: dict[str, Spike] = {}
    for batch in timeline.batches():
        engine.add(batch.spans, batch.points)
        spikes.update((s.id, s) for s in engine.advance().spikes)
    return sorted(spikes.values(), key=lambda s: s.start_unix_nano)


# -- the pieces ---------------------------------------------------------------------------------------------

def test_normal_requests_after_a_fault_end_it_within_a_few_and_a_fault_rarely_looks_over():
    fault = RecoveryEvidence()
    for i in range(40):
        fault.update_one(True, i, i + 1)
    steps = 0
    while fault.value < DetectionSettings().end_evidence:
        steps += 1
        fault.update_one(False, 100 + steps, 110)
    assert steps <= 4
    assert fault.last_slow_ns == 40  # the end is the last slow request's window, not when it was decided

    # Under a fault that slows 95 % of requests, 5,000 requests give no run of evidence that ends it early
    # more than a handful of times: each ends a spike that would reopen at once.
    rng = random.Random(7)
    ongoing, early = RecoveryEvidence(), 0
    for i in range(5_000):
        if ongoing.update_one(rng.random() < 0.95, i, i) >= DetectionSettings().end_evidence:
            early += 1
            ongoing.value = 0.0
    assert early <= 3


def test_normal_requests_that_ended_before_the_faults_slow_ones_do_not_end_its_spike():
    # Chaos seed 304: a spike opened on three slow calls, then the rest of its first window came in: six normal
    # calls that had ended before the first slow one. Counted toward the end, they ended it at once, and the
    # fault's next calls opened a second spike for one fault. They were before the fault, not after it.
    r = RecoveryEvidence()
    for end in (45, 49, 49):
        r.update_one(True, end, 50, ("route",))
    for end in (35, 35, 36, 39, 42, 42):
        r.update_one(False, end, 50, ("route",))
    assert r.value == 0.0 and r.calm_run == 0 and r.requests == 3
    for end in (55, 58, 61):  # normal calls after the slow ones: the fault is over
        r.update_one(False, end, 60, ("route",))
    assert r.value >= DetectionSettings().end_evidence


def test_a_calm_busy_window_counts_for_half_the_end_and_an_elevated_one_starts_it_again():
    r = RecoveryEvidence()
    settings = DetectionSettings()
    weight = settings.end_evidence / settings.resolve_windows
    r.update_window(False, 10, weight)
    r.update_window(True, 20, weight)
    assert (r.value, r.last_slow_ns) == (0.0, 20)
    r.update_window(False, 30, weight)
    r.update_window(False, 40, weight)
    assert r.value >= settings.end_evidence and r.last_slow_ns == 20


def test_requests_of_a_spike_and_of_the_minute_before_it_are_not_learned():
    judge = StreamJudge(DetectionSettings())
    started = {b"straggler": 95 * NS}
    judge.trace_start = started.get
    judge.quarantine = [(100 * NS - 60 * NS, 200 * NS)]  # a spike from 100 s to 200 s
    before = (1 * NS, b"early", b"s", 30 * NS)  # ended before the minute before the onset: learnable
    lead_up = (1 * NS, b"lead", b"s", 50 * NS)  # the minute before the onset
    during = (5 * NS, b"fault", b"s", 150 * NS)
    straggler = (1 * NS, b"straggler", b"s", 230 * NS)  # began at 229 s, but its trace began during the spike
    after = (1 * NS, b"late", b"s", 230 * NS)
    assert judge.unclaimed([before, lead_up, during, straggler, after]) == [before, after]
    judge.quarantine = [(40 * NS, None)]  # still open: everything since is its
    assert judge.unclaimed([before, after]) == [before]
    assert judge.unclaimed([before, after], ended_only=True) == [before, after]


def _window(judge: StreamJudge, start_s: int, durations_ms: list[int]) -> None:
    """One closed window of a sparse hop, judged and settled with no spike of its own."""
    samples = [(d * 1_000_000, f"t{start_s}-{i}".encode(), b"s", start_s * NS + NS) for i, d in enumerate(durations_ms)]
    window = LatencyWindow(service="notify", operation="POST /notify", start_unix_nano=start_s * NS,
                           end_unix_nano=(start_s + 10) * NS, count=len(samples), p50_ns=0, p95_ns=0,
                           p99_ns=max(d for d, *_ in samples), max_ns=max(d for d, *_ in samples),
                           peer_service="cancel", samples=tuple(sorted(samples)))
    judge.settle(judge.judge(window), None)


def test_a_stream_too_new_to_judge_does_not_learn_a_fault_that_a_spike_elsewhere_claimed():
    # A sparse hop, 8 calls learned, not warm yet (12): calls of 1.8 and 1.7 s stand out from its 70-80 ms (two:
    # the baseline of a pool this small is its second slowest call, which one stall cannot set).
    settings = DetectionSettings()
    claimed, unclaimed = StreamJudge(settings), StreamJudge(settings)
    for judge in (claimed, unclaimed):
        for minute in range(8):
            _window(judge, minute * 60, [70 + minute % 10])
        _window(judge, 1000, [1800])
        _window(judge, 1010, [1700])
    # A spike elsewhere opened at 1020 s (its quarantine takes the minute before); the other judge saw none.
    claimed.quarantine = [(960 * NS, 1300 * NS)]
    for judge in (claimed, unclaimed):
        for start in range(1060, 1400, 60):  # calm calls until the held one is due
            _window(judge, start, [75])
    assert claimed.baseline_ns(StreamKey("notify", "POST /notify", "cancel")) < 100_000_000  # dropped
    assert unclaimed.baseline_ns(StreamKey("notify", "POST /notify", "cancel")) == 1_700_000_000  # a real tail


def test_a_stream_too_new_to_judge_drops_a_cluster_of_slow_requests_but_learns_a_lasting_shift():
    judge = StreamJudge(DetectionSettings())
    key = StreamKey("notify", "POST /notify", "cancel")
    for minute in range(4):  # not warm yet (12 learned)
        _window(judge, minute * 60, [70 + minute % 10])
    # A fault nobody could judge: a slow call every 40 s for three minutes, then calm calls.
    for start in range(1000, 1180, 40):
        _window(judge, start, [1800])
    for start in range(1200, 1380, 60):  # 7 learned
        _window(judge, start, [75])
    assert judge.baseline_ns(key) < 100_000_000  # none of the cluster was learned
    # A lasting shift (a slower release) is learned once it has stood out for 20 minutes.
    for start in range(1500, 1500 + 40 * 60, 60):
        _window(judge, start, [900])
    assert judge.baseline_ns(key) == 900_000_000


def test_a_sparse_streams_slow_call_stands_as_evidence_for_two_minutes_while_it_has_no_calls():
    settings = DetectionSettings()
    judge = StreamJudge(settings)
    key = StreamKey("notify", "POST /notify", "cancel")
    for minute in range(40):  # warm: 40 calls of 70-80 ms, one a minute
        _window(judge, minute * 60, [70 + minute % 10])
    _window(judge, 2400, [1800])  # one slow call
    (standing,) = judge.standing(set(), 2460 * NS, 2470 * NS)
    assert standing.stream == key and standing.standing and standing.hot and standing.count == 0
    assert standing.p99_ns == 1_800_000_000 and standing.evidence >= settings.hot_evidence
    assert judge.standing({key}, 2460 * NS, 2470 * NS) == []  # judged in this window: not standing
    # Past standing_ns after the slow call (it ended at 2401 s), it stands for nothing any more.
    assert judge.standing(set(), 2520 * NS, 2530 * NS) == []
    # Normal calls take its evidence back down: nothing stands.
    for start in range(2410, 2460, 10):
        _window(judge, start, [75])
    assert judge.standing(set(), 2460 * NS, 2470 * NS) == []


def test_each_return_of_a_fault_is_a_new_firing_message_even_within_the_resolve_wait():
    now = [1_800_000_000.0]
    router = Router(AlertsConfig(receivers=[ReceiverConfig(name="oncall", url="http://127.0.0.1:9/")],
                                 routes=[RouteConfig(receiver="oncall", name="oncall", resolve_wait_seconds=600)]),
                    clock=lambda: now[0])
    first = spike(0, start_s=0)
    again = replace(spike(1, start_s=300), recurrence_of=first.id, occurrence=2,
                    first_start_unix_nano=first.start_unix_nano)
    told = []
    for step in ([first], [ended(first, 200)], [again]):
        router.observe(step)
        told += [(n.status, [a.spike.id for a in n.alerts], n.alerts[0].annotations["summary"])
                 for n in router.evaluate().notifications]
        now[0] += 60
    assert [(status, ids) for status, ids, _ in told] == [("firing", [first.id]), ("firing", [again.id])]
    assert told[-1][2].endswith(", 2nd time in 5 min")


# -- through the engine ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_fault_that_returns_after_three_minutes_is_a_second_spike_linked_to_the_first():
    timeline = _returning()
    spikes = [s for s in _through_engine(timeline) if s.causes and s.causes[0].service == TARGET]
    assert len(spikes) == 2, [(s.id, s.start_unix_nano, s.end_unix_nano) for s in spikes]
    first, again = spikes
    t0 = timeline.start_ns
    first_end = t0 + int((ONSET + LENGTH) * NS)
    again_onset = t0 + int((ONSET + LENGTH + GAP) * NS)
    # The first ended within a minute (and a window) of its fault, before the fault came back ...
    assert first.state == "resolved" and first.end_unix_nano is not None
    assert abs(first.end_unix_nano - first_end) <= 70 * NS
    # ... and the return opened its own spike, as fast as the first time, linked to the first.
    assert again_onset - 10 * NS <= again.start_unix_nano <= again_onset + 60 * NS
    assert again.detected_unix_nano is not None and first.detected_unix_nano is not None
    first_delay = first.detected_unix_nano - (t0 + int(ONSET * NS))
    assert again.detected_unix_nano - again_onset <= first_delay + 30 * NS
    assert (again.recurrence_of, again.occurrence) == (first.id, 2)
    assert (first.recurrence_of, first.occurrence) == (None, 1)
    # Every spike is led by a stream whose p99 rose.
    assert all(s.p99_ns > s.baseline_p99_ns for s in spikes)


@pytest.mark.slow
def test_a_long_fault_is_one_spike_for_its_whole_length_with_the_same_cause():
    fault = MeshFault("delay", TARGET, onset_s=ONSET, duration_s=25 * 60.0, size_ms=1500.0)
    timeline = MeshTimeline(seed=43, hours=0.85, faults=[fault])
    spikes = _through_engine(timeline)
    assert len(spikes) == 1, [(s.id, s.start_unix_nano, s.end_unix_nano) for s in spikes]
    (spike,) = spikes
    assert spike.causes[0].service == TARGET
    assert spike.end_unix_nano is not None
    assert abs(spike.end_unix_nano - (timeline.start_ns + int((ONSET + fault.duration_s) * NS))) <= 70 * NS


# -- through a running collector ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sparse_fault_returning_after_three_minutes_opens_two_spikes_and_pages_twice(tmp_path: Path):
    assert 2 <= reach()[TARGET] * 45 <= 6
    timeline = _returning()
    with HookReceiver() as hook:
        cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                               alerts__receivers=[{"name": "pager", "url": hook.url}],
                               alerts__routes=[{"receiver": "pager", "resolve_wait_seconds": 0}])
        with CollectorThread(cfg) as collector:
            send(collector.http_endpoint, scenario_requests(timeline))
            spikes = collector.spikes_once_settled(60, done=lambda found: len(found) >= 2)
            ours = [s for s in spikes if s["causes"] and s["causes"][0]["service"] == TARGET]
            assert len(ours) == 2, [(s["id"], s["start"], s.get("end")) for s in spikes]

            def firing() -> list[str] | None:
                pages = [a["annotations"]["spike_id"] for e in hook.events.values()
                         if e.json["status"] == "firing" for a in e.json["alerts"] if a["status"] == "firing"]
                found = sorted(set(pages) & {s["id"] for s in ours})
                return found if len(found) == 2 else None

            assert eventually(firing, "a firing page for each spike", timeout=60) == sorted(s["id"] for s in ours)


@pytest.mark.slow
def test_with_an_agent_sending_host_metrics_and_spans_stopped_the_last_windows_close_and_the_spike_ends(
        tmp_path: Path):
    fault = MeshFault("delay", TARGET, onset_s=ONSET, duration_s=LENGTH, size_ms=1500.0)
    timeline = MeshTimeline(seed=41, hours=(ONSET + LENGTH + 150) / 3600, faults=[fault])
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}")) as collector:
        agent = AgentProcess(collector.grpc_endpoint, tmp_path, interval=0.2,
                             env={"SPIKEHOUND_AGENT_HOST_NAME": "idle-host"}).start()
        try:
            # The agent's host metrics arrive all along, more often than the idle flush would wait for.
            eventually(lambda: collector.metric("spikehound_ingest_stored_total", signal="metrics") > 0 or None,
                       "the agent's first metrics", timeout=30)
            send(collector.http_endpoint, scenario_requests(timeline))
            spikes = collector.spikes_once_settled(
                60, done=lambda found: bool(found) and all(s["state"] == "resolved" for s in found))
            assert agent.running
        finally:
            agent.kill()
    ours = [s for s in spikes if s["causes"] and s["causes"][0]["service"] == TARGET]
    assert len(ours) == 1 and ours[0]["state"] == "resolved", spikes
