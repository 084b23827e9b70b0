"""Attribution: which span, service, network hop or resource explains a spike's added latency.

Every trace is reduced to its critical-path *breakdown*: how much of its
latency each component held on the critical path (see
:func:`spikehound.detectors.critical_path.critical_path_times`). Components are

- ``span``: a span's own time, keyed by (service, span name); a CLIENT span
  with no instrumented server behind it (a database call) is a span too;
- ``network``: a CLIENT span's time not covered by its SERVER child on the path,
  the network and queueing time of that hop, keyed by (callee service, callee
  operation, caller service);
- ``service``: the sum of a service's span components;
- ``network`` of a service (operation and peer None): the sum of every hop into
  and out of it. A delay on a service's own network interface slows its
  callers' calls to it *and* its calls to others; each hop alone then names the
  wrong side (the hop to a database it calls), their sum names the service.

Each stream keeps a :class:`NormalProfile`, the mean breakdown of tail traces
(p90 and up) of its normal windows. When a spike opens, and while it lasts,
the same tail band of its windows is broken down the same way and compared
with the profile: a component's *score* is its growth's share of the added
latency. A service (or its network) whose growth is mostly one span (one hop)
ranks after that span (hop), which says more; one whose growth is spread over
several ranks first. Resource flags (:mod:`spikehound.detectors.resource`) on the hosts
that served the top components are joined in, ahead of the component they
explain when their size can account for its growth (CPU steal rising from 4 to
14 % takes a tenth of the CPU away: it cannot make a span three times slower),
else just behind it, as evidence.

>>> from spikehound.model import SpanKind, StatusCode
>>> def span(i, parent, service, name, kind, start, end, host="h1"):
...     return Span(trace_id=bytes(16), span_id=bytes([i]), parent_span_id=parent and bytes([parent]),
...                 service=service, host=host, name=name, kind=kind, start_unix_nano=start,
...                 end_unix_nano=end, status=StatusCode.UNSET)
>>> def trace(db_ms):
...     return [span(1, None, "api", "GET /x", SpanKind.SERVER, 0, (5 + db_ms) * 10**6),
...             span(2, 1, "api", "SELECT", SpanKind.CLIENT, 10**6, (1 + db_ms) * 10**6)]
>>> profile = NormalProfile()
>>> for _ in range(20):
...     profile.learn(breakdown(trace(10), bytes([1])))
>>> causes = attribute([breakdown(trace(40), bytes([1]))], profile, flags=[], max_causes=2)
>>> [(c.kind.value, c.operation, round(c.score, 2), c.baseline, c.observed) for c in causes]
[('span', 'SELECT', 1.0, 10.0, 40.0), ('service', None, 1.0, 15.0, 45.0)]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from spikehound.detectors.critical_path import TraceIndex, critical_path_times, hop_callees
from spikehound.detectors.resource import ResourceFlag
from spikehound.model import Cause, CauseKind, Span, SpanKind
from spikehound.units import MS

__all__ = ["NormalProfile", "TraceBreakdown", "attribute", "breakdown"]

# (kind, service, operation, peer service); see the module docstring.
Key = tuple[str, str, str | None, str | None]
SPECIFIC_SPAN_SHARE = 0.6  # a span holding this much of its service's growth is the better answer
# A caller's network ranks behind the network of the callee its slowed hops went to unless it grew this much
# more: its own fault would have slowed the hops into it too, not only its calls to that callee.
CALLER_NETWORK_MARGIN = 1.25
MIN_SCORE = 0.05  # components explaining less than 5 % of the added latency are not causes
UNANSWERED = ""  # the peer of a span component that is a CLIENT span no server answered
MAX_COMPONENTS = 64  # components a breakdown keeps (its largest); a normal profile keeps twice as many
ACCOUNT_SLACK = 1.5  # a resource accounts for a component that grew up to this much more than it can explain


@dataclass(slots=True)
class TraceBreakdown:
    """One trace's critical-path time per component (ns), and the host that served each.

    The detector checkpoint pickles a spike's slow breakdowns (``DetectionEngine.snapshot``), so this class's
    module and name are part of its stored format: move or rename it only with a ``CHECKPOINT_FORMAT`` bump.
    """

    total_ns: int
    components: dict[Key, int]
    hosts: dict[Key, str | None]


def breakdown(spans: Sequence[Span] | TraceIndex, root: bytes | None = None) -> TraceBreakdown:
    """The critical-path breakdown of the (sub)trace under ``root`` (the trace root when None)."""
    path = critical_path_times(spans, root)
    if not path:
        return TraceBreakdown(0, {}, {})
    callees = hop_callees(path)
    components: dict[Key, int] = {}
    hosts: dict[Key, str | None] = {}
    total = 0
    for span, self_ns in path:
        total += self_ns
        callee = callees.get(span.span_id)
        if callee is not None:
            key: Key = ("network", callee.service, callee.name, span.service)
            hosts[key] = callee.host
        else:
            # A CLIENT span nobody answered (a database, an uninstrumented service) is marked: its time is
            # also part of its service's network.
            key = ("span", span.service, span.name, UNANSWERED if span.kind == SpanKind.CLIENT else None)
            hosts.setdefault(key, span.host)
            service_key: Key = ("service", span.service, None, None)
            components[service_key] = components.get(service_key, 0) + self_ns
            hosts.setdefault(service_key, span.host)
        components[key] = components.get(key, 0) + self_ns
    if len(components) > MAX_COMPONENTS:  # a path of thousands of distinct spans: its largest parts say it all
        kept = heapq.nlargest(MAX_COMPONENTS, components.items(), key=lambda item: item[1])
        components = dict(kept)
        hosts = {key: hosts[key] for key in components}
    return TraceBreakdown(total, components, hosts)


@dataclass(slots=True)
class NormalProfile:
    """The running mean breakdown of a stream's normal tail traces.

    Means are plain averages over the first ``1 / fading`` traces, then exponentially weighted, so the
    profile follows slow change (a deploy, the daily curve) and never holds more than one number per
    component. A component missing from a trace counts as 0 for it.
    """

    fading: float = 0.02
    traces: int = 0
    total_ns: float = 0.0
    means: dict[Key, float] = field(default_factory=dict)
    normal_trace_id: bytes | None = None  # a typical normal request, shown beside the slow one

    def learn(self, b: TraceBreakdown) -> None:
        if not b.components:
            return
        self.traces += 1
        alpha = max(1.0 / self.traces, self.fading)
        self.total_ns += alpha * (b.total_ns - self.total_ns)
        for key in self.means.keys() - b.components.keys():
            self.means[key] -= alpha * self.means[key]
        for key, value in b.components.items():
            old = self.means.get(key, 0.0)
            self.means[key] = old + alpha * (value - old)
        if len(self.means) > 2 * MAX_COMPONENTS:  # the smallest means go: what was common stays
            for key, _ in heapq.nsmallest(len(self.means) - 2 * MAX_COMPONENTS, self.means.items(),
                                          key=lambda item: item[1]):
                del self.means[key]


def attribute(slow: Sequence[TraceBreakdown], profile: NormalProfile, flags: Sequence[ResourceFlag],
              max_causes: int = 5) -> list[Cause]:
    """Ranked causes of the growth from ``profile`` to the ``slow`` traces, best first."""
    slow = [b for b in slow if b.components]
    if not slow or profile.traces == 0:
        return []
    n = len(slow)
    observed: dict[Key, float] = {}
    for b in slow:
        for key, value in b.components.items():
            observed[key] = observed.get(key, 0.0) + value / n
    added = sum(b.total_ns for b in slow) / n - profile.total_ns
    baseline = dict(profile.means)
    _add_network_rollups(observed)
    _add_network_rollups(baseline)
    growth = {key: observed.get(key, 0.0) - baseline.get(key, 0.0) for key in observed.keys() | baseline.keys()}
    denominator = max(added, sum(g for key, g in growth.items() if not _is_rollup(key) and g > 0), 1.0)

    ranked: list[tuple[float, Key]] = []
    for key, g in growth.items():
        score = min(g / denominator, 1.0)
        if score < MIN_SCORE:
            continue
        rank_score = score
        if _is_rollup(key):
            top_part = max((growth[k] for k in growth if _part_of(k, key)), default=0.0)
            if top_part >= SPECIFIC_SPAN_SHARE * g:
                if key[0] == "network":
                    continue  # a service's network that is mostly one hop or call says nothing that one does not
                rank_score = top_part / denominator - 1e-9  # just behind its dominant span
        ranked.append((rank_score, key))
    ranked = _callers_behind_callees(ranked, growth)
    ranked.sort(key=lambda item: _rank_key(item, growth))

    causes: list[Cause] = []
    for _, key in ranked:
        host = _serving_host(key if key[0] != "network" or key[2] is not None else ("service", key[1], None, None),
                             slow, profile)
        score = min(growth[key] / denominator, 1.0)
        base, obs = baseline.get(key, 0.0) / MS, observed.get(key, 0.0) / MS
        causes.append(_component_cause(key, host, score, base, obs))
    return _join_resources(causes, flags)[:max_causes]


def _add_network_rollups(means: dict[Key, float]) -> None:
    """Add each service's network: the hops into and out of it, and its calls that no server answered."""
    rollups: dict[Key, float] = {}
    for (kind, service, operation, peer), value in means.items():
        if kind == "network" and operation is not None:
            touched = {service, peer}
        elif kind == "span" and peer == UNANSWERED:
            touched = {service}
        else:
            continue
        for name in touched:
            if name is not None:
                key: Key = ("network", name, None, None)
                rollups[key] = rollups.get(key, 0.0) + value
    means.update(rollups)


