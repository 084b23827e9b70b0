"""Batch-size analysis: latency, throughput and GPU utilization per batch size, and the sweet spot.

A service's requests (its entry spans) are grouped by a batch-size attribute,
read from the entry span or, when the server sets it deeper (on the forward
pass), from the first span of the same service below it that has it. Per batch
size: p50/p95/p99 (with a bootstrap interval for the p99), throughput, and the
mean ``hw.gpu.utilization`` of the hosts that served those requests, over the
time those requests ran.

Throughput is requests per second between the group's first start and last
end: what a batching experiment measures when batch sizes are run one after
another. When sizes interleave in time it is each size's share of the traffic.

The recommendation is the largest batch size whose p99 stays within the target
(among sizes with ``min_requests`` requests), with its throughput against the
smallest batch size's.

>>> reqs = [BatchRequest(str(b), (5 + 2 * b) * 1_000_000, i * 40_000_000 // b, i * 40_000_000 // b + 1, "gpu-1")
...         for b in (1, 4, 8) for i in range(200)]
>>> report = analyze_batching(reqs, {}, p99_target_ns=15e6, min_requests=100)
>>> [(g.batch, g.p99_ns / 1e6) for g in report.groups]
[('1', 7.0), ('4', 13.0), ('8', 21.0)]
>>> report.recommended.batch, report.message
('4', 'batch size 4: p99 13.0 ms within the 15.0 ms target, 101 req/s: 4.0x the throughput of batch size 1')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spikehound.detectors.bootstrap import DEFAULT_REPLICATES, OrderStatistics, interval
from spikehound.model import Span
from spikehound.units import MS, NS

__all__ = ["BatchGroup", "BatchRequest", "BatchingReport", "analyze_batching", "batch_requests"]


@dataclass(frozen=True, slots=True)
class BatchRequest:
    batch: str  # the attribute's value, as text
    duration_ns: int
    start_ns: int
    end_ns: int
    host: str | None


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def batch_requests(traces: Iterable[Sequence[Span]], service: str, attribute: str = "batch.size"
                   ) -> tuple[list[BatchRequest], int]:
    """The service's requests with their batch size, and how many requests had none."""
    out: list[BatchRequest] = []
    missing = 0
    for spans in traces:
        children: dict[bytes, list[Span]] = {}
        for s in spans:
            if s.parent_span_id is not None:
                children.setdefault(s.parent_span_id, []).append(s)
        for entry in spans:
            if entry.service != service or not entry.is_entry:
                continue
            value = _find(entry, children, attribute)
            if value is None:
                missing += 1
            else:
                out.append(BatchRequest(_text(value), entry.duration_ns, entry.start_unix_nano, entry.end_unix_nano,
                                        entry.host))
    return out, missing


def _find(entry: Span, children: dict[bytes, list[Span]], attribute: str) -> Any:
    """The attribute on the entry span, else on the earliest-starting span of its service below it."""
    level = [entry]
    seen = {entry.span_id}
    while level:
        for span in sorted(level, key=lambda s: s.start_unix_nano):
            value = span.attributes.get(attribute)
            if value is not None:
                return value
        level = [c for s in level for c in children.get(s.span_id, ())
                 if c.service == entry.service and c.span_id not in seen and not seen.add(c.span_id)]
    return None


@dataclass(slots=True)
class BatchGroup:
    batch: str
    size: float | None  # numeric batch size, None when the value is not a number
    count: int
    p50_ns: float
    p95_ns: float
    p99_ns: float
    p99_ci_ns: tuple[float, float]
    throughput_rps: float | None
    active_seconds: float
    hosts: tuple[str, ...]
    gpu_utilization: float | None  # mean hw.gpu.utilization (0..1) of those hosts while these requests ran
    gpu_samples: int
    enough: bool  # at least min_requests requests

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "size": self.size, "count": self.count, "p50_ms": self.p50_ns / MS,
                "p95_ms": self.p95_ns / MS, "p99_ms": self.p99_ns / MS,
                "p99_ci_ms": [self.p99_ci_ns[0] / MS, self.p99_ci_ns[1] / MS],
                "throughput_rps": self.throughput_rps, "active_seconds": self.active_seconds,
                "hosts": list(self.hosts), "gpu_utilization": self.gpu_utilization, "gpu_samples": self.gpu_samples,
                "enough_data": self.enough}


