"""Memory under abusive input: unique 1 MiB span names and a million unique operation names, sent at full speed.

Run from the repository root: ``python -m benchmarks.memory_abuse`` (``make bench``).

What is measured
----------------
A real ``spikehound collector`` child process (SQLite in a temporary directory, defaults otherwise: detectors
and span metrics on) is loaded in two phases, while a thread samples its resident memory (``VmRSS`` of
``/proc/PID/status``, every 0.2 s; the kernel's high-water mark ``VmHWM`` is reported too) and another times
``GET /metrics`` every 5 s (one at a time, as Prometheus scrapes):

A. **Long names** over OTLP/HTTP: ``--long-senders`` threads send requests of 30 spans whose names are each 1 MiB
   and unique (in their first characters, so they stay unique once cut to ``collector.max_name_length``),
   plus a fresh trace id per span, back to back; a refusal (429) is followed by the next request after 50 ms.
   It runs until ``--long-spans`` spans were sent or ``--long-seconds`` passed, whichever comes first: a
   million 1 MiB names is a terabyte, more than loopback carries in a benchmark's time, so the volume sent is
   printed as it was.
   Eight senders of 30 MiB want more than the default ``collector.max_bytes_in_flight`` (128 MiB).
B. **Unique operation names** over OTLP/gRPC: ``--operation-spans`` spans (a million by default) in 512-span
   requests from ``--senders`` threads, every span name unique (``op-`` and 16 hex digits), retried after
   RESOURCE_EXHAUSTED.

Beside them, in the same run: the idle collector's RSS and ``/metrics`` time before the load (the reference),
and both again after it. At the end a SIGHUP that changes a retention key makes the collector run retention
at once (it otherwise runs every five minutes), and the ``operations`` table is counted before and after.

This is a measurement, not a test: it prints the figures beside the bar (RSS under 1 GB throughout,
``/metrics`` under 1 s) and exits 0 whatever they are; non-zero only when the benchmark itself failed
(the collector died, nothing was accepted).
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ingest import EXPORT_METHOD, Collector

MIB = 1024 * 1024
RSS_BAR_BYTES = 1_000_000_000
METRICS_BAR_SECONDS = 1.0
LONG_SPANS_PER_REQUEST = 30  # 30 MiB: just under the default collector.max_request_bytes (32 MiB)
OPERATION_SPANS_PER_REQUEST = 512
NAME_MARK = 16  # the leading characters of a name that a request makes unique
RETENTION_SECONDS = 300  # how long the benchmark waits for retention after the SIGHUP
SCRAPE_SECONDS = 5.0  # between the starts of two GET /metrics, as a Prometheus scraping every 5 s (never overlapping)


# --- requests ----------------------------------------------------------------------------------


class Template:
    """An encoded request whose span names and trace ids are made fresh by overwriting bytes in place.

    Re-encoding 30 MiB of protobuf per request would cost the load generator more than the collector;
    copying the template and writing a few hundred bytes costs a few milliseconds.
    """

    def __init__(self, service: str, spans: int, name_chars: int, name_prefix: str = "") -> None:
        now = time.time_ns()
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = service
        rs.resource.attributes.add(key="host.name").value.string_value = "abuse-host"
        scope = rs.scope_spans.add()
        marks, ids = [], []
        for i in range(spans):
            mark, trace_id = f"{i:0{NAME_MARK}d}", b"TRACEID!" + i.to_bytes(8, "big")
            name = name_prefix + mark + "x" * max(name_chars - len(name_prefix) - NAME_MARK, 0)
            scope.spans.add(trace_id=trace_id, span_id=(i + 1).to_bytes(8, "big"), name=name, kind=2,
                            start_time_unix_nano=now - 3_000_000, end_time_unix_nano=now)
            marks.append(mark.encode())
            ids.append(trace_id)
        self.body = req.SerializeToString()
        self.spans = spans
        self.name_offsets = [self._find(m, name_prefix.encode()) for m in marks]
        self.id_offsets = [self.body.index(t) for t in ids]

    def _find(self, mark: bytes, prefix: bytes) -> int:
        at = self.body.index(prefix + mark) + len(prefix)
        assert self.body.find(prefix + mark, at + 1) == -1, "a name mark must occur once"
        return at

    def fresh(self) -> bytes:
        """The request with unique span names and trace ids."""
        buf = bytearray(self.body)
        for at in self.name_offsets:
            buf[at:at + NAME_MARK] = os.urandom(NAME_MARK // 2).hex().encode()
        for at in self.id_offsets:
            buf[at:at + 16] = os.urandom(16)
        return bytes(buf)


# --- watching the collector ------------------------------------------------------------------------


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    return 0


def get_metrics(api_port: int) -> tuple[float, int, str]:
    """Seconds to answer GET /metrics, its body size, and the body."""
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/metrics", timeout=60) as r:
        body = r.read()
    return time.perf_counter() - started, len(body), body.decode()


@dataclass
class Watch:
    """RSS samples and /metrics timings of one phase."""

    rss: list[int] = field(default_factory=list)
    metrics_seconds: list[float] = field(default_factory=list)
    metrics_bytes: list[int] = field(default_factory=list)


class Watcher:
    """Samples RSS every 0.2 s and times /metrics every ``SCRAPE_SECONDS``, into the current phase's ``Watch``."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.phase = Watch()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._rss, daemon=True),
                         threading.Thread(target=self._metrics, daemon=True)]

    def start(self, phase: Watch) -> None:
        self.phase = phase
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:
                t.join(120)

    def _rss(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.phase.rss.append(rss_bytes(self.collector.pid))
            except OSError:
                return  # the collector is gone; the phases notice

    def _metrics(self) -> None:
        next_at = time.monotonic() + SCRAPE_SECONDS
        while not self._stop.wait(max(next_at - time.monotonic(), 0.0)):
            next_at += SCRAPE_SECONDS
            phase = self.phase
            try:
                seconds, size, _ = get_metrics(self.collector.api_port)
            except OSError as exc:
                print(f"  GET /metrics failed: {exc}", flush=True)
                continue
            phase.metrics_seconds.append(seconds)
            phase.metrics_bytes.append(size)


# --- the load ------------------------------------------------------------------------------------------


@dataclass
class Sent:
    """What one phase's senders sent and how it was answered (shared by its threads)."""

    requests: int = 0
    spans: int = 0
    bytes: int = 0
    accepted_spans: int = 0
    refused: int = 0  # 429 / RESOURCE_EXHAUSTED, or the connection closed on an unread body
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, spans: int, size: int, accepted: bool) -> None:
        with self.lock:
            self.requests += 1
            self.spans += spans
            self.bytes += size
            if accepted:
                self.accepted_spans += spans
            else:
                self.refused += 1


