"""Collector scale-out: N collectors on one PostgreSQL, one of them the detection leader.

Run from the repository root: ``python -m benchmarks.scale_out`` (``make bench``).

What is measured
----------------
In a cluster (``cluster.enabled``, docs/scale-out.md) every collector stores what it receives and adds one
feed row per commit; the leader also reads every member's feed back from the database and runs the detectors
over all spans. What that design costs, and where it stops scaling, is three per-span costs:

* a **follower's** collector CPU per span it stores (receive, decode, write, stamp the feed): the part that
  more collectors divide;
* the **leader's detection** CPU per span of the whole cluster (read the feed, decode the blocks again, judge):
  the leader's CPU less what its own share of the ingest costs at the followers' rate. One leader does this for
  every span, on one core (one Python process), whatever N is;
* **PostgreSQL's** CPU per span (every server process, the postmaster's exited children included): the
  shared database every member and the leader use.

Configurations, each on a fresh database of one throwaway PostgreSQL 15 server (``harness.pgserver``):
a single collector *not* in cluster mode (the reference: detectors inline, no feed), then N = 1, 2, 3
(``--collectors``) collectors in cluster mode. Each is loaded like ``benchmarks.ingest`` loads one collector:
the same pre-encoded 7-span inference traces in ``--batch``-span requests with fresh trace ids each round,
``--senders`` export calls in flight from ``--processes`` sender processes (raw gRPC, retrying
RESOURCE_EXHAUSTED / UNAVAILABLE), except that each request goes whole to one collector chosen by its first
trace id (``benchmarks.routed_load``), as agents routing by trace id keep each trace on one collector. After a
warm-up, for ``--seconds``: acknowledged spans/s; each collector's CPU seconds (``/proc``); PostgreSQL's CPU
seconds; the machine's busy seconds. Afterwards the collectors' ``spikehound_ingest_stored_total`` and the
spans in the stored span blocks must be at least the acknowledged count, and the leader's
``spikehound_cluster_feed_spans_total`` must reach the stored count: its lag at the end of the measured interval
and the time it takes to catch up once the load stops are reported (``--catch-up-timeout``).

Beside them, as in ``benchmarks.ingest``: the protobuf-decode-only rate of the same request bodies in this
process, the reference that normalises for the machine. Last, a projection from the measured per-span costs:
spans/s of N collectors of C cores each on a database server of D cores, ``min(N*C/follower, D/postgres,
1 core/leader detection)``, and which term binds. On a small machine (the 2-core CI box) every collector,
the senders and PostgreSQL share the same cores, so the measured totals cannot grow with N there: the
per-span costs are what carry over to real hosts.

This is a measurement, not a test: it exits 0 whatever the rates, and non-zero only when the benchmark
itself failed (a collector died or exited uncleanly, acknowledged spans missing from storage, no leader, a
leader whose feed stopped moving while it was still behind).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from benchmarks.ingest import (
    Collector,
    SenderResult,
    collect_results,
    count_span_rows,
    decode_rate,
    machine_busy_seconds,
    make_workload,
    percentile,
    process_cpu_seconds,
    spawn_senders,
)
from benchmarks.routed_load import routed_sender_process
from harness.pgserver import PostgresServer
from harness.scrape import sample, scrape, total

STORED = "spikehound_ingest_stored_total"
FED = "spikehound_cluster_feed_spans_total"
LEADER = "spikehound_cluster_leader"
JUDGED = "spikehound_detector_judged_windows_total"
LEADER_TIMEOUT_SECONDS = 30.0
STALL_SECONDS = 20.0  # a leader behind whose feed count has not moved this long is stuck: the benchmark fails


# --- measuring --------------------------------------------------------------------------------------------


def postgres_cpu_seconds(server: PostgresServer) -> float:
    """CPU seconds of the whole PostgreSQL server: the postmaster, its live children (backends, writers) and,
    through the postmaster's child times, every child that has exited and been reaped."""
    pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    root = psutil.Process(pid)
    t = root.cpu_times()
    seconds = t.user + t.system + t.children_user + t.children_system
    for child in root.children():
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:  # exited meanwhile: its time is in the postmaster's children_* next time
            continue
        seconds += c.user + c.system
    return seconds


