"""Storage faults under load, one episode of each kind: PostgreSQL restarted (fast and immediate
shutdown), PostgreSQL away for a few seconds, the disk under SQLite full, the collector SIGKILLed, and a read
while the database is away.

Whatever the fault, what a sender was told is stored is served afterwards exactly once, the collector answers
senders UNAVAILABLE / 503 with a retry delay while storage is away, says so on /readyz, in one log line and in
its metrics, and resumes by itself. These tests run their own PostgreSQL server, which they stop and restart;
the session's shared one is never touched. The long campaign (dozens of episodes, 60 s outages) is
benchmarks/'s; each test here stays within seconds.
"""

from __future__ import annotations

import resource
import signal
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
import pytest
import requests
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

from harness.api_client import ApiClient, list_spikes
from harness.daemons import (
    AgentProcess,
    CollectorProcess,
    CollectorThread,
    DaemonProcess,
    collector_config,
    detection_settled,
)
from harness.pgserver import PostgresServer
from harness.scrape import sample, scrape, total
from harness.waiting import eventually
from spikehound.collector import pipeline
from tests.support.sdk_traffic import SdkApp, trace_request
from tests.support.served import agent_idle, assert_served_once, grpc_export, http_export, served_span_counts

pytestmark = pytest.mark.slow

ROOT = "POST /v1/generate"  # SdkApp's root span: a SERVER span, so one entry stream per service
UNAVAILABLE_LINE = "storage unavailable"
AVAILABLE_LINE = "storage available again"
# One-second windows and checkpoints, so that a few seconds of traffic cross several of each; the default
# lateness (5 s) and idle flush (3 s), which an outage's or a restart's backlog must live with.
DETECTION_ENV = {"SPIKEHOUND_COLLECTOR_WINDOW_SECONDS": "1", "SPIKEHOUND_DETECTION_CHECKPOINT_SECONDS": "1"}


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg(own_pg_server: PostgresServer) -> PostgresServer:
    """This module's own PostgreSQL server: its tests stop and restart it."""
    return own_pg_server


@pytest.fixture
def pg_db(pg: PostgresServer) -> Iterator[str]:
    """A fresh database on this module's server, which is running again once the test is over."""
    name = f"f_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg.url.rsplit("/", 1)[0] + f"/{name}"
    pg.start()  # a test that failed with the server stopped leaves it to the next one running


@pytest.fixture
def daemons() -> Iterator[Callable[[DaemonProcess], DaemonProcess]]:
    """Registers daemons (collectors, agents) to be killed when the test ends, whatever happened."""
    made: list[DaemonProcess] = []

    def register(daemon: DaemonProcess) -> DaemonProcess:
        made.append(daemon)
        return daemon

    yield register
    for daemon in reversed(made):
        daemon.kill()


# --- helpers ------------------------------------------------------------------------------------


def readiness(api: str) -> tuple[int, str]:
    """/readyz: the status code and the reason it gives."""
    r = requests.get(f"{api}/readyz", timeout=5)
    return r.status_code, r.json().get("reason", "")


def wait_ready(api: str, timeout: float = 15) -> None:
    eventually(lambda: readiness(api)[0] == 200, "/readyz to answer 200 again", timeout, every=0.1)


