"""Agent overhead: CPU (% of one core) and resident memory at a 1 s interval while forwarding 1,000 spans/s.

Run with ``python -m benchmarks.agent_overhead`` (``make bench`` does). A collector
(SQLite, temporary directory) and the agent run as separate processes; a load
process sends pre-encoded OTLP/gRPC requests to the agent's local receiver the
way an OpenTelemetry SDK's BatchSpanProcessor does with its defaults (batches of
up to 512 spans), at 1,000 spans/s in all. The agent's CPU time is read from /proc before and
after the measured period.

Reference, same run: Debian's ``prometheus-node-exporter`` scraped once a second,
the usual always-on host agent an SRE already runs. It is installed with apt when
missing (and skipped, with a note, when that is not possible).
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
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


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


def load(endpoint: str, spans_per_second: int, seconds: float, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """Send pre-encoded 512-span requests at the given rate (runs in its own process)."""
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
    while time.monotonic() - start < seconds:
        export(bodies[i % len(bodies)], timeout=10)
        i += 1
        time.sleep(max(0.0, start + i * period - time.monotonic()))
    channel.close()


def measure(pid: int, seconds: float, scrape: str | None = None) -> tuple[float, float]:
    """(% of one core, peak RSS MB) of ``pid`` over ``seconds``, scraping ``scrape`` once a second if given."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    peak = rss_mb(pid)
    while time.monotonic() - t0 < seconds:
        if scrape:
            with urllib.request.urlopen(scrape, timeout=5) as r:
                r.read()
        peak = max(peak, rss_mb(pid))
        time.sleep(1.0)
    return 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0), peak


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured period (default 60)")
    parser.add_argument("--rate", type=int, default=1000, help="spans per second sent through the agent")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="spikehound-agent-bench-"))
    api, c_grpc, c_http = free_port(), free_port(), free_port()
    a_grpc, a_http, a_metrics = free_port(), free_port(), free_port()
    exe = [sys.executable, "-m", "spikehound.cli"]
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, float | str | None] = {}
    try:
        log = open(work / "collector.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([*exe, "collector", "--db", f"sqlite:///{work / 'db.sqlite'}", "--api",
                                       f"127.0.0.1:{api}", "--otlp-grpc", f"127.0.0.1:{c_grpc}", "--otlp-http",
                                       f"127.0.0.1:{c_http}"], stdout=log, stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{api}/readyz")
        env = {**os.environ, "SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{a_metrics}",
               "SPIKEHOUND_DATA_DIR": str(work), "SPIKEHOUND_LOG_LEVEL": "warning"}
        agent_log = open(work / "agent.log", "wb")  # noqa: SIM115
        agent = subprocess.Popen([*exe, "agent", "--collector", f"127.0.0.1:{c_grpc}", "--otlp-grpc",
                                  f"127.0.0.1:{a_grpc}", "--otlp-http", f"127.0.0.1:{a_http}", "--interval", "1"],
                                 stdout=agent_log, stderr=subprocess.STDOUT, env=env)
        procs.append(agent)
        wait_http(f"http://127.0.0.1:{a_metrics}/healthz")
        ready = mp.Event()
        sender = mp.Process(target=load, args=(f"127.0.0.1:{a_grpc}", args.rate, args.seconds + 10, ready))
        sender.start()
        ready.wait(60)
        time.sleep(5)  # warm-up: first sampler deltas, caches, JIT-free but import-heavy start
        cpu, rss = measure(agent.pid, args.seconds)
        sender.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{a_metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        forwarded = next((float(line.split()[-1]) for line in text.splitlines()
                          if line.startswith('spikehound_agent_forwarded_total{signal="spans"}')), 0.0)
        results.update(agent_cpu_percent=round(cpu, 3), agent_rss_mb=round(rss, 1), spans_forwarded=forwarded)
        print(f"agent  (1 s interval, {args.rate} spans/s forwarded): {cpu:5.2f} % of one core, "
              f"RSS {rss:5.1f} MB   [{forwarded:.0f} spans forwarded]")

        exporter = node_exporter()
        if exporter:
            port = free_port()
            ne = subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
            procs.append(ne)
            wait_http(f"http://127.0.0.1:{port}/metrics")
            ne_cpu, ne_rss = measure(ne.pid, args.seconds, scrape=f"http://127.0.0.1:{port}/metrics")
            results.update(node_exporter_cpu_percent=round(ne_cpu, 3), node_exporter_rss_mb=round(ne_rss, 1))
            print(f"reference: prometheus-node-exporter scraped every 1 s: {ne_cpu:5.2f} % of one core, "
                  f"RSS {ne_rss:5.1f} MB")
        else:
            print("reference: prometheus-node-exporter not available (apt-get install prometheus-node-exporter)")
        ok = cpu < 1.0 and rss < 80
        print(f"target < 1 % of one core and < 80 MB RSS: {'PASS' if ok else 'FAIL'}")
        results["target_met"] = "yes" if ok else "no"
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
            if p.poll() is None:
                p.kill()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
