"""The scenario suite's table: detection recall, false spikes, delay and cause accuracy, against two baselines.

Run from the repository root: ``python -m benchmarks.detection [--seeds N] [--family all|inference|mesh]``
(part of ``make bench``). The scenarios, the runs and the scoring are :mod:`harness.detection` (dense
inference traffic) and :mod:`harness.mesh_detection` (sparse microservice traffic), which
``tests/test_detection_suite.py`` holds to the bars.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from benchmarks import mesh_detection
from harness.detection import run, scenarios, score
from spikehound.detectors.settings import DetectionSettings
from spikehound.scenarios.traffic import ENTRY


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per scenario (default 2)")
    parser.add_argument("--family", choices=("all", "inference", "mesh"), default="all",
                        help="the dense inference scenarios, the sparse microservice timelines, or both")
    parser.add_argument("--mesh-seeds", type=int, default=4, help="microservice timelines (default 4)")
    args = parser.parse_args(argv)
    if args.family in ("all", "inference"):
        inference(args.seeds)
    if args.family in ("all", "mesh"):
        print("\n" + "-" * 100)
        mesh_detection.main(["--seeds", str(args.mesh_seeds)])
    return 0


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
