"""Alerts from real spikes: scenario traffic over OTLP/HTTP into a real collector, webhooks to a real receiver.

Also what a crash leaves behind: a collector SIGKILLed while its alert waits
in the outbox sends it after the restart, and one killed after committing a
spike but before routing it routes it at the next start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.api_client import client_of, get_json, list_spikes
from harness.daemons import CollectorProcess, CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from harness.scrape import sample, scrape
from harness.waiting import eventually
from spikehound.model import Cause, CauseKind, Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.alert_receivers import HookReceiver, Received

pytestmark = pytest.mark.slow

SECRET = "live-signing-s3cret"
S = 1_000_000_000


def _scenario() -> Scenario:
    # As in test_detection_live.py: 3.5 minutes of warm-up, a one-minute slow feature query, then calm.
    return Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)


def _outbox(api: str, state: str | None = None) -> list[dict[str, Any]]:
    return get_json(f"{api}/api/v1/alerts/outbox", **({"state": state} if state else {}))["notifications"]


def _metric(api: str, name: str) -> float:
    """The unlabelled sample ``name``; 0 while the collector does not show it yet."""
    return sample(scrape(api), name) or 0.0


@contextmanager
def _paged_under_silence(tmp_path: Path, hook: HookReceiver, matchers: dict[str, str]) -> Iterator[CollectorThread]:
    """A collector paging ``hook`` for every spike, with a silence of ``matchers``; the scenario sent to it."""
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", alerts__receivers=[
        {"name": "pager", "url": hook.url, "signing_secret": SECRET}],
        alerts__routes=[{"receiver": "pager", "resolve_wait_seconds": 0}])
    with CollectorThread(cfg) as running:
        made = client_of(running.api).request("POST", "/api/v1/silences", json={
            "matchers": matchers, "duration_seconds": 3600, "comment": "known"})
        assert made.status_code == 201
        send(running.http_endpoint, scenario_requests(_scenario()))
        yield running


def _all_sent(running: CollectorThread, hook: HookReceiver) -> Received:
    """Wait until nothing more can come of the traffic sent, instead of pausing "long enough" for it.

    First every window is judged and written (the spikes it made were handed to alerting); then a canary
    spike, handed to alerting after them, pages. Routing decides in order and each receiver's outbox is sent
    oldest first, so once the canary's page is in, every notification decided before it has been sent.
    Returns the canary's page.
    """
    eventually(running.detection_settled, "the collector to judge every window", timeout=60)
    canary = Spike(id="ca0a4ca0a4ca0a40", service="canary", operation="GET /canary", state="open",
                   start_unix_nano=1_767_225_600 * S, end_unix_nano=None, p99_ns=200_000_000,
                   baseline_p99_ns=50_000_000, causes=())
    assert running.collector.alerting is not None
    running.loop.call_soon_threadsafe(running.collector.alerting.observe, [canary])
    return eventually(lambda: next((e for e in hook.events.values()
                                    if e.json["commonLabels"]["service"] == "canary"), None),
                      "the canary's page", timeout=60)


def test_a_silence_on_a_service_the_spike_only_moved_lets_it_page_then_resolve(tmp_path: Path):
    """The spike is led by the gateway; preprocess is one of the streams it moved, and the place of its
    cause. A silence on service preprocess is about spikes preprocess leads: this one pages."""
    with HookReceiver(secret=SECRET.encode()) as hook, _paged_under_silence(tmp_path, hook,
                                                                            {"service": "preprocess"}) as running:
        events = hook.wait_events(2, timeout=60)
        canary = _all_sent(running, hook)
        spikes = list_spikes(running.api)

    # One fault, one spike, one alert: its firing message and its resolve notice (then the canary's page).
    (spike,) = spikes
    assert [r.key for r in hook.requests] == [*(e.key for e in events), canary.key]
    firing, resolved = (e.json for e in events)
    assert (firing["status"], resolved["status"]) == ("firing", "resolved")
    assert firing["commonLabels"]["service"] == "gateway"
    top = firing["spikehound"]["spikes"][0]["causes"][0]
    assert (top["kind"], top["service"], top["operation"]) == ("span", "preprocess", "SELECT features")
    # The message lists the other streams the spike moved, the service that ran the slow query among them.
    annotations = firing["alerts"][0]["annotations"]
    assert annotations["spike_id"] == spike["id"] and "preprocess /preprocess" in annotations["affected_streams"]
    assert resolved["alerts"][0]["endsAt"] == spike["end"].replace(".000000000", "")


def test_a_silence_on_the_service_of_its_cause_suppresses_it(tmp_path: Path):
    with HookReceiver(secret=SECRET.encode()) as hook, _paged_under_silence(tmp_path, hook,
                                                                            {"cause_service": "preprocess"}) as running:
        spikes = eventually(lambda: [s for s in list_spikes(running.api) if s["state"] == "resolved"],
                            "the spike to resolve")
        silenced = eventually(lambda: running.metric(
            "spikehound_alert_spikes_total", outcome="silenced", route="pager"), "the silence to be counted")
        canary = _all_sent(running, hook)  # a page, had there been one, was sent before it

    # The spike is led by the gateway, but its slow query ran in preprocess: the silence covers it.
    assert [s["service"] for s in spikes] == ["gateway"]
    assert silenced >= 1 and [r.key for r in hook.requests] == [canary.key]


def test_a_collector_killed_before_delivery_delivers_after_its_restart(tmp_path: Path):
    sc = _scenario()
    bodies = scenario_requests(sc)
    cut = 2 * (int(sc.onset_s) + 25)  # the spike is open 25 s into the fault (two requests per second)
    config = tmp_path / "spikehound.toml"
    with HookReceiver(secret=SECRET.encode()) as hook:
        hook.down()  # the receiver is away: the alert waits in the outbox
        # Checkpoints every second: the detectors' state survives the kill, so the spike also ends after it.
        config.write_text(f"""