@dataclass(slots=True)
class Member:
    name: str
    collector: Collector
    leader: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.collector.api_port}"

    def metrics(self) -> dict[str, float]:
        s = scrape(self.url)
        return {"stored": total(s, STORED, signal="spans"), "fed": total(s, FED),
                "leader": sample(s, LEADER) or 0.0, "judged": total(s, JUDGED)}


@dataclass(slots=True)
class Snapshot:
    at: float
    busy: float
    pg_cpu: float
    cpu: list[float]
    metrics: list[dict[str, float]]

    @property
    def stored(self) -> float:
        return sum(m["stored"] for m in self.metrics)


def snapshot(members: Sequence[Member], server: PostgresServer) -> Snapshot:
    cpu = [process_cpu_seconds(m.collector.pid) for m in members]
    return Snapshot(time.time(), machine_busy_seconds(), postgres_cpu_seconds(server), cpu,
                    [m.metrics() for m in members])


@dataclass(slots=True)
class MemberFigures:
    name: str
    leader: bool
    stored_spans_per_s: float
    cores: float
    cpu_us_per_stored_span: float


@dataclass(slots=True)
class Run:
    label: str
    collectors: int
    cluster: bool
    seconds: float
    spans_per_s: float = 0.0  # acknowledged in the measured interval, all collectors
    stored_spans_per_s: float = 0.0  # collector side, all collectors
    collector_cores: float = 0.0
    collector_cpu_us_per_span: float = 0.0  # all collectors' CPU / all stored spans
    leader_cpu_us_per_span: float | None = None  # the leader's CPU / the spans it stored itself
    follower_cpu_us_per_span: float | None = None  # mean over the followers of CPU / spans stored
    leader_detection_cpu_us_per_span: float | None = None  # leader's extra, per span fed to the detectors
    postgres_cores: float = 0.0
    postgres_cpu_us_per_span: float = 0.0
    sender_cores: float = 0.0
    machine_busy_cores: float = 0.0
    other_cores: float = 0.0  # busy, less collectors, PostgreSQL and senders: noise from outside
    acked_spans: int = 0
    stored_spans_metric: int = 0
    span_rows: int | None = None
    fed_spans_per_s: float | None = None  # the leader's feed in the measured interval
    leader_lag_spans: int | None = None  # stored - fed at the end of the measured interval
    catch_up_s: float | None = None  # from the end of the load until fed >= stored (None: not within timeout)
    final_lag_spans: int | None = None
    judged_windows: int = 0
    retries: int = 0
    calls: int = 0
    latency_ms_p50: float = 0.0
    latency_ms_p99: float = 0.0
    members: list[MemberFigures] = field(default_factory=list)


# --- one configuration ------------------------------------------------------------------------------------


def _create_database(server: PostgresServer, label: str) -> str:
    name = f"scale_{label.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.url.rsplit("/", 1)[0] + f"/{name}"


def _start_members(url: str, workdir: Path, n: int, cluster: bool) -> list[Member]:
    """N collectors on ``url``; in a cluster the first is started alone until it leads, so it is the leader."""
    members: list[Member] = []
    try:
        for i in range(n):
            (workdir / f"c{i}").mkdir()
            collector = Collector(url, workdir / f"c{i}")
            name = f"member-{i}"
            if cluster:
                collector.env.update(SPIKEHOUND_CLUSTER_ENABLED="true", SPIKEHOUND_CLUSTER_MEMBER=name)
            collector.start()
            members.append(Member(name, collector))
            if cluster and i == 0:
                deadline = time.monotonic() + LEADER_TIMEOUT_SECONDS
                while not members[0].metrics()["leader"]:
                    collector.check_alive()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no leader in {LEADER_TIMEOUT_SECONDS:.0f} s:\n{collector.log_tail()}")
                    time.sleep(0.2)
        if cluster:
            leading = [m for m in members if m.metrics()["leader"]]
            if len(leading) != 1:
                raise RuntimeError(f"{len(leading)} collectors lead, expected exactly one")
            leading[0].leader = True
    except BaseException:
        for m in members:
            m.collector.kill()
        raise
    return members


def _wait_until(at: float, members: Sequence[Member]) -> None:
    while (left := at - time.time()) > 0:
        time.sleep(min(left, 0.25))
        for m in members:
            m.collector.check_alive()


