"""What the span metrics cost ingest: the ingest benchmark with ``collector.span_metrics`` off and on, same run.

Run ``python -m benchmarks.ingest --compare-span-metrics`` (``--rounds`` pairs, default 2). Each round starts
a fresh collector on a fresh SQLite database and loads it exactly as ``benchmarks.ingest`` does (same
pre-encoded workload, senders and warm-up); rounds alternate off, on, off, on so that a machine that gets
busier or quieter during the run weighs on both settings alike. Reported per setting: the mean acknowledged
spans/s, and the collector's CPU time per stored span, which a busy machine disturbs less than the rate.
The loss is ``1 - on / off`` of both.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from benchmarks.ingest import Collector, Results, Workload, decode_rate, load_and_stop, make_workload

ENV_SWITCH = "SPIKEHOUND_COLLECTOR_SPAN_METRICS"
MAX_LOSS = 0.10  # the bar: span metrics may cost at most 10 % of ingest throughput


@dataclass(slots=True)
class Setting:
    name: str
    rates: list[float] = field(default_factory=list)
    cpu_us_per_span: list[float] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)


def _round(args: argparse.Namespace, workload: Workload, span_metrics: bool, processes: int
           ) -> tuple[Results, list[str]]:
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spikehound-bench-spanmetrics-") as tmp:
        workdir = Path(tmp)
        collector = Collector(f"sqlite:///{workdir / 'bench.db'}", workdir)
        collector.env[ENV_SWITCH] = "true" if span_metrics else "false"
        collector.start()
        res = Results(db="sqlite", senders=args.senders, processes=processes, batch=args.batch,
                      warmup_s=args.warmup, seconds=args.seconds, workload_requests=len(workload.bodies),
                      workload_bytes_per_span=0.0, reference_spans_per_s=0.0, other_cores_reference=0.0)
        load_and_stop(args, res, workload, collector, processes, failures)
    return res, failures


def compare(args: argparse.Namespace) -> int:
    """Alternate off/on rounds; print each round and the comparison. Exit 1 only if the benchmark failed."""
    processes = max(1, min(args.processes or min(2, args.senders), args.senders))
    workload = make_workload(args.requests, args.batch)
    reference, _ = decode_rate(workload.bodies, args.reference_seconds)
    print(f"reference decode: {reference:,.0f} spans/s (protobuf decode + validation, 1 thread)", flush=True)
    settings = {False: Setting("span metrics off"), True: Setting("span metrics on")}
    for i in range(args.rounds):
        for on in (False, True):
            res, failures = _round(args, workload, on, processes)
            if failures:
                for failure in failures:
                    print(f"benchmark failed: {failure}")
                return 1
            s = settings[on]
            s.rates.append(res.ingest_spans_per_s)
            s.cpu_us_per_span.append(res.collector_cpu_us_per_span)
            s.other_cores.append(res.other_cores)
            print(f"round {i + 1} {s.name:16}: {res.ingest_spans_per_s:8,.0f} spans/s, "
                  f"{res.collector_cpu_us_per_span:5.1f} us collector CPU per span, collector "
                  f"{res.collector_cores:.2f} cores, other processes {res.other_cores:.2f} cores", flush=True)
    off, on = settings[False], settings[True]
    rate_loss = 1 - mean(on.rates) / mean(off.rates)
    cpu_loss = 1 - mean(off.cpu_us_per_span) / mean(on.cpu_us_per_span)
    print()
    print(f"span metrics off: {mean(off.rates):,.0f} spans/s, {mean(off.cpu_us_per_span):.1f} us CPU per span "
          f"(rounds: {', '.join(f'{r:,.0f}' for r in off.rates)})")
    print(f"span metrics on:  {mean(on.rates):,.0f} spans/s, {mean(on.cpu_us_per_span):.1f} us CPU per span "
          f"(rounds: {', '.join(f'{r:,.0f}' for r in on.rates)})")
    busy = max(off.other_cores + on.other_cores)
    print(f"throughput loss {rate_loss:+.1%}, CPU cost per span {cpu_loss:+.1%} of the total  "
          f"(bar: under {MAX_LOSS:.0%}: {'PASS' if max(rate_loss, cpu_loss) < MAX_LOSS else 'OVER'})"
          + (f"  -- other processes kept up to {busy:.2f} cores busy: noisy figures" if busy >= 0.2 else ""))
    return 0
