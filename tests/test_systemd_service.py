"""The daemons as systemd runs them: notifications on a real unix-datagram NOTIFY_SOCKET, SIGTERM, SIGHUP.

Each test starts ``spikehound collector`` or ``spikehound agent`` as a child process with ``NOTIFY_SOCKET``
(and ``WATCHDOG_USEC``) pointing at a socket the test reads, as systemd's manager would. What is checked
is what systemd and an operator see: the datagrams, the exit status within the unit's ``TimeoutStopSec``,
the data on disk afterwards, the log, and that senders lose nothing across reloads.
"""

from __future__ import annotations

import signal
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

from harness.api_client import get_json, request
from harness.daemons import CollectorProcess, CollectorThread, collector_config, free_port
from harness.scrape import scrape
from harness.waiting import eventually
from spikehound.agent.spool import DiskSpool
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.storage import checkpoints
from spikehound.storage.engine import make_engine
from spikehound.storage.reader import Reader
from tests.support.sdk_traffic import SdkApp, send_spans
from tests.support.systemd_notify import (
    Notified,
    NotifiedAgent,
    NotifiedCollector,
    NotifySocket,
    send_traces,
    stop_as_systemd_does,
)

pytestmark = pytest.mark.slow













@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    yield sock
    sock.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket path has at most 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="sh-") as name:
        yield Path(name)






def assert_systemd_saw_a_proper_start(daemon: Notified, notify: NotifySocket) -> None:
    assert daemon.ports_at_ready is not None and all(daemon.ports_at_ready.values()), daemon.ports_at_ready
    before_ready = notify.messages[:-1]
    assert any(m.get("STATUS", "").endswith("starting") for m in before_ready), notify.messages
    assert notify.messages[-1]["STATUS"].endswith("running")
    for _ in range(5):  # the event loop keeps pinging
        notify.wait_for("WATCHDOG", "1", timeout=10)


def test_collector_is_ready_only_when_listening_pings_the_watchdog_and_saves_open_windows_on_sigterm(tmp_path,
                                                                                                  notify):
    db = tmp_path / "spikehound.db"
    # Windows stay open in memory; the stop saves them with the detectors' checkpoint, which the next start
    # continues (so a restart does not cut a window in two).
    collector = NotifiedCollector(f"sqlite:///{db}", tmp_path, notify, SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS="3600")
    try:
        collector.start()
        assert_systemd_saw_a_proper_start(collector, notify)

        send_traces(collector.grpc_endpoint, n=20)
        reader = Reader(make_engine(f"sqlite:///{db}"))
        assert reader.latency("llm-gateway", None, 0, 2**62) == []  # still open, in memory
        stop_as_systemd_does(collector, "spikehound-collector.service")
    finally:
        collector.kill()
    saved = checkpoints.load(make_engine(f"sqlite:///{db}"), "detection")
    assert saved is not None, "no checkpoint written at stop"
    windows = DetectionEngine.restore(DetectionSettings(), saved.state).flush().windows
    # Every entry span of the acknowledged traces is in the saved open windows.
    assert sum(w.count for w in windows if w.service == "llm-gateway") == 20, windows
    assert "collector stopped" in collector.log_text()


def test_agent_is_ready_only_when_listening_pings_the_watchdog_and_spools_its_queue_on_sigterm(tmp_path, short_dir):
    notify = NotifySocket(short_dir)  # a socket path this time, as systemd's NOTIFY_SOCKET usually is
    nowhere = f"127.0.0.1:{free_port()}"  # the collector is away: what the agent takes stays queued
    agent = NotifiedAgent(nowhere, tmp_path, notify, SPIKEHOUND_AGENT_DRAIN_SECONDS="1")
    try:
        agent.start()
        assert_systemd_saw_a_proper_start(agent, notify)

        send_traces(agent.grpc_endpoint)
        stop_as_systemd_does(agent, "spikehound-agent.service")
    finally:
        agent.kill()
        notify.close()
    spool = DiskSpool(agent.spool_dir, 2**30)
    try:
        assert len(spool) > 0  # the queued requests were written to disk for the next start
    finally:
        spool.close()
    assert "left in the disk spool for the next start" in agent.log_text(), agent.log_tail()


def test_without_notify_socket_the_daemon_runs_as_before(tmp_path):
    """No NOTIFY_SOCKET (not under systemd): nothing is sent, nothing fails, SIGHUP does not kill it."""
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path).start()
    try:
        collector.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "configuration reloaded" in collector.log_text(), "the reload logged", 30)
        assert collector.ready()
        assert collector.terminate(60) == 0
    finally:
        collector.kill()
    assert "cannot notify systemd" not in collector.log_text()


# --- SIGHUP ------------------------------------------------------------------------------------


def write_config(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)  # what an editor or a configuration manager does: never a half-written file