def _catch_up(members: Sequence[Member], leader: Member, load_ended: float, timeout: float,
              failures: list[str]) -> tuple[float | None, int]:
    """Seconds from the end of the load until the leader has fed every stored span (None: not within
    ``timeout``), and the lag left then. A leader behind whose feed stops moving is a failure."""
    deadline = load_ended + timeout
    last_fed, moved_at = -1.0, time.time()
    while True:
        stored = sum(m.metrics()["stored"] for m in members)
        fed = leader.metrics()["fed"]
        now = time.time()
        if fed >= stored:
            return max(now - load_ended, 0.0), 0
        if fed > last_fed:
            last_fed, moved_at = fed, now
        elif now - moved_at > STALL_SECONDS:
            failures.append(f"the leader's feed stopped at {fed:,.0f} spans of {stored:,.0f} stored "
                            f"(no progress for {STALL_SECONDS:.0f} s)")
            return None, int(stored - fed)
        if now > deadline:
            return None, int(stored - fed)
        for m in members:
            m.collector.check_alive()
        time.sleep(0.25)


def _stop(members: Sequence[Member], failures: list[str]) -> None:
    """Followers first (a leader stopped first would hand its lead to one of them), then the leader."""
    for m in sorted(members, key=lambda m: m.leader):
        code = m.collector.stop()
        if code not in (0, None):
            failures.append(f"{m.name} exited with {code}:\n{m.collector.log_tail()}")


def run_configuration(args: argparse.Namespace, server: PostgresServer, workload: Any, n: int, cluster: bool,
                      failures: list[str]) -> Run:
    label = f"cluster-{n}" if cluster else "single"
    res = Run(label=label, collectors=n, cluster=cluster, seconds=args.seconds)
    url = _create_database(server, label)
    processes = max(1, min(args.processes or min(2, args.senders), args.senders))
    workdir = Path(tempfile.mkdtemp(prefix=f"spikehound-scale-{label}-"))
    members: list[Member] = []
    try:
        members = _start_members(url, workdir, n, cluster)
        leader = next((m for m in members if m.leader), None)
        measure_at = time.time() + args.startup + args.warmup
        end_at = measure_at + args.seconds
        endpoints = [m.collector.grpc_endpoint for m in members]
        pipes, procs, _ = spawn_senders(routed_sender_process, endpoints, workload, args.senders, processes,
                                        measure_at, end_at)
        print(f"[{label}] {n} collector(s){' in cluster mode' if cluster else ', not in cluster mode'}, "
              f"{args.senders} export calls in flight from {processes} sender process(es), warm-up "
              f"{args.warmup:g} s, measuring {args.seconds:g} s", flush=True)
        try:
            _wait_until(measure_at, members)
            s0 = snapshot(members, server)
            _wait_until(end_at, members)
            s1 = snapshot(members, server)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        results = collect_results(pipes, procs, failures, label)
        for m in members:
            m.collector.check_alive()
        _figures(res, members, leader, s0, s1, results)
        if leader is not None:
            res.catch_up_s, res.final_lag_spans = _catch_up(members, leader, end_at, args.catch_up_timeout, failures)
            if res.catch_up_s is not None:
                res.catch_up_s = round(res.catch_up_s, 1)
        final = [m.metrics() for m in members]
        res.stored_spans_metric = int(sum(f["stored"] for f in final))
        res.judged_windows = int(sum(f["judged"] for f in final))
        if res.stored_spans_metric < res.acked_spans:
            failures.append(f"{label}: collectors stored {res.stored_spans_metric:,} spans but acknowledged "
                            f"{res.acked_spans:,}")
        if not res.spans_per_s:
            failures.append(f"{label}: no span was acknowledged in the measured interval")
    finally:
        _stop(members, failures)
        shutil.rmtree(workdir, ignore_errors=True)
    res.span_rows = count_span_rows(url)
    if res.span_rows is not None and res.span_rows < res.acked_spans:
        failures.append(f"{label}: only {res.span_rows:,} spans stored for {res.acked_spans:,} acknowledged")
    return res


