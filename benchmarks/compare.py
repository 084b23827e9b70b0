"""Cost of the regression gate: ``GET /api/v1/compare`` over a million stored spans.

Run from the repository root: ``python -m benchmarks.compare`` (``make bench``).

What is measured
----------------
A SQLite database in a temporary directory is filled, through the storage
writer, with ``--spans`` spans (default 1,000,000) of the ingest benchmark's
inference traces (``benchmarks.ingest.make_trace``: 7 spans over a gateway and a
model server, heavy-tailed latencies) in 512-span blocks, ending over the last
30 minutes. Half the traces come from resources labelled
``deployment.id=blue``, half from ``deployment.id=green``, whose forward passes
are 30 % slower (a regression the comparison should find). A real
``spikehound collector`` is started on that database, and
``GET /api/v1/compare?baseline=deployment.id=blue&candidate=deployment.id=green``
is timed from the outside (``--runs`` times, default 3): reading the blocks,
decoding what the comparison needs, critical paths of up to 5,000 traces per
side, every request's latency per operation, and 2,000 bootstrap replicates of
p50/p95/p99 per operation and per critical-path stage. The target is under
5 s on a 2-core machine.

Reference, same run, same blocks: reading them from the same database and
parsing them with protobuf (``ExportTraceServiceRequest.FromString``), nothing
else, in this process: the floor under any analysis that reads every span;
and ``spikehound.otlp.decode_spans`` of every span (what reading traces one by
one costs per span). This is a measurement: it exits 0 whatever the time, and
non-zero only when the benchmark itself failed (the collector died, or the
comparison did not find the requests that were written).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from benchmarks.ingest import NS, Collector, machine_busy_seconds, make_trace, process_cpu_seconds
from spikehound.model import Span
from spikehound.otlp import decode_spans, encode_spans
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.writer import SpanBlock, WriteBatch, Writer

TARGET_SECONDS = 5.0
BLOCK = 512
SEED = 20261130


def slower_forward(trace: list[Span]) -> None:
    """Make the forward pass 30 % longer, and everything that waits for it end (or start) that much later."""
    forward = next(s for s in trace if s.name == "forward")
    extra, end = forward.duration_ns * 3 // 10, forward.end_unix_nano
    for s in trace:
        if s.end_unix_nano >= end:  # the forward pass and the spans around or after it
            if s.start_unix_nano >= end:
                s.start_unix_nano += extra
            s.end_unix_nano += extra


def fill(db_url: str, spans: int, seed: int = SEED) -> tuple[int, int, int]:
    """Write ``spans`` spans; returns (since, until) covering them and the number of root requests."""
    rng = random.Random(seed)
    engine = make_engine(db_url)
    upgrade(engine)
    writer = Writer(engine)
    now = time.time_ns()
    since, until, roots, written = now - 1900 * NS, now, 0, 0
    pending: list[Span] = []
    while written < spans:
        trace = make_trace(rng, rng.getrandbits(64).to_bytes(8, "big"), now - rng.randrange(1800 * NS))
        colour = "green" if rng.random() < 0.5 else "blue"
        for s in trace:
            s.resource = {**s.resource, "deployment.id": colour}
        if colour == "green":
            slower_forward(trace)
        roots += 1
        pending += trace[: spans - written]
        written += len(trace[: spans - written])
        while len(pending) >= BLOCK or (written == spans and pending):
            block, pending = pending[:BLOCK], pending[BLOCK:]
            writer.write(WriteBatch(spans=block, blocks=[SpanBlock.of(encode_spans(block).SerializeToString(), block)]))
    engine.dispose()
    return since, until, roots


def reference(db_url: str, since: int, until: int) -> tuple[float, float, int]:
    """Seconds to read + parse every block, and to read + decode every span with decode_spans; the span count."""
    engine = make_engine(db_url)
    reader = Reader(engine)
    started = time.perf_counter()
    for payload in reader.span_payloads(since, until):
        ExportTraceServiceRequest.FromString(payload)
    parse_seconds = time.perf_counter() - started
    started = time.perf_counter()
    count = sum(len(decode_spans(ExportTraceServiceRequest.FromString(p)).spans)
                for p in reader.span_payloads(since, until))
    decode_seconds = time.perf_counter() - started
    engine.dispose()
    return parse_seconds, decode_seconds, count


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float  # wall clock, as the client sees it
    collector_cpu: float  # CPU seconds the collector spent meanwhile
    other_cores: float  # cores other processes kept busy meanwhile (a shared machine slows everything)


def timed_compare(api: str, pid: int, since: int, until: int) -> tuple[Timing, dict]:
    query = urllib.parse.urlencode({"baseline": "deployment.id=blue", "candidate": "deployment.id=green",
                                    "since": str(since / NS), "until": str(until / NS)})
    busy0, cpu0, own0 = machine_busy_seconds(), process_cpu_seconds(pid), time.process_time()
    started = time.perf_counter()
    with urllib.request.urlopen(f"{api}/api/v1/compare?{query}", timeout=600) as response:
        body = json.load(response)
    seconds = time.perf_counter() - started
    cpu = process_cpu_seconds(pid) - cpu0
    others = (machine_busy_seconds() - busy0 - cpu - (time.process_time() - own0)) / seconds
    return Timing(seconds, cpu, max(others, 0.0)), body


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=1_000_000, help="spans stored (default 1,000,000)")
    p.add_argument("--runs", type=int, default=3, help="timed comparisons (default 3)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="spikehound-bench-compare-"))
    db_url = f"sqlite:///{workdir / 'spikehound.db'}"
    started = time.perf_counter()
    since, until, roots = fill(db_url, args.spans)
    print(f"stored {args.spans:,} spans ({roots:,} traces) in {time.perf_counter() - started:.0f} s", flush=True)

    collector = Collector(db_url, workdir)
    collector.start()
    try:
        timings: list[Timing] = []
        body: dict = {}
        for _ in range(args.runs):
            timing, body = timed_compare(f"http://127.0.0.1:{collector.api_port}", collector.pid, since, until)
            timings.append(timing)
            print(f"compare: {timing.seconds:.2f} s (collector CPU {timing.collector_cpu:.2f} s; other processes "
                  f"kept {timing.other_cores:.2f} cores busy)", flush=True)
    finally:
        collector.stop()
    parse_seconds, decode_seconds, count = reference(db_url, since, until)

    judged = [op for op in body.get("operations", []) if op["judged"]]
    requests = sum(op["baseline"]["count"] + op["candidate"]["count"] for op in judged)
    times = [t.seconds for t in timings]
    best, median = min(times), statistics.median(times)
    cpu = statistics.median(t.collector_cpu for t in timings)
    others = statistics.median(t.other_cores for t in timings)
    print()
    print(f"compare over {count:,} spans ({requests:,} entry spans in {len(judged)} operations, critical paths of "
          f"{body['baseline']['path_traces']:,} + {body['candidate']['path_traces']:,} traces): "
          f"median {median:.2f} s, best {best:.2f} s  target < {TARGET_SECONDS:.0f} s: "
          f"{'PASS' if median < TARGET_SECONDS else 'ABOVE TARGET'}")
    busy = "  (busy machine: figures are high)" if others >= 0.2 else ""
    print(f"collector CPU per compare: median {cpu:.2f} s (one thread); other processes kept a median "
          f"{others:.2f} of the machine's {os.cpu_count()} cores busy{busy}")
    print(f"reference, same blocks: read + protobuf parse only {parse_seconds:.2f} s; "
          f"decode_spans of every span {decode_seconds:.2f} s")
    print(f"verdict on the 30 % slower forward pass: {body['verdict']} (exit {body['exit_code']}): "
          f"{body['message'].splitlines()[-1].strip()}")
    if count != args.spans or not judged:
        print(f"benchmark failed: {count:,} spans read back, {len(judged)} operations judged", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
