"""Detection-to-alert latency: from the event-time onset of a spike to its webhook arriving.

Run from the repository root: ``python -m benchmarks.alert_latency`` (``make bench``).

What is measured
----------------
A real ``spikehound collector`` child process (SQLite in a temporary
directory) with one webhook receiver: an aiohttp server in this process that
notes the wall-clock time each POST arrives. Traffic is the scenario suite's
``slow_db`` fault (harness/scenarios/traffic.py; gateway -> preprocess -> model
server, 20 requests/s, a slow feature query from the onset on), sent as
OTLP/HTTP protobuf, one request per second of traffic.

**How event time maps to wall clock.** The scenario's timestamps are shifted
so that its event time *is* wall-clock time for the part that matters: every
second of traffic (its spans and metric samples) is sent once that second has
passed on the wall clock, as an SDK's batch exporter would send it. The
warm-up (3 minutes of normal traffic the detectors learn from) lies in the
past and is sent as fast as the collector takes it; the sender catches up with
the wall clock 20 s before the onset and sends in real time from there on. So
the onset, an event time, is also the wall-clock moment the fault began, and

    latency = (wall time the firing webhook arrived) - (event-time onset)

is what an SRE would see: how long after the fault began the page arrived. The
sender's lag behind the wall clock around the onset is printed; it should be
near zero.

Two figures beside it, from the same run:

* **event-time floor**: the window holding the onset (10 s windows aligned to
  the epoch) can only close once data 5 s (``collector.allowed_lateness_seconds``)
  past its end has arrived; ``window end + lateness - onset`` is the least
  any alert can take, whatever the alert path does;
* **detection**: when the detectors' spike was committed, read from the
  collector's own log line ``spike ... opened on gateway`` (written on the
  event loop right after the commit, just before the spike is handed to
  alerting; millisecond timestamps, same machine clock); and the **alert
  path** from there to the webhook arriving: routing (its state and the outbox
  in one transaction on the writer thread), the delivery task, the POST. A
  bare loopback POST to the same receiver is the floor of that hop.

The onset is put at four places within its window (0.5, 2.5, 5.5 and 8.5 s
in), since where it falls changes the floor by up to one window: an onset
just after a window starts has a floor of nearly 15 s on its own. Target (design
brief): an alert within one window plus 5 s (15 s) of the onset.

This is a measurement, not a test: it exits 0 whatever the figure, and
non-zero only when no alert arrived at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from harness.ports import free_port
from harness.scenarios.traffic import Batch, Scenario
from harness.webhook_receiver import WebhookReceiver
from spikehound.otlp import encode_points, encode_spans

NS = 1_000_000_000
WINDOW_S = 10
LATENESS_S = 5
LEAD_S = 20  # the sender is in real time from this long before the onset
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def start_collector(workdir: Path, hook_url: str) -> tuple[subprocess.Popen[bytes], int, int]:
    config = workdir / "spikehound.toml"
    config.write_text(f"""
[[alerts.receivers]]
name = "bench"
url = "{hook_url}"

