"""The regression gate and the serving analyses over stored spans (synchronous: the API runs them in its pool).

Storage streams the span blocks of a time range (``Reader.span_payloads``),
``spikehound.span_scan`` keeps what each analysis needs, and the pure
computation in ``spikehound/detectors/`` (compare, batching, breakdown) does the rest.

A *selection* says which requests make up one side:

* ``KEY=VALUE``: spans of resources whose attribute KEY has that value
  (``service.version=1.4.2``, ``deployment.environment=canary``), within the
  query's time range;
* ``VALUE`` alone: the same with ``service.version``;
* ``SINCE..UNTIL``: every span in that time window (RFC 3339 or unix seconds).

Selecting by attribute selects spans, not whole traces: when only the model
server runs the candidate version, the comparison is of the model server's
operations and of the critical paths within them.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from spikehound.detectors.batching import BatchingReport, analyze_batching, batch_requests
from spikehound.detectors.breakdown import PipelineBreakdown, pipeline_breakdown
from spikehound.detectors.compare import CompareOptions, compare, comparison_report
from spikehound.detectors.profile import Profile, build_profile, stage_times_by_operation
from spikehound.span_scan import SpanScan, scan_block
from spikehound.storage.reader import Reader
from spikehound.timefmt import parse_time, rfc3339

DEFAULT_ATTRIBUTE = "service.version"
GPU_UTILIZATION = "hw.gpu.utilization"
DEFAULT_MAX_TRACES = 5_000


@dataclass(frozen=True, slots=True)
class Selection:
    text: str
    attribute: tuple[str, str] | None
    since_ns: int
    until_ns: int

    def describe(self) -> dict[str, Any]:
        return {"selector": self.text, "since": rfc3339(self.since_ns), "until": rfc3339(self.until_ns)}

    def scan(self, **options: Any) -> SpanScan:
        return SpanScan(self.since_ns, self.until_ns, attribute=self.attribute, **options)


def parse_selection(text: str, since_ns: int, until_ns: int) -> Selection:
    """``KEY=VALUE``, a bare ``service.version`` value, or ``SINCE..UNTIL``; ValueError says what is wrong.

    >>> parse_selection("1.4.2", 0, 10).attribute
    ('service.version', '1.4.2')
    >>> parse_selection("deployment.environment=canary", 0, 10).attribute
    ('deployment.environment', 'canary')
    >>> s = parse_selection("1700000000..1700003600", 0, 10)
    >>> s.attribute, s.since_ns, s.until_ns
    (None, 1700000000000000000, 1700003600000000000)
    """
    text = text.strip()
    if not text:
        raise ValueError("a selection is KEY=VALUE, a service.version value, or SINCE..UNTIL")
    if "=" in text:
        key, value = (part.strip() for part in text.split("=", 1))
        if not key or not value:
            raise ValueError(f"{text!r}: a selection by attribute is KEY=VALUE")
        return Selection(text, (key, value), since_ns, until_ns)
    if ".." in text:
        first, last = text.split("..", 1)
        since, until = parse_time(first), parse_time(last)
        if since >= until:
            raise ValueError(f"{text!r}: the window's start must be before its end")
        return Selection(text, None, since, until)
    return Selection(text, (DEFAULT_ATTRIBUTE, text), since_ns, until_ns)


class _GcPause:
    """Pause Python's cyclic garbage collector while any analysis runs.

    A scan allocates a wrapper per decoded span, and each collection those allocations trigger walks the
    collector's many long-lived objects too: on a large comparison they cost as much as the scan. Reference counting
    still frees everything at once; only reference cycles wait until the last analysis ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._resume = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._resume:
                    gc.enable()


gc_paused = _GcPause()


def run_scans(reader: Reader, scans: Sequence[SpanScan]) -> None:
    """Feed the stored blocks to every scan: one pass per distinct time range."""
    by_range: dict[tuple[int, int], list[SpanScan]] = {}
    for scan in scans:
        by_range.setdefault((scan.since_ns, scan.until_ns), []).append(scan)
    for (since, until), group in by_range.items():
        for payload in reader.span_payloads(since, until):
            scan_block(payload, group)
        for scan in group:
            scan.finish()


def _profile(selection: Selection, scan: SpanScan) -> Profile:
    meta = {**selection.describe(), "spans": scan.spans, "path_sampled": scan.sampled}
    return build_profile(scan.durations, scan.traces(), since_ns=selection.since_ns, until_ns=selection.until_ns,
                         meta=meta)


def profile(reader: Reader, selection: Selection, *, max_traces: int = DEFAULT_MAX_TRACES) -> Profile:
    """The latency profile of one selection (what ``spikehound baseline save`` keeps)."""
    with gc_paused():
        scan = selection.scan(max_traces=max_traces)
        run_scans(reader, [scan])
        return _profile(selection, scan)


def compare_selections(reader: Reader, baseline: Selection, candidate: Selection, options: CompareOptions, *,
                       max_traces: int = DEFAULT_MAX_TRACES) -> dict[str, Any]:
    """The comparison report (JSON) of two selections; both are read in one pass when their ranges agree."""
    with gc_paused():
        scans = [baseline.scan(max_traces=max_traces), candidate.scan(max_traces=max_traces)]
        run_scans(reader, scans)
        base, cand = _profile(baseline, scans[0]), _profile(candidate, scans[1])
        return comparison_report(compare(base, cand, options), base, cand)


def batching(reader: Reader, service: str, selection: Selection, *, attribute: str, p99_target_ns: float | None,
             min_requests: int, seed: int = 0) -> BatchingReport:
    """Per batch size of ``service``: latency, throughput, GPU utilization; and the sweet spot."""
    with gc_paused():
        scan = selection.scan(service=service, max_traces=None, keep_attribute=attribute)
        run_scans(reader, [scan])
        requests, missing = batch_requests(scan.traces(), service, attribute)
    hosts = {r.host for r in requests if r.host}
    gpu: dict[str, list[tuple[int, float]]] = {}
    if requests:
        start, end = min(r.start_ns for r in requests), max(r.end_ns for r in requests) + 1
        series, _ = reader.metrics(None, GPU_UTILIZATION, start, end, max_points=500_000)
        for s in series:
            if s.host in hosts:
                gpu.setdefault(s.host, []).extend(s.points)
    report = analyze_batching(requests, gpu, p99_target_ns=p99_target_ns, min_requests=min_requests, seed=seed,
                              without_attribute=missing)
    if scan.truncated:
        report.message += f" (only the first {scan.max_spans:,} spans were read; narrow the time range)"
    return report


def pipeline(reader: Reader, service: str, operation: str | None, selection: Selection, *,
             max_traces: int = DEFAULT_MAX_TRACES) -> list[PipelineBreakdown]:
    """Where the time of ``service``'s requests goes, median against p99, per operation (busiest first)."""
    with gc_paused():
        scan = selection.scan(max_traces=max_traces)
        run_scans(reader, [scan])
        per_op = stage_times_by_operation(scan.traces(), selection.since_ns, selection.until_ns)
    out = [pipeline_breakdown(svc, op, requests) for (svc, op), requests in per_op.items()
           if svc == service and (operation is None or op == operation)]
    return sorted((b for b in out if b is not None), key=lambda b: (-b.requests, b.operation))
