"""The scenario suite: detection recall, false spikes, delay and cause accuracy, against two baselines.

``python -m benchmarks.detection [--seeds N] [--family all|inference|mesh]`` prints the table (part of
``make bench``); ``tests/test_detection_suite.py`` runs a subset and holds it to the bars. Both run and
score the suite with this module.

Two families of traffic. This module's own is **dense inference traffic** (below); the second,
**sparse, lumpy microservice traffic** of the shape real benchmark systems have, is
:mod:`harness.mesh_detection`, run after it.

Every fault of :mod:`harness.scenarios.traffic` runs at a large and a subtle strength, and every control
once, per seed, through the same :class:`spikehound.detectors.engine.DetectionEngine` the collector runs, in
event time. Scored:

- **recall**: a fault is found when a spike opens on any stream between one window before its onset
  and its end;
- **false spikes per hour**: spikes that open anywhere else (all of a control run; a fault run outside
  the fault), per hour of normal traffic;
- **delay**: event time from the fault's onset to the detection of its first spike;
- **top-1 / top-3**: of every spike opened during a fault, whether its first (first three) causes name
  the injected fault.

Two baselines run on the same traffic: a **static p99 threshold** per stream, the usual Prometheus
alert (1.5 x the stream's median window p99 over the first five minutes, one window over it fires;
it names no cause), and **the span with the highest mean duration** in the slow requests of each
spike spikehound found (the entry span itself excluded), as a cause ranking.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.scenarios.traffic import CONTROLS, FAULTS, Scenario, Truth
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import Cause, LatencyWindow, Spike
from spikehound.units import NS


@dataclass(slots=True)
class RunResult:
    scenario: Scenario
    spikes: dict[str, Spike]  # final state by id
    windows: list[LatencyWindow]
    highest_mean_span: dict[str, tuple[str, str] | None] = field(default_factory=dict)
    spans: int = 0
    seconds: float = 0.0


def run(scenario: Scenario, settings: DetectionSettings | None = None) -> RunResult:
    """Feed one scenario through a fresh engine, second by second, as the collector would."""
    engine = DetectionEngine(settings or DetectionSettings())
    spikes: dict[str, Spike] = {}
    windows: list[LatencyWindow] = []
    result = RunResult(scenario, spikes, windows)
    started = time.perf_counter()
    for batch in scenario.batches():
        engine.add(batch.spans, batch.points)
        result.spans += len(batch.spans)
        step = engine.advance()
        windows.extend(step.windows)
        for spike in step.spikes:
            if spike.id not in spikes and spike.causes:
                result.highest_mean_span[spike.id] = _highest_mean_span(engine, spike)
            spikes[spike.id] = spike
    step = engine.flush()
    windows.extend(step.windows)
    for spike in step.spikes:
        spikes[spike.id] = spike
    result.seconds = time.perf_counter() - started
    return result


def _highest_mean_span(engine: DetectionEngine, spike: Spike) -> tuple[str, str] | None:
    """The baseline ranking: the (service, span) with the highest mean duration in the spike's slow traces."""
    sums: dict[tuple[str, str], list[int]] = defaultdict(list)
    for trace_id, entry_id in engine.slow_traces(spike.id):
        for span in engine.traces.trace(trace_id):
            if span.span_id != entry_id:
                sums[(span.service, span.name)].append(span.duration_ns)
    if not sums:
        return None
    return max(sums, key=lambda k: statistics.fmean(sums[k]))


def matches(cause: Cause, truth: Truth) -> bool:
    """Does ``cause`` name the injected fault?"""
    if truth.kind == "network":
        return (cause.kind.value == "network" and cause.service == truth.service
                and cause.peer_service == truth.peer_service)
    if truth.fault == "gpu_drop":
        return cause.host == truth.host and (
            (cause.kind.value == "resource" and cause.resource in truth.resources)
            or (cause.kind.value == "span" and cause.service == truth.service and cause.operation == truth.operation))
    if truth.kind == "service":
        return cause.kind.value == "service" and cause.service == truth.service
    # A span fault: the span, or its service's CPU saturating on the hosts that ran it (CPU-bound work).
    if cause.kind.value == "span":
        return cause.service == truth.service and cause.operation == truth.operation
    return cause.kind.value == "resource" and cause.resource in truth.resources and cause.service == truth.service


def _baseline_matches(found: tuple[str, str] | None, truth: Truth) -> bool:
    if found is None:
        return False
    if truth.kind == "network":
        return False  # a span duration cannot name a hop
    if truth.kind == "service":
        return found[0] == truth.service
    return found == (truth.service, truth.operation)


