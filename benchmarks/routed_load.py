"""Load for several collectors at once: ``benchmarks.ingest``'s senders, each request routed by its trace id.

``routed_sender_process`` is :func:`benchmarks.ingest.sender_process` (the same pre-encoded rounds, in-flight
calls, retries on RESOURCE_EXHAUSTED / UNAVAILABLE and accounting) with one difference: it is given several
gRPC endpoints, and each export request goes whole to one of them, chosen by the request's first trace id
(:func:`route`), as agents that route by trace id keep every trace on one collector. The workload's requests
each hold whole traces, so every trace stays on one collector.

It works by standing a :class:`RoutingChannel` in for ``grpc.aio.insecure_channel`` inside the sender process
(a spawned process that does nothing else), so the send loop is ingest.py's own and cannot drift from it.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from benchmarks.ingest import Workload, sender_process, span_ranges
from spikehound.protowire import fields

ENDPOINT_SEPARATOR = ","


def first_trace_id(body: bytes) -> bytes:
    """The trace id of the first span of an encoded ExportTraceServiceRequest (b"" when it holds none)."""
    for s3, e3 in span_ranges(body):
        for n4, _, _, s4, e4 in fields(body, s3, e3):
            if n4 == 1:  # Span.trace_id
                return bytes(body[s4:e4])
    return b""


def route(body: bytes, members: int) -> int:
    """Which of ``members`` collectors gets this request: a hash of its first trace id."""
    return zlib.crc32(first_trace_id(body)) % members if members > 1 else 0


class RoutingChannel:
    """Enough of ``grpc.aio.Channel`` for ``benchmarks.ingest._send``: one real channel per endpoint; a unary
    call goes to the channel that :func:`route` picks for its request body."""

    def __init__(self, channels: Sequence[Any]) -> None:
        self.channels = list(channels)
        self.sent = [0] * len(self.channels)  # requests per endpoint (first tries and retries)

    async def __aenter__(self) -> RoutingChannel:
        for channel in self.channels:
            await channel.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for channel in self.channels:
            await channel.__aexit__(exc_type, exc, tb)

    async def channel_ready(self) -> None:
        await asyncio.gather(*(channel.channel_ready() for channel in self.channels))

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None) -> Any:
        calls = [channel.unary_unary(method, request_serializer=request_serializer,
                                     response_deserializer=response_deserializer) for channel in self.channels]

        def call(body: bytes, **kwargs: Any) -> Any:
            i = route(body, len(calls))
            self.sent[i] += 1
            return calls[i](body, **kwargs)

        return call


def _install_routing() -> None:
    """In this (sender) process: a target of several comma-separated endpoints opens a RoutingChannel."""
    import grpc

    real = grpc.aio.insecure_channel

    def insecure_channel(target: str, *args: Any, **kwargs: Any) -> Any:
        if ENDPOINT_SEPARATOR not in target:
            return real(target, *args, **kwargs)
        return RoutingChannel([real(t, *args, **kwargs) for t in target.split(ENDPOINT_SEPARATOR)])

    grpc.aio.insecure_channel = insecure_channel


def routed_sender_process(conn: Connection, endpoints: Sequence[str], workload: Workload, inflight: int,
                          measure_at: float, end_at: float, offset: int) -> None:
    """A load-generator process (``multiprocessing`` target, spawn context) over several collectors; sends
    its :class:`benchmarks.ingest.SenderResult` through ``conn`` when ``end_at`` has passed."""
    _install_routing()
    sender_process(conn, ENDPOINT_SEPARATOR.join(endpoints), workload, inflight, measure_at, end_at, offset)