def _figures(res: Run, members: Sequence[Member], leader: Member | None, s0: Snapshot, s1: Snapshot,
             results: Sequence[SenderResult]) -> None:
    wall = s1.at - s0.at
    stored = s1.stored - s0.stored
    cpu = [b - a for a, b in zip(s0.cpu, s1.cpu, strict=True)]
    per_member = [b["stored"] - a["stored"] for a, b in zip(s0.metrics, s1.metrics, strict=True)]
    res.acked_spans = sum(r.acked_spans for r in results)
    res.spans_per_s = round(sum(r.measured_spans for r in results) / res.seconds)
    res.stored_spans_per_s = round(stored / wall)
    res.collector_cores = round(sum(cpu) / wall, 2)
    res.postgres_cores = round((s1.pg_cpu - s0.pg_cpu) / wall, 2)
    res.sender_cores = round(sum(r.cpu_seconds for r in results) / res.seconds, 2)
    res.machine_busy_cores = round((s1.busy - s0.busy) / wall, 2)
    res.other_cores = round(max(res.machine_busy_cores - res.collector_cores - res.postgres_cores
                                - res.sender_cores, 0.0), 2)
    if stored > 0:
        res.collector_cpu_us_per_span = round(sum(cpu) / stored * 1e6, 1)
        res.postgres_cpu_us_per_span = round((s1.pg_cpu - s0.pg_cpu) / stored * 1e6, 1)
    for m, c, k in zip(members, cpu, per_member, strict=True):
        res.members.append(MemberFigures(m.name, m.leader, round(k / wall), round(c / wall, 2),
                                         round(c / k * 1e6, 1) if k > 0 else 0.0))
    followers = [f for f in res.members if not f.leader and f.cpu_us_per_stored_span > 0]
    if leader is not None:
        i = members.index(leader)
        res.leader_cpu_us_per_span = res.members[i].cpu_us_per_stored_span
        fed = s1.metrics[i]["fed"] - s0.metrics[i]["fed"]
        res.fed_spans_per_s = round(fed / wall)
        res.leader_lag_spans = int(s1.stored - s1.metrics[i]["fed"])
        if followers:
            res.follower_cpu_us_per_span = round(statistics.fmean(f.cpu_us_per_stored_span for f in followers), 1)
            if fed > 0:  # the leader's CPU less its own ingest at the followers' rate, per span it judged
                extra = cpu[i] - res.follower_cpu_us_per_span / 1e6 * per_member[i]
                res.leader_detection_cpu_us_per_span = round(max(extra, 0.0) / fed * 1e6, 1)
    lat = [x for r in results for x in r.latencies_ms]
    res.latency_ms_p50 = round(percentile(lat, 0.50), 1)
    res.latency_ms_p99 = round(percentile(lat, 0.99), 1)
    res.retries = sum(r.retries for r in results)
    res.calls = sum(r.calls for r in results)


# --- reporting --------------------------------------------------------------------------------------------


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} us"


