"""Collectors sharing one PostgreSQL (docs/scale-out.md): the feed, the leader, its fence and its takeover.

Real collectors (in this process, each on its own event loop thread) on a real PostgreSQL server, sent the
scenario generator's traffic as real OTLP/HTTP requests. The agents' trace routing and the SIGKILL of a leader
are tests/test_scale_out.py's.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from harness.api_client import list_spikes
from harness.daemons import CollectorProcess, CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from harness.scrape import sample, scrape
from harness.waiting import eventually
from spikehound.config import ConfigError, load
from spikehound.model import MetricKind, MetricPoint
from spikehound.storage import cluster
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import current_revision, head_revision, upgrade
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.spike_fields import spike_fields
from tests.support.storage_data import make_span

pytestmark = pytest.mark.postgres


def _scenario() -> Scenario:
    # Three and a half minutes of warm-up (21 windows), a one-minute slow feature query, then calm.
    return Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)


# The tests compare what collectors found field for field. Input idle for collector.idle_flush_seconds of wall
# time closes the open windows; the harness's 0.5 s let a sender starved that long on a loaded machine (five
# workers on two cores) close windows before their last spans: a spike came out different in one fresh-clone
# run. The production default leaves the sender that much more room.
IDLE_FLUSH_SECONDS = 3.0


@pytest.fixture(scope="module")
def one_collector_spikes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What one collector finds in the scenario: the reference a cluster must match."""
    db = tmp_path_factory.mktemp("one") / "one.db"
    with CollectorThread(collector_config(f"sqlite:///{db}", collector__idle_flush_seconds=IDLE_FLUSH_SECONDS)) as one:
        send(one.http_endpoint, scenario_requests(_scenario()))
        return one.spikes_once_settled()


def _members(url: str, count: int, **settings: Any) -> list[CollectorThread]:
    return [CollectorThread(collector_config(url, cluster__enabled=True, cluster__member=f"member-{i}",
                                             **settings)) for i in range(count)]


def _leader(members: list[CollectorThread]) -> CollectorThread:
    leading = [m for m in members if m.metric("spikehound_cluster_leader") == 1]
    assert len(leading) == 1, f"{len(leading)} collectors lead"
    return leading[0]


def _settled(members: list[CollectorThread]) -> list[dict[str, Any]]:
    """The spikes once one member leads, has no window open, and no spike is open (the fault has ended)."""
    def check() -> tuple[list[dict[str, Any]]] | None:
        leaders = [m for m in members if m.metric("spikehound_cluster_leader") == 1]
        if len(leaders) != 1 or leaders[0].metric("spikehound_latency_open_windows") != 0:
            return None
        spikes = list_spikes(members[-1].api)  # any member serves the shared database
        return (spikes,) if spikes and all(s["state"] == "resolved" for s in spikes) else None

    (spikes,) = eventually(check, "the leader to judge every window", timeout=90, every=0.25)
    return spikes


@pytest.fixture
def running(pg_url: str) -> Iterator[list[CollectorThread]]:
    members = _members(pg_url, 3, collector__idle_flush_seconds=IDLE_FLUSH_SECONDS)
    for m in members:
        m.__enter__()
    try:
        yield members
    finally:
        for m in members:
            m.stop()