def _is_rollup(key: Key) -> bool:
    return key[0] == "service" or (key[0] == "network" and key[2] is None)


def _part_of(part: Key, rollup: Key) -> bool:
    """Is ``part`` one of the components summed into ``rollup`` (a service's span, a hop of its network)?"""
    if rollup[0] == "service":
        return part[0] == "span" and part[1] == rollup[1]
    if part[0] == "span":
        return part[3] == UNANSWERED and part[1] == rollup[1]
    return part[0] == "network" and part[2] is not None and rollup[1] in (part[1], part[3])


def _callers_behind_callees(ranked: list[tuple[float, Key]], growth: dict[Key, float]) -> list[tuple[float, Key]]:
    """A service's network whose largest part is a hop it made goes just behind the network of that hop's
    callee when the callee's explains nearly as much (within ``CALLER_NETWORK_MARGIN``).

    Both sums hold the same slowed hops, and both scores are capped at 1: a request that also waited a little
    longer on its way into the caller would otherwise put the caller first. A delay in front of a service
    slows every call into it, from any caller; the caller's own network would have slowed its inbound hops as
    well, and grows by far more than its callee's then.
    """
    scores = {key: score for score, key in ranked}
    out = []
    for score, key in ranked:
        top = _largest_part(key, growth)
        if top is not None and top[0] == "network" and top[1] != key[1]:
            callee: Key = ("network", top[1], None, None)
            if callee in scores and growth[key] < CALLER_NETWORK_MARGIN * growth[callee]:
                score = min(score, scores[callee] - 1e-9)
        out.append((score, key))
    return out


