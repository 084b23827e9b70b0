"""Protobuf's wire format, walked by hand where encoded OTLP is edited without decoding it.

The agent splices enriched resources into requests (``spikehound/agent/enrich.py``) and
the ingest benchmark patches span times in place (``benchmarks/ingest.py``);
both need only to step over fields, which the protobuf runtime does not offer
publicly.

>>> [tuple(f) for f in fields(bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x68, 0x69]))]
[(1, 0, 0, 1, 3), (2, 2, 3, 5, 7)]
>>> read_varint(encode_varint(300), 0)
(300, 2)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5  # the wire types; 3 and 4 (groups) are not walked


class WireError(ValueError):
    """An encoding this walker does not step over (a group)."""


class Field(NamedTuple):
    number: int
    wire: int
    start: int  # where the field's key begins
    value: int  # where its value begins (after the length, for LEN fields)
    end: int


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def fields(buf: bytes | memoryview, start: int = 0, end: int | None = None) -> Iterator[Field]:
    """The fields of the valid message encoded in ``buf[start:end]``, in order; WireError at a group."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        at = pos
        key, pos = read_varint(buf, pos)
        wire, value = key & 7, pos
        if wire == VARINT:
            _, pos = read_varint(buf, pos)
        elif wire == FIXED64:
            pos += 8
        elif wire == LEN:
            length, value = read_varint(buf, pos)
            pos = value + length
        elif wire == FIXED32:
            pos += 4
        else:
            raise WireError(f"wire type {wire} (a group) at byte {at}")
        yield Field(key >> 3, wire, at, value, pos)
