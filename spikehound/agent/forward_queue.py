"""The agent's forward queue: memory first, then the disk spool, always first in, first out.

New requests go to memory while there is room and nothing is spooled; once
memory is full (the collector is away or pushing back) they go to the spool,
and keep going there until it is drained, so replay order is arrival order.
When the spool is full too, ``put`` returns False and the receivers push back
on their senders; when the disk refuses a write, ``put`` raises
``SpoolWriteError`` and they ask the sender to retry. On shutdown the unsent
memory items are written to the head of the spool, ahead of what was spooled
later.

``max_request_bytes`` is the largest request the collector takes: the
receivers split anything larger before it is queued, and the forwarder lowers
it when the collector refuses a request as too large.

>>> import tempfile
>>> from pathlib import Path
>>> from spikehound.agent.spool import DiskSpool, Item, Signal
>>> q = ForwardQueue(memory_bytes=100, spool=DiskSpool(Path(tempfile.mkdtemp()), max_bytes=1000))
>>> [q.put(Item(Signal.TRACES, bytes(60), 1)) for _ in range(3)]
[True, True, True]
>>> q.memory_items, len(q.spool)
(1, 2)
>>> q.close()
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from spikehound.agent.spool import DiskSpool, Item, Signal
from spikehound.config import CollectorConfig

# The collector's own default collector.max_request_bytes: what the agent assumes until the collector says otherwise.
COLLECTOR_MAX_REQUEST_BYTES = CollectorConfig().max_request_bytes


class Sink(Protocol):
    """Where the receivers, the profiler and the samplers queue requests: a ForwardQueue, or the Dispatcher."""

    @property
    def max_request_bytes(self) -> int: ...

    def put_all(self, items: list[Item]) -> bool: ...


class ForwardQueue:
    """Memory deque in front of a DiskSpool; use from the event loop only."""

    def __init__(self, memory_bytes: int, spool: DiskSpool) -> None:
        self.memory_bytes = memory_bytes
        self.spool = spool
        self._memory: deque[Item] = deque()
        self._memory_used = 0
        self._ready = asyncio.Event() if _has_loop() else None
        self._arrival: asyncio.Future[None] | None = None  # resolved by the next put
        self.spilled_items = 0  # requests that went to disk
        self.max_request_bytes = COLLECTOR_MAX_REQUEST_BYTES  # largest request the collector accepts

    @property
    def memory_items(self) -> int:
        return len(self._memory)

    @property
    def memory_used(self) -> int:
        return self._memory_used

    def __len__(self) -> int:
        return len(self._memory) + len(self.spool)

    def has_room(self, size: int) -> bool:
        """Whether ``put_all`` would take ``size`` bytes now (in memory or on disk)."""
        return (not len(self.spool) and self._memory_used + size <= self.memory_bytes) or self.spool.has_room(size)

    def put(self, item: Item) -> bool:
        """Queue ``item``; False when neither memory nor the spool has room (push back).

        Raises SpoolWriteError when it had to go to disk and the disk refused it.
        """
        return self.put_all([item])

    def put_all(self, items: list[Item]) -> bool:
        """Queue ``items`` (the pieces of one request), all or none, as ``put``."""
        size = sum(item.size for item in items)
        if not len(self.spool) and self._memory_used + size <= self.memory_bytes:
            self._memory.extend(items)
            self._memory_used += size
        elif self.spool.extend(items):
            self.spilled_items += len(items)
        else:
            return False
        if self._ready is not None:
            self._ready.set()
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        return True

    def peek(self) -> Item | None:
        return self._memory[0] if self._memory else self.spool.peek()

    def peek_batches(self, max_bytes: int) -> list[list[Item]]:
        """One batch per signal that can leave now, to be sent side by side.

        From memory: each signal's oldest items (up to ``max_bytes`` each), in the order of their heads.
        Memory items are always older than spooled ones, so sending them first keeps each signal in order;
        OTLP requests of one signal merge by concatenating their encodings, so a batch is one request.
        Otherwise the spool's head alone, since spooled records go one by one in arrival order.
        """
        if not self._memory:
            head = self.spool.peek()
            return [[head]] if head is not None else []
        batches: dict[Signal, list[Item]] = {}
        sizes: dict[Signal, int] = {}
        full: set[Signal] = set()
        for item in self._memory:
            signal = item.signal
            if signal in full:
                continue
            batch = batches.setdefault(signal, [])
            size = sizes.get(signal, 0)
            if batch and size + item.size > max_bytes:
                full.add(signal)  # later items of this signal wait: they must not overtake this one
                continue
            batch.append(item)
            sizes[signal] = size + item.size
        return list(batches.values())

    def pop(self) -> None:
        """Remove the item ``peek`` returned, once the collector has acknowledged it."""
        if self._memory:
            self._memory_used -= self._memory.popleft().size
        else:
            self.spool.pop()

    def pop_batch(self, batch: list[Item]) -> None:
        """Remove one batch ``peek_batches`` returned, once the collector has acknowledged them."""
        sent = {id(item) for item in batch}
        kept = deque(item for item in self._memory if id(item) not in sent)
        if len(kept) == len(self._memory):  # not from memory: it was the spool's head
            self.spool.pop()
            return
        self._memory = kept
        self._memory_used -= sum(item.size for item in batch)

    async def wait(self) -> None:
        """Return when there is something to forward."""
        if self._ready is None:
            self._ready = asyncio.Event()
        while self.peek() is None:
            self._ready.clear()
            await self._ready.wait()

    async def arrival(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the next ``put``; True when one came."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
        done, _ = await asyncio.wait([self._arrival], timeout=max(timeout, 0.0))
        return bool(done)

    def spill_memory(self) -> int:
        """Move unsent memory items to the head of the spool (at shutdown); return how many did not fit."""
        left = self.spool.prepend(list(self._memory))
        self.spilled_items += len(self._memory) - len(left)
        self._memory = deque(left)
        self._memory_used = sum(i.size for i in left)
        return len(left)

    def close(self) -> None:
        self.spool.close()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True

