"""Attribution: which span, service, network hop or resource explains a spike's added latency.

Every trace is reduced to its critical-path *breakdown*: how much of its
latency each component held on the critical path (see
:func:`detectors.critical_path.critical_path_times`). Components are

- ``span``: a span's own time, keyed by (service, span name); a CLIENT span
  with no instrumented server behind it (a database call) is a span too;
- ``network``: a CLIENT span's time not covered by its SERVER child on the path,
  the network and queueing time of that hop, keyed by (callee service, callee
  operation, caller service);
- ``service``: the sum of a service's span components.

Each stream keeps a :class:`NormalProfile`, the mean breakdown of tail traces
(p90 and up) of its normal windows. When a spike opens, and while it lasts,
the same tail band of its windows is broken down the same way and compared
with the profile: a component's *score* is its growth's share of the added
latency. A service whose growth is mostly one span ranks after that span (the
span says more); a service whose growth is spread over its spans ranks first.
Resource flags (:mod:`detectors.resource`) on the hosts that served the top
components are joined in, ahead of the component they explain.

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

from collections.abc import Sequence
from dataclasses import dataclass, field

from detectors.critical_path import critical_path_times, hop_callees
from detectors.resource import ResourceFlag
from spikehound.model import Cause, CauseKind, Span

__all__ = ["Breakdown", "NormalProfile", "attribute", "breakdown"]

# (kind, service, operation, peer service); see the module docstring.
Key = tuple[str, str, str | None, str | None]
MS = 1e6
SPECIFIC_SPAN_SHARE = 0.6  # a span holding this much of its service's growth is the better answer
MIN_SCORE = 0.05  # components explaining less than 5 % of the added latency are not causes


@dataclass(slots=True)
class Breakdown:
    """One trace's critical-path time per component (ns), and the host that served each."""

    total_ns: int
    components: dict[Key, int]
    hosts: dict[Key, str | None]


def breakdown(spans: Sequence[Span], root: bytes | None = None) -> Breakdown:
    """The critical-path breakdown of the (sub)trace under ``root`` (the trace root when None)."""
    path = critical_path_times(spans, root)
    if not path:
        return Breakdown(0, {}, {})
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
            key = ("span", span.service, span.name, None)
            hosts.setdefault(key, span.host)
            service_key: Key = ("service", span.service, None, None)
            components[service_key] = components.get(service_key, 0) + self_ns
            hosts.setdefault(service_key, span.host)
        components[key] = components.get(key, 0) + self_ns
    return Breakdown(total, components, hosts)


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

    def learn(self, b: Breakdown) -> None:
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


def attribute(slow: Sequence[Breakdown], profile: NormalProfile, flags: Sequence[ResourceFlag],
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
    growth = {key: observed.get(key, 0.0) - profile.means.get(key, 0.0)
              for key in observed.keys() | profile.means.keys()}
    denominator = max(added, sum(g for key, g in growth.items() if key[0] != "service" and g > 0), 1.0)

    ranked: list[tuple[float, Key]] = []
    for key, g in growth.items():
        score = min(g / denominator, 1.0)
        if score < MIN_SCORE:
            continue
        rank_score = score
        if key[0] == "service":
            top_span = max((growth[k] for k in growth if k[0] == "span" and k[1] == key[1]), default=0.0)
            if top_span >= SPECIFIC_SPAN_SHARE * g:
                rank_score = top_span / denominator - 1e-9  # just behind its dominant span
        ranked.append((rank_score, key))
    ranked.sort(key=lambda item: (-item[0], item[1]))

    causes: list[Cause] = []
    for _, key in ranked:
        host = _serving_host(key, slow, profile)
        score = min(growth[key] / denominator, 1.0)
        base, obs = profile.means.get(key, 0.0) / MS, observed.get(key, 0.0) / MS
        causes.append(_component_cause(key, host, score, base, obs))
    return _join_resources(causes, flags)[:max_causes]


def _serving_host(key: Key, slow: Sequence[Breakdown], profile: NormalProfile) -> str | None:
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
    """Put each flagged resource of a host that served a top cause, and that can explain it, just ahead of it.

    A GPU or CPU explains a span's (or service's) own time; network errors, drops and retransmits explain a
    hop. A flag that cannot explain the cause beside it (CPU steal next to a slow network hop) is left out.
    """
    if not flags:
        return causes
    out: list[Cause] = []
    used: set[tuple[str, str, str]] = set()
    for cause in causes:
        if len(out) < 3 and cause.host is not None:  # only the top components are explained by their host
            for flag in sorted(flags, key=lambda f: (-f.severity, f.metric, f.series)):
                marker = (flag.host, flag.metric, flag.series)
                if flag.host != cause.host or marker in used or cause.kind.value not in flag.explains:
                    continue
                used.add(marker)
                what = f"{cause.operation} of {cause.service}" if cause.operation else f"service {cause.service}"
                out.append(Cause(kind=CauseKind.RESOURCE, score=cause.score, service=cause.service,
                                 operation=cause.operation, host=flag.host, resource=flag.metric,
                                 baseline=flag.baseline, observed=flag.observed, unit=flag.unit,
                                 summary=f"{flag.summary} on {flag.host}, which served the slow {what}."))
        out.append(cause)
    return out
