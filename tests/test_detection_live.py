"""Detection inside a running collector: live ingest against replay, and a restart in the middle of a spike.

Traffic is the scenario generator's (harness/scenarios/traffic.py), sent as real OTLP/HTTP requests to a real
collector; the replay reads the same requests from a recorded file through ``spikehound replay``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.api_client import list_spikes
from harness.daemons import CollectorProcess, CollectorThread, collector_config, detection_settled
from harness.scenario_io import scenario_requests, send, write_json_lines, write_protobuf
from harness.scenarios.traffic import Scenario
from harness.scrape import sample, scrape
from harness.waiting import eventually
from spikehound.collector.daemon import single_collector_pipeline
from spikehound.collector.ingest_queue import IngestQueue
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.otlp import encode_spans
from spikehound.storage import checkpoints
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.spike_fields import spike_fields

pytestmark = pytest.mark.slow


def _scenario() -> Scenario:
    # Three and a half minutes of warm-up (21 windows), a one-minute slow feature query, then calm.
    return Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)


def _spikes_when(collector: CollectorProcess, ready: Callable[[list[dict[str, Any]]], bool], what: str
                 ) -> list[dict[str, Any]]:
    """The spikes once ``ready`` accepts them; a failure shows the end of the collector's log."""
    def check() -> tuple[list[dict[str, Any]]] | None:  # in a tuple: an empty list can be the answer
        spikes = list_spikes(collector.api)
        return (spikes,) if ready(spikes) else None

    try:
        (spikes,) = eventually(check, what, every=0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the collector's log ends:\n{collector.log_tail()}") from exc
    return spikes


def _settled(api: str, metric: Callable[[str], float], timeout: float = 60) -> list[dict[str, Any]]:
    """The spikes once the collector has closed, judged and written every window (``metric`` reads a sample)."""
    eventually(lambda: detection_settled(metric), "the collector to judge every window", timeout=timeout,
               every=0.25)
    return list_spikes(api)


def _metric(api: str, name: str) -> float:
    """The unlabelled sample ``name``, which the collector must show."""
    value = sample(scrape(api), name)
    assert value is not None, f"{api}/metrics shows no unlabelled {name}"
    return value


def _replay(*files: Path) -> list[dict[str, Any]]:
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent))
    assert exe, "spikehound is not installed in this environment"
    done = subprocess.run([exe, "replay", "--format", "json", *map(str, files)], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout)["spikes"]


def test_replay_finds_what_live_ingest_found(tmp_path: Path):
    bodies = scenario_requests(_scenario())
    recording = tmp_path / "capture.binpb"
    write_protobuf(recording, bodies)
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'live.db'}")) as live:
        send(live.http_endpoint, bodies)
        live_spikes = _settled(live.api, live.metric)

    # One fault, one spike: led by the entry stream, with the service that ran the slow query (and the hops
    # into it) among the streams it moved, and named.
    (spike,) = live_spikes
    assert (spike["service"], spike["operation"], spike["state"]) == ("gateway", "POST /v1/predict", "resolved")
    moved = {(a["peer_service"], a["service"], a["operation"]) for a in spike["affected_streams"]}
    assert {(None, "preprocess", "/preprocess"), ("gateway", "preprocess", "/preprocess")} <= moved, moved
    top = spike["causes"][0]
    assert (top["kind"], top["service"], top["operation"]) == ("span", "preprocess", "SELECT features"), top

    assert [spike_fields(s) for s in _replay(recording)] == [spike_fields(s) for s in live_spikes]


def test_replay_reads_json_lines_as_the_file_exporter_writes_them(tmp_path: Path):
    bodies = scenario_requests(_scenario())
    write_protobuf(tmp_path / "capture.binpb", bodies)
    write_json_lines(tmp_path / "capture.jsonl", bodies)
    from_json = _replay(tmp_path / "capture.jsonl")
    assert from_json, "the JSON lines replay found nothing"
    assert [spike_fields(s) for s in from_json] == [spike_fields(s) for s in _replay(tmp_path / "capture.binpb")]


