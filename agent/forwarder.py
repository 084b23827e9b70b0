"""Forwards the queue to the collector over OTLP/gRPC, oldest first within each signal.

While the collector is healthy the forwarder flushes at most once per
``FLUSH_SECONDS``: each signal's queued requests merge into one request, and
the signals' requests go out side by side on the one channel. A gRPC call
costs the agent 1-3 ms of CPU however small it is (most of it waking gRPC's
threads), and two concurrent calls cost little more than one, so this is what
keeps forwarding cheap. Spooled records are sent one at a time, in order.

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
FLUSH_SECONDS = 1.0  # while healthy, forward at most this often (and within 2 s); inside the collector's 5 s lateness
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
    requests: dict[Signal, int] = field(default_factory=lambda: {Signal.TRACES: 0, Signal.METRICS: 0})  # acked
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
        loop = asyncio.get_running_loop()
        last_flush = -FLUSH_SECONDS
        while True:
            await self.queue.wait()
            due = last_flush + FLUSH_SECONDS
            if (self.stats.connected and not len(self.queue.spool) and self.queue.memory_used < LINGER_BYTES
                    and loop.time() < due):
                # Let requests gather: one merged request costs the collector and the agent far less than many
                # small ones. Once due, go with the next request that arrives: the event loop and gRPC's threads
                # are awake for it anyway, where a timer would wake them just to flush (a wake-up costs a few
                # hundred microseconds of CPU). Without arrivals a timer still flushes within two periods.
                while await self.queue.arrival(due + FLUSH_SECONDS - loop.time()) and loop.time() < due:
                    pass
            last_flush = loop.time()
            await self.flush()

    async def flush(self, timeout: float = REQUEST_TIMEOUT) -> bool:
        """Send each signal's oldest requests, merged, side by side; True when anything left the queue.

        After a retryable failure this backs off before returning.
        """
        batches = self.queue.peek_batches(MAX_MERGED_BYTES)
        if not batches:
            return False
        outcomes = await asyncio.gather(*(self._send(batch, timeout) for batch in batches))
        failures = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
        if failures:
            await self._retry_later(failures)
        return any(outcome is True for outcome in outcomes)

    async def _send(self, batch: list[Item], timeout: float) -> bool | grpc.aio.AioRpcError:
        """One merged request: True when it left the queue, the error when it must be retried."""
        item = batch[0]
        payload = item.payload if len(batch) == 1 else b"".join(i.payload for i in batch)
        try:
            await self._calls[item.signal](payload, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _PERMANENT:
                return exc
            if len(batch) > 1:  # find the bad one: send them one by one
                return await self._send_singly(batch, timeout)
            self._drop(item, exc)
            return True
        self.queue.pop_batch(batch)
        self.stats.forwarded[item.signal] += sum(i.count for i in batch)
        self.stats.requests[item.signal] += 1
        if not self.stats.connected:
            log.info("collector reachable; forwarding (%d requests queued)", len(self.queue))
        self.stats.connected = True
        self._backoff = BACKOFF_START
        self._on_change()
        return True

    def _drop(self, item: Item, exc: grpc.aio.AioRpcError) -> None:
        self.queue.pop_batch([item])
        self.stats.dropped[item.signal] += item.count
        log.error("collector refused a %s request as invalid (%s: %s); dropped %d items", item.signal.name.lower(),
                  exc.code().name, (exc.details() or "")[:200], item.count)
        self._on_change()

    async def _retry_later(self, failures: list[grpc.aio.AioRpcError]) -> None:
        self.stats.retries += 1
        exc = failures[0]
        if self.stats.connected:
            log.warning("collector answered %s (%s); queueing and retrying", exc.code().name,
                        (exc.details() or "")[:200])
        self.stats.connected = False
        wanted = max((retry_delay(failure) or 0.0 for failure in failures), default=0.0)
        delay = max(wanted, self._backoff * (0.5 + self._random.random()))
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        await asyncio.sleep(delay)

    async def _send_singly(self, batch: list[Item], timeout: float) -> bool | grpc.aio.AioRpcError:
        for item in batch:
            try:
                await self._calls[item.signal](item.payload, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _PERMANENT:
                    return exc
                self._drop(item, exc)
                continue
            self.stats.forwarded[item.signal] += item.count
            self.stats.requests[item.signal] += 1
            self.queue.pop_batch([item])
        self._on_change()
        return True

    async def close(self) -> None:
        await self.channel.close()