def test_three_collectors_find_what_one_collector_finds(running: list[CollectorThread],
                                                        one_collector_spikes: list[dict[str, Any]]):
    bodies = scenario_requests(_scenario())
    # Every second of traffic to another collector, as agents spread traces over them.
    for i, body in enumerate(bodies):
        send(running[(i // 2) % 3].http_endpoint, [body])
    spikes = _settled(running)
    assert one_collector_spikes, "the scenario's fault was not found by one collector"
    assert [spike_fields(s) for s in spikes] == [spike_fields(s) for s in one_collector_spikes]
    leader = _leader(running)
    assert leader.metric("spikehound_cluster_members") == 3
    # The leader's detectors saw every span every member stored, once; the followers judged nothing.
    stored = sum(m.metric("spikehound_ingest_stored_total", signal="spans") for m in running)
    assert leader.metric("spikehound_cluster_feed_spans_total") == stored
    assert all(m.metric("spikehound_detector_judged_windows_total") == 0 for m in running if m is not leader)
    assert leader.metric("spikehound_latency_late_spans_total") == 0


def test_a_leader_that_lost_its_session_writes_nothing_and_the_next_one_catches_up(
        pg_url: str, one_collector_spikes: list[dict[str, Any]]):
    """The fence: a leader whose database session ended (a network partition, a killed connection) has lost the
    lock; while another session holds it, nothing of the old leader's is written. Once a collector leads
    again, it continues from the checkpoint and the feed, and finds what one collector finds."""
    bodies = scenario_requests(_scenario())
    cut = 2 * (int(_scenario().onset_s) + 25)  # the spike is open 25 s into the fault
    members = _members(pg_url, 2, detection__checkpoint_seconds=1, collector__idle_flush_seconds=IDLE_FLUSH_SECONDS)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with (members[0], members[1], psycopg.connect(dsn, autocommit=True) as usurper,
          psycopg.connect(dsn, autocommit=True) as killer):
        for i, body in enumerate(bodies[:cut]):
            send(members[i // 2 % 2].http_endpoint, [body])
        eventually(lambda: any(s["state"] == "open" for s in list_spikes(members[0].api)), "the spike to open")
        old = _leader(members)
        # Queue for the lock first, then end the old leader's session: the usurper, first in the queue, gets it,
        # and a member's try in between fails (a try that would jump a waiter fails). Polling with tries after
        # the kill raced the members' own tries, and a member that won held it for good.
        usurper.execute("SET lock_timeout = '30s'")
        queued = threading.Thread(target=usurper.execute, args=("SELECT pg_advisory_lock(%s)", (cluster.LEADER_LOCK,)))
        queued.start()
        eventually(lambda: _leader_lock_sessions(killer, granted=False) == [usurper.info.backend_pid],
                   "the usurper to wait for the lock")
        killer.execute("SELECT pg_terminate_backend(%s)", (_leader_lock_sessions(killer, granted=True)[0],))
        queued.join(timeout=35)
        assert not queued.is_alive(), "the usurper never got the lock"
        assert _leader_lock_sessions(killer, granted=True) == [usurper.info.backend_pid]
        eventually(lambda: old.metric("spikehound_cluster_leader") == 0, "the old leader to step down", timeout=30)
        windows = _count(usurper, "latency_windows")
        for i, body in enumerate(bodies[cut:cut + 40]):
            send(members[i // 2 % 2].http_endpoint, [body])
        # Nobody leads while the usurper holds the lock: the data is stored, nothing is judged or written.
        assert all(m.metric("spikehound_cluster_leader") == 0 for m in members)
        assert _count(usurper, "latency_windows") == windows
        usurper.execute("SELECT pg_advisory_unlock(%s)", (cluster.LEADER_LOCK,))
        for i, body in enumerate(bodies[cut + 40:]):
            send(members[i // 2 % 2].http_endpoint, [body])
        spikes = _settled(members)

    assert sum(m.metric("spikehound_cluster_leader_takeovers_total") for m in members) >= 2
    essence = [(s["id"], s["service"], s["operation"], s["state"], s["causes"][0]["summary"]) for s in spikes]
    assert essence == [(s["id"], s["service"], s["operation"], s["state"], s["causes"][0]["summary"])
                       for s in one_collector_spikes]


def _leader_lock_sessions(conn: psycopg.Connection[Any], granted: bool) -> list[int]:
    """The backend pids holding (``granted``) or waiting for the leader's advisory lock."""
    rows = conn.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted = %s",
                        (cluster.LEADER_LOCK & 0xFFFFFFFF, granted)).fetchall()
    return [int(pid) for (pid,) in rows]


def _count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_a_members_commits_are_numbered_in_its_feed_with_their_blocks_and_points(pg_url: str):
    engine = make_engine(pg_url)
    upgrade(engine)
    writer = Writer(engine)
    point = MetricPoint("gpu-1", "hw.gpu.utilization", {"hw.id": "GPU-0", "lanes": (1, 2)}, 10, 0.5,
                        MetricKind.GAUGE, "1")
    spans = [make_span(1, 1), make_span(2, 1)]
    writer.write(WriteBatch(spans=spans, points=[point], feed=cluster.FeedStamp("a", 1)))
    writer.write(WriteBatch(spans=[make_span(3, 1)], feed=cluster.FeedStamp("a", 2)))
    writer.write(WriteBatch(points=[point], feed=cluster.FeedStamp("b", 1)))
    with pytest.raises(Exception, match="pk_cluster_feed"):  # a number is never used twice
        writer.write(WriteBatch(spans=[make_span(4, 1)], feed=cluster.FeedStamp("a", 2)))
    with engine.connect() as conn:
        rows = cluster.read_feed(conn, {"a": 0}, ["a", "b"], 10)
        payloads = cluster.block_payloads(conn, [i for r in rows for i in r.block_ids])
    assert [(r.member, r.seq, len(r.block_ids)) for r in rows] == [("a", 1, 1), ("a", 2, 1), ("b", 1, 0)]
    assert cluster.unpack_points(rows[0].points or b"") == [point]  # an array value stays a tuple
    assert len(payloads) == 2
    assert cluster.last_seq(engine, "a") == 2 and cluster.last_seq(engine, "c") == 0
    with engine.begin() as conn:
        cluster.save_cursors(conn, {"a": 1})
        assert cluster.trim_feed(conn, {"a": 1}) == 1
        assert cluster.pending_block_ids(conn, {"a": 1}) == set(rows[1].block_ids)
    engine.dispose()


def test_collectors_starting_together_migrate_the_database_once(pg_url: str):
    engines = [make_engine(pg_url) for _ in range(3)]
    errors: list[BaseException] = []

    def migrate(engine: Any) -> None:
        try:
            upgrade(engine)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert current_revision(engines[0]) == head_revision()
    with engines[0].connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    for e in engines:
        e.dispose()


@pytest.mark.parametrize(("env", "message"), [
    ({"SPIKEHOUND_CLUSTER_ENABLED": "true"}, "cluster.enabled (from SPIKEHOUND_CLUSTER_ENABLED): collectors share"),
    ({"SPIKEHOUND_CLUSTER_MEMBER": "a b"}, "cluster.member (from SPIKEHOUND_CLUSTER_MEMBER): expected 1 to 64"),
    ({"SPIKEHOUND_CLUSTER_MEMBER_TIMEOUT_SECONDS": "1"}, "cluster.member_timeout_seconds (from "
     "SPIKEHOUND_CLUSTER_MEMBER_TIMEOUT_SECONDS): must be at least twice"),
])
def test_a_cluster_setting_that_cannot_work_is_named(env: dict[str, str], message: str, tmp_path: Path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(env={"SPIKEHOUND_DATA_DIR": str(tmp_path), **env})


@pytest.mark.slow
def test_a_hung_leader_is_deposed_and_writes_nothing_when_it_wakes(pg_url: str, tmp_path: Path):
    """SIGSTOP keeps the leader's database session (its kernel still answers for the socket), and with it the
    lock: a follower that hears no heartbeat from it for cluster.member_timeout_seconds ends that session and
    leads. Woken with SIGCONT, the old leader finds its session gone and follows."""
    env = {"SPIKEHOUND_CLUSTER_ENABLED": "true", "SPIKEHOUND_CLUSTER_HEARTBEAT_SECONDS": "0.5",
           "SPIKEHOUND_CLUSTER_MEMBER_TIMEOUT_SECONDS": "3"}
    members = []
    try:
        for i in range(2):
            workdir = tmp_path / f"member-{i}"
            workdir.mkdir()
            members.append(CollectorProcess(pg_url, workdir, env={**env, "SPIKEHOUND_CLUSTER_MEMBER": f"member-{i}"})
                           .start())
        leading = eventually(lambda: [m for m in members if _leads(m)] or None, "a leader")
        (old,) = leading
        (other,) = [m for m in members if m is not old]
        assert old.proc is not None
        old.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        eventually(lambda: _leads(other), "the other member to lead", timeout=30, every=0.2)
        took = time.monotonic() - stopped
        old.proc.send_signal(signal.SIGCONT)
        eventually(lambda: "no longer the detection leader" in old.log_text(), "the old leader to step down", 30)
        assert not _leads(old) and _leads(other)
    finally:
        for m in members:
            m.kill()
    assert 3 <= took <= 15, f"led by the other member {took:.1f} s after the leader hung"
    assert "has sent no heartbeat for 3 s" in other.log_text()


def _leads(member: CollectorProcess) -> bool:
    return (sample(scrape(member.api), "spikehound_cluster_leader") or 0) == 1


def test_the_windows_wait_for_a_missing_member_until_it_is_gone(pg_url: str, caplog: pytest.LogCaptureFixture):
    """A member whose heartbeats stop holds the windows (its agents keep its share meanwhile) for at most
    cluster.member_gone_seconds; then they close on the others' share."""
    bodies = scenario_requests(_scenario())
    leader_first, other = _members(pg_url, 2, cluster__heartbeat_seconds=0.5, cluster__member_timeout_seconds=10,
                                   cluster__member_gone_seconds=10)
    with leader_first:
        eventually(lambda: leader_first.metric("spikehound_cluster_leader") == 1, "the first member to lead")
        with other:
            for i, body in enumerate(bodies[:160]):
                send((leader_first, other)[i // 2 % 2].http_endpoint, [body])
            eventually(lambda: leader_first.metric("spikehound_detector_judged_windows_total") > 0, "judged windows")
        # The other member stopped: once the leader misses its heartbeats, nothing closes while it is missing.
        eventually(lambda: leader_first.metric("spikehound_detection_catching_up") == 1, "the windows to be held",
                   timeout=10)
        closed = leader_first.metric("spikehound_latency_windows_closed_total")
        send(leader_first.http_endpoint, bodies[160:200])  # 20 more seconds of traffic: two windows' worth
        assert "is gone" not in caplog.text
        assert leader_first.metric("spikehound_latency_windows_closed_total") == closed
        eventually(lambda: "member member-1 is gone" in caplog.text, "the member to be gone", timeout=20)
        eventually(lambda: leader_first.metric("spikehound_latency_windows_closed_total") > closed,
                   "the held windows to close on the first member's share")
        assert leader_first.metric("spikehound_detection_catching_up") == 0


@pytest.mark.slow
def test_a_second_collector_given_a_members_name_is_refused_and_a_restart_after_a_crash_is_not(
        pg_url: str, tmp_path: Path):
    env = {"SPIKEHOUND_CLUSTER_ENABLED": "true", "SPIKEHOUND_CLUSTER_MEMBER": "collector-1",
           "SPIKEHOUND_CLUSTER_HEARTBEAT_SECONDS": "0.5", "SPIKEHOUND_CLUSTER_MEMBER_TIMEOUT_SECONDS": "5"}
    first = CollectorProcess(pg_url, _dir(tmp_path / "first"), env=env).start()
    try:
        twin = CollectorProcess(pg_url, _dir(tmp_path / "twin"), env=env)
        with pytest.raises(RuntimeError, match="collector exited with 2"):
            twin.start()
        assert "cluster.member: another collector runs as member 'collector-1'" in twin.log_text()
        first.kill()  # a crash: its row is fresh, its heartbeats have stopped
        first.start()  # the name is taken back after three missed heartbeats
        assert "member collector-1 of the cluster" in first.log_text()
    finally:
        first.kill()


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
