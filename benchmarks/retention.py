"""Retention's cost and the disk a stored span or point takes, for sizing the caps (docs/operations.md).

Run from the repository root: ``python -m benchmarks.retention`` (SQLite in a temporary directory), with
``--postgres`` to also run on a throwaway PostgreSQL server (harness/pgserver.py), or ``--db URL``.

What is measured, on one store filled through the real ``spikehound.storage.writer.Writer``:

1. **Reference** -- a full recount, the way a naive size cap would read the store at every run:
   ``sum(length(payload))`` over the span blocks and ``count(*)`` over the metric points.
2. **First measure** -- ``Retention.measure`` after a start: it reads everything once (same work as 1).
3. **Later measure** -- after 1 % more data arrived: ``Retention.measure`` reads only that, so its time
   stays flat while the reference grows with the store.
4. **Enforce** -- deleting the oldest 10 % of spans and points for the size caps: rows per second.
5. **Disk** -- bytes the database holds per metric point and per byte of span payload, indexes included
   (SQLite: used pages; PostgreSQL: ``pg_total_relation_size``).

A measurement, not a test: it prints its figures and exits 0 unless the benchmark itself failed.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select, text

from spikehound.model import MetricKind, MetricPoint, Span, SpanKind, StatusCode
from spikehound.otlp import encode_spans
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.retention import Retention, RetentionPolicy
from spikehound.storage.schema import metric_points, span_blocks
from spikehound.storage.writer import SpanBlock, WriteBatch, Writer

S = 1_000_000_000
YEAR_S = 365 * 86_400


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def request(rng: random.Random, n: int, t0: int) -> list[Span]:
    """One export request of ``n`` spans: inference traces of 8 spans with a few attributes each."""
    spans = []
    for i in range(n):
        trace = rng.randbytes(16)
        root = i % 8 == 0
        start = t0 + i * 1_000_000
        spans.append(Span(trace_id=trace, span_id=rng.randbytes(8), parent_span_id=None if root else rng.randbytes(8),
                          service=rng.choice(["gateway", "preprocess", "model-server"]), host="gpu-node-3",
                          name="POST /v1/generate" if root else rng.choice(["prefill", "decode", "tokenize"]),
                          kind=SpanKind.SERVER if root else SpanKind.INTERNAL, start_unix_nano=start,
                          end_unix_nano=start + rng.randint(1, 80) * 1_000_000, status=StatusCode.UNSET,
                          attributes={"model.name": "llama-3-8b", "batch.size": rng.randint(1, 32),
                                      "gen_ai.usage.output_tokens": rng.randint(1, 900)},
                          events=[], resource={"service.name": "gateway", "host.name": "gpu-node-3"}))
    return spans


def fill(writer: Writer, rng: random.Random, blocks: int, points: int, arrived_s: int, t0: int) -> None:
    per_batch = max(1, points // max(blocks, 1))
    for b in range(blocks):
        spans = request(rng, 64, t0 + b * S)
        batch_points = [MetricPoint(host=f"gpu-node-{i % 8}", name=f"hw.gpu.metric.{i % 24}",
                                    attributes={"hw.id": f"GPU-{i % 8}"}, time_unix_nano=t0 + (b * per_batch + i) * S,
                                    value=rng.random(), kind=MetricKind.GAUGE, unit="1") for i in range(per_batch)]
        writer.write(WriteBatch(spans=spans, points=batch_points,
                                blocks=[SpanBlock.of(encode_spans(spans).SerializeToString(), spans)]),
                     now_ns=(arrived_s + b) * S)


def disk_bytes(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            pages = conn.execute(text("SELECT sum(pgsize) FROM dbstat "
                                      "WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = :t)"),
                                 {"t": table}).scalar()
            if pages is not None:
                return int(pages)
            raise RuntimeError("this SQLite has no dbstat table")
        return int(conn.execute(text("SELECT pg_total_relation_size(:t)"), {"t": table}).scalar_one())


def recount(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (int(conn.execute(select(func.coalesce(func.sum(func.length(span_blocks.c.payload)), 0))).scalar_one()),
                int(conn.execute(select(func.count()).select_from(metric_points)).scalar_one()))


def run(url: str, blocks: int, points: int) -> None:
    engine = make_engine(url)
    upgrade(engine)
    writer, rng = Writer(engine), random.Random(6)
    now = int(time.time())
    t0 = (now - 86_400) * S
    fill_s, _ = timed(lambda: fill(writer, rng, blocks, points, now - 7200, t0))
    if engine.dialect.name == "postgresql":  # what autovacuum does on a collector that has run for a while
        with engine.begin() as conn:
            conn.execute(text("ANALYZE span_blocks, metric_points"))
    retention = Retention(engine)
    ref_s, (payload, stored_points) = timed(lambda: recount(engine))
    first_s, size = timed(lambda: retention.measure(now))
    assert (size.span_bytes, size.points) == (payload, stored_points), (size, payload, stored_points)
    fill(writer, rng, blocks // 100 or 1, points // 100, now - 60, t0 + blocks * 2 * S)
    ref2_s, (payload2, points2) = timed(lambda: recount(engine))
    later_s, size2 = timed(lambda: retention.measure(now + 1))
    assert (size2.span_bytes, size2.points) == (payload2, points2)
    span_disk = disk_bytes(engine, "span_blocks") + disk_bytes(engine, "trace_blocks")
    point_disk = disk_bytes(engine, "metric_points")
    policy = RetentionPolicy(span_max_age_s=YEAR_S, point_max_age_s=YEAR_S, span_max_bytes=payload2 * 9 // 10,
                             point_max_count=points2 * 9 // 10)
    enforce_s, result = timed(lambda: retention.enforce(policy, now + 1, max_batches=10**6))
    assert retention.size.span_bytes <= policy.span_max_bytes and retention.size.points <= policy.point_max_count
    deleted_rows = result.points_over_size + blocks // 10
    print(f"\n{engine.dialect.name}: {blocks} span blocks of 64 spans ({payload2 / 2**20:.1f} MiB of payload), "
          f"{points2} metric points; filled in {fill_s:.1f} s")
    print(f"  reference: full recount of the store      {ref2_s * 1e3:9.1f} ms  (before the last 1 %: "
          f"{ref_s * 1e3:.1f} ms)")
    print(f"  first measure after a start               {first_s * 1e3:9.1f} ms")
    print(f"  later measure (1 % new data)              {later_s * 1e3:9.1f} ms")
    print(f"  enforce: {result.spans_over_size} spans and {result.points_over_size} points deleted in "
          f"{enforce_s:.2f} s ({deleted_rows / enforce_s:,.0f} rows/s)")
    print(f"  disk: {point_disk / points2:.1f} bytes per metric point; {span_disk / payload2:.2f} bytes per "
          "byte of span payload (blocks + trace index)")
    engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--db", help="database URL (default: SQLite in a temporary directory)")
    parser.add_argument("--postgres", action="store_true", help="also run on a throwaway PostgreSQL server")
    parser.add_argument("--blocks", type=int, default=2000, help="span blocks of 64 spans (default 2000)")
    parser.add_argument("--points", type=int, default=1_000_000, help="metric points (default 1000000)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args.db or f"sqlite:///{Path(tmp) / 'spikehound.db'}", args.blocks, args.points)
    if args.postgres:
        from harness.pgserver import PostgresServer

        server = PostgresServer()
        server.start()
        try:
            run(server.url, args.blocks, args.points)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
