"""Alerting in the collector: spike states in, notifications delivered out; one object the daemon wires.

The ingest pipeline calls :meth:`Alerting.observe` with every spike state
right after committing it. A routing task evaluates the router (at once, and
every second for its timers) and commits, in ONE transaction, the groups'
new state together with the notifications it decided on; the delivery task
sends the outbox. After a restart, :meth:`restore` reloads the groups and
silences and observes the stored state of every spike that is open, or that
the router still held as open: a spike committed just before the collector
was killed is routed now, and one that ended meanwhile gets its resolve
notice. Notifications already queued are sent by the delivery task.

``reload(cfg)`` swaps receivers and routes (the daemon calls it on SIGHUP);
the outbox and the state of groups whose route remains are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from spikehound.collector.alerts.notification import Notification
from spikehound.collector.alerts.outbox import OutboxDelivery
from spikehound.collector.alerts.routing import Decision, Router
from spikehound.collector.alerts.silences import Silence
from spikehound.collector.alerts.store import AlertStore
from spikehound.collector.alerts.telemetry import AlertTelemetry
from spikehound.collector.notifiers import notifier_for
from spikehound.collector.spike_profile import ALERT_BOUNDS, culprit_line
from spikehound.collector.storage_health import DATABASE_AWAY, StorageHealth
from spikehound.collector.writer_thread import WriterThread
from spikehound.config import Config
from spikehound.model import Spike
from spikehound.storage.alerts import OutboxEntry, OutboxRow
from spikehound.storage.reader import Reader
from spikehound.units import NS

log = logging.getLogger("spikehound.collector.alerts")

EVALUATE_SECONDS = 1.0
GAUGE_SECONDS = 15.0
RETENTION_SECONDS = 300.0
STOP_GRACE_SECONDS = 5.0
MAX_OPEN_SPIKES_READ = 100_000
# The profile line of an alert (collector/spike_profile.py) is read before the notification is rendered: at most
# this long per flush, so a slow database delays no alert by more, and for at most this many spikes a flush.
PROFILE_SECONDS = 2.0
PROFILE_SPIKES = 20


def public_url(cfg: Config, api_port: int) -> str:
    """Where links in alerts point: ``collector.public_url``, else the API's own address."""
    if cfg.collector.public_url:
        return cfg.collector.public_url.rstrip("/")
    host = cfg.collector.api.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{f'[{host}]' if ':' in host else host}:{api_port}"


