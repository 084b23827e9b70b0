"""The detection driver on its own: the idle advance and its limit, the catch-up hold, what waits to be written,
failures of a step. (Its use by a single collector and a cluster's leader: test_detection_continuity.py,
test_detection_live.py, test_cluster.py.)"""

from __future__ import annotations

import logging
import time

import pytest

from harness.daemons import collector_config
from harness.scenarios.traffic import Scenario
from spikehound.collector.detection_driver import DetectionDriver, DriverSettings
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection
from spikehound.model import Span
from spikehound.storage.checkpoints import Checkpoint
from spikehound.units import NS


def _batches(minutes: float = 2.0) -> list[list[Span]]:
    return [b.spans for b in Scenario("steady", seed=3, minutes=minutes, rate=10).batches() if b.spans]


def _driver(*, advance_while_held: bool = False, now: list[float] | None = None, **settings: object
            ) -> DetectionDriver:
    cfg = collector_config("sqlite://", collector__catch_up_seconds=15, **settings)
    clock = (lambda: now[0]) if now is not None else time.monotonic
    return DetectionDriver(DriverSettings.from_config(cfg), CollectorTelemetry(),
                           advance_while_held=advance_while_held, clock=clock)


def test_the_clock_skew_limit_is_converted_once():
    cfg = collector_config("sqlite://", collector__max_clock_skew_seconds=1.5)
    assert DriverSettings.from_config(cfg).max_clock_skew_ns == 1_500_000_000


def test_idle_time_moves_event_time_on_but_never_past_the_clock_plus_the_skew():
    driver = _driver(collector__max_clock_skew_seconds=60)
    for spans in _batches():
        driver.feed(spans, [])
    before = driver.detection.windows.watermark
    assert before is not None
    driver.step(idle_seconds=0.1)  # not idle long enough
    assert driver.detection.windows.watermark == before
    driver.step(idle_seconds=1e9)  # decades: brought to the clock plus the skew, no further
    after = driver.detection.windows.watermark
    assert after is not None and before < after <= time.time_ns() + 60 * NS
    assert driver.outgoing.windows, "the last windows closed"


@pytest.mark.parametrize("advance_while_held", [False, True], ids=["single collector", "leader"])
def test_while_held_idle_time_moves_the_data_watermark_on_the_leader_only(advance_while_held: bool):
    now = [0.0]
    driver = _driver(advance_while_held=advance_while_held, now=now)
    for spans in _batches():
        driver.feed(spans, [])
    driver.begin_catch_up()
    held, data = driver.detection.windows.hold, driver.detection.windows.data_watermark
    assert held is not None and driver.stats()["catching_up"] == 1
    driver.step(idle_seconds=30)
    assert driver.detection.windows.watermark == held  # nothing closes past the hold either way
    moved = driver.detection.windows.data_watermark != data
    assert moved is advance_while_held


def test_the_hold_is_let_go_once_the_backlog_arrived_and_the_windows_close_a_window_at_a_time():
    now = [0.0]
    driver = _driver(now=now, collector__idle_flush_seconds=3600)
    batches = _batches(3)
    for spans in batches[:60]:
        driver.feed(spans, [])
    driver.begin_catch_up()
    for spans in batches[60:]:  # closes nothing while held
        driver.feed(spans, [])
    closed = len(driver.take_outgoing().windows)
    assert driver.release_if_caught_up() is False  # the catch-up is not over yet
    now[0] += 15  # quiet for catch_up_seconds: no backlog span arrived
    assert driver.release_if_caught_up() is True
    assert driver.detection.windows.hold is None and driver.stats()["catching_up"] == 0
    assert len(driver.outgoing.windows) > closed
    starts = sorted({w.start_unix_nano for w in driver.outgoing.windows})
    assert len(starts) > 1, "closed a window at a time, as live traffic would have"


def test_senders_far_behind_the_clock_hold_the_windows_for_their_backlog_only():
    """Every sender replays a recording (or their clocks are behind): the scenario's event time is months before
    this clock. After an episode their live data is not backlog; what one of them spooled still is."""
    now = [0.0]
    driver = _driver(now=now, collector__idle_flush_seconds=3600)
    batches = _batches(3)
    spooled = [spans for i, spans in enumerate(batches[:60]) if i >= 50 and i % 2]  # a slower sender's
    for i, spans in enumerate(batches[:60]):
        if not (i >= 50 and i % 2):
            driver.feed(spans, [])
    driver.begin_catch_up()
    live = iter(batches[60:])
    now[0] = 10.0
    driver.feed(next(live), [])
    for spans in spooled:  # backlog: ended before the data seen before the episode
        driver.feed(spans, [])
    now[0] = 20.0
    driver.feed(next(live), [])
    assert driver.release_if_caught_up() is False, "the spool arrived 10 s ago"
    now[0] = 25.5
    driver.feed(next(live), [])  # live data keeps coming: it does not hold the windows
    assert driver.release_if_caught_up() is True
    assert driver.detection.windows.hold is None


def test_after_a_restart_the_lag_comes_from_the_checkpoint():
    """Restarted from a checkpoint saved while the data trailed the clock by months: live data is no backlog."""
    now = [0.0]
    before = _driver(now=now, collector__idle_flush_seconds=3600)
    batches = _batches(2)
    for spans in batches[:60]:
        before.feed(spans, [])
    saved = Checkpoint(format=CHECKPOINT_FORMAT, state=before.detection.snapshot(), saved_at=int(time.time()),
                       span_block_id=None, points_ingested_at=0)
    driver = _driver(now=now, collector__idle_flush_seconds=3600)
    assert driver.restore(saved)
    driver.begin_catch_up()
    now[0] = 10.0
    for spans in batches[65:75]:  # the senders' live data, arriving 10 s into the catch-up
        driver.feed(spans, [])
    now[0] = 15.0
    assert driver.release_if_caught_up() is True


def test_what_waits_to_be_written_keeps_no_window_requests():
    """A closed window goes to storage with its figures; the requests it was judged on stay behind (a replay
    after a restart closes thousands of windows before the first write)."""
    driver = _driver()
    for spans in _batches():
        driver.feed(spans, [])
    driver.step(idle_seconds=1e9)
    windows = driver.take_outgoing().windows
    assert windows and all(w.count > 0 and w.p99_ns > 0 for w in windows)
    assert not any(w.samples for w in windows)


def test_what_a_failed_write_held_goes_out_first_with_the_next():
    driver = _driver()
    for spans in _batches():
        driver.feed(spans, [])
    driver.step(idle_seconds=1e9)
    first = driver.take_outgoing()
    assert first.windows and not driver.outgoing.windows
    later = Detection(windows=first.windows[:1])
    driver.keep(later)
    driver.not_written(first)
    assert driver.outgoing.windows == first.windows + later.windows


def test_a_failing_detector_step_costs_that_step_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture):
    driver = _driver()
    batches = _batches()

    def failing_add(spans: object, points: object) -> None:
        raise RuntimeError("a detector bug")

    driver.detection.add = failing_add  # type: ignore[method-assign, assignment]
    caplog.set_level(logging.ERROR)
    driver.feed(batches[0], [])
    driver.feed(batches[1], [])
    assert driver.metrics.errors.labels("detectors")._value.get() == 2
    assert [r.getMessage()[:40] for r in caplog.records if r.exc_info] == ["the detectors failed on a batch (stored "]
    del driver.detection.add
    driver.feed(batches[2], [])
    assert driver.stats()["open_windows"] > 0