def report(res: Run, reference: Run | None) -> str:
    mode = "cluster mode" if res.cluster else "NOT in cluster mode (detectors inline, no feed)"
    lines = [f"{res.label}: {res.collectors} collector(s), {mode}: {res.spans_per_s:,.0f} spans/s acknowledged "
             f"(collectors {res.collector_cores:.2f} cores, PostgreSQL {res.postgres_cores:.2f}, senders "
             f"{res.sender_cores:.2f}, other {res.other_cores:.2f}; machine busy {res.machine_busy_cores:.2f})",
             f"  CPU per span: collectors {res.collector_cpu_us_per_span:.1f} us (all together), PostgreSQL "
             f"{res.postgres_cpu_us_per_span:.1f} us"]
    if res.cluster:
        lines.append(f"  leader {_us(res.leader_cpu_us_per_span)} per span it stored, followers' mean "
                     f"{_us(res.follower_cpu_us_per_span)}; leader's detection (its extra) "
                     f"{_us(res.leader_detection_cpu_us_per_span)} per span fed")
        lines.append("  members: " + "; ".join(
            f"{m.name}{' (leader)' if m.leader else ''} {m.stored_spans_per_s:,.0f} spans/s stored, {m.cores:.2f} "
            f"cores, {m.cpu_us_per_stored_span:.1f} us/span" for m in res.members))
        caught = (f"caught up {res.catch_up_s:.1f} s after the load stopped" if res.catch_up_s is not None
                  else f"NOT caught up within the timeout ({res.final_lag_spans:,} spans behind)")
        lines.append(f"  leader's feed: {res.fed_spans_per_s or 0:,.0f} spans/s fed to the detectors, "
                     f"{res.leader_lag_spans or 0:,} spans behind at the end of the measured interval, {caught}")
    if reference is not None and res.cluster and res.collectors == 1 and reference.collector_cpu_us_per_span:
        d_col = res.collector_cpu_us_per_span - reference.collector_cpu_us_per_span
        d_pg = res.postgres_cpu_us_per_span - reference.postgres_cpu_us_per_span
        lines.append(f"  the feed's cost (vs the single collector not in cluster mode): {d_col:+.1f} us collector "
                     f"CPU per span ({d_col / reference.collector_cpu_us_per_span:+.0%}), {d_pg:+.1f} us "
                     f"PostgreSQL CPU per span")
    rows = f", {res.span_rows:,} in span blocks" if res.span_rows is not None else ""
    lines.append(f"  check: acknowledged {res.acked_spans:,} (warm-up included), stored_total "
                 f"{res.stored_spans_metric:,}{rows}; {res.judged_windows:,} windows judged; {res.calls:,} calls, "
                 f"{res.retries:,} retried, latency p50 {res.latency_ms_p50:.1f} ms, p99 {res.latency_ms_p99:.1f} ms")
    return "\n".join(lines)


def projection(runs: Sequence[Run], cores: int, db_cores: int, up_to: int) -> tuple[str, dict[str, Any]]:
    """Spans/s of N collectors of ``cores`` cores on a ``db_cores``-core database, from the per-span costs of
    the measured cluster with the most collectors (the only one with followers and a many-member feed)."""
    basis = max((r for r in runs if r.cluster and r.follower_cpu_us_per_span
                 and r.leader_detection_cpu_us_per_span), key=lambda r: r.collectors, default=None)
    if basis is None:
        return "projection: needs a cluster of 2 or more collectors (a follower to tell ingest from detection)", {}
    f = basis.follower_cpu_us_per_span or 0.0
    p = basis.postgres_cpu_us_per_span
    d = basis.leader_detection_cpu_us_per_span or 0.0
    leader_cap = 1e6 / d if d else float("inf")
    lines = [f"projection from {basis.label}'s per-span costs: follower {f:.1f} us, PostgreSQL {p:.1f} us, leader's "
             f"detection {d:.1f} us; collectors of C = {cores} cores, a database server of D = {db_cores} cores:",
             "  spans/s = min(N * C / follower, D / PostgreSQL, 1 core / leader detection)"]
    table = []
    for n in range(1, up_to + 1):
        terms = {"collectors": n * cores * 1e6 / f, "PostgreSQL": db_cores * 1e6 / p if p else float("inf"),
                 "leader": leader_cap}
        binding = min(terms, key=lambda k: terms[k])
        table.append({"collectors": n, "spans_per_s": round(terms[binding]), "binds": binding})
        lines.append(f"  N = {n}: {terms[binding]:>12,.0f} spans/s  (collectors {terms['collectors']:,.0f}, "
                     f"PostgreSQL {terms['PostgreSQL']:,.0f}, leader {terms['leader']:,.0f}) -> {binding} binds")
    if d:
        # The leader also ingests its own 1/N share, and a Python process's detection thread shares its GIL.
        strict = [1e6 / (d + f / n) for n in range(1, up_to + 1)]
        lines.append(f"  (the leader also ingests its 1/N share in the same process: counting that, its bound is "
                     f"1 core / (detection + follower/N) = {strict[0]:,.0f} spans/s at N = 1, "
                     f"{strict[-1]:,.0f} at N = {up_to})")
    busiest = max((m.cores for r in runs for m in r.members), default=0.0)
    lines.append(f"  (a collector is one Python process: C cores per host means C collector processes per host, or "
                 f"as many cores as one process can use; the busiest collector here used {busiest:.2f} cores)")
    lines.append(f"on this machine ({os.cpu_count()} cores) every collector, the senders and PostgreSQL share the same "
                 f"cores, so the measured totals cannot grow with N here; the per-span costs are what carry over.")
    return "\n".join(lines), {"basis": basis.label, "follower_cpu_us_per_span": f, "postgres_cpu_us_per_span": p,
                              "leader_detection_cpu_us_per_span": d, "cores": cores, "db_cores": db_cores,
                              "table": table}


