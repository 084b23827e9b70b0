"""Benchmarks: measurements of spikehound against the figures it must hold (throughput, overhead, detection
quality, latency, robustness), each printed beside a reference measured in the same run; not tests."""
