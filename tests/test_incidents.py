"""Incidents: one spike per fault however many streams it moves; evidence combined, counted once, corrected.

The rules on their own (spikehound/detectors/incidents.py), then the whole engine on generated microservice traces:
a delay in front of a sparse service, a stall, a pause, two faults at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.incidents import Group, IncidentBook, incident_onset
from spikehound.detectors.sequential import SequentialEvidence, SlowRequest
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.stream_judge import Judgement
from spikehound.detectors.streams import StreamKey
from spikehound.model import Span, SpanKind, StatusCode

NS = 1_000_000_000
MS = 1_000_000
T0 = 1_767_225_600 * NS


# --- the rules --------------------------------------------------------------------------------------------

def _judgement(stream: StreamKey, root: bool = False, evidence: float = 0.0) -> Judgement:
    return Judgement(stream=stream, root=root, window_start_ns=T0, window_end_ns=T0 + 10 * NS, count=0, p99_ns=0,
                     baseline_ns=10 * MS, score=0.0, dense=False, elevated=False, evidence=evidence, samples=[],
                     judged=[], onset_ns=T0, hot=True)


def _group(locus: str, slow: dict[StreamKey, list[tuple[int, float, float]]], roots: set[StreamKey] = frozenset(),
           standing: set[StreamKey] = frozenset()) -> tuple[Group, dict[StreamKey, SequentialEvidence]]:
    """A group whose streams saw ``slow`` requests: (trace, gain, end second) each; the ``standing`` ones had
    no request in the window, their evidence stood from earlier ones."""
    group, evidence = Group(locus), {}
    for stream, requests in slow.items():
        e = evidence[stream] = SequentialEvidence()
        j = _judgement(stream, stream in roots, sum(g for _, g, _ in requests))
        j.standing = stream in standing
        for trace, gain, end_s in requests:
            e.slow.append(SlowRequest(trace.to_bytes(16, "big"), b"s" * 8, 2 * NS, T0 + int(end_s * NS), T0, gain))
            group.add(j, trace.to_bytes(16, "big"), gain, T0 + int(end_s * NS), 2 * NS)
    return group, evidence


ROUTE = StreamKey("gateway", "HTTP POST /api/v1/preserve")
HOP = StreamKey("ts-order", "GET /orders/{id}", "ts-preserve")
ENTRY = StreamKey("ts-order", "GET /orders/{id}")


def test_two_slow_requests_far_over_normal_open_a_spike_and_one_does_not():
    book = IncidentBook(DetectionSettings())
    one, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0)]})
    assert book.step([one], evidence.get, streams=10, now_ns=T0 + 40 * NS) == []
    two, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (event,) = book.step([two], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    assert event.kind == "opened" and event.incident.lead == HOP and event.incident.evidence == 6.2


def test_a_sparse_leads_p99_counts_the_slow_requests_that_opened_the_spike():
    # The window that opened it held none of them (they ended in earlier windows): its p99 is still theirs.
    book = IncidentBook(DetectionSettings())
    group, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (event,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    lead = event.incident.members[event.incident.lead]
    assert lead.peak_p99_ns == 2 * NS > lead.baseline_ns


def test_slow_requests_within_their_streams_normal_p99_open_no_spike():
    # Evidence from slow requests that all stayed within their stream's normal p99 (a route whose tail is
    # seconds long) is no p99 spike: the soak paged one whose lead read "p99 1112 ms against 1113 ms".
    book = IncidentBook(DetectionSettings())
    group, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})  # two calls of 2 s
    group.members[HOP].baseline_ns = 3 * NS
    assert book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS) == []
    group.members[HOP].baseline_ns = 10 * MS
    (event,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    assert event.kind == "opened"


def test_a_slow_request_counts_once_however_many_streams_it_slowed():
    book = IncidentBook(DetectionSettings())
    # The same two traces slowed the route, the hop into the service and the service's own stream: still
    # only two slow requests, 6.2 of evidence, not 18.6.
    group, evidence = _group("ts-order", {s: [(1, 3.1, 30.0), (2, 3.1, 45.0)] for s in (ROUTE, HOP, ENTRY)},
                             roots={ROUTE})
    (event,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    assert event.incident.evidence == 6.2
    # The most user-facing stream leads; the others are affected streams with their own numbers.
    assert event.incident.lead == ROUTE and set(event.incident.members) == {ROUTE, HOP, ENTRY}


def test_weak_streams_add_up_to_one_strong_spike():
    book = IncidentBook(DetectionSettings())
    streams = [StreamKey("ts-food", f"GET /op{i}") for i in range(5)]
    # Each stream alone: one slow request, under the bar. Five of them, five different traces: a spike.
    for stream in streams:
        alone, evidence = _group("ts-food", {stream: [(streams.index(stream), 1.3, 10.0 * streams.index(stream))]})
        assert IncidentBook(DetectionSettings()).step([alone], evidence.get, 10, T0 + 60 * NS) == []
    together, evidence = _group("ts-food", {s: [(i, 1.3, 10.0 * i)] for i, s in enumerate(streams)})
    (event,) = book.step([together], evidence.get, streams=10, now_ns=T0 + 60 * NS)
    assert event.kind == "opened" and len(event.incident.members) == 5


def test_standing_evidence_of_another_route_completes_a_sparse_fault_but_sets_no_onset():
    # A service of a few calls a minute: its fault slowed one call of one route at 30 s, then two of another
    # that were in flight together (ending at 92 s and 93.5 s, 2 s each): one pause could have caught both.
    fresh, evidence = _group("ts-order", {HOP: [(2, 3.1, 92.0), (3, 3.1, 93.5)]})
    assert IncidentBook(DetectionSettings()).step([fresh], evidence.get, 10, T0 + 100 * NS) == []
    both, evidence = _group("ts-order", {ENTRY: [(1, 3.1, 30.0)], HOP: [(2, 3.1, 92.0), (3, 3.1, 93.5)]},
                            standing={ENTRY})
    (event,) = IncidentBook(DetectionSettings()).step([both], evidence.get, 10, T0 + 100 * NS)
    assert event.kind == "opened" and event.incident.evidence == 6.2
    # The rise is dated by the streams that turned hot now: a stray among the standing evidence is no onset.
    assert event.incident.start_ns == T0 + 90 * NS


def test_standing_evidence_that_normal_calls_through_its_place_tested_since_opens_nothing():
    # The soak's false spike in a load drop: a lone stall on one route into ts-order at 30 s, a route with no
    # call since, and 46 s later a lone stall on another route into it. Met, they were a spike. But the second
    # route had six normal calls through ts-order in between: a fault there would have slowed them.
    def stalls(calm_ends_s: list[float]) -> tuple[Group, dict[StreamKey, SequentialEvidence]]:
        group, evidence = _group("ts-order", {ENTRY: [(1, 3.1, 30.0)], HOP: [(2, 3.1, 76.0)]}, standing={ENTRY})
        for end_s in calm_ends_s:
            evidence[HOP]._calm(T0 + int(end_s * NS), -0.45)  # normal: its sum stood at zero
        return group, evidence

    group, evidence = stalls([])
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 80 * NS)
    assert event.kind == "opened" and event.incident.evidence == 6.2
    group, evidence = stalls([40.0, 45.0, 50.0, 60.0, 65.0, 70.0])
    assert IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 80 * NS) == []
    # Calls before the first stall tested nothing it said.
    group, evidence = stalls([5.0, 10.0, 15.0, 20.0, 25.0, 28.0])
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 80 * NS)
    assert event.kind == "opened" and event.incident.evidence == 6.2
    # And they take away the standing evidence only, never what the fresh streams say on their own.
    group, evidence = _group("ts-order", {ENTRY: [(1, 3.1, 30.0)], HOP: [(2, 3.1, 74.0), (3, 3.1, 76.0)]},
                             standing={ENTRY})
    for end_s in range(35, 75, 5):  # eight: 3.6 taken away from 9.3, where the fresh streams alone say 6.2
        evidence[HOP]._calm(T0 + int(end_s * NS), -0.45)
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 80 * NS)
    assert event.kind == "opened" and event.incident.evidence == 6.2


def test_a_stream_that_turned_hot_on_one_old_stray_does_not_date_a_fault_whose_evidence_stood():
    # The fault's calls at 160-175 s built evidence on two streams before this window; the stream that turned
    # hot now did so on its only slow call, a stall at 60 s. The spike begins with the fault's run.
    group, evidence = _group("ts-order", {ENTRY: [(1, 3.1, 160.0), (2, 3.1, 170.0)], HOP: [(3, 3.1, 175.0)],
                                          ROUTE: [(4, 3.1, 60.0)]}, standing={ENTRY, HOP})
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 180 * NS)
    assert event.kind == "opened" and event.incident.start_ns == T0 + 160 * NS


def test_looking_back_at_standing_evidence_pays_for_it_like_judging_more_streams():
    # A lone 3 s stall that crossed three streams half a minute ago, and one tail request (1 in 1,500) now.
    # Both fresh, 5.3 of evidence is enough among 190 streams judged (bar 5.28); met by looking back at three
    # standing streams, three more chances for a stray to meet this one, it is not (bar 5.88).
    stall = {s: [(1, 3.1, 7.0)] for s in (ROUTE, ENTRY, StreamKey("gateway", "GET /*"))}
    fresh, evidence = _group("ts-order", {**stall, HOP: [(2, 2.2, 27.0)]})
    assert IncidentBook(DetectionSettings()).step([fresh], evidence.get, 190, T0 + 30 * NS)
    looked_back, evidence = _group("ts-order", {**stall, HOP: [(2, 2.2, 27.0)]}, standing=set(stall))
    assert IncidentBook(DetectionSettings()).step([looked_back], evidence.get, 190, T0 + 30 * NS) == []


def test_a_stall_a_minute_before_does_not_make_chance_requests_elsewhere_a_spike():
    # The soak's false spike in a load drop: a 5 s stall on the admin route at 30 s, whose evidence its few
    # calls since had not worn down, then four requests just past their streams' p99 at 90-104 s, each on
    # another stream through the same place. Those four say 3.9, under the bar; the stall is not their run.
    stall = {s: [(1, 3.1, 30.0)] for s in (ROUTE, ENTRY)}
    weak = {StreamKey("ts-station", f"GET /op{i}", "ts-order"): [(2 + i, gain, end_s)]
            for i, (gain, end_s) in enumerate(((1.0, 90.0), (1.2, 95.0), (0.8, 100.0), (0.9, 104.0)))}
    group, evidence = _group("ts-order", {**stall, **weak})
    assert IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 110 * NS) == []
    # The same slow call on streams that had no call since still stands for its place (paid for as above).
    group, evidence = _group("ts-order", {**stall, **weak}, standing=set(stall))
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 110 * NS)
    assert event.kind == "opened" and event.incident.evidence == 7.0
    # And a stream of one call a minute whose next call is slow again carries its first one (a fault's pace).
    group, evidence = _group("ts-order", {ENTRY: [(1, 3.1, 30.0), (2, 3.1, 113.0)]})
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 120 * NS)
    assert event.kind == "opened" and event.incident.evidence == 6.2


def test_the_bar_rises_with_the_number_of_streams_judged():
    group, evidence = _group("ts-order", {HOP: [(1, 2.4, 30.0), (2, 2.4, 45.0)]})  # 4.8 of evidence
    assert IncidentBook(DetectionSettings()).step([group], evidence.get, 10, T0 + 50 * NS)
    group, evidence = _group("ts-order", {HOP: [(1, 2.4, 30.0), (2, 2.4, 45.0)]})
    # Judging 100 streams, ten times the chances: the same evidence must be ten times as unlikely.
    assert IncidentBook(DetectionSettings()).step([group], evidence.get, 100, T0 + 50 * NS) == []


def test_slow_requests_that_all_ended_at_once_are_one_stall_not_a_spike():
    book = IncidentBook(DetectionSettings())
    # A pause of a couple of seconds releases every request it held at once.
    group, evidence = _group("ts-order", {HOP: [(i, 3.1, 30.0 + 0.1 * i) for i in range(6)]})
    assert book.step([group], evidence.get, streams=10, now_ns=T0 + 40 * NS) == []


def test_requests_in_flight_together_are_one_stall_whenever_each_ended():
    """A pause holds every request in flight through it; its callers then finish when they finish."""
    def three(duration_s: float) -> tuple[Group, dict[StreamKey, SequentialEvidence]]:
        group, evidence = Group("ts-order"), {HOP: SequentialEvidence()}
        j = _judgement(HOP, evidence=9.3)
        for i in range(3):
            trace, end = bytes([i + 1]) * 16, T0 + int((30.0 + 8.0 * i) * NS)
            evidence[HOP].slow.append(SlowRequest(trace, b"s" * 8, int(duration_s * NS), end, T0, 3.1))
            group.add(j, trace, 3.1, end, int(duration_s * NS))
        return group, evidence

    held, evidence = three(duration_s=20.0)  # all three in flight from 26 s to 30 s
    assert IncidentBook(DetectionSettings()).step([held], evidence.get, streams=10, now_ns=T0 + 60 * NS) == []
    apart, evidence = three(duration_s=2.0)  # the same ends, each in flight alone: three slow requests
    (event,) = IncidentBook(DetectionSettings()).step([apart], evidence.get, streams=10, now_ns=T0 + 60 * NS)
    assert event.kind == "opened" and event.incident.evidence == 9.3


def test_slow_requests_seconds_apart_each_in_flight_alone_are_a_fault_not_a_pause():
    # Recurrence seed 404's CPU fault on ts-consign-service: three calls of 0.6 s, each slowed on its own, ended
    # within 7 s of each other. No pause could have held them (none was in flight with another): three slow
    # requests, found at once instead of on a fourth two minutes later.
    group, evidence = Group("ts-consign"), {HOP: SequentialEvidence()}
    j = _judgement(HOP, evidence=9.3)
    for i, end_s in enumerate((60.6, 63.0, 67.2)):
        trace, end = bytes([i + 1]) * 16, T0 + int(end_s * NS)
        evidence[HOP].slow.append(SlowRequest(trace, b"s" * 8, int(0.6 * NS), end, T0, 3.1))
        group.add(j, trace, 3.1, end, int(0.6 * NS))
    (event,) = IncidentBook(DetectionSettings()).step([group], evidence.get, streams=10, now_ns=T0 + 70 * NS)
    assert event.kind == "opened" and event.incident.evidence == 9.3


def test_a_lone_slow_request_on_the_path_of_an_open_spike_stays_apart_and_more_join_it():
    book = IncidentBook(DetectionSettings())
    first, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)], ENTRY: [(1, 1.0, 30.0)]})
    (opened,) = book.step([first], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    # One slow request of the same entry stream whose time was added elsewhere (a stall there): no part of it.
    lone, evidence = _group("ts-payment", {ENTRY: [(7, 3.1, 55.0)]})
    assert book.step([lone], evidence.get, streams=10, now_ns=T0 + 60 * NS) == []
    assert "ts-payment" not in opened.incident.loci
    # Two, attributed next door (the same fault, seen from a neighbour): they extend it.
    more, evidence = _group("ts-payment", {ENTRY: [(8, 3.1, 62.0), (9, 3.1, 68.0)]})
    (event,) = book.step([more], evidence.get, streams=10, now_ns=T0 + 70 * NS)
    assert event.kind == "updated" and event.incident is opened.incident


def test_calls_into_a_spikes_place_from_callers_it_never_slowed_are_no_sign_its_fault_is_over():
    """A delay on one caller's own network slows only its calls: the callee answering others at its usual
    pace says nothing of it. The caller's own calls, normal again, do."""
    engine = DetectionEngine(DetectionSettings())
    slowed, other = StreamKey("ts-order", "GET /orders/{id}", "ts-payment"), HOP
    group, evidence = _group("ts-order", {slowed: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (opened,) = engine.incidents.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    recovery = opened.incident.recovery

    def normal_calls(stream: StreamKey, first_trace: int) -> Judgement:
        j = _judgement(stream)
        j.scored = [(0.2, (12 * MS, (first_trace + i).to_bytes(16, "big"), b"s" * 8, T0 + (52 + i) * NS))
                    for i in range(5)]
        return j

    engine._watch_ends([normal_calls(other, 100)])
    assert (recovery.value, recovery.calm_run) == (0.0, 0)
    engine._watch_ends([normal_calls(slowed, 200)])
    assert recovery.calm_run == 5 and recovery.value > 1.0


def _calls(first_trace: int, slow: list[bool], at_s: float, stream: StreamKey = HOP
           ) -> list[tuple[int, bytes, bool, int, StreamKey]]:
    """Requests through a spike's locus, one a second from ``at_s``: (end, trace, slow, window end, stream)."""
    window, out = 10 * NS, []
    for i, is_slow in enumerate(slow):
        end = T0 + int((at_s + i) * NS)
        out.append((end, (first_trace + i).to_bytes(16, "big"), is_slow, end - end % window + window, stream))
    return out


def test_a_fault_that_lets_a_few_calls_through_stays_one_spike_and_a_stray_slow_call_moves_nothing():
    book = IncidentBook(DetectionSettings())
    group, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (opened,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    incident = opened.incident
    book.observe(incident, _calls(100, [False] * 4, 51))
    assert book.resolve(T0 + 55 * NS) == [] and incident.end_ns is None  # over, held
    assert book.hold_ns(incident) == 3 * (54 - 30) * NS // 5  # three typical gaps of its requests (30-54 s: 6)
    # The fault was letting calls through: two slow ones in the hold, and it is the same spike, still open.
    book.observe(incident, _calls(200, [True, True], 61))
    book.observe(incident, _calls(300, [False] * 6, 63))
    held_from = T0 + 70 * NS
    assert book.resolve(held_from) == [] and book.open_count == 1
    # A lone stray slow call in the next hold neither cancels it nor moves the end.
    book.observe(incident, _calls(400, [True], 72))
    book.observe(incident, _calls(500, [False] * 6, 73))
    hold = book.hold_ns(incident)
    assert book.resolve(held_from + hold - NS) == []
    (resolved,) = book.resolve(held_from + hold)
    assert resolved.incident is incident
    assert incident.end_ns == T0 + 70 * NS  # the window of the last slow calls before the hold


def test_normal_calls_of_a_route_the_fault_barely_slows_say_little_toward_its_end():
    """A CPU fault slows every call of one route and one in three of another: three normal calls of the second
    in a row are common while the fault lasts, and must not end its spike."""
    book = IncidentBook(DetectionSettings())
    group, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (opened,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    incident = opened.incident
    book.observe(incident, _calls(100, [True] * 6, 50))
    book.observe(incident, _calls(200, [i % 3 == 0 for i in range(12)], 56, ROUTE))
    before = incident.recovery.value
    book.observe(incident, _calls(300, [False] * 3, 70, ROUTE))
    assert incident.recovery.value - before < 1.0
    # The same three through the place it slowed every time say the fault is over.
    book.observe(incident, _calls(400, [False] * 3, 75))
    assert incident.recovery.value >= DetectionSettings().end_evidence


def test_a_group_with_the_locus_of_an_open_incident_extends_it():
    book = IncidentBook(DetectionSettings())
    group, evidence = _group("ts-order", {HOP: [(1, 3.1, 30.0), (2, 3.1, 45.0)]})
    (opened,) = book.step([group], evidence.get, streams=10, now_ns=T0 + 50 * NS)
    later, more = _group("ts-order", {ROUTE: [(3, 3.1, 55.0)]}, roots={ROUTE})
    (updated,) = book.step([later], more.get, streams=10, now_ns=T0 + 60 * NS)
    assert updated.kind == "updated" and updated.incident is opened.incident
    # It joins as an affected stream; the leader and the id the alerts carry stay.
    assert opened.incident.lead == HOP and ROUTE in opened.incident.members and book.open_count == 1


def test_the_onset_is_where_slow_requests_began_to_come_not_a_stray_one_before():
    window = 10 * NS
    # A run every few seconds, a stray stall half a minute before it: the run's start.
    run = [T0 + (95 + 2 * k) * NS for k in range(6)]
    assert incident_onset([T0 + 68 * NS, *run], window) == T0 + 90 * NS
    # A sparse run every twenty seconds, a stray two minutes before it: still the run's start ...
    sparse = [T0 + (200 + 20 * k) * NS for k in range(4)]
    assert incident_onset([T0 + 75 * NS, *sparse], window) == T0 + 200 * NS
    # ... but one that comes at the run's own pace is part of it.
    assert incident_onset([T0 + 175 * NS, *sparse], window) == T0 + 170 * NS
    assert incident_onset([T0 + 95 * NS, T0 + 107 * NS], window) == T0 + 90 * NS


def test_a_weak_slow_request_just_before_a_run_of_far_slower_ones_is_not_its_onset():
    window = 10 * NS
    # A sparse run (every 10-40 s) whose lead only just passed the bar: timing alone would date it from there.
    ends = [T0 + 13 * NS, T0 + 53 * NS, T0 + 64 * NS, T0 + 90 * NS]
    assert incident_onset(ends, window) == T0 + 10 * NS
    assert incident_onset(ends, window, [0.8, 3.1, 3.1, 3.1]) == T0 + 50 * NS
    # A lead as telling as the rest is the run's start, and so is one a fault slowed less than its peers.
    assert incident_onset(ends, window, [3.1, 3.1, 3.1, 3.1]) == T0 + 10 * NS
    assert incident_onset(ends, window, [1.8, 3.1, 3.1, 3.1]) == T0 + 10 * NS
    # Never past the newest: a run that is all weak keeps its own start.
    assert incident_onset(ends, window, [0.6, 0.7, 0.6, 0.7]) == T0 + 10 * NS


# --- the engine on microservice traces -------------------------------------------------------------------

class _Mesh:
    """A gateway calling a few services; each call is a CLIENT span and the callee's SERVER span."""

    ROUTES = {"POST /book": ["ts-order", "ts-pay"], "GET /search": ["ts-travel"], "GET /orders": ["ts-order"]}
    # With ``database``: these services query one database that has no spans of its own (CLIENT spans only).
    QUERIES = {"ts-order": "SELECT orders", "ts-travel": "SELECT trips"}
    DATABASE = {"db.system": "postgresql", "server.address": "orders-db"}

    def __init__(self, seed: int = 1, database: bool = False) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1
        self.database = database

    def _span(self, trace: bytes, parent: bytes | None, service: str, name: str, kind: SpanKind, start: int,
              end: int) -> Span:
        self.next_id += 1
        return Span(trace_id=trace, span_id=self.next_id.to_bytes(8, "big"), parent_span_id=parent,
                    service=service, host=f"node-{service}", name=name, kind=kind, start_unix_nano=start,
                    end_unix_nano=end, status=StatusCode.UNSET, attributes={})

    def request(self, start: int, route: str, delay_into: dict[str, int] | None = None,
                stall: int = 0) -> list[Span]:
        """One user request; ``delay_into`` adds ns in front of a service (its callers' CLIENT spans only)."""
        rng, delay_into = self.rng, delay_into or {}
        trace = rng.getrandbits(128).to_bytes(16, "big")
        root = self._span(trace, None, "gateway", f"HTTP {route.split()[0]}", SpanKind.SERVER, start, 0)
        root.attributes["http.route"] = route.split()[1]
        spans, t = [root], start + MS
        for callee in self.ROUTES[route]:
            client = self._span(trace, root.span_id, "gateway", "HTTP GET", SpanKind.CLIENT, t, 0)
            work = int(rng.lognormvariate(3.0, 0.3) * MS) + stall
            server = self._span(trace, client.span_id, callee, f"GET /{callee}", SpanKind.SERVER, t + MS,
                                t + MS + work)
            if self.database and callee in self.QUERIES:
                query_ns = int(rng.lognormvariate(1.5, 0.3) * MS) + delay_into.get("orders-db", 0)
                query = self._span(trace, server.span_id, callee, self.QUERIES[callee], SpanKind.CLIENT,
                                   t + 2 * MS, t + 2 * MS + query_ns)
                query.attributes.update(self.DATABASE)
                server.end_unix_nano += query_ns
                spans.append(query)
            client.end_unix_nano = server.end_unix_nano + MS + delay_into.get(callee, 0)
            spans += [client, server]
            t, stall = client.end_unix_nano + MS, 0
        root.end_unix_nano = t + MS
        return spans


def _through_engine(seconds: int, spans_at: Callable[[int], list[Span]]) -> dict[str, object]:
    """``spans_at(second)`` for each second through one engine, as the collector feeds it; the spikes by id."""
    engine, spikes = DetectionEngine(DetectionSettings()), {}
    for second in range(seconds):
        engine.add(spans_at(second))
        spikes.update((s.id, s) for s in engine.advance().spikes)
    spikes.update((s.id, s) for s in engine.flush().spikes)
    return spikes


def _run(minutes: int, per_minute: float, fault: tuple[int, int, str, int] | None = None,
         stall_at: tuple[int, ...] = (), pause_at: int | None = None, database: bool = False,
         churn: float = 0.0) -> dict[str, object]:
    """Minutes of traffic second by second through one engine; ``fault`` = (from s, to s, service, ns);
    ``churn``: the share of requests whose route is a name never seen before (a badly templated route)."""
    mesh, rng = _Mesh(database=database), random.Random(7)

    def spans_at(second: int) -> list[Span]:
        spans: list[Span] = []
        arrivals = [rng.random() for _ in range(10) if rng.random() < per_minute / 600]
        if pause_at is not None and pause_at <= second < pause_at + 2:
            arrivals += [0.1 * i for i in range(4)]
        for offset in arrivals:
            start = T0 + second * NS + int(offset * NS)
            route = rng.choice(list(_Mesh.ROUTES))
            delay = {fault[2]: fault[3]} if fault and fault[0] <= second < fault[1] else None
            stall = 3 * NS if second in stall_at else 0
            if pause_at is not None and pause_at <= second < pause_at + 2:
                stall = T0 + (pause_at + 2) * NS - start  # everyone in the paused service waits until it resumes
            request = mesh.request(start, route, delay, stall)
            if rng.random() < churn:
                request[0].attributes["http.route"] += f"/~{rng.getrandbits(32):08x}"
            spans += request
        return spans

    return _through_engine(minutes * 60, spans_at)


def test_a_delay_in_front_of_a_sparse_service_opens_one_spike_naming_the_hop_into_it():
    # ts-pay is called by one route of three, a few times a minute; from minute 20 every call into it waits
    # 1.5 s in front of it (its own SERVER spans do not grow).
    onset, end = 20 * 60, 24 * 60
    spikes = _run(26, per_minute=9, fault=(onset, end, "ts-pay", 1_500 * MS))
    assert len(spikes) == 1, [(s.service, s.operation) for s in spikes.values()]
    (spike,) = spikes.values()
    top = spike.causes[0]
    assert (top.kind.value, top.service, top.peer_service) == ("network", "ts-pay", "gateway")
    assert 0 <= (spike.detected_unix_nano - (T0 + onset * NS)) / NS <= 120
    assert T0 + (onset - 10) * NS <= spike.start_unix_nano <= T0 + (onset + 60) * NS
    # It was found on the route that reaches it and on the hop into it: one spike, both streams listed.
    assert {(a.service, a.peer_service) for a in spike.affected} >= {("ts-pay", "gateway"), ("gateway", None)}
    assert spike.state == "resolved"


def test_routes_named_once_that_carried_a_faults_slow_requests_are_not_listed_as_rising_from_nothing():
    # One request in five goes to a route never seen before (an id templated into it): some of them are slow
    # ones of the fault. They have no normal p99 to rise from, so the spike lists only streams that have one.
    onset, end = 20 * 60, 24 * 60
    spikes = _run(26, per_minute=9, fault=(onset, end, "ts-pay", 1_500 * MS), churn=0.2)
    assert len(spikes) == 1, [(s.service, s.operation) for s in spikes.values()]
    (spike,) = spikes.values()
    assert spike.causes[0].service == "ts-pay"
    assert {(a.service, a.peer_service) for a in spike.affected} >= {("ts-pay", "gateway"), ("gateway", None)}
    assert all(a.baseline_p99_ns > 0 for a in spike.affected), [
        (a.operation, a.baseline_p99_ns) for a in spike.affected if not a.baseline_p99_ns]


def test_a_slow_database_that_two_services_query_is_one_spike_named_by_its_address():
    # Nobody answers the queries (the database has no spans): each caller's hop is named by what its CLIENT
    # spans say they called. Both name orders-db, so the fault is one incident, not one per caller.
    onset, end = 20 * 60, 24 * 60
    spikes = _run(26, per_minute=9, fault=(onset, end, "orders-db", 1_000 * MS), database=True)
    assert len(spikes) == 1, [(s.service, s.operation, s.peer_service) for s in spikes.values()]
    (spike,) = spikes.values()
    hops = {(a.service, a.operation, a.peer_service) for a in spike.affected if a.peer_service is not None}
    assert hops >= {("orders-db", "SELECT orders", "ts-order"), ("orders-db", "SELECT trips", "ts-travel")}
    assert spike.causes and spike.causes[0].service in {"ts-order", "ts-travel"}, spike.causes
    assert "SELECT" in (spike.causes[0].operation or ""), spike.causes


def test_calm_lumpy_traffic_with_lone_stalls_and_a_pause_opens_nothing():
    stalls = tuple(range(300, 1500, 137))  # a request stalls 3 s every couple of minutes
    assert _run(26, per_minute=9, stall_at=stalls, pause_at=16 * 60) == {}


def test_a_route_that_barely_moved_still_leads_and_the_spike_is_explained_from_it():
    # A slow route (450 ms) calling a fast service (5 ms) that becomes 25 ms: the service's streams rise five
    # times over, the route by 4 %, too little to be judged a rise. The route still leads (it is what users
    # called), and the causes are read from its traces.
    rng = random.Random(3)
    engine, spikes, mesh = DetectionEngine(DetectionSettings()), {}, _Mesh()
    for second in range(8 * 60):
        spans: list[Span] = []
        for i in range(20):
            start = T0 + second * NS + i * NS // 20
            trace = rng.getrandbits(128).to_bytes(16, "big")
            root = mesh._span(trace, None, "gateway", "POST /render", SpanKind.SERVER, start, 0)
            work = int(rng.lognormvariate(0, 0.05) * (25 if second >= 6 * 60 else 5) * MS)
            client = mesh._span(trace, root.span_id, "gateway", "HTTP GET", SpanKind.CLIENT, start + 450 * MS, 0)
            server = mesh._span(trace, client.span_id, "ts-fonts", "GET /font", SpanKind.SERVER,
                                start + 451 * MS, start + 451 * MS + work)
            client.end_unix_nano = server.end_unix_nano + MS
            root.end_unix_nano = client.end_unix_nano + MS
            spans += [root, client, server]
        engine.add(spans)
        spikes.update((s.id, s) for s in engine.advance().spikes)
    (spike,) = spikes.values()
    assert (spike.service, spike.operation) == ("gateway", "POST /render")
    assert spike.causes and spike.causes[0].service == "ts-fonts", spike.causes
    assert {(a.service, a.peer_service) for a in spike.affected} >= {("ts-fonts", None), ("ts-fonts", "gateway")}


def _busy(pause_at: int | None = None, fault_at: int | None = None, seconds: int = 8 * 60,
          seed: int = 5) -> dict[str, object]:
    """Twenty requests a second; ``pause_at``: ts-order stops for 3 s (each call in it then waits until it
    resumes); ``fault_at``: calls into ts-order take 300 ms more for a minute."""
    mesh, rng = _Mesh(seed), random.Random(seed)

    def spans_at(second: int) -> list[Span]:
        spans: list[Span] = []
        for i in range(20):
            start = T0 + second * NS + i * NS // 20 + rng.randrange(NS // 40)
            route = rng.choice(list(_Mesh.ROUTES))
            stall = 0
            if pause_at is not None and pause_at <= second < pause_at + 3 and "ts-order" in _Mesh.ROUTES[route]:
                stall = T0 + (pause_at + 3) * NS - start
            delay = {"ts-order": 300 * MS} if fault_at is not None and fault_at <= second < fault_at + 60 else None
            spans += mesh.request(start, route, delay, stall)
        return spans

    return _through_engine(seconds, spans_at)


def test_a_pause_on_busy_routes_opens_nothing_though_tail_requests_elsewhere_in_its_window_widen_it():
    # The pause holds some sixty requests, all released at once; the window test fires on them, and a few
    # requests just over the learned p99 end seconds apart from them in the same window. They are the
    # normal tail, not a sustained rise.
    for seed, pause_at in ((2, 361), (3, 423)):  # two of the pauses whose tails opened a spike before
        assert _busy(pause_at, seconds=pause_at + 60, seed=seed) == {}
    # The same traffic with a fault of one minute: one spike, found within its first windows.
    (spike,) = _busy(fault_at=6 * 60).values()
    assert spike.start_unix_nano - T0 <= 6 * 60 * NS + 20 * NS


def _netem(seconds: int = 8 * 60, fault_at: int = 6 * 60, seed: int = 4) -> dict[str, object]:
    """Twenty requests a second; half book through ts-pay, which asks ts-config for its settings. From
    ``fault_at`` for two minutes ts-pay's own network adds 400 ms each way: calls into it and its call out."""
    mesh, rng = _Mesh(seed), random.Random(seed)

    def spans_at(second: int) -> list[Span]:
        spans: list[Span] = []
        net = 400 * MS if fault_at <= second < fault_at + 120 else 0
        for i in range(20):
            start = T0 + second * NS + i * NS // 20 + rng.randrange(NS // 40)
            trace = rng.getrandbits(128).to_bytes(16, "big")
            book = i % 2 == 0
            root = mesh._span(trace, None, "gateway", "HTTP POST" if book else "HTTP GET", SpanKind.SERVER, start, 0)
            root.attributes["http.route"] = "/book" if book else "/search"
            callee, op = ("ts-pay", "POST /pay") if book else ("ts-travel", "GET /trips")
            client = mesh._span(trace, root.span_id, "gateway", "HTTP POST", SpanKind.CLIENT, start + MS, 0)
            t = start + 2 * MS + (net if book else 0)
            server = mesh._span(trace, client.span_id, callee, op, SpanKind.SERVER, t, 0)
            t += int(rng.lognormvariate(2.0, 0.3) * MS)
            spans += [root, client, server]
            if book:
                ask = mesh._span(trace, server.span_id, "ts-pay", "HTTP GET", SpanKind.CLIENT, t, 0)
                answer = mesh._span(trace, ask.span_id, "ts-config", "GET /config", SpanKind.SERVER, t + MS + net,
                                    t + MS + net + int(rng.lognormvariate(1.5, 0.3) * MS))
                ask.end_unix_nano = answer.end_unix_nano + MS
                t = ask.end_unix_nano + MS
                spans += [ask, answer]
            server.end_unix_nano = t
            client.end_unix_nano = t + MS + (net if book else 0)
            root.end_unix_nano = client.end_unix_nano + MS
        return spans

    return _through_engine(seconds, spans_at)


def test_a_slowed_network_read_from_its_route_and_from_its_busy_hop_out_is_one_spike():
    # The routes' slow requests point to ts-pay's network; its hop to ts-config, judged by windows, to that
    # hop (ts-config, called by ts-pay). The hop links the two places, as it does for sparse streams.
    spikes = _netem()
    assert len(spikes) == 1, [(s.service, s.operation, s.peer_service, s.causes[:1]) for s in spikes.values()]


def test_a_resource_flag_where_the_slow_requests_ran_completes_weak_evidence_but_never_one_request():
    # A CPU fault of a few hundred ms on a route of a few calls a minute: two slow calls, each a little over
    # the normal ones, fall short of the bar; the host's CPU gone busy while they ran says as much as one more.
    asked: list[str] = []

    def flagged(group: Group) -> float:
        asked.append(group.locus)
        return 3.1

    weak, evidence = _group("ts-order", {HOP: [(1, 1.2, 30.0), (2, 1.2, 75.0)]})
    assert IncidentBook(DetectionSettings()).step([weak], evidence.get, 10, T0 + 80 * NS) == []
    (event,) = IncidentBook(DetectionSettings()).step([weak], evidence.get, 10, T0 + 80 * NS, flagged)
    assert event.kind == "opened" and event.incident.evidence == 5.5 and asked == ["ts-order"]
    # One slow request, however slow, with the flag: a lone stall on a busy host is still no spike.
    lone, evidence = _group("ts-order", {HOP: [(3, 3.1, 30.0)]})
    assert IncidentBook(DetectionSettings()).step([lone], evidence.get, 10, T0 + 40 * NS, flagged) == []
    # Evidence enough without it: the flag is not asked for.
    asked.clear()
    strong, evidence = _group("ts-order", {HOP: [(4, 3.1, 30.0), (5, 3.1, 45.0)]})
    (event,) = IncidentBook(DetectionSettings()).step([strong], evidence.get, 10, T0 + 50 * NS, flagged)
    assert event.incident.evidence == 6.2 and asked == []
