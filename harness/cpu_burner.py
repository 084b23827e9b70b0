"""A CPU-bound Python process with a known hot function, for profiler tests and benchmarks.

As a program (``python -m harness.cpu_burner``) it runs ``burn_cpu`` in fixed steps, under
``--depth`` frames of ``nest`` (a server's stack is some tens of frames deep, and a sampling
profiler's cost grows with it), and prints one progress line every ``--report-every`` seconds::

    progress ITERATIONS CPU_SECONDS MONOTONIC_SECONDS

the iterations done so far, its own CPU time (``time.process_time``) and ``time.monotonic`` (the
same clock as the parent's, so the parent can cut windows out of the stream). ``--function-name``
renames the hot function, so a test can look for a name no other process has.

The parent side is :class:`CpuBurner`::

    with CpuBurner(function_name="burn_cpu_for_test") as burner:
        t0 = time.monotonic(); time.sleep(2); t1 = time.monotonic()
        rate = burner.throughput(t0, t1)  # iterations per CPU second and per wall second
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_FUNCTION = "burn_cpu"


def burn_cpu(iterations: int) -> int:
    """The hot loop: pure bytecode, no allocation that grows, no system call."""
    total = 0
    for i in range(iterations):
        total = (total + i * i) % 1_000_003
    return total


def nest(depth: int, work: Callable[[int], int], iterations: int) -> int:
    """Run ``work`` ``depth`` Python frames down."""
    return nest(depth - 1, work, iterations) if depth > 0 else work(iterations)


def renamed(function: types.FunctionType, name: str) -> types.FunctionType:
    """``function`` with another name in its code object: the name profilers read from the stack."""
    code = function.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


def run(function_name: str, step: int, depth: int, report_every: float, seconds: float, idle_threads: int = 0
        ) -> None:
    work = burn_cpu if function_name == DEFAULT_FUNCTION else renamed(burn_cpu, function_name)
    # A server's pool of threads waiting for work: a profiler that reads every thread pays for each.
    never = threading.Event()
    for _ in range(idle_threads):
        threading.Thread(target=nest, args=(depth, lambda _: never.wait(), 0), daemon=True).start()
    done = 0
    start = time.monotonic()
    next_report = start
    while True:
        nest(depth, work, step)
        done += step
        now = time.monotonic()
        if now >= next_report:
            print(f"progress {done} {time.process_time():.6f} {now:.6f}", flush=True)
            next_report = now + report_every
            if now - start >= seconds:
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--function-name", default=DEFAULT_FUNCTION, help="name of the hot function (burn_cpu)")
    parser.add_argument("--step", type=int, default=20_000, help="iterations between clock checks (20,000: ~1 ms)")
    parser.add_argument("--depth", type=int, default=0, help="Python frames above the hot function (0)")
    parser.add_argument("--report-every", type=float, default=0.1, help="seconds between progress lines (0.1)")
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (3600)")
    parser.add_argument("--idle-threads", type=int, default=0, help="threads waiting, as a server's pool does (0)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        run(args.function_name, args.step, args.depth, args.report_every, args.seconds, args.idle_threads)
    return 0


@dataclass(frozen=True, slots=True)
class Throughput:
    """Iterations per second of the burner's own CPU time, and per second of wall time."""

    per_cpu_second: float
    per_wall_second: float
    cpu_share: float  # the burner's CPU seconds per wall second (1.0: it had a core to itself)


class CpuBurner:
    """Runs ``python -m harness.cpu_burner`` and keeps its progress lines (a reader thread)."""

    def __init__(self, function_name: str = DEFAULT_FUNCTION, *, depth: int = 0, step: int = 20_000,
                 report_every: float = 0.1, idle_threads: int = 0) -> None:
        self.command = [sys.executable, "-m", "harness.cpu_burner", "--function-name", function_name,
                        "--depth", str(depth), "--step", str(step), "--report-every", str(report_every),
                        "--idle-threads", str(idle_threads)]
        self.function_name = function_name
        self.proc: subprocess.Popen[str] | None = None
        self._times: list[float] = []  # the child's monotonic time of each line
        self._rows: list[tuple[int, float]] = []  # (iterations, cpu seconds) of each line
        self._lines = threading.Condition()  # guards _times and _rows; notified at every line
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> CpuBurner:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name="cpu-burner-reader", daemon=True)
        self._reader.start()
        if not self.wait_past(0.0, timeout):
            self.close()
            raise RuntimeError(f"the CPU burner printed no progress within {timeout} s")
        return self

    def wait_past(self, t: float, timeout: float = 30.0) -> bool:
        """Wait until a progress line dated at or after monotonic time ``t`` has arrived (False on timeout):
        then ``throughput(..., t)`` is read off lines on both sides of ``t``, however loaded the machine."""
        with self._lines:
            return self._lines.wait_for(lambda: bool(self._times) and self._times[-1] >= t, timeout)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 4 and parts[0] == "progress":
                with self._lines:
                    self._times.append(float(parts[3]))
                    self._rows.append((int(parts[1]), float(parts[2])))
                    self._lines.notify_all()

    def _at(self, t: float) -> tuple[float, int, float]:
        """The last progress line at or before monotonic time ``t`` (the first one if none)."""
        with self._lines:
            i = max(0, bisect.bisect_right(self._times, t) - 1)
            return self._times[i], *self._rows[i]

    def throughput(self, t0: float, t1: float) -> Throughput:
        """The burner's rate between two monotonic times (call once ``wait_past(t1)`` returned)."""
        w0, n0, c0 = self._at(t0)
        w1, n1, c1 = self._at(t1)
        if w1 <= w0 or c1 <= c0:
            raise ValueError(f"no progress between {t0:.3f} and {t1:.3f}")
        return Throughput((n1 - n0) / (c1 - c0), (n1 - n0) / (w1 - w0), (c1 - c0) / (w1 - w0))

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._reader is not None:
            self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> CpuBurner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
