"""The collector's one storage writer thread, lent to every part that writes.

SQLite allows one writer at a time. Ingest commits, the detectors' checkpoints,
retention's deletes and the alert tables' writes all run here, one after the
other (each a short transaction), so none of them ever meets ``database is
locked``; reads use their own connections on other threads. The detection
engine is only touched from this thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class WriterThread:
    """The single thread storage writes run on; a component (``start``/``stop``) of the collector."""

    name = "writer thread"

    def __init__(self) -> None:
        # One worker: calls run in the order they were made, never two at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spikehound-writer")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the writer thread, after the calls queued before it; its result or its error."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        """Nothing to do: the thread starts with the first call."""

    async def stop(self) -> None:
        """Finish the calls queued, then end the thread (off the event loop: a last write may take a while)."""
        await asyncio.to_thread(self._executor.shutdown, True)
