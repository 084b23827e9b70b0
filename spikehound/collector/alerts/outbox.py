"""Delivery from the durable outbox: at least once, in order per receiver, with backoff and a dead letter.

Notifications wait in the ``alert_outbox`` table until a receiver answered
2xx, so a collector that restarts (or is killed) sends what was queued. Each
receiver gets its notifications one at a time, oldest first: a resolve notice
never overtakes its firing message, and a receiver that asks to slow down
(``429`` with ``Retry-After``) is given the time it asked for. Failures are
retried with exponential backoff and jitter (``alerts.backoff_initial_seconds``
doubling up to ``alerts.backoff_max_seconds``, each delay drawn between half
and all of it); after ``alerts.max_attempts`` the notification is
dead-lettered, and so is one that the receiver refused outright (a 4xx other
than 408, 425 and 429, which retrying cannot fix). Dead letters are listed by
``GET /api/v1/alerts/outbox?state=dead`` and can be sent again with ``POST
/api/v1/alerts/outbox/{id}/retry``.

Error texts name the receiver and what happened, never its URL: a Slack
webhook URL is a credential.

>>> retry_after_seconds("120", now=0.0), retry_after_seconds("Thu, 01 Jan 1970 00:01:00 GMT", now=0.0)
(120.0, 60.0)
>>> retry_after_seconds("²", now=0.0), retry_after_seconds("Thu, 01 Jan 99999 00:00:00 GMT", now=0.0)
(None, None)
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from spikehound.backoff import Backoff
from spikehound.collector.alerts.store import AlertStore
from spikehound.collector.alerts.telemetry import AlertTelemetry
from spikehound.collector.notifiers import Notifier, notifier_for
from spikehound.collector.storage_health import StorageHealth
from spikehound.config import AlertsConfig, ReceiverConfig
from spikehound.storage.alerts import OutboxRow
from spikehound.units import NS

log = logging.getLogger("spikehound.collector.alerts")

RETRYABLE_STATUS = frozenset({408, 425, 429})
MAX_RETRY_AFTER_SECONDS = 3600.0
IDLE_POLL_SECONDS = 5.0
_DELTA_SECONDS = re.compile(r"^[0-9]+$")  # ASCII: str.isdigit() also takes '²', which float() refuses
ERROR_PAUSE_SECONDS = 1.0


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """``Retry-After`` as seconds from ``now``: delta-seconds or an HTTP date (RFC 9110); None when unreadable."""
    if not value:
        return None
    text = value.strip()
    if _DELTA_SECONDS.match(text):
        return min(float(text), MAX_RETRY_AFTER_SECONDS)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    return min(max(0.0, when.timestamp() - now), MAX_RETRY_AFTER_SECONDS)


@dataclass(frozen=True, slots=True)
class Outcome:
    result: str  # delivered | retry | dead
    error: str | None = None
    retry_after: float | None = None


def _describe(exc: BaseException, timeout: float) -> str:
    """What went wrong, without the URL (aiohttp's messages may contain it)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror if exc.os_error is not None and exc.os_error.strerror else "refused"
        return f"cannot connect: {reason}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.__class__.__name__}: {exc.strerror}"
    return exc.__class__.__name__


def _classify(status: int, retry_after: str | None, text: str, now: float) -> Outcome:
    if 200 <= status < 300:
        return Outcome("delivered")
    error = f"HTTP {status}" + (f": {text}" if text else "")
    if status in RETRYABLE_STATUS or status >= 500:
        return Outcome("retry", error, retry_after_seconds(retry_after, now) if status in (429, 503) else None)
    return Outcome("dead", error + " (not retried: the receiver refused it)")


class OutboxDelivery:
    """Sends the outbox; one background task (:meth:`run`) per collector."""

    def __init__(self, cfg: AlertsConfig, store: AlertStore, telemetry: AlertTelemetry, *,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 health: StorageHealth | None = None) -> None:
        self.store = store
        self.health = health or StorageHealth()
        self.telemetry = telemetry
        self.clock = clock
        self.rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None
        self.reload(cfg)

    def reload(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        self.receivers: dict[str, ReceiverConfig] = {r.name: r for r in cfg.receivers}
        self.notifiers: dict[str, Notifier] = {r.name: notifier_for(r) for r in cfg.receivers}
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=True)
        try:
            while not self._stopping:
                try:
                    wait = await self.deliver_due()
                except Exception as exc:  # storage away: try again shortly, never die
                    self.health.note("alert delivery (reading the outbox)", exc)
                    wait = ERROR_PAUSE_SECONDS
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    self._wake.clear()
        finally:
            await self._session.close()

    async def deliver_due(self) -> float:
        """Attempt the oldest pending notification of every receiver that is due; seconds until the next."""
        rows = await self.store.pending()
        now_ns = int(self.clock() * NS)
        heads: dict[str, OutboxRow] = {}
        for row in rows:
            heads.setdefault(row.receiver, row)
        due = [row for row in heads.values() if row.next_attempt_at <= now_ns]
        if due:
            await asyncio.gather(*(self._attempt(row) for row in due))
            return 0.0
        if not heads:
            return IDLE_POLL_SECONDS
        return max(0.0, min(IDLE_POLL_SECONDS, (min(r.next_attempt_at for r in heads.values()) - now_ns) / NS))

    async def _attempt(self, row: OutboxRow) -> None:
        receiver = self.receivers.get(row.receiver)
        if receiver is None:
            outcome = Outcome("dead", f"receiver {row.receiver!r} is not configured any more")
        else:
            outcome = await self._post(row, receiver)
        now = self.clock()
        attempts = row.attempts + 1
        if outcome.result == "delivered":
            await self.store.record_attempt(row.id, state="delivered", attempts=attempts,
                                            next_attempt_at=row.next_attempt_at, last_error=None,
                                            delivered_at=int(now * NS))
            self.telemetry.attempts.labels(row.receiver, "delivered").inc()
            self.telemetry.latency.labels(row.receiver).observe(max(0.0, now - row.created_at / NS))
            log.info("alert %s (%s) delivered to %s after %d attempt(s)", row.idempotency_key[:12], row.status,
                     row.receiver, attempts)
            return
        if outcome.result == "dead" or attempts >= self.cfg.max_attempts:
            await self.store.record_attempt(row.id, state="dead", attempts=attempts,
                                            next_attempt_at=row.next_attempt_at, last_error=outcome.error)
            self.telemetry.attempts.labels(row.receiver, "dead").inc()
            log.error("alert %s (%s) to %s dead-lettered after %d attempt(s): %s (see /api/v1/alerts/outbox"
                      "?state=dead)", row.idempotency_key[:12], row.status, row.receiver, attempts, outcome.error)
            return
        delay = outcome.retry_after
        if delay is None:
            # Read from the configuration each time: a reload may change it.
            backoff = Backoff(self.cfg.backoff_initial_seconds, self.cfg.backoff_max_seconds)
            delay = backoff.delay(attempts, self.rng)
        await self.store.record_attempt(row.id, state="pending", attempts=attempts,
                                        next_attempt_at=int((now + delay) * NS), last_error=outcome.error)
        self.telemetry.attempts.labels(row.receiver, "retry").inc()
        log.warning("alert %s (%s) to %s failed: %s; attempt %d of %d, next in %.1f s", row.idempotency_key[:12],
                    row.status, row.receiver, outcome.error, attempts, self.cfg.max_attempts, delay)

    async def _post(self, row: OutboxRow, receiver: ReceiverConfig) -> Outcome:
        assert self._session is not None, "run() first"
        headers = self.notifiers[receiver.name].headers(row.body, row.idempotency_key, time.time())
        try:
            async with self._session.post(receiver.url or receiver.url_secret, data=row.body, headers=headers,
                                          allow_redirects=False,
                                          timeout=aiohttp.ClientTimeout(total=receiver.timeout_seconds)) as resp:
                text = (await resp.content.read(200)).decode("utf-8", "replace").strip()
                return _classify(resp.status, resp.headers.get("Retry-After"), "".join(
                    ch for ch in text if ch.isprintable()), self.clock())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return Outcome("retry", _describe(exc, receiver.timeout_seconds))
        except Exception as exc:  # whatever the receiver answered: an attempt that counts, never a jammed outbox
            log.warning("alert %s to %s: unexpected %s reading the answer", row.idempotency_key[:12], receiver.name,
                        exc.__class__.__name__)  # no message or traceback: they may hold the receiver's URL
            return Outcome("retry", f"unreadable answer ({exc.__class__.__name__})")
