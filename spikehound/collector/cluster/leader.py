"""The cluster's detection leader: one collector at a time runs the detectors over every member's data.

Every member stores what its agents route to it and adds a row to its feed per commit (``storage/cluster.py``).
The member that holds the leader's lock reads every member's feed after its cursors, merges the members' rows in
the order the database received them, and feeds them through the same :class:`DetectionDriver` a single collector
runs, so a cluster finds the spikes, streams and causes one collector fed the same data would. Its windows,
spikes and checkpoints are written in transactions that first check that it still leads; its checkpoint holds the
cursors, so a new leader continues where the last one checkpointed and reads again what came after: spike ids are
deterministic and every write an upsert, so nothing is lost or written twice. Alerting routes and delivers on the
leader only (the outbox is shared; notifications keep their idempotency keys).

Why not merge per-member summaries (sketches) instead: the detectors judge windows *and* request-by-request
evidence (the sequential test), and attribute each slow request from its whole trace against the stream's
normal profile; a summary of a window cannot carry either, and a cluster would then find other spikes than
one collector. What the leader pays instead is decoding and judging every span, which bounds how much traffic a
cluster can judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine

from spikehound.collector.alerts.alerting import Alerting
from spikehound.collector.detection_driver import CHECKPOINT_NAME, DetectionDriver, DriverSettings
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.config import Config
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection
from spikehound.heap import release_free_heap
from spikehound.model import MetricPoint, Span
from spikehound.otlp import spans_of_block
from spikehound.storage import checkpoints, cluster
from spikehound.storage.reader import Reader
from spikehound.storage.writer import Writer

log = logging.getLogger("spikehound.collector.cluster")

FEED_ROWS = 32  # feed rows read per member and poll
POLL_SECONDS = 0.25
PRUNE_MEMBERS_SECONDS = 86_400.0  # a member silent this long, with nothing left in the feed, is forgotten
NO_LEADER_CHECK_SECONDS = 5.0  # a member that may not lead looks this often whether another does
T = TypeVar("T")


class LostLead(Exception):
    """Another collector holds the leader's lock now."""


@dataclass(slots=True)
class _Row:
    """A member's feed row, read and decoded (it may wait for a member that has more to read)."""

    member: str
    seq: int
    written_ns: int  # database clock
    spans: list[Span]
    points: list[MetricPoint]


