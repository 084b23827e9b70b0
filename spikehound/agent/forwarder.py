"""Forwards the queue to the collector over OTLP/gRPC, oldest first within each signal.

The signals are spans, metrics and the profiler's profiles (``ProfilesService/Export``); a collector too old
to take profiles answers UNIMPLEMENTED, and they are dropped and counted (one warning).

While the collector is healthy the forwarder flushes at most once per
``FLUSH_SECONDS``: each signal's queued requests merge into one request (never
past the collector's limit), and the signals' requests go out side by side on
the one channel. A gRPC call costs the agent 1-3 ms of CPU however small it
is (most of it waking gRPC's threads), and two concurrent calls cost little
more than one, so this is what keeps forwarding cheap. Spooled records are
sent one at a time, in order.

An item leaves the queue only when the collector acknowledged it (which it
does after committing). Retryable answers (UNAVAILABLE, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, ...) back off exponentially with jitter, or, when the
collector's ``RetryInfo`` names a delay, wait that (up to half again more,
drawn, so that agents spread out); a request the collector calls invalid is
dropped and counted, since sending it again can never succeed.

A request refused as larger than the collector's maximum (gRPC's
RESOURCE_EXHAUSTED "message larger than max", which carries no
``RetryInfo``, unlike the collector's backpressure) can never succeed either:
the forwarder lowers its limit to the one the collector named and sends the
request again split by resource, scope and span; only a single span or point
over the limit is dropped, counted and logged. When forwarding makes no
progress for ``STALL_WARN_SECONDS`` one WARNING says why, and another every
``STALL_REMIND_SECONDS`` while it lasts, not one per retry.

Every request carries the agent's instance id and those of the agents that forwarded to it lately
(``INSTANCE_HEADER``, see ``AgentChain``). An agent's receiver refuses a request carrying its own id with
FAILED_PRECONDITION and ``LOOP_TRAILER``: the member is this agent itself, reached through a name or a proxy,
or an agent upstream of it (A -> B -> A). The forwarder then sets ``looped`` (and retries no faster than after any other
failure) for the dispatcher to take the member out; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.request_split import DropLog, Dropped, request_sender, split_request
from spikehound.agent.spool import Item, Signal
from spikehound.backoff import Backoff
from spikehound.otlp import trailer_retry_delay

log = logging.getLogger("spikehound.agent.forwarder")

_METHODS = {Signal.TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            Signal.METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
            Signal.PROFILES: "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export"}
_PERMANENT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}
FLUSH_SECONDS = 1.0  # while healthy, forward at most this often (and within 2 s); inside the collector's 5 s lateness
LINGER_BYTES = 1 << 20  # ... unless this much is already queued
MAX_MERGED_BYTES = 4 << 20  # the collector accepts 32 MiB; stay well below
BACKOFF_START = 0.25
# Tries against a collector that is down cost nothing; one that restarts must get its agents' backlogs back
# within its catch-up (collector.catch_up_seconds, 15 s) to judge them in order: 8 s, drawn up to 12 s.
BACKOFF_MAX = 8.0
BACKOFF_JITTER = (0.5, 1.5)  # each delay drawn between half and one and a half times the step
HINT_JITTER = 1.5  # a collector's RetryInfo delay is waited for, times up to this
REQUEST_TIMEOUT = 30.0
RECONNECT_BACKOFF_MAX_MS = 5000
MAX_SEND_BYTES = 64 << 20
MIN_LEARNED_BYTES = 1024  # never believe a limit below this from a refusal that does not name one
STALL_WARN_SECONDS = 30.0
STALL_REMIND_SECONDS = 600.0
INSTANCE_HEADER = "spikehound-agent-instance"  # gRPC metadata: the forwarding agent's random instance id
LOOP_TRAILER = "spikehound-forward-loop"  # in the refusal of a request that came back to an agent it went through
MAX_CHAIN = 16  # ids in INSTANCE_HEADER: a longer chain of agents is not followed further
MAX_ID_CHARS = 64
MAX_UPSTREAM = 256  # upstream ids remembered (the newest MAX_CHAIN - 1 are sent)
UPSTREAM_SECONDS = 60.0
# gRPC's own wording, from the collector's side ("SERVER: Received ...") or ours ("CLIENT: Sent ...").
_TOO_LARGE = re.compile(r"message larger than max(?: \((\d+) vs\. (\d+)\))?", re.IGNORECASE)
# Why forwarding failed, as an operator reads it.
REASONS = {"unavailable": "the collector is unreachable or unavailable",
           "backpressure": "the collector is pushing back (its ingest queue is full)",
           "timeout": "the collector did not answer in time",
           "unauthenticated": "the collector refuses the agent's token (agent.collector_token)",
           "loop": "the collector is this agent itself (its own receiver refused what it forwarded)",
           "other": "the collector answered with an error"}


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


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """TLS to the collector: verified by ``ca_file`` (gRPC's public CAs when empty), with a client certificate and key
    for a collector that requires one (mTLS)."""
    ca, key, cert = (Path(path).read_bytes() if path else None for path in (ca_file, key_file, cert_file))
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def retry_delay(error: grpc.aio.AioRpcError) -> float | None:
    """The delay a ``google.rpc.RetryInfo`` detail asks for, if any."""
    return trailer_retry_delay(error.trailing_metadata())


def size_limit(error: grpc.aio.AioRpcError) -> int | None:
    """The limit a "message larger than max" refusal names (0 when it names none); None for any other error.

    The collector's backpressure is RESOURCE_EXHAUSTED too, but asks to retry (``RetryInfo``): not this.
    """
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or retry_delay(error) is not None:
        return None
    found = _TOO_LARGE.search(error.details() or "")
    if found is None:
        return None
    return int(found.group(2)) if found.group(2) else 0


def is_loop(error: grpc.aio.AioRpcError) -> bool:
    """The refusal of an agent's receiver that found its own id in the chain of a request: the member is an
    agent the request came through (this one, or one upstream)."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    return any(key == LOOP_TRAILER for key, _ in error.trailing_metadata() or ())


class AgentChain:
    """This agent's instance id and those of the agents that forwarded to it lately: what ``INSTANCE_HEADER``
    carries on every forwarded request (comma-separated, this agent first, at most MAX_CHAIN ids).

    A receiver that finds its own id there refuses the request: it came back (A -> A through a proxy, or
    A -> B -> A). Ids are remembered for UPSTREAM_SECONDS after they were last seen.

    >>> a, b = AgentChain("aa"), AgentChain("bb")
    >>> b.note(a.header()), a.note(b.header())
    (False, True)
    """

    def __init__(self, instance: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.instance = instance
        self._clock = clock
        self._upstream: dict[str, float] = {}  # id -> last seen, oldest first

    def header(self) -> str:
        now = self._clock()
        for key in [k for k, seen in self._upstream.items() if now - seen > UPSTREAM_SECONDS]:
            del self._upstream[key]
        newest = list(self._upstream)[-(MAX_CHAIN - 1):]
        return ",".join([self.instance, *reversed(newest)])

    def note(self, value: str) -> bool:
        """A request's chain: True when it holds this agent's id (refuse it); else its ids are remembered."""
        ids = [part.strip() for part in value.split(",")[:MAX_CHAIN]]
        if self.instance in ids:
            return True
        now = self._clock()
        for key in ids:
            if key and len(key) <= MAX_ID_CHARS:
                self._upstream.pop(key, None)
                self._upstream[key] = now
        while len(self._upstream) > MAX_UPSTREAM:
            del self._upstream[next(iter(self._upstream))]
        return False


def failure_reason(error: grpc.aio.AioRpcError) -> str:
    """The ``REASONS`` key of a retryable failure."""
    code = error.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION and any(
            key == LOOP_TRAILER for key, _ in error.trailing_metadata() or ()):
        return "loop"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "backpressure"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return "unauthenticated"
    return "other"


def _signals() -> Counter[Signal]:
    # A Counter reads 0 for a signal not yet counted (profiles, where the agent does not profile).
    return Counter({Signal.TRACES: 0, Signal.METRICS: 0})


@dataclass
class ForwardStats:
    forwarded: Counter[Signal] = field(default_factory=_signals)
    dropped: Counter[Signal] = field(default_factory=_signals)  # refused by the collector as invalid
    too_large: Counter[Signal] = field(default_factory=_signals)  # alone larger than the collector's limit
    split_requests: Counter[Signal] = field(default_factory=_signals)  # queued requests sent in pieces
    requests: Counter[Signal] = field(default_factory=_signals)  # acked
    retries: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # failed attempts by reason (REASONS, "too_large")
    connected: bool = False


class Forwarder:
    def __init__(self, queue: ForwardQueue, collector_url: str, token: str = "",
                 on_change: Callable[[], None] | None = None, *, clock: Callable[[], float] = time.monotonic,
                 backoff_start: float = BACKOFF_START, backoff_max: float = BACKOFF_MAX,
                 drop_log: DropLog | None = None, credentials: grpc.ChannelCredentials | None = None,
                 rng: random.Random | None = None, chain: AgentChain | None = None) -> None:
        """``credentials`` secure an https:// ``collector_url`` (default: gRPC's public CAs, no client certificate);
        ``rng`` draws the backoff's jitter; ``chain`` (the agent's id, and its upstream agents') goes with every
        request."""
        self.queue = queue
        self.target, tls = parse_target(collector_url)
        credentials = (credentials or grpc.ssl_channel_credentials()) if tls else None
        # gRPC's own reconnect backoff grows to 120 s: after a long outage our retries would keep failing fast
        # that long after the collector is back. Reconnecting is cheap, so keep the channel close behind.
        options = [("grpc.max_send_message_length", MAX_SEND_BYTES), ("grpc.enable_retries", 0),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)]
        self.channel = (grpc.aio.secure_channel(self.target, credentials, options=options) if credentials
                        else grpc.aio.insecure_channel(self.target, options=options))
        self._calls = {signal: self.channel.unary_unary(method, request_serializer=None,
                                                        response_deserializer=None)
                       for signal, method in _METHODS.items()}
        self._auth = [("authorization", f"Bearer {token}")] if token else []
        self.chain = chain
        self.looped = False  # this agent's own receiver refused a request: the collector is this agent
        self.stats = ForwardStats()
        self._on_change = on_change or (lambda: None)
        self._clock = clock
        self._backoff = Backoff(backoff_start, backoff_max, jitter=BACKOFF_JITTER)
        self._failures = 0  # flushes failed since forwarding last went through
        self._random = rng or random.Random()
        self._drop_log = drop_log or DropLog(clock=clock)
        self._stalled_since: float | None = None  # first failure since forwarding last went through
        self._warned_at: float | None = None
        self._resume: tuple[Item, int, int] | None = None  # (item, limit, pieces acknowledged) of a split send
        self._profiles_unimplemented = False  # warned that the collector takes no profiles

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

    @property
    def stalled_seconds(self) -> float:
        """How long forwarding has failed without anything going through; 0 while it flows."""
        return 0.0 if self._stalled_since is None else self._clock() - self._stalled_since

    async def flush(self, timeout: float = REQUEST_TIMEOUT) -> bool:
        """Send each signal's oldest requests, merged, side by side; True when anything left the queue.

        After a retryable failure this backs off before returning.
        """
        batches = self.queue.peek_batches(min(MAX_MERGED_BYTES, self.queue.max_request_bytes))
        if not batches:
            return False
        outcomes = await asyncio.gather(*(self._send(batch, timeout) for batch in batches))
        failures = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
        if failures:
            await self._retry_later(failures)
        else:
            self._progressed()
        return any(outcome is True for outcome in outcomes)

    async def _call(self, signal: Signal, payload: bytes, timeout: float) -> None:
        await self._calls[signal](payload, timeout=timeout, metadata=self._metadata())

    async def _send(self, batch: list[Item], timeout: float) -> bool | grpc.aio.AioRpcError:
        """One merged request: True when it left the queue, the error when it must be retried."""
        item = batch[0]
        if len(batch) == 1 and len(item.payload) > self.queue.max_request_bytes:
            return await self._send_split(item, timeout)
        payload = item.payload if len(batch) == 1 else b"".join(i.payload for i in batch)
        try:
            await self._call(item.signal, payload, timeout)
        except grpc.aio.AioRpcError as exc:
            if self._refused_as_too_large(exc, len(payload)):
                return await self._send_singly(batch, timeout)  # each alone, split if it must be
            if exc.code() not in _PERMANENT:
                return exc
            if len(batch) > 1:  # find the bad one: send them one by one
                return await self._send_singly(batch, timeout)
            self._drop(item, exc)
            return True
        self._acked(batch)
        return True

    def _acked(self, batch: list[Item]) -> None:
        item = batch[0]
        self.queue.pop_batch(batch)
        self.stats.forwarded[item.signal] += sum(i.count for i in batch)
        self.stats.requests[item.signal] += 1
        self._went_through()

    def _went_through(self) -> None:
        if not self.stats.connected:
            log.info("collector %s reachable; forwarding (%d requests queued)", self.target, len(self.queue))
        self.stats.connected = True
        self._failures = 0
        self._on_change()

    def _drop(self, item: Item, exc: grpc.aio.AioRpcError) -> None:
        self.queue.pop_batch([item])
        self._count_invalid(item.signal, item.count, exc)
        self._on_change()

    def _count_invalid(self, signal: Signal, count: int, exc: grpc.aio.AioRpcError) -> None:
        self.stats.dropped[signal] += count
        if signal is Signal.PROFILES and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            # A collector from before profiles: every window would log an error; say it once.
            if not self._profiles_unimplemented:
                self._profiles_unimplemented = True
                log.warning("the collector does not take profiles (UNIMPLEMENTED: an older version?); the agent's "
                            "profiles are dropped (counted in spikehound_agent_dropped{signal=\"profiles\"})")
            return
        log.error("collector refused a %s request as invalid (%s: %s); dropped %d items", signal.name.lower(),
                  exc.code().name, (exc.details() or "")[:200], count)

    async def _send_singly(self, batch: list[Item], timeout: float) -> bool | grpc.aio.AioRpcError:
        for item in batch:
            if len(item.payload) > self.queue.max_request_bytes:
                outcome = await self._send_split(item, timeout)
                if outcome is not True:
                    return outcome
                continue
            try:
                await self._call(item.signal, item.payload, timeout)
            except grpc.aio.AioRpcError as exc:
                if self._refused_as_too_large(exc, len(item.payload)):
                    outcome = await self._send_split(item, timeout)
                    if outcome is not True:
                        return outcome
                    continue
                if exc.code() not in _PERMANENT:
                    return exc
                self._drop(item, exc)
                continue
            self._acked([item])
        return True

    async def _send_split(self, item: Item, timeout: float) -> bool | grpc.aio.AioRpcError:
        """Send ``item`` in pieces the collector takes; True once all went (or were dropped), else the error.

        After a retryable failure the next attempt resumes after the pieces already acknowledged.
        """
        while True:
            limit = self.queue.max_request_bytes
            split = split_request(item.signal, item.payload, limit, item.count)
            resume = self._resume
            done = resume[2] if resume is not None and resume[0] is item and resume[1] == limit else 0
            for index in range(done, len(split.pieces)):
                piece, count = split.pieces[index]
                try:
                    await self._call(item.signal, piece, timeout)
                except grpc.aio.AioRpcError as exc:
                    if self._refused_as_too_large(exc, len(piece)):
                        if self.queue.max_request_bytes < limit:
                            break  # the limit is lower than we knew: cut again
                        # Refused at a size the collector said it takes: cutting further would never end.
                        split.dropped.append(Dropped(request_sender(piece), count, len(piece)))
                        continue
                    if exc.code() not in _PERMANENT:
                        self._resume = (item, limit, index)
                        return exc
                    self._count_invalid(item.signal, count, exc)
                    continue
                self.stats.forwarded[item.signal] += count
                self.stats.requests[item.signal] += 1
            else:
                self._resume = None
                self.stats.split_requests[item.signal] += 1
                if split.dropped:
                    self.stats.too_large[item.signal] += split.dropped_items
                    self._drop_log.report(item.signal, split.dropped, limit, "forwarder")
                self.queue.pop_batch([item])
                self._went_through()
                return True

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self.chain is None:
            return tuple(self._auth) or None
        return (*self._auth, (INSTANCE_HEADER, self.chain.header()))

    def _refused_as_too_large(self, exc: grpc.aio.AioRpcError, sent: int) -> bool:
        """True for a "larger than max" refusal, after lowering the limit below ``sent`` where it can."""
        named = size_limit(exc)
        if named is None:
            return False
        self.stats.failures["too_large"] += 1
        limit = named if 0 < named < sent else max(sent // 2, MIN_LEARNED_BYTES)
        if limit < self.queue.max_request_bytes:
            self.queue.max_request_bytes = limit
            log.warning("collector refused a %d-byte request as too large (%s); requests over %d bytes are split "
                        "from now on (raise the collector's collector.max_request_bytes to avoid this)", sent,
                        (exc.details() or "")[:200], limit)
        return True

    async def _retry_later(self, failures: list[grpc.aio.AioRpcError]) -> None:
        self.stats.retries += 1
        exc = failures[0]
        reason = failure_reason(exc)
        if self.chain is not None and any(is_loop(failure) for failure in failures):
            self.looped = True
        for failure in failures:
            self.stats.failures[failure_reason(failure)] += 1
        if self.stats.connected:
            log.info("collector %s answered %s (%s); queueing and retrying", self.target, exc.code().name,
                     (exc.details() or "")[:200])
        self.stats.connected = False
        self._stalled(reason, exc)
        wanted = max((retry_delay(failure) or 0.0 for failure in failures), default=0.0)
        self._failures += 1
        # A collector that names a delay is up and says when to come back (storage away, its queue full): its
        # word beats our own doubling, which after a minute-long outage would keep the backlog waiting for up
        # to 45 s after storage returned. Only ever later than asked, so agents told together spread out.
        if wanted:
            delay = wanted * (1.0 + self._random.random() * (HINT_JITTER - 1.0))
        else:
            delay = self._backoff.delay(self._failures, self._random)
        await asyncio.sleep(delay)

    def _stalled(self, reason: str, exc: grpc.aio.AioRpcError) -> None:
        """Say why forwarding is stuck: once it has been for a while, then now and again, never per retry."""
        now = self._clock()
        if self._stalled_since is None:
            self._stalled_since = now
        stalled = now - self._stalled_since
        if stalled < STALL_WARN_SECONDS or (self._warned_at is not None
                                            and now - self._warned_at < STALL_REMIND_SECONDS):
            return
        self._warned_at = now
        q = self.queue
        log.warning("forwarding to %s has made no progress for %.0f s: %s (%s: %s); %d requests queued (%d bytes "
                    "in memory, %d requests and %d bytes on disk); retrying", self.target, stalled, REASONS[reason],
                    exc.code().name, (exc.details() or "")[:200], len(q), q.memory_used, len(q.spool),
                    q.spool.bytes_used)

    def _progressed(self) -> None:
        if self._warned_at is not None and self._stalled_since is not None:
            log.info("forwarding to %s resumed after %.0f s without progress; %d requests queued", self.target,
                     self._clock() - self._stalled_since, len(self.queue))
        self._stalled_since = self._warned_at = None

    async def close(self) -> None:
        await self.channel.close()
