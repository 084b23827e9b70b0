"""The detectors in a process of their own (``detection.own_process``, the default): a real collector process,
real OTLP/HTTP, real signals.

A killed detection process is forked again and continues from the checkpoint without losing the fault in
flight, also while the collector's gRPC server is busy; a killed collector takes its detection process with it,
and none of its ports stays bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.api_client import list_spikes
from harness.daemons import CollectorProcess, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from harness.scrape import Samples, sample, scrape, total
from harness.waiting import eventually
from spikehound.collector import detection_process
from spikehound.collector.detection_driver import DriverSettings
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from tests.support.sdk_traffic import GrpcExports

pytestmark = pytest.mark.slow


def _detection_process(collector: CollectorProcess) -> psutil.Process:
    assert collector.proc is not None
    (child,) = psutil.Process(collector.proc.pid).children()
    return child


def _metric(collector: CollectorProcess, name: str) -> float:
    return sample(scrape(collector.api), name) or 0.0


def _counted_as_stored(collector: CollectorProcess) -> Samples | None:
    """The collector's samples once its span metrics count as many spans as it stored."""
    samples = scrape(collector.api)
    counted = total(samples, "traces_span_metrics_calls_total")
    return samples if counted == sample(samples, "spikehound_ingest_stored_total", signal="spans") else None


@contextlib.contextmanager
def _under_grpc_load(tmp_path: Path) -> Iterator[tuple[CollectorProcess, GrpcExports]]:
    """A collector on SQLite whose gRPC server four senders keep busy (20 requests acknowledged already); both
    stopped on the way out."""
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path)
    collector.start()
    load = GrpcExports(collector.grpc_endpoint, senders=4).start()
    try:
        load.wait_acked(20)
        yield collector, load
    finally:
        load.stop()
        collector.kill()


def test_a_killed_detection_process_is_forked_again_and_still_finds_the_fault(tmp_path: Path):
    # Two and a half minutes of warm-up, a 40-second slow feature query from 150 s, then calm. The
    # detection process is killed 20 s before the fault: its replacement continues from the checkpoint saved
    # at start and replays everything committed since.
    sc = Scenario("slow_db", "large", seed=3, minutes=3.5, onset_s=150.0, fault_s=40.0)
    bodies = scenario_requests(sc)
    cut = 2 * (int(sc.onset_s) - 20)  # two requests a second of the scenario
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path)
    collector.start()
    try:
        first = _detection_process(collector)
        send(collector.http_endpoint, bodies[:cut])
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        send(collector.http_endpoint, bodies[cut:])
        # (Windows the dead process had judged and written are judged and written again by the replay, so
        # the written count runs ahead of the judged one: settled is every window closed and the spike over.)
        def settled() -> list[dict] | None:
            spikes = list_spikes(collector.api)
            over = spikes and all(s["state"] == "resolved" for s in spikes)
            return spikes if over and _metric(collector, "spikehound_latency_open_windows") == 0 else None

        spikes = eventually(settled, "the spike to be found and to end", timeout=90, every=0.25)
        second = _detection_process(collector)
        restarts = _metric(collector, "spikehound_detection_process_restarts_total")
    finally:
        collector.kill()
    assert second.pid != first.pid and restarts == 1
    assert "started again from the checkpoint" in collector.log_text()
    (spike,) = spikes
    assert (spike["service"], spike["operation"], spike["state"]) == ("gateway", "POST /v1/predict", "resolved")
    top = spike["causes"][0]
    assert (top["kind"], top["service"], top["operation"]) == ("span", "preprocess", "SELECT features"), top


def test_a_detection_process_killed_under_grpc_load_is_started_again_every_time(tmp_path: Path):
    # The child is forked from a collector whose gRPC server is serving exports. With grpcio's fork support on
    # (its default), most such forks crashed within milliseconds (SIGSEGV, or SIGABRT in ev_epoll1), and the
    # detectors stayed down, a new crash every 5 s, for as long as the load lasted.
    with _under_grpc_load(tmp_path) as (collector, load):
        for kills in range(1, 5):
            gone = _detection_process(collector)
            os.kill(gone.pid, signal.SIGKILL)
            gone.wait(10)

            def serving(gone_pid: int = gone.pid) -> int | None:
                children = psutil.Process(collector.proc.pid).children() if collector.proc else []
                pids = {c.pid for c in children} - {gone_pid}
                started = collector.log_text()
                return next((pid for pid in pids if f"detection runs in process {pid} " in started), None)

            eventually(serving, f"a new detection process after kill {kills}", timeout=60, every=0.1)
        load.wait_acked(load.acked + 20)  # still taking exports
        restarts = _metric(collector, "spikehound_detection_process_restarts_total")
        load.stop()
        # The span metrics are counted in the detection process: the spans of the commits a killed one had not
        # answered, and of those made while none ran, are counted by the collector, and none twice.
        samples = eventually(lambda: _counted_as_stored(collector), "every stored span counted once in the span "
                             "metrics", timeout=30, every=0.2)
    log = collector.log_text()
    assert restarts == 4, log[-3000:]
    assert total(samples, "traces_span_metrics_calls_total") >= load.acked * load.spans > 0
    assert "could not be started again" not in log and not re.search(r"exit code -(6|11)\b", log), log[-3000:]