class Alerting:
    def __init__(self, cfg: Config, engine: Engine, registry: CollectorRegistry, writer_thread: WriterThread, *,
                 clock: Callable[[], float] = time.time, health: StorageHealth | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        # The pipeline's view of storage: during an outage it has said so once, and alerting need not repeat it.
        self.health = health or StorageHealth()
        self.store = AlertStore(engine, writer_thread)
        self.router = Router(cfg.alerts, clock=clock)
        self.telemetry = AlertTelemetry(registry, lambda: self.router.counts)
        self.delivery = OutboxDelivery(cfg.alerts, self.store, self.telemetry, clock=clock, health=self.health)
        self.reader = Reader(engine)  # the profile lines of alerts
        self._profile_error_logged = False
        self._profile_read: asyncio.Future[dict[str, str]] | None = None  # the last read, maybe still running
        self._unsaved = Decision()
        self._event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._next_gauges = self._next_retention = 0.0

    @property
    def enabled(self) -> bool:
        return self.cfg.alerts.enabled

    async def restore(self, reader: Reader) -> None:
        """Continue after a restart: saved groups, active silences, and spikes the router has not seen end."""
        self.router.restore(await self.store.load_groups())
        rows = await self.store.silences(active_at=int(self.clock() * NS))
        self.router.set_silences(Silence.from_row(r) for r in rows)
        if not self.enabled:
            return
        open_spikes = await asyncio.to_thread(reader.spikes, None, None, None, "open", MAX_OPEN_SPIKES_READ)
        held = self.router.open_spike_ids() - {s.id for s in open_spikes}
        ended = await asyncio.to_thread(lambda: [s for s in map(reader.spike, sorted(held)) if s is not None])
        self.router.observe([*open_spikes, *ended])
        if open_spikes or ended or self.router.groups:
            log.info("alerting restored: %d alert groups, %d open spikes, %d spikes ended while away",
                     len(self.router.groups), len(open_spikes), len(ended))

    def observe(self, spikes: Iterable[Spike]) -> None:
        """The pipeline's spike listener (on the event loop, after the spikes were committed)."""
        if not self.enabled:
            return
        self.router.observe(spikes)
        self._event.set()

    def start(self, base_url: str) -> None:
        """Start routing and delivery; ``base_url`` is where links in alerts point (collector.public_url)."""
        self.router.base_url = base_url.rstrip("/")
        if not self.enabled:
            log.info("alerts are disabled (alerts.enabled = false): spikes are stored, nothing is sent")
            return
        if not self.cfg.alerts.routes:
            log.info("no alert routes configured (alerts.routes): spikes are stored, nothing is sent")
        self._tasks = [asyncio.create_task(self._route_loop(), name="alert-routing"),
                       asyncio.create_task(self.delivery.run(), name="alert-delivery")]

    def reload(self, cfg: Config) -> None:
        """New receivers and routes (SIGHUP): the outbox and the state of remaining routes are kept."""
        self.cfg = cfg
        self.router.reload(cfg.alerts)
        self.delivery.reload(cfg.alerts)
        self._event.set()
        log.info("alert routes reloaded: %d receivers, %d routes", len(cfg.alerts.receivers), len(cfg.alerts.routes))

    async def stop(self) -> None:
        """Commit what routing decided last, then let deliveries in flight finish (briefly)."""
        await self._end_tasks()
        if self.enabled:
            await self.flush()

    async def lead(self, reader: Reader, base_url: str) -> None:
        """This collector has become its cluster's leader: route from the shared state (alert groups, silences,
        open spikes, as the last leader committed them) and deliver the shared outbox."""
        self._reset()
        await self.restore(reader)
        self.start(base_url)

    async def follow(self) -> None:
        """No longer the leader: stop routing and delivering, and commit nothing more. What was decided and not
        committed, the new leader decides again from the shared state; a notification cut off mid-send stays
        pending in the outbox, and the new leader sends it with the same Idempotency-Key."""
        await self._end_tasks()
        self._reset()

    async def _end_tasks(self) -> None:
        self._stopping = True
        self._event.set()
        self.delivery.stop()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_GRACE_SECONDS)
            for task in pending:  # a notification cut off here stays pending and is sent after the restart
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks = []

    def _reset(self) -> None:
        """Routing as a fresh start has it (``restore`` fills it from storage)."""
        self.router = Router(self.cfg.alerts, clock=self.clock)
        self.delivery = OutboxDelivery(self.cfg.alerts, self.store, self.telemetry, clock=self.clock,
                                       health=self.health)
        self._unsaved = Decision()
        self._event = asyncio.Event()
        self._stopping = False

    # -- routing -------------------------------------------------------------------------------

    async def _route_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), EVALUATE_SECONDS)
            self._event.clear()
            await self.flush()
            await self._housekeeping()

    async def flush(self) -> None:
        """Evaluate the router and commit its decision with the notifications it made."""
        self._unsaved.merge(self.router.evaluate())
        decision = self._unsaved
        if not decision:
            return
        entries = []
        for note in await self._with_profiles(decision.notifications):
            receiver = next((r for r in self.cfg.alerts.receivers if r.name == note.receiver), None)
            if receiver is None:
                log.error("alert for group %s dropped: receiver %r is not configured", note.group_key, note.receiver)
                continue
            entries.append(OutboxEntry(note.idempotency_key, note.receiver, note.route, note.group_id, note.status,
                                       notifier_for(receiver).render(note)))
        try:
            added = await self.store.commit_routing(
                groups=[(gid, route, state) for gid, (route, state) in decision.saved.items()],
                removed=sorted(decision.removed), outbox=entries, now_ns=int(self.clock() * NS))
        except Exception as exc:
            self.telemetry.state_errors.inc()
            self.health.note("saving alert state (retried; nothing is lost)", exc)
            return
        self._unsaved = Decision()
        for note in decision.notifications:
            self.telemetry.notifications.labels(note.route, note.status).inc()
            log.info("alert %s queued for %s: %s %s (%d streams)", note.idempotency_key[:12], note.receiver,
                     note.status, note.group_key, len(note.alerts))
        if added:
            self.delivery.wake()

    async def _with_profiles(self, notes: Sequence[Notification]) -> list[Notification]:
        """``notes`` with a ``profile`` annotation on each alert whose spike's profile names a clear culprit.

        Never fails and never holds routing long: a read that errs or takes over PROFILE_SECONDS costs the
        line only (counted in spikehound_alert_profile_errors, logged once).
        """
        spikes = {a.spike.id: a.spike for n in notes for a in n.alerts if "profile" not in a.annotations}
        if not spikes:
            return list(notes)
        if self._profile_read is not None and not self._profile_read.done():
            # A read that timed out still holds a thread (a hung database): no second one beside it.
            self._profile_failed(f"an earlier read is still running after {PROFILE_SECONDS:g} s")
            return list(notes)
        read = asyncio.ensure_future(asyncio.to_thread(self._profile_lines, list(spikes.values())[:PROFILE_SPIKES]))
        self._profile_read = read
        try:
            lines = await asyncio.wait_for(asyncio.shield(read), PROFILE_SECONDS)
        except TimeoutError:
            self._profile_failed(f"no answer within {PROFILE_SECONDS:g} s")
            return list(notes)
        if not lines:
            return list(notes)
        return [dataclasses.replace(n, alerts=tuple(
            dataclasses.replace(a, annotations={**a.annotations, "profile": lines[a.spike.id]})
            if a.spike.id in lines else a for a in n.alerts)) for n in notes]

    def _profile_lines(self, spikes: list[Spike]) -> dict[str, str]:
        """On a worker thread: the culprit line of each spike that has one.

        Each diff is held to ALERT_BOUNDS (a fixed amount of memory) and to what is left of the flush's
        PROFILE_SECONDS, so a read the flush stopped waiting for does not run on beside the next one.
        """
        lines: dict[str, str] = {}
        now_ns = int(self.clock() * NS)
        until = time.monotonic() + PROFILE_SECONDS
        for spike in spikes:
            left = until - time.monotonic()
            if left <= 0:
                break
            try:
                line = culprit_line(self.reader, spike, now_ns, dataclasses.replace(ALERT_BOUNDS, seconds=left))
            except DATABASE_AWAY as exc:
                self.health.note("reading profiles for an alert (sent without the profile line)", exc)
                self._profile_failed(None)
                return lines
            except Exception as exc:
                self._profile_failed(f"{exc.__class__.__name__}: {exc}")
                continue
            if line:
                lines[spike.id] = line
        return lines

    def _profile_failed(self, why: str | None) -> None:
        self.telemetry.profile_errors.inc()
        if why is not None and not self._profile_error_logged:
            self._profile_error_logged = True
            log.warning("alerts are sent without their profile line: %s (said once; counted in "
                        "spikehound_alert_profile_errors_total)", why)

    async def _housekeeping(self) -> None:
        now = self.clock()
        try:
            if now >= self._next_gauges:
                self._next_gauges = now + GAUGE_SECONDS
                counts = await self.store.count_by_state()
                for state in ("pending", "delivered", "dead"):
                    self.telemetry.outbox.labels(state).set(counts.get(state, 0))
                # From storage, not only this collector's own: in a cluster a silence may be created through
                # any collector's API, and the leader routes.
                rows = await self.store.silences(active_at=int(now * NS))
                self.router.set_silences(Silence.from_row(r) for r in rows)
            if now >= self._next_retention:
                self._next_retention = now + RETENTION_SECONDS
                keep = self.cfg.alerts.delivered_retention_hours * 3600
                await self.store.expire_delivered(int((now - keep) * NS))
        except Exception as exc:
            self.health.note("alert housekeeping", exc)

    # -- silences and the outbox, for the API --------------------------------------------------

    async def create_silence(self, body: Any) -> Silence:
        """Store a silence from the API's POST body (ValueError says what is wrong) and apply it at once."""
        silence = Silence.parse(body, int(self.clock() * NS))
        await self.store.insert_silence(silence.to_row())
        self.router.set_silences([*self.router.silences, silence])
        self._event.set()
        log.info("silence %s created by %s until %s: %s", silence.id, silence.created_by or "(unnamed)",
                 time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(silence.ends_at / NS)), silence.matchers)
        return silence

    async def silences(self, include_expired: bool) -> list[Silence]:
        active_at = None if include_expired else int(self.clock() * NS)
        return [Silence.from_row(r) for r in await self.store.silences(active_at=active_at)]

    async def expire_silence(self, silence_id: str) -> Silence | None:
        now_ns = int(self.clock() * NS)
        if not await self.store.expire_silence(silence_id, now_ns):
            return None
        self.router.set_silences(s for s in self.router.silences if s.id != silence_id)
        self._event.set()
        log.info("silence %s ended", silence_id)
        row = await self.store.silence(silence_id)
        return Silence.from_row(row) if row is not None else None

    async def outbox(self, state: str | None, limit: int) -> list[OutboxRow]:
        return await self.store.outbox(state, limit)

    async def outbox_row(self, row_id: int) -> OutboxRow | None:
        return await self.store.outbox_row(row_id)

    async def retry(self, row_id: int) -> bool:
        done = await self.store.requeue(row_id, int(self.clock() * NS))
        if done:
            self.delivery.wake()
        return done