@dataclass(slots=True)
class Score:
    faults: int = 0
    found: int = 0
    delays_s: list[float] = field(default_factory=list)
    normal_hours: float = 0.0
    false_spikes: int = 0
    attributed: int = 0
    top1: int = 0
    top3: int = 0
    baseline_top1: int = 0
    static_found: int = 0
    static_false: int = 0
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    false_labels: list[str] = field(default_factory=list)

    def line(self) -> dict[str, float]:
        return {
            "recall": self.found / self.faults if self.faults else 1.0,
            "false_per_hour": self.false_spikes / self.normal_hours if self.normal_hours else 0.0,
            "top1": self.top1 / self.attributed if self.attributed else 0.0,
            "top3": self.top3 / self.attributed if self.attributed else 0.0,
            "delay_median_s": statistics.median(self.delays_s) if self.delays_s else float("nan"),
            "delay_max_s": max(self.delays_s) if self.delays_s else float("nan"),
            "static_recall": self.static_found / self.faults if self.faults else 1.0,
            "static_false_per_hour": self.static_false / self.normal_hours if self.normal_hours else 0.0,
            "baseline_top1": self.baseline_top1 / self.attributed if self.attributed else 0.0,
        }


def score(results: Sequence[RunResult], window_ns: int) -> Score:
    out = Score()
    for r in results:
        sc = r.scenario
        run_hours = (sc.end_ns - sc.start_ns) / NS / 3600
        if sc.is_fault:
            out.faults += 1
            out.normal_hours += run_hours - sc.fault_s / 3600
            lo, hi = sc.onset_ns - window_ns, sc.fault_end_ns
            during = [s for s in r.spikes.values() if lo <= s.start_unix_nano < hi]
            outside = [s for s in r.spikes.values() if not lo <= s.start_unix_nano < hi]
            if during:
                out.found += 1
                first = min(s.detected_unix_nano or s.start_unix_nano for s in during)
                out.delays_s.append((first - sc.onset_ns) / NS)
            else:
                out.missed.append(sc.label())
            truth = sc.truth()
            for s in during:
                out.attributed += 1
                if s.causes and matches(s.causes[0], truth):
                    out.top1 += 1
                else:
                    out.wrong.append(f"{sc.label()} seed {sc.seed} {s.service}/{s.operation}: "
                                     + (s.causes[0].summary if s.causes else "no cause"))
                if any(matches(c, truth) for c in s.causes[:3]):
                    out.top3 += 1
                if _baseline_matches(r.highest_mean_span.get(s.id), truth):
                    out.baseline_top1 += 1
            static = _static_alerts(r.windows, sc)
            if any(lo <= t < hi for t in static):
                out.static_found += 1
            out.static_false += sum(1 for t in static if not lo <= t < hi)
        else:
            out.normal_hours += run_hours
            outside = list(r.spikes.values())
            out.static_false += len(_static_alerts(r.windows, sc))
        out.false_spikes += len(outside)
        out.false_labels.extend(f"{sc.label()} seed {sc.seed} {s.service}/{s.operation} "
                                f"p99 {s.p99_ns / 1e6:.1f} vs {s.baseline_p99_ns / 1e6:.1f} ms" for s in outside)
    return out


def _static_alerts(windows: Sequence[LatencyWindow], sc: Scenario) -> list[int]:
    """Start times of alert firings of a static per-stream p99 threshold (1.5 x the first 5 minutes' median)."""
    learn_until = sc.start_ns + 300 * NS
    by_stream: dict[tuple[str, str], list[LatencyWindow]] = defaultdict(list)
    for w in windows:
        by_stream[(w.service, w.operation)].append(w)
    firings: list[int] = []
    for stream_windows in by_stream.values():
        early = [w.p99_ns for w in stream_windows if w.start_unix_nano < learn_until and w.count >= 10]
        if len(early) < 10:
            continue
        threshold = 1.5 * statistics.median(early)
        firing = False
        for w in sorted(stream_windows, key=lambda w: w.start_unix_nano):
            over = w.start_unix_nano >= learn_until and w.count >= 10 and w.p99_ns > threshold
            if over and not firing:
                firings.append(w.start_unix_nano)
            firing = over
    return firings


def scenarios(seeds: Sequence[int], minutes: float = 14.0) -> list[Scenario]:
    out = [Scenario(f, strength, seed=seed, minutes=minutes) for seed in seeds for f in FAULTS
           for strength in ("large", "subtle")]
    out += [Scenario(c, seed=seed, minutes=minutes) for seed in seeds for c in CONTROLS]
    return out
