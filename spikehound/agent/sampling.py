"""Runs the samplers every interval, each timed and isolated from the others.

Every sampler has its own worker thread, so a sampler stuck in a driver call
(NVML can hang when a GPU falls off the bus) only costs its own readings: while
its previous call is still running, its tick is skipped and counted as a
timeout. Errors are counted per sampler and logged once per kind, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from spikehound.agent.sample import Sample

log = logging.getLogger("spikehound.agent.sampling")


class Sampler(Protocol):
    name: str

    def start(self) -> bool: ...

    def sample(self) -> list[Sample]: ...

    def close(self) -> None: ...


@dataclass
class SamplerHealth:
    """What ``/metrics`` reports per sampler."""

    runs: int = 0
    errors: int = 0
    timeouts: int = 0
    last_seconds: float = 0.0
    total_seconds: float = 0.0
    error_kinds: Counter[str] = field(default_factory=Counter)


class SamplingLoop:
    """Owns the samplers; ``tick`` returns every reading gathered within ``timeout`` seconds."""

    def __init__(self, samplers: list[Sampler]) -> None:
        self.samplers: list[Sampler] = []
        self.health: dict[str, SamplerHealth] = {}
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._running: dict[str, Future[list[Sample]]] = {}
        for sampler in samplers:
            try:
                started = sampler.start()
            except Exception as exc:  # a sampler that cannot start must not stop the agent
                log.warning("sampler %s failed to start (%s: %s); disabled", sampler.name, type(exc).__name__, exc)
                started = False
            if started:
                self.samplers.append(sampler)
                self.health[sampler.name] = SamplerHealth()
                self._executors[sampler.name] = ThreadPoolExecutor(1, thread_name_prefix=f"sampler-{sampler.name}")

    async def tick(self, timeout: float) -> list[Sample]:
        started = time.perf_counter()
        running: dict[str, Future[list[Sample]]] = {}
        for sampler in self.samplers:
            health = self.health[sampler.name]
            previous = self._running.get(sampler.name)
            if previous is not None and not previous.done():
                health.timeouts += 1  # still stuck in last tick's call
                continue
            running[sampler.name] = self._running[sampler.name] = self._executors[sampler.name].submit(
                self._timed, sampler)
        if not running:
            return []
        await asyncio.wait([_all_done(running.values())], timeout=timeout)
        out: list[Sample] = []
        for name, future in running.items():
            health = self.health[name]
            if not future.done():
                health.timeouts += 1
                log.warning("sampler %s took longer than %.1f s; its readings are skipped this interval", name,
                            timeout)
                continue
            exc = future.exception()
            if exc is not None:
                kind = type(exc).__name__
                health.errors += 1
                if not health.error_kinds[kind]:
                    log.warning("sampler %s failed: %s: %s (logged once per kind)", name, kind, exc)
                health.error_kinds[kind] += 1
                continue
            out.extend(future.result())
        log.debug("sampled %d readings in %.1f ms", len(out), (time.perf_counter() - started) * 1e3)
        return out

    def _timed(self, sampler: Sampler) -> list[Sample]:
        started = time.perf_counter()
        try:
            return sampler.sample()
        finally:
            health = self.health[sampler.name]
            health.runs += 1
            health.last_seconds = time.perf_counter() - started
            health.total_seconds += health.last_seconds

    def close(self) -> None:
        for sampler in self.samplers:
            try:
                sampler.close()
            except Exception as exc:
                log.debug("sampler %s close failed: %s", sampler.name, exc)
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)


def _all_done(futures: Iterable[Future[list[Sample]]]) -> asyncio.Future[None]:
    """An asyncio future resolved when every one of ``futures`` is done.

    Only the last sampler to finish wakes the event loop: one wake-up a tick rather than one per sampler
    (each costs a few hundred microseconds of CPU on a busy virtual machine).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    futures = list(futures)
    remaining = [len(futures)]
    lock = threading.Lock()

    def resolve() -> None:
        if not done.done():
            done.set_result(None)

    def finished(_future: Future[list[Sample]]) -> None:  # runs in the sampler's thread
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop closed while a stuck sampler was still running
                loop.call_soon_threadsafe(resolve)

    for future in futures:
        future.add_done_callback(finished)
    return done
