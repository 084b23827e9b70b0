"""Detection across faults: retried exports, a SIGKILL between checkpoints, senders' backlogs after an episode.

Each gives the same windows and spikes as a fault-free run of the same data.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, select

from harness.daemons import collector_config
from harness.scenarios.traffic import Scenario
from spikehound.collector import commit_feed
from spikehound.collector.alerts.routing import Router
from spikehound.collector.daemon import single_collector_pipeline
from spikehound.collector.ingest_queue import IngestQueue
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.config import AlertsConfig, ReceiverConfig, RouteConfig
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.resource import ResourceWatch
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import MetricKind, MetricPoint, Span, Spike
from spikehound.otlp import encode_spans
from spikehound.storage import schema
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.alert_spikes import ended, spike

NS = 1_000_000_000


def _spans(minutes: float = 2.0, name: str = "steady") -> list[list[Span]]:
    return [b.spans for b in Scenario(name, seed=3, minutes=minutes, rate=10).batches() if b.spans]


def test_spans_seen_twice_do_not_change_the_windows():
    once, twice = DetectionEngine(DetectionSettings()), DetectionEngine(DetectionSettings())
    batches = _spans()
    for i, spans in enumerate(batches):
        once.add(spans)
        once.advance()
        twice.add(spans)
        if i:
            twice.add(batches[i - 1])  # the previous export again: its commit succeeded, its answer was lost
        twice.advance()
    assert once.flush().windows == twice.flush().windows
    assert twice.stats()["duplicate_spans"] > 0
    assert once.stats()["duplicate_spans"] == 0


def _slow_db_spikes(restart_at_s: int | None = None, hold_at_s: int | None = None) -> list[Spike]:
    """The spikes of a one-minute fault, each in its last state, as one engine finds them: restarted at
    ``restart_at_s`` from its checkpoint with the open windows' traces read back (as a restart or a leader's
    takeover does), and with event time held at ``hold_at_s`` at the end, then let go (a leader waiting for a
    member): the windows after the fault then close in two steps, not one."""
    settings = DetectionSettings(allowed_lateness_ns=30 * NS)
    scenario = Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)
    engine, fed, last = DetectionEngine(settings), [], {}
    for i, batch in enumerate(scenario.batches()):
        if i == restart_at_s:
            engine = DetectionEngine.restore(settings, engine.snapshot())
            since = engine.windows.earliest_open_ns - settings.window_ns
            engine.traces.add([sp for sp in fed if sp.end_unix_nano >= since])
        engine.add(batch.spans, batch.points)
        fed.extend(batch.spans)
        last.update((sp.id, sp) for sp in engine.advance().spikes)
    if hold_at_s is not None:
        engine.hold(scenario.start_ns + hold_at_s * NS)
        last.update((sp.id, sp) for sp in engine.advance(100 * NS).spikes)
        engine.hold(None)
    last.update((sp.id, sp) for sp in engine.flush().spikes)
    return list(last.values())


def test_a_spike_is_stored_alike_however_its_windows_were_stepped_through_and_restarted():
    reference = _slow_db_spikes()
    assert [(sp.state, len(sp.exemplar_trace_ids)) for sp in reference] == [("resolved", 2)]
    for restart_at_s, hold_at_s in ((252, None), (None, 290), (252, 290)):
        assert _slow_db_spikes(restart_at_s, hold_at_s) == reference, (restart_at_s, hold_at_s)


def test_metric_points_seen_twice_do_not_change_resource_detection():
    """A delta counter's rate would double if a retried export's points counted again."""
    def point(second: int, value: float) -> MetricPoint:
        return MetricPoint(host="gpu-1", name="nvidia.gpu.xid.errors", attributes={}, time_unix_nano=second * NS,
                           value=value, kind=MetricKind.SUM_DELTA)

    once, twice = ResourceWatch(window_ns=10 * NS), ResourceWatch(window_ns=10 * NS)
    for second in range(0, 600, 5):
        value = 50.0 if 400 <= second < 420 else 0.0
        once.add([point(second, value)])
        twice.add([point(second, value), point(second, value)])
        if second >= 5:
            twice.add([point(second - 5, 0.0 if second - 5 < 400 or second - 5 >= 420 else 50.0)])
        assert once.close(second * NS) == twice.close(second * NS)
    assert twice.duplicate_points > 0 and once.duplicate_points == 0
    assert once.flags(None, 0, 600 * NS), "the burst is flagged"


class _Run:
    """A single collector's pipeline and detection over a real Writer and WriterThread, on a clock the test
    steps."""

    def __init__(self, engine: Engine, **settings: Any) -> None:
        # In this process: the tests read the detectors' state right after a commit.
        settings.setdefault("detection__own_process", False)
        self.cfg = collector_config("sqlite://", collector__idle_flush_seconds=3600, **settings)
        self.engine = engine
        self.now = [0.0]

    async def start(self) -> None:
        self.queue = IngestQueue(capacity=1 << 30)
        self.telemetry = CollectorTelemetry()
        self.writer_thread = WriterThread()
        await self.writer_thread.start()
        self.pipeline, self.detection = single_collector_pipeline(
            self.cfg, Writer(self.engine), self.queue, self.writer_thread, self.telemetry,
            StorageHealth(self.telemetry), clock=lambda: self.now[0])
        await self.pipeline.start()

    async def send(self, batches: Sequence[list[Span]], points: Sequence[list[MetricPoint]] = ()) -> None:
        """One request at a time, each committed before the next, as one sender's; ``points[i]`` with
        ``batches[i]``."""
        for i, spans in enumerate(batches):
            sub = self.queue.offer(spans, points[i] if points else [], encode_spans(spans).SerializeToString())
            await asyncio.wait_for(sub.committed, 30)

    async def stop(self) -> None:
        await asyncio.wait_for(self.pipeline.stop(), 60)
        await self.writer_thread.stop()

    async def kill(self) -> None:
        """As SIGKILL leaves it: nothing after the last commit is written, no checkpoint is saved."""
        task = self.pipeline._task
        assert task is not None
        self.pipeline._stopping = True  # so that the cancelled task is not reported as a failure
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.writer_thread.stop()


def _stored(engine: Engine) -> tuple[list[tuple[Any, ...]], list[tuple[str, str, int, int | None, str]]]:
    w = schema.latency_windows
    with engine.connect() as conn:
        windows = [tuple(r) for r in conn.execute(select(w).order_by(*w.primary_key.columns))]
    spikes = sorted((s.id, s.state, s.start_unix_nano, s.end_unix_nano, s.causes[0].summary if s.causes else "")
                    for s in Reader(engine).spikes(None, None, None, None, 10_000))
    return windows, spikes


def _clear(engine: Engine) -> None:
    with engine.begin() as conn:
        for table in reversed(schema.metadata.sorted_tables):
            if table.name != "alembic_version":
                conn.execute(table.delete())


# In the collector's process: the detection process's restarts are the default of every collector-process test
# (test_detection_live.py, test_storage_faults.py) and of tests/test_detection_process.py.
@pytest.mark.parametrize("saved_at", [380, 0], ids=["after-a-checkpoint", "before-the-first-checkpoint"])
def test_a_restart_after_sigkill_replays_what_was_committed_after_the_checkpoint(engine: Engine, saved_at: int):
    # The second case: killed before its first periodic checkpoint (the one it saves as it starts is all there
    # is), as a collector in a crash loop always is.
    batches = [b.spans for b in Scenario("slow_db", seed=1, minutes=9, onset_s=400, rate=8).batches() if b.spans]
    killed_at = 450  # the spike opens in between

    async def uninterrupted() -> None:
        run = _Run(engine, collector__catch_up_seconds=0)
        await run.start()
        await run.send(batches)
        await run.stop()

    async def killed() -> None:
        run = _Run(engine, collector__catch_up_seconds=0)
        await run.start()
        await run.send(batches[:saved_at])
        if saved_at:
            await run.detection.checkpoint(run.pipeline.flush)
        await run.send(batches[saved_at:killed_at])
        await run.kill()
        again = _Run(engine, collector__catch_up_seconds=0)
        await again.start()
        assert again.detection.stats()["duplicate_spans"] == 0
        await again.send(batches[killed_at:])
        await again.stop()

    asyncio.run(uninterrupted())
    expected = _stored(engine)
    _clear(engine)
    asyncio.run(killed())
    windows, spikes = _stored(engine)
    assert len(windows) == len(expected[0]) and windows == expected[0]
    assert spikes == expected[1]
    assert expected[1], "the scenario opens a spike"


def test_a_replay_after_a_restart_closes_the_windows_as_they_closed_before_the_kill(engine: Engine):
    """With the catch-up on (the default): what was committed after the checkpoint is replayed as it came, the
    windows closing as they did live; only then are they held for the senders' backlogs. Held through the
    replay, every replayed request stayed in memory until the catch-up ended, and the detection process kept
    that much for the rest of its life (the soak: hundreds of MB after a restart under load)."""
    batches = [b.spans for b in Scenario("slow_db", seed=1, minutes=9, onset_s=400, rate=8).batches() if b.spans]
    saved_at, killed_at = 300, 450  # 150 s committed after the checkpoint: fifteen 10 s windows

    async def uninterrupted() -> int:
        run = _Run(engine)
        await run.start()
        await run.send(batches[:killed_at])
        at_the_kill = run.detection.driver.detection.windows.open_windows
        await run.send(batches[killed_at:])
        await run.stop()
        return at_the_kill

    async def killed() -> int:
        run = _Run(engine)
        await run.start()
        await run.send(batches[:saved_at])
        await run.detection.checkpoint(run.pipeline.flush)
        await run.send(batches[saved_at:killed_at])
        await run.kill()
        again = _Run(engine)
        await again.start()
        driver = again.detection.driver
        after_the_replay = driver.detection.windows.open_windows
        assert driver.detection.windows.hold is not None, "held for the backlogs after the replay"
        again.now[0] += again.cfg.collector.catch_up_seconds
        await again.send(batches[killed_at:])
        await again.stop()
        return after_the_replay

    live_open = asyncio.run(uninterrupted())
    expected = _stored(engine)
    _clear(engine)
    replayed_open = asyncio.run(killed())
    assert replayed_open == live_open, (replayed_open, live_open)
    windows, spikes = _stored(engine)
    assert windows == expected[0] and spikes == expected[1]
    assert expected[1], "the scenario opens a spike"


def test_metric_points_committed_after_the_checkpoint_are_replayed_before_any_window_closes(
        engine: Engine, monkeypatch: pytest.MonkeyPatch):
    """Points are read back by series, not by time: replayed after the spans, or with the spans' windows free to
    close, one series' later points would close the windows that another's still fill, and the GPU drop
    behind a spike would be missed."""
    monkeypatch.setattr(commit_feed, "REPLAY_POINTS", 40)  # many reads, each a few series' worth
    timeline = [b for b in Scenario("gpu_drop", seed=2, minutes=9, onset_s=330, fault_s=60, rate=8).batches()
                if b.spans]
    batches, points = [b.spans for b in timeline], [b.points for b in timeline]
    saved_at, killed_at = 300, 450  # the drop, and the spike it causes, begin and end between the two

    async def uninterrupted() -> None:
        run = _Run(engine)
        await run.start()
        await run.send(batches, points)
        await run.stop()

    async def killed() -> int:
        run = _Run(engine)
        await run.start()
        await run.send(batches[:saved_at], points[:saved_at])
        await run.detection.checkpoint(run.pipeline.flush)
        await run.send(batches[saved_at:killed_at], points[saved_at:killed_at])
        await run.kill()
        again = _Run(engine)
        await again.start()
        late = again.detection.stats()["resource_late_points"]
        again.now[0] += again.cfg.collector.catch_up_seconds
        await again.send(batches[killed_at:], points[killed_at:])
        await again.stop()
        return late

    asyncio.run(uninterrupted())
    expected = _stored(engine)
    _clear(engine)
    assert asyncio.run(killed()) == 0, "no replayed point came too late for its window"
    windows, spikes = _stored(engine)
    assert windows == expected[0] and spikes == expected[1]
    assert expected[1] and all("GPU utilization" in summary for *_, summary in expected[1]), expected[1]


def _split(batches: list[list[Span]]) -> tuple[list[list[Span]], list[list[Span]]]:
    """Two senders' exports of the same traffic: each trace goes through one of them."""
    a = [[s for s in spans if s.trace_id[-1] % 2 == 0] for spans in batches]
    b = [[s for s in spans if s.trace_id[-1] % 2 == 1] for spans in batches]
    return [x for x in a if x], [x for x in b if x]