def test_a_killed_collector_takes_its_detection_process_with_it(tmp_path: Path):
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path)
    collector.start()
    child = _detection_process(collector)
    assert collector.proc is not None
    assert child.cmdline() == psutil.Process(collector.proc.pid).cmdline()  # forked: the same program
    api_port = int(collector.api.rsplit(":", 1)[1])
    collector.kill()
    # The pipe closes with the collector; the child ends on it instead of running on, unowned.
    eventually(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
               "the detection process to end with the collector", timeout=10, every=0.1)
    with socket.socket() as again:  # no listener the child inherited keeps the port
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", api_port))


def test_a_stopped_detection_process_holds_the_senders_back_without_an_outage_of_storage(tmp_path: Path):
    # SIGSTOPped under load, the detection process takes no commit: the writer waits for it, the queue fills and
    # the receivers push back. Storage answered every commit meanwhile: it must not be declared unreachable
    # (senders told UNAVAILABLE, /readyz 503, an outage counted) for the detection process's stop.
    with _under_grpc_load(tmp_path) as (collector, load):
        child = _detection_process(collector)
        child.suspend()
        eventually(lambda: "for the detection process to take it" in collector.log_text(),
                   "the writer to say it waits for the detection process", timeout=40, every=0.2)
        waiting_while_stopped = sample(scrape(collector.api), "spikehound_detection_waiting_bytes")
        child.resume()
        load.wait_acked(load.acked + 20)  # taking exports again, from the same detection process
        outages = total(scrape(collector.api), "spikehound_storage_outages_total")
        load.stop()
        eventually(lambda: _counted_as_stored(collector), "every stored span counted once", timeout=30, every=0.2)
        eventually(lambda: sample(scrape(collector.api), "spikehound_detection_waiting_bytes") == 0,
                   "the detection process to take what waited", timeout=30, every=0.2)
        same_child = _detection_process(collector).pid == child.pid
    assert outages == 0 and "storage unavailable" not in collector.log_text()
    assert same_child  # resumed within ANSWER_SECONDS: not replaced
    # What waited for it was on /metrics: near the 32 MiB the writer waits at, the rest still in the pipe
    assert waiting_while_stopped is not None and waiting_while_stopped > detection_process.WAITING_BYTES / 2


def test_a_resume_that_lasts_says_so_while_commits_wait_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture):
    # A restart's replay may take minutes (RESUME_SECONDS allows 30); a detection process stopped while it
    # resumes holds the commits as long. Either way the log says so meanwhile, not only at the end.
    monkeypatch.setattr(detection_process, "RESUME_LOG_SECONDS", 0.3)
    ask = detection_process._Child.ask

    def stopped_before_it_resumes(child: detection_process._Child, kind: str, *args: object) -> object:
        if kind == "resume":  # stopped before it reads the message, started again a second and a half later
            os.kill(child.process.pid, signal.SIGSTOP)
            threading.Timer(1.5, os.kill, (child.process.pid, signal.SIGCONT)).start()
        return ask(child, kind, *args)

    monkeypatch.setattr(detection_process._Child, "ask", stopped_before_it_resumes)
    url = f"sqlite:///{tmp_path / 'spikehound.db'}"
    engine = make_engine(url)
    upgrade(engine)
    telemetry = CollectorTelemetry()

    async def start_and_stop() -> None:
        writer_thread = WriterThread()
        await writer_thread.start()
        detection = detection_process.ProcessDetection(
            DriverSettings.from_config(collector_config(url)), url, "NORMAL", engine, writer_thread,
            StorageHealth(telemetry), telemetry)

        async def flush() -> bool:
            return True

        await detection.start(flush)
        await detection.stop(flush)
        await writer_thread.stop()

    with caplog.at_level(logging.WARNING, logger="spikehound.collector.detection"):
        asyncio.run(start_and_stop())
    waiting = [r for r in caplog.records if "has been resuming for" in r.getMessage()]
    assert len(waiting) >= 2, [r.getMessage() for r in waiting]  # said meanwhile, more than once
    # ...and not more often than every RESUME_LOG_SECONDS (a loaded machine only spaces the lines further)
    gaps = [later.created - earlier.created for earlier, later in itertools.pairwise(waiting)]
    assert min(gaps) >= 0.25, gaps
    engine.dispose()
