"""Sustained ingest rate: OTLP/gRPC into SQLite (or PostgreSQL) with the detectors on.

Run from the repository root: ``python -m benchmarks.ingest`` (``make bench``).

What is measured
----------------
1. **Reference** -- the protobuf-decode-only rate, single thread, in this process:
   ``ExportTraceServiceRequest.FromString(body)`` plus ``spikehound.otlp.decode_spans``
   over the very request bodies that the load generator sends. Every span the
   collector stores has to pass through exactly this, so it is the ceiling of
   one collector core. The ratio ingest/decode says how much of the collector's
   time goes to everything else (gRPC, queue, SQL, latency windows); it also
   normalises for the machine, so two runs on different hardware compare by it.
2. **Sustained ingest** -- a real ``spikehound collector`` child process
   (SQLite in a temporary directory unless ``--db`` names a database), loaded by
   separate sender processes (``--processes``, default 2) that keep ``--senders``
   export calls in flight (default 8, like eight agents exporting at once), replaying
   PRE-ENCODED requests with a raw gRPC generic unary call, so the load generator
   costs little next to the collector it measures. A span counts once the
   collector has acknowledged it, which it does only after the commit.
   RESOURCE_EXHAUSTED / UNAVAILABLE answers make the sender pause (50 ms,
   doubling up to 1 s) and retry the same request, as OTLP exporters do. After a
   warm-up, acknowledged spans are counted for ``--seconds``. Afterwards the
   collector's ``spikehound_ingest_stored_total`` and the spans in the stored
   span blocks must be at least the acknowledged count. Over the measured
   interval the collector's CPU use (``/proc/PID/stat``) is reported in cores
   and per stored span, beside what other processes kept the machine busy with:
   on a small shared machine that load lowers both figures.

Workload: multi-service AI-inference traces (gateway SERVER root -> preprocess ->
feature-store DB CLIENT call; gateway CLIENT -> model-server SERVER -> forward;
postprocess), a handful of attributes per span, three hosts, heavy-tailed
durations from a fixed seed, end times just before the run. Spans are grouped
into ``--batch``-span requests with ``spikehound.otlp.encode_spans`` and
serialised once. The requests are replayed in rounds;
every round gives every trace id a fresh 8-byte prefix (a ``bytes.replace`` on the
encoded body), so each stored span is new and the trace index sees real inserts,
never cheap conflicts, and moves every span later in event time (the fixed64 time
fields patched in place), following the wall clock at twice its speed, so that
the collector's windows keep closing and its detectors keep judging and
attributing throughout, as in production, only faster.

``--detection both`` (the default) runs the collector twice, detectors off
(``detection.enabled = false``: latency windows only) then on, and prints the
detectors' cost in throughput and in collector CPU per span; ``--pairs N``
alternates N such pairs and compares the best run of each side.

This is a measurement, not a test: it exits 0 whatever the rate, and non-zero
only when the benchmark itself failed (collector died, nothing acknowledged,
acknowledged spans missing from storage).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from harness.ports import free_port
from spikehound.model import Span, SpanKind, StatusCode
from spikehound.otlp import decode_spans, encode_spans
from spikehound.protowire import FIXED64, fields

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TARGET_SPANS_PER_SECOND = 50_000
SEED = 20240917
MARKER_BYTES = 8  # trace ids are MARKER + 8 bytes; a round swaps the marker for a fresh one
EVENT_SPEEDUP = 2  # event time runs this much faster than the wall clock during the load
RETRY_PAUSE_SECONDS = 0.05  # first pause after RESOURCE_EXHAUSTED / UNAVAILABLE, doubling up to the next
MAX_RETRY_PAUSE_SECONDS = 1.0
MAX_ATTEMPTS = 60  # of one request (about a minute of pauses), then the benchmark fails
CALL_TIMEOUT_SECONDS = 60.0
START_TIMEOUT_SECONDS = 60.0
NS = 1_000_000_000
MS = 1_000_000

# --- workload ---------------------------------------------------------------------------------

HOSTS = ("gpu-node-1", "gpu-node-2", "gpu-node-3")
# model -> (public route, median forward latency in ms, typical batch sizes)
MODELS: dict[str, tuple[str, float, tuple[int, ...]]] = {
    "llama-3-8b-instruct": ("POST /v1/chat/completions", 45.0, (1, 2, 4, 8)),
    "mistral-7b-instruct": ("POST /v1/chat/completions", 35.0, (1, 2, 4, 8, 16)),
    "bge-reranker-v2": ("POST /v1/rerank", 8.0, (8, 16, 32)),
}
GATEWAY_RESOURCE = {"service.version": "2.14.1", "deployment.environment": "bench", "telemetry.sdk.language": "python"}
MODEL_RESOURCE = {"service.version": "0.9.3", "deployment.environment": "bench", "telemetry.sdk.language": "python",
                  "process.runtime.name": "cpython"}


def _duration_ns(rng: random.Random, median_ms: float, sigma: float, tail_p: float = 0.02) -> int:
    """Log-normal around ``median_ms`` with an occasional Pareto tail (the p99 spikes)."""
    ms = median_ms * math.exp(rng.gauss(0.0, sigma))
    if rng.random() < tail_p:
        ms *= min(rng.paretovariate(1.3), 50.0)
    return max(int(ms * MS), 1_000)


def _span_id(rng: random.Random) -> bytes:
    return (rng.getrandbits(64) | 1).to_bytes(8, "big")  # never all zeroes


def make_trace(rng: random.Random, marker: bytes, root_end_ns: int) -> list[Span]:
    """One inference request: 7 spans over the gateway and the model server."""
    model = rng.choice(list(MODELS))
    route, forward_median, batches = MODELS[model]
    batch = rng.choice(batches)
    trace_id = marker + rng.getrandbits(64).to_bytes(8, "big")
    gw_host, ms_host = rng.choice(HOSTS), rng.choice(HOSTS)
    error = rng.random() < 0.005

    gap = 50_000
    db = _duration_ns(rng, 1.5, 0.6)
    pre = db + _duration_ns(rng, 2.0, 0.4)
    fwd = _duration_ns(rng, forward_median * (1 + batch / 32), 0.35)
    srv = fwd + _duration_ns(rng, 0.8, 0.3)
    net = _duration_ns(rng, 0.3, 0.5, tail_p=0.01)
    cli = srv + 2 * net
    post = _duration_ns(rng, 1.0, 0.4)
    root = 4 * gap + pre + cli + post
    t0 = root_end_ns - root

    root_id, pre_id, db_id, cli_id, srv_id, fwd_id, post_id = (_span_id(rng) for _ in range(7))
    pre_start = t0 + gap
    cli_start = pre_start + pre + gap
    srv_start = cli_start + net
    post_start = cli_start + cli + gap
    status = StatusCode.ERROR if error else StatusCode.UNSET

    def span(span_id: bytes, parent: bytes | None, service: str, name: str, kind: SpanKind, start: int,
             duration: int, attributes: dict[str, Any], span_status: StatusCode = StatusCode.UNSET) -> Span:
        on_gateway = service == "gateway"
        return Span(trace_id=trace_id, span_id=span_id, parent_span_id=parent, service=service,
                    host=gw_host if on_gateway else ms_host, name=name, kind=kind, start_unix_nano=start,
                    end_unix_nano=start + duration, status=span_status, attributes=attributes,
                    resource=GATEWAY_RESOURCE if on_gateway else MODEL_RESOURCE)

    return [
        span(root_id, None, "gateway", route, SpanKind.SERVER, t0, root,
             {"http.method": "POST", "http.route": route.split(" ", 1)[1], "http.status_code": 500 if error else 200,
              "model.name": model}, status),
        span(pre_id, root_id, "gateway", "preprocess", SpanKind.INTERNAL, pre_start, pre,
             {"model.name": model, "input.tokens": rng.randint(16, 2048)}),
        span(db_id, pre_id, "gateway", "HGETALL features", SpanKind.CLIENT, pre_start + (pre - db) // 2, db,
             {"db.system": "redis", "db.operation": "HGETALL", "peer.service": "feature-store",
              "server.address": "feature-store.internal", "server.port": 6379}),
        span(cli_id, root_id, "gateway", "POST /infer", SpanKind.CLIENT, cli_start, cli,
             {"http.method": "POST", "server.address": "model-server.internal", "peer.service": "model-server",
              "model.name": model}, status),
        span(srv_id, cli_id, "model-server", "POST /infer", SpanKind.SERVER, srv_start, srv,
             {"http.method": "POST", "http.route": "/infer", "model.name": model, "batch.size": batch}, status),
        span(fwd_id, srv_id, "model-server", "forward", SpanKind.INTERNAL, srv_start + (srv - fwd) // 2, fwd,
             {"model.name": model, "batch.size": batch, "gpu.id": rng.randrange(8), "model.dtype": "bfloat16"},
             status),
        span(post_id, root_id, "gateway", "postprocess", SpanKind.INTERNAL, post_start, post,
             {"output.tokens": rng.randint(1, 1024), "model.name": model}),
    ]


@dataclass(frozen=True, slots=True)
class Workload:
    bodies: list[bytes]
    spans_per_body: list[int]
    marker: bytes
    # Per body: byte offsets of every span's start and end time (fixed64 fields), so that a round can move
    # the whole workload forward in event time without re-encoding it.
    time_offsets: list[Any] = field(default_factory=list)
    event_span_ns: int = 2 * NS  # event time one pass covers; each round starts that much later
    created_ns: int = 0  # the wall clock when the spans were made: rounds move on from it

    @property
    def spans(self) -> int:
        return sum(self.spans_per_body)

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.bodies)


def make_workload(requests: int, batch: int, seed: int = SEED, *, one_span_traces: bool = False) -> Workload:
    """``requests`` serialised export requests of ``batch`` spans each, ends within 2 s before now.

    ``one_span_traces``: every span is the root of a trace of its own (the worst case for the trace index and
    the detectors' trace buffer: one index row and one trace a span)."""
    rng = random.Random(seed)
    marker = rng.getrandbits(64).to_bytes(MARKER_BYTES, "big")
    now = time.time_ns()
    spans: list[Span] = []
    while len(spans) < requests * batch:
        spans += make_trace(rng, marker, now - rng.randrange(2 * NS))
    if one_span_traces:
        for s in spans:
            s.trace_id, s.parent_span_id = marker + rng.getrandbits(64).to_bytes(8, "big"), None
    bodies = [encode_spans(spans[i:i + batch]).SerializeToString() for i in range(0, requests * batch, batch)]
    if any(body.count(marker) != len(decode_spans(ExportTraceServiceRequest.FromString(body)).spans)
           for body in bodies[:4]):
        raise RuntimeError("trace-id marker also occurs outside trace ids; pick another seed")
    return Workload(bodies, [batch] * len(bodies), marker, [_time_offsets(b) for b in bodies], created_ns=now)


def span_ranges(body: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) offsets of every Span message in an encoded ExportTraceServiceRequest, in order."""
    for n1, _, _, s1, e1 in fields(body):  # ResourceSpans
        if n1 != 1:
            continue
        for n2, _, _, s2, e2 in fields(body, s1, e1):  # ScopeSpans
            if n2 != 2:
                continue
            for n3, _, _, s3, e3 in fields(body, s2, e2):  # Span
                if n3 == 2:
                    yield s3, e3


def _time_offsets(body: bytes) -> Any:
    """Offsets of Span.start_time_unix_nano (7) and end_time_unix_nano (8) in an encoded request."""
    import numpy as np

    out = []
    for s3, e3 in span_ranges(body):
        out += [f.value for f in fields(body, s3, e3) if f.number in (7, 8) and f.wire == FIXED64]
    return np.asarray(out, dtype=np.int64)


def shift_times(body: bytes, offsets: Any, shift_ns: int) -> bytes:
    """``body`` with every span moved ``shift_ns`` later in event time (same length, same ids)."""
    import numpy as np

    if shift_ns == 0 or len(offsets) == 0:
        return body
    raw = np.frombuffer(body, dtype=np.uint8).copy()
    index = offsets[:, None] + np.arange(8)
    times = raw[index].view("<u8") + np.uint64(shift_ns)
    raw[index] = times.view(np.uint8).reshape(-1, 8)
    return raw.tobytes()


# --- reference: decode only --------------------------------------------------------------------


def machine_busy_seconds() -> float:
    """CPU seconds spent busy (not idle, not waiting for I/O) by the whole machine, all cores together."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait; no guest


def decode_rate(bodies: Sequence[bytes], min_seconds: float) -> tuple[float, float]:
    """Spans/s of parse + validate + convert, one thread, at least one pass and ``min_seconds``.

    Also returns how many cores other processes kept busy meanwhile: on a small
    (often hyperthreaded) machine they can slow this loop down a lot.
    """
    spans = 0
    busy0, cpu0 = machine_busy_seconds(), time.process_time()
    started = time.perf_counter()
    while True:
        for body in bodies:
            decoded = decode_spans(ExportTraceServiceRequest.FromString(body))
            if decoded.rejected:
                raise RuntimeError(f"generated spans rejected: {decoded.error_message}")
            spans += len(decoded.spans)
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            others = (machine_busy_seconds() - busy0 - (time.process_time() - cpu0)) / elapsed
            return spans / elapsed, max(others, 0.0)


def store_rate(bodies: Sequence[bytes], min_seconds: float) -> float:
    """Spans/s of the plainest store, one thread: decode and validate each request as the collector does,
    flatten its spans into rows (ids, names, kind, times, status) and insert them into a SQLite file (WAL,
    synchronous=NORMAL), one row a span and one commit a request. What one core does with no index, no
    detection and no answers to senders: the reference the collector's rate is held against."""
    with tempfile.TemporaryDirectory(prefix="spikehound-store-reference-") as tmp:
        db = sqlite3.connect(Path(tmp) / "reference.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE spans (trace_id BLOB, span_id BLOB, parent_id BLOB, service TEXT, name TEXT, "
                   "kind INTEGER, start_ns INTEGER, end_ns INTEGER, status INTEGER)")
        insert = "INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        spans = 0
        started = time.perf_counter()
        while True:
            for body in bodies:
                decoded = decode_spans(ExportTraceServiceRequest.FromString(body))
                db.execute("BEGIN")
                db.executemany(insert, [(s.trace_id, s.span_id, s.parent_span_id, s.service, s.name, int(s.kind),
                                         s.start_unix_nano, s.end_unix_nano, int(s.status)) for s in decoded.spans])
                db.execute("COMMIT")
                spans += len(decoded.spans)
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                db.close()
                return spans / elapsed


# --- load generator (runs in its own processes) ------------------------------------------------


@dataclass(slots=True)
class SenderResult:
    acked_spans: int = 0  # all phases, for the stored >= acknowledged check
    measured_spans: int = 0  # acknowledged inside [measure_at, end_at)
    calls: int = 0
    retries: int = 0
    rejected_spans: int = 0
    cpu_seconds: float = 0.0  # over the measured interval
    latencies_ms: list[float] = field(default_factory=list)  # per acknowledged call, measured interval
    error: str = ""


def _rounds(workload: Workload) -> Iterator[tuple[bytes, int]]:
    """The requests forever; each round with fresh trace ids (random prefix: unique across processes), and
    later in event time, following the wall clock since the workload was made but ``EVENT_SPEEDUP`` times
    faster, so that the collector's windows keep closing and its detectors keep judging, as in production."""
    while True:
        marker = os.urandom(MARKER_BYTES)
        # Whole passes of the workload's event span: the senders (each its own process) stay in step.
        passes = max(time.time_ns() - workload.created_ns, 0) * EVENT_SPEEDUP // workload.event_span_ns
        shift = passes * workload.event_span_ns
        for body, n, offsets in zip(workload.bodies, workload.spans_per_body, workload.time_offsets, strict=True):
            yield shift_times(body.replace(workload.marker, marker), offsets, shift), n


async def _send(endpoint: str, workload: Workload, inflight: int, measure_at: float, end_at: float,
                offset: int) -> SenderResult:
    import grpc  # only the sender processes need a client

    result = SenderResult()
    bodies = _rounds(workload)
    for _ in range(offset % len(workload.bodies)):  # processes start at different requests
        next(bodies)
    cpu_marks: list[float] = []

    async def cpu_clock() -> None:
        for at in (measure_at, end_at):
            await asyncio.sleep(max(at - time.time(), 0.0))
            cpu_marks.append(time.process_time())

    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_send_message_length", -1)]) as channel:
        # No request serializer: the pre-encoded bytes go out as they are.
        export = channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                     response_deserializer=ExportTraceServiceResponse.FromString)
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_SECONDS)

        async def worker() -> None:
            while time.time() < end_at:
                body, n = next(bodies)
                sent = time.perf_counter()
                for attempt in itertools.count(1):
                    try:
                        response = await export(body, timeout=CALL_TIMEOUT_SECONDS)
                        break
                    except grpc.aio.AioRpcError as exc:
                        # Queue full or storage failing: pause briefly, then the same request again.
                        retryable = (exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
                                     and "larger than max" not in (exc.details() or ""))  # not: over the size limit
                        if not retryable or attempt >= MAX_ATTEMPTS:
                            raise
                        result.retries += 1
                        await asyncio.sleep(min(RETRY_PAUSE_SECONDS * 2 ** (attempt - 1), MAX_RETRY_PAUSE_SECONDS))
                done = time.time()
                rejected = response.partial_success.rejected_spans
                result.calls += 1
                result.rejected_spans += rejected
                result.acked_spans += n - rejected
                if measure_at <= done < end_at:
                    result.measured_spans += n - rejected
                    result.latencies_ms.append((time.perf_counter() - sent) * 1000)

        clock = asyncio.create_task(cpu_clock())
        try:
            async with asyncio.TaskGroup() as group:  # one failing sender stops the others
                for _ in range(inflight):
                    group.create_task(worker())
        except* Exception as failed:
            exc = failed.exceptions[0]
            result.error = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                            else f"{exc.__class__.__name__}: {exc}")
        await clock
    result.cpu_seconds = cpu_marks[1] - cpu_marks[0]
    return result


