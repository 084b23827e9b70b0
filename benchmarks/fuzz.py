"""The big fuzz run: the properties of harness/fuzz_properties.py over more than 100,000 generated inputs.

Run from the repository root: ``python -m benchmarks.fuzz`` (``--scale 0.1`` for a tenth of the inputs,
``--seed N`` to repeat a run, ``--only WORD`` for the properties whose name has it). The properties are
the ones ``make test`` runs a few dozen inputs of (see that module for what each promises): the OTLP
decoders as the receivers call them (protobuf and JSON, traces and metrics, arbitrary bytes), recorded
OTLP files through ``spikehound replay``, every query parameter parser, and a real collector (a child
process, loaded with scenario traffic first) over OTLP/HTTP, OTLP/gRPC and its APIs.

It prints each property's inputs, what they came to, the crashes found (a failed check: an exception that
escaped, a 5xx, an undocumented answer, an invalid record accepted) and the time taken, and exits 1 when
anything crashed or the collector logged an error or died.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import requests
from hypothesis import HealthCheck

from harness.daemons import CollectorProcess
from harness.fuzz_properties import (
    ANY_BYTES,
    METRIC_JSON,
    METRIC_PROTOBUF,
    PARSERS,
    TRACE_JSON,
    TRACE_PROTOBUF,
    Property,
    assert_still_ingesting,
    collector_properties,
    load_sample_data,
    replay_file_property,
    run,
)

# Inputs per property at --scale 1: 103,000 in all, most where inputs are cheap (about 20 minutes).
LOCAL_COUNTS = {TRACE_PROTOBUF.name: 10_000, TRACE_JSON.name: 10_000, METRIC_PROTOBUF.name: 10_000,
                METRIC_JSON.name: 10_000, ANY_BYTES.name: 15_000, PARSERS.name: 20_000,
                "recorded OTLP files through spikehound replay": 5_000}
COLLECTOR_COUNTS = {"OTLP/HTTP requests to a live collector": 4_000, "OTLP/gRPC requests to a live collector": 3_000,
                    "query parameters over HTTP": 10_000, "path parameters over HTTP": 4_000,
                    "silences over HTTP": 2_000}
COUNTS = LOCAL_COUNTS | COLLECTOR_COUNTS
LOGGED_ERROR = re.compile(r" (ERROR|CRITICAL) |Traceback")
STALL_SECONDS = 120  # an input that takes longer is a stall (an infinite loop, say): a failure, not a hang
# A fuzz campaign, not a test: new inputs each seed, no example database, no deadline or health checks.
SETTINGS = {"derandomize": False, "database": None, "deadline": None, "print_blob": True,
            "suppress_health_check": list(HealthCheck)}


@dataclass(slots=True)
class Result:
    name: str
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        common = ", ".join(f"{k} {v:,}" for k, v in self.outcomes.most_common(4))
        return (f"{self.name:<48} {sum(self.outcomes.values()):>8,} {self.crashes:>7} {self.seconds:>7.1f}  "
                f"{common}")


def fuzz(prop: Property, count: int, random_seed: int) -> Result:
    """Run one property; a failure is counted (each distinct one hypothesis reports) and printed."""
    result = Result(prop.name)
    started = time.perf_counter()
    print(f"{prop.name}: {count:,} inputs ...", flush=True)
    try:
        run(prop, count, lambda outcome: result.outcomes.update([outcome]),
            random_seed=random_seed, stall_seconds=STALL_SECONDS, **SETTINGS)
    except Exception as exc:
        failures = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
        result.crashes = len(failures)
        for failure in failures:
            print("".join(traceback.format_exception(failure, limit=-4)), file=sys.stderr, flush=True)
    result.seconds = time.perf_counter() - started
    return result


def fuzz_collector(workdir: Path, wanted: Callable[[list[Property]], list[Property]], random_seed: int,
                   scale: float, results: list[Result]) -> tuple[bool, list[str]]:
    """The properties over a real collector process: whether it stayed up and ingesting, and its error lines."""
    collector = CollectorProcess(f"sqlite:///{workdir / 'spikehound.db'}", workdir,
                                 env={"SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS": "0.5"})
    collector.start()
    healthy = True
    try:
        load_sample_data(collector.http_endpoint)
        with requests.Session() as session, grpc.insecure_channel(collector.grpc_endpoint) as channel:
            for prop in wanted(collector_properties(collector, session, channel)):
                results.append(fuzz(prop, max(1, round(COUNTS[prop.name] * scale)), random_seed))
        assert_still_ingesting(collector.http_endpoint, collector.api)
    except Exception as exc:  # the collector stopped answering: a failure of its own
        print(f"collector failed: {exc!r}\n{collector.log_tail()}", file=sys.stderr)
        healthy = False
    finally:
        healthy = healthy and collector.running
        collector.kill()
    return healthy, [line for line in collector.log_text().splitlines() if LOGGED_ERROR.search(line)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every property's inputs (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a new one, printed)")
    parser.add_argument("--only", default="", help="run only the properties whose name contains this")
    args = parser.parse_args(argv)
    random_seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {random_seed} (repeat with --seed {random_seed})", flush=True)

    def wanted(props: list[Property]) -> list[Property]:
        return [p for p in props if args.only in p.name]

    results: list[Result] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spikehound-fuzz-") as tmp:
        workdir = Path(tmp)
        for prop in wanted([TRACE_PROTOBUF, TRACE_JSON, METRIC_PROTOBUF, METRIC_JSON, ANY_BYTES, PARSERS,
                            replay_file_property(workdir)]):
            results.append(fuzz(prop, max(1, round(COUNTS[prop.name] * args.scale)), random_seed))
        healthy, logged = True, []
        if any(args.only in name for name in COLLECTOR_COUNTS):
            healthy, logged = fuzz_collector(workdir, wanted, random_seed, args.scale, results)
    total = time.perf_counter() - started

    print()
    print(f"{'property':<48} {'inputs':>8} {'crashes':>7} {'seconds':>7}  most common outcomes")
    for r in results:
        print(r.line())
    inputs, crashes = sum(sum(r.outcomes.values()) for r in results), sum(r.crashes for r in results)
    print(f"{'total':<48} {inputs:>8,} {crashes:>7} {total:>7.1f}")
    print(f"crashes found: {crashes}; collector error lines logged: {len(logged)}; collector up and ingesting at "
          f"the end: {healthy}")
    for line in logged[:10]:
        print(f"  {line}")
    return 0 if crashes == 0 and not logged and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
