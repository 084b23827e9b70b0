"""The detection engine: spans and metric samples in, closed windows and spikes with causes out.

One object wires the detectors together, in the order the data needs:

1. committed spans feed the event-time latency windows (entry and hop streams)
   and the trace buffer; metric samples feed the resource windows;
2. :meth:`DetectionEngine.advance` closes what the watermark allows: resource
   windows first (so their flags exist), then latency windows, a window start
   at a time: every stream's window is judged (:mod:`spikehound.detectors.stream_judge`),
   the hot ones are attributed to find where their time was added, and
   :mod:`spikehound.detectors.incidents` groups them into incidents, one per fault;
3. an incident's leading stream's slow traces are attributed against that
   stream's normal profile, joined with resource flags; a normal window
   teaches its stream's normal profile a few of its tail traces.

It reads no clock and does no I/O, so the collector runs it on its writer
thread, ``spikehound replay`` runs it over files, and tests run it on
generated traffic, all with the same answers. Its whole learned state
(windows, baselines, request pools, evidence, profiles, open incidents,
resource detectors; not the trace buffer, which refills in seconds)
round-trips through :meth:`snapshot` and :meth:`restore`.
"""

from __future__ import annotations

import pickle
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import groupby, islice

from spikehound.detectors.attribution import NormalProfile, TraceBreakdown, attribute, breakdown
from spikehound.detectors.critical_path import TraceIndex
from spikehound.detectors.incidents import Group, Incident, IncidentBook, IncidentEvent, stream_rank
from spikehound.detectors.resource import ResourceFlag, ResourceWatch
from spikehound.detectors.sequential import SlowRequest
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.stream_judge import Judgement, StreamJudge, tail_band
from spikehound.detectors.streams import UNINSTRUMENTED, StreamKey
from spikehound.detectors.trace_buffer import TraceBuffer
from spikehound.detectors.windows import LatencyWindows
from spikehound.model import AffectedStream, Cause, CauseKind, LatencyWindow, MetricPoint, Span, Spike

__all__ = ["CHECKPOINT_FORMAT", "Detection", "DetectionEngine"]

# Bump when the pickled state's layout changes: an older checkpoint is then ignored, not misread.
CHECKPOINT_FORMAT = 8
MAX_AFFECTED = 50  # streams a spike lists (the most user-facing first): an outage of the gateway moves them all
_WALK_BUDGET = 50_000  # spans the critical paths of one trace may visit in one step, all its streams together
_BREAKDOWN_CACHE = 4096  # critical-path breakdowns kept for streams whose evidence builds over several windows
_LOCATE_TRACES = 32  # slow requests of a stream attributed to find its locus
_EXPLAINING_TRACES = 32  # an open spike's newest traces, read for the hosts its place runs on


@dataclass(slots=True)
class Detection:
    """What one step of the engine produced."""

    windows: list[LatencyWindow] = field(default_factory=list)
    spikes: list[Spike] = field(default_factory=list)  # opened, updated or resolved: their latest state
    flags: list[ResourceFlag] = field(default_factory=list)


