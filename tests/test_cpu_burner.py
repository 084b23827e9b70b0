"""harness/cpu_burner.py: the CPU-bound child that profiler tests and benchmarks/profiling_overhead.py watch."""

from __future__ import annotations

import time

from harness.cpu_burner import CpuBurner, burn_cpu, nest, renamed


def test_the_hot_function_can_be_renamed_and_computes_the_same():
    other = renamed(burn_cpu, "burn_cpu_elsewhere")
    assert other.__code__.co_name == other.__code__.co_qualname == other.__name__ == "burn_cpu_elsewhere"
    assert other(1000) == burn_cpu(1000) == nest(5, burn_cpu, 1000)


def test_the_burner_reports_its_progress_and_its_own_cpu_time():
    with CpuBurner("burn_cpu_for_test", depth=10, report_every=0.05) as burner:
        t0 = time.monotonic()
        t1 = t0 + 1.0
        assert burner.wait_past(t1 + 0.05)  # lines on both sides of t1, however late the child gets a CPU
        rate = burner.throughput(t0, t1)
        assert burner.proc is not None and burner.proc.poll() is None
    assert burner.proc.returncode is not None  # stopped on leaving the block
    assert rate.per_cpu_second > 10_000 and rate.per_wall_second > 10_000
    assert 0.05 < rate.cpu_share <= 1.05  # one thread: at most one core
