"""The detection process's memory after a restart: a resume's replay against the same traffic seen live.

Run from the repository root: ``python -m benchmarks.resume_memory`` (``make bench``).

What is measured
----------------
A collector killed under load leaves what it committed after its last checkpoint to be replayed: up to
``detection.checkpoint_seconds`` (60 s) of its traffic. The benchmark builds that case in a SQLite file: the
soak's traffic (:class:`harness.soak_traffic.SoakPlan`, ``--rate`` spans a second of event time) committed
through the storage writer as the collector stores it, with live detection over ``--warm`` seconds, a
checkpoint, then ``--after`` seconds committed that no detector saw (the kill). Then two fresh processes, one
after the other, each what the detection process is (a :class:`DetectionDriver` fed by a :class:`CommitFeed`
over a :class:`Reader`):

* **restarted**: continues from the checkpoint (restore, the open windows' traces read back, the replay of
  what came after it), then takes ``--tail`` seconds of live commits, and the catch-up's hold is let go;
* **uninterrupted** (the reference): the same seconds fed live from the start, no restart.

Each process's resident memory is read after a full collection and the C heap's release (what a checkpoint
does), at the kill's point and at the end, with its high-water mark and the CPU time the whole life took
(the measurements' own collections and the traffic's generation included, alike in both: the restarted
process generates the seconds before the kill too, to skip them). The figure is the step: the restarted
process's memory at the end less the uninterrupted one's, and that per replayed span. Before the replay was
bounded (commit_feed.py) the step was 0.36 kB a replayed span here (0.65 in the soak, whose detection process
also kept its SQLite page cache), kept for the process's life.

This is a measurement, not a test: it exits 0 whatever the figures are.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from harness.soak_replay import REPLAY_START_NS
from harness.soak_traffic import SoakPlan
from spikehound.collector.commit_feed import CommitFeed
from spikehound.collector.detection_driver import CHECKPOINT_NAME, DetectionDriver, DriverSettings
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.config import Config
from spikehound.detectors.engine import CHECKPOINT_FORMAT
from spikehound.heap import release_free_heap
from spikehound.storage import checkpoints, migrate
from spikehound.storage.engine import make_engine
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch, Writer

BLOCK_SPANS = 500  # spans an export request (a stored block) holds


def _plan(args: argparse.Namespace) -> SoakPlan:
    return SoakPlan(seed=args.seed, start_ns=REPLAY_START_NS, seconds=args.warm + args.after + args.tail,
                    spans_per_s=args.rate)


def _driver(now: list[float]) -> DetectionDriver:
    return DetectionDriver(DriverSettings.from_config(Config()), CollectorTelemetry(), advance_while_held=False,
                           clock=lambda: now[0])


def _settled_mb() -> float:
    gc.collect()
    release_free_heap()
    return psutil.Process().memory_info().rss / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the kernel's high-water mark, in kB


def build(args: argparse.Namespace, db: Path) -> dict[str, Any]:
    """The killed collector's database: blocks as stored, live detection until the checkpoint."""
    engine = make_engine(f"sqlite:///{db}")
    migrate.upgrade(engine)
    writer, now = Writer(engine), [0.0]
    driver = _driver(now)
    feed = CommitFeed(driver, Reader(engine))
    feed.resume(None)
    replayed = 0
    for second, (_, batch) in enumerate(_plan(args).event_seconds()):
        if second == args.warm + args.after:
            break
        for i in range(0, len(batch), BLOCK_SPANS):  # one export request a commit (the writer encodes its block)
            writer.write(WriteBatch(spans=batch[i:i + BLOCK_SPANS]))
        if second < args.warm:
            feed.committed(batch, [])
            driver.take_outgoing()
            now[0] += 1
        else:
            replayed += len(batch)
        if second == args.warm - 1:
            checkpoints.save(engine, CHECKPOINT_NAME, CHECKPOINT_FORMAT, driver.snapshot())
    engine.dispose()
    return {"replayed_spans": replayed}


def run(args: argparse.Namespace, db: Path, restarted: bool) -> dict[str, Any]:
    """One detection process's life over the database (see the module); its memory figures."""
    engine = make_engine(f"sqlite:///{db}")
    now = [0.0]
    driver = _driver(now)
    feed = CommitFeed(driver, Reader(engine))
    out: dict[str, Any] = {}
    kill_point = args.warm + args.after
    began = time.process_time()
    if restarted:
        started = time.perf_counter()
        feed.resume(checkpoints.load(engine, CHECKPOINT_NAME))
        engine.dispose()  # as the detection process does: nothing is read after the resume
        out["resume_s"] = round(time.perf_counter() - started, 2)
        out["at_kill_mb"] = round(_settled_mb(), 1)
    else:
        feed.resume(None)
    for second, (_, batch) in enumerate(_plan(args).event_seconds()):
        if restarted and second < kill_point:
            continue
        feed.committed(batch, [])
        driver.take_outgoing()
        now[0] += 1
        if not restarted and second == kill_point - 1:
            out["at_kill_mb"] = round(_settled_mb(), 1)
    feed.idle(args.tail)  # the catch-up's quiet time has passed: a hold still there is let go
    driver.take_outgoing()
    out.update(cpu_s=round(time.process_time() - began, 1), end_mb=round(_settled_mb(), 1),
               peak_mb=round(_peak_mb(), 1), held=driver.detection.windows.hold is not None,
               open_windows=driver.detection.windows.open_windows)
    return out


def _in_fresh_process(fn: Any, *fn_args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, fn_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=5000.0, help="spans a second of event time")
    parser.add_argument("--warm", type=int, default=300, help="seconds seen live before the checkpoint")
    parser.add_argument("--after", type=int, default=100, help="seconds committed after it, replayed")
    parser.add_argument("--tail", type=int, default=60, help="seconds of live commits after the restart")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spikehound-resume-") as tmp:
        db = Path(tmp) / "spikehound.db"
        built = _in_fresh_process(build, args, db)
        restarted = _in_fresh_process(run, args, db, True)
        uninterrupted = _in_fresh_process(run, args, db, False)
    step = restarted["end_mb"] - uninterrupted["end_mb"]
    replayed = built["replayed_spans"]
    print(f"resume_memory: {replayed:,} spans replayed ({args.after} s at {args.rate:,.0f} spans/s) in "
          f"{restarted['resume_s']} s")
    for name, figures in (("restarted", restarted), ("uninterrupted", uninterrupted)):
        print(f"  {name:>13}: {figures['at_kill_mb']:7.1f} MB at the kill's point, {figures['end_mb']:7.1f} MB at "
              f"the end, peak {figures['peak_mb']:7.1f} MB, {figures['cpu_s']} s of CPU (held at the end: "
              f"{figures['held']}, {figures['open_windows']} windows open)")
    print(f"  step after the restart: {step:+.1f} MB, {step * 2**20 / max(replayed, 1) / 1000:.2f} kB a replayed "
          f"span (before the bounded replay: 0.36)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
