"""The collector's view of storage (spikehound/collector/storage_health.py): one episode per outage, told once each way.

The errors are the real drivers' own: SQLite refusing a write past ``max_page_count`` ("database or disk is
full"), psycopg failing to reach a port nothing listens on.
"""

from __future__ import annotations

import logging
import sqlite3

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from harness.ports import free_port
from spikehound.collector.storage_health import SETTLE_SECONDS, StorageHealth, classify
from spikehound.collector.telemetry import CollectorTelemetry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sqlite_disk_full() -> OperationalError:
    """What SQLAlchemy raises when SQLite cannot grow the database (here: past its page limit)."""
    engine = create_engine("sqlite://")
    with pytest.raises(OperationalError) as caught, engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x BLOB)"))
        conn.execute(text("PRAGMA max_page_count = 8"))
        for _ in range(100):
            conn.execute(text("INSERT INTO t VALUES (randomblob(4000))"))
    return caught.value


def postgres_unreachable() -> psycopg.OperationalError:
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(host="127.0.0.1", port=free_port(), dbname="x", connect_timeout=2)
    return caught.value


def test_the_drivers_errors_are_told_apart():
    assert classify(sqlite_disk_full()) == "disk_full"
    assert classify(postgres_unreachable()) == "unreachable"
    assert classify(sqlite3.IntegrityError("UNIQUE constraint failed: spikes.id")) == "error"


def outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "spikehound.collector.storage" and r.levelno >= logging.WARNING]


def test_an_outage_is_one_episode_told_once_each_way(caplog: pytest.LogCaptureFixture):
    clock, telemetry = Clock(), CollectorTelemetry()
    health = StorageHealth(telemetry, clock=clock)
    caplog.set_level(logging.DEBUG, "spikehound.collector.storage")
    error = postgres_unreachable()
    delays = []
    for _ in range(30):  # a minute of failed attempts, and senders knocking in between
        delays.append(health.failed(error))
        assert not health.admit() and health.retry_after() >= 1
        clock.now += delays[-1]
        assert health.admit()  # the attempt is due: a sender's request is let through to be it
    assert max(delays) == 2.0 and delays[:3] == [0.25, 0.5, 1.0]
    assert telemetry.registry.get_sample_value("spikehound_storage_available") == 0
    assert health.describe().startswith("storage unavailable (unreachable")

    assert health.succeeded() is True  # senders are let in again at once
    assert health.admit() and telemetry.registry.get_sample_value("spikehound_storage_available") == 1
    clock.now += SETTLE_SECONDS
    health.settle()
    lines = outage_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("storage unavailable (unreachable")
    assert lines[1].startswith("storage available again after 55.8 s")  # 0.25 + 0.5 + 1 + 2 * 27 s
    assert telemetry.registry.get_sample_value("spikehound_storage_outages_total", {"kind": "unreachable"}) == 1


def test_a_nearly_full_disk_that_takes_some_writes_is_still_one_episode(caplog: pytest.LogCaptureFixture):
    clock, telemetry = Clock(), CollectorTelemetry()
    health = StorageHealth(telemetry, clock=clock)
    caplog.set_level(logging.INFO, "spikehound.collector.storage")
    full = sqlite_disk_full()
    for _ in range(5):  # a write fits now and then, the next does not
        clock.now += health.failed(full)
        assert health.succeeded()
        clock.now += 1
        health.succeeded()
    assert len(outage_lines(caplog)) == 1
    clock.now += SETTLE_SECONDS
    health.succeeded()
    assert [line.split(" (")[0] for line in outage_lines(caplog)] == ["storage unavailable",
                                                                        "storage available again after 9.8 s"]
    assert telemetry.registry.get_sample_value("spikehound_storage_outages_total", {"kind": "disk_full"}) == 1


def test_other_writers_failures_start_an_episode_and_are_not_repeated_during_it(caplog: pytest.LogCaptureFixture):
    health = StorageHealth(clock=Clock())
    caplog.set_level(logging.INFO, "spikehound.collector.storage")
    health.note("alert housekeeping", sqlite3.IntegrityError("UNIQUE constraint failed"))  # its own error
    assert health.available
    error = postgres_unreachable()
    for _ in range(10):  # with no traffic, alerting is what finds the database gone: the episode starts
        health.note("alert housekeeping", error)
        health.note("detector checkpoint", error)
    assert not health.available and health.kind == "unreachable"
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert said == [("ERROR", "alert housekeeping failed"), ("ERROR", "storage unavailable (unreachable"),
                    ("WARNING", "alert housekeeping waits for storage (unreachable)"),
                    ("WARNING", "detector checkpoint waits for storage (unreachable)")]
