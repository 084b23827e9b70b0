"""The C heap gives back what Python freed (spikehound/heap.py): the collector's checkpoints and catch-ups
free tens to hundreds of MB among objects that live on, which glibc would otherwise keep."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from spikehound.heap import configure_malloc, heap_used_and_free_bytes, sqlite_heap_bytes

pytestmark = pytest.mark.skipif(not configure_malloc(), reason="glibc's malloc only")


def test_memory_freed_among_live_objects_goes_back_to_the_system():
    # In a child of its own: this process's heap is whatever earlier tests left in it.
    script = textwrap.dedent("""
        from spikehound.heap import configure_malloc, heap_free_bytes, release_free_heap

        def rss_mb():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

        configure_malloc()
        before = rss_mb()
        blocks = [bytes(2000) + i.to_bytes(4, "little") for i in range(100_000)]  # 200 MB on the C heap
        kept = blocks[::50]  # a few live on among the freed ones, as the detectors' state does
        del blocks
        held, free = rss_mb() - before, heap_free_bytes() / 2**20
        release_free_heap()
        print(round(held), round(free), round(rss_mb() - before), len(kept))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    held, free, after, _ = (int(x) for x in out.split())
    assert held > 150 and free > 150  # freed, but still the process's
    assert after < 40  # given back: what is left is the 2,000 kept blocks and the interpreter's own growth


def test_the_heap_figures_follow_what_c_code_and_sqlite_hold():
    import sqlite3

    db = sqlite3.connect(":memory:")
    before_sqlite, (before_used, _) = sqlite_heap_bytes(), heap_used_and_free_bytes()
    db.execute("CREATE TABLE t (x BLOB)")
    db.executemany("INSERT INTO t VALUES (?)", ((bytes(1000),) for _ in range(20_000)))  # 20 MB of pages
    filled = sqlite_heap_bytes() - before_sqlite
    used_now, _ = heap_used_and_free_bytes()
    assert filled > 15 * 2**20 and used_now - before_used > 15 * 2**20  # SQLite's memory is malloc's
    db.close()
    assert sqlite_heap_bytes() - before_sqlite < filled / 10  # its pages went with the connection
