"""Where the time goes: shares of critical-path time by stage, for median and for p99 requests.

Requests of one operation (each with its duration and its stage times from
``spikehound.detectors.path_time``) are sorted by latency. The *median* group is the
requests ranked within ``median_band`` of the middle; the *p99* group is the
requests at or above the p99 (the slowest 1 %, at least ``min_group``). For
each group and stage: the mean time per request and the share of the group's
total latency. Stages are span self times and network/queue gaps; their
rollup by service books each span's self time to its service and every gap to
``network``. Shares of a group add up to 100 %.

>>> from spikehound.detectors.path_time import Stage
>>> resize, forward = Stage("span", "pre", "resize"), Stage("span", "model", "forward")
>>> normal = [(10 * MS, {resize: 2 * MS, forward: 8 * MS})] * 98
>>> slow = [(50 * MS, {resize: 42 * MS, forward: 8 * MS})] * 2
>>> b = pipeline_breakdown("gw", "GET /", normal + slow, min_group=2)
>>> [(s.stage.name, round(s.median_share, 2), round(s.tail_share, 2)) for s in b.stages]
[('resize', 0.2, 0.84), ('forward', 0.8, 0.16)]
>>> print(b.headline)
p99 requests (2, from 50.0 ms): 84% in pre: resize (median requests: 20%); median requests: 80% in model: forward
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spikehound.detectors.path_time import Stage
from spikehound.units import MS

__all__ = ["PipelineBreakdown", "ServiceShare", "StageShare", "pipeline_breakdown"]

NETWORK = "network"


@dataclass(slots=True)
class StageShare:
    stage: Stage
    median_ns: float  # mean per request of the median group
    median_share: float
    tail_ns: float  # mean per request of the p99 group
    tail_share: float


@dataclass(slots=True)
class ServiceShare:
    service: str  # or "network" for every network/queue gap
    median_ns: float
    median_share: float
    tail_ns: float
    tail_share: float


@dataclass(slots=True)
class PipelineBreakdown:
    service: str
    operation: str
    requests: int
    median_count: int
    median_latency_ns: tuple[int, int]  # latency range of the median group
    tail_count: int
    tail_latency_ns: tuple[int, int]
    stages: list[StageShare]  # by p99 share, largest first
    services: list[ServiceShare]

    @property
    def headline(self) -> str:
        top = self.stages[0]
        line = (f"p99 requests ({self.tail_count}, from {self.tail_latency_ns[0] / MS:.1f} ms): "
                f"{top.tail_share:.0%} in {top.stage.label} (median requests: {top.median_share:.0%})")
        median_top = max(self.stages, key=lambda s: s.median_share)
        if median_top is not top:
            line += f"; median requests: {median_top.median_share:.0%} in {median_top.stage.label}"
        return line

    def to_json(self) -> dict[str, Any]:
        def share(ns: float, fraction: float) -> dict[str, float]:
            return {"ms": ns / MS, "share": fraction}

        return {"service": self.service, "operation": self.operation, "requests": self.requests,
                "median": {"count": self.median_count, "latency_ms": [t / MS for t in self.median_latency_ns]},
                "p99": {"count": self.tail_count, "latency_ms": [t / MS for t in self.tail_latency_ns]},
                "headline": self.headline,
                "stages": [{"kind": s.stage.kind, "service": s.stage.service, "name": s.stage.name,
                            "peer_service": s.stage.peer_service, "label": s.stage.label,
                            "median": share(s.median_ns, s.median_share), "p99": share(s.tail_ns, s.tail_share)}
                           for s in self.stages],
                "services": [{"service": s.service, "median": share(s.median_ns, s.median_share),
                              "p99": share(s.tail_ns, s.tail_share)} for s in self.services]}


def _totals(group: Sequence[tuple[int, Mapping[Stage, int]]]) -> tuple[dict[Stage, int], int]:
    per_stage: dict[Stage, int] = {}
    for _, stages in group:
        for stage, ns in stages.items():
            per_stage[stage] = per_stage.get(stage, 0) + ns
    return per_stage, sum(duration for duration, _ in group)


def pipeline_breakdown(service: str, operation: str, requests: Sequence[tuple[int, Mapping[Stage, int]]], *,
                       tail_quantile: float = 0.99, median_band: float = 0.05, min_group: int = 5
                       ) -> PipelineBreakdown | None:
    """The breakdown of one operation's requests; None without requests."""
    n = len(requests)
    if n == 0:
        return None
    ordered = sorted(requests, key=lambda r: r[0])
    want = min(min_group, n)
    lo, hi = math.floor((0.5 - median_band) * n + 1e-9), math.ceil((0.5 + median_band) * n - 1e-9)
    if hi - lo < want:
        lo = max(0, min(n - want, n // 2 - want // 2))
        hi = lo + want
    median = ordered[lo:hi]
    first_tail = min(max(math.ceil(tail_quantile * n - 1e-9), 1), n) - 1  # 0-based index of the p99 request
    tail = ordered[min(first_tail, n - want):]

    (m_stage, m_total), (t_stage, t_total) = _totals(median), _totals(tail)
    stages = [StageShare(stage, m_stage.get(stage, 0) / len(median), m_stage.get(stage, 0) / max(m_total, 1),
                         t_stage.get(stage, 0) / len(tail), t_stage.get(stage, 0) / max(t_total, 1))
              for stage in set(m_stage) | set(t_stage)]
    stages.sort(key=lambda s: (-s.tail_share, -s.median_share, s.stage))
    by_service: dict[str, list[float]] = {}
    for s in stages:
        row = by_service.setdefault(NETWORK if s.stage.kind == "network" else s.stage.service, [0.0] * 4)
        for i, value in enumerate((s.median_ns, s.median_share, s.tail_ns, s.tail_share)):
            row[i] += value
    services = sorted((ServiceShare(name, *values) for name, values in by_service.items()),
                      key=lambda s: (-s.tail_share, s.service))
    return PipelineBreakdown(service, operation, n, len(median), (median[0][0], median[-1][0]), len(tail),
                     (tail[0][0], tail[-1][0]), stages, services)