def long_names(port: int, template: Template, senders: int, max_spans: int, seconds: float) -> Sent:
    """Phase A: OTLP/HTTP requests of unique 1 MiB names from ``senders`` threads."""
    sent = Sent()
    end = time.monotonic() + seconds

    def sender() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < end and sent.spans < max_spans:
            body = template.fresh()
            try:
                conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                # Refused before the body was read: the collector closed the connection under the upload.
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                status = 429
            if status not in (200, 429):
                with sent.lock:
                    sent.errors.append(f"HTTP {status}")
            sent.add(template.spans, len(body), status == 200)
            if status != 200:
                time.sleep(0.05)
        conn.close()

    _run_threads(sender, senders)
    return sent


def unique_operations(endpoint: str, template: Template, senders: int, total_spans: int) -> Sent:
    """Phase B: OTLP/gRPC requests of 512 spans with unique names until ``total_spans`` were accepted."""
    import grpc

    sent = Sent()
    claimed = [0]  # spans sent or being sent that may yet be accepted
    with grpc.insecure_channel(endpoint) as channel:
        export = channel.unary_unary(EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString)

        def sender() -> None:
            while True:
                with sent.lock:
                    if claimed[0] >= total_spans:
                        return
                    claimed[0] += template.spans
                body = template.fresh()
                try:
                    export(body, timeout=120)
                    accepted = True
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                        with sent.lock:
                            sent.errors.append(f"{exc.code().name}: {exc.details()}")
                        return
                    accepted = False
                    with sent.lock:
                        claimed[0] -= template.spans
                sent.add(template.spans, len(body), accepted)
                if not accepted:
                    time.sleep(0.05)

        _run_threads(sender, senders)
    return sent


def _run_threads(target: Callable[[], None], n: int) -> None:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- reporting -----------------------------------------------------------------------------------------


