"""Forwards the queue to the collector over OTLP/gRPC, oldest first, one request at a time.

An item leaves the queue only when the collector acknowledged it (which it
does after committing). Retryable answers (UNAVAILABLE, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, ...) back off exponentially with jitter, honouring the
collector's ``RetryInfo``; a request the collector calls invalid is dropped
and counted, since sending it again can never succeed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2

from agent.forward_queue import ForwardQueue
from agent.spool import Item, Signal

log = logging.getLogger("spikehound.agent.forwarder")

_METHODS = {Signal.TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            Signal.METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"}
_PERMANENT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}
LINGER_SECONDS = 0.5  # while healthy, wait this long for more requests to merge into one
LINGER_BYTES = 1 << 20  # ... unless this much is already queued
MAX_MERGED_BYTES = 4 << 20  # the collector accepts 32 MiB; stay well below
BACKOFF_START = 0.25
BACKOFF_MAX = 30.0
REQUEST_TIMEOUT = 30.0
RECONNECT_BACKOFF_MAX_MS = 5000


def parse_target(url: str) -> tuple[str, bool]:
    """``http://host:4317``, ``https://host:4317`` or ``host:4317`` -> (grpc target, use TLS).

    >>> parse_target("https://collector.example:4317"), parse_target("10.0.0.5:4317")
    (('collector.example:4317', True), ('10.0.0.5:4317', False))
    """
    if url.startswith("https://"):
        return url[len("https://"):].rstrip("/"), True
    if url.startswith("http://"):
        return url[len("http://"):].rstrip("/"), False
    return url.rstrip("/"), False


def retry_delay(error: grpc.aio.AioRpcError) -> float | None:
    """The delay a ``google.rpc.RetryInfo`` detail asks for, if any."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


@dataclass
class ForwardStats:
    forwarded: dict[Signal, int] = field(default_factory=lambda: {Signal.TRACES: 0, Signal.METRICS: 0})
    dropped: dict[Signal, int] = field(default_factory=lambda: {Signal.TRACES: 0, Signal.METRICS: 0})
    retries: int = 0
    connected: bool = False


class Forwarder:
    def __init__(self, queue: ForwardQueue, collector_url: str, token: str = "",
                 on_change: Callable[[], None] | None = None) -> None:
        self.queue = queue
        target, tls = parse_target(collector_url)
        credentials = grpc.ssl_channel_credentials() if tls else None
        # gRPC's own reconnect backoff grows to 120 s: after a long outage our retries would keep failing fast
        # that long after the collector is back. Reconnecting is cheap, so keep the channel close behind.
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.enable_retries", 0),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)]
        self.channel = (grpc.aio.secure_channel(target, credentials, options=options) if credentials
                        else grpc.aio.insecure_channel(target, options=options))
        self._calls = {signal: self.channel.unary_unary(method, request_serializer=None,
                                                        response_deserializer=None)
                       for signal, method in _METHODS.items()}
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.stats = ForwardStats()
        self._on_change = on_change or (lambda: None)
        self._backoff = BACKOFF_START
        self._random = random.Random()

    async def run(self) -> None:
        """Forward forever (cancel to stop)."""
        while True:
            await self.queue.wait()
            if self.stats.connected and not len(self.queue.spool) and self.queue.memory_used < LINGER_BYTES:
                # Let a few requests gather: one merged request costs the collector and the agent
                # far less than many small ones, and half a second is nothing next to a 10 s window.
                await asyncio.sleep(LINGER_SECONDS)
            await self.forward_one()

    async def forward_one(self, timeout: float = REQUEST_TIMEOUT) -> bool:
        """Try to send the oldest request (merged with later ones of its signal); True when it left the queue."""
        batch = self.queue.peek_batch(MAX_MERGED_BYTES)
        if not batch:
            return False
        item = batch[0]
        payload = item.payload if len(batch) == 1 else b"".join(i.payload for i in batch)
        try:
            await self._calls[item.signal](payload, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            return await self._failed(batch, exc)
        self.queue.pop_batch(batch)
        self.stats.forwarded[item.signal] += sum(i.count for i in batch)
        if not self.stats.connected:
            log.info("collector reachable; forwarding (%d requests queued)", len(self.queue))
        self.stats.connected = True
        self._backoff = BACKOFF_START
        self._on_change()
        return True

    async def _failed(self, batch: list[Item], exc: grpc.aio.AioRpcError) -> bool:
        code = exc.code()
        if code in _PERMANENT:
            if len(batch) > 1:  # find the bad one: send them one by one
                return await self._send_singly(batch)
            self.queue.pop_batch(batch)
            item = batch[0]
            self.stats.dropped[item.signal] += item.count
            log.error("collector refused a %s request as invalid (%s: %s); dropped %d items", item.signal.name.lower(),
                      code.name, (exc.details() or "")[:200], item.count)
            self._on_change()
            return True
        self.stats.retries += 1
        if self.stats.connected:
            log.warning("collector answered %s (%s); queueing and retrying", code.name, (exc.details() or "")[:200])
        self.stats.connected = False
        wanted = retry_delay(exc)
        delay = max(wanted or 0.0, self._backoff * (0.5 + self._random.random()))
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        await asyncio.sleep(delay)
        return False

    async def _send_singly(self, batch: list[Item]) -> bool:
        for item in batch:
            try:
                await self._calls[item.signal](item.payload, timeout=REQUEST_TIMEOUT, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _PERMANENT:
                    return await self._failed([item], exc)
                self.stats.dropped[item.signal] += item.count
                log.error("collector refused a %s request as invalid (%s: %s); dropped %d items",
                          item.signal.name.lower(), exc.code().name, (exc.details() or "")[:200], item.count)
            else:
                self.stats.forwarded[item.signal] += item.count
            self.queue.pop_batch([item])
        self._on_change()
        return True

    async def close(self) -> None:
        await self.channel.close()
