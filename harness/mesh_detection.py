"""The scenario suite's second family: sparse, lumpy microservice traffic (:mod:`harness.scenarios.mesh_traffic`).

``python -m benchmarks.mesh_detection [--seeds N] [--hours H]`` prints the table (also part of
``python -m benchmarks.detection``, so of ``make bench``); ``tests/test_detection_suite.py`` runs two
timelines and holds them to the issue's bars. Both run and score them with this module.

Each seed is one timeline of several hours: about 45 user requests a minute through ~40 services,
lone multi-second stalls and service pauses in calm traffic, a tenfold load drop in every other
timeline, and seven faults (network delay into a service, the same delay on its own interface, CPU
contention on it) of about 3.5 minutes each, with clean traffic before and after. Scored:

- **recall (2 min)**: a fault is found when a spike opens (start between one window before its
  onset and its end) and is detected within two minutes of the onset, in event time;
- **false spikes per 6 h**: spikes that start outside every fault (one window of slack either side),
  per six hours of calm traffic;
- **top-1 / top-3 service**: of the first spike of each found fault, whether its first (first
  three) causes name the faulty service (for a network cause, the callee);
- **incidents per fault**: spikes that open during one fault; one is the goal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.scenarios.mesh_traffic import MeshFault, MeshTimeline
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import Spike
from spikehound.units import NS

WITHIN_S = 120.0


def timelines(seeds: Sequence[int], hours: float = 3.0) -> list[MeshTimeline]:
    """The family's timelines: every other one is 1.5 times longer and has a tenfold load drop for an hour
    and a half; the entry name, the route attribute and host metrics vary, so no one shape decides."""
    out = []
    for seed in seeds:
        shape = {"route_attribute": seed % 3 == 2, "generic_name": "/*" if seed % 4 == 3 else "HTTP",
                 "metrics": seed % 4 != 1}
        if seed % 2 == 1:
            length = hours * 1.5
            drop = (length / 3 - 0.25, length / 3 + 1.25)
            out.append(MeshTimeline(seed, hours=length, faults=_room(length, drop), load_drop=drop, **shape))
        else:
            out.append(MeshTimeline(seed, hours=hours, faults=_room(hours, None), **shape))
    return out


def _room(hours: float, drop: tuple[float, float] | None) -> int:
    """As many faults as fit 20-minute slots after the warm-up, outside the drop."""
    return MeshTimeline.fault_slots(hours, drop)


@dataclass(slots=True)
class MeshRun:
    timeline: MeshTimeline
    spikes: dict[str, Spike]  # final state by id
    spans: int = 0
    seconds: float = 0.0
    streams_judged: int = 0  # stream windows judged (closed windows through the spike tracker)


def run(timeline: MeshTimeline, settings: DetectionSettings | None = None) -> MeshRun:
    """Feed one timeline through a fresh engine, second by second, as the collector would."""
    engine = DetectionEngine(settings or DetectionSettings())
    result = MeshRun(timeline, {})
    started = time.perf_counter()
    for batch in timeline.batches():
        engine.add(batch.spans, batch.points)
        result.spans += len(batch.spans)
        step = engine.advance()
        result.streams_judged += len(step.windows)
        for spike in step.spikes:
            result.spikes[spike.id] = spike
    step = engine.flush()
    result.streams_judged += len(step.windows)
    for spike in step.spikes:
        result.spikes[spike.id] = spike
    result.seconds = time.perf_counter() - started
    return result


@dataclass(slots=True)
class MeshScore:
    faults: int = 0
    found: int = 0  # within two minutes
    found_late: int = 0  # found during the fault, but later than two minutes
    delays_s: list[float] = field(default_factory=list)
    top1: int = 0
    top3: int = 0
    incidents: list[int] = field(default_factory=list)  # spikes opened per found fault
    calm_hours: float = 0.0
    false_spikes: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [faults, found, top1]
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    false_labels: list[str] = field(default_factory=list)

    def line(self) -> dict[str, float]:
        found = self.found + self.found_late
        return {
            "recall": self.found / self.faults if self.faults else 1.0,
            "recall_any": found / self.faults if self.faults else 1.0,
            "top1": self.top1 / found if found else 0.0,
            "top3": self.top3 / found if found else 0.0,
            "false_per_6h": self.false_spikes / self.calm_hours * 6 if self.calm_hours else 0.0,
            "delay_median_s": statistics.median(self.delays_s) if self.delays_s else float("nan"),
            "delay_max_s": max(self.delays_s) if self.delays_s else float("nan"),
            "incidents_per_fault": statistics.fmean(self.incidents) if self.incidents else float("nan"),
        }


def _label(f: MeshFault, seed: int) -> str:
    return f"seed {seed} {f.kind} {f.service} +{f.size_ms:.0f} ms at {f.onset_s / 60:.1f} min"


def _names(spike: Spike, f: MeshFault, rank: int) -> bool:
    return any(c.service == f.service for c in spike.causes[:rank])


def score(results: Sequence[MeshRun], window_ns: int = 10 * NS) -> MeshScore:
    out = MeshScore()
    for r in results:
        tl = r.timeline
        faults = tl.faults
        spikes = sorted(r.spikes.values(), key=lambda s: s.start_unix_nano)
        claimed: set[str] = set()
        fault_s = 0.0
        for f in faults:
            onset = tl.start_ns + int(f.onset_s * NS)
            end = onset + int(f.duration_s * NS)
            fault_s += f.duration_s
            kind = out.by_kind.setdefault(f.kind, [0, 0, 0])
            kind[0] += 1
            out.faults += 1
            during = [s for s in spikes if onset - window_ns <= s.start_unix_nano < end + window_ns]
            claimed.update(s.id for s in during)
            if not during:
                out.missed.append(_label(f, tl.seed))
                continue
            first = min(during, key=lambda s: s.detected_unix_nano or s.start_unix_nano)
            delay = ((first.detected_unix_nano or first.start_unix_nano) - onset) / NS
            out.delays_s.append(delay)
            if delay <= WITHIN_S:
                out.found += 1
                kind[1] += 1
            else:
                out.found_late += 1
                out.missed.append(_label(f, tl.seed) + f" (found after {delay:.0f} s)")
            out.incidents.append(len(during))
            if _names(first, f, 1):
                out.top1 += 1
                kind[2] += 1
            else:
                top = first.causes[0].summary if first.causes else "no cause"
                out.wrong.append(f"{_label(f, tl.seed)}: {first.service}/{first.operation}: {top}")
            out.top3 += _names(first, f, 3)
        out.calm_hours += (tl.duration_s - fault_s) / 3600
        for s in spikes:
            if s.id not in claimed:
                out.false_spikes += 1
                top = s.causes[0].summary if s.causes else "no cause"
                out.false_labels.append(f"seed {tl.seed} at {(s.start_unix_nano - tl.start_ns) / NS / 60:.1f} min "
                                        f"{s.service}/{s.operation} p99 {s.p99_ns / 1e6:.0f} vs "
                                        f"{s.baseline_p99_ns / 1e6:.0f} ms: {top}")
    return out
