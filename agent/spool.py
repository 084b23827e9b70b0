"""The disk spool: a size-capped FIFO of export requests in append-only segment files.

Each record is a fixed header (payload length, signal, item count, CRC-32)
followed by the serialized OTLP request. A small cursor file remembers how far
the oldest segment has been forwarded; fully forwarded segments are deleted.
After a crash a torn trailing record is cut off, and a record whose CRC does
not match is skipped and counted, so one bad sector never blocks the queue.
Replay is at-least-once: a record sent just before a crash may be sent again,
which the collector absorbs (spans and samples are stored idempotently).

>>> import tempfile
>>> spool = DiskSpool(Path(tempfile.mkdtemp()), max_bytes=1 << 20)
>>> spool.append(Item(Signal.TRACES, b"payload", 3))
True
>>> spool.peek().payload, len(spool)
(b'payload', 1)
>>> spool.pop(); spool.peek() is None
True
>>> spool.close()
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("spikehound.agent.spool")

_HEADER = struct.Struct("<IBII")  # payload length, signal, item count, crc32 of payload
_SEGMENT_SUFFIX = ".seg"
_CURSOR = "cursor"
_FIRST_SEQUENCE = 1_000_000_000  # room below it for segments prepended at shutdown


class Signal(enum.IntEnum):
    TRACES = 1
    METRICS = 2


@dataclass(frozen=True, slots=True)
class Item:
    """One serialized export request waiting to be forwarded."""

    signal: Signal
    payload: bytes
    count: int  # spans or data points, for the counters

    @property
    def size(self) -> int:
        return _HEADER.size + len(self.payload)


class DiskSpool:
    """FIFO of Items on disk, at most ``max_bytes`` of unsent records; not thread-safe."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = 16 << 20) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.corrupt_records = 0
        directory.mkdir(parents=True, exist_ok=True)
        self._segments: deque[int] = deque(sorted(
            int(p.stem) for p in directory.glob(f"*{_SEGMENT_SUFFIX}") if p.stem.isdigit()))
        self._read_offset = 0
        self._writer: BinaryIO | None = None
        self._reader: BinaryIO | None = None
        self._peeked: tuple[Item, int] | None = None  # item and the offset after it
        self._count = 0
        self._recover()

    # --- state ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    @property
    def bytes_used(self) -> int:
        return sum(self._path(s).stat().st_size for s in self._segments) - self._read_offset

    def _path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:012d}{_SEGMENT_SUFFIX}"

    def _recover(self) -> None:
        cursor = self.directory / _CURSOR
        if cursor.exists():
            try:
                sequence, offset = (int(x) for x in cursor.read_text().split())
            except ValueError:
                sequence, offset = -1, 0
            while self._segments and self._segments[0] < sequence:
                self._path(self._segments.popleft()).unlink(missing_ok=True)
            if self._segments and self._segments[0] == sequence:
                self._read_offset = offset
        for sequence in list(self._segments):
            start = self._read_offset if sequence == self._segments[0] else 0
            self._count += self._scan(sequence, start)
        self._used = self.bytes_used

    def _scan(self, sequence: int, start: int) -> int:
        """Count whole records from ``start``; cut a torn tail left by a crash."""
        path = self._path(sequence)
        count, offset, size = 0, start, path.stat().st_size
        with path.open("rb") as f:
            f.seek(offset)
            while offset + _HEADER.size <= size:
                length = _HEADER.unpack(f.read(_HEADER.size))[0]
                if offset + _HEADER.size + length > size:
                    break
                f.seek(length, os.SEEK_CUR)
                offset += _HEADER.size + length
                count += 1
        if offset < size:
            log.warning("spool segment %s: cutting a torn record at byte %d (left by a crash)", path.name, offset)
            with path.open("r+b") as f:
                f.truncate(offset)
        return count

    # --- writing --------------------------------------------------------------------------------

    def has_room(self, size: int) -> bool:
        return self._used + size <= self.max_bytes

    def append(self, item: Item) -> bool:
        """Add at the tail; False (nothing written) when the cap would be exceeded."""
        if not self.has_room(item.size):
            return False
        if self._writer is None or self._writer.tell() >= self.segment_bytes:
            self._open_tail()
        assert self._writer is not None
        self._writer.write(_HEADER.pack(len(item.payload), item.signal, item.count, zlib.crc32(item.payload)))
        self._writer.write(item.payload)
        self._writer.flush()  # in the page cache: survives a killed agent
        self._used += item.size
        self._count += 1
        return True

    def _open_tail(self) -> None:
        if self._writer is not None:
            self._writer.close()
        sequence = self._segments[-1] + 1 if self._segments else _FIRST_SEQUENCE
        self._segments.append(sequence)
        self._writer = self._path(sequence).open("ab")

    def prepend(self, items: list[Item]) -> list[Item]:
        """Put ``items`` (older than everything spooled) at the head, in order; return those that did not fit."""
        fitting: list[Item] = []
        size = 0
        for item in items:
            if not self.has_room(size + item.size):
                break
            fitting.append(item)
            size += item.size
        if not fitting:
            return items
        sequence = (self._segments[0] - 1) if self._segments else _FIRST_SEQUENCE
        with self._path(sequence).open("wb") as f:
            for item in fitting:
                f.write(_HEADER.pack(len(item.payload), item.signal, item.count, zlib.crc32(item.payload)))
                f.write(item.payload)
            f.flush()
            os.fsync(f.fileno())
        old_head, old_offset = (self._segments[0], self._read_offset) if self._segments else (None, 0)
        self._segments.appendleft(sequence)
        self._close_reader()
        self._read_offset = 0
        # The cursor moves to the new head before anything else changes: a crash from here on at worst
        # re-sends the already forwarded part of the old head (the collector absorbs duplicates).
        self._write_cursor()
        if old_head is not None and old_offset:
            self._drop_forwarded_part(old_head, old_offset)
        self._used += size
        self._count += len(fitting)
        return items[len(fitting):]

    def _drop_forwarded_part(self, sequence: int, offset: int) -> None:
        """Rewrite a segment without its first ``offset`` bytes (already forwarded), atomically."""
        path = self._path(sequence)
        if self._writer is not None and sequence == self._segments[-1]:
            self._writer.close()
            self._writer = None
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(path.read_bytes()[offset:])
        os.replace(tmp, path)

    # --- reading --------------------------------------------------------------------------------

    def peek(self) -> Item | None:
        """The oldest unsent item, or None."""
        while self._peeked is None:
            if not self._segments:
                return None
            sequence = self._segments[0]
            if self._reader is None:
                self._reader = self._path(sequence).open("rb")
            self._reader.seek(self._read_offset)
            header = self._reader.read(_HEADER.size)
            if len(header) < _HEADER.size:
                if sequence == self._segments[-1]:
                    return None  # the tail segment: nothing more written yet
                self._drop_head()
                continue
            length, signal, count, crc = _HEADER.unpack(header)
            payload = self._reader.read(length)
            end = self._read_offset + _HEADER.size + length
            if len(payload) < length:
                return None
            if zlib.crc32(payload) != crc or signal not in (1, 2):
                self.corrupt_records += 1
                log.error("spool segment %s: record at byte %d fails its checksum; skipped",
                          self._path(sequence).name, self._read_offset)
                self._advance(end, _HEADER.size + length)
                continue
            self._peeked = (Item(Signal(signal), payload, count), end)
        return self._peeked[0]

    def pop(self) -> None:
        """Mark the item returned by ``peek`` as forwarded."""
        if self._peeked is None:
            raise RuntimeError("pop() without peek()")
        item, end = self._peeked
        self._peeked = None
        self._advance(end, item.size)

    def _advance(self, end: int, size: int) -> None:
        self._read_offset = end
        self._used -= size
        self._count -= 1
        self._write_cursor()

    def _drop_head(self) -> None:
        self._close_reader()
        self._path(self._segments.popleft()).unlink(missing_ok=True)
        self._read_offset = 0
        self._write_cursor()

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._peeked = None

    def _write_cursor(self) -> None:
        head = self._segments[0] if self._segments else -1
        tmp = self.directory / f"{_CURSOR}.tmp"
        tmp.write_text(f"{head} {self._read_offset}\n")
        os.replace(tmp, self.directory / _CURSOR)

    def close(self) -> None:
        """Flush to stable storage and close the files."""
        if self._writer is not None:
            self._writer.flush()
            os.fsync(self._writer.fileno())
            self._writer.close()
            self._writer = None
        self._close_reader()
