"""The alert tables from the event loop: writes on the collector's single writer thread, reads on threads.

SQLite allows one writer at a time; the ingest pipeline's writer thread
already is that writer, so every alert write is queued on it (between two
ingest commits, each a short transaction) and never meets ``database is
locked``. Reads use WAL snapshots on other threads.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Engine

from spikehound.collector.writer_thread import WriterThread
from spikehound.storage import alerts as db

T = TypeVar("T")


class AlertStore:
    """The alert tables: writes on ``writer_thread`` (the collector's one writer), reads on other threads."""

    def __init__(self, engine: Engine, writer_thread: WriterThread) -> None:
        self.engine = engine
        self.writer_thread = writer_thread

    async def _write(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self.writer_thread.run(functools.partial(fn, self.engine, *args, **kwargs))

    async def _read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(functools.partial(fn, self.engine, *args, **kwargs))

    async def commit_routing(self, groups: Sequence[tuple[str, str, str]], removed: Sequence[str],
                             outbox: Sequence[db.OutboxEntry], now_ns: int) -> int:
        return await self._write(db.commit_routing, groups=groups, removed=removed, outbox=outbox, now_ns=now_ns)

    async def load_groups(self) -> list[tuple[str, str, str]]:
        return await self._read(db.load_groups)

    async def pending(self, limit: int = 1000) -> list[db.OutboxRow]:
        return await self._read(db.pending, limit)

    async def record_attempt(self, row_id: int, **values: Any) -> None:
        await self._write(db.record_attempt, row_id, **values)

    async def outbox(self, state: str | None, limit: int) -> list[db.OutboxRow]:
        return await self._read(db.outbox, state, limit)

    async def outbox_row(self, row_id: int) -> db.OutboxRow | None:
        return await self._read(db.outbox_row, row_id)

    async def requeue(self, row_id: int, now_ns: int) -> bool:
        return await self._write(db.requeue, row_id, now_ns)

    async def count_by_state(self) -> dict[str, int]:
        return await self._read(db.count_by_state)

    async def expire_delivered(self, before_ns: int) -> int:
        return await self._write(db.expire_delivered, before_ns)

    async def insert_silence(self, row: db.SilenceRow) -> None:
        await self._write(db.insert_silence, row)

    async def silences(self, active_at: int | None = None, limit: int = 1000) -> list[db.SilenceRow]:
        return await self._read(db.silences, active_at=active_at, limit=limit)

    async def silence(self, silence_id: str) -> db.SilenceRow | None:
        return await self._read(db.silence, silence_id)

    async def expire_silence(self, silence_id: str, now_ns: int) -> bool:
        return await self._write(db.expire_silence, silence_id, now_ns)
