"""Bursts in Python's small-object arenas: the collector's two regular ones, each against what it replaced.

Run from the repository root: ``python -m benchmarks.arena_bursts`` (``make bench``).

What is measured
----------------
Python gives one of its 1 MiB arenas back only when none of its objects is alive. A burst of short-lived
objects maps new arenas; objects that outlive it (a cache entry, a new operation's name) land among them
and keep them: the RSS stays at the burst's peak. The soak (``benchmarks.soak``) saw the collector's RSS
rise in steps over hours with its live objects flat. Two bursts, each measured in a fresh process (the
peak of mapped arenas only grows), as the peak less the mapped arenas before:

* **scrape**: ``/metrics`` with ``--series`` span-metric series in each set (spanmetrics and
  ``model_inference_latency_seconds``), written by ``SpanMetrics.exposition`` (series by series, as text)
  against the reference: the same families as prometheus_client's sample objects, all alive at once, then
  ``generate_latest`` (what the collector did before);
* **queue**: ``--queued`` spans waiting in the ingest queue (requests of 1,000, decoded by the receivers'
  ``decode_spans``), held as blocks (``keep_spans`` off: the collector with its detection process) against
  the reference, the decoded spans kept (``keep_spans`` on: what every request held before).

Each line gives the arenas' peak rise in MB and the seconds the work took. This is a measurement, not a
test: it exits 0 whatever the figures are.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from spikehound.heap import python_arenas

MB = 2**20


def _span_metrics(series: int) -> Any:
    from spikehound.collector.span_metrics import SpanMetrics
    from spikehound.model import Span, SpanKind, StatusCode

    rng = random.Random(7)
    metrics = SpanMetrics(max_series=series)
    for _ in range(20):
        metrics.add_spans([Span(trace_id=os.urandom(16), span_id=os.urandom(8), parent_span_id=None,
                                service=f"svc-{i % 40}", host=f"gpu-{i % 2}", name=f"GET /api/v1/route/{i}",
                                kind=SpanKind.SERVER, start_unix_nano=0, end_unix_nano=rng.randint(1, 10**9),
                                status=StatusCode.OK) for i in range(series)])
    return metrics


def scrape_as_text(series: int) -> Callable[[], object]:
    metrics = _span_metrics(series)
    return metrics.exposition


def scrape_as_samples(series: int) -> Callable[[], object]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric

    from spikehound.collector.span_metrics import DURATION_BUCKETS_MS, INFERENCE_BUCKETS_S, le_label

    metrics = _span_metrics(series)

    def histogram(family: Metric, labels: dict[str, str], row: list[int], les: list[str], unit: float) -> None:
        cumulative = 0
        for le, n in zip(les, row, strict=False):
            cumulative += n
            family.add_sample(family.name + "_bucket", {**labels, "le": le}, cumulative)
        total = cumulative + row[-2]
        family.add_sample(family.name + "_bucket", {**labels, "le": "+Inf"}, total)
        family.add_sample(family.name + "_sum", labels, row[-1] / unit)
        family.add_sample(family.name + "_count", labels, total)

    class Families:
        """The span metrics' families built as sample objects at each scrape (the collector's way before)."""

        def collect(self) -> Iterator[Metric]:
            calls_rows, _ = metrics._calls.snapshot()
            entry_rows, _ = metrics._entry.snapshot()
            calls = Metric("traces_span_metrics_calls", "", "counter")
            duration = Metric("traces_span_metrics_duration_milliseconds", "", "histogram")
            inference = Metric("model_inference_latency_seconds", "", "histogram")
            les = [le_label(b) for b in DURATION_BUCKETS_MS]
            for (service, name, kind, status), row in calls_rows:
                labels = {"service_name": service, "span_name": name, "span_kind": str(kind),
                          "status_code": str(status)}
                histogram(duration, labels, row, les, 1e6)
                calls.add_sample("traces_span_metrics_calls_total", labels, sum(row[:-1]))
            les = [le_label(b) for b in INFERENCE_BUCKETS_S]
            for (service, operation, host), row in entry_rows:
                histogram(inference, {"service": service, "operation": operation, "host": host or ""}, row, les, 1e9)
            return iter((calls, duration, inference))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())  # type: ignore[arg-type]
    return lambda: generate_latest(registry)


def _requests(spans: int) -> list[bytes]:
    from spikehound.model import Span, SpanKind, StatusCode
    from spikehound.otlp import encode_spans

    out = []
    for r in range(spans // 1000):
        batch = [Span(trace_id=os.urandom(16), span_id=os.urandom(8), parent_span_id=os.urandom(8),
                      service=f"svc-{i % 20}", host="gpu-1", name=f"GET /api/v1/route/{i % 50}",
                      kind=SpanKind.SERVER, start_unix_nano=(r * 1000 + i) * 10**6,
                      end_unix_nano=(r * 1000 + i) * 10**6 + 5 * 10**6, status=StatusCode.OK)
                 for i in range(1000)]
        out.append(encode_spans(batch).SerializeToString())
    return out


def _queue(spans: int, keep_spans: bool) -> Callable[[], object]:
    import asyncio

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from spikehound.collector.ingest_queue import IngestQueue
    from spikehound.otlp import decode_spans

    bodies = _requests(spans)

    def fill() -> object:
        async def run() -> IngestQueue:
            queue = IngestQueue(spans, keep_spans=keep_spans)
            for body in bodies:
                decoded = decode_spans(ExportTraceServiceRequest.FromString(body), body)
                queue.offer(decoded.spans, [], decoded.payload)
            return queue

        return asyncio.run(run())  # the queue is returned: what it holds is alive when the peak is read

    return fill


def queue_as_blocks(spans: int) -> Callable[[], object]:
    return _queue(spans, keep_spans=False)


def queue_as_spans(spans: int) -> Callable[[], object]:
    return _queue(spans, keep_spans=True)


def measure(setup_name: str, size: int, out: Any) -> None:
    """In a fresh process: set up, then the peak rise of the mapped arenas over the work, and its seconds."""
    work = globals()[setup_name](size)
    before = python_arenas()
    began = time.perf_counter()
    kept = work()
    seconds = time.perf_counter() - began
    after = python_arenas()
    del kept
    out.put((max(after.peak_mapped - before.mapped, 0) / MB, seconds))


def run(setup_name: str, size: int) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=measure, args=(setup_name, size, out))
    process.start()
    figures = out.get(timeout=600)
    process.join()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", type=int, default=1000, help="span-metric series in each set")
    parser.add_argument("--queued", type=int, default=100_000, help="spans waiting in the ingest queue")
    args = parser.parse_args()
    if not python_arenas().mapped:
        print("Python's arenas cannot be read here (CPython on glibc only): nothing measured")
        return
    for label, size, setups in (("scrape", args.series, ("scrape_as_text", "scrape_as_samples")),
                                ("queue", args.queued, ("queue_as_blocks", "queue_as_spans"))):
        (mb, s), (ref_mb, ref_s) = (run(name, size) for name in setups)
        print(f"{label:7s} {setups[0]:18s} arenas +{mb:6.1f} MB in {s:5.3f} s   reference {setups[1]:18s} "
              f"+{ref_mb:6.1f} MB in {ref_s:5.3f} s   (ratio {mb / ref_mb if ref_mb else 0:.2f} of the MB)")


if __name__ == "__main__":
    main()