[[alerts.routes]]
receiver = "bench"
services = ["gateway"]
""")
    api, grpc_port, http_port = free_port(), free_port(), free_port()
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent)) or "spikehound"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    log = (workdir / "collector.log").open("wb")
    proc = subprocess.Popen([exe, "collector", "--config", str(config), "--db", f"sqlite:///{workdir / 'db.sqlite'}",
                             "--api", f"127.0.0.1:{api}", "--otlp-grpc", f"127.0.0.1:{grpc_port}",
                             "--otlp-http", f"127.0.0.1:{http_port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"collector exited with {proc.returncode}; see {workdir / 'collector.log'}")
        try:
            if requests.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200:
                return proc, api, http_port
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("collector not ready within 60 s")


def shift(batch: Batch, delta_ns: int) -> Batch:
    """The batch ``delta_ns`` later in event time (spans are mutable; samples are frozen and replaced)."""
    for span in batch.spans:
        span.start_unix_nano += delta_ns
        span.end_unix_nano += delta_ns
    points = [dataclasses.replace(p, time_unix_nano=p.time_unix_nano + delta_ns,
                                  start_unix_nano=p.start_unix_nano + delta_ns if p.start_unix_nano else 0)
              for p in batch.points]
    return Batch(batch.time_ns + delta_ns, batch.spans, points)


@dataclasses.dataclass
class Trial:
    offset_s: float  # onset, seconds into its window
    latency_s: float | None
    floor_s: float
    detected_s: float | None  # onset -> the spike visible in the API
    path_s: float | None  # the spike visible -> the webhook received
    lag_s: float  # how far behind the wall clock the sender was around the onset


def run_trial(offset_s: float, timeout_s: float) -> Trial:
    base_start = 1_767_225_600 * NS  # aligned to the window grid
    onset_s = 210.0 + offset_s
    sc = Scenario("slow_db", "large", seed=3, minutes=5, onset_s=onset_s, fault_s=60.0, start_ns=base_start)
    batches = list(sc.batches())
    # Place the scenario so that the real-time part starts a little after the warm-up could have been sent.
    warmup_estimate_s = 25.0
    start_s = time.time() + warmup_estimate_s - (onset_s - LEAD_S)
    start_s = (int(start_s) // WINDOW_S + 1) * WINDOW_S  # keep the window grid: the offset stays as asked
    delta = start_s * NS - base_start
    onset_wall = start_s + onset_s
    window_end = (int(onset_wall) // WINDOW_S + 1) * WINDOW_S
    closes_at = window_end + LATENESS_S  # the watermark passes the window's end once data this late arrived

    with tempfile.TemporaryDirectory(prefix="spikehound-alert-bench-") as tmp, WebhookReceiver() as hook:
        proc, _, http_port = start_collector(Path(tmp), hook.url)
        lags: list[float] = []
        try:
            with requests.Session() as session:
                for batch in batches:
                    b = shift(batch, delta)
                    due = b.time_ns / NS + 1.0  # a second's traffic is sent once that second has passed
                    wait = due - time.time()
                    if wait > 0:
                        time.sleep(wait)
                    elif abs(due - onset_wall) < 15:
                        lags.append(-wait)
                    bodies = [("traces", encode_spans(b.spans).SerializeToString())] if b.spans else []
                    bodies += [("metrics", encode_points(b.points).SerializeToString())] if b.points else []
                    for signal, body in bodies:
                        r = session.post(f"http://127.0.0.1:{http_port}/v1/{signal}", data=body, headers=PROTOBUF,
                                         timeout=60)
                        r.raise_for_status()
                    if any(b'"status":"firing"' in body for _, body in hook.arrivals):
                        break
                    if time.time() > onset_wall + timeout_s:
                        break
            deadline = time.time() + 10
            while not hook.arrivals and time.time() < deadline:
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(30)
        firing = [t for t, body in hook.arrivals if b'"status":"firing"' in body]
        seen = _spike_logged((Path(tmp) / "collector.log").read_text())
    received = firing[0] if firing else None
    return Trial(offset_s=offset_s, latency_s=None if received is None else received - onset_wall,
                 floor_s=closes_at - onset_wall, detected_s=None if seen is None else seen - onset_wall,
                 path_s=None if received is None or seen is None else received - seen,
                 lag_s=max(lags, default=0.0))


def _spike_logged(log: str) -> float | None:
    """Wall time of the collector's "spike ... opened on gateway" line (logging's local-time asctime, in ms)."""
    for line in log.splitlines():
        if " opened on gateway " in line:
            stamp, millis = line[:23].split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    return None


def bare_post_seconds(n: int = 50) -> float:
    """Median round trip of a small POST to a loopback aiohttp receiver: the floor of the webhook hop."""
    with WebhookReceiver() as hook, requests.Session() as session:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            session.post(hook.url, data=b'{"status":"firing"}', timeout=5)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offsets", default="0.5,2.5,5.5,8.5",
                        help="where the onset falls in its 10 s window, seconds (default 0.5,2.5,5.5,8.5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up this long after the onset")
    args = parser.parse_args(argv)
    trials = []
    for offset in (float(x) for x in args.offsets.split(",")):
        trial = run_trial(offset, args.timeout)
        trials.append(trial)
        shown = "no alert" if trial.latency_s is None else f"{trial.latency_s:5.2f} s"
        detected = float("nan") if trial.detected_s is None else trial.detected_s
        path = float("nan") if trial.path_s is None else trial.path_s * 1000
        print(f"  onset {offset:3.1f} s into its window: alert {shown} after the onset; event-time floor "
              f"{trial.floor_s:4.1f} s, spike committed after {detected:5.2f} s, then {path:6.1f} ms to the "
              f"webhook (sender lag {trial.lag_s:.2f} s)", flush=True)
    post = bare_post_seconds()
    found = [t.latency_s for t in trials if t.latency_s is not None]
    target = WINDOW_S + 5
    print(f"\ndetection-to-alert latency (onset in event time -> webhook received), {len(found)} of {len(trials)} "
          f"alerts: median {statistics.median(found) if found else float('nan'):.2f} s, max "
          f"{max(found, default=float('nan')):.2f} s; within the target of one window + 5 s ({target} s): "
          f"{sum(x <= target for x in found)} of {len(trials)}")
    paths = [t.path_s * 1000 for t in trials if t.path_s is not None]
    floors = [t.latency_s - t.floor_s for t in trials if t.latency_s is not None]
    print(f"beyond the event-time floor (window end + lateness - onset): median "
          f"{statistics.median(floors) if floors else float('nan'):.2f} s; alert path (spike committed -> webhook "
          f"received): median {statistics.median(paths) if paths else float('nan'):.1f} ms; reference: a bare "
          f"loopback POST to the same receiver takes {post * 1000:.2f} ms")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
