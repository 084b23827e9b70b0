"""The profile diff at spike time on hostile stored profiles: a collector's memory and time per request.

Run from the repository root: ``python -m benchmarks.profile_diff``; ``--code DIR`` runs the collector from
another checkout (a git worktree of an older commit), for a before/after comparison.

What is measured
----------------
A real ``spikehound collector`` child process (harness/daemons.py ``CollectorProcess``, SQLite in a temporary
directory, run under an address-space cap like a container's memory limit: ``--as-gb``, 4 by default) holds one
resolved spike of service ``svc`` and ``--stacks`` stored stacks of ``--depth`` frames each (short names from
a vocabulary of ``--functions``), ``--per-window`` distinct stacks a 10 s window, as a sender holding the OTLP
token can store them (about 1,450 distinct stacks a request stays within the collector's decode budget): half
of the windows in the spike, half in its baseline, so one diff would read every one of them.

While a thread samples the collector's resident memory (``VmRSS`` of ``/proc/PID/status``, every 20 ms):

1. the reference: the idle RSS after seeding, and the time of ``GET /api/v1/spikes/{id}`` (a plain read);
2. one ``GET /api/v1/spikes/{id}/profile``: time, status, peak RSS over idle;
3. ``--concurrent`` of them at once: the statuses at once (a diff beyond the collector's cap is answered 429
   with Retry-After), the time until the last first answer, then the time until every one of them got its
   200 (each retrying after Retry-After), and the peak RSS over idle.

This is a measurement, not a test: it prints the figures beside the bar (under 300 MB over idle, no 5xx)
and exits 0 whatever they are; non-zero only when the benchmark itself failed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests

from harness.daemons import CollectorProcess
from spikehound.model import ProfileStack, Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.writer import WriteBatch, Writer

S = 1_000_000_000
MB = 1_000_000
RSS_BAR_BYTES = 300 * MB
WINDOW_NS = 10 * S
SPIKE_SECONDS = 150  # 15 windows; its baseline is the 5-minute floor, ending 10 s before it


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User and system CPU the process used so far: beside wall time on a machine shared with other work."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watcher:
    """Samples a process's RSS every 20 ms on a thread; ``peak`` since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except OSError:
                return
            self._stop.wait(0.02)

    def reset(self) -> None:
        try:
            self.peak = rss_bytes(self.pid)
        except OSError:  # the process is gone
            self.peak = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def seed(db_url: str, stacks: int, per_window: int, depth: int, functions: int, start_ns: int) -> float:
    """Store the spike and the stacks; the seconds it took."""
    t = time.perf_counter()
    engine = make_engine(db_url)
    writer = Writer(engine)
    writer.write(WriteBatch(spikes=[Spike(
        id="sp-deep", service="svc", operation="GET /", state="resolved", start_unix_nano=start_ns,
        end_unix_nano=start_ns + SPIKE_SECONDS * S, p99_ns=400_000_000, baseline_p99_ns=50_000_000)]))
    rng = random.Random(11)
    names = [(f"f{i}", "a.py") for i in range(functions)]
    windows = stacks // per_window
    baseline_end = start_ns - 10 * S
    for w in range(windows):
        # Alternately in the spike and in the last windows of its baseline.
        t0 = start_ns + (w // 2) * WINDOW_NS if w % 2 else baseline_end - (w // 2 + 1) * WINDOW_NS
        batch = []
        for _ in range(per_window):
            frames = tuple((*rng.choice(names), rng.randrange(1, 400)) for _ in range(depth))
            batch.append(ProfileStack(host="h1", service="svc", pid=4242, process="python3", start_unix_nano=t0,
                                      end_unix_nano=t0 + WINDOW_NS, frames=frames, samples=rng.randrange(1, 6)))
        writer.write_profiles(batch)
    engine.dispose()
    return time.perf_counter() - t


def timed(fn: Callable[[], requests.Response]) -> tuple[float, int, str]:
    """The time, the status (0: no answer) and Retry-After (or why there was no answer)."""
    t = time.perf_counter()
    try:
        r = fn()
    except requests.RequestException as exc:
        return time.perf_counter() - t, 0, f"{exc.__class__.__name__}"
    return time.perf_counter() - t, r.status_code, r.headers.get("Retry-After", "")


def shown(status: int, note: str) -> str:
    if status == 0:
        return f"no answer ({note})"
    return f"{status}" + (f" (Retry-After {note})" if note else "")


def until_answered(url: str) -> tuple[float, list[int]]:
    """Ask until a 200 (or a refusal that is no 429), retrying after Retry-After: the time, and every status."""
    t, statuses = time.perf_counter(), []
    while True:
        try:
            r = requests.get(url, timeout=600)
        except requests.RequestException:
            statuses.append(0)
            break
        statuses.append(r.status_code)
        if r.status_code != 429:
            break
        time.sleep(float(r.headers.get("Retry-After", "1")))
    return time.perf_counter() - t, statuses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stacks", type=int, default=43_560)
    p.add_argument("--per-window", type=int, default=1_452)
    p.add_argument("--depth", type=int, default=256)
    p.add_argument("--functions", type=int, default=1_000)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--as-gb", type=float, default=4.0, help="the collector's address-space cap (0: none)")
    p.add_argument("--code", type=Path, help="run the collector from this checkout (PYTHONPATH)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="spikehound-profile-diff-") as tmp:
        db_url = f"sqlite:///{tmp}/spikehound.db"
        env = {"PYTHONPATH": str(args.code.resolve())} if args.code else {}
        collector = CollectorProcess(db_url, Path(tmp), env)
        if args.as_gb:
            collector.prefix = ["prlimit", f"--as={int(args.as_gb * 1024**3)}", "--"]
        collector.start()
        try:
            start_ns = (time.time_ns() // S - 3600) * S
            seeded = seed(db_url, args.stacks, args.per_window, args.depth, args.functions, start_ns)
            print(f"code: {args.code or 'this checkout'}; collector under a {args.as_gb:g} GB address-space cap"
                  if args.as_gb else f"code: {args.code or 'this checkout'}; no address-space cap")
            print(f"stored {args.stacks:,} stacks of {args.depth} frames ({args.per_window:,} distinct a window, "
                  f"{args.functions:,} function names) in {seeded:.1f} s; database "
                  f"{os.path.getsize(f'{tmp}/spikehound.db') / MB:.0f} MB")
            base = f"{collector.api}/api/v1/spikes/sp-deep"
            url = f"{base}/profile"
            watcher = Watcher(collector.proc.pid)  # type: ignore[union-attr]
            try:
                ref_time, ref_status, _ = timed(lambda: requests.get(base, timeout=60))
                time.sleep(1)
                idle = rss_bytes(collector.proc.pid)  # type: ignore[union-attr]
                print(f"reference: idle RSS {idle / MB:.0f} MB; GET /api/v1/spikes/{{id}} {ref_status} in "
                      f"{ref_time * 1000:.0f} ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

                watcher.reset()
                cpu = cpu_seconds(collector.proc.pid)  # type: ignore[union-attr]
                answer: list[requests.Response] = []
                took, status, note = timed(lambda: answer.append(requests.get(url, timeout=600)) or answer[-1])
                partial = answer[0].json().get("partial", "(no such field)") if status == 200 else "-"
                print(f"1 request: {shown(status, note)} in {took:.2f} s; peak RSS {watcher.peak / MB:.0f} MB, "
                      f"{(watcher.peak - idle) / MB:+.0f} MB over idle (bar {RSS_BAR_BYTES / MB:.0f} MB)")
                if collector.running:
                    print(f"  the collector's CPU: {cpu_seconds(collector.proc.pid) - cpu:.2f} s")  # type: ignore[union-attr]
                print(f"  partial: {partial}")
                if not collector.running:
                    print(f"the collector died: {collector.log_tail(8)}")
                    return 0

                time.sleep(1)
                watcher.reset()
                firsts: list[tuple[float, int, str]] = [(0.0, 0, "")] * args.concurrent
                whole: list[tuple[float, list[int]]] = [(0.0, [])] * args.concurrent

                def first(i: int) -> None:
                    firsts[i] = timed(lambda: requests.get(url, timeout=600))

                def retried(i: int) -> None:
                    whole[i] = until_answered(url)

                for fn, label in ((first, "at once"), (retried, "retrying after Retry-After")):
                    threads = [threading.Thread(target=fn, args=(i,)) for i in range(args.concurrent)]
                    cpu = cpu_seconds(collector.proc.pid)  # type: ignore[union-attr]
                    t = time.perf_counter()
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    wall = time.perf_counter() - t
                    if fn is first:
                        statuses = [shown(s, r) for _, s, r in firsts]
                        print(f"{args.concurrent} requests {label}: {', '.join(statuses)}; last answer after "
                              f"{wall:.2f} s")
                    else:
                        print(f"{args.concurrent} requests {label}: last answers "
                              f"{sorted(w[1][-1] for w in whole)} after {wall:.2f} s "
                              f"({sum(len(w[1]) for w in whole)} requests in all)")
                    used = cpu_seconds(collector.proc.pid) - cpu if collector.running else float("nan")  # type: ignore[union-attr]
                    print(f"  peak RSS {watcher.peak / MB:.0f} MB, {(watcher.peak - idle) / MB:+.0f} MB over idle; "
                          f"the collector's CPU {used:.2f} s")
                    if not collector.running:
                        break
                    time.sleep(1)
                    watcher.reset()
                fives = [s for _, s, _ in firsts if s >= 500 or s == 0] + [
                    s for w in whole for s in w[1] if s >= 500 or s == 0]
                alive = collector.running
                after = f"{rss_bytes(collector.proc.pid) / MB:.0f} MB" if alive else "-"  # type: ignore[union-attr]
                print(f"5xx or no answer: {len(fives)}; RSS after: {after}; collector running: {alive}")
                if not alive:
                    print(f"the collector died: {collector.log_tail(8)}")
            finally:
                watcher.stop()
        finally:
            collector.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
