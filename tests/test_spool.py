"""The agent's disk spool and forward queue on their own: order, cap, restart, crash damage, spill at shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.forward_queue import ForwardQueue
from agent.spool import DiskSpool, Item, Signal

HEADER_BYTES = 13  # length, signal, item count, crc32: the record header of agent/spool.py


def item(n: int, size: int = 100, signal: Signal = Signal.TRACES) -> Item:
    """Item number ``n``: its payload starts with the number, so the order can be read back."""
    tag = f"item-{n:06d}|".encode()
    return Item(signal, tag + bytes([n % 251]) * (size - len(tag)), n + 1)


def number(it: Item) -> int:
    return int(it.payload.split(b"|", 1)[0].removeprefix(b"item-"))


def drain(source: DiskSpool | ForwardQueue) -> list[int]:
    out = []
    while (head := source.peek()) is not None:
        out.append(number(head))
        source.pop()
    return out


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


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
    spool = open_spool(spools, spool_dir, segment_bytes=500)  # four 113-byte records per segment
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
    assert accepted == [True] * 8 + [False] * 4  # 8 x 113 bytes fit in 1000
    assert len(spool) == 8
    assert spool.bytes_used == 8 * 113
    sizes = [p.stat().st_size for p in segments(spool_dir)]
    assert spool.append(item(99)) is False
    assert [p.stat().st_size for p in segments(spool_dir)] == sizes  # nothing written
    assert (len(spool), spool.bytes_used) == (8, 8 * 113)
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
    assert last.stat().st_size == size - 113  # cut back to the end of record 8
    assert len(spool) == 9
    assert spool.bytes_used == 9 * 113
    spool.append(item(10))  # new records after the cut are read normally
    assert drain(spool) == [*range(9), 10]
    assert spool.corrupt_records == 0


def test_torn_header_is_cut_too(spools, spool_dir):
    spool = open_spool(spools, spool_dir)
    for n in range(3):
        spool.append(item(n))
    spool.close()
    (seg,) = segments(spool_dir)
    with seg.open("ab") as f:
        f.write(b"\x05\x00")  # two bytes of a header, then the crash
    spool = open_spool(spools, spool_dir)
    assert len(spool) == 3
    assert seg.stat().st_size == 3 * 113
    assert drain(spool) == [0, 1, 2]


def test_corrupt_record_is_skipped_counted_and_the_rest_delivered(spools, spool_dir):
    spool = open_spool(spools, spool_dir)
    for n in range(6):
        spool.append(item(n))
    spool.close()
    (seg,) = segments(spool_dir)
    data = bytearray(seg.read_bytes())
    data[2 * 113 + HEADER_BYTES + 40] ^= 0xFF  # one flipped bit pattern in record 2's payload
    seg.write_bytes(bytes(data))
    spool = open_spool(spools, spool_dir)
    assert drain(spool) == [0, 1, 3, 4, 5]
    assert spool.corrupt_records == 1
    assert len(spool) == 0
    assert spool.bytes_used == 0


def test_drained_spool_is_empty_and_read_segments_are_deleted(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=1000)
    for n in range(100):
        spool.append(item(n))
    assert spool.bytes_used == 100 * 113
    before = segments(spool_dir)
    assert len(before) >= 10
    assert drain(spool) == list(range(100))
    assert spool.bytes_used == 0
    assert len(spool) == 0
    assert segments(spool_dir) == before[-1:]  # only the tail, still open for writing, is left
    spool.append(item(100))
    assert drain(spool) == [100]
    assert spool.bytes_used == 0
    assert spool.has_room(spool.max_bytes)  # the cap counts only what is unsent


def test_prepend_onto_a_partly_read_head_of_many_segments(spools, spool_dir):
    spool = open_spool(spools, spool_dir, segment_bytes=500)
    for n in range(10, 30):
        spool.append(item(n))
    assert drain_some(spool, 2) == [10, 11]  # head segment partly read
    assert spool.prepend([item(n) for n in range(5)]) == []
    assert len(spool) == 23
    assert spool.bytes_used == 23 * 113
    spool.append(item(30))
    spool = reopen(spools, spool)
    assert drain(spool) == list(range(5)) + list(range(12, 31))


def test_prepend_returns_what_does_not_fit(spools, spool_dir):
    spool = open_spool(spools, spool_dir, max_bytes=5 * 113)
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
    q = ForwardQueue(memory_items * 113, DiskSpool(spool_dir, spool_max, segment_bytes=segment_bytes))
    queues.append(q)
    return q


def test_queue_keeps_arrival_order_from_memory_to_spool(queues, spool_dir):
    q = forward_queue(queues, spool_dir, memory_items=3)
    for n in range(10):
        assert q.put(item(n))
    assert (q.memory_items, len(q.spool), q.spilled_items) == (3, 7, 7)
    assert q.memory_used == 3 * 113
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
    q = forward_queue(queues, spool_dir, memory_items=2, spool_max=3 * 113)
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
    q = forward_queue(queues, spool_dir, memory_items=4, spool_max=5 * 113)
    for n in range(7):
        q.put(item(n))  # 0-3 in memory, 4-6 spooled
    assert q.spill_memory() == 2  # room for two more records only
    assert (q.memory_items, q.memory_used) == (2, 2 * 113)
    q.close()
    again = forward_queue(queues, spool_dir, memory_items=4, spool_max=5 * 113)
    assert drain(again) == [0, 1, 4, 5, 6]