def operations_rows(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute("SELECT count(*) FROM operations").fetchone()[0]


def counters(text: str) -> dict[str, float]:
    """The samples of /metrics this benchmark reports, by name and labels."""
    wanted = ("spikehound_ingest_truncated_total", "spikehound_ingest_rejected_requests_total",
              "spikehound_span_metrics_overflow_spans_total", "spikehound_ingest_stored_total",
              "spikehound_trace_buffer_evicted_traces_total", "spikehound_retention_deleted_total")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def phase_line(name: str, watch: Watch) -> str:
    rss = max(watch.rss, default=0)
    times = watch.metrics_seconds
    timed = (f"GET /metrics {len(times)} times: median {statistics.median(times) * 1000:,.0f} ms, "
             f"max {max(times) * 1000:,.0f} ms, body up to {max(watch.metrics_bytes) / 1e3:,.0f} kB"
             if times else "GET /metrics: not timed")
    return f"  {name}: RSS max {mb(rss)} ({len(watch.rss)} samples); {timed}"


def idle_figures(collector: Collector, rounds: int = 5) -> tuple[int, float, int]:
    """RSS, median /metrics seconds and body size of the collector now."""
    times, size = [], 0
    for _ in range(rounds):
        seconds, size, _ = get_metrics(collector.api_port)
        times.append(seconds)
        time.sleep(0.2)
    return rss_bytes(collector.pid), statistics.median(times), size


@dataclass
class Phase:
    """One load on a fresh collector, with the collector's figures before, during and after it."""

    name: str
    sent: Sent = field(default_factory=Sent)
    seconds: float = 0.0
    idle: tuple[int, float, int] = (0, 0.0, 0)  # RSS, /metrics seconds, /metrics bytes
    during: Watch = field(default_factory=Watch)
    after: tuple[int, float, int] = (0, 0.0, 0)
    hwm: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    operations: tuple[int, int] = (0, 0)  # rows after the load, after retention
    exit_code: int | None = None

    def report(self) -> list[str]:
        idle_rss, idle_t, idle_size = self.idle
        after_rss, after_t, after_size = self.after
        sent = self.sent
        lines = [f"{self.name}",
                 f"  reference, idle before the load: RSS {mb(idle_rss)}, GET /metrics {idle_t * 1000:,.1f} ms "
                 f"({idle_size / 1e3:,.0f} kB)",
                 f"  sent {sent.spans:,} spans in {sent.requests:,} requests ({sent.bytes / 2**30:,.2f} GiB) in "
                 f"{self.seconds:.0f} s; accepted {sent.accepted_spans:,} ({sent.accepted_spans / self.seconds:,.0f} "
                 f"spans/s); {sent.refused:,} requests told to retry later",
                 phase_line("during the load", self.during),
                 f"  after the load: RSS {mb(after_rss)}, GET /metrics {after_t * 1000:,.1f} ms "
                 f"({after_size / 1e3:,.0f} kB)",
                 f"  RSS peak {mb(max(self.during.rss, default=0))} sampled, {mb(self.hwm)} VmHWM"]
        if self.operations != (0, 0):
            lines.append(f"  operations table: {self.operations[0]:,} rows after the load, {self.operations[1]:,} "
                         "after retention (run by a SIGHUP)")
        lines += [f"  {name} {value:,.0f}" for name, value in self.counters.items() if value]
        return lines


def run_phase(phase: Phase, load: Callable[[Collector], Sent], settings: dict[str, str],
              prune_operations: bool = False) -> Phase:
    """Run ``load`` against a fresh collector (``settings``: more SPIKEHOUND_* variables), watching it."""
    with tempfile.TemporaryDirectory(prefix="spikehound-memory-") as tmp:
        workdir = Path(tmp)
        db, config = workdir / "spikehound.db", workdir / "collector.toml"
        config.write_text("[storage]\nspan_retention_hours = 72\n")
        collector = Collector(f"sqlite:///{db}", workdir)
        collector.env.update(settings, SPIKEHOUND_CONFIG=str(config))
        collector.start()
        watcher = Watcher(collector)
        try:
            time.sleep(2)
            phase.idle = idle_figures(collector)
            print(f"{phase.name} ...", flush=True)
            watcher.start(phase.during)
            started = time.monotonic()
            phase.sent = load(collector)
            phase.seconds = time.monotonic() - started
            collector.check_alive()
            time.sleep(3)  # the last commits, and a /metrics scrape after them
            watcher.stop()
            phase.after = idle_figures(collector)
            if prune_operations:
                phase.operations = (operations_rows(db), prune(collector, db, config))
            phase.counters = counters(get_metrics(collector.api_port)[2])
            phase.hwm = rss_bytes(collector.pid, "VmHWM")
        finally:
            watcher.stop()
            phase.exit_code = collector.stop()
    return phase


def prune(collector: Collector, db: Path, config: Path) -> int:
    """Make the collector run retention now (a SIGHUP with a changed retention key); the operations left."""
    config.write_text("[storage]\nspan_retention_hours = 71\n")
    assert collector.proc is not None
    started = time.monotonic()
    collector.proc.send_signal(signal.SIGHUP)
    while time.monotonic() < started + RETENTION_SECONDS:
        time.sleep(1)
        if "operations not recorded" in collector.log_tail(200):  # retention's line once done
            print(f"  retention took {time.monotonic() - started:.0f} s", flush=True)
            break
    return operations_rows(db)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_abuse", description=__doc__.split("\n")[0])
    parser.add_argument("--long-spans", type=int, default=1_000_000,
                        help="phase A stops after sending this many 1 MiB-name spans (default 1,000,000) ...")
    parser.add_argument("--long-seconds", type=float, default=60.0, help="... or after this long (default 60)")
    parser.add_argument("--operation-spans", type=int, default=1_000_000,
                        help="phase B: spans with unique operation names (default 1,000,000)")
    parser.add_argument("--long-senders", type=int, default=8, help="concurrent requests of phase A (default 8)")
    parser.add_argument("--senders", type=int, default=4, help="concurrent requests of phase B (default 4)")
    parser.add_argument("--span-metrics-max-series", type=int,
                        help="the collectors' collector.span_metrics_max_series (default: theirs, 5,000)")
    args = parser.parse_args(argv)
    settings = ({"SPIKEHOUND_COLLECTOR_SPAN_METRICS_MAX_SERIES": str(args.span_metrics_max_series)}
                if args.span_metrics_max_series else {})

    print("building requests ...", flush=True)
    long_template = Template("abuse-long-names", LONG_SPANS_PER_REQUEST, MIB)
    op_template = Template("abuse-operations", OPERATION_SPANS_PER_REQUEST, 3 + NAME_MARK, name_prefix="op-")
    a = run_phase(Phase(f"A. unique 1 MiB span names over OTLP/HTTP, {args.long_senders} senders, "
                        f"{LONG_SPANS_PER_REQUEST} spans a request, until {args.long_spans:,} spans or "
                        f"{args.long_seconds:.0f} s"),
                  lambda c: long_names(c.http_port, long_template, args.long_senders, args.long_spans,
                                       args.long_seconds), settings)
    b = run_phase(Phase(f"B. {args.operation_spans:,} spans with unique operation names over OTLP/gRPC, "
                        f"{args.senders} senders, {OPERATION_SPANS_PER_REQUEST} spans a request"),
                  lambda c: unique_operations(c.grpc_endpoint, op_template, args.senders, args.operation_spans),
                  settings, prune_operations=True)

    print()
    print(f"collector.span_metrics_max_series = {args.span_metrics_max_series or 'default (5,000)'}")
    for phase in (a, b):
        print("\n".join(phase.report()))
    peak = max(max(p.during.rss, default=0) for p in (a, b))
    hwm = max(a.hwm, b.hwm)
    print(f"collector RSS peak over both: {mb(peak)} sampled, {mb(hwm)} VmHWM (start-up included)   bar < "
          f"{mb(RSS_BAR_BYTES)}: {'PASS' if max(peak, hwm) < RSS_BAR_BYTES else 'FAIL'}")
    slowest = max(a.during.metrics_seconds + b.during.metrics_seconds + [a.after[1], b.after[1]])
    print(f"slowest GET /metrics: {slowest * 1000:,.0f} ms   bar < {METRICS_BAR_SECONDS:.0f} s: "
          f"{'PASS' if slowest < METRICS_BAR_SECONDS else 'FAIL'}")
    for error in sorted(set(a.sent.errors + b.sent.errors))[:5]:
        print(f"unexpected answer: {error}")
    if any(p.exit_code not in (0, None) or not p.sent.accepted_spans for p in (a, b)):
        print("benchmark failed: a collector exited badly or accepted nothing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
