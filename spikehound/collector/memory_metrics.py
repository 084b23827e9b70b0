"""Where the collector's own process holds its memory, read when scraped: the figures that place a slow rise.

A process's RSS is Python's objects, the free room in Python's small-object arenas, what C code has from
glibc's ``malloc`` (in use and held free), SQLite's page caches, and the libraries' own. A rise over hours in
one of those is a different story (a cache still filling to its bound, freed memory not given back, objects
kept too long), and the soak (``python -m benchmarks.soak``) samples these beside the RSS to tell which.

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> registry = CollectorRegistry()
>>> registry.register(ProcessMemoryMetrics())
>>> b"spikehound_process_python_blocks" in generate_latest(registry)
True
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spikehound.heap import heap_used_and_free_bytes, python_arenas, sqlite_heap_bytes


class ProcessMemoryMetrics(Collector):
    """``spikehound_process_heap_bytes{allocator}``, ``spikehound_process_python_arena_bytes{state}`` and
    ``spikehound_process_python_blocks`` of this process."""

    def collect(self) -> Iterator[Metric]:
        heap = GaugeMetricFamily(
            "spikehound_process_heap_bytes",
            "Bytes of this process's heaps by allocator: malloc_used (glibc's malloc, in use: buffers, "
            "payloads, SQLite's caches, native libraries), malloc_free (free in glibc's heaps: after a "
            "checkpoint its whole pages are given back to the system but still counted here), sqlite "
            "(SQLite's page caches and statements, bounded by its soft heap limit; a part of malloc_used). "
            "0 where unknown.",
            labels=["allocator"])
        used, free = heap_used_and_free_bytes()  # one walk of malloc's arenas for both
        heap.add_metric(["malloc_used"], used)
        heap.add_metric(["malloc_free"], free)
        heap.add_metric(["sqlite"], sqlite_heap_bytes())
        yield heap
        arenas = GaugeMetricFamily(
            "spikehound_process_python_arena_bytes",
            "Bytes of Python's small-object arenas by state: mapped (what the RSS holds of them), in_use (in "
            "their allocated blocks), peak_mapped (the most mapped at once since start). Mapped far above in use "
            "is a burst's peak that a few live objects keep from being given back. 0 where unknown.",
            labels=["state"])
        now = python_arenas()
        arenas.add_metric(["mapped"], now.mapped)
        arenas.add_metric(["in_use"], now.in_use)
        arenas.add_metric(["peak_mapped"], now.peak_mapped)
        yield arenas
        yield GaugeMetricFamily("spikehound_process_python_blocks",
                                "Memory blocks Python has allocated and not freed (its objects): flat while "
                                "the RSS rises is memory freed but not given back, not objects kept.",
                                value=sys.getallocatedblocks())