def test_two_senders_backlogs_after_an_episode_are_judged_in_full(engine: Engine):
    # The outage begins 20 s before a fault whose spike opens and resolves while the windows are held.
    batches = [b.spans for b in Scenario("slow_db", seed=1, minutes=9, onset_s=400, fault_s=40, rate=8).batches()
               if b.spans]
    before, backlog = batches[:380], batches[380:]
    fast, slow = _split(backlog)

    announced: dict[str, list[tuple[str, str]]] = {"in order": [], "after an episode": []}

    def listen(run: _Run, name: str) -> None:  # what alerting is told: every state, in order
        run.detection.driver.announcer.listeners.append(
            lambda spikes: announced[name].extend((s.id, s.state) for s in spikes))

    async def in_order() -> None:
        run = _Run(engine)
        await run.start()
        listen(run, "in order")
        await run.send(batches)
        await run.stop()

    async def after_an_episode() -> None:
        run = _Run(engine)
        await run.start()
        listen(run, "after an episode")
        await run.send(before)
        run.pipeline.health.failed(OSError(errno.ENOSPC, "No space left on device"))  # a write failed: an outage
        await run.send(fast)  # the first attempt after it succeeds; one sender drains its whole backlog first,
        assert run.detection.driver.stats()["catching_up"] == 1  # ... the other after it
        await run.send(slow)
        assert run.detection.driver.detection.windows.late_spans == 0
        run.now[0] += run.cfg.collector.catch_up_seconds  # nothing older arrives any more
        await run.pipeline._tick()
        assert run.detection.driver.stats()["catching_up"] == 0
        await run.stop()
        assert run.detection.driver.detection.windows.late_spans == 0

    asyncio.run(in_order())
    expected = _stored(engine)
    _clear(engine)
    asyncio.run(after_an_episode())
    assert _stored(engine) == expected
    # The held windows close a window at a time: a spike that opened and resolved while they were held is
    # announced (and alerted) as opened, then resolved, as it was live; never only as resolved.
    transitions = {name: list(dict.fromkeys(states)) for name, states in announced.items()}
    assert ("open" in {state for _, state in transitions["in order"]}
            and transitions["after an episode"] == transitions["in order"]), transitions


