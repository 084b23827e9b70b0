"""What collectors sharing one PostgreSQL keep there to work as one (docs/scale-out.md).

* **The feed.** Every commit of a member that holds spans or metric points adds one ``cluster_feed`` row in
  the same transaction: the ids of the span blocks it wrote and the points, packed. A member numbers its rows
  itself (``seq``), in commit order: its one writer thread commits one batch at a time, so a reader that
  keeps a cursor per member sees every commit once and in order, which ids from a shared sequence cannot
  promise (two transactions commit in another order than they drew their ids).
* **Members.** Each collector upserts its ``cluster_members`` row every heartbeat; ages are measured on the
  database's clock, so collectors whose clocks disagree still agree on who is alive.
* **The leader.** One collector holds a session advisory lock (``LEADER_LOCK``) and runs detection over the
  feed. Each of its writes first takes the same lock for its transaction (``still_leading``): that succeeds in
  the session that holds it, and fails once another collector does, so a leader that lost its session (a
  network partition, a killed connection) never writes beside its successor.

PostgreSQL only: a cluster needs a database that several processes on several hosts can write at once.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson
from sqlalchemy import Connection, Engine, case, func, select, text
from sqlalchemy.dialects.postgresql import insert

from spikehound.model import MetricKind, MetricPoint
from spikehound.storage import schema

__all__ = ["LEADER_LOCK", "FeedRow", "FeedStamp", "Member", "MemberNameInUse", "add_feed_row", "block_payloads",
           "claim_lead", "depose_silent_leader", "feed_members", "heartbeat", "join", "last_seq", "leader_present",
           "leader_session", "load_cursors", "members", "pack_points", "pending_block_ids", "prune_members",
           "read_feed", "release_lead", "save_cursors", "still_leading", "trim_feed", "try_lead", "unpack_points"]

LEADER_LOCK = 0x5350_4B48_0002  # the detection leader's advisory lock ("SPKH" 2)
_DB_NOW_SQL = "(extract(epoch from clock_timestamp()) * 1000000000)::bigint"
# pg_locks shows a bigint advisory key as two 32-bit halves (classid, objid) with objsubid 1.
_LEADER_LOCK_HELD = "l.locktype = 'advisory' AND l.granted AND l.classid = :high AND l.objid = :low AND l.objsubid = 1"
_LEADER_LOCK_KEY = {"high": LEADER_LOCK >> 32, "low": LEADER_LOCK & 0xFFFFFFFF}
_DB_NOW_NS = text(_DB_NOW_SQL)


@dataclass(frozen=True, slots=True)
class FeedStamp:
    """Which member commits a batch, and its number in that member's feed."""

    member: str
    seq: int


@dataclass(frozen=True, slots=True)
class FeedRow:
    member: str
    seq: int
    block_ids: tuple[int, ...]
    points: bytes | None
    written_ns: int  # database clock


@dataclass(frozen=True, slots=True)
class Member:
    member: str
    started_at: int  # unix ns, database clock
    age_s: float  # seconds since its last heartbeat, on the database's clock
    fed_seq: int
    api_url: str


def pack_points(points: Sequence[MetricPoint]) -> bytes:
    """Metric points as a feed row carries them: pickled tuples, so that every attribute value comes back as
    it was decoded (an array stays a tuple, an integer an integer) and the leader keys each series as the member
    did. Only collectors write and read them, as they do their checkpoints.

    >>> p = MetricPoint("gpu-1", "hw.gpu.utilization", {"hw.id": "GPU-0", "lanes": (1, 2)}, 10, 0.5,
    ...                 MetricKind.GAUGE, "1", 5)
    >>> unpack_points(pack_points([p])) == [p]
    True
    """
    return pickle.dumps([(p.host, p.name, p.attributes, p.time_unix_nano, p.value, int(p.kind), p.unit,
                          p.start_unix_nano) for p in points], protocol=pickle.HIGHEST_PROTOCOL)


def unpack_points(blob: bytes) -> list[MetricPoint]:
    return [MetricPoint(host, name, attributes, t, value, MetricKind(kind), unit, start)
            for host, name, attributes, t, value, kind, unit, start in pickle.loads(blob)]


def add_feed_row(conn: Connection, stamp: FeedStamp, block_ids: Sequence[int], points: Sequence[MetricPoint]
                 ) -> None:
    """In the transaction of the commit it describes (see the module's docstring)."""
    conn.execute(schema.cluster_feed.insert().values(
        member=stamp.member, seq=stamp.seq, block_ids=orjson.dumps(list(block_ids)).decode(),
        points=pack_points(points) if points else None, written_ns=_DB_NOW_NS))