def _largest_part(key: Key, growth: dict[Key, float]) -> Key | None:
    """The component that grew most of those summed into a service's network ``key`` (None for other keys)."""
    if key[0] != "network" or key[2] is not None:
        return None
    return max((k for k in growth if _part_of(k, key)), key=lambda k: growth[k], default=None)


def _rank_key(item: tuple[float, Key], growth: dict[Key, float]) -> tuple[float, int, str, str, str, str]:
    """Best first. Between equals, a service's network goes behind another answer when its largest part is a
    hop it made (the same hops slowed its callee's network) or a call nobody answered (a slow database is
    no more the caller's network than its service)."""
    score, key = item
    top = _largest_part(key, growth)
    behind = int(top is not None and (top[0] == "span" or top[1] != key[1]))
    return (-round(score, 9), behind, key[0], key[1], key[2] or "", key[3] or "")


def _serving_host(key: Key, slow: Sequence[TraceBreakdown], profile: NormalProfile) -> str | None:
    """The host whose slow traces put the most time into ``key`` beyond normal."""
    normal = profile.means.get(key, 0.0)
    excess: dict[str | None, float] = {}
    for b in slow:
        if key in b.components:
            host = b.hosts.get(key)
            excess[host] = excess.get(host, 0.0) + b.components[key] - normal
    if not excess:
        return None
    return max(excess.items(), key=lambda item: (item[1], item[0] or ""))[0]