class DetectionLeader:
    """A component: campaigns for the leader's lock from ``start`` to ``stop``; leads while it holds it.

    ``leading`` says whether it leads now (retention runs on the leader only). Its database work and the
    detection driver run on one thread of its own, never on the event loop or the member's writer thread.
    """

    name = "detection leader"

    def __init__(self, cfg: Config, engine: Engine, member: str, telemetry: CollectorTelemetry,
                 alerting: Alerting | None, links: Callable[[], str], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.engine = engine
        self.member = member
        self.alerting = alerting
        self.links = links
        self.clock = clock
        # Idle time moves event time on under a hold: a missing member holds the windows until it is gone.
        self.driver = DetectionDriver(DriverSettings.from_config(cfg), telemetry, advance_while_held=True,
                                      clock=clock)
        self.metrics = ClusterMetrics(self)
        self.writer = Writer(engine)
        self.reader = Reader(engine)
        self.leading = False
        self.takeovers = 0
        self.members_live = 0
        self.feed_rows = 0
        self.feed_spans = 0
        self._cursors: dict[str, int] = {}  # per member: its last feed row fed to the detectors
        self._fetched: dict[str, int] = {}  # per member: its last feed row read
        self._waiting: dict[str, deque[_Row]] = {}
        # Members the windows wait for: heartbeats stopped, not yet gone (name -> since when, by clock()) ...
        self._missing: dict[str, float] = {}
        self._started: dict[str, int] = {}  # ... and each member's start, to see it restart
        self._gone: set[str] = set()  # missing past cluster.member_gone_seconds (said once)
        self._last_spans = clock()  # when the feed last brought spans
        self._campaign_error: str | None = None  # the kind of the last failure, logged once while it repeats
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spikehound-leader")

    async def start(self) -> None:
        if not self.cfg.cluster.lead:
            log.info("%s stores its share and never leads detection (cluster.lead = false)", self.member)
            self._task = asyncio.create_task(self._watch_for_a_leader(), name="detection-leader-watch")
            return
        self._task = asyncio.create_task(self._campaign(), name="detection-leader")

    async def _watch_for_a_leader(self) -> None:
        """On a member that may not lead: say when no member leads (nothing is judged, alerted or deleted)."""
        missing_since: float | None = None
        said = False
        while not self._stop.is_set():
            try:
                present = await asyncio.to_thread(self._leader_present)
            except Exception:  # the database away: the pipeline says so
                present = True
            if present:
                missing_since, said = None, False
            else:
                missing_since = missing_since if missing_since is not None else self.clock()
                if not said and self.clock() - missing_since > self.cfg.cluster.member_timeout_seconds:
                    said = True
                    log.warning("no collector leads the cluster: nothing is judged, no alert is sent, retention "
                                "does not run (every member up has cluster.lead = false?)")
            await self._pause(NO_LEADER_CHECK_SECONDS)

    def _leader_present(self) -> bool:
        with self.engine.connect() as conn:
            return cluster.leader_present(conn)

    async def stop(self) -> None:
        """Stop campaigning; a leader writes what it closed, saves its checkpoint and lets go of the lock."""
        self._stop.set()
        if self._task is not None:
            await self._task
        await asyncio.to_thread(self._executor.shutdown, True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # -- the campaign ------------------------------------------------------------------------------

    async def _campaign(self) -> None:
        conn: Connection | None = None  # a follower keeps its session between tries
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = await self._run(cluster.leader_session, self.engine)
                if await self._run(cluster.try_lead, conn):
                    try:
                        previous = await self._run(cluster.claim_lead, conn, self.member)
                        await self._lead(conn, previous)
                    finally:
                        # Closed, not returned to the pool: the session, and the lock, end with it.
                        await self._run(_discard, conn)
                        conn = None
                else:
                    await self._depose_silent_leader(conn)
                self._campaign_error = None
            except LostLead as exc:
                log.warning("no longer the detection leader: %s", exc)
            except Exception as exc:  # its session ended, or the database is away: campaign again; never die
                # Not a storage outage of this member's: its own writes tell the pipeline that, if it is one.
                if self.leading:
                    log.warning("no longer the detection leader: %s: %s", exc.__class__.__name__, exc)
                elif self._campaign_error != exc.__class__.__name__:
                    log.warning("cannot campaign for the detection leader's lock (tried again every %g s): %s: %s",
                                self.cfg.cluster.heartbeat_seconds, exc.__class__.__name__, exc)
                self._campaign_error = exc.__class__.__name__
                if conn is not None:
                    await self._run(_discard, conn)
                    conn = None
            finally:
                if self.leading:
                    await self._step_down()
            await self._pause(self.cfg.cluster.heartbeat_seconds)
        if conn is not None:
            await self._run(_discard, conn)

    async def _depose_silent_leader(self, conn: Connection) -> None:
        timeout = self.cfg.cluster.member_timeout_seconds
        deposed = await self._run(cluster.depose_silent_leader, conn, timeout)
        if deposed is not None:
            log.warning("the detection leader %s has sent no heartbeat for %g s (a hung or stopped process keeps "
                        "its database session): its session was ended, so that another collector leads",
                        deposed, timeout)

    async def _lead(self, conn: Connection, previous: str | None) -> None:
        self.leading = True
        self.takeovers += 1
        started = time.perf_counter()
        await self._run(self._take_over, conn, previous)
        detection = self.driver.detection
        log.warning("%s leads detection now: %d streams, %d open spikes, in %.2f s", self.member,
                    detection.stats()["judged_streams"], len(detection.open_spikes()), time.perf_counter() - started)
        if self.alerting is not None and self.alerting.enabled:
            await self.alerting.lead(self.reader, self.links())
        self._last_spans = self.clock()
        next_checkpoint = self.clock() + self.cfg.detection.checkpoint_seconds
        while not self._stop.is_set():
            fed, done = await self._run(self._step, conn)
            self.driver.written(done)
            if self.clock() >= next_checkpoint:
                next_checkpoint = self.clock() + self.cfg.detection.checkpoint_seconds
                await self._run(self._checkpoint, conn)
            if not fed:
                await self._pause(POLL_SECONDS)
        # Stopping: what is in the feed now is for the next leader; what was judged is saved, and so is what
        # routing decided last, while this collector still leads.
        await self._run(self._checkpoint, conn)
        if self.alerting is not None and self.alerting.enabled:
            await self.alerting.stop()
        await self._run(cluster.release_lead, conn)

    async def _step_down(self) -> None:
        self.leading = False
        if self.alerting is not None and self.alerting.enabled:
            await self.alerting.follow()
        self.driver.reset()  # the next lead restores from storage
        self._waiting.clear()

    # -- on the leader's thread ------------------------------------------------------------------

    def _take_over(self, conn: Connection, previous: str | None) -> None:
        """Continue from the checkpoint and its cursors; refill the recent traces of the open windows.

        The previous leader (another member) is held missing until its heartbeats say otherwise: if it died,
        its agents hold its share, and the windows must not close over it while the feed is replayed.
        """
        with conn.begin():
            found = checkpoints.load(conn, CHECKPOINT_NAME)
            cursors = cluster.load_cursors(conn)
        restored = self.driver.restore(found)
        self._cursors, self._fetched, self._waiting = dict(cursors), dict(cursors), {}
        self._missing, self._started, self._gone = {}, {}, set()
        if previous is not None and previous != self.member:
            log.info("the windows wait for the previous leader %s's heartbeats: if it died, its agents hold its "
                     "share of the traffic", previous)
            self._missing[previous] = self.clock()
            self.driver.hold()
        if restored and found is not None:
            # Up to the checkpoint's position, but for the blocks the feed still holds after the cursors: the
            # detectors are fed those, windows too.
            with conn.begin():
                pending = cluster.pending_block_ids(conn, cursors)
            self.driver.refill_traces(self.reader, found, exclude=pending)
        # Open before the takeover: the replay of the feed finds them again (same ids), not as new spikes.
        self.driver.knows_open([s.id for s in self.reader.spikes(None, None, None, "open", 10_000)])

    def _step(self, conn: Connection) -> tuple[int, Detection]:
        """Feed what the members committed since the last step, close what the watermark allows, and write it;
        (feed rows fed, what was written).

        Each feed row is one commit of a member; they are fed one at a time in the order the database
        received them, as one collector feeds its own commits: a cluster then counts the same spans late and
        closes the same windows one collector would.
        """
        rows = self._read(conn)
        for row in rows:
            self.driver.feed(row.spans, row.points)
        spans = any(row.spans for row in rows)
        if spans:
            self._last_spans = self.clock()
        # The windows wait for a missing member; input is busy while rows wait for another member's read.
        self.driver.step(self.clock() - self._last_spans, source_waits=bool(self._missing),
                         busy=spans or any(self._waiting.values()))
        done = self.driver.take_outgoing()
        if done.windows or done.spikes:
            with conn.begin():
                self._fence(conn)
                self.writer.write_detection(conn, done.windows, done.spikes)
        return len(rows), done

    def _watch(self, members: list[cluster.Member]) -> None:
        """Hold the windows while a member is missing: its heartbeats stopped (it died, hangs, or lost the
        database) and it is not yet gone. Its agents hold its share meanwhile; windows closed over it would
        count that share late. Gone after ``cluster.member_gone_seconds``: the windows close without it
        (judged on the others' share). Back after a restart, or after longer than the lateness allowed, its
        agents' backlog arrives: the windows wait for it as one collector waits for its senders' backlogs
        after a restart (CatchUp)."""
        k, now = self.cfg.cluster, self.clock()
        late = 2 * k.heartbeat_seconds
        for m in members:
            started = self._started.get(m.member)
            restarted = started is not None and m.started_at != started
            self._started[m.member] = m.started_at
            since = self._missing.get(m.member)
            if m.age_s > k.member_gone_seconds:
                if m.member not in self._gone and (since is not None or started is not None):
                    log.warning("member %s is gone (no heartbeat for %.0f s): the windows close without its share "
                                "until it is back", m.member, m.age_s)
                self._missing.pop(m.member, None)
                self._gone.add(m.member)
            elif m.age_s > late:
                if since is None:
                    log.warning("member %s has sent no heartbeat for %.1f s: the windows wait for it (at most "
                                "cluster.member_gone_seconds, %g s)", m.member, m.age_s, k.member_gone_seconds)
                    self._missing[m.member] = now
            elif since is not None and now - since < late + POLL_SECONDS and not restarted:
                pass  # a previous leader, held missing at the takeover, until its heartbeats say
            else:
                away = now - since if since is not None else 0.0
                self._missing.pop(m.member, None)
                if restarted or m.member in self._gone or away > self.cfg.collector.allowed_lateness_seconds:
                    log.info("member %s is back: the windows wait for its agents' backlogs", m.member)
                    self.driver.begin_catch_up()
                self._gone.discard(m.member)
        if self._missing or self.driver.catch_up.active:
            self.driver.hold()

    def _read(self, conn: Connection) -> list[_Row]:
        """The members' new feed rows, decoded, in the order the database received them; cursors move past them.

        A member whose read filled ``FEED_ROWS`` has more to come: the others' rows received after its last one
        wait for the next read (a backlog after a takeover is then fed interleaved, not a member at a time).
        """
        timeout = self.cfg.cluster.member_timeout_seconds
        with conn.begin():
            members = cluster.members(conn)
            rows = cluster.read_feed(conn, self._fetched, cluster.feed_members(conn), FEED_ROWS)
            payloads = cluster.block_payloads(conn, [i for r in rows for i in r.block_ids])
        self.members_live = sum(1 for m in members if m.age_s < timeout)
        self._watch(members)
        read = Counter(r.member for r in rows)
        for r in rows:
            spans = [s for i in r.block_ids if (p := payloads.get(i)) is not None for s in spans_of_block(p)]
            points = cluster.unpack_points(r.points) if r.points else []
            self._waiting.setdefault(r.member, deque()).append(_Row(r.member, r.seq, r.written_ns, spans, points))
            self._fetched[r.member] = r.seq
        more = [q[-1].written_ns for m, q in self._waiting.items() if q and read[m] >= FEED_ROWS]
        bound = min(more) if more else None
        ready: list[_Row] = []
        for queue in self._waiting.values():
            while queue and (bound is None or queue[0].written_ns <= bound):
                ready.append(queue.popleft())
        ready.sort(key=lambda row: (row.written_ns, row.member, row.seq))
        for row in ready:
            self._cursors[row.member] = max(row.seq, self._cursors.get(row.member, 0))
        self.feed_rows += len(ready)
        self.feed_spans += sum(len(row.spans) for row in ready)
        return ready

    def _checkpoint(self, conn: Connection) -> None:
        """The detectors' state and the cursors, in one transaction; then the feed rows they consumed go."""
        state = self.driver.snapshot()
        with conn.begin():
            self._fence(conn)
            checkpoints.save_on(conn, CHECKPOINT_NAME, CHECKPOINT_FORMAT, state, checkpoints.latest_block_id(conn),
                                None)
            cluster.save_cursors(conn, self._cursors)
        with conn.begin():
            cluster.trim_feed(conn, self._cursors)
            cluster.prune_members(conn, PRUNE_MEMBERS_SECONDS)
        release_free_heap()  # the pickle's tens of MB (spikehound/heap.py)

    def _fence(self, conn: Connection) -> None:
        if not cluster.still_leading(conn):
            raise LostLead("another collector holds the leader's lock")


def _discard(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.invalidate()
    with contextlib.suppress(Exception):
        conn.close()


class ClusterMetrics(Collector):
    """``spikehound_cluster_*``: whether this collector leads, the live members, what its leadership fed."""

    def __init__(self, leader: DetectionLeader) -> None:
        self.leader = leader

    def collect(self) -> Iterator[Metric]:
        leader = self.leader
        yield GaugeMetricFamily("spikehound_cluster_leader", "1 while this collector is the detection leader.",
                                value=int(leader.leading))
        yield GaugeMetricFamily("spikehound_cluster_members",
                                "Members whose heartbeat is recent, as the leader last read them (0 on others).",
                                value=leader.members_live if leader.leading else 0)
        yield CounterMetricFamily("spikehound_cluster_leader_takeovers",
                                  "Times this collector became the detection leader.", value=leader.takeovers)
        yield CounterMetricFamily("spikehound_cluster_feed_rows",
                                  "Members' feed rows this collector fed to the detectors while leading.",
                                  value=leader.feed_rows)
        yield CounterMetricFamily("spikehound_cluster_feed_spans",
                                  "Spans this collector fed to the detectors from the members' feeds while leading.",
                                  value=leader.feed_spans)
