"""The component stack both daemons are built on: started in order, stopped in reverse, nothing left running
after a failed start."""

from __future__ import annotations

import asyncio

import pytest

from harness.daemons import CollectorThread
from spikehound.components import ComponentStack, Stage


class Recorded:
    """A component that writes what happens to it into ``log``; it can be told to fail its start or stop."""

    def __init__(self, name: str, log: list[str], *, fail_start: bool = False, fail_stop: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail_start = fail_start
        self.fail_stop = fail_stop

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.fail_start:
            raise OSError(f"{self.name} cannot start")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError(f"{self.name} cannot stop")


def test_started_in_order_and_stopped_in_reverse_once():
    log: list[str] = []

    async def scenario() -> list[str]:
        stack = ComponentStack()
        await stack.start(Recorded("storage", log), Recorded("pipeline", log))
        await stack.start(Recorded("receiver", log))  # a later call starts after the earlier ones
        running = stack.started
        await stack.stop()
        await stack.stop()  # again: nothing left to stop
        return running

    assert asyncio.run(scenario()) == ["storage", "pipeline", "receiver"]
    assert log == ["start storage", "start pipeline", "start receiver",
                   "stop receiver", "stop pipeline", "stop storage"]


def test_a_failed_start_stops_the_started_ones_and_raises():
    log: list[str] = []
    stack = ComponentStack()

    async def scenario() -> None:
        await stack.start(Recorded("storage", log))
        await stack.start(Recorded("pipeline", log), Recorded("receiver", log, fail_start=True),
                          Recorded("never", log))

    with pytest.raises(OSError, match="receiver cannot start"):
        asyncio.run(scenario())
    # The receiver cleans up its own partial start; the one after it is never started.
    assert log == ["start storage", "start pipeline", "start receiver", "stop pipeline", "stop storage"]
    assert stack.started == []


def test_a_failing_stop_does_not_keep_the_others_running(caplog: pytest.LogCaptureFixture):
    log: list[str] = []

    async def scenario() -> None:
        stack = ComponentStack()
        await stack.start(Recorded("storage", log), Recorded("pipeline", log, fail_stop=True),
                          Stage("receiver", stop=lambda: _append(log, "stop receiver")))
        await stack.stop()

    with pytest.raises(RuntimeError, match="pipeline cannot stop"):
        asyncio.run(scenario())
    assert log == ["start storage", "start pipeline", "stop receiver", "stop pipeline", "stop storage"]
    assert "stopping the pipeline failed: RuntimeError: pipeline cannot stop" in caplog.text


async def _append(log: list[str], line: str) -> None:
    log.append(line)


def test_the_collector_stops_its_receivers_first_and_its_storage_last(sqlite_collector: CollectorThread):
    assert sqlite_collector.collector.components.started == [
        "storage", "writer thread", "alert state", "API", "alerting", "ingest pipeline", "OTLP/gRPC", "OTLP/HTTP"]
