"""What both OTLP receivers share: validation outcome -> queue -> wait for commit.

Receivers only translate between their protocol and these outcomes:
``Accepted`` (maybe with rejected records), ``InvalidPayload``, ``Overloaded``
or ``Unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Self

from spikehound.collector.ingest_queue import ByteBudget, IngestQueue
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.storage_unavailable import StorageUnavailable
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.config import CollectorConfig
from spikehound.export_outcome import Accepted, QueueFull
from spikehound.otlp import Decoded, Limits
from spikehound.text import printable
from spikehound.units import NS

log = logging.getLogger("spikehound.collector.ingest")
MAX_WRONG_CLOCK_SENDERS = 100  # senders counted by name; the rest together (a hostile peer may invent names)
WRONG_CLOCK_LOG_SECONDS = 600.0
_UNITS = {"metrics": "metric samples", "profiles": "profile samples"}  # what a signal's records are, in the logs


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


def limits_of(c: CollectorConfig) -> Limits:
    """The decoding limits that ``c`` configures."""
    return Limits(name=c.max_name_length, value=c.max_attribute_value_length, attributes=c.max_attributes_per_span)


class HeldUntilDone:
    """A request's hold on something shared, given back when the context is left, or, when its data is still
    on its way to storage then (the sender hung up), once ``until``'s future is done. Subclasses say in
    ``_release`` what they give back; it is called once."""

    _until: asyncio.Future[Any] | None = None

    def until(self, done: asyncio.Future[Any]) -> None:
        self._until = done

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._until is not None and not self._until.done():
            self._until.add_done_callback(self._release)
        else:
            self._release()

    def _release(self, _: Any = None) -> None:
        raise NotImplementedError


class Admission(HeldUntilDone):
    """The bytes one export request holds in the shared budget, from before it is decoded until its commit answer.

    A context manager: leaving it gives the bytes back, or, when the request's data is still queued (its
    sender hung up), once that data is committed, since until then it is still in memory.
    """

    def __init__(self, ingest: Ingest, protocol: str) -> None:
        self._ingest = ingest
        self._protocol = protocol
        self.held = 0

    def need(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all (never fewer than already held); raise Overloaded when they do not fit now."""
        extra = nbytes - self.held
        if extra <= 0:
            return
        ingest = self._ingest
        budget = ingest.bytes_in_flight
        if not budget.take(extra, self.held):
            ingest.telemetry.rejected_requests.labels(self._protocol, "bytes_in_flight").inc()
            raise Overloaded(f"too many request bytes in flight ({budget.used} of {budget.capacity}, this request "
                             f"{nbytes})", ingest.retry_after)
        self.held += extra
        ingest.telemetry.bytes_in_flight.set(budget.used)

    def _release(self, _: Any = None) -> None:
        if self.held:
            self._ingest.bytes_in_flight.give_back(self.held)
            self.held = 0
            self._ingest.telemetry.bytes_in_flight.set(self._ingest.bytes_in_flight.used)


