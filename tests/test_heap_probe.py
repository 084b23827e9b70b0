"""The soak's heap probe (``harness/heap_probe.py``): a real collector run under it answers SIGUSR2 with where
its Python heap is (two answers give what grew); its forked detection process runs untraced and lets the signal
pass."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import psutil
import pytest

from harness.daemons import CollectorProcess
from harness.heap_probe import growth
from harness.waiting import eventually

pytestmark = pytest.mark.slow


def lines_of(heap: Path, pid: int) -> int:
    path = heap / f"heap-{pid}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_collector_under_the_probe_writes_its_heap_on_sigusr2_and_its_detection_process_lets_it_pass(tmp_path: Path):
    heap = tmp_path / "heap"
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path,
                                 env={"HEAP_PROBE_DIR": str(heap)})
    collector.prefix = [sys.executable, "-m", "harness.heap_probe"]
    collector.start(120)
    try:
        main = psutil.Process(collector.proc.pid)
        (detection,) = main.children(recursive=True)  # the detection process, forked from it
        detection.send_signal(signal.SIGUSR2)
        for answers in (1, 2):
            main.send_signal(signal.SIGUSR2)
            eventually(lambda n=answers: lines_of(heap, main.pid) == n, f"heap line {answers}", 60)
        assert collector.running and detection.is_running(), collector.log_tail()
        assert lines_of(heap, detection.pid) == 0  # untraced: nothing to say, and not killed by the signal
    finally:
        collector.terminate(60)

    lines = [json.loads(text) for text in (heap / f"heap-{main.pid}.jsonl").read_text().splitlines()]
    assert all(line["traced_mb"] > 1 and line["rss_mb"] > line["traced_mb"] for line in lines), lines
    sites = [site["where"][0] for site in lines[0]["by_line"]]
    # Traced from before the daemon's modules loaded: their import is among the biggest sites, and an idle
    # collector's heap is mostly its modules (about 100 MB traced here; a few MB if tracing began after them).
    assert any(site.startswith("<frozen importlib") for site in sites[:5]), sites[:20]
    assert lines[0]["traced_mb"] > 30, lines[0]["traced_mb"]
    grew = growth(heap / f"heap-{main.pid}.jsonl")
    assert {site for site, _, _ in grew} >= set(sites), "every site of either line is in the growth table"