@dataclass(slots=True)
class BatchingReport:
    groups: list[BatchGroup]
    p99_target_ns: float | None
    recommended: BatchGroup | None
    reference: BatchGroup | None  # the smallest batch size with enough requests
    message: str
    without_attribute: int = 0

    @property
    def throughput_gain(self) -> float | None:
        """Throughput of the recommendation over that of the smallest batch size."""
        r, ref = self.recommended, self.reference
        if r is None or ref is None or not r.throughput_rps or not ref.throughput_rps:
            return None
        return r.throughput_rps / ref.throughput_rps

    def to_json(self) -> dict[str, Any]:
        return {"groups": [g.to_json() for g in self.groups],
                "p99_target_ms": None if self.p99_target_ns is None else self.p99_target_ns / MS,
                "recommended": None if self.recommended is None else self.recommended.batch,
                "reference": None if self.reference is None else self.reference.batch,
                "throughput_gain": self.throughput_gain, "message": self.message,
                "requests_without_attribute": self.without_attribute}


def _size(batch: str) -> float | None:
    try:
        size = float(batch)
    except ValueError:
        return None
    return size if math.isfinite(size) else None


def _gpu(hosts: Iterable[str], start: int, end: int, gpu: Mapping[str, Sequence[tuple[int, float]]]
         ) -> tuple[float | None, int]:
    values: list[float] = []
    for host in hosts:
        points = gpu.get(host, ())
        values.extend(v for t, v in points if start <= t <= end)
    return (float(np.mean(values)) if values else None), len(values)


def analyze_batching(requests: Sequence[BatchRequest], gpu: Mapping[str, Sequence[tuple[int, float]]], *,
                     p99_target_ns: float | None = None, min_requests: int = 100, confidence: float = 0.95,
                     seed: int = 0, without_attribute: int = 0) -> BatchingReport:
    """Group ``requests`` by batch size; ``gpu`` maps host to its (time ns, utilization 0..1) samples."""
    rng = np.random.default_rng(seed)
    by_batch: dict[str, list[BatchRequest]] = {}
    for r in requests:
        by_batch.setdefault(r.batch, []).append(r)
    groups = []
    for batch, reqs in sorted(by_batch.items(), key=lambda kv: (_size(kv[0]) is None, _size(kv[0]) or 0, kv[0])):
        sample = OrderStatistics.of([r.duration_ns for r in reqs])
        start, end = min(r.start_ns for r in reqs), max(r.end_ns for r in reqs)
        active = (end - start) / NS
        hosts = tuple(sorted({r.host for r in reqs if r.host}))
        utilization, samples = _gpu(hosts, start, end, gpu)
        groups.append(BatchGroup(
            batch, _size(batch), len(reqs), sample.quantile(0.5) or 0.0, sample.quantile(0.95) or 0.0,
            sample.quantile(0.99) or 0.0, interval(sample.replicates(0.99, rng, DEFAULT_REPLICATES), confidence),
            len(reqs) / active if active > 0 and len(reqs) > 1 else None, active, hosts, utilization, samples,
            len(reqs) >= min_requests))
    judged = [g for g in groups if g.enough and g.size is not None]
    reference = judged[0] if judged else None
    recommended, message = _recommend(judged, groups, p99_target_ns, min_requests)
    report = BatchingReport(groups, p99_target_ns, recommended, reference, message, without_attribute)
    if recommended is not None and report.throughput_gain is not None and recommended is not reference:
        report.message += (f", {recommended.throughput_rps:.0f} req/s: {report.throughput_gain:.1f}x the "
                           f"throughput of batch size {reference.batch}")  # type: ignore[union-attr]
    return report


def _recommend(judged: list[BatchGroup], groups: list[BatchGroup], target: float | None, min_requests: int
               ) -> tuple[BatchGroup | None, str]:
    if not groups:
        return None, "no requests with a batch size"
    if not judged:
        return None, f"too little data: no numeric batch size has {min_requests} requests"
    if target is None:
        return None, "give a p99 target to get a recommendation"
    within = [g for g in judged if g.p99_ns <= target]
    if not within:
        best = min(judged, key=lambda g: g.p99_ns)
        return None, (f"no batch size keeps p99 within {target / MS:.1f} ms (lowest: batch size {best.batch}, "
                      f"p99 {best.p99_ns / MS:.1f} ms)")
    pick = max(within, key=lambda g: g.size or 0.0)
    return pick, f"batch size {pick.batch}: p99 {pick.p99_ns / MS:.1f} ms within the {target / MS:.1f} ms target"
