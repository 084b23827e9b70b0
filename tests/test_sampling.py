"""The sampling loop isolates its samplers: a stuck or failing sampler costs only its own readings.

The real CPU sampler runs beside samplers that hang (as an NVML call can when a GPU falls off the bus), raise,
or cannot start.
"""

from __future__ import annotations

import asyncio
import threading
import time

from spikehound.agent.sample import Sample
from spikehound.agent.samplers.cpu import CpuSampler
from spikehound.agent.sampling import SamplingLoop


class Stuck:
    """Blocks in sample() until released."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def start(self) -> bool:
        return True

    def sample(self) -> list[Sample]:
        self.calls += 1
        self.release.wait(30)
        return [Sample("hw.power", 1.0, "W", {"hw.id": "GPU-1"})]

    def close(self) -> None:
        self.release.set()


class Failing:
    name = "failing"

    def start(self) -> bool:
        return True

    def sample(self) -> list[Sample]:
        raise OSError("driver went away")

    def close(self) -> None:
        pass


class Unstartable(Failing):
    name = "unstartable"

    def start(self) -> bool:
        raise RuntimeError("no device")


def names(samples: list[Sample]) -> set[str]:
    return {s.name for s in samples}


def test_a_stuck_sampler_costs_only_its_own_readings_until_it_returns():
    stuck = Stuck()
    loop = SamplingLoop([stuck, CpuSampler()])

    async def run() -> list[list[Sample]]:
        ticks = [await loop.tick(timeout=0.3), await loop.tick(timeout=0.3)]  # stuck in its first call throughout
        stuck.release.set()
        # Its first call returns and its thread is free again: not within a fixed pause on a loaded host, so tick
        # until it is (a tick while it is still busy skips it without calling it, as the second did).
        deadline = time.monotonic() + 30
        while "hw.power" not in names(third := await loop.tick(timeout=5)) and time.monotonic() < deadline:
            early.append(third)
            await asyncio.sleep(0.05)
        ticks.append(third)
        return ticks

    early: list[list[Sample]] = []  # ticks that came before the stuck call's thread was free again

    try:
        first, second, third = asyncio.run(run())
    finally:
        loop.close()
    assert "system.memory.utilization" in names(first) and "hw.power" not in names(first)
    assert "system.cpu.utilization" in names(second) and "hw.power" not in names(second)
    assert "hw.power" in names(third) and "system.memory.utilization" in names(third)
    assert stuck.calls == 2  # the second tick did not queue a call behind the stuck one
    assert all("system.memory.utilization" in names(tick) for tick in early)
    assert loop.health["stuck"].timeouts == 2 + len(early) and loop.health["cpu"].timeouts == 0
    assert loop.health["cpu"].runs == 3 + len(early)


def test_errors_are_counted_by_kind_and_the_other_samplers_go_on():
    loop = SamplingLoop([Failing(), CpuSampler(), Unstartable()])

    async def run() -> list[Sample]:
        await loop.tick(timeout=5)
        return await loop.tick(timeout=5)

    try:
        samples = asyncio.run(run())
    finally:
        loop.close()
    assert [s.name for s in loop.samplers] == ["failing", "cpu"]  # the one that could not start is left out
    assert "system.memory.utilization" in names(samples)
    assert loop.health["failing"].errors == 2 and loop.health["failing"].error_kinds == {"OSError": 2}
    assert loop.health["cpu"].errors == 0