class DetectionEngine:
    """Everything between committed telemetry and stored spikes; pure computation.

    >>> engine = DetectionEngine(DetectionSettings())
    >>> engine.add(spans=[], points=[])
    >>> engine.advance().spikes
    []
    """

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        s = settings
        self.traces = TraceBuffer(s.trace_buffer_spans, s.trace_buffer_bytes)
        self.windows = LatencyWindows(window_ns=s.window_ns, allowed_lateness_ns=s.allowed_lateness_ns,
                                      max_streams=s.max_streams, hops=s.hop_streams and s.enabled,
                                      route_of=self.traces.callees_of if s.split_generic else None)
        self.judge = StreamJudge(s)
        self.judge.trace_start = self.traces.trace_start
        self.incidents = IncidentBook(s)
        self.resources = ResourceWatch(window_ns=s.window_ns, max_series=s.max_resource_series,
                                       keep_windows=s.resource_flag_windows)
        self.profiles: OrderedDict[StreamKey, NormalProfile] = OrderedDict()
        self._causes: dict[str, tuple[Cause, ...]] = {}
        # Per open incident: the critical-path breakdowns of its leading stream's slow requests, with their
        # (trace id, entry span id). Held as breakdowns, not trace ids, so that the trace buffer may forget
        # the traces of a long spike without changing its attribution.
        self._slow: dict[str, list[tuple[bytes, bytes, TraceBreakdown]]] = {}
        self._viewed_from: dict[str, StreamKey] = {}  # per open incident: the stream it is attributed from
        self._breakdowns: OrderedDict[tuple[bytes, bytes], TraceBreakdown] = OrderedDict()
        self._step_traces: dict[bytes, TraceIndex] = {}  # traces indexed during one step (see _trace)
        self._loci: OrderedDict[tuple[bytes, bytes], tuple[str, str | None]] = OrderedDict()  # (trace, span) -> locus
        self._metric_max_ns: int | None = None
        self.spikes_opened = 0
        self.attributions_without_traces = 0
        self.judged_windows = 0
        self.duplicate_spans = 0  # spans skipped by add() as already seen (see TraceBuffer.add)

    # -- input -------------------------------------------------------------

    def add(self, spans: Iterable[Span] = (), points: Iterable[MetricPoint] = ()) -> None:
        """Take committed spans and metric samples (any order, any batch size)."""
        spans = spans if isinstance(spans, list) else list(spans)
        if spans:
            # First: a generic entry's route is read off its trace. A span the buffer holds already (a retried
            # export whose first commit succeeded, its answer lost: stored twice, served once) is counted once.
            fresh = self.traces.add(spans) if self.settings.enabled else spans
            if fresh is not spans:
                self.duplicate_spans += len(spans) - len(fresh)
                spans = list(fresh)
            self.windows.add(spans)
        if not self.settings.enabled:
            return
        points = points if isinstance(points, list) else list(points)
        if points:
            self.resources.add(points)
            latest = max(p.time_unix_nano for p in points)
            if self._metric_max_ns is None or latest > self._metric_max_ns:
                self._metric_max_ns = latest

    def advance(self, idle_advance_ns: int = 0) -> Detection:
        """Close and judge what the watermark (moved on by ``idle_advance_ns`` when input is idle) allows."""
        return self._process(self.windows.close(idle_advance_ns), idle_advance_ns)

    def hold(self, at_ns: int | None) -> None:
        """Cap event time at ``at_ns`` while a backlog drains (None: release it; the next advance closes what
        the data allows, in one step). See :attr:`LatencyWindows.hold`."""
        self.windows.hold = at_ns

    def flush(self) -> Detection:
        """Close every open window (end of a replay). Open spikes stay open."""
        return self._process(self.windows.flush(), 0)

    # -- state -------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The learned state as bytes, for a checkpoint in storage."""
        state = {"windows": self.windows, "judge": self.judge, "incidents": self.incidents,
                 "resources": self.resources, "profiles": self.profiles, "causes": self._causes, "slow": self._slow,
                 "viewed_from": self._viewed_from,
                 "metric_max_ns": self._metric_max_ns, "spikes_opened": self.spikes_opened,
                 "window_ns": self.settings.window_ns}
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def restore(cls, settings: DetectionSettings, blob: bytes) -> DetectionEngine:
        """An engine continuing from ``snapshot()`` bytes, under (possibly changed) ``settings``.

        Raises ValueError when the checkpoint cannot be continued (another window length).
        The bytes come from the collector's own database, never from a sender.
        """
        state = pickle.loads(blob)
        if state.get("window_ns") != settings.window_ns:
            raise ValueError("the checkpoint was taken with another window length")
        engine = cls(settings)
        windows: LatencyWindows = state["windows"]
        windows.allowed_lateness_ns = settings.allowed_lateness_ns
        windows.max_streams = settings.max_streams
        windows.hops = engine.windows.hops
        windows.route_of = engine.windows.route_of
        engine.windows = windows
        engine.judge = state["judge"]
        engine.judge.settings = settings
        engine.judge.trace_start = engine.traces.trace_start
        engine.incidents = state["incidents"]
        engine.incidents.settings = settings
        engine.resources = state["resources"]
        engine.profiles = state["profiles"]
        engine._causes = state["causes"]
        engine._slow = state["slow"]
        engine._viewed_from = state["viewed_from"]
        engine._metric_max_ns = state["metric_max_ns"]
        engine.spikes_opened = state["spikes_opened"]
        return engine

    def limit_event_time(self, latest_ns: int) -> bool:
        """Bring the engine's event time back to at most ``latest_ns`` (the collector's clock plus the allowed
        skew); True when a wrong clock had moved it past (a checkpoint from before the receivers refused such
        spans): the windows beyond are dropped and the watermarks start again from what is left."""
        moved = self.windows.limit(latest_ns)
        moved |= self.resources.limit(latest_ns)
        if self._metric_max_ns is not None and self._metric_max_ns > latest_ns:
            self._metric_max_ns, moved = latest_ns, True
        return moved

    def open_spikes(self) -> list[Spike]:
        return [self._spike(incident) for incident in self.incidents.open_incidents]

    def stats(self) -> dict[str, int]:
        """Counters and sizes for the collector's /metrics (plain numbers: safe to read from another thread)."""
        return {
            "streams": self.windows.streams,
            "late_spans": self.windows.late_spans,
            "overflow_spans": self.windows.overflow_spans,
            "unjoined_calls": self.windows.unjoined_calls,
            "judged_streams": len(self.judge),
            "evicted_streams": self.judge.evicted_streams,
            "judged_windows": self.judged_windows,
            "duplicate_spans": self.duplicate_spans,
            "open_spikes": self.incidents.open_count,
            "spikes_opened": self.spikes_opened,
            "trace_buffer_spans": self.traces.spans,
            "trace_buffer_bytes": self.traces.bytes,
            "trace_buffer_evicted_traces": self.traces.evicted_traces,
            "attributions_without_traces": self.attributions_without_traces,
            "resource_series": self.resources.series,
            "resource_late_points": self.resources.late_points,
            "resource_overflow_points": self.resources.overflow_points,
        }

    def slow_traces(self, spike_id: str) -> list[tuple[bytes, bytes]]:
        """(trace id, entry span id) of the slow requests an open spike was attributed from."""
        return [(trace_id, span_id) for trace_id, span_id, _ in self._slow.get(spike_id, ())]

    # -- internals ---------------------------------------------------------

    def _process(self, closed: list[LatencyWindow], idle_advance_ns: int) -> Detection:
        s = self.settings
        watermark = self.windows.watermark
        resource_watermark = watermark
        if self._metric_max_ns is not None:
            from_metrics = self._metric_max_ns - s.allowed_lateness_ns + idle_advance_ns
            resource_watermark = from_metrics if watermark is None else max(watermark, from_metrics)
            if self.windows.hold is not None:  # a metrics backlog drains with the spans' (see LatencyWindows.hold)
                resource_watermark = min(resource_watermark, self.windows.hold)
        out = Detection(windows=closed)
        if not s.enabled:
            return out
        if resource_watermark is not None:
            out.flags = self.resources.close(resource_watermark)
        if watermark is None:
            return out
        changed: dict[str, Incident] = {}
        # Each spike as it stood right after the windows that changed it were judged, so that it reads the same
        # however many windows one step closes (a restart, a leader's takeover, a held watermark let go).
        spikes: dict[str, Spike] = {}
        # Detection happens when the latest event time seen reaches the window's end plus the lateness.
        now = watermark + s.allowed_lateness_ns
        try:
            for _, windows in groupby(closed, key=lambda w: w.start_unix_nano):
                events = self._judge_windows(list(windows), now)
                for event in events:
                    if event.kind != "resolved":
                        self._on_event(event)
                    changed[event.incident.id] = event.incident
                for event in events:
                    spikes[event.incident.id] = self._spike(event.incident)
        finally:
            self._step_traces.clear()
        for event in self._end(watermark):  # the time rule, when the locus's requests stopped
            changed[event.incident.id] = event.incident
            spikes[event.incident.id] = self._spike(event.incident)
        out.spikes = list(spikes.values())
        for incident in changed.values():
            if incident.end_ns is not None:
                self._causes.pop(incident.id, None)
                self._slow.pop(incident.id, None)
                self._viewed_from.pop(incident.id, None)
        return out

    def _judge_windows(self, windows: list[LatencyWindow], now_ns: int) -> list[IncidentEvent]:
        """Judge every stream's window of one window start, then group the hot ones into incidents."""
        self.judged_windows += len(windows)
        judgements = [self.judge.judge(w, self.windows.is_root(StreamKey(w.service, w.operation, w.peer_service)))
                      for w in windows]
        for j in judgements:  # each new slow request is attributed now, while its trace is surely buffered
            evidence = self.judge.evidence(j.stream)
            if evidence is not None:
                for r in evidence.slow:
                    if r.locus is None:
                        r.locus = self._trace_locus(j.stream, r.trace_id, r.span_id)
        hot = [j for j in judgements if j.hot]
        events = []
        if hot:
            standing = self.judge.standing({j.stream for j in judgements}, windows[0].start_unix_nano,
                                           windows[0].end_unix_nano)
            groups = self._groups(hot + standing)
            if standing:  # standing evidence joins a place that turned hot now; alone it said its say before
                now_hot = {j.stream for j in hot}
                groups = [g for g in groups if not now_hot.isdisjoint(g.members)]
            self._unclaim(groups)
            _with_their_roots(groups, [j for j in judgements if j.root and not j.hot])
            events = self.incidents.step(groups, self.judge.evidence, self.judge.warm_streams(now_ns), now_ns,
                                         self._resource_evidence)
        self._watch_ends(judgements)
        events += self._end(windows[0].end_unix_nano)
        q = self.settings.quarantine_before_ns
        self.judge.quarantine = [(i.start_ns - q, i.end_ns)
                                 for i in (*self.incidents.ended, *self.incidents.open_incidents)]
        for j in judgements:
            incident = self.incidents.incident_of(j.stream)
            self.judge.settle(j, incident.id if incident is not None else None)
            if incident is None and not j.hot and not (
                    (j.evidence > 0.0 or j.elevated) and self.judge.unclaimed(j.samples) is not j.samples):
                self._learn_normal(j)
        return events

    def _resource_evidence(self, group: Group) -> float:
        """What resource flags add to a group's evidence: one request's most (``max_surprise`` less the drift)
        when a host that served its locus in its slow requests was flagged while they ran, and no open spike
        at another place on that host explains the flag; else nothing."""
        hosts = self._hosts_of(group.locus, group.traces)
        if not hosts:
            return 0.0
        start = min(t.start_ns for t in group.traces.values()) - self.settings.window_ns
        end = max(t.end_ns for t in group.traces.values()) + self.settings.window_ns
        flagged = {f.host for f in self.resources.flags(sorted(hosts), start, end)}
        if not flagged:
            return 0.0
        # A flag that explains an open spike's place on that host explains nothing more.
        for incident in self.incidents.open_incidents:
            if incident.locus == group.locus:
                continue
            flagged -= self._hosts_of(incident.locus, islice(reversed(incident.seen), _EXPLAINING_TRACES))
            if not flagged:
                return 0.0
        return self.settings.max_surprise - self.settings.surprise_drift

    def _hosts_of(self, service: str, trace_ids: Iterable[bytes]) -> set[str]:
        """The hosts ``service`` ran on in these traces (those still buffered)."""
        return {sp.host for t in trace_ids for sp in self.traces.trace(t) if sp.service == service and sp.host}

    def _unclaim(self, groups: list[Group]) -> None:
        """Take out of each group the slow traces that began before a spike at its place ended: the last
        requests of a fault that ended (a long request started while it lasted) are not its return."""
        for group in groups:
            ends = [i.end_ns for i in self.incidents.ended
                    if i.end_ns is not None and (group.locus in i.loci or i.locus in group.loci)]
            if not ends or group.locus in {i.locus for i in self.incidents.open_incidents}:
                continue
            end = max(ends)
            for trace_id in list(group.traces):
                began = self.traces.trace_start(trace_id)
                if began is not None and began < end:
                    del group.traces[trace_id]
                    for seen in group.by_stream.values():
                        seen.discard(trace_id)

    def _watch_ends(self, judgements: list[Judgement]) -> None:
        """Feed each open incident the requests of its streams through its locus: evidence toward its end.

        A request counts when it is of an affected stream that carried some of the incident's slow requests
        and it is a call into the locus or its trace went through the locus; a busy stream whose window test
        fired in the incident counts by windows.
        """
        s = self.settings
        for incident in self.incidents.open_incidents:
            views: list[tuple[int, bytes, bool, int, StreamKey]] = []
            for j in judgements:
                member = incident.members.get(j.stream)
                # A stream counts once it carried some of the incident's slow requests (a route that only
                # joined says little), and so does every call into the locus from a caller whose calls were
                # among them. Calls from other callers do not: a delay on the caller's own network slows only
                # its calls, and the others' being normal says nothing of it.
                if member is None or not member.slow_requests:
                    continue
                direct = j.stream.is_hop and j.stream.service == incident.locus
                if j.busy:
                    if member is not None and member.over_baseline:
                        self.incidents.observe_window(incident, j.elevated or j.dense, j.window_end_ns)
                    continue
                for surprise, (_, trace_id, span_id, end) in j.scored:
                    if direct or self.traces.touches(trace_id, incident.locus):
                        slow = surprise >= s.slow_surprise
                        if slow and not direct:
                            where, caller = self._trace_locus(j.stream, trace_id, span_id)
                            # It went through the locus, but its time was added elsewhere (a stall in another
                            # service, not on a hop into or out of the locus): the locus let it through.
                            slow = where in ("", incident.locus) or caller == incident.locus
                        views.append((end, trace_id, slow, j.window_end_ns, j.stream))
            if views:
                self.incidents.observe(incident, views)

    def _end(self, now_ns: int) -> list[IncidentEvent]:
        """End the incidents whose fault is over; their streams' evidence starts again from zero."""
        events = self.incidents.resolve(now_ns)
        for event in events:
            incident = event.incident
            for stream in incident.members:
                self.judge.release(stream)
            self.judge.forget_windows(incident.start_ns - self.settings.quarantine_before_ns,
                                      incident.end_ns or incident.last_anomalous_end_ns)
            # Slow requests of the fault that other streams still hold must not open its return early.
            for stream, evidence in self.judge.streams_with_slow():
                if any(r.locus is not None and r.locus[0] in incident.loci for r in evidence.slow):
                    self.judge.forget_evidence(stream)
        return events

    def _slow_samples(self, j: Judgement, limit: int) -> list[tuple[bytes, bytes]]:
        """(trace id, span id) of the requests that made ``j`` hot: the window's tail, or the slow requests
        of the stream's sequential evidence (its latest ones)."""
        if j.dense:
            return [(t, sp) for _, t, sp, _ in tail_band(j.judged, limit)]
        evidence = self.judge.evidence(j.stream)
        return [(r.trace_id, r.span_id) for r in evidence.slow[-limit:]] if evidence is not None else []

    def _its_slow_requests(self, incident: Incident, lead: Judgement, traces: set[bytes]) -> list[tuple[bytes, bytes]]:
        """The slow requests of ``lead`` (a stream of the incident) that belong to this incident, not to a
        stall elsewhere on the same route (all of them when none can be told apart). A stream that joined
        only because the incident's slow requests came through it (a route whose own tests said nothing)
        gives those requests, seen from it."""
        if not lead.hot:
            return [(t, sp) for _, t, sp, _ in lead.samples if t in traces][-self.settings.slow_traces_per_window:]
        candidates = self._slow_samples(lead, self.settings.slow_traces_per_window)
        if lead.dense:
            mine = [(t, sp) for t, sp in candidates if self._trace_locus(lead.stream, t, sp)[0] in incident.loci]
        else:
            mine = [(t, sp) for t, sp in candidates if t in traces]
        return mine or candidates

    def _breakdown(self, trace_id: bytes, span_id: bytes) -> TraceBreakdown:
        key = (trace_id, span_id)
        found = self._breakdowns.get(key)
        if found is None:
            found = breakdown(self._trace(trace_id), span_id)
            if found.components:  # an empty one may fill in when the trace's last spans arrive
                self._breakdowns[key] = found
                if len(self._breakdowns) > _BREAKDOWN_CACHE:
                    self._breakdowns.popitem(last=False)
        return found

    def _groups(self, hot: list[Judgement]) -> list[Group]:
        """The hot streams' slow requests, grouped by where their time was added (see spikehound.detectors.incidents).

        Each slow trace is attributed once, from the most user-facing stream that saw it (the widest view of
        it), to a locus: the service its time was added in and, where that was a hop, the caller too. A
        delay on a service's own network reads as its hop to a database from that hop's stream and as the
        service's network from the route's: loci linked by a slowed hop are one group, and a group that
        touches an open incident's loci extends it. A stream whose window test fired goes with the locus
        most of its slow requests point to, linked to the callers of a slowed hop there (or its open
        incident's). What cannot be attributed (its trace is no longer buffered, as after a restart) goes
        with the largest group of the same window: streams that turn anomalous together are one incident
        unless their traces say otherwise.
        """
        seen: dict[bytes, list[tuple[Judgement, SlowRequest]]] = {}
        for j in hot:
            evidence = self.judge.evidence(j.stream)
            if evidence is not None:
                for r in evidence.slow[-_LOCATE_TRACES:]:
                    seen.setdefault(r.trace_id, []).append((j, r))
        links = _Links()
        # Places a recent spike linked stay linked: the same fault seen from its caller in the next window is
        # the same incident, not a second one.
        for incident in (*self.incidents.ended, *self.incidents.open_incidents):
            links.join(incident.locus, *incident.loci)
        placed: list[tuple[str, Judgement, SlowRequest | None]] = []  # (where, stream, its slow request or None)
        unknown: list[tuple[Judgement, SlowRequest | None]] = []
        for views in seen.values():
            widest, request = min(views, key=lambda v: stream_rank(v[0].stream, v[0].root))
            where, caller = request.locus or self._trace_locus(widest.stream, request.trace_id, request.span_id)
            if not where:
                unknown += views
                continue
            links.join(where, *(caller,) if caller is not None else ())
            links.count(where, caller)
            placed += [(where, j, r) for j, r in views]
        for j in hot:
            if not j.dense:
                continue
            incident = self.incidents.incident_of(j.stream)
            callers: set[str] = set()
            if incident is not None:
                where = incident.locus  # more of the same: its tail may already hold requests after the fault
            else:
                loci = [self._trace_locus(j.stream, t, sp) for t, sp in self._slow_samples(j, _LOCATE_TRACES)]
                votes = Counter(where for where, _ in loci if where)
                if not votes:
                    unknown.append((j, None))
                    continue
                where = min(votes, key=lambda k: (-votes[k], k))
                # A slowed hop links its caller, as a slow request of the sequential test does above.
                callers = {caller for at, caller in loci if at == where and caller is not None}
            links.join(where, *callers)
            links.count(where, None)
            placed.append((where, j, None))
        if unknown:
            if placed:  # with the window's largest group
                sizes = Counter(links.find(where) for where, _, _ in placed)
                where = min(sizes, key=lambda root: (-sizes[root], root))
            else:  # among themselves: a hop names its callee, an entry its own service
                names = Counter(j.stream.service for j, _ in unknown for _ in range(2 if j.stream.is_hop else 1))
                where = min(names, key=lambda k: (-names[k], k))
                links.join(where)
                links.count(where, None)
            placed += [(where, j, r) for j, r in unknown]
        named = {incident.locus: incident.locus for incident in self.incidents.open_incidents}
        groups: dict[str, Group] = {}
        for where, j, r in placed:
            root = links.find(where)
            locus = named.get(root) or next((i.locus for i in self.incidents.open_incidents
                                             if links.find(i.locus) == root), None) or links.center(root)
            named[root] = locus
            group = groups.get(locus) or groups.setdefault(locus, Group(locus))
            group.loci.update(links.members(where))
            if r is not None:
                group.add(j, r.trace_id, r.gain, r.end_ns, r.duration_ns)
            elif j.dense:
                group.add_dense(j)
        return list(groups.values())

    def _trace_locus(self, stream: StreamKey, trace_id: bytes, span_id: bytes) -> tuple[str, str | None]:
        """Where one slow request of ``stream`` had its time added: the service of its top cause, and the
        caller when that was a hop; ``("", None)`` when its trace is not buffered."""
        key = (trace_id, span_id)
        locus = self._loci.get(key)
        if locus is None:
            found = self._breakdown(trace_id, span_id)
            if not found.components:
                return "", None
            locus = (stream.service, stream.peer_service)  # before a profile: a hop's callee, an entry's service
            profile = self.profiles.get(stream)
            if profile is not None and profile.traces:
                causes = attribute([found], profile, flags=(), max_causes=1)
                if causes and causes[0].service is not None:
                    top = causes[0]
                    locus = (top.service, top.peer_service if top.kind == CauseKind.NETWORK else None)
                    if top.kind == CauseKind.SPAN and top.operation:
                        # A call nobody answers (a query): the time was added where it went, if it says.
                        peer = self.windows.unanswered_peer.get((top.service, top.operation))
                        if peer is not None:
                            locus = (peer, top.service)
            if locus[0] == UNINSTRUMENTED or locus[0] in self.windows.kinds:
                # Says nothing about where (or only "mysql"): unrelated calls must not meet there. The caller.
                locus = (locus[1] or "", None)
            self._loci[key] = locus
            if len(self._loci) > _BREAKDOWN_CACHE:
                self._loci.popitem(last=False)
        return locus

    def _profile(self, stream: StreamKey) -> NormalProfile:
        profile = self.profiles.get(stream)
        if profile is None:
            if len(self.profiles) >= self.settings.max_streams:
                self.profiles.popitem(last=False)
            profile = self.profiles[stream] = NormalProfile()
        else:
            self.profiles.move_to_end(stream)
        return profile

    def _trace(self, trace_id: bytes) -> TraceIndex:
        """A buffered trace, indexed once per step: one trace is seen by the windows of many streams, and a
        path from one of its spans then costs the subtree under it, not the whole trace."""
        index = self._step_traces.get(trace_id)
        if index is None:
            index = self._step_traces[trace_id] = TraceIndex.of(self.traces.trace(trace_id), _WALK_BUDGET)
        return index

    def _learn_normal(self, j: Judgement) -> None:
        if not j.samples:
            return
        profile = self._profile(j.stream)
        for _, trace_id, span_id, _ in tail_band(j.samples, self.settings.normal_traces_per_window):
            profile.learn(breakdown(self._trace(trace_id), span_id))
        trace_id = j.samples[len(j.samples) // 2][1]
        if trace_id in self.traces:
            profile.normal_trace_id = trace_id

    def _on_event(self, event: IncidentEvent) -> None:
        """Attribute an incident that opened or grew, from the widest view of it there is.

        The causes come from the most user-facing of its streams that has slow requests of it: a route's
        traces hold the whole tree, a hop's only what is behind it (a delay on a service's own network
        reads, from one hop out of it, as that hop). When a wider stream joins, attribution moves to it.
        """
        if event.kind == "opened":
            self.spikes_opened += 1
        s = self.settings
        incident = event.incident
        viewed = {j.stream: j for j in event.judgements if j.stream in incident.members}
        found = {stream: [(t, sp, b) for t, sp in self._its_slow_requests(incident, j, event.traces)
                          if (b := self._breakdown(t, sp)).components]
                 for stream, j in viewed.items()}
        current = self._viewed_from.get(incident.id)
        # The widest view that sees some of it; a wider one starts over (compared with its own profile).
        for stream in sorted((s for s in found if found[s]), key=lambda s: incident.members[s].rank):
            if current is None or incident.members[stream].rank < incident.members[current].rank:
                self._viewed_from[incident.id] = current = stream
                self._slow[incident.id] = []
            break
        slow = self._slow.setdefault(incident.id, [])
        view = viewed.get(current) if current is not None else None
        if view is not None:
            seen = {(t, sp) for t, sp, _ in slow}
            slow += [(t, sp, b) for t, sp, b in found[current] if (t, sp) not in seen]
            if len(slow) > s.max_slow_traces:
                del slow[::2]  # thin evenly, so early and late windows of a long spike both stay represented
        if not slow:
            if view is not None:
                self.attributions_without_traces += 1
            return
        flags = self.resources.flags(None, incident.start_ns - s.window_ns, incident.last_anomalous_end_ns)
        profile = self.profiles.get(current) if current is not None else None
        causes = attribute([b for _, _, b in slow], profile or NormalProfile(), flags, max_causes=s.max_causes)
        if causes:
            self._causes[incident.id] = tuple(causes)

    def _spike(self, incident: Incident) -> Spike:
        lead = incident.leader
        exemplars: list[bytes] = []
        if incident.slowest is not None:
            exemplars.append(incident.slowest[1])
        profile = self.profiles.get(incident.lead)
        if profile is not None and profile.normal_trace_id is not None and profile.normal_trace_id not in exemplars:
            exemplars.append(profile.normal_trace_id)
        members = sorted(incident.members.values(), key=lambda m: (m.stream != incident.lead, m.rank, m.stream.order))
        affected = tuple(AffectedStream(service=m.stream.service, operation=m.stream.operation,
                                        peer_service=m.stream.peer_service, start_unix_nano=m.start_ns,
                                        last_anomalous_end_unix_nano=m.last_anomalous_end_ns,
                                        p99_ns=m.peak_p99_ns, baseline_p99_ns=m.baseline_ns,
                                        evidence=round(m.evidence, 2), slow_requests=m.slow_requests)
                         for m in members[:MAX_AFFECTED])
        return Spike(id=incident.id, service=lead.stream.service, operation=lead.stream.operation,
                     state=incident.state, start_unix_nano=incident.start_ns, end_unix_nano=incident.end_ns,
                     p99_ns=lead.peak_p99_ns, baseline_p99_ns=lead.baseline_ns,
                     causes=self._causes.get(incident.id, ()), exemplar_trace_ids=tuple(exemplars),
                     detected_unix_nano=incident.detected_ns, peer_service=lead.stream.peer_service,
                     affected=affected, recurrence_of=incident.recurrence_of, occurrence=incident.occurrence,
                     first_start_unix_nano=incident.first_start_ns if incident.recurrence_of else None)


def _with_their_roots(groups: list[Group], roots: list[Judgement]) -> None:
    """Add to each group the trace-root streams its slow requests came through, hot or not: what users
    called leads an incident, even where a deeper stream saw the rise first. A root with no learned normal (a
    name seen for the first time, as a badly templated route makes one a request) has no p99 to rise from:
    listed, it would read "1.6 s against 0 ms" and crowd out the streams that did rise."""
    roots = [j for j in roots if j.baseline_ns > 0]
    for group in groups:
        slow = group.slow_ids
        slow.update(group.traces)
        for j in group.dense:
            slow.update(t for _, t, _, _ in tail_band(j.judged, _LOCATE_TRACES))
        for j in roots:
            if j.stream not in group.members and any(t in slow for _, t, _, _ in j.samples):
                group.members[j.stream] = j


class _Links:
    """Services linked by slowed hops (a union-find), with how often each was named: the center of a group."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}
        self._size: dict[str, int] = {}  # a root -> how many services its group holds
        self._named: Counter[str] = Counter()

    def find(self, service: str) -> str:
        parents = self._parent
        root = parents.setdefault(service, service)
        while parents[root] != root:  # iterative: thousands of linked services must not reach the recursion limit
            root = parents[root]
        while service != root:  # path compression
            parents[service], service = root, parents[service]
        return root

    def join(self, service: str, *others: str) -> None:
        root = self.find(service)
        for other in others:
            other_root = self.find(other)
            if other_root != root:
                # Union by size keeps the trees shallow.
                if self._size.get(other_root, 1) > self._size.get(root, 1):
                    root, other_root = other_root, root
                self._parent[other_root] = root
                self._size[root] = self._size.get(root, 1) + self._size.pop(other_root, 1)

    def count(self, where: str, caller: str | None) -> None:
        self._named[where] += 2  # where the time was added counts more than the caller of a slowed hop
        if caller is not None:
            self._named[caller] += 1

    def members(self, service: str) -> set[str]:
        root = self.find(service)
        return {s for s in self._parent if self.find(s) == root}

    def center(self, root: str) -> str:
        """The most named service of ``root``'s group."""
        return min(self.members(root), key=lambda s: (-self._named[s], s))
