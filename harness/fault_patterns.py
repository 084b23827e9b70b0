"""Runs and scores the fault-pattern families (:mod:`harness.scenarios.fault_patterns`).

Each fault counts on its own, a return of the same fault included. Scored per family:

- **recall (2 min)**: a spike opens with its start between one window before the fault's onset and its
  end, detected within two minutes of the onset (event time);
- **spikes per fault**: spikes that start during the fault (one window of slack either side); exactly
  one is the goal. A fault with none is missed (a return folded into the spike before it is one);
- **end error**: the end of the fault's spike (its last one, when there are several) less the fault's
  end; a spike still open at the end of the timeline ends there;
- **onset error**: the spike's start less the fault's onset;
- **false spikes per 6 h**: spikes that start outside every fault, per six hours of calm traffic;
- **top-1 service**: whether the first cause of the fault's first spike names the faulty service;
- **causes held**: of faults found, whether the spike's final top cause names the same service as when
  it was first reported (a long fault must not drift to something else);
- **reachable in 2 min**: faults with two requests or more through their service that began within two
  minutes of the onset. One slow request is a lone stall to any detector, so a fault with fewer cannot be
  found in time by one that keeps lone stalls quiet: the ceiling its recall is read against.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.scenarios.fault_patterns import FAMILIES
from harness.scenarios.mesh_traffic import MeshTimeline
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import Span, SpanKind, Spike
from spikehound.units import NS

WITHIN_S = 120.0
BUSY_CALLS_PER_MIN = 15.0


@dataclass(slots=True)
class PatternRun:
    timeline: MeshTimeline
    spikes: dict[str, Spike]  # final state by id
    first: dict[str, Spike]  # the state in which each spike was first reported
    seconds: float = 0.0
    spans: int = 0
    # When each request that reached a service began (event ns, its trace's first span), per service.
    requests_into: dict[str, list[int]] = field(default_factory=dict)


def _record_requests(spans: Sequence[Span], first_start: dict[bytes, int], into: dict[str, set[bytes]]) -> None:
    for span in spans:
        if span.start_unix_nano < first_start.get(span.trace_id, span.start_unix_nano + 1):
            first_start[span.trace_id] = span.start_unix_nano
        if span.kind == SpanKind.SERVER:
            into.setdefault(span.service, set()).add(span.trace_id)


def run(timeline: MeshTimeline, settings: DetectionSettings | None = None, until_ns: int | None = None) -> PatternRun:
    """Feed one timeline through a fresh engine, second by second, as the collector would (up to ``until_ns``
    of event time, then flushed, when given)."""
    engine = DetectionEngine(settings or DetectionSettings())
    result = PatternRun(timeline, {}, {})
    started = time.perf_counter()
    first_start: dict[bytes, int] = {}
    into: dict[str, set[bytes]] = {}
    for batch in timeline.batches():
        if until_ns is not None and batch.time_ns > until_ns:
            break
        engine.add(batch.spans, batch.points)
        result.spans += len(batch.spans)
        _record_requests(batch.spans, first_start, into)
        for spike in engine.advance().spikes:
            result.spikes[spike.id] = spike
            result.first.setdefault(spike.id, spike)
    for spike in engine.flush().spikes:
        result.spikes[spike.id] = spike
        result.first.setdefault(spike.id, spike)
    result.seconds = time.perf_counter() - started
    result.requests_into = {service: sorted(first_start[t] for t in traces) for service, traces in into.items()}
    return result


@dataclass(slots=True)
class PatternScore:
    faults: int = 0
    found: int = 0
    found_late: int = 0
    spikes_per_fault: list[int] = field(default_factory=list)  # every fault, 0 for a missed one
    end_errors_s: list[float] = field(default_factory=list)
    end_errors_busy_s: list[float] = field(default_factory=list)
    onset_errors_s: list[float] = field(default_factory=list)
    top1: int = 0
    held: int = 0
    reachable: int = 0  # faults with two requests or more through their service in their first two minutes
    found_reachable: int = 0
    calm_hours: float = 0.0
    false_spikes: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> dict[str, float]:
        found = self.found + self.found_late

        def pct(values: list[float], q: float) -> float:
            return statistics.quantiles(values, n=10, method="inclusive")[int(q * 10) - 1] if len(values) > 1 \
                else (values[0] if values else float("nan"))

        return {
            "recall": self.found / self.faults if self.faults else 1.0,
            "spikes_per_fault": statistics.fmean(self.spikes_per_fault) if self.spikes_per_fault else float("nan"),
            "exactly_one": (sum(1 for n in self.spikes_per_fault if n == 1) / len(self.spikes_per_fault)
                            if self.spikes_per_fault else float("nan")),
            "end_median_s": statistics.median(self.end_errors_s) if self.end_errors_s else float("nan"),
            "end_p90_s": pct(self.end_errors_s, 0.9),
            "end_busy_p90_s": pct(self.end_errors_busy_s, 0.9),
            "onset_median_s": statistics.median(self.onset_errors_s) if self.onset_errors_s else float("nan"),
            "false_per_6h": self.false_spikes / self.calm_hours * 6 if self.calm_hours else 0.0,
            "top1": self.top1 / found if found else 0.0,
            "held": self.held / found if found else 0.0,
            "reachable": self.reachable / self.faults if self.faults else 1.0,
            "recall_of_reachable": self.found_reachable / self.reachable if self.reachable else 1.0,
        }


def _top(spike: Spike) -> str | None:
    return spike.causes[0].service if spike.causes else None


def score(results: Sequence[PatternRun], window_ns: int = 10 * NS) -> PatternScore:
    from harness.scenarios.mesh_traffic import reach
    shares = reach()
    out = PatternScore()
    for r in results:
        tl = r.timeline
        spikes = sorted(r.spikes.values(), key=lambda s: s.start_unix_nano)
        claimed: set[str] = set()
        fault_s = 0.0
        for f in tl.faults:
            onset = tl.start_ns + int(f.onset_s * NS)
            end = onset + int(f.duration_s * NS)
            fault_s += f.duration_s
            out.faults += 1
            starts = r.requests_into.get(f.service, [])
            reached = bisect.bisect_left(starts, onset + int(WITHIN_S * NS)) - bisect.bisect_left(starts, onset)
            out.reachable += reached >= 2
            unreachable = f" ({reached} request(s) into it in 2 min)" if reached < 2 else ""
            label = (f"seed {tl.seed} {f.kind} {f.service} at {f.onset_s / 60:.1f}-"
                     f"{(f.onset_s + f.duration_s) / 60:.1f} min")
            during = [s for s in spikes if onset - window_ns <= s.start_unix_nano < end + window_ns]
            claimed.update(s.id for s in during)
            out.spikes_per_fault.append(len(during))
            if not during:
                covering = [s for s in spikes if s.start_unix_nano < onset
                            and (s.end_unix_nano is None or s.end_unix_nano >= onset)]
                out.notes.append(f"missed: {label}" + (" (inside an earlier spike)" if covering else "") + unreachable)
                continue
            if len(during) > 1:
                out.notes.append(f"{len(during)} spikes: {label}")
            first = min(during, key=lambda s: s.detected_unix_nano or s.start_unix_nano)
            delay = ((first.detected_unix_nano or first.start_unix_nano) - onset) / NS
            if delay <= WITHIN_S:
                out.found += 1
                out.found_reachable += reached >= 2
            else:
                out.found_late += 1
                out.notes.append(f"late ({delay:.0f} s): {label}{unreachable}")
            last = max(during, key=lambda s: s.start_unix_nano)
            spike_end = last.end_unix_nano if last.end_unix_nano is not None else tl.end_ns
            error = (spike_end - end) / NS
            busy = shares.get(f.service, 0.0) * tl.rate_per_min >= BUSY_CALLS_PER_MIN
            (out.end_errors_busy_s if busy else out.end_errors_s).append(error)
            out.onset_errors_s.append((first.start_unix_nano - onset) / NS)
            if _top(first) == f.service:
                out.top1 += 1
            else:
                out.notes.append(f"wrong top cause: {label}: {_top(first)}")
            if _top(r.first[first.id]) == _top(first):
                out.held += 1
            else:
                out.notes.append(f"cause moved: {label}: {_top(r.first[first.id])} -> {_top(first)}")
        out.calm_hours += (tl.duration_s - fault_s) / 3600
        for s in spikes:
            if s.id not in claimed:
                out.false_spikes += 1
                out.notes.append(f"false spike: seed {tl.seed} at {(s.start_unix_nano - tl.start_ns) / NS / 60:.1f} "
                                 f"min {s.service}/{s.operation}")
    return out


def timelines(family: str, seeds: Sequence[int]) -> list[MeshTimeline]:
    return [FAMILIES[family](seed) for seed in seeds]
