"""What both OTLP receivers do with a profiles export: admit it, decode it, commit it, answer.

Profiles are low volume (one ``Profile`` per process and 10 s window, a few hundred stacks), so they do not
go through the span and point ingest queue and its batches: each request is written in its own transaction
on the collector's writer thread (``IngestPipeline.write_aside``, which reports the outcome to
``StorageHealth`` as the pipeline's commits do) and answered once that transaction has committed. Requests
in flight are bounded (``MAX_REQUESTS_IN_FLIGHT``, besides the byte budget both receivers share): past it the
sender is told to retry later, as a full ingest queue does. Parsing and decoding a request run on a worker
thread (``decode_body``), not on the event loop, so at most ``MAX_REQUESTS_IN_FLIGHT`` of them at once: a large
export must not stall the other receivers and the API; what one request may expand to is bounded while it is
decoded (``decode_profiles``: ``MAX_STACKS_PER_REQUEST`` stacks, ``MAX_FRAME_CHARS_PER_REQUEST`` characters).

>>> ProfileIngest.in_flight_message(8)
'too many profile exports in flight (8); retry later'
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import ExportProfilesServiceRequest

from spikehound.collector.ingest import (
    Admission,
    HeldUntilDone,
    Ingest,
    InvalidPayload,
    Overloaded,
    Unavailable,
)
from spikehound.collector.storage_unavailable import StorageUnavailable
from spikehound.export_outcome import Accepted
from spikehound.model import ProfileStack
from spikehound.otlp_profiles import (
    DecodedProfiles,
    decode_profiles,
    parse_profiles_request,
    stacks_of_samples,
)

SIGNAL = "profiles"
MAX_REQUESTS_IN_FLIGHT = 8  # profile writes queue on the one writer thread, between the span commits

# Runs ``fn(*args)`` in its own transaction on the writer thread; StorageUnavailable when it failed.
WriteAside = Callable[..., Awaitable[Any]]


class InFlight(HeldUntilDone):
    """One profile export's place among those in flight, from before its body is read until its write ends.

    A context manager like ``Admission``: leaving it frees the place, or, when the write is still running
    (the sender hung up), once the write ends.
    """

    def __init__(self, owner: ProfileIngest) -> None:
        self._owner = owner
        self._held = True

    def _release(self, _: Any = None) -> None:
        if self._held:
            self._held = False
            self._owner.in_flight -= 1


class ProfileIngest:
    """The receivers' profiles path: admission, decoding with the collector's limits, the write, the counters.

    ``write_aside`` is the pipeline's (``IngestPipeline.write_aside``); used on the event loop only.
    """

    def __init__(self, ingest: Ingest, write_aside: WriteAside, write: Callable[[Sequence[ProfileStack]], None],
                 *, max_in_flight: int = MAX_REQUESTS_IN_FLIGHT) -> None:
        self.ingest = ingest
        self.write_aside = write_aside
        self.write = write  # Writer.write_profiles: run on the writer thread by write_aside
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    @staticmethod
    def in_flight_message(count: int) -> str:
        return f"too many profile exports in flight ({count}); retry later"

    def admit(self, protocol: str) -> InFlight:
        """A place among the exports in flight; Overloaded (counted) when there is none now."""
        if self.in_flight >= self.max_in_flight:
            self.ingest.telemetry.rejected_requests.labels(protocol, "profiles_in_flight").inc()
            raise Overloaded(self.in_flight_message(self.in_flight), self.ingest.retry_after)
        self.in_flight += 1
        return InFlight(self)

    async def decode_body(self, body: bytes, admission: Admission, in_flight: InFlight, *,
                          json: bool = False) -> DecodedProfiles:
        """Parse and decode a request's body on a worker thread: PayloadError when it is unreadable.

        The request keeps its bytes and its place among those in flight until the decoding ends, even when its
        sender hangs up meanwhile: the places bound the decodings running at once.
        """
        ingest = self.ingest
        not_after = ingest.not_after_ns()
        done = asyncio.get_running_loop().run_in_executor(None, self._decode, body, json, not_after)
        done.add_done_callback(_retrieve)
        admission.until(done)
        in_flight.until(done)
        decoded, future = await asyncio.shield(done)
        for (service, host), count in future.items():
            ingest.count_future(SIGNAL, service, host, count)
        return decoded

    def _decode(self, body: bytes, json: bool, not_after: int) -> tuple[DecodedProfiles, dict[tuple[str, str], int]]:
        """Run on a worker thread: the request's stacks, cut to the collector's limits and checked against
        ``not_after``, and the samples dated after it by sender."""
        return self.decode(parse_profiles_request(body, json=json), not_after)

    def decode(self, request: ExportProfilesServiceRequest,
               not_after: int | None = None) -> tuple[DecodedProfiles, dict[tuple[str, str], int]]:
        """The request's stacks, cut to the collector's limits and checked against its clock, and the samples
        dated after it by (service, host); touches nothing shared, so it may run on any thread."""
        limits = self.ingest.limits
        not_after = self.ingest.not_after_ns() if not_after is None else not_after
        decoded = decode_profiles(request, limits=limits, not_after_ns=not_after)
        return decoded, decoded.future

    async def submit(self, decoded: DecodedProfiles, protocol: str, admission: Admission,
                     in_flight: InFlight) -> Accepted:
        """Write the valid stacks and return once they are committed (counted by samples, as decoded).

        InvalidPayload when nothing in the request can be stored, Unavailable when the write failed.
        """
        t = self.ingest.telemetry
        accepted = stacks_of_samples(decoded.stacks)
        t.received.labels(SIGNAL, protocol).inc(accepted + decoded.rejected)
        if decoded.rejected:
            t.rejected.labels(SIGNAL, "invalid").inc(decoded.rejected)
        for kind, count in decoded.truncated.items():
            t.truncated.labels(SIGNAL, kind).inc(count)
        if not decoded.stacks:
            if decoded.rejected or decoded.errors:
                raise InvalidPayload(decoded.error_message)
            return Accepted(0, "")
        write = asyncio.ensure_future(self.write_aside("profile write", self.write, decoded.stacks))
        write.add_done_callback(_retrieve)  # a sender gone before the answer must not leave it unretrieved
        # The request's bytes and its place stay taken until the write ends, even if its sender hangs up.
        admission.until(write)
        in_flight.until(write)
        try:
            # Shielded: a sender that hangs up must not cancel a transaction under way.
            await asyncio.shield(write)
        except StorageUnavailable as exc:
            t.dropped.labels(SIGNAL, "storage_error").inc(accepted)
            health = self.ingest.health
            # Outside an outage (this write's own error) there is no next attempt to wait for.
            retry_after = self.ingest.retry_after if health.available else health.retry_after()
            raise Unavailable(str(exc), retry_after) from None
        t.stored.labels(SIGNAL).inc(accepted)
        message = "; ".join(m for m in (decoded.error_message, self.ingest.truncation_note(decoded.truncated)) if m)
        return Accepted(decoded.rejected, message)


def _retrieve(write: asyncio.Future[Any]) -> None:
    if not write.cancelled():
        write.exception()
