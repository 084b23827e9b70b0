"""Run a spikehound daemon with tracemalloc on: each SIGUSR2 writes where its Python heap is.

For finding what grows over a long run (``python -m benchmarks.soak --heap-every 1800``)::

    HEAP_PROBE_DIR=heap python -m harness.heap_probe "$(command -v spikehound)" collector --db ...
    kill -USR2 <the collector's pid>
    python -m harness.heap_probe --growth heap/heap-<pid>.jsonl     # what grew from its first line to its last

The daemon's own process (and its forked children too with ``HEAP_PROBE_CHILDREN=1``: a child keeps the handler, and
the tracing unless it is stopped at the fork) answers a SIGUSR2 with one JSON line in
``$HEAP_PROBE_DIR/heap-<pid>.jsonl``: the traced total, the RSS, and the biggest allocation sites by line (and by
call path, slower, when ``$HEAP_PROBE_FRAMES`` asks for more than one frame). Taking one stops the process for
seconds to a minute, and tracing slows allocation: this is for finding a leak, not for timing anything.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from types import FrameType

TOP = 120  # allocation sites kept per grouping: growth worth chasing is among the biggest


def _sites(snapshot: tracemalloc.Snapshot, key: str) -> list[dict[str, object]]:
    return [{"where": [f"{f.filename}:{f.lineno}" for f in stat.traceback], "kib": round(stat.size / 1024, 1),
             "blocks": stat.count} for stat in snapshot.statistics(key)[:TOP]]


def write_heap(out: Path) -> None:
    """One line: traced bytes, RSS, and the top sites of this process's Python heap."""
    began = time.monotonic()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    current, peak = tracemalloc.get_traced_memory()
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    line = {"at": time.time(), "pid": os.getpid(), "traced_mb": round(current / 2**20, 2),
            "peak_mb": round(peak / 2**20, 2), "rss_mb": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 2),
            "by_line": _sites(snapshot, "lineno")}
    if tracemalloc.get_traceback_limit() > 1:  # grouping by path is the slow part: only when asked for
        line["by_path"] = _sites(snapshot, "traceback")
    line["took_s"] = round(time.monotonic() - began, 2)
    with open(out / f"heap-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def growth(path: Path, first: int = 0, last: int = -1) -> list[tuple[str, float, int]]:
    """(site, KiB, blocks) that grew between two lines of one process's file, the most first.

    A site in only one of the two lines' top lists counts from zero (or to zero): a slow grower enters late.
    """
    lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    before, after = ({s["where"][0]: (s["kib"], s["blocks"]) for s in line["by_line"]}
                     for line in (lines[first], lines[last]))
    rows = [(site, after.get(site, (0.0, 0))[0] - before.get(site, (0.0, 0))[0],
             after.get(site, (0.0, 0))[1] - before.get(site, (0.0, 0))[1]) for site in {*before, *after}]
    return sorted(rows, key=lambda row: -row[1])


def main(argv: list[str]) -> int:
    """``argv``: the daemon's executable, then its arguments (the executable's path is not needed); or
    ``--growth FILE``: print what grew in that file, its first line to its last."""
    if argv[:1] == ["--growth"]:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: end quietly
        for site, kib, blocks in growth(Path(argv[1]))[:40]:
            print(f"{kib / 1024:9.2f} MiB {blocks:+10d} blocks  {site}")
        return 0
    out = Path(os.environ.get("HEAP_PROBE_DIR", "."))
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(int(os.environ.get("HEAP_PROBE_FRAMES", "1")))
    if os.environ.get("HEAP_PROBE_CHILDREN", "0") != "1":
        # A forked child (the collector's detection process) runs untraced unless asked: traced, it missed
        # its 30 s answers under a soak's load on two cores and was restarted again and again.
        os.register_at_fork(after_in_child=tracemalloc.stop)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if tracemalloc.is_tracing():  # an untraced child has nothing to say
            write_heap(out)

    signal.signal(signal.SIGUSR2, on_signal)
    from spikehound.cli import main as spikehound_main

    return spikehound_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