def _component_cause(key: Key, host: str | None, score: float, base: float, obs: float) -> Cause:
    kind, service, operation, peer = key
    peer = None if peer == UNANSWERED else peer
    if kind == "network" and operation is None:
        summary = (f"The network of {service} (every hop into and out of it) held {obs:.1f} ms per slow request "
                   f"against {base:.1f} ms normally.")
        return Cause(kind=CauseKind.NETWORK, score=score, summary=summary, service=service, host=host,
                     baseline=round(base, 3), observed=round(obs, 3), unit="ms")
    if kind == "network":
        summary = (f"The hop {peer} -> {service} ({operation}) spent {obs:.1f} ms in the network and queues per "
                   f"slow request against {base:.1f} ms normally.")
        return Cause(kind=CauseKind.NETWORK, score=score, summary=summary, service=service, operation=operation,
                     peer_service=peer, host=host, baseline=round(base, 3), observed=round(obs, 3), unit="ms")
    if kind == "service":
        summary = (f"Service {service} held the critical path for {obs:.1f} ms per slow request against "
                   f"{base:.1f} ms normally.")
        return Cause(kind=CauseKind.SERVICE, score=score, summary=summary, service=service, host=host,
                     baseline=round(base, 3), observed=round(obs, 3), unit="ms")
    summary = (f"Span {operation} of {service} took {obs:.1f} ms of the critical path per slow request "
               f"against {base:.1f} ms normally.")
    return Cause(kind=CauseKind.SPAN, score=score, summary=summary, service=service, operation=operation,
                 host=host, baseline=round(base, 3), observed=round(obs, 3), unit="ms")


def _join_resources(causes: list[Cause], flags: Sequence[ResourceFlag]) -> list[Cause]:
    """Join each flagged resource of a host that served a top cause, and that can explain it, to that cause.

    A GPU or CPU explains a span's (or service's) own time; network errors, drops and retransmits explain a
    hop. A flag that cannot explain the kind of cause beside it (CPU steal next to a slow network hop) is
    left out. One that can goes just ahead of the cause when its size accounts for the cause's growth
    (see :meth:`ResourceFlag.max_slowdown`), else just behind it, as evidence.
    """
    if not flags:
        return causes
    out: list[Cause] = []
    used: set[tuple[str, str, str]] = set()
    for cause in causes:
        ahead: list[Cause] = []
        behind: list[Cause] = []
        if len(out) < 3 and cause.host is not None:  # only the top components are explained by their host
            for flag in sorted(flags, key=lambda f: (-f.severity, f.metric, f.series)):
                marker = (flag.host, flag.metric, flag.series)
                if flag.host != cause.host or marker in used or cause.kind not in flag.explains:
                    continue
                used.add(marker)
                what = f"{cause.operation} of {cause.service}" if cause.operation else f"service {cause.service}"
                joined = Cause(kind=CauseKind.RESOURCE, score=cause.score, service=cause.service,
                               operation=cause.operation, host=flag.host, resource=flag.metric,
                               baseline=flag.baseline, observed=flag.observed, unit=flag.unit,
                               summary=f"{flag.summary} on {flag.host}, which served the slow {what}.")
                (ahead if _accounts_for(flag, cause) else behind).append(joined)
        out += [*ahead, cause, *behind]
    return out


def _accounts_for(flag: ResourceFlag, cause: Cause) -> bool:
    """Can the resource's move make the cause's component as much slower as it became (with some slack)?"""
    if not cause.baseline or cause.observed is None:
        return flag.max_slowdown == math.inf  # from nothing to something: only an unbounded resource explains it
    return cause.observed / cause.baseline <= ACCOUNT_SLACK * flag.max_slowdown
