"""The scenario suite's table: detection recall, false spikes, delay and cause accuracy, against two baselines.

Run from the repository root: ``python -m benchmarks.detection [--seeds N] [--family all|inference|mesh|
recurrence|back-to-back|long|chaos|patterns] [--first-seed N]`` (part of ``make bench``). The scenarios, the
runs and the scoring are :mod:`harness.detection` (dense inference traffic), :mod:`harness.mesh_detection`
(sparse microservice traffic) and :mod:`harness.fault_patterns` (the same traffic with faults that return,
follow one another, last half an hour, or come every few minutes for hours), which
``tests/test_detection_suite.py`` holds to the bars. The pattern families run on held-out seeds
(``--pattern-seeds``, from 100 on); seeds 0-3 were used while the design was made, and seeds 200 on
(``--first-seed 200``) were held out while the chaos family's fixes were made.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from benchmarks import mesh_detection
from harness import fault_patterns
from harness.detection import run, scenarios, score
from harness.scenarios.traffic import ENTRY
from spikehound.detectors.settings import DetectionSettings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per scenario (default 2)")
    parser.add_argument("--family", choices=("all", "inference", "mesh", "patterns", *fault_patterns.FAMILIES),
                        default="all", help="the dense inference scenarios, the sparse microservice timelines, "
                        "one fault-pattern family, all of those (patterns), or everything")
    parser.add_argument("--mesh-seeds", type=int, default=4, help="microservice timelines (default 4)")
    parser.add_argument("--pattern-seeds", type=int, default=8, help="timelines per pattern family (default 8)")
    parser.add_argument("--first-seed", type=int, default=100, help="first pattern seed (default 100: held out)")
    args = parser.parse_args(argv)
    if args.family in ("all", "inference"):
        inference(args.seeds)
    if args.family in ("all", "mesh"):
        print("\n" + "-" * 100)
        mesh_detection.main(["--seeds", str(args.mesh_seeds)])
    for family in fault_patterns.FAMILIES:
        if args.family in ("all", "patterns", family):
            print("\n" + "-" * 100)
            patterns(family, range(args.first_seed, args.first_seed + args.pattern_seeds))
    return 0


def patterns(family: str, seeds: Sequence[int]) -> None:
    """One fault-pattern family: every fault (a return included) scored on its own."""
    settings = DetectionSettings()
    started = time.perf_counter()
    runs = []
    for tl in fault_patterns.timelines(family, seeds):
        r = fault_patterns.run(tl, settings)
        runs.append(r)
        print(f"  {family} seed {tl.seed}: {len(tl.faults)} faults, {len(r.spikes)} spike(s)", flush=True)
    s = fault_patterns.score(runs, settings.window_ns)
    line = s.line()
    print(f"\n{family}: {len(runs)} timelines (seeds {seeds[0]}-{seeds[-1]}), {s.faults} faults, "
          f"{s.calm_hours:.1f} h of calm traffic, in {time.perf_counter() - started:.0f} s\n")
    print(f"{'recall within 2 min':40s}{line['recall']:>10.1%}")
    print(f"{'reachable in 2 min; recall of those':40s}{line['reachable']:>10.1%}; {line['recall_of_reachable']:.1%}")
    print(f"{'spikes per fault (share with exactly 1)':40s}{line['spikes_per_fault']:>10.2f} "
          f"({line['exactly_one']:.1%})")
    print(f"{'end error median / p90, sparse (s)':40s}{line['end_median_s']:>10.1f} / {line['end_p90_s']:.1f}")
    busy = s.end_errors_busy_s
    if busy:
        print(f"{'end error median / p90, busy (s)':40s}{statistics.median(busy):>10.1f} / "
              f"{line['end_busy_p90_s']:.1f}")
    print(f"{'onset error median (s)':40s}{line['onset_median_s']:>10.1f}")
    print(f"{'false spikes per 6 h':40s}{line['false_per_6h']:>10.2f}")
    print(f"{'top-1 service':40s}{line['top1']:>10.1%}")
    print(f"{'top cause held from the first report':40s}{line['held']:>10.1%}")
    for note in s.notes:
        print(f"  {note}")


def inference(seeds: int) -> None:
    """The first family: dense inference traffic, six faults at two strengths and six controls per seed."""
    settings = DetectionSettings()
    results = []
    started = time.perf_counter()
    for sc in scenarios(range(seeds)):
        r = run(sc, settings)
        results.append(r)
        entry = [s for s in r.spikes.values() if (s.service, s.operation) == ENTRY]
        print(f"  {sc.label():28s} seed {sc.seed}: {len(r.spikes)} spike(s), {len(entry)} on the entry stream, "
              f"{r.spans / r.seconds:,.0f} spans/s through the engine", flush=True)
    s = score(results, settings.window_ns)
    line = s.line()
    print(f"\nscenario suite: {len(results)} runs ({s.faults} faults, {s.normal_hours:.1f} h of normal traffic) "
          f"in {time.perf_counter() - started:.0f} s\n")
    print(f"{'':34s}{'spikehound':>12s}{'static p99':>12s}{'highest mean':>14s}")
    print(f"{'recall':34s}{line['recall']:>12.1%}{line['static_recall']:>12.1%}{'-':>14s}")
    print(f"{'false spikes per hour':34s}{line['false_per_hour']:>12.2f}{line['static_false_per_hour']:>12.2f}"
          f"{'-':>14s}")
    print(f"{'top-1 cause':34s}{line['top1']:>12.1%}{'none':>12s}{line['baseline_top1']:>14.1%}")
    print(f"{'top-3 cause':34s}{line['top3']:>12.1%}{'none':>12s}{'-':>14s}")
    print(f"{'detection delay median / max (s)':34s}{line['delay_median_s']:>6.1f} / {line['delay_max_s']:<5.1f}")
    for label, items in (("missed", s.missed), ("wrong top cause", s.wrong), ("false spikes", s.false_labels)):
        for item in items:
            print(f"  {label}: {item}")


if __name__ == "__main__":
    raise SystemExit(main())