[detection]
checkpoint_seconds = 1

[alerts]
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0

[[alerts.receivers]]
name = "pager"
url = "{hook.url}"
signing_secret = "{SECRET}"

[[alerts.routes]]
receiver = "pager"
services = ["gateway"]
resolve_wait_seconds = 5
""")
        collector = CollectorProcess(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path,
                                     env={"SPIKEHOUND_CONFIG": str(config)})
        collector.start()
        try:
            send(collector.http_endpoint, bodies[:cut])
            (waiting,) = eventually(lambda: [n for n in _outbox(collector.api) if n["attempts"] >= 1],
                                    "a failed delivery")
            assert waiting["state"] == "pending" and waiting["status"] == "firing"
            # A checkpoint taken after the spike opened (one from before it would not know the spike).
            checkpoints = "spikehound_detector_checkpoint_seconds_count"
            seen = _metric(collector.api, checkpoints)
            eventually(lambda: _metric(collector.api, checkpoints) > seen, "a detector checkpoint")
            collector.kill()  # SIGKILL: no chance to do anything more

            hook.up()
            collector.start()
            (event,) = hook.wait_events(1, timeout=60)
            send(collector.http_endpoint, bodies[cut:])
            eventually(lambda: len(hook.events) == 2, "the resolve notice", 120)
            # Recorded as delivered (after the receiver's answer): nothing is left to retry.
            rows = eventually(lambda: (r := _outbox(collector.api)) and all(
                n["state"] == "delivered" for n in r) and r, "both recorded as delivered")
        finally:
            collector.kill()

    assert event.key == waiting["idempotency_key"]  # the very notification queued before the kill
    assert event.json["status"] == "firing" and event.json["commonLabels"]["service"] == "gateway"
    assert [r.status for r in hook.requests] == [200, 200]  # each sent once after the restart
    assert [e.json["status"] for e in hook.events.values()] == ["firing", "resolved"]
    assert {r["state"] for r in rows} == {"delivered"}


SLOW_QUERY = Cause(kind=CauseKind.SPAN, score=0.9, service="preprocess", operation="SELECT features",
                   summary="Span SELECT features of preprocess took 79.6 ms of the critical path per slow request "
                           "against 9.8 ms normally.")


def test_spikes_committed_but_not_yet_routed_are_routed_at_the_next_start(db_url):
    """A kill between the spike's commit and the routing commit: the spikes table has it, the outbox not."""
    spike = Spike(id="c0ffee0000000001", service="gateway", operation="POST /v1/predict", state="open",
                  start_unix_nano=1_767_225_600 * S, end_unix_nano=None, p99_ns=219_000_000,
                  baseline_p99_ns=69_000_000, causes=(SLOW_QUERY,), detected_unix_nano=1_767_225_615 * S)
    engine = make_engine(db_url)
    upgrade(engine)
    Writer(engine).write(WriteBatch(spikes=[spike]))
    with HookReceiver(secret=SECRET.encode()) as hook:
        cfg = collector_config(db_url, alerts__receivers=[{"name": "pager", "url": hook.url, "signing_secret": SECRET}],
                               alerts__routes=[{"receiver": "pager", "resolve_wait_seconds": 0}])
        with CollectorThread(cfg):
            (firing,) = hook.wait_events(1)
        # It ends while the collector is down (as the detectors would have written it just before a kill).
        Writer(engine).write(WriteBatch(spikes=[replace(spike, state="resolved",
                                                        end_unix_nano=spike.start_unix_nano + 90 * S)]))
        with CollectorThread(cfg) as running:
            resolved = hook.wait_events(2)[1]
            # Restore routes what it finds once, at start; with both recorded as delivered nothing is left to send.
            eventually(lambda: (r := _outbox(running.api)) and all(n["state"] == "delivered" for n in r),
                       "both recorded as delivered")
    engine.dispose()
    assert firing.json["alerts"][0]["annotations"]["spike_id"] == spike.id
    assert resolved.json["status"] == "resolved" and resolved.json["alerts"][0]["endsAt"] == "2026-01-01T00:01:30Z"
    assert len(hook.requests) == 2
