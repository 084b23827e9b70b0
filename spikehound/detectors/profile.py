"""A latency profile: what one side of a comparison looked like.

For every entry operation (service, span name of roots and SERVER spans, as in
the latency streams) it holds the latency of every request, and for each stage
of the operation's critical path (see ``spikehound.detectors.path_time``) the time that
stage held the path in each request it appeared in. Profiles are what
``spikehound baseline save`` writes and what ``spikehound.detectors.compare`` compares;
they serialise to plain JSON.

Request latencies come from every entry span; stage times come from whole
traces, which may be a uniform sample of the traces (``path_traces`` says how
many), because a critical path needs every span of a trace in memory.

>>> from spikehound.model import Span, SpanKind, StatusCode
>>> root = Span(trace_id=bytes(16), span_id=b"\\x01" * 8, parent_span_id=None, service="gw", host=None,
...             name="GET /", kind=SpanKind.SERVER, start_unix_nano=0, end_unix_nano=5_000_000,
...             status=StatusCode.UNSET)
>>> p = build_profile({("gw", "GET /"): [5_000_000, 7_000_000]}, [[root]], since_ns=0, until_ns=10**9)
>>> op = p.operations[("gw", "GET /")]
>>> op.latency.n, op.latency.quantile(0.99), [s.label for s in op.stages]
(2, 7000000.0, ['gw: GET /'])
>>> Profile.from_json(p.to_json()).operations[("gw", "GET /")].latency.quantile(0.5)
5000000.0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spikehound.detectors.bootstrap import DEFAULT_MAX_POINTS, OrderStatistics
from spikehound.detectors.path_time import Stage, entry_stage_times
from spikehound.model import Span

__all__ = ["FORMAT", "OperationProfile", "Profile", "build_profile", "stage_times_by_operation"]

FORMAT = "spikehound-profile/1"
OperationKey = tuple[str, str]


@dataclass(slots=True)
class OperationProfile:
    service: str
    operation: str
    latency: OrderStatistics  # every request's duration, ns
    stages: dict[Stage, OrderStatistics] = field(default_factory=dict)  # per stage: its path time in each request, ns
    path_requests: int = 0  # requests whose critical path the stages come from


@dataclass(slots=True)
class Profile:
    operations: dict[OperationKey, OperationProfile]
    path_traces: int = 0  # traces whose critical paths were walked
    meta: dict[str, Any] = field(default_factory=dict)  # selector, time range: shown, never computed on

    @property
    def requests(self) -> int:
        return sum(op.latency.n for op in self.operations.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.meta, "path_traces": self.path_traces, "operations": [
            {"service": op.service, "operation": op.operation, "latency_ns": op.latency.to_json(),
             "path_requests": op.path_requests,
             "stages": [{"kind": st.kind, "service": st.service, "name": st.name, "peer_service": st.peer_service,
                         "time_ns": sample.to_json()} for st, sample in sorted(op.stages.items())]}
            for _, op in sorted(self.operations.items())]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        """Read a profile (a saved baseline); raises ValueError saying what is wrong."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"not a spikehound latency profile (format {FORMAT!r} expected)")
        operations: dict[OperationKey, OperationProfile] = {}
        try:
            for item in data["operations"]:
                key = (str(item["service"]), str(item["operation"]))
                stages = {Stage(str(s["kind"]), str(s["service"]), str(s["name"]), s.get("peer_service")):
                          OrderStatistics.from_json(s["time_ns"]) for s in item.get("stages", ())}
                operations[key] = OperationProfile(key[0], key[1], OrderStatistics.from_json(item["latency_ns"]),
                                                   stages, int(item.get("path_requests", 0)))
            path_traces = int(data.get("path_traces", 0))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile operation entry is missing {exc}") from None
        meta = {k: v for k, v in data.items() if k not in ("format", "operations", "path_traces")}
        return cls(operations, path_traces, meta)


def stage_times_by_operation(traces: Iterable[Sequence[Span]], since_ns: int, until_ns: int
                             ) -> dict[OperationKey, list[tuple[int, dict[Stage, int]]]]:
    """Per entry operation: (request duration, stage times) of each entry span ending in [since, until)."""
    out: dict[OperationKey, list[tuple[int, dict[Stage, int]]]] = {}
    for spans in traces:
        for entry, stages in entry_stage_times(spans):
            if since_ns <= entry.end_unix_nano < until_ns:
                out.setdefault((entry.service, entry.name), []).append((entry.duration_ns, stages))
    return out


def build_profile(durations: Mapping[OperationKey, Sequence[int]], traces: Iterable[Sequence[Span]], *,
                  since_ns: int, until_ns: int, max_points: int = DEFAULT_MAX_POINTS,
                  meta: Mapping[str, Any] | None = None) -> Profile:
    """The profile of one side: ``durations`` of every request per operation, ``traces`` for the stages."""
    operations = {key: OperationProfile(key[0], key[1], OrderStatistics.of(values, max_points))
                  for key, values in durations.items() if len(values)}
    per_stage: dict[OperationKey, dict[Stage, list[int]]] = {}
    traces = list(traces)
    for key, requests in stage_times_by_operation(traces, since_ns, until_ns).items():
        if key not in operations:
            continue
        operations[key].path_requests = len(requests)
        stages = per_stage.setdefault(key, {})
        for _, times in requests:
            for stage, ns in times.items():
                stages.setdefault(stage, []).append(ns)
    for key, stages in per_stage.items():
        operations[key].stages = {stage: OrderStatistics.of(values, max_points) for stage, values in stages.items()}
    return Profile(operations, len(traces), dict(meta or {}))
