"""The agent's disk spool and forward queue on their own: order, cap, restart, crash damage, spill at shutdown."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.spool import HEADER_BYTES, MAGIC, DiskSpool, Item, Signal
from tests.support.spool_items import item, number

RECORD = 100 + HEADER_BYTES  # the spool's size of item(n): header and a 100-byte payload






def drain(source: DiskSpool | ForwardQueue) -> list[int]:
    out = []
    while (head := source.peek()) is not None:
        out.append(number(head))
        source.pop()
    return out


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg2"))


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def spools(spool_dir: Path) -> Iterator[list[DiskSpool]]:
    """Spools opened by a test; closed at its end whatever happens."""
    opened: list[DiskSpool] = []
    yield opened
    for s in opened:
        s.close()


def open_spool(spools: list[DiskSpool], directory: Path, max_bytes: int = 1 << 20,
               segment_bytes: int = 16 << 20) -> DiskSpool:
    spool = DiskSpool(directory, max_bytes, segment_bytes=segment_bytes)
    spools.append(spool)
    return spool


def reopen(spools: list[DiskSpool], spool: DiskSpool) -> DiskSpool:
    spool.close()
    return open_spool(spools, spool.directory, spool.max_bytes, spool.segment_bytes)


# --- DiskSpool ------------------------------------------------------------------------------------


def test_fifo_order_across_many_segments(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)  # five records per segment
    for n in range(200):
        assert spool.append(item(n))
    assert len(segments(spool_dir)) >= 40
    assert len(spool) == 200
    # Reading and writing interleaved keeps the order too.
    got = []
    for n in range(200, 260):
        got.append(number(spool.peek()))
        spool.pop()
        assert spool.append(item(n))
    assert got + drain(spool) == list(range(260))
    assert len(spool) == 0


def test_signal_and_count_survive_the_round_trip(spools, spool_dir):
    spool = open_spool(spools, spool_dir)
    assert spool.append(item(1, signal=Signal.METRICS))
    assert spool.append(item(2, size=5000))
    spool = reopen(spools, spool)
    first = spool.peek()
    assert (first.signal, first.count, first.payload) == (Signal.METRICS, 2, item(1, signal=Signal.METRICS).payload)
    spool.pop()
    assert spool.peek() == item(2, size=5000)


def test_cap_refuses_appends_and_counts_nothing(spools, spool_dir):
    spool = open_spool(spools, spool_dir, max_bytes=1000, segment_bytes=300)
    accepted = [spool.append(item(n)) for n in range(12)]
    assert accepted == [True] * 8 + [False] * 4  # 8 x RECORD bytes fit in 1000
    assert len(spool) == 8
    assert spool.bytes_used == 8 * RECORD
    sizes = [p.stat().st_size for p in segments(spool_dir)]
    assert spool.append(item(99)) is False
    assert [p.stat().st_size for p in segments(spool_dir)] == sizes  # nothing written
    assert (len(spool), spool.bytes_used) == (8, 8 * RECORD)
    # Forwarding one makes room for one.
    assert spool.peek() == item(0)
    spool.pop()
    assert spool.append(item(8)) is True
    assert spool.append(item(9)) is False
    assert drain(spool) == list(range(1, 9))


def test_restart_resumes_right_after_the_last_pop(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)
    for n in range(30):
        spool.append(item(n))
    assert drain_some(spool, 11) == list(range(11))  # ends in the middle of the third segment
    spool = reopen(spools, spool)
    assert len(spool) == 19
    assert drain_some(spool, 5) == list(range(11, 16))
    spool.peek()  # peeked but not popped: not forwarded, so it comes again after a restart
    spool = reopen(spools, spool)
    assert len(spool) == 14
    for n in range(30, 35):
        spool.append(item(n))
    assert drain(spool) == list(range(16, 35))


def drain_some(source: DiskSpool | ForwardQueue, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(number(source.peek()))
        source.pop()
    return out


def test_restart_after_everything_was_forwarded_sends_nothing_again(spools, spool_dir):
    spool = open_spool(spools, spool_dir)
    for n in range(5):
        spool.append(item(n))
    assert drain(spool) == list(range(5))
    spool = reopen(spools, spool)
    assert (len(spool), spool.peek(), spool.bytes_used) == (0, None, 0)


def test_torn_trailing_record_is_cut_and_earlier_records_are_intact(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)
    for n in range(10):
        spool.append(item(n))
    spool.close()
    last = segments(spool_dir)[-1]
    size = last.stat().st_size
    with last.open("r+b") as f:  # a crash in the middle of writing record 9
        f.truncate(size - 7)
    spool = open_spool(spools, spool_dir, segment_bytes=500)
    assert last.stat().st_size == size - RECORD  # cut back to the end of record 8
    assert len(spool) == 9
    assert spool.bytes_used == 9 * RECORD
    spool.append(item(10))  # new records after the cut are read normally
    assert drain(spool) == [*range(9), 10]
    assert spool.corrupt_records == 0


def written_segment(spools: list[DiskSpool], directory: Path, records: int) -> Path:
    """The one segment file of a spool that took items 0 to ``records`` - 1 and was closed."""
    spool = open_spool(spools, directory)
    for n in range(records):
        spool.append(item(n))
    spool.close()
    (seg,) = segments(directory)
    return seg


def test_torn_header_is_cut_too(spools, spool_dir):
    seg = written_segment(spools, spool_dir, 3)
    with seg.open("ab") as f:
        f.write(b"\x05\x00")  # two bytes of a header, then the crash
    spool = open_spool(spools, spool_dir)
    assert len(spool) == 3
    assert seg.stat().st_size == 3 * RECORD
    assert drain(spool) == [0, 1, 2]


def test_corrupt_record_is_skipped_counted_and_the_rest_delivered(spools, spool_dir):
    seg = written_segment(spools, spool_dir, 6)
    data = bytearray(seg.read_bytes())
    data[2 * RECORD + HEADER_BYTES + 40] ^= 0xFF  # one flipped bit pattern in record 2's payload
    seg.write_bytes(bytes(data))
    spool = open_spool(spools, spool_dir)
    assert drain(spool) == [0, 1, 3, 4, 5]
    assert spool.corrupt_records == 1
    assert len(spool) == 0
    assert spool.bytes_used == 0


LENGTH_AT = len(MAGIC)  # where a record's payload length starts in its header


def flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("bit", [20, 6], ids=["length-past-the-end", "length-inside-the-record"])
def test_a_flipped_bit_in_a_record_length_loses_that_record_only(spools, spool_dir, bit):
    seg = written_segment(spools, spool_dir, 6)
    flip_bit(seg, 2 * RECORD + LENGTH_AT + bit // 8, bit % 8)  # record 2 claims 1 MiB more, or 64 bytes less
    spool = open_spool(spools, spool_dir)
    assert len(spool) == 5
    assert drain(spool) == [0, 1, 3, 4, 5]
    assert (spool.corrupt_records, spool.skipped_bytes) == (1, RECORD)
    assert (len(spool), spool.bytes_used) == (0, 0)
    spool.append(item(6))  # and the spool goes on
    assert drain(spool) == [6]


def test_garbage_between_records_is_skipped_up_to_the_next_record(spools, spool_dir):
    seg = written_segment(spools, spool_dir, 4)
    data = seg.read_bytes()
    junk = MAGIC + bytes(range(200))  # even a stray marker
    seg.write_bytes(data[:2 * RECORD] + junk + data[2 * RECORD:])
    spool = open_spool(spools, spool_dir)
    assert len(spool) == 4
    assert drain(spool) == [0, 1, 2, 3]
    assert (spool.corrupt_records, spool.skipped_bytes) == (1, len(junk))


def test_damage_in_an_older_segment_never_stalls_the_reader(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)  # five records per segment
    for n in range(15):
        spool.append(item(n))
    second = segments(spool_dir)[1]  # records 5 to 9, behind the head segment and before the tail
    assert drain_some(spool, 1) == [0]
    with second.open("r+b") as f:  # lost while the agent runs: record 7 is cut short, 8 and 9 are gone
        f.truncate(2 * RECORD + 50)
    assert drain(spool) == [1, 2, 3, 4, 5, 6, *range(10, 15)]
    assert (len(spool), spool.peek(), spool.bytes_used) == (0, None, 0)
    assert (spool.corrupt_records, spool.skipped_bytes) == (1, 50)


def legacy_record(it: Item) -> bytes:
    """``it`` as the agent wrote spool records before the record header had a marker and its own checksum."""
    return struct.pack("<IBII", len(it.payload), it.signal, it.count, zlib.crc32(it.payload)) + it.payload


def test_a_spool_left_by_the_previous_version_is_forwarded_first(spools, spool_dir):
    spool_dir.mkdir()
    (spool_dir / "001000000000.seg").write_bytes(b"".join(legacy_record(item(n)) for n in range(3)))
    (spool_dir / "001000000001.seg").write_bytes(b"".join(legacy_record(item(n, signal=Signal.METRICS))
                                                          for n in range(3, 5)))
    (spool_dir / "cursor").write_text(f"1000000000 {len(legacy_record(item(0)))}\n")  # 0 went before the upgrade
    spool = open_spool(spools, spool_dir)
    assert len(spool) == 4
    spool.append(item(5))
    assert drain_some(spool, 2) == [1, 2]
    spool = reopen(spools, spool)  # a restart in the middle
    assert len(spool) == 3
    assert spool.peek() == item(3, signal=Signal.METRICS)
    assert drain(spool) == [3, 4, 5]
    assert [p.suffix for p in segments(spool_dir)] == [".seg2"]  # the old segments went once forwarded
    assert not list(spool_dir.glob("*.seg"))
    assert spool.corrupt_records == 0


DISK_FULL = r"""
import json, logging, resource, sys
from pathlib import Path
from spikehound.agent.spool import DiskSpool, SpoolWriteError
from tests.support.spool_items import item, number

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
directory, limit = Path(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
spool = DiskSpool(directory, max_bytes=1 << 20)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # no file may grow past ``limit``: EFBIG
accepted, refused = [], 0
for n in range(10):
    try:
        if spool.append(item(n)):
            accepted.append(n)
    except SpoolWriteError:
        refused += 1
full = {"len": len(spool), "bytes": spool.bytes_used, "errors": spool.write_errors,
        "files": sorted(p.stat().st_size for p in directory.glob("*.seg2"))}
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
accepted += [n for n in (10, 11) if spool.append(item(n))]
drained = []
while (head := spool.peek()) is not None:
    drained.append(number(head))
    spool.pop()
print(json.dumps({"accepted": accepted, "refused": refused, "full": full, "drained": drained, "len": len(spool)}))
"""


def test_a_full_disk_refuses_the_append_and_keeps_the_spool_whole(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse to grow a file past the limit (EFBIG), as a full disk does (ENOSPC),
    # after writing what fits: here part of record 5. Python ignores SIGXFSZ, so the write raises.
    limit = 5 * RECORD + 60
    done = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path / "spool"), str(limit)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["accepted"] == [0, 1, 2, 3, 4, 10, 11]
    assert out["refused"] == 5
    assert out["full"] == {"len": 5, "bytes": 5 * RECORD, "errors": 5, "files": [5 * RECORD]}  # rolled back
    assert out["drained"] == [0, 1, 2, 3, 4, 10, 11]
    assert out["len"] == 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "the disk refused appending 1 records" in errors[0], done.stderr  # once, not per try
    assert "INFO spool: writing again after 5 refused appends" in done.stderr


def test_drained_spool_is_empty_and_read_segments_are_deleted(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=1000)
    for n in range(100):
        spool.append(item(n))
    assert spool.bytes_used == 100 * RECORD
    before = segments(spool_dir)
    assert len(before) >= 10
    assert drain(spool) == list(range(100))
    assert spool.bytes_used == 0
    assert len(spool) == 0
    assert segments(spool_dir) == before[-1:]  # only the tail, still open for writing, is left
    assert before[-1].stat().st_size == 0  # and emptied: a drained spool holds no disk (it kept up to 16 MiB)
    spool.append(item(100))
    assert drain(spool) == [100]
    assert spool.bytes_used == 0 and before[-1].stat().st_size == 0
    assert spool.has_room(spool.max_bytes)  # the cap counts only what is unsent
    spool.append(item(101))  # written into the emptied segment, then read after a restart exactly once
    spool = reopen(spools, spool)
    spool.append(item(102))
    assert drain(spool) == [101, 102]
    spool = reopen(spools, spool)
    assert (len(spool), spool.peek(), spool.bytes_used) == (0, None, 0)


def test_prepend_onto_a_partly_read_head_of_many_segments(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)
    for n in range(10, 30):
        spool.append(item(n))
    assert drain_some(spool, 2) == [10, 11]  # head segment partly read
    assert spool.prepend([item(n) for n in range(5)]) == []
    assert len(spool) == 23
    assert spool.bytes_used == 23 * RECORD
    spool.append(item(30))
    spool = reopen(spools, spool)
    assert drain(spool) == list(range(5)) + list(range(12, 31))


def test_prepend_returns_what_does_not_fit(spools, spool_dir):
    spool = open_spool(spools, spool_dir, max_bytes=5 * RECORD)
    for n in range(10, 13):
        spool.append(item(n))
    left = spool.prepend([item(n) for n in range(4)])
    assert left == [item(2), item(3)]
    spool = reopen(spools, spool)
    assert drain(spool) == [0, 1, 10, 11, 12]


# --- ForwardQueue ---------------------------------------------------------------------------------


@pytest.fixture
def queues(spools) -> Iterator[list[ForwardQueue]]:
    opened: list[ForwardQueue] = []
    yield opened
    for q in opened:
        q.close()


def forward_queue(queues: list[ForwardQueue], spool_dir: Path, memory_items: int, spool_max: int = 1 << 20,
                  segment_bytes: int = 16 << 20) -> ForwardQueue:
    q = ForwardQueue(memory_items * RECORD, DiskSpool(spool_dir, spool_max, segment_bytes=segment_bytes))
    queues.append(q)
    return q


def test_queue_keeps_arrival_order_from_memory_to_spool(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=3)
    for n in range(10):
        assert q.put(item(n))
    assert (q.memory_items, len(q.spool), q.spilled_items) == (3, 7, 7)
    assert q.memory_used == 3 * RECORD
    assert drain(q) == list(range(10))
    assert (q.memory_used, q.spool.bytes_used, len(q)) == (0, 0, 0)


def test_once_anything_is_spooled_new_items_go_to_the_spool(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=2)
    for n in range(3):
        q.put(item(n))  # 0, 1 in memory; 2 spooled
    assert number(q.peek()) == 0
    q.pop()  # memory has room again, but 3 must not overtake 2
    q.put(item(3))
    assert (q.memory_items, len(q.spool)) == (1, 2)
    assert drain(q) == [1, 2, 3]
    q.put(item(4))  # the spool is empty again: back to memory
    assert (q.memory_items, len(q.spool)) == (1, 0)
    assert drain(q) == [4]


def test_queue_refuses_when_memory_and_spool_are_full(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=2, spool_max=3 * RECORD)
    assert [q.put(item(n)) for n in range(7)] == [True] * 5 + [False] * 2
    assert (len(q), q.spilled_items) == (5, 3)
    assert drain(q) == list(range(5))


def test_spill_memory_puts_unsent_memory_items_ahead_of_spooled_ones(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=4, segment_bytes=300)
    for n in range(12):
        q.put(item(n))  # 0-3 in memory, 4-11 spooled
    q.pop()  # 0 forwarded
    assert q.spill_memory() == 0
    assert (q.memory_items, q.memory_used, len(q.spool)) == (0, 0, 11)
    q.close()
    again = forward_queue(queues, spool_dir, memory_items=4, segment_bytes=300)  # the next start
    assert len(again) == 11
    again.put(item(12))  # spooled behind the old records, not into memory ahead of them
    assert drain(again) == list(range(1, 13))


def test_spill_memory_with_the_head_segment_partly_read(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=2)
    for n in range(4):
        q.put(item(n))  # 0, 1 in memory; 2, 3 spooled
    assert drain_some(q, 3) == [0, 1, 2]
    assert (q.memory_items, len(q.spool)) == (0, 1)  # the one segment is read up to 3
    assert drain(q) == [3]  # the spool is empty, but its one segment was read, not deleted
    for n in range(4, 7):
        q.put(item(n))  # 4, 5 in memory; 6 spooled behind the read part of the segment
    assert (q.memory_items, len(q.spool)) == (2, 1)
    assert q.spill_memory() == 0
    q.close()
    again = forward_queue(queues, spool_dir, memory_items=2)
    assert drain(again) == [4, 5, 6]
    assert again.spool.corrupt_records == 0


def test_spill_memory_keeps_in_memory_what_the_spool_cannot_hold(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=4, spool_max=5 * RECORD)
    for n in range(7):
        q.put(item(n))  # 0-3 in memory, 4-6 spooled
    assert q.spill_memory() == 2  # room for two more records only
    assert (q.memory_items, q.memory_used) == (2, 2 * RECORD)
    q.close()
    again = forward_queue(queues, spool_dir, memory_items=4, spool_max=5 * RECORD)
    assert drain(again) == [0, 1, 4, 5, 6]