def last_seq(engine: Engine, member: str) -> int:
    """The last feed number ``member`` used (0: none): its next commit takes the one after."""
    f, m, c = schema.cluster_feed, schema.cluster_members, schema.cluster_cursors
    with engine.connect() as conn:
        found = [conn.execute(select(func.max(f.c.seq)).where(f.c.member == member)).scalar(),
                 conn.execute(select(m.c.fed_seq).where(m.c.member == member)).scalar(),
                 conn.execute(select(c.c.seq).where(c.c.member == member)).scalar()]
    return max(int(v) for v in found if v is not None) if any(v is not None for v in found) else 0


class MemberNameInUse(Exception):
    """Another live process runs as this member."""


def join(engine: Engine, member: str, instance: str, api_url: str, *, heartbeat_s: float, timeout_s: float,
         sleep: Callable[[float], None] = time.sleep) -> None:
    """Become ``member`` (process token ``instance``): its row says so, with a fresh start and heartbeat.

    A row of another process that is younger than ``timeout_s`` is watched for three heartbeats: if its
    heartbeat moves, that process lives and MemberNameInUse is raised (two collectors given one name would
    number their feed rows over each other); if not, it died (a restart after a crash) and the name is taken.
    """
    m = schema.cluster_members

    def current() -> tuple[str, int, float] | None:
        with engine.connect() as conn:
            row = conn.execute(select(m.c.instance, m.c.heartbeat_at, (_DB_NOW_NS - m.c.heartbeat_at) / 1e9)
                               .where(m.c.member == member)).first()
        return (str(row[0]), int(row[1]), float(row[2])) if row is not None else None

    first = current()
    if first is not None and first[0] != instance and first[2] < timeout_s:
        waited = 0.0
        while waited < 3 * heartbeat_s:
            sleep(heartbeat_s / 2)
            waited += heartbeat_s / 2
            now = current()
            if now is not None and now[0] == first[0] and now[1] != first[1]:
                raise MemberNameInUse(f"another collector runs as member {member!r} (its heartbeat is "
                                      f"{now[2]:.1f} s old); give each collector its own cluster.member")
    stmt = insert(m).values(member=member, started_at=_DB_NOW_NS, heartbeat_at=_DB_NOW_NS, fed_seq=0,
                            api_url=api_url, instance=instance)
    with engine.begin() as conn:
        conn.execute(stmt.on_conflict_do_update(index_elements=["member"], set_={
            "started_at": stmt.excluded.started_at, "heartbeat_at": stmt.excluded.heartbeat_at,
            "api_url": stmt.excluded.api_url, "instance": stmt.excluded.instance}))


def heartbeat(engine: Engine, member: str, instance: str, fed_seq: int) -> bool:
    """Say ``member`` is alive; False when another process has taken the name (this one's beats no longer
    count)."""
    m = schema.cluster_members
    with engine.begin() as conn:
        done = conn.execute(m.update().where(m.c.member == member, m.c.instance == instance).values(
            heartbeat_at=_DB_NOW_NS, fed_seq=func.greatest(m.c.fed_seq, fed_seq)))
    return bool(done.rowcount)


def prune_members(conn: Connection, older_than_s: float) -> int:
    """Forget members silent for ``older_than_s`` that have no feed rows left (renamed or retired hosts); their
    cursor stays, so a member that comes back under its name numbers on from it."""
    m, f = schema.cluster_members, schema.cluster_feed
    stale = (_DB_NOW_NS - m.c.heartbeat_at) / 1e9 > older_than_s
    done = conn.execute(m.delete().where(stale, m.c.leader_pid.is_(None),
                                         ~m.c.member.in_(select(f.c.member).distinct())))
    return int(done.rowcount or 0)


def feed_members(conn: Connection) -> list[str]:
    """The members that have rows in the feed now (it holds about a checkpoint's worth)."""
    f = schema.cluster_feed
    return sorted(str(r) for r in conn.execute(select(f.c.member).distinct()).scalars())


def leader_present(conn: Connection) -> bool:
    """Whether some session holds the leader's lock now."""
    found = conn.execute(text(f"SELECT 1 FROM pg_locks l WHERE {_LEADER_LOCK_HELD}"), _LEADER_LOCK_KEY).first()
    conn.commit()
    return found is not None


def members(conn: Connection) -> list[Member]:
    m = schema.cluster_members
    age = (_DB_NOW_NS - m.c.heartbeat_at) / 1e9
    rows = conn.execute(select(m.c.member, m.c.started_at, age, m.c.fed_seq, m.c.api_url).order_by(m.c.member))
    return [Member(r[0], int(r[1]), float(r[2]), int(r[3]), r[4]) for r in rows]