def test_without_the_hold_the_slower_backlog_would_be_late():
    """The test above holds only because of the hold: the same arrival order without it loses spans."""
    batches = _spans(minutes=3)
    fast, slow = _split(batches[60:])
    engine = DetectionEngine(DetectionSettings())
    for spans in batches[:60] + fast + slow:
        engine.add(spans)
        engine.advance()
    assert engine.windows.late_spans > 0


def test_a_spike_routed_before_the_kill_is_not_alerted_again_when_the_replay_emits_it_again():
    """The replay hands the spike listeners spike states they may have routed before the kill (the pipeline
    writes what the detectors make of the replay again): alerting must not page twice."""
    now = [1_800_000_000.0]
    cfg = AlertsConfig(receivers=[ReceiverConfig(name="oncall", url="http://127.0.0.1:9/")],
                       routes=[RouteConfig(name="oncall", receiver="oncall")])
    before = Router(cfg, clock=lambda: now[0])
    opened = spike(0, start_s=0)
    before.observe([opened])
    decision = before.evaluate()
    assert [n.status for n in decision.notifications] == ["firing"]
    after = Router(cfg, clock=lambda: now[0])  # the restarted collector's
    after.restore([(gid, route, state) for gid, (route, state) in decision.saved.items()])
    after.observe([opened])  # Alerting.restore reads the open spikes from storage
    after.observe([opened])  # and the replay emits the same state again
    now[0] += 60
    assert after.evaluate().notifications == []


def test_a_batch_with_two_states_of_one_spike_stores_the_latest(engine: Engine):
    """A catch-up closes many windows at once, and a replay runs many detector steps before the next commit:
    one batch may carry a spike opened and resolved. One row each, the latest state, not a failed commit."""
    opened = spike(0, start_s=0)
    Writer(engine).write(WriteBatch(spikes=[opened, ended(opened, 40)]))
    assert [(s.id, s.state) for s in Reader(engine).spikes(None, None, None, None, 10)] == [(opened.id, "resolved")]
