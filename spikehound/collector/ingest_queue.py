"""The ingest backpressure: the bounded queue between the receivers and the storage writer, and the byte budget.

Capacity is counted in spans plus points and covers everything not yet
committed, including the batch being written, so memory stays bounded however
fast senders push. A full queue raises ``QueueFull`` at once: receivers turn
it into ``RESOURCE_EXHAUSTED`` / 429 so the sender retries later instead of
the collector dropping data silently.

Items do not bound memory when the items are large, and a request takes memory
before it is decoded into items: ``ByteBudget`` counts the request bytes in
flight, from before decoding until the commit answer, over both receivers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from spikehound.export_outcome import QueueFull
from spikehound.model import MetricPoint, Span
from spikehound.storage.writer import SpanBlock


@dataclass(slots=True)
class Submission:
    """One accepted request, waiting for its commit.

    Its spans wait as ``block`` (their encoding and what the writer needs of them); ``spans`` keeps the decoded
    spans only where this process reads them after the commit (``IngestQueue.keep_spans``), else it is empty.
    """

    block: SpanBlock | None  # None for metrics
    spans: list[Span]
    points: list[MetricPoint]
    committed: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __len__(self) -> int:
        return self.span_count + len(self.points)

    @property
    def span_count(self) -> int:
        return self.block.span_count if self.block is not None else 0


class IngestQueue:
    """FIFO of submissions with a capacity in items; use from the event loop only.

    ``keep_spans``: whether submissions keep their decoded spans until the commit (a detector or commit hook in
    this process reads them); when the detection process decodes the stored blocks itself, they are dropped at
    once (see :class:`~spikehound.storage.writer.SpanBlock` for why).
    """

    def __init__(self, capacity: int, *, keep_spans: bool = True) -> None:
        self.capacity = capacity
        self.keep_spans = keep_spans
        self.items = 0  # queued plus being written
        self._queue: deque[Submission] = deque()
        self._ready = asyncio.Event()

    def offer(self, spans: list[Span], points: list[MetricPoint], payload: bytes = b"") -> Submission:
        """Queue a request or raise QueueFull; await ``.committed`` for the commit.

        ``payload`` is the encoded request holding exactly ``spans`` (encoded here when empty).
        """
        size = len(spans) + len(points)
        # A request larger than the whole capacity still gets in when the queue is empty.
        if self.items and self.items + size > self.capacity:
            raise QueueFull(f"ingest queue full ({self.items} of {self.capacity} items waiting)")
        block = SpanBlock.of(payload, spans) if spans else None
        sub = Submission(block, spans if self.keep_spans else [], points)
        self._queue.append(sub)
        self.items += size
        self._ready.set()
        return sub

    async def take(self, max_items: int, timeout: float) -> list[Submission]:
        """Up to ``max_items`` (at least one submission); empty after ``timeout`` s without any."""
        if not self._queue:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return []
        taken = [self._queue.popleft()]
        size = len(taken[0])
        while self._queue and size + len(self._queue[0]) <= max_items:
            sub = self._queue.popleft()
            size += len(sub)
            taken.append(sub)
        return taken

    def release(self, submissions: list[Submission]) -> None:
        """Give back the room of written (or failed) submissions."""
        self.items -= sum(len(s) for s in submissions)

    def pending(self) -> int:
        return len(self._queue)


class ByteBudget:
    """Request bytes in flight against a capacity; use from the event loop only.

    >>> budget = ByteBudget(100)
    >>> budget.take(60), budget.take(60), budget.used
    (True, False, 60)
    >>> budget.give_back(60); budget.take(500)  # alone, a request larger than the whole budget still gets in
    True
    >>> budget.take(100, held=500)  # ... and may grow (a gzip body inflating) while it is alone
    True
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def take(self, nbytes: int, held: int = 0) -> bool:
        """Hold ``nbytes`` more for a taker already holding ``held``, or return False (holding nothing more)
        when they do not fit now."""
        # As in the queue: one request larger than the whole capacity still gets in when nothing else is held.
        if self.used > held and self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.used -= nbytes