# --- main -------------------------------------------------------------------------------------------------


def _collector_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_out", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="measured interval per configuration (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="load before measuring starts (default 3)")
    p.add_argument("--collectors", type=_collector_counts, default=[1, 2, 3],
                   help="cluster sizes to run, comma-separated (default 1,2,3)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the single collector not in cluster mode (the feed's reference)")
    p.add_argument("--senders", type=int, default=8, help="concurrent export calls in flight (default 8)")
    p.add_argument("--processes", type=int, default=0,
                   help="load-generator processes the senders are spread over (default min(2, senders))")
    p.add_argument("--batch", type=int, default=512, help="spans per export request (default 512)")
    p.add_argument("--requests", type=int, default=64,
                   help="distinct pre-encoded requests, replayed with fresh trace ids (default 64)")
    p.add_argument("--reference-seconds", type=float, default=3.0, help="length of the decode-only run")
    p.add_argument("--startup", type=float, default=2.0, help="seconds allowed for the senders to connect")
    p.add_argument("--catch-up-timeout", type=float, default=30.0,
                   help="seconds after the load for the leader to feed every stored span (default 30)")
    p.add_argument("--project-cores", type=int, default=8, help="cores per collector host in the projection")
    p.add_argument("--project-db-cores", type=int, default=16, help="database server cores in the projection")
    p.add_argument("--long", action="store_true", help="60 s per configuration and 120 s to catch up")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON to FILE")
    args = p.parse_args(argv)
    if args.long:
        args.seconds, args.catch_up_timeout = max(args.seconds, 60.0), max(args.catch_up_timeout, 120.0)
    if min(args.seconds, args.senders, args.batch, args.requests) <= 0 or args.warmup < 0:
        p.error("--seconds, --senders, --batch and --requests must be positive, --warmup not negative")

    started = time.perf_counter()
    workload = make_workload(args.requests, args.batch)
    print(f"workload: {len(workload.bodies)} requests x {args.batch} spans, "
          f"{workload.size_bytes / workload.spans:.0f} bytes/span encoded", flush=True)
    reference_rate, reference_others = decode_rate(workload.bodies, args.reference_seconds)
    print(f"reference: protobuf decode + validation only, 1 thread, in this process: {reference_rate:,.0f} spans/s "
          f"(other processes kept {reference_others:.2f} cores busy meanwhile)", flush=True)

    configurations = ([] if args.no_reference else [(1, False)]) + [(n, True) for n in args.collectors]
    runs: list[Run] = []
    failures: list[str] = []
    try:
        with PostgresServer() as server:
            print(f"PostgreSQL: {server.url.rsplit('/', 1)[0]} (one fresh database per configuration)", flush=True)
            for n, cluster in configurations:
                try:
                    res = run_configuration(args, server, workload, n, cluster, failures)
                except RuntimeError as exc:
                    failures.append(f"{'cluster' if cluster else 'single'} x{n}: {exc}")
                    continue
                reference = next((r for r in runs if not r.cluster), None)
                print(report(res, reference), flush=True)
                runs.append(res)
    except RuntimeError as exc:  # no PostgreSQL
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1

    print()
    print(f"reference: protobuf decode only, 1 thread: {reference_rate:,.0f} spans/s; "
          + "; ".join(f"{r.label} {r.spans_per_s:,.0f} spans/s ({r.spans_per_s / reference_rate:.2f} of it)"
                      for r in runs))
    text, projected = projection(runs, args.project_cores, args.project_db_cores, 8)
    print(text)
    print(f"({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "reference_decode_spans_per_s": round(reference_rate), "other_cores_reference": round(reference_others, 2),
            "machine_cores": os.cpu_count(), "seconds": args.seconds, "senders": args.senders,
            "batch": args.batch, "runs": [asdict(r) for r in runs], "projection": projected}, indent=2) + "\n")
    for failure in failures:
        print(f"benchmark failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
