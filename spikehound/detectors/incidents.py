"""Incidents: streams that turn anomalous together for a shared cause are one spike, one page.

Judging hop streams and routes as well as entry operations means many more
streams, and one fault moves several of them: a delay in front of a service
slows every edge into it and every route that reaches it. Each of those is
evidence of the same fault. The engine hands this module **groups**, one per
*locus* (the service where the time was added):

- every slow request of a hot stream (see :mod:`spikehound.detectors.stream_judge`) is
  attributed once, from the widest view that saw it (a trace root's stream
  before a hop's), and its locus is the service of its top cause: the callee
  of a slowed hop, the service of a slowed span. A trace slowed by a lone stall
  in one service and a trace slowed by a fault in another are thereby evidence
  for different things, even on the same route;
- a busy stream whose window test fired joins the locus most of its slow
  requests point to.

A group becomes an **incident** when its evidence is enough: one of its
streams' window test fires (``min_score``, corrected as below), or the
sequential evidence of its slow requests, each trace counted once however many
of the group's streams it slowed, less what the normal requests of those
streams took away, reaches ``min_evidence`` over at least
``min_slow_requests`` stalls (below): the slow traces of its latest run, and the
earlier ones of the streams that carry on (in the run, or standing); a stream
that had normal calls since its only slow one had its say, and standing
evidence is worth what the normal calls of the group's other streams since
left of it. A spike carried by
five weak streams is still one strong spike. A resource flag
(:mod:`spikehound.detectors.resource`: a CPU gone busy, a GPU gone idle) on a
host that served the group's locus while its slow requests ran is one more place saying the same: it adds what
one request at ``max_surprise`` adds (the engine's ``resource_of``), unless an
open spike at another place on that host explains it. A CPU
contention of a few hundred milliseconds on a service of three calls a minute
is then found on its second or third slow call, not its fifth; it never opens
a spike on its own, nor on one slow request.

- Both thresholds grow with ``log10`` of the number of streams being judged (a
  Bonferroni correction: at the same per-stream odds, ten times the streams
  would give ten times the false spikes).
- Slow requests that were all in flight at one instant are one stall, however
  far apart they ended: a pause of a second or three holds every request in
  flight through it, and the slow requests must be ``min_slow_requests``
  stalls (a window test's must not all have ended within ``min_spread_ns``:
  ends of the tail just over the p99 elsewhere in the window do not widen a
  pause, ``stream_judge.slow_spread``).
- A group whose locus has an open incident, or most of whose slow traces an
  open incident already counted as its slow requests, extends it: its streams join as
  *affected streams* with their own numbers instead of paging again. The most
  user-facing stream of the group that opened it leads (trace roots, then other
  entry streams, then hops); the leader and the id are fixed when it opens.
- It ends on evidence that its fault is over (:class:`RecoveryEvidence`, fed
  by the engine with the requests through its locus: a CUSUM toward normal,
  each trace once), or when those requests stopped for ten of their typical
  gaps (``quiet_min_ns`` to ``quiet_max_ns``), and stayed so for three of
  those gaps, a window to ``end_hold_ns`` (a fault that lets a few calls through is one spike; slow
  requests enough to open a spike cancel the end, a lone stray one does not). Its end is
  the end of the window of its last slow request before the hold; its streams
  then start from zero evidence.
- A spike that opens at the place of one that ended within ``recurrence_ns``
  is its **return**: a new spike, with its own onset, causes and page, linked
  to the first of the chain (``recurrence_of``) and numbered (``occurrence``).

>>> from spikehound.detectors.settings import DetectionSettings
>>> book = IncidentBook(DetectionSettings())
>>> book.open_count, spike_id(StreamKey("gateway", "POST /predict"), 1_700_000_000_000_000_000)
(0, 'e9b6cebdb3f417e2')
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from spikehound.detectors.sequential import RecoveryEvidence, SequentialEvidence
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.stream_judge import WEAK_LEAD, Judgement
from spikehound.detectors.streams import StreamKey
from spikehound.detectors.windows import Sample

__all__ = ["Group", "Incident", "IncidentBook", "IncidentEvent", "Member", "spike_id", "stream_rank"]

_REFERENCE_STREAMS = 10  # the thresholds hold as set up to this many streams; beyond, they grow with log10
MAX_SLOW_IDS = 1024  # slow request ids an affected stream keeps to count each once; beyond, they are counted
MAX_SEEN_TRACES = 512  # traces an open incident remembers having judged toward its end (each counts once)
_RUN_GAP = 4  # a gap this many times the typical one (plus a window) ends a run of slow requests


def spike_id(stream: StreamKey, start_ns: int, locus: str | None = None) -> str:
    """A spike's id: stable for the same leading stream, start and locus, so a replay names it as live
    ingest did (two faults that start together on one route are two spikes).

    >>> hop = StreamKey("ts-order", "GET /orders", "ts-preserve")
    >>> spike_id(hop, 1_700_000_000_000_000_000, "ts-order"), spike_id(hop, 1_700_000_000_000_000_000, "ts-db")
    ('828e08552951b5c3', '1e69d2f9fbc1b96e')
    """
    key = f"{stream.service}\0{stream.operation}\0{start_ns}"
    if stream.peer_service is not None:
        key += f"\0{stream.peer_service}"
    if locus is not None and locus != stream.service:
        key += f"\0@{locus}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def stream_rank(stream: StreamKey, root: bool, evidence: float = 0.0) -> tuple[int, float, tuple[str, str, str]]:
    """Lower is more user-facing: trace roots, then other entry streams, then hops; more evidence first."""
    return (0 if root else 2 if stream.is_hop else 1, -evidence, stream.order)


@dataclass(slots=True)
class SlowTrace:
    """One slow request of a group: its trace, what it added to the evidence, when it began and ended."""

    gain: float
    end_ns: int
    start_ns: int


@dataclass(slots=True)
class Group:
    """Everything in one window that points at one locus."""

    locus: str
    members: dict[StreamKey, Judgement] = field(default_factory=dict)  # the streams with slow requests here
    traces: dict[bytes, SlowTrace] = field(default_factory=dict)  # each slow trace once, with its largest gain
    by_stream: dict[StreamKey, set[bytes]] = field(default_factory=dict)  # which stream saw which of them
    dense: list[Judgement] = field(default_factory=list)  # members whose window test fired
    loci: set[str] = field(default_factory=set)  # the services its slow requests were linked to
    slow_ids: set[bytes] = field(default_factory=set)  # every slow trace of the window's group, both tests'

    def add(self, j: Judgement, trace_id: bytes, gain: float, end_ns: int, duration_ns: int) -> None:
        """One slow request of stream ``j.stream`` pointing here."""
        self.members[j.stream] = j
        self.by_stream.setdefault(j.stream, set()).add(trace_id)
        seen = self.traces.get(trace_id)
        if seen is None:
            self.traces[trace_id] = SlowTrace(gain, end_ns, end_ns - duration_ns)
        else:
            # The largest gain any stream saw in it; the call that ended first: the innermost slowed call,
            # nearest the cause (a pause releases every call it held at once, whatever the callers did after).
            seen.gain = max(seen.gain, gain)
            if end_ns < seen.end_ns:
                seen.end_ns, seen.start_ns = end_ns, end_ns - duration_ns

    def add_dense(self, j: Judgement) -> None:
        """A stream whose window test fired with most of its slow requests pointing here."""
        self.members[j.stream] = j
        self.dense.append(j)


@dataclass(slots=True)
class Member:
    """One stream affected by an incident, with its own numbers."""

    stream: StreamKey
    root: bool
    start_ns: int  # where its rise began
    last_anomalous_end_ns: int
    peak_p99_ns: int
    baseline_ns: int
    evidence: float  # the most evidence it showed (-log10 units)
    slow_traces: set[bytes] = field(default_factory=set)  # its slow requests the sequential test counted
    over_baseline: int = 0  # requests over its baseline in the windows its window test fired on
    counted_slow: int = 0  # slow requests counted beyond the set (a long incident keeps MAX_SLOW_IDS ids)

    @property
    def slow_requests(self) -> int:
        return len(self.slow_traces) + self.counted_slow + self.over_baseline

    def add_slow(self, trace_ids: Iterable[bytes]) -> None:
        for trace_id in trace_ids:
            if trace_id in self.slow_traces:
                continue
            if len(self.slow_traces) < MAX_SLOW_IDS:
                self.slow_traces.add(trace_id)
            else:
                self.counted_slow += 1  # a trace past the cap may be counted twice across windows: rare

    @property
    def rank(self) -> tuple[int, float, tuple[str, str, str]]:
        return stream_rank(self.stream, self.root, self.evidence)


@dataclass(slots=True)
class Incident:
    """A spike while it is being detected: its streams, its evidence and its window of time."""

    id: str
    locus: str
    lead: StreamKey
    start_ns: int
    detected_ns: int
    last_anomalous_end_ns: int
    evidence: float  # what opened it (-log10 units)
    members: dict[StreamKey, Member] = field(default_factory=dict)
    loci: set[str] = field(default_factory=set)  # every service its slow requests were linked to
    end_ns: int | None = None
    slowest: Sample | None = None  # the slowest request of the leading stream seen while it was open
    recovery: RecoveryEvidence = field(default_factory=RecoveryEvidence)  # evidence that its fault is over
    seen: dict[bytes, bool] = field(default_factory=dict)  # recent traces judged toward its end: slow or not
    # Recent slow traces of the groups at its own locus (insertion-ordered, MAX_SEEN_TRACES at most): a trace
    # it merely saw slow on a route may owe that to another place (a stall there), and says nothing of it.
    own: dict[bytes, None] = field(default_factory=dict)
    recurrence_of: str | None = None  # the first spike of the chain this one is a return of
    occurrence: int = 1  # 1 for a first spike, 2 for its first return, ...
    first_start_ns: int = 0  # the start of the chain's first spike
    # Since when the evidence has said its fault is over (None while it has not), the end it would have then, and
    # how many slow requests it had counted by then.
    ending_since_ns: int | None = None
    ending_at_ns: int = 0
    ending_slow_before: int = 0

    @property
    def state(self) -> str:
        return "open" if self.end_ns is None else "resolved"

    @property
    def leader(self) -> Member:
        return self.members[self.lead]


@dataclass(slots=True)
class IncidentEvent:
    kind: str  # "opened" | "updated" | "resolved"
    incident: Incident
    judgements: list[Judgement] = field(default_factory=list)  # its streams' hot judgements of this window
    traces: set[bytes] = field(default_factory=set)  # the slow traces of this window that point at it


class IncidentBook:
    """Open incidents by locus, and the rules that open, extend and resolve them; pure, no clock."""

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        self._open: dict[str, Incident] = {}  # by locus
        self.ended: list[Incident] = []  # incidents that ended within recurrence_ns, oldest first

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def open_incidents(self) -> list[Incident]:
        return list(self._open.values())

    def incident_of(self, stream: StreamKey) -> Incident | None:
        """An open incident ``stream`` is affected by (the first opened, when two faults move it)."""
        return next((i for i in self._open.values() if stream in i.members), None)

    def correction(self, streams: int) -> float:
        """What both thresholds add for judging ``streams`` streams at once (-log10 units)."""
        return math.log10(max(streams, _REFERENCE_STREAMS) / _REFERENCE_STREAMS)

    def step(self, groups: Iterable[Group], evidence_of: Callable[[StreamKey], SequentialEvidence | None],
             streams: int, now_ns: int, resource_of: Callable[[Group], float] | None = None) -> list[IncidentEvent]:
        """Judge one window's groups; return the incidents that opened or grew. ``resource_of`` gives the
        evidence resource flags add to a group's (asked only of one whose requests fell short)."""
        events: list[IncidentEvent] = []
        correction = self.correction(streams)
        for group in sorted(groups, key=lambda g: g.locus):
            incident = self._open.get(group.locus)
            if incident is not None:
                _claim(incident, group.traces)
            else:
                # Incidents opened earlier in this step are among the open ones already.
                incident = self._sharing(group) or _same_streams(group, self._open.values(),
                                                                 self.settings.min_slow_requests)
            if incident is not None:
                incident.loci |= group.loci
                for j in group.members.values():
                    self._extend(incident, j, group)
                events.append(IncidentEvent("updated", incident, list(group.members.values()), _slow_of(group)))
                continue
            new = self._try_open(group, evidence_of, correction, now_ns, resource_of)
            if new is not None:
                events.append(IncidentEvent("opened", new, list(group.members.values()), _slow_of(group)))
        return events

    def resolve(self, now_ns: int) -> list[IncidentEvent]:
        """End the incidents whose fault is over (see :meth:`is_over`) and stayed over for :meth:`hold_ns`, as
        of event time ``now_ns``.

        A fault that lets a few calls through now and then is one spike: while the hold lasts, ``min_slow_requests``
        slow requests that take the evidence back under ``end_evidence`` (or a busy window elevated again) cancel
        the end, and a lone stray slow request does not move it.
        """
        s = self.settings
        out = []
        for locus, incident in list(self._open.items()):
            if not self.is_over(incident, now_ns):
                continue
            if incident.ending_since_ns is None:
                incident.ending_since_ns, incident.ending_at_ns = now_ns, incident.last_anomalous_end_ns
                incident.ending_slow_before = incident.recovery.slow
            if now_ns - incident.ending_since_ns < self.hold_ns(incident):
                continue
            incident.end_ns = max(incident.ending_at_ns, incident.start_ns + 1)
            incident.last_anomalous_end_ns = incident.end_ns
            incident.seen.clear()
            incident.own.clear()
            del self._open[locus]
            self.ended.append(incident)
            out.append(IncidentEvent("resolved", incident))
        horizon = now_ns - s.recurrence_ns
        while self.ended and (self.ended[0].end_ns or 0) < horizon:
            self.ended.pop(0)
        return out

    def hold_ns(self, incident: Incident) -> int:
        """How long an incident stays open once its evidence says the fault is over: three of its requests'
        typical gaps, at least a window (a busy stream judged by windows) and at most ``end_hold_ns``."""
        s = self.settings
        gap = incident.recovery.typical_gap_ns()
        return s.window_ns if gap is None else min(max(3 * gap, s.window_ns), s.end_hold_ns)

    def is_over(self, incident: Incident, now_ns: int) -> bool:
        """Enough evidence toward normal, or its requests stopped for ten of their typical gaps."""
        s = self.settings
        recovery = incident.recovery
        if recovery.value >= s.end_evidence:
            return True
        last = recovery.last_seen_ns if recovery.last_seen_ns is not None else incident.detected_ns
        gap = recovery.typical_gap_ns()
        quiet = s.quiet_max_ns if gap is None else min(max(10 * gap, s.quiet_min_ns), s.quiet_max_ns)
        return now_ns - last >= quiet

    def observe(self, incident: Incident, views: list[tuple[int, bytes, bool, int, StreamKey]]) -> None:
        """Requests through ``incident``'s locus, (end, trace id, slow, window end, stream): toward its end or not.

        A trace seen by several of its streams counts once, slow when any of them found it slow, judged by what
        the fault did to the streams it went through (:meth:`RecoveryEvidence.share_of`).
        """
        traces: dict[bytes, tuple[int, bool, int, list[StreamKey]]] = {}
        for end, trace_id, slow, window_end, stream in views:
            seen = traces.get(trace_id)
            if seen is None:
                traces[trace_id] = (end, slow, window_end, [stream])
            else:
                seen[3].append(stream)
                if slow and not seen[1]:
                    traces[trace_id] = (min(seen[0], end), True, window_end, seen[3])
        recovery, seen_before = incident.recovery, incident.seen
        for trace_id, (end, slow, window_end, streams) in sorted(traces.items(), key=lambda kv: kv[1][0]):
            before = seen_before.get(trace_id)
            if before is None or (slow and not before):
                recovery.update_one(slow, end, window_end, streams)
                if slow:
                    self._back(incident)
                seen_before[trace_id] = slow
                if len(seen_before) > MAX_SEEN_TRACES:
                    del seen_before[next(iter(seen_before))]
        incident.last_anomalous_end_ns = max(incident.last_anomalous_end_ns, recovery.last_slow_ns)

    def observe_window(self, incident: Incident, elevated: bool, window_end_ns: int) -> None:
        """A busy window of a stream whose window test fired in ``incident``: still elevated or calm."""
        s = self.settings
        incident.recovery.update_window(elevated, window_end_ns, s.end_evidence / max(s.resolve_windows, 1))
        if elevated:
            self._back(incident)
        incident.last_anomalous_end_ns = max(incident.last_anomalous_end_ns, incident.recovery.last_slow_ns)

    def _back(self, incident: Incident) -> None:
        """After a slow request or an elevated window: a spike whose end is being held is open again when its
        fault came back (slow requests enough to open a spike, the evidence under the end's), not for a stray."""
        s, recovery = self.settings, incident.recovery
        if incident.ending_since_ns is not None and (recovery.value <= 0.0 or (
                recovery.value < s.end_evidence
                and recovery.slow - incident.ending_slow_before >= s.min_slow_requests)):
            incident.ending_since_ns = None

    # -- internals ---------------------------------------------------------

    def _try_open(self, group: Group, evidence_of: Callable[[StreamKey], SequentialEvidence | None],
                  correction: float, now_ns: int,
                  resource_of: Callable[[Group], float] | None = None) -> Incident | None:
        s = self.settings
        # A fifth of a window at most: with windows of 2 s or less, 2 s could never be reached in one window.
        min_spread = min(s.min_spread_ns, s.window_ns // 5)
        dense = [j for j in group.dense if j.score >= s.min_score + correction and j.spread_ns >= min_spread]
        if dense:
            strength = max(j.score for j in dense)
            start = min(j.onset_ns for j in dense)
        else:
            # What opens a spike is the latest run of slow requests and the earlier ones of the streams that
            # carry on: a stream in the run, or one that had no call since (standing, paid for below). A
            # stream whose only slow requests came before the run and that had normal calls since had its say:
            # a lone stall a minute before, whose evidence its few calls (at night, in a load drop) had not yet
            # worn down, would make chance requests on other streams of its place look like a rise.
            if len(group.traces) < s.min_slow_requests:
                return None
            any_j = next(iter(group.members.values()))
            width = any_j.window_end_ns - any_j.window_start_ns
            ends = sorted(t.end_ns for t in group.traces.values())
            run_from = ends[_latest_run(ends, width)]
            carry_on = {t for stream, ids in group.by_stream.items()
                        if group.members[stream].standing or any(group.traces[t].end_ns >= run_from for t in ids)
                        for t in ids}
            traces = {t: slow for t, slow in group.traces.items() if t in carry_on}
            if len(traces) < s.min_slow_requests:
                return None
            stalls = _stalls(traces.values())
            if len(stalls) < s.min_slow_requests:  # one pause holding several requests is one stall
                return None
            counted = [stream for stream, ids in group.by_stream.items() if not ids.isdisjoint(traces)]
            # What the normal requests of the streams whose slow ones count took away, per stream.
            penalties = {stream: e.penalty if (e := evidence_of(stream)) is not None else 0.0 for stream in counted}
            strength = sum(stalls) + sum(penalties.values())
            standing = [stream for stream in counted if group.members[stream].standing]
            if standing:
                strength = _tested_since(group, traces, penalties, standing, evidence_of, strength)
            # Each stream whose evidence stood from earlier requests is one more place a stray could have come
            # from to meet this window's: a Bonferroni term for looking back, as for the streams judged.
            bar = s.min_evidence + correction + math.log10(1 + len(standing))
            if strength < bar and resource_of is not None:
                strength += resource_of(group)
            if strength < bar:
                return None
            # Where the rise began is read from the streams that turned hot now: evidence that stood from
            # earlier requests adds to the strength, and a stray slow request among it is no onset. Nor is it
            # before the latest run of all its slow requests: a stream that turned hot now on one stray
            # minutes ago, beside streams whose evidence stood from the fault, does not date it.
            fresh = {t for stream, ids in group.by_stream.items() if not group.members[stream].standing
                     for t in ids if t in traces}
            start = _run_onset(traces.values(), width)
            if fresh:
                start = max(start, _run_onset([traces[t] for t in fresh], width))
        members = {stream: _member(j, group, start) for stream, j in group.members.items()}
        for stream, member in members.items():
            # A sparse stream's p99 is its slowest request: the slow ones that built its evidence count too,
            # though they ended in earlier windows than the one that opened the spike.
            evidence = evidence_of(stream)
            if evidence is not None and evidence.slow:
                member.peak_p99_ns = max(member.peak_p99_ns, max(r.duration_ns for r in evidence.slow))
        # A p99 spike is one where a stream's p99 rose; the lead is one of those: a number the user reads must
        # make sense. (Evidence whose slow requests all stayed within their streams' normal p99 is not one.)
        rose = [m for m in members.values() if m.peak_p99_ns > m.baseline_ns]
        if not rose:
            return None
        lead = min(rose, key=lambda m: m.rank).stream
        window = s.window_ns
        last_slow = max(j.window_end_ns for j in dense) if dense else ends[-1] - ends[-1] % window + window
        incident = Incident(id=spike_id(lead, start, group.locus), locus=group.locus, lead=lead, start_ns=start,
                            detected_ns=now_ns, evidence=round(strength, 2), last_anomalous_end_ns=last_slow,
                            members=members, loci={group.locus, *group.loci}, first_start_ns=start)
        for trace_id, slow in sorted(group.traces.items(), key=lambda kv: kv[1].end_ns):  # what opened it
            places = [stream for stream, seen in group.by_stream.items() if trace_id in seen]
            incident.recovery.update_one(True, slow.end_ns, slow.end_ns - slow.end_ns % window + window, places)
            incident.seen[trace_id] = True
        _claim(incident, group.traces)
        incident.recovery.last_slow_ns = last_slow
        incident.slowest = _slowest(None, group.members[lead])
        earlier = self._returning(incident)
        if earlier is not None:
            incident.recurrence_of = earlier.recurrence_of or earlier.id
            incident.occurrence = earlier.occurrence + 1
            incident.first_start_ns = earlier.first_start_ns
        self._open[group.locus] = incident
        return incident

    def _sharing(self, group: Group) -> Incident | None:
        """An open incident that already counted most of ``group``'s slow traces as its own slow requests: the
        same fault seen from another place (a caller whose own time its slowed call grew), not a new one."""
        if not group.traces:
            return None
        for incident in self._open.values():
            shared = sum(1 for t in group.traces if t in incident.own)
            if 2 * shared >= len(group.traces):
                return incident
        return None

    def _returning(self, incident: Incident) -> Incident | None:
        """The latest ended incident at ``incident``'s place within ``recurrence_ns`` (None: a first)."""
        for earlier in reversed(self.ended):
            if earlier.end_ns is not None and incident.start_ns - earlier.end_ns > self.settings.recurrence_ns:
                break
            if earlier.locus == incident.locus or earlier.locus in incident.loci or incident.locus in earlier.loci:
                return earlier
        return None

    def _extend(self, incident: Incident, j: Judgement, group: Group) -> None:
        member = incident.members.get(j.stream)
        if member is None:  # joins as an affected stream; the leader (and the alerts keyed on it) stays
            member = incident.members[j.stream] = _member(j, group, incident.start_ns)
        member.add_slow(group.by_stream.get(j.stream, ()))
        if j.dense:
            member.over_baseline += j.exceed
        member.last_anomalous_end_ns = max(member.last_anomalous_end_ns, j.window_end_ns)
        member.peak_p99_ns = max(member.peak_p99_ns, _p99(j))
        member.evidence = max(member.evidence, j.evidence, j.score)
        if j.stream == incident.lead:
            incident.slowest = _slowest(incident.slowest, j)


def _claim(incident: Incident, traces: Iterable[bytes]) -> None:
    """Count ``traces`` among ``incident``'s own slow traces, the oldest forgotten past MAX_SEEN_TRACES."""
    own = incident.own
    for trace_id in traces:
        own[trace_id] = None
    while len(own) > MAX_SEEN_TRACES:
        del own[next(iter(own))]


def _tested_since(group: Group, traces: dict[bytes, SlowTrace], penalties: dict[StreamKey, float],
                  standing: list[StreamKey], evidence_of: Callable[[StreamKey], SequentialEvidence | None],
                  strength: float) -> float:
    """``strength`` less what the normal requests of the group's other streams took away after the standing
    evidence's slow requests, down to what those other streams say alone.

    Standing evidence waited, untested on its own stream (a route with no call since). Its place was not
    untested: a fault there would have slowed the calls that went through it on the other streams meanwhile.
    Two lone stalls 46 s apart on two routes into one service, in a load drop, with normal calls on the second
    route between them, are not a fault; a fault that slows every call through its service leaves no normal
    call between its slow ones. The streams' own evidence cleared those calls (its sum stood at zero), so they
    are counted here, from each stream's latest calm calls (``CALM_KEPT``), per stream as the penalty of their
    excursions is.
    """
    since = min(max(group.traces[t].end_ns for t in group.by_stream[stream] if t in traces) for stream in standing)
    others = [stream for stream in penalties if stream not in standing]  # the counted streams not standing
    tested = sum(e.calm_after(since) for stream in others if (e := evidence_of(stream)) is not None)
    if tested == 0.0:
        return strength
    fresh = {t: traces[t] for stream in others for t in group.by_stream[stream] if t in traces}
    alone = sum(_stalls(fresh.values())) + sum(penalties[stream] for stream in others)
    return max(strength + tested, min(alone, strength))


def _stalls(traces: Iterable[SlowTrace]) -> list[float]:
    """The gain of each stall among slow traces: those that were all in flight at one instant are one stall,
    counted with the largest gain among them.

    A pause (a GC, a stalled disk, a dropped link) holds every request in flight through it, and they are all
    in flight at its last moment, however far apart their callers then finish: one stall, however many
    requests it caught. A fault's slow requests come at the pace of its traffic, each at its own time, a
    few seconds apart on a busy route as much as minutes apart on a quiet one.
    """
    stalls: list[float] = []
    common_end: int | None = None
    for t in sorted(traces, key=lambda t: t.start_ns):
        if common_end is not None and t.start_ns < common_end:  # in flight with all the others so far
            stalls[-1], common_end = max(stalls[-1], t.gain), min(common_end, t.end_ns)
        else:
            stalls.append(t.gain)
            common_end = t.end_ns
    return stalls


def _same_streams(group: Group, near: Iterable[Incident], min_slow_requests: int) -> Incident | None:
    """An open incident whose streams saw ``group``'s slow requests too (a hop or an entry stream, not a
    route: routes carry many faults' requests): one fault whose slow requests were attributed to two
    neighbouring places, not a second fault. A group of fewer slow requests
    than could open a spike is no such sign (a lone stall elsewhere on the same path): it stays apart, and
    its request does not pull the incident's causes to its place."""
    if len(group.traces) < min_slow_requests:
        return None
    mine = {stream for stream, seen in group.by_stream.items() if seen and not group.members[stream].root}
    return next((i for i in near if any(stream in i.members for stream in mine)), None)


def _slow_of(group: Group) -> set[bytes]:
    return group.slow_ids or set(group.traces)


def _member(j: Judgement, group: Group, incident_start_ns: int) -> Member:
    return Member(stream=j.stream, root=j.root, start_ns=max(j.onset_ns, incident_start_ns),
                  last_anomalous_end_ns=j.window_end_ns, peak_p99_ns=_p99(j), baseline_ns=j.baseline_ns,
                  evidence=max(j.evidence, j.score), slow_traces=set(group.by_stream.get(j.stream, ())),
                  over_baseline=j.exceed if j.dense else 0)


def _run_onset(slow: Iterable[SlowTrace], window_ns: int) -> int:
    """:func:`incident_onset` of slow traces, by their ends and gains."""
    run = sorted((t.end_ns, t.gain) for t in slow)
    return incident_onset([end for end, _ in run], window_ns, [gain for _, gain in run])


def _latest_run(ends: list[int], window_ns: int) -> int:
    """The index of the first of the latest run of ``ends`` (ascending): going back from the newest, each
    earlier one is taken while the gap to it is at most ``_RUN_GAP`` times the run's typical gap plus a window."""
    first = len(ends) - 1
    while first > 0:
        gaps = sorted(b - a for a, b in zip(ends[first:], ends[first + 1:], strict=False)) or [window_ns]
        typical = gaps[len(gaps) // 2]
        if ends[first] - ends[first - 1] > _RUN_GAP * typical + window_ns:
            break
        first -= 1
    return first


def incident_onset(ends: list[int], window_ns: int, gains: list[float] | None = None) -> int:
    """The start of the window in which the slow requests (ending at ascending ``ends``) began to come.

    Their latest run: going back from the newest, each earlier one is taken while the gap to it is at most
    ``_RUN_GAP`` times the run's typical (median) gap plus a window. A fault's slow requests come at the
    pace of its traffic; a stray stall half a minute before a run that comes every few seconds is not its
    start, and one two minutes before a run that comes every twenty seconds is not either.

    With ``gains`` (what each added to the evidence), the run begins at its first request that said at
    least half as much as the run's typical one: on a stream of a few calls a minute a request just past
    the bar, ten seconds before requests far past it, is a stray the timing alone cannot tell apart.

    >>> s = 1_000_000_000
    >>> incident_onset([13 * s, 53 * s, 64 * s], 10 * s) // s  # timing alone: the run's pace holds it
    10
    >>> incident_onset([13 * s, 53 * s, 64 * s], 10 * s, [0.8, 3.1, 3.1]) // s  # a weak one leads it
    50
    """
    first = _latest_run(ends, window_ns)
    if gains is not None:
        run = sorted(gains[first:])
        bar = WEAK_LEAD * run[len(run) // 2]
        while first < len(ends) - 1 and gains[first] < bar:
            first += 1
    return ends[first] // window_ns * window_ns


def _p99(j: Judgement) -> int:
    """The stream's p99 as this judgement saw it (its slowest request when it judged only a few)."""
    if j.count:
        return j.p99_ns
    return j.samples[-1][0] if j.samples else j.p99_ns


def _slowest(current: Sample | None, j: Judgement) -> Sample | None:
    if j.samples and (current is None or j.samples[-1][0] > current[0]):
        return j.samples[-1]
    return current
