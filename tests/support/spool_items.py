"""Spool items whose payload says their number, so that the order read back can be checked (also in the child
process of tests/test_spool.py's DISK_FULL script); and what a forward queue holds."""

from __future__ import annotations

from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.spool import Item, Signal


def item(n: int, size: int = 100, signal: Signal = Signal.TRACES) -> Item:
    """Item number ``n``: its payload starts with the number, so the order can be read back."""
    tag = f"item-{n:06d}|".encode()
    return Item(signal, tag + bytes([n % 251]) * (size - len(tag)), n + 1)


def number(it: Item) -> int:
    """The number ``item`` gave it."""
    return int(it.payload.split(b"|", 1)[0].removeprefix(b"item-"))


def queued(q: ForwardQueue) -> list[Item]:
    """Everything ``q`` holds, oldest first, taken out of it (memory, then the spool)."""
    out = []
    while (head := q.peek()) is not None:
        out.append(head)
        q.pop()
    return out