def read_feed(conn: Connection, cursors: Mapping[str, int], names: Iterable[str], limit: int) -> list[FeedRow]:
    """Up to ``limit`` rows per member after its cursor (0 for a member without one), each member's in order."""
    f = schema.cluster_feed
    rows: list[FeedRow] = []
    for name in names:
        query = (select(f.c.member, f.c.seq, f.c.block_ids, f.c.points, f.c.written_ns)
                 .where(f.c.member == name, f.c.seq > cursors.get(name, 0)).order_by(f.c.seq).limit(limit))
        rows += [FeedRow(r[0], int(r[1]), tuple(orjson.loads(r[2])), bytes(r[3]) if r[3] is not None else None,
                         int(r[4])) for r in conn.execute(query)]
    return rows


def block_payloads(conn: Connection, ids: Sequence[int]) -> dict[int, bytes]:
    b = schema.span_blocks
    if not ids:
        return {}
    return {int(i): bytes(p) for i, p in conn.execute(select(b.c.id, b.c.payload).where(b.c.id.in_(list(ids))))}


def pending_block_ids(conn: Connection, cursors: Mapping[str, int]) -> set[int]:
    """The span blocks of every feed row after the cursors (0 for a member without one): not yet fed.

    Rows up to the cursors are trimmed after each checkpoint, so the table holds little more than these.
    """
    f = schema.cluster_feed
    ids: set[int] = set()
    for member, seq, block_ids in conn.execute(select(f.c.member, f.c.seq, f.c.block_ids)):
        if seq > cursors.get(member, 0):
            ids.update(orjson.loads(block_ids))
    return ids


def load_cursors(conn: Connection) -> dict[str, int]:
    c = schema.cluster_cursors
    return {member: int(seq) for member, seq in conn.execute(select(c.c.member, c.c.seq))}


def save_cursors(conn: Connection, cursors: Mapping[str, int]) -> None:
    """In the transaction that saves the leader's checkpoint."""
    if not cursors:
        return
    c = schema.cluster_cursors
    stmt = insert(c)
    conn.execute(stmt.on_conflict_do_update(index_elements=["member"], set_={"seq": stmt.excluded.seq}),
                 [{"member": k, "seq": v} for k, v in sorted(cursors.items())])


def trim_feed(conn: Connection, cursors: Mapping[str, int]) -> int:
    """Delete the feed rows a saved checkpoint has consumed; how many."""
    f = schema.cluster_feed
    deleted = 0
    for member, seq in sorted(cursors.items()):
        deleted += conn.execute(f.delete().where(f.c.member == member, f.c.seq <= seq)).rowcount or 0
    return deleted


def leader_session(engine: Engine) -> Connection:
    """A session to campaign and lead on. The server drops a leader it cannot reach within about 11 s (its lock
    with it), so that a partitioned leader does not hold the cluster's detection for the kernel's two hours of
    TCP keepalive."""
    conn = engine.connect()
    conn.execute(text("SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; SET tcp_keepalives_count = 3"))
    conn.commit()
    return conn


def try_lead(conn: Connection) -> bool:
    """Take the leader's lock for ``conn``'s session if nobody holds it (outside a transaction: a session lock
    taken in one stays when it ends, so it is committed at once)."""
    held = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK}).scalar())
    conn.commit()
    return held


def claim_lead(conn: Connection, member: str) -> str | None:
    """Just after ``try_lead``: mark ``member``'s row as the leader's, with its session's backend pid; the
    member that led before, when a row still says so."""
    m = schema.cluster_members
    previous = conn.execute(select(m.c.member).where(m.c.leader_pid.is_not(None))).scalar()
    conn.execute(m.update().values(leader_pid=case((m.c.member == member, func.pg_backend_pid()), else_=None)))
    conn.commit()
    return str(previous) if previous is not None else None


def depose_silent_leader(conn: Connection, timeout_s: float) -> str | None:
    """End the session holding the leader's lock if the member it belongs to has not sent a heartbeat for
    ``timeout_s``; the member's name when it did. A stopped or hung process keeps its session (the kernel
    still answers for its socket), so the lock alone would never pass on. A session no member claims (an
    operator's) is left alone."""
    m = schema.cluster_members
    found = conn.execute(text(
        f"SELECT l.pid, m.member, ({_DB_NOW_SQL} - m.heartbeat_at) / 1e9 FROM pg_locks l "
        f"JOIN cluster_members m ON m.leader_pid = l.pid WHERE {_LEADER_LOCK_HELD}"), _LEADER_LOCK_KEY).first()
    conn.commit()
    if found is None or found[2] <= timeout_s:
        return None
    conn.execute(select(func.pg_terminate_backend(found[0])))
    conn.execute(m.update().where(m.c.member == found[1]).values(leader_pid=None))
    conn.commit()
    return str(found[1])


def still_leading(conn: Connection) -> bool:
    """In a transaction of the leader's: False when another session holds the leader's lock now."""
    return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": LEADER_LOCK}).scalar())


def release_lead(conn: Connection) -> None:
    conn.execute(text("SELECT pg_advisory_unlock_all()"))
    conn.commit()