def test_replay_names_an_unreadable_file(tmp_path: Path):
    bad = tmp_path / "notes.jsonl"
    bad.write_text('{"resourceSpans": []}\nthis is not json\n')
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent))
    done = subprocess.run([exe, "replay", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{bad}: line 2: not JSON" in done.stderr


def test_restart_in_the_middle_of_a_spike_keeps_it_and_does_not_rewarm(tmp_path: Path):
    sc = _scenario()
    bodies = scenario_requests(sc)
    # Stop 25 s into the fault: the spike is open by then (one window plus the lateness). Every second of
    # the scenario is two requests, its spans and its metric samples.
    cut = 2 * (int(sc.onset_s) + 25)
    collector = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path)
    collector.start()
    try:
        send(collector.http_endpoint, bodies[:cut])
        _spikes_when(collector, lambda spikes: any(s["state"] == "open" for s in spikes),
                     "a spike to open before the restart")
        before = {(s["service"], s["operation"]): s for s in list_spikes(collector.api)}
        assert collector.terminate() == 0

        collector.start()
        assert "detectors restored from the checkpoint" in collector.log_text()
        # Before any new data: the open spikes and the learned streams are back.
        assert _metric(collector.api, "spikehound_detector_open_spikes") == len([s for s in before.values()
                                                                         if s["state"] == "open"])
        assert _metric(collector.api, "spikehound_detector_streams") >= 3
        send(collector.http_endpoint, bodies[cut:])
        after = _settled(collector.api, lambda name: _metric(collector.api, name))
    finally:
        collector.kill()

    # The same spikes, by id, now resolved: the restored baseline judged the calm windows after the fault.
    # A collector that had re-learned from scratch would have taken the slow windows as normal and never
    # resolved them, or opened new spikes once warm again.
    assert {(s["service"], s["operation"]) for s in after} == set(before)
    for spike in after:
        earlier = before[(spike["service"], spike["operation"])]
        assert spike["id"] == earlier["id"] and spike["start"] == earlier["start"]
        assert spike["state"] == "resolved" and spike["end"] is not None
        assert spike["baseline_p99_ms"] == earlier["baseline_p99_ms"]


@pytest.mark.parametrize("checkpoint", ["with its position", "from before positions"])
def test_a_spike_opened_after_the_last_checkpoint_is_closed_when_the_collector_comes_back(tmp_path: Path,
                                                                                          checkpoint: str):
    """SIGKILL after a spike opened and before the next checkpoint.

    The checkpoint the collector saved as it started says where storage stood: the restarted detectors replay
    what came after it, know the spike again and resolve it when the fault ends. A checkpoint from a version
    before positions cannot say: the restarted detectors do not know the spike, so nothing would ever resolve
    it; it stays open (alerting announces it as any open spike found at start) until event time passes the last
    window that saw it anomalous, and is closed there."""
    sc = _scenario()
    bodies = scenario_requests(sc)
    cut = 2 * (int(sc.onset_s) + 25)
    db = tmp_path / "spikehound.db"
    collector = CollectorProcess(f"sqlite:///{db}", tmp_path, env={"SPIKEHOUND_DETECTION_CHECKPOINT_SECONDS": "3600"})
    collector.start()
    try:
        send(collector.http_endpoint, bodies[:cut])
        _spikes_when(collector, lambda spikes: any(s["state"] == "open" for s in spikes),
                     "a spike to open before the kill")
        collector.kill()
        if checkpoint == "from before positions":
            with sqlite3.connect(db) as conn:
                conn.execute("UPDATE detector_checkpoints SET span_block_id = NULL, points_ingested_at = NULL")

        collector.start()
        if checkpoint == "with its position":
            assert "replayed what was committed after the checkpoint" in collector.log_text()
            assert "not in the detectors' checkpoint" not in collector.log_text()
            open_before = {s["id"] for s in list_spikes(collector.api) if s["state"] == "open"}
            send(collector.http_endpoint, bodies[cut:])
            after = _spikes_when(collector, lambda spikes: not any(s["state"] == "open" for s in spikes),
                                 "the spike to be resolved")
            assert open_before and {s["id"] for s in after} == open_before  # the same spike, once, resolved
            return
        assert "does not say where storage stood" in collector.log_text()
        assert "not in the detectors' checkpoint" in collector.log_text()
        orphans = {s["id"]: s for s in list_spikes(collector.api) if s["state"] == "open"}
        assert orphans, "the orphaned spike was closed before event time passed it"
        send(collector.http_endpoint, bodies[cut:])
        after = _spikes_when(collector, lambda spikes: not any(s["state"] == "open" for s in spikes
                                                               if s["id"] in orphans),
                             "the orphaned spike to be closed")
    finally:
        collector.kill()
    closed = {s["id"]: s for s in after}
    for spike_id, spike in orphans.items():
        assert closed[spike_id]["end"] == max(a["last_anomalous_end"] for a in spike["affected_streams"])
    assert "closed 1 orphaned spike(s) as resolved" in collector.log_text()


def test_the_detector_state_is_checkpointed_under_continuous_ingest(tmp_path: Path):
    """Ingest that never goes idle still checkpoints every ``detection.checkpoint_seconds``.

    Driven on the pipeline itself, so that neither holds by luck of the machine's speed: the whole minute
    is queued before the pipeline runs (the queue is never empty, so no idle tick ever runs), and the
    pipeline's clock moves one second per committed request, not with the wall clock. (Sending over HTTP
    against a wall-clock deadline made "never idle" and "a checkpoint was due" depend on the machine's load.)
    """
    db = f"sqlite:///{tmp_path / 'spikehound.db'}"
    # One request per commit (batch_max_items=1); idle flushes would never happen anyway.
    cfg = collector_config(db, detection__checkpoint_seconds=10, collector__idle_flush_seconds=3600,
                           collector__batch_max_items=1)
    engine = make_engine(db)
    upgrade(engine)
    now = [0.0]
    # Per committed request, in order: (checkpoints saved before it, requests still queued behind it).
    seen: list[tuple[int, int]] = []

    async def ingest() -> CollectorTelemetry:
        queue = IngestQueue(capacity=1 << 30)
        telemetry = CollectorTelemetry()
        writer_thread = WriterThread()
        await writer_thread.start()
        pipeline, _ = single_collector_pipeline(cfg, Writer(engine), queue, writer_thread, telemetry,
                                                StorageHealth(telemetry), clock=lambda: now[0])

        def committed(batch: WriteBatch) -> None:  # on the writer thread, right after each commit
            if not batch.spans and not batch.points:
                return  # detection's own write (windows, spikes), not a request
            saved = telemetry.registry.get_sample_value("spikehound_detector_checkpoint_seconds_count") or 0
            seen.append((int(saved), queue.pending()))
            now[0] += 1.0

        pipeline.commit_hooks.add(committed)
        subs = [queue.offer(b.spans, b.points, encode_spans(b.spans).SerializeToString() if b.spans else b"")
                for b in Scenario("steady", seed=4, minutes=1).batches()]
        await pipeline.start()
        await asyncio.wait_for(asyncio.gather(*(s.committed for s in subs)), 120)
        await asyncio.wait_for(pipeline.stop(), 120)
        await writer_thread.stop()
        return telemetry

    asyncio.run(ingest())
    saved = checkpoints.load(engine, "detection")
    engine.dispose()
    requests_sent = len(seen)
    assert requests_sent >= 60
    # Never idle: every request but the last had more queued behind it when it was committed.
    assert all(queued > 0 for _, queued in seen[:-1])
    # One saved as the pipeline started, then one after every 10 s of its clock, taken between two commits.
    assert [n for n, _ in seen] == [1 + i // 10 for i in range(requests_sent)], \
        "no checkpoint while ingest never went idle"
    assert saved is not None