def sender_process(conn: Connection, endpoint: str, workload: Workload, inflight: int, measure_at: float,
                    end_at: float, offset: int) -> None:
    try:
        result = asyncio.run(_send(endpoint, workload, inflight, measure_at, end_at, offset))
    except Exception as exc:  # reported to the parent, which fails the benchmark
        result = SenderResult(error=f"{exc.__class__.__name__}: {exc}")
    conn.send(result)
    conn.close()


# --- the collector under test ------------------------------------------------------------------


def spawn_senders(target: Callable[..., None], endpoint: Any, workload: Workload, senders: int, processes: int,
                  measure_at: float, end_at: float) -> tuple[list[Connection], list[Any], list[int]]:
    """Start ``processes`` sender processes running ``target`` (``sender_process``, or one with its arguments
    that routes), with ``senders`` export calls in flight over them; their result pipes, the processes, and
    the calls in flight of each."""
    ctx = multiprocessing.get_context("spawn")  # no inherited grpc state; each sender starts clean
    per_process = [senders // processes + (i < senders % processes) for i in range(processes)]
    pipes: list[Connection] = []
    procs = []
    for i, inflight in enumerate(per_process):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, name=f"bench-sender-{i}",
                        args=(child, endpoint, workload, inflight, measure_at, end_at,
                              i * len(workload.bodies) // processes))
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    return pipes, procs, per_process


def collect_results(pipes: list[Connection], procs: list[Any], failures: list[str], label: str = ""
                    ) -> list[SenderResult]:
    """Each sender's result (a sender that sends none is a failure, named with ``label``); the senders end."""
    results: list[SenderResult] = []
    prefix = f"{label}: " if label else ""
    for pipe, p in zip(pipes, procs, strict=True):
        if pipe.poll(CALL_TIMEOUT_SECONDS * 2):
            results.append(pipe.recv())
        else:
            failures.append(f"{prefix}{p.name} sent no result")
        p.join(10)
        if p.is_alive():
            p.kill()
    failures += [f"{prefix}sender: {r.error}" for r in results if r.error]
    return results


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (the collector's detection process)."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


def _rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory now and its high-water mark, in MB, from /proc/PID/status, summed over the process and
    its children (pages a forked child still shares are counted in both: an upper bound)."""
    total = [0.0, 0.0]
    for each in process_tree(pid):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{each}/status").read_text().splitlines()
            fields = dict(line.split(":", 1) for line in lines if ":" in line)
            for i, key in enumerate(("VmRSS", "VmHWM")):
                total[i] += int(fields[key].split()[0]) / 1024
    return round(total[0], 1), round(total[1], 1)


def process_cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User + system CPU time of a process (all its threads) and, with ``children``, of its live descendants,
    from /proc."""
    seconds = 0.0
    for each in process_tree(pid) if children else [pid]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{each}/stat").read_text().rpartition(")")[2].split()
            seconds += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return seconds


class Collector:
    """``spikehound collector`` as a child process on free loopback ports."""

    def __init__(self, db_url: str, workdir: Path, settings: dict[str, bool] | None = None) -> None:
        self.db_url = db_url
        self.log_path = workdir / "collector.log"
        self.api_port, self.grpc_port, self.http_port = free_port(), free_port(), free_port()
        self.env = {**os.environ, "SPIKEHOUND_DATA_DIR": str(workdir)}
        for key, value in (settings or {}).items():  # "detection.enabled" -> SPIKEHOUND_DETECTION_ENABLED
            self.env["SPIKEHOUND_" + key.replace(".", "_").upper()] = "true" if value else "false"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        exe = shutil.which("spikehound", path=str(Path(sys.executable).parent)) or "spikehound"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [exe, "collector", "--db", self.db_url, "--api", f"127.0.0.1:{self.api_port}",
                 "--otlp-grpc", self.grpc_endpoint, "--otlp-http", f"127.0.0.1:{self.http_port}"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"collector not ready in {START_TIMEOUT_SECONDS:.0f} s:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"collector exited with {self.proc.returncode}:\n{self.log_tail()}")

    def stored_spans(self) -> float:
        return self.metric('spikehound_ingest_stored_total{signal="spans"}')

    def metric(self, name: str) -> float:
        """One sample of the collector's /metrics (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def count_span_rows(db_url: str) -> int | None:
    """Spans held by the stored span blocks (None when they cannot be read, e.g. no schema yet)."""
    from sqlalchemy import text

    from spikehound.storage.engine import make_engine

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT coalesce(sum(span_count), 0) FROM span_blocks")).scalar_one())
    except Exception:
        return None
    finally:
        engine.dispose()


# --- the run -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Results:
    db: str
    senders: int
    processes: int
    batch: int
    warmup_s: float
    seconds: float
    workload_requests: int
    workload_bytes_per_span: float
    reference_spans_per_s: float
    other_cores_reference: float  # other processes' load while the reference ran
    store_reference_spans_per_s: float = 0.0  # decode + flatten + one SQLite row a span, one thread (store_rate)
    ratio_ingest_store: float = 0.0
    ingest_spans_per_s: float = 0.0
    collector_side_spans_per_s: float = 0.0
    ratio_ingest_decode: float = 0.0
    collector_cores: float = 0.0
    collector_cpu_us_per_span: float = 0.0  # CPU time per stored span: less sensitive to a busy machine
    load_generator_cores: float = 0.0
    other_cores: float = 0.0  # everything else busy on the machine meanwhile (noise in the figure)
    machine_cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    acked_spans: int = 0
    stored_spans_metric: int = 0
    span_rows: int | None = None
    rejected_spans: int = 0
    retries: int = 0
    calls: int = 0
    latency_ms_p50: float = 0.0
    latency_ms_p99: float = 0.0
    target_spans_per_s: int = TARGET_SPANS_PER_SECOND
    passed: bool = False
    settings: dict[str, bool] = field(default_factory=dict)  # switched configuration keys
    windows_closed: int = 0  # what the detectors did meanwhile: windows judged, spans too late to count
    late_spans: int = 0
    collector_main_cores: float = 0.0  # of collector_cores, the main process's (the rest: its detection process)
    collector_rss_mb: float = 0.0  # the collector's resident memory at the end of the measured interval
    collector_peak_rss_mb: float = 0.0  # its high-water mark (the kernel's VmHWM)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(max(math.ceil(q * len(ordered)) - 1, 0), len(ordered) - 1)] if ordered else 0.0


# --compare SETTING -> the configuration key switched off and on.
COMPARED_SETTINGS = {"detection": "detection.enabled", "span-metrics": "collector.span_metrics",
                     "hop-streams": "detection.hop_streams", "own-process": "detection.own_process"}


def run(args: argparse.Namespace, settings: dict[str, bool] | None = None) -> tuple[Results, list[str]]:
    """The whole benchmark; returns the results and the reasons it failed (empty when it did not).

    ``settings`` switches boolean configuration keys of the collector (``"detection.enabled": False``).
    """
    failures: list[str] = []
    processes = max(1, min(args.processes or min(2, args.senders), args.senders))
    started = time.perf_counter()
    workload = make_workload(args.requests, args.batch, one_span_traces=args.one_span_traces)
    print(f"workload: {len(workload.bodies)} requests x {args.batch} spans"
          f"{', every span its own trace' if args.one_span_traces else ''}, "
          f"{workload.size_bytes / workload.spans:.0f} bytes/span encoded, "
          f"built in {time.perf_counter() - started:.1f} s", flush=True)
    reference, reference_others = decode_rate(workload.bodies, args.reference_seconds)
    print(f"reference decode: {reference:,.0f} spans/s", flush=True)
    stored_reference = store_rate(workload.bodies, args.reference_seconds)
    print(f"reference store: {stored_reference:,.0f} spans/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="spikehound-bench-") as tmp:
        workdir = Path(tmp)
        db_url = args.db or f"sqlite:///{workdir / 'bench.db'}"
        rows_before = (count_span_rows(db_url) or 0) if args.db else 0
        collector = Collector(db_url, workdir, settings or {})
        collector.start()
        res = Results(db=db_url.split("://", 1)[0], senders=args.senders, processes=processes, batch=args.batch,
                      warmup_s=args.warmup, seconds=args.seconds, workload_requests=len(workload.bodies),
                      workload_bytes_per_span=round(workload.size_bytes / workload.spans, 1),
                      reference_spans_per_s=round(reference), other_cores_reference=round(reference_others, 2),
                      store_reference_spans_per_s=round(stored_reference),
                      settings=dict(settings or {}))
        load_and_stop(args, res, workload, collector, processes, failures)
        rows = count_span_rows(db_url)
        if rows is not None:
            res.span_rows = rows - rows_before
            if res.span_rows < res.acked_spans:
                failures.append(f"only {res.span_rows:,} spans stored for {res.acked_spans:,} acknowledged")
    res.ratio_ingest_decode = round(res.ingest_spans_per_s / reference, 3) if reference else 0.0
    res.ratio_ingest_store = round(res.ingest_spans_per_s / stored_reference, 3) if stored_reference else 0.0
    res.passed = res.ingest_spans_per_s >= TARGET_SPANS_PER_SECOND
    return res, failures


def _sample(collector: Collector) -> tuple[float, float, float, float, float]:
    """Stored spans, collector CPU seconds (with its detection process), machine busy seconds, wall time, and
    the CPU seconds of the collector's main process alone: now."""
    return (collector.stored_spans(), process_cpu_seconds(collector.pid), machine_busy_seconds(), time.time(),
            process_cpu_seconds(collector.pid, children=False))


def _wait_until(at: float, collector: Collector) -> None:
    """Sleep until wall time ``at``; raise at once if the collector dies meanwhile."""
    while (left := at - time.time()) > 0:
        time.sleep(min(left, 0.25))
        collector.check_alive()


def _load(args: argparse.Namespace, res: Results, workload: Workload, collector: Collector, processes: int,
          failures: list[str]) -> None:
    measure_at = time.time() + args.startup + args.warmup
    end_at = measure_at + args.seconds
    pipes, procs, per_process = spawn_senders(sender_process, collector.grpc_endpoint, workload, args.senders,
                                              processes, measure_at, end_at)
    print(f"load: {args.senders} concurrent export calls in {processes} sender process(es) "
          f"{per_process}, warm-up {args.warmup:g} s, measuring {args.seconds:g} s", flush=True)

    try:
        _wait_until(measure_at, collector)
        stored0, cpu0, busy0, t0, main0 = _sample(collector)
        _wait_until(end_at, collector)
        stored1, cpu1, busy1, t1, main1 = _sample(collector)
    except BaseException:
        for p in procs:  # the senders would otherwise retry against a dead collector for a minute
            p.kill()
        raise
    res.collector_rss_mb, res.collector_peak_rss_mb = _rss_mb(collector.pid)
    res.collector_side_spans_per_s = round((stored1 - stored0) / (t1 - t0))
    res.collector_cores = round((cpu1 - cpu0) / (t1 - t0), 2)
    res.collector_main_cores = round((main1 - main0) / (t1 - t0), 2)
    if stored1 > stored0:
        res.collector_cpu_us_per_span = round((cpu1 - cpu0) / (stored1 - stored0) * 1e6, 1)

    results = collect_results(pipes, procs, failures)
    collector.check_alive()
    res.acked_spans = sum(r.acked_spans for r in results)
    res.ingest_spans_per_s = round(sum(r.measured_spans for r in results) / args.seconds)
    res.load_generator_cores = round(sum(r.cpu_seconds for r in results) / args.seconds, 2)
    res.other_cores = round(max((busy1 - busy0) / (t1 - t0) - res.collector_cores - res.load_generator_cores, 0.0), 2)
    res.rejected_spans = sum(r.rejected_spans for r in results)
    res.retries = sum(r.retries for r in results)
    res.calls = sum(r.calls for r in results)
    latencies = [x for r in results for x in r.latencies_ms]
    res.latency_ms_p50 = round(percentile(latencies, 0.50), 1)
    res.latency_ms_p99 = round(percentile(latencies, 0.99), 1)
    res.stored_spans_metric = int(collector.stored_spans())
    res.windows_closed = int(collector.metric("spikehound_latency_windows_closed_total"))
    res.late_spans = int(collector.metric("spikehound_latency_late_spans_total"))
    if res.stored_spans_metric < res.acked_spans:
        failures.append(f"collector stored {res.stored_spans_metric:,} spans but acknowledged {res.acked_spans:,}")
    if res.rejected_spans:
        failures.append(f"{res.rejected_spans:,} generated spans were rejected as invalid")
    if not res.ingest_spans_per_s:
        failures.append("no span was acknowledged in the measured interval")


def load_and_stop(args: argparse.Namespace, res: Results, workload: Workload, collector: Collector, processes: int,
                  failures: list[str]) -> None:
    """Load the started collector, then stop it; a collector that did not exit cleanly is a failure."""
    try:
        _load(args, res, workload, collector, processes, failures)
    finally:
        code = collector.stop()
    if code not in (0, None) and not failures:
        failures.append(f"collector exited with {code}:\n{collector.log_tail()}")


def _switched(settings: dict[str, bool]) -> str:
    if not settings:
        return "detectors and span metrics on"
    return ", ".join(f"{key} = {'true' if value else 'FALSE'}" for key, value in settings.items())


def report(res: Results) -> str:
    setup = f"{res.senders} concurrent senders in {res.processes} process(es), {res.batch}-span batches"
    db = "SQLite" if res.db == "sqlite" else "PostgreSQL"
    rows = f", {res.span_rows:,} spans in storage" if res.span_rows is not None else ""
    lines = [
        f"ingest (OTLP/gRPC -> {db}, {_switched(res.settings)}, {setup}): "
        f"{res.ingest_spans_per_s:,.0f} spans/s  "
        f"(collector used {res.collector_cores:.2f} cores: {res.collector_main_cores:.2f} its main process, "
        f"{res.collector_cores - res.collector_main_cores:.2f} its detection process; load generator "
        f"{res.load_generator_cores:.2f})",
        f"reference: protobuf decode + validation only, 1 thread: {res.reference_spans_per_s:,.0f} spans/s",
        f"reference: decode, flatten and insert a row a span into SQLite, 1 thread: "
        f"{res.store_reference_spans_per_s:,.0f} spans/s; ratio ingest/store: {res.ratio_ingest_store:.2f} "
        f"(bar: 0.8)",
        f"ratio ingest/decode: {res.ratio_ingest_decode:.2f}   target >= {res.target_spans_per_s:,} spans/s: "
        f"{'PASS' if res.passed else 'BELOW TARGET'}",
        f"check: acknowledged {res.acked_spans:,} spans (warm-up included), collector stored_total "
        f"{res.stored_spans_metric:,}{rows}; collector-side rate {res.collector_side_spans_per_s:,.0f} spans/s, "
        f"{res.collector_cpu_us_per_span:.1f} us collector CPU per span, resident memory {res.collector_rss_mb:.0f} MB "
        f"(peak {res.collector_peak_rss_mb:.0f} MB)",
        f"detectors: {res.windows_closed:,} latency windows closed and judged, {res.late_spans:,} entry spans too "
        f"late to count (event time runs {EVENT_SPEEDUP}x the wall clock)",
        f"calls: {res.calls:,} acknowledged, {res.retries:,} retried (RESOURCE_EXHAUSTED/UNAVAILABLE), "
        f"latency p50 {res.latency_ms_p50:.1f} ms, p99 {res.latency_ms_p99:.1f} ms",
        f"machine: {res.machine_cores} cores; other processes kept {res.other_cores:.2f} cores busy during the "
        f"ingest run{' (the PostgreSQL server included)' if res.db != 'sqlite' else ''}, "
        f"{res.other_cores_reference:.2f} during the reference"
        + ("  (busy machine: figures are low)" if max(res.other_cores, res.other_cores_reference) >= 0.2 else ""),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="measured interval (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="load before measuring starts (default 3)")
    p.add_argument("--senders", type=int, default=8,
                   help="concurrent export calls in flight, like that many exporting agents (default 8)")
    p.add_argument("--processes", type=int, default=0,
                   help="load-generator processes the senders are spread over (default min(2, senders))")
    p.add_argument("--batch", type=int, default=512, help="spans per export request (default 512)")
    p.add_argument("--requests", type=int, default=64,
                   help="distinct pre-encoded requests, replayed with fresh trace ids (default 64)")
    p.add_argument("--db", default="", help="database URL (default: SQLite in a temporary directory); a "
                   "postgresql:// URL works too (the spans are added to what it holds)")
    p.add_argument("--one-span-traces", action="store_true",
                   help="every span the root of its own trace (the worst case for the trace index and buffer)")
    p.add_argument("--reference-seconds", type=float, default=3.0, help="length of the decode-only run")
    p.add_argument("--startup", type=float, default=2.0, help="seconds allowed for the senders to connect")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON to FILE")
    p.add_argument("--compare", choices=[*COMPARED_SETTINGS, "none"], default="detection",
                   help="measure what one part costs: run the collector with it off and on, alternating "
                   "(default detection; span-metrics; hop-streams; own-process: the detectors on the writer "
                   "thread against in a process of their own; none: one run with everything on)")
    p.add_argument("--pairs", type=int, default=1, help="off/on pairs to alternate (default 1); each side's "
                   "mean is compared, so a machine that gets busier during the run weighs on both alike")
    args = p.parse_args(argv)
    if min(args.seconds, args.senders, args.batch, args.requests) <= 0 or args.warmup < 0:
        p.error("--seconds, --senders, --batch and --requests must be positive, --warmup not negative")
    key = COMPARED_SETTINGS.get(args.compare)
    sides = [{}] if key is None else [{key: False}, {key: True}] * max(args.pairs, 1)
    results: list[Results] = []
    failures: list[str] = []
    for settings in sides:
        try:
            res, failed = run(args, settings)
        except RuntimeError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
        print()
        print(report(res), flush=True)
        results.append(res)
        failures += failed
    if key is not None and not failures:
        print()
        print(compare_report(args.compare, results, key))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    for failure in failures:
        print(f"benchmark failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


# What each compared part may cost: the detectors 20 % of ingest throughput, the span metrics 10 %, the hop
# streams (CLIENT spans joined to their callees, judged as streams of their own) 15 % of the collector's CPU.
MAX_LOSS = {"detection": 0.20, "span-metrics": 0.10, "hop-streams": 0.15,
            "own-process": 0.35}  # its process decodes each block again (a quarter more CPU a span, on the other core)


def compare_report(name: str, results: Sequence[Results], key: str) -> str:
    """The cost of one part: mean throughput and collector CPU per span with it off and on."""
    off = [r for r in results if not r.settings[key]]
    on = [r for r in results if r.settings[key]]
    rate_off, rate_on = statistics.fmean(r.ingest_spans_per_s for r in off), statistics.fmean(
        r.ingest_spans_per_s for r in on)
    cpu_off, cpu_on = statistics.fmean(r.collector_cpu_us_per_span for r in off), statistics.fmean(
        r.collector_cpu_us_per_span for r in on)
    rss_off, rss_on = max(r.collector_peak_rss_mb for r in off), max(r.collector_peak_rss_mb for r in on)
    rate_loss = 1 - rate_on / rate_off if rate_off else 0.0
    cpu_share = 1 - cpu_off / cpu_on if cpu_on else 0.0
    busy = max(r.other_cores for r in results)
    bar = MAX_LOSS[name]
    return (f"{name} off: {rate_off:,.0f} spans/s, {cpu_off:.1f} us collector CPU per span, peak {rss_off:.0f} MB "
            f"(runs: {', '.join(f'{r.ingest_spans_per_s:,}' for r in off)})\n"
            f"{name} on:  {rate_on:,.0f} spans/s, {cpu_on:.1f} us collector CPU per span, peak {rss_on:.0f} MB "
            f"(runs: {', '.join(f'{r.ingest_spans_per_s:,}' for r in on)})\n"
            f"cost of {name}: {rate_loss:+.1%} throughput, {cpu_share:+.1%} of the collector's CPU per span "
            f"(bar: under {bar:.0%}: {'PASS' if max(rate_loss, cpu_share) < bar else 'OVER'})"
            + (f"  -- other processes kept up to {busy:.2f} cores busy: noisy figures" if busy >= 0.2 else ""))


if __name__ == "__main__":
    sys.exit(main())
