"""The scenario suite's second family, sparse, lumpy microservice traffic: its table.

Run from the repository root: ``python -m benchmarks.mesh_detection [--seeds N] [--hours H]`` (also
part of ``python -m benchmarks.detection``, so of ``make bench``). The timelines, the runs and the
scoring are :mod:`harness.mesh_detection`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from harness.mesh_detection import MeshRun, MeshScore, run, score, timelines
from harness.scenarios.mesh_traffic import FAULT_KINDS
from spikehound.detectors.settings import DetectionSettings


def report(s: MeshScore, runs: Sequence[MeshRun], seconds: float) -> None:
    line = s.line()
    spans = sum(r.spans for r in runs)
    engine_s = sum(r.seconds for r in runs)
    judged = sum(r.streams_judged for r in runs)
    print(f"\nsparse microservice traffic: {len(runs)} timelines, {s.faults} faults, {s.calm_hours:.1f} h of calm "
          f"traffic, {spans:,} spans in {seconds:.0f} s ({spans / engine_s:,.0f} spans/s and "
          f"{judged / engine_s:,.0f} stream windows/s through the engine)\n")
    print(f"{'recall within 2 min':34s}{line['recall']:>10.1%}   (any time during the fault: {line['recall_any']:.1%})")
    print(f"{'top-1 / top-3 service':34s}{line['top1']:>10.1%} / {line['top3']:.1%}")
    print(f"{'false spikes per 6 h':34s}{line['false_per_6h']:>10.2f}")
    print(f"{'detection delay median / max (s)':34s}{line['delay_median_s']:>10.1f} / {line['delay_max_s']:.1f}")
    print(f"{'incidents per detected fault':34s}{line['incidents_per_fault']:>10.2f}")
    for kind in FAULT_KINDS:
        n, found, top1 = s.by_kind.get(kind, [0, 0, 0])
        print(f"  {kind:8s} {found}/{n} found within 2 min, {top1} with the right top service")
    for label, items in (("missed", s.missed), ("wrong top cause", s.wrong), ("false spike", s.false_labels)):
        for item in items:
            print(f"  {label}: {item}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4, help="timelines (default 4)")
    parser.add_argument("--hours", type=float, default=3.0, help="hours per timeline (default 3)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    settings = DetectionSettings()
    runs = []
    for tl in timelines(range(args.seeds), hours=args.hours):
        r = run(tl, settings)
        runs.append(r)
        print(f"  timeline seed {tl.seed}: {len(r.spikes)} spike(s), {tl.requests:,} requests, "
              f"{r.spans / r.seconds:,.0f} spans/s through the engine", flush=True)
    report(score(runs, settings.window_ns), runs, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
