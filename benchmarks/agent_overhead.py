"""Agent overhead: CPU (% of one core) and resident memory at a 1 s interval while forwarding 1,000 spans/s.

Run with ``python -m benchmarks.agent_overhead`` (``make bench`` does). A collector
(SQLite, temporary directory) and the agent run as separate processes; a load
process sends pre-encoded OTLP/gRPC requests to the agent's local receiver the
way an OpenTelemetry SDK's BatchSpanProcessor does with its defaults (batches of
512 spans), at 1,000 spans/s in all. CPU is process CPU time read from /proc
(utime + stime) before and after each measured round, so other load on the
machine does not count against the agent; it is split by thread into the event
loop (the main thread), gRPC's C-core threads and the other Python threads
(samplers, gRPC's completion-queue poller).

Reference, measured over the same rounds as the agent: Debian's
``prometheus-node-exporter`` scraped once a second, the usual always-on host
agent an SRE already runs. It is installed with apt when missing (and skipped,
with a note, when that is not possible). ``--breakdown`` adds three more agent
runs, each beside the reference again: samplers only (no spans), forwarding only
(samplers off) and neither (an idle agent).
Target: under 1 % of one core and under 80 MB resident for the agent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.ports import free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GRPC_CORE_THREADS = ("event_engine", "grpc_global_tim", "lifeguard")  # gRPC's own thread names


def _ticks(stat: str) -> int:
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def cpu_seconds(pid: int) -> float:
    return _ticks(Path(f"/proc/{pid}/stat").read_text()) / CLOCK_TICKS


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of the live threads by group: the event loop (main thread), gRPC core, other Python threads."""
    groups = {"event loop": 0.0, "gRPC core threads": 0.0, "other threads": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            group = ("event loop" if task.name == str(pid) else
                     "gRPC core threads" if name.startswith(GRPC_CORE_THREADS) else "other threads")
            groups[group] += _ticks(stat) / CLOCK_TICKS
    return groups


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def load(endpoint: str, spans_per_second: int, stop: mp.Event, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """Send pre-encoded 512-span requests at the given rate until ``stop`` (runs in its own process)."""
    import grpc

    from spikehound.model import Span, SpanKind, StatusCode
    from spikehound.otlp import encode_spans

    batch = 512  # the SDK's BatchSpanProcessor default max_export_batch_size
    now = time.time_ns()
    bodies = []
    for b in range(20):
        spans = [Span(trace_id=os.urandom(16), span_id=os.urandom(8), parent_span_id=None, service="model-server",
                      host=None, name="POST /infer", kind=SpanKind.SERVER, start_unix_nano=now - 5_000_000 + b,
                      end_unix_nano=now + b, status=StatusCode.OK,
                      attributes={"model.name": "resnet50", "batch.size": 8, "http.request.method": "POST"})
                 for _ in range(batch)]
        bodies.append(encode_spans(spans).SerializeToString())
    channel = grpc.insecure_channel(endpoint)
    export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                 request_serializer=None, response_deserializer=None)
    ready.set()
    period = batch / spans_per_second
    start = time.monotonic()
    i = 0
    while not stop.is_set():
        export(bodies[i % len(bodies)], timeout=10)
        i += 1
        time.sleep(max(0.0, start + i * period - time.monotonic()))
    channel.close()


@dataclass
class Figures:
    cpu_percent: float
    rss_mb: float
    threads: dict[str, float] | None = None  # % of one core by thread group


class Scraper(threading.Thread):
    """Scrapes ``url`` once a second, as Prometheus would, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url, timeout=5) as r:
                r.read()


def measure(pids: dict[str, int], seconds: float) -> dict[str, Figures]:
    """CPU (% of one core) and peak RSS (MB) of each process over the same ``seconds``."""
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads0 = {name: thread_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    peak = {name: rss_mb(pid) for name, pid in pids.items()}
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        for name, pid in pids.items():
            peak[name] = max(peak[name], rss_mb(pid))
    elapsed = time.monotonic() - t0
    out = {}
    for name, pid in pids.items():
        threads1 = thread_seconds(pid)
        out[name] = Figures(100 * (cpu_seconds(pid) - cpu0[name]) / elapsed, peak[name],
                            {g: 100 * (threads1[g] - threads0[name][g]) / elapsed for g in threads1})
    return out


def node_exporter() -> str | None:
    path = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if path or os.geteuid() != 0:
        return path
    subprocess.run(["apt-get", "install", "-y", "-q", "prometheus-node-exporter"], capture_output=True, check=False)
    if not (shutil.which("prometheus-node-exporter")):
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False)
        subprocess.run(["apt-get", "install", "-y", "-q", "prometheus-node-exporter"], capture_output=True,
                       check=False)
    return shutil.which("prometheus-node-exporter")


def serve_agent_without_samplers() -> int:
    """Run an agent configured from the environment, with no samplers: the breakdown's forwarding-only agent."""
    from spikehound.agent.runtime import prefer_poll_transport, run

    prefer_poll_transport()  # as `spikehound agent` does
    from spikehound.agent.daemon import Agent
    from spikehound.config import load as load_config
    from spikehound.lifecycle import serve

    return run(serve(Agent(load_config(), samplers=[])))


class Bench:
    """A collector, the reference node-exporter and, one after another, the agents to measure."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exe = [sys.executable, "-m", "spikehound.cli"]
        self.collector_grpc = free_port()
        self.node_exporter: subprocess.Popen[bytes] | None = None
        self.scraper: Scraper | None = None

    def start(self) -> None:
        api, http = free_port(), free_port()
        log = open(self.work / "collector.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen([*self.exe, "collector", "--db", f"sqlite:///{self.work / 'db.sqlite'}",
                                            "--api", f"127.0.0.1:{api}", "--otlp-grpc",
                                            f"127.0.0.1:{self.collector_grpc}", "--otlp-http", f"127.0.0.1:{http}"],
                                           stdout=log, stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{api}/readyz")
        exporter = node_exporter()
        if exporter:
            port = free_port()
            self.node_exporter = subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{port}"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(self.node_exporter)
            wait_http(f"http://127.0.0.1:{port}/metrics")
            self.scraper = Scraper(f"http://127.0.0.1:{port}/metrics")
            self.scraper.start()

    def run_agent(self, name: str, *, samplers: bool, rate: int, seconds: float,
                  rounds: int) -> tuple[list[dict[str, Figures]], dict[str, float]]:
        """Start an agent, send ``rate`` spans/s through it, measure ``rounds`` rounds; stop it."""
        grpc_port, metrics_port = free_port(), free_port()
        env = {**os.environ, "SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
               "SPIKEHOUND_AGENT_COLLECTOR": f"127.0.0.1:{self.collector_grpc}",
               "SPIKEHOUND_AGENT_OTLP_GRPC": f"127.0.0.1:{grpc_port}",
               "SPIKEHOUND_AGENT_OTLP_HTTP": f"127.0.0.1:{free_port()}", "SPIKEHOUND_AGENT_INTERVAL": "1",
               "SPIKEHOUND_DATA_DIR": str(self.work / name), "SPIKEHOUND_LOG_LEVEL": "warning"}
        command = ([*self.exe, "agent"] if samplers else
                   [sys.executable, "-c", "import sys; from benchmarks.agent_overhead import "
                    "serve_agent_without_samplers as s; sys.exit(s())"])
        log = open(self.work / f"agent-{name}.log", "wb")  # noqa: SIM115 - closed with the process
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(agent)
        stop, ready = mp.Event(), mp.Event()
        sender = None
        try:
            wait_http(f"http://127.0.0.1:{metrics_port}/healthz")
            if rate:
                sender = mp.Process(target=load, args=(f"127.0.0.1:{grpc_port}", rate, stop, ready))
                sender.start()
                ready.wait(60)
            time.sleep(5)  # warm-up: first sampler deltas, caches, connections
            pids = {"agent": agent.pid}
            if self.node_exporter is not None:
                pids["node-exporter"] = self.node_exporter.pid
            figures = [measure(pids, seconds) for _ in range(rounds)]
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
                counters = _agent_counters(r.read().decode())
        finally:
            stop.set()
            if sender is not None:
                sender.join(30)
            agent.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(30)
        return figures, counters

    def close(self) -> None:
        if self.scraper is not None:
            self.scraper.stopped.set()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
            if p.poll() is None:
                p.kill()


def _agent_counters(text: str) -> dict[str, float]:
    wanted = {'spikehound_agent_forwarded_total{signal="spans"}': "spans_forwarded",
              'spikehound_agent_forward_requests_total{signal="spans"}': "span_requests_forwarded",
              'spikehound_agent_forward_requests_total{signal="metrics"}': "metric_requests_forwarded",
              'spikehound_agent_forwarded_total{signal="metrics"}': "metric_points_forwarded"}
    out = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key in wanted:
            out[wanted[key]] = float(value)
    return out


def _row(label: str, figures: list[dict[str, Figures]]) -> dict[str, Any]:
    """Print one configuration's rounds and return its summary."""
    agent = [f["agent"].cpu_percent for f in figures]
    reference = [f["node-exporter"].cpu_percent for f in figures if "node-exporter" in f]
    rss = max(f["agent"].rss_mb for f in figures)
    line = f"{label:<38} agent {statistics.median(agent):5.2f} % ({min(agent):.2f}-{max(agent):.2f}), RSS {rss:5.1f} MB"
    summary: dict[str, Any] = {"agent_cpu_percent": [round(v, 3) for v in agent], "agent_rss_mb": round(rss, 1)}
    if reference:
        ne_rss = max(f["node-exporter"].rss_mb for f in figures)
        line += (f"  | node-exporter {statistics.median(reference):5.2f} % ({min(reference):.2f}-"
                 f"{max(reference):.2f}), RSS {ne_rss:5.1f} MB")
        summary.update(node_exporter_cpu_percent=[round(v, 3) for v in reference], node_exporter_rss_mb=ne_rss)
    print(line)
    groups: dict[str, list[float]] = {}
    for f in figures:
        for group, value in (f["agent"].threads or {}).items():
            groups.setdefault(group, []).append(value)
    split = ", ".join(f"{group} {statistics.median(values):.2f} %" for group, values in groups.items())
    print(f"{'':<38}   by thread (median): {split}")
    summary["agent_threads_percent"] = {group: round(statistics.median(v), 3) for group, v in groups.items()}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of one measured round (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per configuration (default 3)")
    parser.add_argument("--rate", type=int, default=1000, help="spans per second sent through the agent")
    parser.add_argument("--breakdown", action="store_true",
                        help="also measure samplers only, forwarding only and an idle agent")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="spikehound-agent-bench-"))
    bench = Bench(work)
    results: dict[str, Any] = {}
    runs = [("full", f"agent, {args.rate} spans/s, samplers at 1 s", True, args.rate)]
    if args.breakdown:
        runs += [("samplers_only", "samplers only (no spans)", True, 0),
                 ("forwarding_only", f"forwarding only ({args.rate} spans/s)", False, args.rate),
                 ("idle", "neither (idle agent)", False, 0)]
    try:
        bench.start()
        if bench.node_exporter is None:
            print("reference: prometheus-node-exporter not available (apt-get install prometheus-node-exporter)")
        print(f"{args.rounds} rounds of {args.seconds:.0f} s each; median (min-max) of the rounds; the reference "
              "is measured over the same rounds")
        for key, label, samplers, rate in runs:
            figures, counters = bench.run_agent(key, samplers=samplers, rate=rate, seconds=args.seconds,
                                                rounds=args.rounds)
            results[key] = {**_row(label, figures), **counters}
        full = results["full"]
        print(f"forwarded {full.get('spans_forwarded', 0):.0f} spans in {full.get('span_requests_forwarded', 0):.0f} "
              f"requests and {full.get('metric_points_forwarded', 0):.0f} metric points in "
              f"{full.get('metric_requests_forwarded', 0):.0f} requests")
        ok = statistics.median(full["agent_cpu_percent"]) < 1.0 and full["agent_rss_mb"] < 80
        print(f"target < 1 % of one core and < 80 MB RSS: {'PASS' if ok else 'FAIL'}")
        results["target_met"] = "yes" if ok else "no"
    finally:
        bench.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
