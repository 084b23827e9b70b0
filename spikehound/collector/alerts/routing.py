"""Routing: spike states in, notifications out. Pure bookkeeping: no I/O, the clock is injected.

Each open spike is tried against the routes in order (``[[alerts.routes]]``);
the first that matches takes it, and later ones too while
``continue_matching`` says so. A route matches on patterns (service,
operation, causes), a minimum severity (p99 over baseline) and a minimum
duration. A matched spike becomes an *alert* (one per stream and top cause,
see :mod:`spikehound.collector.alerts.notification`) in a *group* (route, service, top
cause); the top cause is read when the spike is first routed and kept, so
re-ranked causes update the alert without moving it.

A group is announced when it starts firing (after ``group_wait``), again
when its alerts change (at most every ``group_interval``), again every
``repeat_interval`` while it fires, and once more when everything in it has
ended (after ``resolve_wait``; a spike that comes back on the same stream for
the same reason within it continues the alert). A fault's return (a spike with
``recurrence_of``, docs/detection.md) is told at once in a new firing message,
whatever the intervals: the receiver hears of each one. A spike first seen already over (found late: the
collector judged a backlog after a storage outage or a restart) is judged by
how long it lasted in event time: long enough for a route, it is announced
firing, then resolved, as it would have been live. A route sends at most ``max_per_hour`` notifications;
beyond that a group waits, and what it finally sends is its latest state.
Silenced alerts are left out; a group whose alerts are all silenced sends
nothing.

>>> from spikehound.config import AlertsConfig, ReceiverConfig, RouteConfig
>>> from spikehound.model import Spike
>>> cfg = AlertsConfig(receivers=[ReceiverConfig(name="pager", url="http://127.0.0.1:9/")],
...                    routes=[RouteConfig(receiver="pager", name="pager", resolve_wait_seconds=0)])
>>> now = [1000.0]
>>> router = Router(cfg, clock=lambda: now[0])
>>> spike = Spike(id="s1", service="gateway", operation="POST /v1/predict", state="open",
...               start_unix_nano=0, end_unix_nano=None, p99_ns=300_000_000, baseline_p99_ns=100_000_000)
>>> router.observe([spike])
>>> [(n.status, n.alerts[0].labels["service"]) for n in router.evaluate().notifications]
[('firing', 'gateway')]
>>> router.evaluate().notifications  # nothing new
[]
>>> from dataclasses import replace
>>> router.observe([replace(spike, state="resolved", end_unix_nano=10**10)])
>>> [n.status for n in router.evaluate().notifications]
['resolved']
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from spikehound.collector.alerts.matchers import SpikeMatcher
from spikehound.collector.alerts.notification import (
    NO_CAUSE,
    AlertItem,
    Notification,
    affected_summary,
    alert_labels,
    cause_label,
    describe,
    fingerprint,
    milliseconds,
    ratio,
)
from spikehound.collector.alerts.saved_spike import from_saved_form, saved_form
from spikehound.collector.alerts.silences import Silence
from spikehound.collector.web.links import spike_page_url, trace_page_path
from spikehound.config import AlertsConfig, RouteConfig
from spikehound.model import Spike
from spikehound.units import NS

log = logging.getLogger("spikehound.collector.alerts")

HOUR = 3600.0
MAX_SPIKE_IDS = 32  # spikes remembered per alert (a flapping stream makes many)


@dataclass(slots=True)
class AlertState:
    """One stream under one top cause in one group: firing while any of its spikes is open."""

    fingerprint: str
    labels: dict[str, str]
    spike: Spike  # the latest state of the alert's latest spike
    starts_at: int  # event time ns of the spike that began this episode
    open_spikes: list[str] = field(default_factory=list)
    spike_ids: list[str] = field(default_factory=list)
    ends_at: int | None = None  # event time ns, once every spike ended
    resolved_at: float | None = None  # wall clock, when its last open spike ended
    announced: str | None = None  # the spike its last firing message told of (not saved)

    @property
    def firing(self) -> bool:
        return bool(self.open_spikes)

    @property
    def returned(self) -> bool:
        """Its spike is a fault's return that no firing message told of yet: the receiver hears of each one."""
        return (self.firing and self.spike.recurrence_of is not None and self.announced is not None
                and self.spike.id != self.announced)

    def to_doc(self) -> dict[str, Any]:
        """The alert as its group's saved state holds it."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "announced"}
        doc["spike"] = saved_form(self.spike)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> AlertState:
        """The alert a saved group state holds."""
        return cls(**{**doc, "spike": from_saved_form(doc["spike"])})


@dataclass(slots=True)
class GroupState:
    """One (route, service, top cause) and what was last sent about it; saved with every change."""

    id: str
    route: str
    receiver: str
    service: str
    cause: str
    created_at: int  # wall clock ns; part of every idempotency key of the group
    alerts: dict[str, AlertState] = field(default_factory=dict)
    firing_since: float | None = None
    sent_status: str = ""  # "" | firing | resolved
    sent_firing: list[str] = field(default_factory=list)  # fingerprints announced as firing
    sent_at: float = 0.0
    seq: int = 0
    held: bool = False  # waiting for the route's rate limit (not saved)

    def to_json(self) -> str:
        """The state to save (the rate limit's hold is not saved: it is decided again after a restart)."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "held"}
        doc["alerts"] = {fp: a.to_doc() for fp, a in self.alerts.items()}
        return orjson.dumps(doc).decode()

    @classmethod
    def from_json(cls, text: str) -> GroupState:
        doc = orjson.loads(text)
        doc["alerts"] = {fp: AlertState.from_doc(a) for fp, a in doc["alerts"].items()}
        return cls(**doc)


@dataclass(slots=True)
class Route:
    cfg: RouteConfig
    matcher: SpikeMatcher
    sent: deque[float] = field(default_factory=deque)  # wall times of its notifications in the last hour

    @classmethod
    def of(cls, cfg: RouteConfig) -> Route:
        return cls(cfg, SpikeMatcher(services=tuple(cfg.services), operations=tuple(cfg.operations),
                                     cause_kinds=tuple(cfg.cause_kinds), cause_resources=tuple(cfg.cause_resources),
                                     min_cause_score=cfg.min_cause_score))


@dataclass(slots=True)
class Decision:
    """What one evaluation produced: to be committed together (state and outbox in one transaction)."""

    notifications: list[Notification] = field(default_factory=list)
    saved: dict[str, tuple[str, str]] = field(default_factory=dict)  # group id -> (route, state JSON)
    removed: set[str] = field(default_factory=set)

    def merge(self, later: Decision) -> None:
        """Fold a later decision in (after a failed commit, both are committed together)."""
        self.notifications.extend(later.notifications)
        for gid in later.removed:
            self.saved.pop(gid, None)
        self.removed = (self.removed - set(later.saved)) | later.removed
        self.saved.update(later.saved)

    def __bool__(self) -> bool:
        return bool(self.notifications or self.saved or self.removed)


class Router:
    """Routes, groups and timers of every alert; call :meth:`observe` with spikes, :meth:`evaluate` often."""

    def __init__(self, cfg: AlertsConfig, *, clock: Callable[[], float] = time.time, base_url: str = "") -> None:
        self.clock = clock
        self.base_url = base_url.rstrip("/")
        self.routes: dict[str, Route] = {}
        self.groups: dict[str, GroupState] = {}
        self.silences: list[Silence] = []
        # (outcome, route) -> spikes: routed, silenced, rate_limited; ("unmatched"|"too_short", "") at their end.
        self.counts: Counter[tuple[str, str]] = Counter()
        self._index: dict[str, list[tuple[str, str]]] = {}  # open spike id -> (group id, fingerprint)
        self._waiting: dict[str, Spike] = {}  # open spikes, tried against routes not yet taken
        # Spikes whose end came before they were routed (their open and resolved states arrived together after
        # a catch-up): routed on their event-time length, resolved once their firing was announced.
        self._ended_unannounced: dict[str, tuple[Spike, float]] = {}  # -> (its end, when it was seen)
        self._first_seen: dict[str, float] = {}
        self._matched: set[str] = set()  # open spikes some route matched (maybe still too short)
        self._silenced: set[str] = set()  # open spikes counted as silenced
        self._dirty: set[str] = set()
        self._removed: set[str] = set()
        self._last_created = 0
        self.reload(cfg)

    # -- configuration and state ---------------------------------------------------------------

    def reload(self, cfg: AlertsConfig) -> None:
        """Swap the routes (``SIGHUP``); groups of routes that remain keep their state, the rest are dropped."""
        old = self.routes
        self.routes = {}
        for rc in cfg.routes:
            route = Route.of(rc)
            if rc.name in old:
                route.sent = old[rc.name].sent
            self.routes[rc.name] = route
        for gid, g in list(self.groups.items()):
            route = self.routes.get(g.route)
            if route is None:
                self._drop(gid)
            elif g.receiver != route.cfg.receiver:
                g.receiver = route.cfg.receiver
                self._dirty.add(gid)

    def restore(self, saved: Iterable[tuple[str, str, str]]) -> None:
        """Continue from the saved groups ``(id, route, state JSON)``."""
        for gid, route, state in saved:
            if route not in self.routes:
                self._removed.add(gid)
                continue
            try:
                g = GroupState.from_json(state)
            except (ValueError, KeyError, TypeError) as exc:  # written by another version, or damaged
                log.warning("alert group %s: its saved state does not read (%s: %s); it is dropped, and alerts "
                            "about its spikes start afresh", gid, exc.__class__.__name__, str(exc)[:200])
                self._removed.add(gid)
                continue
            self.groups[gid] = g
            for fp, a in g.alerts.items():
                for sid in a.open_spikes:
                    self._index.setdefault(sid, []).append((gid, fp))

    def open_spike_ids(self) -> set[str]:
        """Spikes the router holds as open: after a restart their stored state is observed again."""
        return set(self._index) | set(self._waiting)

    # -- input ---------------------------------------------------------------------------------

    def observe(self, spikes: Iterable[Spike], seen_at: float | None = None) -> None:
        """Take spike states (opened, updated, resolved) as the detectors commit them (``seen_at``: when they
        did, if not now)."""
        now = self.clock() if seen_at is None else seen_at
        for spike in spikes:
            for gid, fp in self._index.get(spike.id, ()):
                g = self.groups.get(gid)
                a = g.alerts.get(fp) if g is not None else None
                if a is None:
                    continue
                if spike.start_unix_nano >= a.spike.start_unix_nano:
                    a.spike = spike
                if spike.state == "resolved" and spike.id in a.open_spikes:
                    a.open_spikes.remove(spike.id)
                    if not a.open_spikes:
                        a.resolved_at, a.ends_at = now, spike.end_unix_nano
                self._dirty.add(gid)
            if spike.state == "open":
                self._waiting[spike.id] = spike
                self._first_seen.setdefault(spike.id, now)
                continue
            if spike.id in self._waiting and spike.id not in self._index:
                self._ended_unannounced[spike.id] = (spike, now)  # decided at the next evaluate (_route_waiting)
                continue
            self._forget(spike.id)

    def _forget(self, sid: str) -> None:
        """A spike has ended: counted if no route ever took it, and let go of."""
        if sid in self._waiting and sid not in self._index:
            spike = self._waiting[sid]
            matched = sid in self._matched or any(
                r.matcher.matches(spike) and ratio(spike) >= r.cfg.min_ratio for r in self.routes.values())
            self.counts["too_short" if matched else "unmatched", ""] += 1
        for name in (self._waiting, self._first_seen, self._index, self._ended_unannounced):
            name.pop(sid, None)
        self._matched.discard(sid)
        self._silenced.discard(sid)

    def set_silences(self, silences: Iterable[Silence]) -> None:
        self.silences = list(silences)

    # -- output --------------------------------------------------------------------------------

    def evaluate(self) -> Decision:
        """Route waiting spikes and return the notifications due now with the group states to save."""
        now = self.clock()
        self._resolve_announced(now)
        self._route_waiting(now)
        for sid in [sid for sid in self._ended_unannounced if sid not in self._index]:
            self._forget(sid)  # no route found it long enough
        out = Decision()
        for g in sorted(self.groups.values(), key=lambda g: (g.created_at, g.id)):
            note = self._evaluate(g, now)
            if note is not None:
                out.notifications.append(note)
        for gid in self._dirty:
            if gid in self.groups:
                out.saved[gid] = (self.groups[gid].route, self.groups[gid].to_json())
        out.removed = self._removed - set(out.saved)
        self._dirty.clear()
        self._removed.clear()
        return out

    def _route_waiting(self, now: float) -> None:
        for sid, spike in self._waiting.items():
            taken = {self.groups[gid].route for gid, _ in self._index.get(sid, ()) if gid in self.groups}
            severity = ratio(spike)
            for name, route in self.routes.items():
                if not route.matcher.matches(spike) or severity < route.cfg.min_ratio:
                    continue
                self._matched.add(sid)
                ended = self._ended_unannounced.get(sid)
                if ended is not None and ended[0].end_unix_nano:  # over already: its length in event time
                    lasted = max(0.0, (ended[0].end_unix_nano - spike.start_unix_nano) / NS)
                else:
                    detected = spike.detected_unix_nano or spike.start_unix_nano
                    lasted = max(0.0, (detected - spike.start_unix_nano) / NS)
                    lasted += now - self._first_seen.get(sid, now)
                if name not in taken and lasted >= route.cfg.min_duration_seconds:
                    self._assign(route, sid, spike, now)
                if not route.cfg.continue_matching:
                    break

    def _resolve_announced(self, now: float) -> None:
        """Apply the end of each spike found late once every group that took it has announced it firing (or never
        will: a silence mutes it)."""
        now_ns = int(now * NS)
        for sid, (ended, seen_at) in list(self._ended_unannounced.items()):
            places = self._index.get(sid)
            if places and all(self._told(gid, fp, now_ns) for gid, fp in places):
                del self._ended_unannounced[sid]
                self.observe([ended], seen_at)  # resolve_wait counts from when its end was seen

    def _told(self, gid: str, fp: str, now_ns: int) -> bool:
        g = self.groups.get(gid)
        a = g.alerts.get(fp) if g is not None else None
        return (g is None or a is None or fp in g.sent_firing
                or any(s.mutes(a.spike, now_ns) for s in self.silences))

    def _assign(self, route: Route, sid: str, spike: Spike, now: float) -> None:
        label = cause_label(spike)
        gid = hashlib.sha256(f"{route.cfg.name}\0{spike.service}\0{label}".encode()).hexdigest()[:32]
        g = self.groups.get(gid)
        if g is None:
            # Unique and increasing: groups made in one evaluation keep their order (the rate limit serves
            # them first come, first served), and a group made again later has new idempotency keys.
            created = self._last_created = max(int(now * NS), self._last_created + 1)
            g = self.groups[gid] = GroupState(id=gid, route=route.cfg.name, receiver=route.cfg.receiver,
                                              service=spike.service, cause=label, created_at=created)
            self._removed.discard(gid)
        labels = alert_labels(spike)
        fp = fingerprint(labels)
        a = g.alerts.get(fp)
        if a is None:
            a = g.alerts[fp] = AlertState(fingerprint=fp, labels=labels, spike=spike,
                                          starts_at=spike.start_unix_nano)
        elif not a.firing and fp not in g.sent_firing:
            a.starts_at = spike.start_unix_nano  # a new episode, not the continuation of an announced one
        a.spike, a.ends_at, a.resolved_at = spike, None, None
        if sid not in a.open_spikes:
            a.open_spikes.append(sid)
        a.spike_ids = [*a.spike_ids, sid][-MAX_SPIKE_IDS:]
        self._index.setdefault(sid, []).append((gid, fp))
        self._dirty.add(gid)
        self.counts["routed", route.cfg.name] += 1

    def _muted(self, g: GroupState, now: float) -> set[str]:
        """Fingerprints of the group's alerts that an active silence covers (each silenced spike counted once)."""
        now_ns = int(now * NS)
        muted = set()
        for fp, a in g.alerts.items():
            if any(s.mutes(a.spike, now_ns) for s in self.silences):
                muted.add(fp)
                fresh = set(a.open_spikes) - self._silenced
                self._silenced |= fresh
                self.counts["silenced", g.route] += len(fresh)
        return muted

    def _evaluate(self, g: GroupState, now: float) -> Notification | None:
        route = self.routes[g.route]
        c = route.cfg
        for fp, a in list(g.alerts.items()):  # ended before it was ever announced: nothing to say
            if not a.firing and fp not in g.sent_firing:
                del g.alerts[fp]
                self._dirty.add(g.id)
        muted = self._muted(g, now)
        firing = [a for fp, a in g.alerts.items() if a.firing and fp not in muted]
        announced = [fp for fp in g.sent_firing if fp in g.alerts]
        if firing:
            if g.firing_since is None:
                g.firing_since = now
                self._dirty.add(g.id)
            status = "firing"
            if g.sent_status != "firing":
                due = g.firing_since + c.group_wait_seconds
            elif any(a.returned for a in firing):
                due = now  # the same fault again: a new firing message, whatever the group's intervals
            elif ({a.fingerprint for a in firing} - set(announced)
                  or any(not g.alerts[fp].firing for fp in announced if fp not in muted)):
                due = g.sent_at + c.group_interval_seconds
            else:
                due = g.sent_at + c.repeat_interval_seconds
        else:
            if g.firing_since is not None:
                g.firing_since = None
                self._dirty.add(g.id)
            if g.sent_status != "firing" or any(g.alerts[fp].firing for fp in announced):
                if not g.alerts:
                    self._drop(g.id)
                return None  # never announced, or what was announced is still firing but silenced
            status = "resolved"
            due = max((g.alerts[fp].resolved_at or now for fp in announced), default=now) + c.resolve_wait_seconds
        if now < due:
            return None
        ended = [g.alerts[fp] for fp in announced if not g.alerts[fp].firing and fp not in muted]
        items = firing + ended
        if not items or (status == "resolved" and not c.send_resolved):
            self._sent(g, status, [], now)  # all silenced, or resolve notices are off: close quietly
            return None
        while route.sent and route.sent[0] <= now - HOUR:
            route.sent.popleft()
        if len(route.sent) >= c.max_per_hour:
            if not g.held:
                g.held = True
                self.counts["rate_limited", c.name] += 1
            return None
        g.held = False
        route.sent.append(now)
        g.seq += 1
        key = hashlib.sha256(f"{g.receiver}\0{g.id}\0{g.created_at}\0{g.seq}".encode()).hexdigest()[:32]
        note = Notification(
            idempotency_key=key, receiver=g.receiver, route=g.route, group_id=g.id,
            group_key=f'{g.route}:{{service="{g.service}", cause="{g.cause}"}}',
            group_labels={"service": g.service, "cause": g.cause}, status=status,
            alerts=tuple(self._item(a, "firing" if a.firing else "resolved") for a in items),
            external_url=self.base_url)
        self._sent(g, status, [a.fingerprint for a in firing], now)
        return note

    def _sent(self, g: GroupState, status: str, firing: list[str], now: float) -> None:
        g.sent_status, g.sent_firing, g.sent_at = status, firing, now
        for fp in firing:
            g.alerts[fp].announced = g.alerts[fp].spike.id
        for fp, a in list(g.alerts.items()):  # what ended has been told (or needs no telling)
            if not a.firing:
                del g.alerts[fp]
        self._dirty.add(g.id)
        if not g.alerts:
            self._drop(g.id)

    def _drop(self, gid: str) -> None:
        g = self.groups.pop(gid, None)
        if g is not None:
            for a in g.alerts.values():
                for sid in a.open_spikes:
                    left = [e for e in self._index.get(sid, ()) if e[0] != gid]
                    if left:
                        self._index[sid] = left
                    else:
                        self._index.pop(sid, None)
        self._dirty.discard(gid)
        self._removed.add(gid)

    def _item(self, a: AlertState, status: str) -> AlertItem:
        spike = a.spike
        spike_url = spike_page_url(self.base_url, spike.id)  # the web page: chart, causes, waterfalls
        exemplars = spike.exemplar_trace_ids
        trace_url = self.base_url.rstrip("/") + trace_page_path(exemplars[0].hex()) if exemplars else None
        top = spike.causes[0].summary if spike.causes else NO_CAUSE
        annotations = {"summary": describe(spike), "description": top, "spike_id": spike.id,
                       "p99_ms": f"{milliseconds(spike.p99_ns):.1f}",
                       "baseline_p99_ms": f"{milliseconds(spike.baseline_p99_ns):.1f}",
                       "ratio": f"{ratio(spike):.2f}", "spike_url": spike_url}
        if trace_url:
            annotations["trace_url"] = trace_url
        also = affected_summary(spike)
        if also:
            annotations["affected_streams"] = also
        return AlertItem(fingerprint=a.fingerprint, status=status, labels=a.labels, annotations=annotations,
                         starts_at_ns=a.starts_at, ends_at_ns=None if status == "firing" else a.ends_at,
                         spike=spike, spike_url=spike_url, trace_url=trace_url)
