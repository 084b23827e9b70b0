"""The disk spool: a size-capped FIFO of export requests in append-only segment files.

Each record is a header (a magic marker, payload length, signal, item count,
the payload's CRC-32, then a CRC-32 of the header itself) followed by the
serialized OTLP request. The header's own checksum means a damaged length is
never trusted: the reader resynchronises at the next magic marker whose
header checks out, skipping (and counting) only the damaged stretch. A
record whose payload fails its checksum is skipped on its own. A small cursor
file remembers how far the oldest segment has been forwarded; fully forwarded
segments are deleted. After a crash a torn trailing record is cut off.
Replay is at-least-once: a record sent just before a crash may be sent again,
which the collector absorbs (spans and samples are stored idempotently).

An append that the disk refuses (full, over the file size limit) is rolled
back to the last whole record and raises ``SpoolWriteError``, so the
receivers can tell the sender to retry; the spool stays consistent.

Segments written before this format (``*.seg``, 13-byte headers without a
marker) are still read, in order, before newer ones; they cannot be
resynchronised, so damage in one of them loses the rest of that segment
(counted). New records always go to ``*.seg2`` segments. An agent of an
older version ignores ``*.seg2`` files, so a downgrade leaves them on disk
unread rather than misreading them. Profiles (signal 3) came after the
record format: an agent from before them skips such records as damaged
(counted) and forwards the rest.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("spikehound.agent.spool")

MAGIC = b"\xd5SHR"  # starts every record: what resynchronisation looks for
_HEAD = struct.Struct("<4sIBII")  # magic, payload length, signal, item count, crc32 of the payload
_HEAD_CRC = struct.Struct("<I")  # crc32 of the fields above
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
_LEGACY_HEAD = struct.Struct("<IBII")  # the first format: payload length, signal, item count, crc32 of the payload
SUFFIX = ".seg2"
LEGACY_SUFFIX = ".seg"
_CURSOR = "cursor"
_FIRST_SEQUENCE = 1_000_000_000  # room below it for segments prepended at shutdown
_RESYNC_CHUNK = 1 << 20


class Signal(enum.IntEnum):
    # The values are on disk: append new ones, never renumber.
    TRACES = 1
    METRICS = 2
    PROFILES = 3


_SIGNALS = frozenset(Signal)


@dataclass(frozen=True, slots=True)
class Item:
    """One serialized export request waiting to be forwarded."""

    signal: Signal
    payload: bytes
    count: int  # spans, data points or profile stacks, for the counters

    @property
    def size(self) -> int:
        return HEADER_BYTES + len(self.payload)


class SpoolWriteError(Exception):
    """The disk refused an append (full, file too large, I/O error); nothing of it was kept."""


def encode_record(item: Item) -> bytes:
    """``item`` as one spool record: header, header checksum, payload."""
    head = _HEAD.pack(MAGIC, len(item.payload), item.signal, item.count, zlib.crc32(item.payload))
    return b"".join((head, _HEAD_CRC.pack(zlib.crc32(head)), item.payload))


def _parse_header(raw: bytes) -> tuple[int, int, int, int] | None:
    """(payload length, signal, item count, payload crc) of a sound header; None for anything else."""
    if len(raw) < HEADER_BYTES or raw[:4] != MAGIC:
        return None
    if zlib.crc32(raw[:_HEAD.size]) != _HEAD_CRC.unpack_from(raw, _HEAD.size)[0]:
        return None
    _, length, signal, count, crc = _HEAD.unpack_from(raw)
    return (length, signal, count, crc) if signal in _SIGNALS else None


class SpoolBudget:
    """One cap on the unsent bytes of several spools (the agent's per-collector spools share agent.spool_max_bytes)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.spools: list[DiskSpool] = []

    @property
    def used(self) -> int:
        return sum(spool.reserved_bytes for spool in self.spools)


class DiskSpool:
    """FIFO of Items on disk, at most ``max_bytes`` of unsent records (and within ``budget``); not thread-safe."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = 16 << 20,
                 budget: SpoolBudget | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.budget = budget
        self.segment_bytes = segment_bytes
        self.corrupt_records = 0  # damaged records or stretches skipped
        self.skipped_bytes = 0  # bytes of them
        self.write_errors = 0  # appends the disk refused (rolled back)
        directory.mkdir(parents=True, exist_ok=True)
        self._legacy: set[int] = set()  # segments in the first format
        self._segments: deque[int] = deque(sorted(self._find_segments()))
        self._counts: dict[int, int] = {}  # records not yet forwarded, per segment
        self._read_offset = 0
        self._writer: BinaryIO | None = None
        self._tail_size = 0  # bytes in the segment the writer appends to
        self._reader: BinaryIO | None = None
        self._peeked: tuple[Item, int] | None = None  # item and the offset after it
        self._count = 0
        self._write_failing = False
        self._cursor_failing = False
        self._recover()
        if budget is not None:
            budget.spools.append(self)

    def _find_segments(self) -> set[int]:
        found: dict[int, Path] = {}
        for path in sorted(self.directory.iterdir(), key=lambda p: p.suffix != SUFFIX):  # the current format first
            if path.suffix not in (SUFFIX, LEGACY_SUFFIX) or not path.stem.isdigit():
                continue
            sequence = int(path.stem)
            if sequence in found:  # only after a downgrade and upgrade again: never guess their order
                log.error("spool: %s and %s hold the same place in the queue; %s is left unread, move it aside "
                          "and forward it with a separate agent", found[sequence].name, path.name, path.name)
                continue
            found[sequence] = path
            if path.suffix == LEGACY_SUFFIX:
                self._legacy.add(sequence)
        if self._legacy:
            log.info("spool: reading %d segments written in the previous format first", len(self._legacy))
        return set(found)

    # --- state ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    @property
    def bytes_used(self) -> int:
        return sum(self._size(s) for s in self._segments) - self._read_offset

    def _size(self, sequence: int) -> int:
        try:
            return self._path(sequence).stat().st_size
        except OSError:
            return 0

    def _path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:012d}{LEGACY_SUFFIX if sequence in self._legacy else SUFFIX}"

    def _header_bytes(self, sequence: int) -> int:
        return _LEGACY_HEAD.size if sequence in self._legacy else HEADER_BYTES

    def _recover(self) -> None:
        cursor = self.directory / _CURSOR
        if cursor.exists():
            try:
                sequence, offset = (int(x) for x in cursor.read_text().split())
            except ValueError:
                sequence, offset = -1, 0
            while self._segments and self._segments[0] < sequence:
                self._unlink(self._segments.popleft())
            if self._segments and self._segments[0] == sequence:
                self._read_offset = max(0, min(offset, self._size(sequence)))
        for sequence in list(self._segments):
            start = self._read_offset if sequence == self._segments[0] else 0
            self._counts[sequence] = self._scan(sequence, start, cut=True)
        self._count = sum(self._counts.values())
        self._used = self.bytes_used

    def _scan(self, sequence: int, start: int, cut: bool = False) -> int:
        """Count whole records from ``start``; with ``cut``, cut off a torn tail left by a crash.

        A damaged stretch in the middle is stepped over here and skipped (and counted) by the reader.
        """
        path, header = self._path(sequence), self._header_bytes(sequence)
        legacy = sequence in self._legacy
        count, offset, size, damaged = 0, start, self._size(sequence), False
        with path.open("rb") as f:
            while offset + header <= size:
                f.seek(offset)
                raw = f.read(header)
                if legacy:
                    length = _LEGACY_HEAD.unpack(raw)[0]
                else:
                    parsed = _parse_header(raw)
                    if parsed is None:
                        after = _resync(f, offset + 1, size)
                        if after is None:
                            damaged = True
                            break
                        offset = after
                        continue
                    length = parsed[0]
                if offset + header + length > size:
                    break
                offset += header + length
                count += 1
        if cut and offset < size:
            if damaged:
                self.corrupt_records += 1
                self.skipped_bytes += size - offset
                log.error("spool segment %s: %d damaged bytes at byte %d with no whole record after them; cut off",
                          path.name, size - offset, offset)
            else:
                log.warning("spool segment %s: cutting a torn record at byte %d (left by a crash)", path.name, offset)
            with path.open("r+b") as f:
                f.truncate(offset)
        return count

    # --- writing --------------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """Unsent bytes as counted against the cap (no file system calls, unlike ``bytes_used``)."""
        return self._used

    def has_room(self, size: int) -> bool:
        if self.budget is not None and self.budget.used + size > self.budget.max_bytes:
            return False
        return self._used + size <= self.max_bytes

    def append(self, item: Item) -> bool:
        """Add at the tail; False (nothing written) when the cap would be exceeded; SpoolWriteError as ``extend``."""
        return self.extend([item])

    def extend(self, items: Sequence[Item]) -> bool:
        """Add ``items`` at the tail, all or none; False (nothing written) when the cap would be exceeded.

        Raises SpoolWriteError when the disk refuses the write; what was written of it is cut off again.
        """
        size = sum(item.size for item in items)
        if not self.has_room(size):
            return False
        if not items:
            return True
        try:
            if self._writer is None or self._tail_size >= self.segment_bytes:
                self._open_tail()
        except OSError as exc:
            self._write_failed(exc, "opening a new segment")
        assert self._writer is not None
        data = memoryview(b"".join(encode_record(item) for item in items))
        start = self._tail_size
        try:
            written = 0
            while written < len(data):  # unbuffered: each write reaches the kernel, a killed agent loses nothing
                written += self._writer.write(data[written:]) or 0
        except OSError as exc:
            self._roll_back(start)
            self._write_failed(exc, f"appending {len(items)} records")
        if self._write_failing:
            self._write_failing = False
            log.info("spool: writing again after %d refused appends", self.write_errors)
        tail = self._segments[-1]
        self._tail_size += len(data)
        self._used += size
        self._count += len(items)
        self._counts[tail] = self._counts.get(tail, 0) + len(items)
        return True

    def _write_failed(self, exc: OSError, what: str) -> None:
        self.write_errors += 1
        if not self._write_failing:  # once per episode: a full disk refuses every append until it is not
            self._write_failing = True
            log.error("spool: the disk refused %s (%s); local senders are told to retry later", what, exc)
        raise SpoolWriteError(f"agent disk spool cannot be written ({exc.strerror or exc}); retry later") from exc

    def _roll_back(self, offset: int) -> None:
        """Cut the tail segment back to ``offset``, the end of its last whole record."""
        assert self._writer is not None
        try:
            os.ftruncate(self._writer.fileno(), offset)
        except OSError as exc:
            # The partial record stays; new records go to a fresh segment and the reader skips it, counted.
            log.error("spool: cannot cut a partly written record off %s (%s)", self._path(self._segments[-1]).name,
                      exc)
            self._writer.close()
            self._writer = None

    def _open_tail(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        sequence = self._segments[-1] + 1 if self._segments else _FIRST_SEQUENCE
        self._writer = self._path(sequence).open("ab", buffering=0)  # before it is listed: it may fail (ENOSPC)
        self._segments.append(sequence)
        self._counts[sequence] = 0
        self._tail_size = 0

    def prepend(self, items: list[Item]) -> list[Item]:
        """Put ``items`` (older than everything spooled) at the head, in order; return those that were not kept."""
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
        path = self.directory / f"{sequence:012d}{SUFFIX}"
        try:
            with path.open("wb") as f:
                for item in fitting:
                    f.write(encode_record(item))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error("spool: cannot write %d queued requests to %s (%s)", len(fitting), path.name, exc)
            path.unlink(missing_ok=True)
            return items
        old_head, old_offset = (self._segments[0], self._read_offset) if self._segments else (None, 0)
        self._segments.appendleft(sequence)
        self._counts[sequence] = len(fitting)
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
        try:
            tmp.write_bytes(path.read_bytes()[offset:])
            os.replace(tmp, path)
        except OSError as exc:  # the forwarded part stays and is sent again: duplicates, not loss
            log.warning("spool: cannot trim the forwarded part of %s (%s); it will be sent again", path.name, exc)
            tmp.unlink(missing_ok=True)

    # --- reading --------------------------------------------------------------------------------

    def peek(self) -> Item | None:
        """The oldest unsent item, or None; damaged records on the way are skipped and counted."""
        while self._peeked is None:
            if not self._segments:
                return None
            sequence = self._segments[0]
            try:
                self._peeked = self._read_head(sequence)
            except OSError as exc:
                self._unreadable(sequence, exc)
                continue
            if self._peeked is None:  # this segment is read to its end
                if sequence == self._segments[-1]:
                    return None  # the tail segment: nothing more written yet
                self._drop_head()
        return self._peeked[0]

    def _read_head(self, sequence: int) -> tuple[Item, int] | None:
        """The next sound record of the head segment and the offset after it; None at its end."""
        if self._reader is None:
            self._reader = self._path(sequence).open("rb")
        f, legacy, header = self._reader, sequence in self._legacy, self._header_bytes(sequence)
        size = os.fstat(f.fileno()).st_size
        while (offset := self._read_offset) < size:
            if offset + header > size:
                self._skip(size, "a partial record header")
                return None
            f.seek(offset)
            raw = f.read(header)
            parsed = _LEGACY_HEAD.unpack(raw) if legacy else _parse_header(raw)
            if parsed is None:
                after = _resync(f, offset + 1, size)
                self._skip(size if after is None else after, "a damaged record header")
                continue
            length, signal, count, crc = parsed
            end = offset + header + length
            if end > size:
                self._skip(size, f"a record of {length} bytes that runs past the end of the segment")
                return None
            payload = f.read(length)
            if zlib.crc32(payload) != crc or signal not in _SIGNALS:
                self._skip(end, "a record that fails its checksum")
                continue
            return Item(Signal(signal), payload, count), end
        return None

    def _skip(self, end: int, why: str) -> None:
        """Step the read offset over damaged bytes up to ``end``; count them, and recount what is left."""
        sequence, offset = self._segments[0], self._read_offset
        self.corrupt_records += 1
        self.skipped_bytes += end - offset
        log.error("spool segment %s: skipped %d bytes at byte %d: %s", self._path(sequence).name, end - offset,
                  offset, why)
        self._read_offset = end
        self._write_cursor()
        counted = self._scan(sequence, end)
        self._count += counted - self._counts.get(sequence, 0)
        self._counts[sequence] = counted
        self._used = self.bytes_used

    def _unreadable(self, sequence: int, exc: OSError) -> None:
        """The head segment cannot be read at all: give up on what is left of it, counted, rather than stall."""
        lost = self._counts.get(sequence, 0)
        self.corrupt_records += max(lost, 1)
        self.skipped_bytes += max(self._size(sequence) - self._read_offset, 0)
        log.error("spool segment %s cannot be read (%s); %d requests in it are lost", self._path(sequence).name,
                  exc, lost)
        if sequence == self._segments[-1] and self._writer is not None:
            self._writer.close()  # new records go to a fresh segment
            self._writer = None
        self._drop_head()

    def pop(self) -> None:
        """Mark the item returned by ``peek`` as forwarded."""
        if self._peeked is None:
            raise RuntimeError("pop() without peek()")
        _, end = self._peeked
        self._peeked = None
        head = self._segments[0]
        self._used -= end - self._read_offset
        self._read_offset = end
        self._count -= 1
        self._counts[head] -= 1
        if head == self._segments[-1] and self._writer is not None and end == self._tail_size:
            self._empty_tail()
        self._write_cursor()

    def _empty_tail(self) -> None:
        """Everything written was forwarded: cut the segment being appended to back to nothing, so that a
        drained spool holds no disk until the next outage (it kept up to a segment, 16 MiB, for good).

        Cut before the cursor is saved: a crash between the two leaves a cursor past the end of an empty
        file, which reads as nothing to send, never as records to send again.
        """
        assert self._writer is not None
        try:
            os.ftruncate(self._writer.fileno(), 0)
        except OSError as exc:  # the bytes stay; they are forwarded already and rotate away as before
            log.warning("spool: cannot empty forwarded segment %s (%s)", self._path(self._segments[-1]).name, exc)
            return
        self._close_reader()
        self._tail_size = self._read_offset = 0

    def _drop_head(self) -> None:
        self._close_reader()
        sequence = self._segments.popleft()
        self._count -= self._counts.pop(sequence, 0)
        self._unlink(sequence)
        self._legacy.discard(sequence)
        self._read_offset = 0
        self._write_cursor()
        self._used = self.bytes_used

    def _unlink(self, sequence: int) -> None:
        try:
            self._path(sequence).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("spool: cannot delete forwarded segment %s (%s)", self._path(sequence).name, exc)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._peeked = None

    def _write_cursor(self) -> None:
        head = self._segments[0] if self._segments else -1
        tmp = self.directory / f"{_CURSOR}.tmp"
        try:
            tmp.write_text(f"{head} {self._read_offset}\n")
            os.replace(tmp, self.directory / _CURSOR)
        except OSError as exc:
            # Forwarding goes on; after a crash the records since the last cursor are sent again (duplicates).
            if not self._cursor_failing:
                log.warning("spool: cannot save the read cursor (%s); a restart may send some requests again", exc)
            self._cursor_failing = True
            return
        self._cursor_failing = False

    def close(self) -> None:
        """Flush to stable storage and close the files (and leave the shared budget)."""
        if self.budget is not None and self in self.budget.spools:
            self.budget.spools.remove(self)
        if self._writer is not None:
            try:
                os.fsync(self._writer.fileno())
            except OSError as exc:
                log.warning("spool: fsync failed at close (%s)", exc)
            self._writer.close()
            self._writer = None
        self._close_reader()


def _resync(f: BinaryIO, start: int, size: int) -> int | None:
    """The offset of the next sound record header in ``f`` at or after ``start``; None when there is none."""
    position = start
    while position < size:
        f.seek(position)
        buf = f.read(_RESYNC_CHUNK + HEADER_BYTES - 1)  # overlapping: a header across two chunks is found
        at = buf.find(MAGIC)
        while 0 <= at < _RESYNC_CHUNK:
            if _parse_header(buf[at:at + HEADER_BYTES]) is not None:
                return position + at
            at = buf.find(MAGIC, at + 1)
        position += _RESYNC_CHUNK
    return None
