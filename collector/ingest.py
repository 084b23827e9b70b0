"""What both OTLP receivers share: validation outcome -> queue -> wait for commit.

Receivers only translate between their protocol and these outcomes:
``Accepted`` (maybe with rejected records), ``InvalidPayload``, ``Overloaded``
or ``Unavailable``.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from collector.ingest_queue import IngestQueue, QueueFull
from collector.pipeline import StorageUnavailable
from collector.telemetry import CollectorTelemetry
from spikehound.otlp import Decoded


@dataclass(slots=True, frozen=True)
class Accepted:
    rejected: int
    message: str


class InvalidPayload(Exception):
    """Nothing in the request can be stored; not worth retrying."""


class Overloaded(Exception):
    """The queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    """Storage failed; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def bearer_ok(header: str | None, token: str) -> bool:
    """True when no token is configured or the Authorization header carries it."""
    if not token:
        return True
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


class Ingest:
    def __init__(self, queue: IngestQueue, telemetry: CollectorTelemetry, retry_after: int) -> None:
        self.queue = queue
        self.telemetry = telemetry
        self.retry_after = retry_after

    def check_room(self, signal: str, items: int) -> None:
        """Raise Overloaded before the costly decoding when the queue is already full.

        Under overload, decoding requests only to refuse them would starve the writer
        of the CPU it needs to drain the queue.
        """
        if self.queue.items >= self.queue.capacity:
            self.telemetry.dropped.labels(signal, "queue_full").inc(items)
            raise Overloaded(f"ingest queue full ({self.queue.items} of {self.queue.capacity} items waiting)",
                             self.retry_after)

    async def submit(self, decoded: Decoded, signal: str, protocol: str) -> Accepted:
        """Queue the valid records and return once they are committed."""
        t = self.telemetry
        total = decoded.accepted + decoded.rejected
        t.received.labels(signal, protocol).inc(total)
        if decoded.rejected:
            t.rejected.labels(signal, "invalid").inc(decoded.rejected)
        if not decoded.accepted:
            if decoded.rejected:
                raise InvalidPayload(decoded.error_message)
            return Accepted(0, "")
        try:
            submission = self.queue.offer(decoded.spans, decoded.points, decoded.payload)
        except QueueFull as exc:
            t.dropped.labels(signal, "queue_full").inc(decoded.accepted)
            raise Overloaded(str(exc), self.retry_after) from None
        t.queue_items.set(self.queue.items)
        try:
            # Shielded: a sender that hangs up must not cancel the commit others share.
            await asyncio.shield(submission.committed)
        except StorageUnavailable as exc:
            raise Unavailable(str(exc), max(self.retry_after, 1)) from None
        return Accepted(decoded.rejected, decoded.error_message)