class Ingest:
    """The receivers' shared admission (bytes in flight, queue room), decoding limits and commit wait."""

    def __init__(self, queue: IngestQueue, telemetry: CollectorTelemetry, retry_after: int, *,
                 limits: Limits | None = None, max_bytes_in_flight: int | None = None,
                 max_clock_skew_ns: int = 300 * NS, health: StorageHealth | None = None) -> None:
        self.queue = queue
        self.telemetry = telemetry
        self.retry_after = retry_after
        self.health = health or StorageHealth(telemetry)  # the pipeline's: whether storage takes writes now
        self.limits = limits or Limits()  # what the receivers cut records to while decoding
        self.max_clock_skew_ns = max_clock_skew_ns
        self._senders: dict[tuple[str, str], float] = {}  # senders whose clock was wrong -> when last logged
        capacity = max_bytes_in_flight or CollectorConfig().max_bytes_in_flight
        self.bytes_in_flight = ByteBudget(capacity)
        telemetry.bytes_in_flight_capacity.set(capacity)

    @classmethod
    def configured(cls, queue: IngestQueue, telemetry: CollectorTelemetry, c: CollectorConfig,
                   health: StorageHealth | None = None) -> Ingest:
        """The ingest that the collector section ``c`` configures."""
        return cls(queue, telemetry, c.retry_after_seconds, limits=limits_of(c),
                   max_bytes_in_flight=c.max_bytes_in_flight, max_clock_skew_ns=int(c.max_clock_skew_seconds * NS),
                   health=health)

    def check_storage(self, protocol: str) -> None:
        """Raise Unavailable, before the request is read or decoded, while storage takes no writes.

        Requests that arrive once the pipeline's next attempt is due are let through: their data is that attempt.
        """
        health = self.health
        if health.admit():
            return
        self.telemetry.rejected_requests.labels(protocol, "storage_unavailable").inc()
        raise Unavailable(f"storage unavailable ({health.kind}); retry later", health.retry_after())

    def not_after_ns(self) -> int:
        """The latest event time a record may have now: the collector's clock plus the allowed skew."""
        return time.time_ns() + self.max_clock_skew_ns

    def admission(self, protocol: str) -> Admission:
        """Hold an export request's bytes in the budget both receivers share (``Admission.need``)."""
        return Admission(self, protocol)

    def check_room(self, signal: str, items: int) -> None:
        """Raise Overloaded before the costly decoding when the queue is already full.

        Under overload, decoding requests only to refuse them would starve the writer
        of the CPU it needs to drain the queue.
        """
        if self.queue.items >= self.queue.capacity:
            self.telemetry.dropped.labels(signal, "queue_full").inc(items)
            raise Overloaded(f"ingest queue full ({self.queue.items} of {self.queue.capacity} items waiting)",
                             self.retry_after)

    async def submit(self, decoded: Decoded, signal: str, protocol: str,
                     admission: Admission | None = None) -> Accepted:
        """Queue the valid records and return once they are committed.

        ``message`` of the answer names the rejected records and, as a warning (OTLP allows one with nothing
        rejected), what was cut to the limits.
        """
        t = self.telemetry
        total = decoded.accepted + decoded.rejected
        t.received.labels(signal, protocol).inc(total)
        if decoded.rejected:
            t.rejected.labels(signal, "invalid").inc(decoded.rejected)
        for kind, count in decoded.truncated.items():
            t.truncated.labels(signal, kind).inc(count)
        for (service, host), count in decoded.future.items():
            self.count_future(signal, service, host or "", count)
        if not decoded.accepted:
            if decoded.rejected:
                raise InvalidPayload(decoded.error_message)
            return Accepted(0, "")
        accepted = decoded.accepted
        try:
            submission = self.queue.offer(decoded.spans, decoded.points, decoded.payload)
        except QueueFull as exc:
            t.dropped.labels(signal, "queue_full").inc(accepted)
            raise Overloaded(str(exc), self.retry_after) from None
        # The queue holds what it needs of them; the receiver's frame must not hold the spans until the commit.
        decoded.spans = []
        if admission is not None:
            admission.until(submission.committed)
        t.queue_items.set(self.queue.items)
        try:
            # Shielded: a sender that hangs up must not cancel the commit others share.
            await asyncio.shield(submission.committed)
        except StorageUnavailable as exc:
            raise Unavailable(str(exc), self.health.retry_after()) from None
        message = "; ".join(m for m in (decoded.error_message, self.truncation_note(decoded.truncated)) if m)
        return Accepted(decoded.rejected, message, accepted)

    def count_future(self, signal: str, service: str, host: str, count: int) -> None:
        """Count a sender's records dated beyond the clock, and say so once in a while, naming the sender."""
        key = (service, host)
        if key not in self._senders and len(self._senders) >= MAX_WRONG_CLOCK_SENDERS:
            key = ("other", "other")
        self.telemetry.future.labels(signal, *key).inc(count)
        now = time.monotonic()
        if now - self._senders.get(key, -math.inf) >= WRONG_CLOCK_LOG_SECONDS:
            self._senders[key] = now
            log.warning("refused %d %s dated more than %.0f s after this collector's clock from service %r on host "
                        "%r: that sender's clock is ahead (collector.max_clock_skew_seconds); said once every "
                        "%.0f minutes per sender", count, _UNITS.get(signal, signal), self.max_clock_skew_ns / NS,
                        printable(service, 200), printable(host, 200), WRONG_CLOCK_LOG_SECONDS / 60)

    def truncation_note(self, truncated: dict[str, int]) -> str:
        """The warning an answer carries when values were cut to the limits ("" when none were)."""
        if not truncated:
            return ""
        lim = self.limits
        counts = ", ".join(f"{count} {kind}" for kind, count in sorted(truncated.items()))
        return (f"cut to the collector's limits ({lim.name}-character names, {lim.value}-character values, "
                f"{lim.attributes} attributes): {counts}")
