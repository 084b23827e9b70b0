"""What one poll of the spike list costs the API: ``GET /api/v1/spikes?limit=100`` read and encoded.

Run from the repository root: ``python -m benchmarks.spike_list`` (``make bench``).

A SQLite file holds ``--spikes`` spikes (``--open`` of them still open), each with ``--streams`` affected
streams and five causes, written through the storage writer as the collector writes them. Timed in CPU
time, best of ``--runs``, in one process:

* **every spike built**: the list read and encoded with nothing kept, as every poll was before;
* **first poll**: through the route's own function (``rest/core.py``, ``spike_list_json``) with a fresh reader;
* **later polls**: the same list again, as a dashboard polls it (resolved spikes kept as built and encoded,
  ``storage/resolved_spikes.py``; the open ones read afresh);
* **reference**: the spike rows alone (no causes, no streams), the least a list can read.

The soak's long runs polled this list under load (``benchmarks.soak``): 25-40 ms of CPU a poll at 93 spikes,
hundreds of milliseconds of wall time on a busy 2-core machine. This is a measurement: it exits 0.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from aiohttp import web
from sqlalchemy import select

from spikehound.collector.rest.common import ENCODED_SPIKES, READER
from spikehound.collector.rest.core import spike_list_json
from spikehound.model import AffectedStream, Cause, CauseKind, Spike
from spikehound.model_json import spike_json
from spikehound.storage import schema
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.resolved_spikes import ResolvedSpikes
from spikehound.storage.writer import WriteBatch, Writer
from spikehound.units import MS, NS

T0 = 1_780_000_000 * NS


def spikes(n: int, n_open: int, streams: int) -> list[Spike]:
    out = []
    for i in range(n):
        start = T0 + i * 1200 * NS
        out.append(Spike(
            id=f"{i:016x}", service=f"ts-service-{i % 40}", operation=f"POST /api/v1/route/{i % 17}",
            state="open" if i >= n - n_open else "resolved", start_unix_nano=start,
            end_unix_nano=None if i >= n - n_open else start + 240 * NS, p99_ns=900 * MS, baseline_p99_ns=120 * MS,
            causes=tuple(Cause(kind=CauseKind.SERVICE, score=0.8 / (c + 1), summary=f"ts-service-{c} added time",
                               service=f"ts-service-{c}", operation=f"op-{c}", baseline=10.0, observed=90.0 + c,
                               unit="ms") for c in range(5)),
            exemplar_trace_ids=tuple(bytes([i % 256, c]) * 8 for c in range(3)),
            affected=tuple(AffectedStream(
                service="ts-gateway-service", operation=f"HTTP POST -> ts-service-{s} POST /api/v1/route/{s}",
                peer_service=None, start_unix_nano=start, last_anomalous_end_unix_nano=start + 230 * NS,
                p99_ns=(900 + s) * MS, baseline_p99_ns=120 * MS, evidence=12.5 + s, slow_requests=30 + s)
                for s in range(streams))))
    return out


def best_cpu_ms(runs: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        began = time.process_time()
        work()
        best = min(best, time.process_time() - began)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spikes", type=int, default=100)
    parser.add_argument("--open", type=int, default=2, help="of them still open (default 2)")
    parser.add_argument("--streams", type=int, default=30, help="affected streams a spike (default 30; at most 50)")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'list.sqlite'}")
        upgrade(engine)
        Writer(engine).write(WriteBatch(spikes=spikes(args.spikes, args.open, args.streams)), now_ns=T0)

        def api(reader: Reader) -> web.Application:  # what the list's route reads through
            app = web.Application()
            app[READER], app[ENCODED_SPIKES] = reader, ResolvedSpikes()
            return app

        def poll(app: web.Application) -> bytes:
            return spike_list_json(app, None, None, None, None, 100)

        def built_again() -> bytes:
            return orjson.dumps({"spikes": [spike_json(s) for s in Reader(engine).spikes(limit=100)]})

        before = best_cpu_ms(args.runs, built_again)
        first = best_cpu_ms(args.runs, lambda: poll(api(Reader(engine))))
        warm = api(Reader(engine))
        size = len(poll(warm))
        later = best_cpu_ms(args.runs, lambda: poll(warm))
        with engine.connect() as conn:
            reference = best_cpu_ms(args.runs, lambda: conn.execute(
                select(schema.spikes).order_by(schema.spikes.c.start_ns.desc()).limit(100)).all())
        engine.dispose()
    print(f"spike list of {min(args.spikes, 100)} spikes ({args.open} open, {args.streams} streams each), "
          f"{size / 1024:.0f} KiB of JSON; CPU ms a poll, best of {args.runs}:")
    print(f"  every spike built and encoded at each poll (as before the list kept them) {before:.1f}; first poll "
          f"{first:.1f}; later polls {later:.1f} ({before / later:.1f}x less); reference (the spike rows alone) "
          f"{reference:.1f}")


if __name__ == "__main__":
    main()