def lines_with(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def agent_for(collector: str, tmp_path: Path) -> AgentProcess:
    """An agent whose own samples (every 30 s) keep neither the collector's input nor the test busy."""
    return AgentProcess(collector, tmp_path, interval=30, env={"SPIKEHOUND_AGENT_HOST_NAME": "fault-host"})


def assert_one_episode_logged(collector: DaemonProcess) -> str:
    """One line when storage went away and one when it was back (once writes had gone through for a few
    seconds), not one per request; the first is returned."""
    eventually(lambda: lines_with(collector.log_text(), AVAILABLE_LINE), f"the '{AVAILABLE_LINE}' line", 10)
    log = collector.log_text()
    down, up = lines_with(log, UNAVAILABLE_LINE), lines_with(log, AVAILABLE_LINE)
    assert len(down) == 1 and len(up) == 1, \
        f"{len(down)} '{UNAVAILABLE_LINE}' and {len(up)} '{AVAILABLE_LINE}' lines, not one each:\n" + \
        "\n".join((down + up)[:20])
    return down[0]


def assert_each_request_counted_once(api: str, app: SdkApp, service: str) -> None:
    """Once every window is closed and judged: the windows of ``service``'s entry stream count each of its
    requests once (none twice, none lost, none left out as late), no window is served twice, and no spike is
    stored twice."""
    eventually(lambda: detection_settled(lambda name: sample(scrape(api), name) or 0.0),
               "every window closed and judged", 15, every=0.25)
    late = int(total(scrape(api), "spikehound_latency_late_spans_total"))
    acked = app.recording.acked
    roots = {key for span in app.recording.spans if span.name == ROOT
             if (key := (format(span.context.trace_id, "032x"), format(span.context.span_id, "016x"))) in acked}
    points = ApiClient(api).get_json("/api/v1/latency", service=service, operation=ROOT)["points"]
    assert len({p["t"] for p in points}) == len(points), "a window served twice"
    counted = sum(p["count"] for p in points)
    numbers = f"{len(roots)} requests made and stored, {counted} counted in windows, {late} spans counted late"
    assert counted <= len(roots), f"requests counted twice: {numbers}"
    assert counted + late == len(roots), f"requests neither in a window nor counted late: {numbers}"
    assert late == 0, f"the backlog came too late for its windows: {numbers}"
    spikes = list_spikes(api)
    keys = [(s["service"], s["operation"], s["peer_service"], s["start"]) for s in spikes]
    assert len(set(keys)) == len(keys), f"a spike stored twice: {keys}"


# --- 1: PostgreSQL restarted under load ---------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgresql_restarted_under_load_loses_and_duplicates_nothing(pg: PostgresServer, pg_db: str, mode: str):
    with CollectorThread(collector_config(pg_db)) as c:
        client = ApiClient(c.api)
        assert client.get_json("/api/v1/services")["services"] == []  # a dashboard's reader connection, pooled
        # The senders retry an export for 30 s: on a busy machine an immediate restart's recovery alone can take
        # longer than the SDK's default 10 s, and what is asserted is the collector's part, not the machine's speed.
        apps = [SdkApp(c.grpc_endpoint, "restart-grpc", traces_per_second=20, export_timeout=30).start(),
                SdkApp(c.http_endpoint, "restart-http", traces_per_second=20,
                       exporter=HttpSpanExporter(endpoint=f"{c.http_endpoint}/v1/traces", timeout=30)).start()]
        try:
            eventually(lambda: all(len(app.recording.acked) >= 200 for app in apps), "exports acknowledged", 30)
            pg.restart(mode)
            before = [len(app.recording.acked) for app in apps]
            eventually(lambda: all(len(app.recording.acked) >= n + 200 for app, n in zip(apps, before, strict=True)),
                       f"both senders acknowledged again after the {mode} restart", 45)
        finally:
            for app in apps:
                app.stop()
        wait_ready(c.api)
        assert requests.get(f"{c.api}/healthz", timeout=5).status_code == 200
        for app in apps:  # every export went through in the end: the SDK gave nothing up
            assert not app.recording.failed, f"{len(app.recording.failed)} spans the SDK gave up on ({mode})"
        acked = set().union(*(app.recording.acked for app in apps))
        assert_served_once(c.api, acked)
        services = {s["service"] for s in client.get_json("/api/v1/services")["services"]}
        assert {"restart-grpc", "restart-http"} <= services


# --- 2: PostgreSQL away for a few seconds, senders going through an agent -------------------------

OUTAGE_SECONDS = 4.0


@pytest.mark.postgres
def test_postgresql_away_under_load_through_an_agent(pg: PostgresServer, pg_db: str, tmp_path: Path, daemons):
    c = daemons(CollectorProcess(pg_db, tmp_path, env=DETECTION_ENV)).start()
    agent = daemons(agent_for(c.grpc_endpoint, tmp_path)).start()
    app = SdkApp(agent.grpc_endpoint, "outage-app", traces_per_second=20).start()
    try:
        eventually(lambda: agent.metric("spikehound_agent_forwarded_total", signal="spans") >= 100,
                   "spans forwarded before the outage", 20)
        assert sample(scrape(c.api), "spikehound_storage_available") == 1

        pg.shutdown("fast")
        stopped = time.monotonic()
        _, reason = eventually(lambda: (r := readiness(c.api))[0] == 503 and r,
                               "/readyz to answer 503 while PostgreSQL is down", 10)
        assert "storage" in reason, reason

        # Senders are told to come back, with a delay, over both protocols.
        probe, _ = trace_request("probe-app", spans=3)
        code, delay = grpc_export(c.grpc_endpoint, probe)
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert delay is not None and 0 < delay <= 5, f"RetryInfo delay {delay}"
        r = http_export(c.http_endpoint, probe)
        assert r.status_code == 503, (r.status_code, r.content)
        assert 1 <= int(r.headers["Retry-After"]) <= 5, r.headers

        metrics = scrape(c.api)
        assert sample(metrics, "spikehound_storage_available") == 0
        assert total(metrics, "spikehound_storage_outages_total") == 1
        assert total(metrics, "spikehound_ingest_rejected_requests_total", reason="storage_unavailable") >= 1

        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - stopped)))
        # The agent was told so too: its forwards failed as "unavailable", and it kept what it had acknowledged.
        assert agent.metric("spikehound_agent_forward_failures_total", reason="unavailable") > 0
        pg.start()
        back = time.monotonic()
        wait_ready(c.api)
    finally:
        app.stop()
    # The agent's backlog goes in within seconds of storage: it waits what the collector asked, not its own
    # back-off.
    eventually(lambda: agent_idle(agent), "the agent's queues drained", 20)
    print(f"\nthe agent's queues drained {time.monotonic() - back:.1f} s after PostgreSQL came back")

    assert c.running, c.log_tail()
    assert not app.recording.failed, f"{len(app.recording.failed)} spans the SDK gave up on"
    assert_served_once(c.api, app.recording.acked)
    assert agent.metric("spikehound_agent_dropped_total", signal="spans") == 0
    # Detection: the windows open when storage went away are judged after it, with the backlog in them.
    assert_each_request_counted_once(c.api, app, "outage-app")
    assert_one_episode_logged(c)
    metrics = scrape(c.api)
    assert sample(metrics, "spikehound_storage_available") == 1
    assert total(metrics, "spikehound_storage_outages_total") == 1