def test_sighup_reloads_the_agents_log_level_without_dropping_data(tmp_path, notify):
    config = tmp_path / "agent.toml"
    write_config(config, '[log]\nlevel = "info"\n')
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}")) as collector:
        agent = NotifiedAgent(collector.grpc_endpoint, tmp_path, notify, SPIKEHOUND_CONFIG=str(config))
        agent.interval = 0.2
        try:
            agent.start()
            app = SdkApp(agent.grpc_endpoint, "llm-gateway", traces_per_second=20).start()
            try:
                # The samplers have ticked (their readings reached the collector), and their per-tick line,
                # at debug, is not in the log: not a pause that a loaded host might not fill with a tick.
                eventually(lambda: collector.metric("spikehound_ingest_stored_total", signal="metrics") > 0,
                           "the agent's first samples stored", 60)
                assert "sampled" not in agent.log_text()

                write_config(config, '[log]\nlevel = "debug"\n[agent]\nhost_name = "renamed"\n')
                agent.proc.send_signal(signal.SIGHUP)
                notify.wait_for("RELOADING", "1")
                assert notify.wait_for("READY", "1")["STATUS"].endswith("configuration reloaded")
                eventually(lambda: "sampled" in agent.log_text(), "debug lines after the reload", 30)
                log = agent.log_text()
                assert "now in effect: log.level" in log
                assert "agent.host_name changed in the configuration; it takes effect at the next restart" in log

                write_config(config, '[log]\nlevel = "loud"\n')  # a bad edit: refused, the agent keeps running
                agent.proc.send_signal(signal.SIGHUP)
                refused = notify.wait_for("READY", "1")
                assert "reload failed" in refused["STATUS"] and "log.level" in refused["STATUS"]
                assert "reload failed; the running configuration stays in effect" in agent.log_text()
                after_refusal = len(app.recording.acked)
                eventually(lambda: len(app.recording.acked) > after_refusal + 5, "spans acknowledged after it", 60)
            finally:
                app.stop()
            assert agent.terminate(60) == 0
        finally:
            agent.kill()
        acked = app.recording.acked
        assert len(acked) > 20 and not app.recording.failed  # the app sent all along, through both reloads ...
        reader = Reader(collector.collector.engine)
        traces = {bytes.fromhex(t) for t, _ in acked}
        stored = lambda: {(s.trace_id.hex(), s.span_id.hex()) for t in traces for s in reader.trace(t)}  # noqa: E731
        eventually(lambda: stored() >= acked, "every acknowledged span stored", 30)  # ... and lost nothing


def test_sighup_applies_new_retention_caps_at_once_and_the_collector_keeps_taking_data(tmp_path, notify):
    db, config = tmp_path / "spikehound.db", tmp_path / "collector.toml"
    write_config(config, "[storage]\nspan_retention_max_bytes = 0\n")
    collector = NotifiedCollector(f"sqlite:///{db}", tmp_path, notify, SPIKEHOUND_CONFIG=str(config))
    try:
        collector.start()
        traces = []
        for i in range(10):  # ten requests, one stored block each, oldest first
            recording = send_spans(GrpcSpanExporter(endpoint=collector.grpc_endpoint, insecure=True),
                                   {"service.name": "llm-gateway", "request": str(i)}, n=1)
            traces.append(next(iter(recording.acked))[0])
        with closing(sqlite3.connect(db)) as conn:
            sizes = [n for (n,) in conn.execute("SELECT length(payload) FROM span_blocks ORDER BY id")]
        assert len(sizes) == 10
        cap = sum(sizes[-4:])  # room for the newest four

        write_config(config, f"[storage]\nspan_retention_max_bytes = {cap}\n[collector]\nqueue_capacity = 1000\n")
        collector.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING", "1")
        notify.wait_for("READY", "1")
        deleted = ("spikehound_retention_deleted_total", (("reason", "size"), ("table", "spans")))
        eventually(lambda: scrape(collector.api).get(deleted) == 18, "six blocks of three spans deleted", 30)
        kept = [request("GET", f"{collector.api}/api/v1/traces/{t}").status_code == 200 for t in traces]
        assert kept == [False] * 6 + [True] * 4  # oldest arrivals first
        assert scrape(collector.api)[("spikehound_storage_span_payload_bytes", ())] == cap
        log = collector.log_text()
        assert "now in effect: storage.span_retention_max_bytes" in log
        assert "collector.queue_capacity changed in the configuration; it takes effect at the next restart" in log

        app = SdkApp(collector.grpc_endpoint, "model-server", traces_per_second=20).start()
        try:
            eventually(lambda: len(app.recording.acked) > 5, "spans acknowledged before the reload", 60)
            write_config(config, f"[storage]\nspan_retention_max_bytes = {cap}\n[log]\nlevel = \"warning\"\n")
            collector.proc.send_signal(signal.SIGHUP)
            notify.wait_for("READY", "1")
            after_reload = len(app.recording.acked)
            eventually(lambda: len(app.recording.acked) > after_reload + 5, "spans acknowledged after it", 60)
        finally:
            app.stop()
        acked = app.recording.acked
        assert len(acked) > 10 and not app.recording.failed
        served = set()
        for trace_id in {t for t, _ in acked}:
            body = get_json(f"{collector.api}/api/v1/traces/{trace_id}")
            served |= {(s["trace_id"], s["span_id"]) for s in body["spans"]}
        assert served == acked  # nothing lost while reloading
        assert collector.terminate(60) == 0
    finally:
        collector.kill()
    assert "collector stopped" not in collector.log_text()  # level warning by then: info lines are gone
