"""Storage-fault campaign: nothing acknowledged is lost, spikes and alerts as without faults.

Run from the repository root (slow: each run is the dataset's length in real time, about 6 minutes, plus
settling; the default campaign about 35 minutes, or about 10 with ``--parallel``)::

    python -m benchmarks.fault_campaign                      # every fault kind, the default counts
    python -m benchmarks.fault_campaign --only sigkill --kills 20
    python -m benchmarks.fault_campaign --kills 2 --pg-restarts 2 --outages 1 --outage-seconds 10 \\
        --disk-full 1 --dataset-faults slow_db --warmup 130 --fault-seconds 20 --gap 30 --parallel  # smoke

What runs
---------
A deterministic dataset (:func:`harness.fault_campaign_parts.build_dataset`): the scenario suite's inference
traffic (20 requests/s through gateway, preprocess, model server, postprocess on hosts edge-1, gpu-1..3),
seeded, with latency faults (by default slow_db, queue_wait and downstream_slow, 30 s each after a 130 s
warm-up, 40 s apart: the shortest timeline that gives three spikes), built again for each run with its
event time starting at the run's first whole minute, so that it arrives as live traffic: what agents spool
through a fault is data from before it. Spikes are compared by stream and start relative to the run's.
Spans only: the agents' own samples (one at start) are real, and would differ between runs.
One sender thread per host posts its host's spans as OTLP/HTTP protobuf to its own ``spikehound agent``
(own spool, ``agent.host_name`` = the host, sampling once at start) at real-time pace: second ``i`` of
event time once ``i + 1`` wall seconds have passed. A span is acknowledged when its agent answered 200.
The agents forward over OTLP/gRPC to one ``spikehound collector`` whose alerts go to a local webhook receiver.

Runs, each on a fresh database with fresh agents: the fault-free run (PostgreSQL), then
``sigkill`` (the collector SIGKILLed at seeded random moments and started again at once on the same database
and ports, PostgreSQL), ``detection-kill`` (the collector's detection process SIGKILLed at such moments, as
the OOM killer would pick it, and forked again by the collector; PostgreSQL), ``pg-restart`` (PostgreSQL
restarted, ``fast`` and ``immediate`` shutdown in turn), ``outage`` (PostgreSQL stopped for
``--outage-seconds``), ``disk-full`` (SQLite on a tmpfs the script mounts, filled with a filler file until
the collector refuses writes, held ``--disk-hold-seconds``, filler deleted; RLIMIT_FSIZE on the collector
where mounting is not possible).

After each run: every agent's queue empty, detection settled (no open window, every judged window written),
the alert outbox empty; then every acknowledged span looked up through ``GET /api/v1/traces/{id}`` (lost:
not served, duplicated: served more than once), the spikes (``GET /api/v1/spikes``: service, operation,
start, state, top cause) and the notifications (set of (spike, status, cause)) compared with the
fault-free run, every difference printed. Recovery: from the fault's end (restart issued, PostgreSQL
started, filler deleted) until ``/readyz`` answers 200 and the agents' forwarded counters move.

Prints one line per episode, the differences, and the table (per fault kind: episodes, acked spans, lost,
duplicated, spikes same/different, alerts same/different, recovery median/max); ``--json PATH`` writes it.
A measurement, not a test: exits 0 whatever it finds, 1 only when a run could not be carried out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import requests

from harness.api_client import list_spikes
from harness.daemons import AgentProcess, CollectorProcess, detection_settled
from harness.fault_campaign_parts import (
    EPOCH_NS,
    NS,
    Dataset,
    PacedSender,
    Recovery,
    alert_config,
    build_dataset,
    compare_spikes,
    next_start_ns,
    notifications,
    served_once,
    spike_key,
    spike_summary,
    wait_recovery,
)
from harness.pgserver import PostgresServer
from harness.scrape import sample, scrape, total
from harness.webhook_receiver import WebhookReceiver

KINDS = ("sigkill", "detection-kill", "pg-restart", "outage", "disk-full")


@dataclass
class RunResult:
    kind: str
    episodes: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    rejected: int = 0
    sender_retries: int = 0
    spikes: dict[str, Any] = field(default_factory=dict)
    notifications: list[list[str]] = field(default_factory=list)
    spike_differences: list[str] = field(default_factory=list)
    spikes_same: int = 0
    spikes_different: int = 0
    alerts_same: int = 0
    alerts_different: int = 0
    alert_differences: list[str] = field(default_factory=list)
    recoveries: list[float | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    log_excerpts: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    workdir: str = ""

    def recovery(self) -> tuple[float | None, float | None]:
        found = [r for r in self.recoveries if r is not None]
        return (statistics.median(found), max(found)) if found else (None, None)


class Run:
    """One run: its storage, collector, agents, webhook receiver and senders."""

    def __init__(self, kind: str, dataset: Callable[[int], Dataset], workdir: Path, args: argparse.Namespace) -> None:
        # The dataset is built again for each run, starting where the run starts: it is sent as live traffic.
        self.kind, self.make_dataset, self.workdir, self.args = kind, dataset, workdir, args
        self.dataset = dataset(EPOCH_NS)
        self.result = RunResult(kind, workdir=str(workdir))
        self.pg: PostgresServer | None = None
        self.mount: Path | None = None
        self.db_file: Path | None = None
        self.collector: CollectorProcess | None = None
        self.agents: list[AgentProcess] = []
        self.start_wall = 0.0
        self.log = print

    # -- set-up ---------------------------------------------------------------------------------------------

    def storage_url(self) -> str:
        if self.kind != "disk-full":
            self.pg = PostgresServer(base_dir=self.workdir / "pg")
            return self.pg.start()
        self.mount = self.workdir / "fs"
        self.mount.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mb}m", "tmpfs", str(self.mount)],
                              capture_output=True, text=True, check=False)
        if self.args.disk_rlimit or done.returncode != 0:
            if done.returncode == 0:
                subprocess.run(["umount", str(self.mount)], check=False)
            self.result.notes.append("RLIMIT_FSIZE on the collector instead of a small file system"
                                     + (f" (mount failed: {done.stderr.strip()})" if done.returncode else ""))
            self.mount = None
            (self.workdir / "fs").mkdir(exist_ok=True)
            self.db_file = self.workdir / "fs" / "db.sqlite"
        else:
            self.db_file = self.mount / "db.sqlite"
        return f"sqlite:///{self.db_file}"

    def start(self, hook_url: str) -> None:
        url = self.storage_url()
        config = self.workdir / "collector.toml"
        config.write_text(alert_config(hook_url))
        self.collector = retried(lambda: CollectorProcess(url, self.workdir, env={"SPIKEHOUND_CONFIG": str(config)}),
                                 120)
        for host in self.dataset.hosts:
            workdir = self.workdir / f"agent-{host}"
            workdir.mkdir(parents=True, exist_ok=True)
            self.agents.append(retried(lambda w=workdir, h=host, g=self.collector.grpc_endpoint: AgentProcess(
                g, w, interval=86400, env={"SPIKEHOUND_AGENT_HOST_NAME": h}), 60))

    def stop(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.terminate(60)
        if self.collector is not None:
            with contextlib.suppress(Exception):
                self.collector.terminate(60)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                shutil.copy(self.pg.log_path, self.workdir / "postgres.log")
            self.pg.stop()
        if self.mount is not None:
            subprocess.run(["umount", "-l", str(self.mount)], check=False)

    # -- probes ---------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        assert self.collector is not None
        return requests.get(f"{self.collector.api}/readyz", timeout=1).status_code == 200

    def forwarded(self) -> float:
        return sum(a.metric("spikehound_agent_forwarded_total", signal="spans") for a in self.agents)

    def collector_metric(self) -> Callable[[str], float]:
        assert self.collector is not None
        samples = scrape(self.collector.api, timeout=10)
        return lambda name: sample(samples, name) or 0.0

    def agents_drained(self) -> bool:
        for a in self.agents:
            m = a.metrics()
            if total(m, "spikehound_agent_queue_memory_bytes") or total(m, "spikehound_agent_spool_requests"):
                return False
            received = total(m, "spikehound_agent_received_total", signal="spans")
            done = (total(m, "spikehound_agent_forwarded_total", signal="spans")
                    + total(m, "spikehound_agent_dropped_total", signal="spans"))
            if done < received:
                return False
        return True

    # -- the run --------------------------------------------------------------------------------------------

    def execute(self) -> RunResult:
        started = time.monotonic()
        try:
            with WebhookReceiver() as hook:
                try:
                    self.start(hook.url)
                    self.drive()
                    self.settle(hook)
                    self.check(hook)
                finally:
                    self.collect_logs()
                    self.stop()
        except Exception as exc:  # the run is reported as failed, the campaign goes on
            self.result.notes.append(f"run failed: {exc.__class__.__name__}: {str(exc)[:2000]}")
        self.result.wall_s = time.monotonic() - started
        return self.result

    def drive(self) -> None:
        stop = threading.Event()
        self.dataset = self.make_dataset(next_start_ns())
        self.start_wall = self.dataset.epoch_ns / NS
        senders = [PacedSender(host, agent.http_endpoint, self.dataset.by_host[host], self.start_wall, stop)
                   for host, agent in zip(self.dataset.hosts, self.agents, strict=True)]
        for s in senders:
            s.start()
        try:
            self.faults()
        except Exception as exc:  # reported; the traffic goes on and the run is checked all the same
            self.result.notes.append(f"fault injection failed: {exc.__class__.__name__}: {exc}")
        finally:
            for s in senders:
                s.join()
        for s in senders:
            self.result.acked += len(s.acked)
            self.result.rejected += s.rejected
            self.result.sender_retries += s.retries
            if s.error is not None:
                self.result.notes.append(f"sender {s.host} failed: {s.error}")
        self._acked = [k for s in senders for k in s.acked]
        lag = max(s.max_lag_s for s in senders)
        self.log(f"[{self.kind}] sent {self.dataset.seconds} s of traffic; acked {self.result.acked} spans, "
                 f"{self.result.sender_retries} retries, senders at most {lag:.1f} s behind")

    def schedule(self, n: int, duration: float) -> list[float]:
        """Seeded random start times (s from the start) of ``n`` episodes, one per even slot of the run."""
        rng = random.Random(f"{self.args.seed}/{self.kind}")
        first, last = 20.0, self.dataset.seconds - 30.0
        slot = (last - first) / max(n, 1)
        return [first + i * slot + rng.uniform(0, max(slot - duration - 12.0, 0.0)) for i in range(n)]

    def faults(self) -> None:
        a = self.args
        plans: dict[str, tuple[int, float, Callable[[int], float]]] = {
            "sigkill": (a.kills, 0.0, self.sigkill), "detection-kill": (a.kills, 0.0, self.detection_kill),
            "pg-restart": (a.pg_restarts, 0.0, self.pg_restart),
            "outage": (a.outages, a.outage_seconds, self.outage), "disk-full": (a.disk_full, a.disk_hold_seconds + 5,
                                                                                self.disk_full)}
        if self.kind not in plans:
            return
        n, duration, episode = plans[self.kind]
        for i, at in enumerate(self.schedule(n, duration)):
            wait = self.start_wall + at - time.time()
            if wait > 0:
                time.sleep(wait)
            began = time.time() - self.start_wall
            t_end = episode(i)
            rec = wait_recovery(self.ready, self.forwarded, t_end, self.forwarded())
            self.result.episodes += 1
            self.result.recoveries.append(rec.seconds)
            self._report(i, began, t_end - self.start_wall, rec)

    def _report(self, i: int, began: float, ended: float, rec: Recovery) -> None:
        shown = "not recovered" if rec.seconds is None else f"recovered in {rec.seconds:.2f} s"
        self.log(f"[{self.kind}] episode {i + 1}: {began:.1f} s to {ended:.1f} s into the run; {shown} (/readyz 200 "
                 f"after {fmt(rec.ready_s)} s, forwarded counters moving after {fmt(rec.moving_s)} s) "
                 + " ".join(rec.notes))
        self.result.notes.extend(f"episode {i + 1}: {n}" for n in rec.notes)

    def sigkill(self, i: int) -> float:
        assert self.collector is not None
        self.collector.kill()
        t_end = time.time()  # restart issued at once, as systemd's Restart=always would
        self.collector.start(120)
        return t_end

    def detection_kill(self, i: int) -> float:
        """SIGKILL the collector's detection process (the OOM killer's usual pick: it holds the learned state);
        the collector forks another between two commits."""
        assert self.collector is not None and self.collector.proc is not None
        for child in psutil.Process(self.collector.proc.pid).children():
            child.kill()
        return time.time()

    def pg_restart(self, i: int) -> float:
        assert self.pg is not None
        self.pg.restart("fast" if i % 2 == 0 else "immediate")
        return time.time()

    def outage(self, i: int) -> float:
        assert self.pg is not None
        self.pg.shutdown("fast")
        time.sleep(self.args.outage_seconds)
        self.pg.start()
        return time.time()

    def disk_full(self, i: int) -> float:
        assert self.collector is not None and self.db_file is not None and self.collector.proc is not None
        filler = self.db_file.parent / "filler"
        errors_before = self.collector_metric()("spikehound_storage_write_errors_total")
        pid = self.collector.proc.pid
        if self.mount is not None:
            fill(filler)
        else:
            biggest = max(p.stat().st_size for p in self.db_file.parent.iterdir() if p.is_file())
            hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (biggest, hard))  # the soft limit: raised again below
        refused_at = None
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if not self.ready() or self.collector_metric()("spikehound_storage_write_errors_total") > errors_before:
                    refused_at = time.time()
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        if refused_at is None:
            self.result.notes.append(f"disk-full episode {i + 1}: the collector did not refuse writes within 60 s")
        time.sleep(self.args.disk_hold_seconds)
        if self.mount is not None:
            filler.unlink()
        else:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
        return time.time()

    # -- after the run --------------------------------------------------------------------------------------

    def detection_settled(self) -> bool:
        """``detection_settled``; after a detection process was killed, its replacement judges again and writes
        again what was judged after the checkpoint, so the written count runs ahead: every window closed and the
        counts still for two seconds."""
        metric = self.collector_metric()
        if self.kind != "detection-kill":
            return detection_settled(metric)
        names = ("spikehound_latency_open_windows", "spikehound_detector_judged_windows_total",
                 "spikehound_latency_windows_closed_total")
        before = [metric(n) for n in names]
        time.sleep(2.0)
        after = [metric(n) for n in names]
        return after == before and after[0] == 0 and after[1] > 0 and after[2] >= after[1]

    def settle(self, hook: WebhookReceiver) -> None:
        assert self.collector is not None
        deadline = time.time() + self.args.settle_timeout
        while not self.agents_drained():
            if time.time() > deadline:
                self.result.notes.append("agents' queues not empty at the settle timeout")
                break
            time.sleep(0.5)
        while True:
            try:
                if self.detection_settled():
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.result.notes.append("detection not settled at the settle timeout")
                break
            time.sleep(0.5)
        # Notifications: the outbox empty, and every resolved spike's resolve notice in (resolve_wait is 5 s).
        while time.time() < deadline:
            pending = sample(scrape(self.collector.api), "spikehound_alert_outbox_notifications", state="pending")
            spikes = list_spikes(self.collector.api, limit=10_000)
            resolved = {s["id"] for s in spikes if s["state"] == "resolved"}
            noticed = {n[0] for n in notifications(hook) if n[1] == "resolved"}
            if not pending and resolved <= noticed and len(resolved) == len(spikes):
                break
            time.sleep(1.0)
        time.sleep(2.0)

    def check(self, hook: WebhookReceiver) -> None:
        assert self.collector is not None
        spikes = list_spikes(self.collector.api, limit=10_000)
        if len(spikes) >= 10_000:
            self.result.notes.append("10,000 spikes or more: the list is cut")
        epoch = self.dataset.epoch_ns
        self.result.spikes = {k: list(v) for k, v in spike_summary(spikes, epoch).items()}
        keys = {s["id"]: spike_key(s, epoch) for s in spikes}
        self.result.notifications = sorted([keys.get(i, f"unknown spike {i}"), status, cause]
                                           for i, status, cause in notifications(hook))
        samples = scrape(self.collector.api)
        outages = {dict(labels).get("kind", ""): v for (name, labels), v in samples.items()
                   if name == "spikehound_storage_outages_total" and v}
        refused = total(samples, "spikehound_ingest_rejected_requests_total", reason="storage_unavailable")
        if outages or refused:
            self.result.notes.append(f"the collector (since its last start) counted storage outages {outages}, "
                                     f"{refused:.0f} requests refused as storage_unavailable")
        acked, lost, dup = served_once(self.collector.api, self._acked)
        self.result.lost, self.result.duplicated = lost, dup
        if acked != self.result.acked:
            self.result.notes.append(f"{self.result.acked - acked} (trace, span) keys were acknowledged more than "
                                     "once (the dataset repeats them)")

    def collect_logs(self) -> None:
        """Lines at ERROR or worse, and tracebacks, from every collector and agent log of the run."""
        for path in sorted(self.workdir.rglob("*.log")):
            lines = [ln for ln in path.read_text(errors="replace").splitlines()
                     if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln or "FATAL" in ln or "PANIC" in ln]
            if lines:
                self.result.log_excerpts.append(f"{path.relative_to(self.workdir)}: {len(lines)} line(s), first: "
                                                + " | ".join(ln[:300] for ln in lines[:3]))


D = TypeVar("D", CollectorProcess, AgentProcess)


def retried(make: Callable[[], D], timeout: float, tries: int = 3) -> D:
    """``make()`` a daemon and start it; again on new ports when it fails (a port another process took between
    free_port() and the daemon's bind: parallel runs, other tests on the machine)."""
    for attempt in range(tries):
        daemon = make()
        try:
            return daemon.start(timeout)
        except RuntimeError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def fill(path: Path) -> int:
    """Write zeros to ``path`` until its file system refuses (ENOSPC); the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    try:
        for size in (1 << 20, 4096, 1):
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                while True:
                    written += os.write(fd, chunk)
    finally:
        os.close(fd)
    return written


def compare(result: RunResult, baseline: RunResult) -> None:
    result.spike_differences = compare_spikes({k: tuple(v) for k, v in baseline.spikes.items()},
                                              {k: tuple(v) for k, v in result.spikes.items()})
    same = [i for i in baseline.spikes.keys() & result.spikes.keys() if baseline.spikes[i] == result.spikes[i]]
    result.spikes_same = len(same)
    result.spikes_different = len((baseline.spikes.keys() | result.spikes.keys()) - set(same))
    want = {tuple(n) for n in baseline.notifications}
    got = {tuple(n) for n in result.notifications}
    result.alerts_same, result.alerts_different = len(want & got), len(want ^ got)
    result.alert_differences = ([f"missing notification {n}" for n in sorted(want - got)]
                                + [f"extra notification {n}" for n in sorted(got - want)])


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: Sequence[RunResult]) -> str:
    head = (f"{'fault kind':15s}{'episodes':>9s}{'acked spans':>12s}{'lost':>7s}{'dup':>6s}{'spikes same/diff':>18s}"
            f"{'alerts same/diff':>18s}{'recovery med/max s':>20s}{'wall s':>8s}")
    rows = [head, "-" * len(head)]
    for r in results:
        med, mx = r.recovery()
        spikes = f"{r.spikes_same}/{r.spikes_different}"
        alerts = f"{r.alerts_same}/{r.alerts_different}"
        failed = " (failed)" if any(n.startswith("run failed") for n in r.notes) else ""
        rows.append(f"{r.kind:15s}{r.episodes:>9d}{r.acked:>12,d}{r.lost:>7d}{r.duplicated:>6d}{spikes:>18s}"
                    f"{alerts:>18s}{fmt(med) + ' / ' + fmt(mx):>20s}{r.wall_s:>8.0f}{failed}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=KINDS, help="this fault kind only (repeatable)")
    parser.add_argument("--kills", type=int, default=20, help="collector SIGKILLs (default 20)")
    parser.add_argument("--pg-restarts", type=int, default=10, help="PostgreSQL restarts, fast/immediate (10)")
    parser.add_argument("--outages", type=int, default=3, help="PostgreSQL outages (default 3)")
    parser.add_argument("--outage-seconds", type=float, default=60.0, help="length of each outage (default 60)")
    parser.add_argument("--disk-full", type=int, default=3, help="disk-full episodes (default 3)")
    parser.add_argument("--disk-hold-seconds", type=float, default=20.0, help="disk kept full this long (20)")
    parser.add_argument("--disk-mb", type=int, default=256, help="size of the SQLite file system (MiB, 256)")
    parser.add_argument("--disk-rlimit", action="store_true",
                        help="disk full by RLIMIT_FSIZE on the collector even where a tmpfs can be mounted")
    parser.add_argument("--dataset-faults", default="slow_db,queue_wait,downstream_slow",
                        help="latency faults of the dataset, in order (harness.scenarios.traffic.FAULTS)")
    parser.add_argument("--warmup", type=float, default=130.0, help="normal traffic before the first fault (s)")
    parser.add_argument("--fault-seconds", type=float, default=30.0, help="length of each latency fault (s)")
    parser.add_argument("--gap", type=float, default=40.0, help="normal traffic after each latency fault (s)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the traffic and of the fault moments")
    parser.add_argument("--settle-timeout", type=float, default=300.0, help="after the traffic, at most (s)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the fault-free run and every faulted run at once (shorter, but they share CPUs)")
    parser.add_argument("--workdir", type=Path, help="keep the runs' logs here (default: a temp dir, kept)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    kinds = args.only or list(KINDS)
    if os.geteuid() != 0 and "disk-full" in kinds:
        print("not root: disk-full falls back to RLIMIT_FSIZE on the collector")

    needs = {"sigkill": args.kills * 15, "detection-kill": args.kills * 15, "pg-restart": args.pg_restarts * 15,
             "outage": args.outages * (args.outage_seconds + 20),
             "disk-full": args.disk_full * (args.disk_hold_seconds + 30)}
    faults = tuple(f for f in args.dataset_faults.split(",") if f)
    base = args.warmup + len(faults) * (args.fault_seconds + args.gap)
    tail = max(0.0, max(needs[k] for k in kinds) + 50 - base)
    make_dataset = functools.partial(build_dataset, faults, warmup_s=args.warmup, fault_s=args.fault_seconds,
                                     gap_s=args.gap, tail_s=tail, seed=args.seed)
    dataset = make_dataset(epoch_ns=EPOCH_NS)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="spikehound-fault-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o755)
    print(f"dataset: {dataset.seconds} s of event time, {dataset.spans:,} spans from {len(dataset.hosts)} hosts "
          f"({', '.join(dataset.hosts)}), latency faults {[(f, a, b) for f, a, b in dataset.faults]}; runs in "
          f"{workdir}", flush=True)
    started = time.monotonic()
    runs = [Run(kind, lambda epoch: make_dataset(epoch_ns=epoch), workdir / kind, args)
            for kind in ("fault-free", *kinds)]
    for run in runs:
        run.workdir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            print(line, flush=True)

    for run in runs:
        run.log = log
    if args.parallel:
        threads = [threading.Thread(target=run.execute, name=run.kind) for run in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [run.result for run in runs]
    else:
        results = [run.execute() for run in runs]
    baseline = results[0]
    print(f"\nfault-free run: {len(baseline.spikes)} spike(s), {len(baseline.notifications)} distinct notification "
          f"alert(s)")
    for spike_id, s in sorted(baseline.spikes.items(), key=lambda kv: kv[1][2]):
        print(f"  {spike_id} {s[0]} {s[1]} from {s[2]} {s[3]}, top cause {s[4]}")
    for r in results:
        compare(r, baseline)
    for r in results:
        for label, items in (("spike difference", r.spike_differences), ("alert difference", r.alert_differences),
                             ("note", r.notes), ("log", r.log_excerpts)):
            for item in items:
                print(f"  [{r.kind}] {label}: {item}")
    print()
    print(table(results))
    print(f"\ntotal wall time {time.monotonic() - started:.0f} s; logs in {workdir}")
    if args.json:
        args.json.write_text(json.dumps({"dataset": {"seconds": dataset.seconds, "spans": dataset.spans,
                                                     "faults": dataset.faults},
                                         "wall_s": time.monotonic() - started,
                                         "results": [{**asdict(r), "recovery_median_s": r.recovery()[0],
                                                      "recovery_max_s": r.recovery()[1]} for r in results]},
                                        indent=2, default=str))
    return 1 if any(n.startswith("run failed") for r in results for n in r.notes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