# --- 3: the disk under SQLite full ------------------------------------------------------------------

ROOM = 256 * 1024  # bytes a database file may still grow once the "disk" is nearly full


def test_full_disk_under_sqlite_refuses_writes_keeps_serving_reads_and_recovers(tmp_path: Path, daemons):
    # RLIMIT_FSIZE (prlimit) on the collector: a write past it fails with EFBIG (Python ignores SIGXFSZ), as a
    # full file system's does with ENOSPC, and nothing needs mounting.
    db = tmp_path / "spikehound.db"
    c = daemons(CollectorProcess(f"sqlite:///{db}", tmp_path)).start()
    assert c.proc is not None
    acked: Counter[str] = Counter()  # trace id -> spans acknowledged

    def send() -> requests.Response:
        payload, trace_id = trace_request("disk-app", spans=20, padding=300)
        r = http_export(c.http_endpoint, payload)
        if r.status_code == 200:
            acked[trace_id.hex()] += 20
        return r

    for _ in range(5):
        assert send().status_code == 200
    stored_before = next(iter(acked))
    largest = max(p.stat().st_size for p in tmp_path.glob("spikehound.db*"))
    _, hard = resource.prlimit(c.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(c.proc.pid, resource.RLIMIT_FSIZE, (largest + ROOM, hard))
    try:
        for _ in range(500):
            r = send()
            if r.status_code != 200:
                break
        else:
            pytest.fail(f"the collector took {len(acked)} requests on a full disk")
        assert r.status_code == 503, (r.status_code, r.content)
        assert 1 <= int(r.headers["Retry-After"]) <= 5, r.headers
        code, delay = grpc_export(c.grpc_endpoint, trace_request("disk-app", spans=20, padding=300)[0])
        assert code == grpc.StatusCode.UNAVAILABLE and delay is not None and delay > 0, (code, delay)

        # Reads go on: what was stored before is served.
        client = ApiClient(c.api)
        assert len(client.get_json(f"/api/v1/traces/{stored_before}")["spans"]) == 20
        assert "disk-app" in {s["service"] for s in client.get_json("/api/v1/services")["services"]}
        status, reason = readiness(c.api)
        assert status == 503 and "storage" in reason, (status, reason)
        assert sample(scrape(c.api), "spikehound_storage_available") == 0
        print(f"\n/readyz while the disk is full: {reason}")
    finally:
        resource.prlimit(c.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # room again

    eventually(lambda: send().status_code == 200, "a request taken once there is room", 10, every=0.5)
    wait_ready(c.api)
    for _ in range(5):
        assert send().status_code == 200

    served = served_span_counts(c.api, acked)
    assert Counter(trace_id for trace_id, _ in served.elements()) == acked  # every acknowledged request, once
    assert set(served.values()) == {1}
    line = assert_one_episode_logged(c)
    metrics = scrape(c.api)
    assert sample(metrics, "spikehound_storage_available") == 1
    assert total(metrics, "spikehound_storage_outages_total") == 1
    outages = {labels: n for (name, labels), n in metrics.items() if name == "spikehound_storage_outages_total"}
    print(f"logged: {line}\ncounted: {outages}")
    assert c.running
    assert c.terminate(15) == 0, c.log_tail()


# --- 4: the collector SIGKILLed under load, senders going through an agent ------------------------


@pytest.mark.postgres
def test_sigkill_under_load_through_an_agent_serves_everything_once_and_counts_each_request_once(
        pg_db: str, tmp_path: Path, daemons):
    c = daemons(CollectorProcess(pg_db, tmp_path, env=DETECTION_ENV)).start()
    agent = daemons(agent_for(c.grpc_endpoint, tmp_path)).start()
    app = SdkApp(agent.grpc_endpoint, "kill-app", traces_per_second=30).start()
    try:
        # Past a checkpoint or two, so that the restart continues from one and re-reads what came after it.
        eventually(lambda: agent.metric("spikehound_agent_forwarded_total", signal="spans") >= 400,
                   "spans forwarded before the kill", 20)
        assert c.proc is not None
        c.proc.send_signal(signal.SIGKILL)
        assert c.proc.wait(10) == -signal.SIGKILL
        c.start()  # same database, same ports: the agent finds it again with its backlog
    finally:
        app.stop()
    eventually(lambda: agent_idle(agent), "the agent's queues drained", 20)

    assert not app.recording.failed, f"{len(app.recording.failed)} spans the SDK gave up on"
    acked = app.recording.acked
    assert_served_once(c.api, acked)

    # Detection: each request counted once in its latency window, across the kill; no window or spike twice.
    assert_each_request_counted_once(c.api, app, "kill-app")
    assert c.terminate(15) == 0, c.log_tail()


# --- 5: a read while PostgreSQL is down -------------------------------------------------------------


@pytest.mark.postgres
def test_a_read_while_postgresql_is_down_answers_503_with_a_json_error(pg: PostgresServer, pg_db: str):
    with CollectorThread(collector_config(pg_db)) as c:
        payload, trace_id = trace_request("read-app", spans=3)
        assert http_export(c.http_endpoint, payload).status_code == 200
        client = ApiClient(c.api)
        assert len(client.get_json(f"/api/v1/traces/{trace_id.hex()}")["spans"]) == 3  # a pooled reader connection
        pg.shutdown("fast")
        try:
            for path in (f"/api/v1/traces/{trace_id.hex()}", "/api/v1/services"):
                r = client.get(path)  # the answer checked against the served OpenAPI document
                assert r.status_code == 503, f"GET {path} answered {r.status_code}: {r.text[:300]}"
                assert r.headers["Content-Type"].startswith("application/json"), r.headers
                assert r.json()["error"].startswith("storage unavailable"), r.json()
                assert int(r.headers["Retry-After"]) >= 1, r.headers
        finally:
            pg.start()
        eventually(lambda: client.get(f"/api/v1/traces/{trace_id.hex()}").status_code == 200,
                   "the trace served again once PostgreSQL is back", 10)


def test_a_write_that_hangs_is_an_outage_and_senders_are_refused_until_it_ends(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch):
    # A database that holds a write without failing it (here another process holding SQLite's write lock, as a
    # hung PostgreSQL would): past the stall limit (10 s; 1 s here) senders are refused instead of left waiting.
    monkeypatch.setattr(pipeline, "STALL_SECONDS", 1.0)
    db = tmp_path / "spikehound.db"
    with CollectorThread(collector_config(f"sqlite:///{db}")) as c, ThreadPoolExecutor(1) as pool:
        first, _ = trace_request("stall-app", spans=2)
        assert http_export(c.http_endpoint, first).status_code == 200
        holder = sqlite3.connect(db, timeout=0, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, as a backup script or a stuck process holds it
        try:
            waiting = pool.submit(http_export, c.http_endpoint, trace_request("stall-app", spans=2)[0], timeout=60)
            _, reason = eventually(lambda: (r := readiness(c.api))[0] == 503 and r,
                                   "/readyz to answer 503 while the write hangs", 10)
            assert "has not answered a write" in reason, reason
            refused = http_export(c.http_endpoint, trace_request("stall-app")[0], timeout=5)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert not waiting.done()  # the request in the hung write still waits for its commit
        finally:
            holder.rollback()
            holder.close()
        assert waiting.result(30).status_code == 200  # committed once the lock went: answered as stored
        wait_ready(c.api)
