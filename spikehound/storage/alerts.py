"""Alert storage: the notification outbox, the routing state of alert groups, and silences.

Every function is one short transaction. The collector runs the writing ones
on its single writer thread (SQLite has one writer at a time).

>>> from spikehound.storage.engine import make_engine
>>> from spikehound.storage.migrate import upgrade
>>> eng = make_engine("sqlite://")
>>> _ = upgrade(eng)
>>> entry = OutboxEntry("k1", "pager", "pager", "g1", "firing", b"{}")
>>> commit_routing(eng, groups=[("g1", "pager", "{}")], removed=[], outbox=[entry], now_ns=5)
1
>>> commit_routing(eng, groups=[], removed=[], outbox=[entry], now_ns=6)  # the same key again: kept once
0
>>> [(r.idempotency_key, r.state, r.attempts) for r in pending(eng)]
[('k1', 'pending', 0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, select, update

from spikehound.storage import schema
from spikehound.storage.writer import upsert

__all__ = ["OutboxEntry", "OutboxRow", "SilenceRow", "commit_routing", "count_by_state", "expire_delivered",
           "expire_silence", "insert_silence", "load_groups", "outbox", "outbox_row", "pending", "record_attempt",
           "requeue", "silence", "silences"]


@dataclass(slots=True, frozen=True)
class OutboxEntry:
    """A notification to deliver, as the router makes it."""

    idempotency_key: str
    receiver: str
    route: str
    group_id: str
    status: str  # firing | resolved
    body: bytes


@dataclass(slots=True, frozen=True)
class OutboxRow:
    id: int
    idempotency_key: str
    receiver: str
    route: str
    group_id: str
    status: str
    body: bytes
    created_at: int
    state: str  # pending | delivered | dead
    attempts: int
    next_attempt_at: int
    last_error: str | None
    delivered_at: int | None


@dataclass(slots=True, frozen=True)
class SilenceRow:
    id: str
    matchers: str  # JSON object
    comment: str
    created_by: str
    starts_at: int
    ends_at: int
    created_at: int


def commit_routing(engine: Engine, *, groups: Sequence[tuple[str, str, str]], removed: Sequence[str],
                   outbox: Sequence[OutboxEntry], now_ns: int) -> int:
    """Save group states ``(id, route, state JSON)``, drop ``removed`` groups and queue ``outbox`` in one
    transaction; return how many notifications were new (an idempotency key already queued is skipped)."""
    g = schema.alert_groups
    with engine.begin() as conn:
        if groups:
            stmt = upsert(engine, g)
            stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={
                "route": stmt.excluded.route, "state": stmt.excluded.state, "updated_at": stmt.excluded.updated_at})
            conn.execute(stmt, [{"id": i, "route": r, "state": s, "updated_at": now_ns} for i, r, s in groups])
        if removed:
            conn.execute(delete(g).where(g.c.id.in_(list(removed))))
        added = 0
        insert = upsert(engine, schema.alert_outbox).on_conflict_do_nothing(index_elements=["idempotency_key"])
        for e in outbox:  # one by one: the row count says whether the key was new
            added += conn.execute(insert, {
                "idempotency_key": e.idempotency_key, "receiver": e.receiver, "route": e.route,
                "group_id": e.group_id, "status": e.status, "body": e.body, "created_at": now_ns,
                "state": "pending", "attempts": 0, "next_attempt_at": now_ns}).rowcount
    return added


def load_groups(engine: Engine) -> list[tuple[str, str, str]]:
    """Every saved group as ``(id, route, state JSON)``."""
    g = schema.alert_groups
    with engine.connect() as conn:
        return [(r.id, r.route, r.state) for r in conn.execute(select(g.c.id, g.c.route, g.c.state))]


def _row(r: Any) -> OutboxRow:
    return OutboxRow(id=r.id, idempotency_key=r.idempotency_key, receiver=r.receiver, route=r.route,
                     group_id=r.group_id, status=r.status, body=bytes(r.body), created_at=r.created_at,
                     state=r.state, attempts=r.attempts, next_attempt_at=r.next_attempt_at,
                     last_error=r.last_error, delivered_at=r.delivered_at)


def pending(engine: Engine, limit: int = 1000) -> list[OutboxRow]:
    """Notifications not yet delivered nor dead-lettered, oldest first."""
    o = schema.alert_outbox
    with engine.connect() as conn:
        rows = conn.execute(select(o).where(o.c.state == "pending").order_by(o.c.id).limit(limit))
        return [_row(r) for r in rows]


def record_attempt(engine: Engine, row_id: int, *, state: str, attempts: int, next_attempt_at: int,
                   last_error: str | None, delivered_at: int | None = None) -> None:
    o = schema.alert_outbox
    with engine.begin() as conn:
        conn.execute(update(o).where(o.c.id == row_id).values(
            state=state, attempts=attempts, next_attempt_at=next_attempt_at, last_error=last_error,
            delivered_at=delivered_at))


def outbox(engine: Engine, state: str | None, limit: int) -> list[OutboxRow]:
    """The newest notifications first, optionally of one state."""
    o = schema.alert_outbox
    query = select(o).order_by(o.c.id.desc()).limit(limit)
    if state is not None:
        query = query.where(o.c.state == state)
    with engine.connect() as conn:
        return [_row(r) for r in conn.execute(query)]


def outbox_row(engine: Engine, row_id: int) -> OutboxRow | None:
    o = schema.alert_outbox
    with engine.connect() as conn:
        r = conn.execute(select(o).where(o.c.id == row_id)).first()
    return _row(r) if r is not None else None


def requeue(engine: Engine, row_id: int, now_ns: int) -> bool:
    """Send a dead-lettered notification again from its first attempt; False if it is not dead."""
    o = schema.alert_outbox
    with engine.begin() as conn:
        done = conn.execute(update(o).where(o.c.id == row_id, o.c.state == "dead").values(
            state="pending", attempts=0, next_attempt_at=now_ns))
    return done.rowcount == 1


def count_by_state(engine: Engine) -> dict[str, int]:
    o = schema.alert_outbox
    with engine.connect() as conn:
        return {r[0]: r[1] for r in conn.execute(select(o.c.state, func.count()).group_by(o.c.state))}


def expire_delivered(engine: Engine, before_ns: int, batch: int = 1000) -> int:
    """Delete delivered notifications created before ``before_ns``; return how many."""
    o = schema.alert_outbox
    with engine.begin() as conn:
        # Oldest first through the (state, id) index: ids grow with created_at, so the scan stops early.
        ids = [r[0] for r in conn.execute(select(o.c.id).where(o.c.state == "delivered", o.c.created_at < before_ns)
                                          .order_by(o.c.id).limit(batch))]
        if ids:
            conn.execute(delete(o).where(o.c.id.in_(ids)))
    return len(ids)


# --- silences ----------------------------------------------------------------------------------


def insert_silence(engine: Engine, silence: SilenceRow) -> None:
    with engine.begin() as conn:
        conn.execute(schema.silences.insert(), {
            "id": silence.id, "matchers": silence.matchers, "comment": silence.comment,
            "created_by": silence.created_by, "starts_at": silence.starts_at, "ends_at": silence.ends_at,
            "created_at": silence.created_at})


def silences(engine: Engine, *, active_at: int | None = None, limit: int = 1000) -> list[SilenceRow]:
    """Silences, newest first; only those not yet ended at ``active_at`` when given."""
    s = schema.silences
    query = select(s).order_by(s.c.created_at.desc(), s.c.id).limit(limit)
    if active_at is not None:
        query = query.where(s.c.ends_at > active_at)
    with engine.connect() as conn:
        return [SilenceRow(id=r.id, matchers=r.matchers, comment=r.comment, created_by=r.created_by,
                           starts_at=r.starts_at, ends_at=r.ends_at, created_at=r.created_at)
                for r in conn.execute(query)]


def silence(engine: Engine, silence_id: str) -> SilenceRow | None:
    s = schema.silences
    with engine.connect() as conn:
        r = conn.execute(select(s).where(s.c.id == silence_id)).first()
    return None if r is None else SilenceRow(id=r.id, matchers=r.matchers, comment=r.comment,
                                             created_by=r.created_by, starts_at=r.starts_at, ends_at=r.ends_at,
                                             created_at=r.created_at)


def expire_silence(engine: Engine, silence_id: str, now_ns: int) -> bool:
    """End a silence now (it stays listed as expired); False if there is no such silence."""
    s = schema.silences
    with engine.begin() as conn:
        found = conn.execute(select(s.c.ends_at).where(s.c.id == silence_id)).first()
        if found is None:
            return False
        if found.ends_at > now_ns:
            conn.execute(update(s).where(s.c.id == silence_id).values(ends_at=now_ns))
    return True
