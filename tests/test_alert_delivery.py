"""Alert delivery to real HTTP receivers on loopback, from a real collector and its storage.

Spikes are handed to the collector's alerting as the pipeline hands them over
(test_alert_live.py makes them from real traffic); everything after that is
the real path: routing state and outbox in SQLite or PostgreSQL, HTTP POSTs
to an aiohttp receiver, the REST API and /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import orjson
import pytest
import requests

from harness.api_client import client_of, get_json, request
from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.config import Config
from spikehound.model import Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.writer import Writer
from tests.support.alert_receivers import HookReceiver, signature_ok
from tests.support.alert_spikes import PREPROCESS, SLOW_QUERY, S, ended, spike
from tests.support.profiles import windows as profile_windows

PUBLIC = "https://spikehound.example.com"
SECRET = b"webhook-signing-s3cret"


def config(db_url: str, receivers: list[dict[str, Any]], **settings: Any) -> Config:
    route = {"receiver": receivers[0]["name"], "resolve_wait_seconds": 0, "group_interval_seconds": 0}
    route.update(settings.pop("route", {}))
    return collector_config(db_url, alerts__receivers=receivers, alerts__routes=[route],
                            collector__public_url=PUBLIC, alerts__backoff_initial_seconds=0.2,
                            alerts__backoff_max_seconds=0.5, **settings)


def observe(running: CollectorThread, *spikes: Spike) -> None:
    """What the ingest pipeline does after committing spike states."""
    running.loop.call_soon_threadsafe(running.collector.alerting.observe, list(spikes))


def outbox(running: CollectorThread, state: str | None = None) -> list[dict[str, Any]]:
    params = {"state": state} if state else {}
    return get_json(f"{running.api}/api/v1/alerts/outbox", **params)["notifications"]


@pytest.fixture
def hook() -> Iterator[HookReceiver]:
    with HookReceiver(secret=SECRET) as receiver:
        yield receiver


# --- Slack -------------------------------------------------------------------------------------


def _texts(block: dict[str, Any]) -> list[str]:
    out = []
    if "text" in block:
        out.append(block["text"]["text"])
    out += [f["text"] for f in block.get("fields", [])]
    out += [e["text"] for e in block.get("elements", []) if e.get("type") in ("mrkdwn", "plain_text")]
    return out


def check_block_kit(message: dict[str, Any]) -> None:
    """Slack's published limits for messages sent to incoming webhooks."""
    blocks = message["blocks"]
    assert 1 <= len(blocks) <= 50
    for block in blocks:
        if block["type"] == "header":
            assert len(block["text"]["text"]) <= 150
        if block["type"] == "section":
            assert all(len(t) <= 3000 for t in _texts(block)), [len(t) for t in _texts(block)]
            assert len(block.get("fields", [])) <= 10
        if block["type"] == "context":
            assert len(block["elements"]) <= 10 and all(len(t) <= 3000 for t in _texts(block))
        if block["type"] == "actions":
            assert len(block["elements"]) <= 25
            for button in block["elements"]:
                assert len(button["text"]["text"]) <= 75 and len(button["url"]) <= 3000


def test_slack_message_names_the_cause_links_the_evidence_and_keeps_block_kit_limits(tmp_path):
    with HookReceiver() as slack:
        cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                     [{"name": "oncall", "type": "slack", "url_secret": slack.url + "/services/T0/B0/XXXX"}])
        with CollectorThread(cfg) as running:
            s = spike(1)
            observe(running, s)
            (firing,) = slack.wait_events(1)
            observe(running, ended(s))
            resolved = slack.wait_events(2)[1]

    message = firing.json
    check_block_kit(message)
    text = "\n".join(t for b in message["blocks"] for t in _texts(b))
    assert "gateway" in text and "POST /v1/predict" in text
    assert "219.0 ms" in text and "69.0 ms" in text  # p99 against the baseline
    assert SLOW_QUERY.summary in text and "96%" in text  # the top cause, with its numbers
    assert text.index(SLOW_QUERY.summary) < text.index(PREPROCESS.summary)
    urls = [e["url"] for b in message["blocks"] if b["type"] == "actions" for e in b["elements"]]
    assert urls == [f"{PUBLIC}/ui/spikes/{s.id}", f"{PUBLIC}/ui/traces/e5bf1bc448df2524ea2e57ed82473184"]
    assert "Top cause: " + SLOW_QUERY.summary in message["text"]  # the notification's plain-text fallback

    check_block_kit(resolved.json)
    assert "Resolved" in resolved.json["blocks"][0]["text"]["text"]
    assert firing.key != resolved.key


def test_a_huge_group_with_hostile_names_still_fits_slack(tmp_path):
    hostile = "<!channel> " + "x" * 3000
    long_cause = replace(SLOW_QUERY, summary="Span <@U123> & " + "y" * 6000)
    with HookReceiver() as slack:
        cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                     [{"name": "oncall", "type": "slack", "url_secret": slack.url}])
        with CollectorThread(cfg) as running:
            # 30 streams of one service with one top cause: one group, one message.
            observe(running, *[spike(n, operation=f"{hostile} {n}", causes=(long_cause,)) for n in range(30)])
            (got,) = slack.wait_events(1)
    message = got.json
    check_block_kit(message)
    raw = orjson.dumps(message).decode()
    assert "<!channel>" not in raw and "<@U123>" not in raw  # escaped: nobody is pinged by a span name
    text = "\n".join(t for b in message["blocks"] for t in _texts(b))
    assert "Span &lt;@U123&gt; &amp; yyy" in text  # the top cause is there, clipped
    assert "and 20 more streams" in text


# --- the profile line ----------------------------------------------------------------------------


def _profiled(db_url: str, s: Spike) -> None:
    """The normal profile of preprocess on gpu-1 (the spike's top cause) before ``s``, the hot one since."""
    engine = make_engine(db_url)
    upgrade(engine)
    Writer(engine).write_profiles(profile_windows("preprocess-before.folded", s.start_unix_nano - 600 * S, 60)
                                  + profile_windows("preprocess-spike.folded", s.start_unix_nano, 3))
    engine.dispose()


PROFILE_LINE = "burn_cpu in preprocess: 53% of samples during the spike against 6% before (on gpu-1)"


@pytest.mark.parametrize("kind", ["slack", "webhook"])
def test_a_clear_culprit_in_the_profile_adds_one_line_to_the_alert(tmp_path, kind):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    s = spike(1)
    _profiled(url, s)
    with HookReceiver() as receiver:
        where = "url_secret" if kind == "slack" else "url"
        with CollectorThread(config(url, [{"name": "oncall", "type": kind, where: receiver.url}])) as running:
            observe(running, s)
            (got,) = receiver.wait_events(1)
    if kind == "slack":
        check_block_kit(got.json)
        (causes,) = [t for b in got.json["blocks"] for t in _texts(b) if t.startswith("*Top causes*")]
        assert causes.splitlines()[1:] == [
            f"1. [span] {SLOW_QUERY.summary} _(explains 96% of the added latency)_",
            f"2. [service] {PREPROCESS.summary} _(explains 84% of the added latency)_",
            f"*Profile:* {PROFILE_LINE}"]
    else:
        assert got.json["alerts"][0]["annotations"]["profile"] == PROFILE_LINE


def test_without_a_clear_culprit_or_when_profiles_cannot_be_read_the_alert_goes_out_without_the_line(
        tmp_path, hook, caplog):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    cfg = config(url, [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}])
    with CollectorThread(cfg) as running:
        observe(running, spike(1))  # no profiles at all
        (plain,) = hook.wait_events(1)
        alerting = running.collector.alerting

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the profile read")

        alerting.reader.profile_rows = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="spikehound.collector.alerts"):
            observe(running, spike(2, service="postprocess"), spike(3, service="model-server"))
            hook.wait_events(3)
        assert running.metric("spikehound_alert_profile_errors_total") == 2
    assert "profile" not in plain.json["alerts"][0]["annotations"]
    assert all("profile" not in a["annotations"] for e in hook.events.values() for a in e.json["alerts"])
    said = [r.getMessage() for r in caplog.records if "without their profile line" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: a bug in the profile read" in said[0]


def test_a_profile_read_that_hangs_holds_the_alert_two_seconds_at_most(tmp_path, hook):
    cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}", [{"name": "pager", "type": "webhook", "url": hook.url,
                                                          "signing_secret": SECRET.decode()}])
    with CollectorThread(cfg) as running:
        release = threading.Event()

        def hung(*args: Any, **kwargs: Any) -> Any:
            release.wait(30)
            return []

        running.collector.alerting.reader.profile_rows = hung  # type: ignore[method-assign]
        try:
            began = time.monotonic()
            observe(running, spike(1))
            hook.wait_events(1)
            waited = time.monotonic() - began
            observe(running, spike(2, service="postprocess"))  # while the first read still hangs: none beside it
            hook.wait_events(2)
            assert time.monotonic() - began - waited < 1.5
        finally:
            release.set()
        assert 2.0 <= waited < 5.0
        # Both flushes went without the line; on a busy machine a notification may be rendered once more while
        # the read still hangs, and is counted again.
        assert running.metric("spikehound_alert_profile_errors_total") >= 2
    assert all("profile" not in a["annotations"] for e in hook.events.values() for a in e.json["alerts"])


# --- webhooks ----------------------------------------------------------------------------------

ALERTMANAGER_KEYS = {"version", "groupKey", "status", "receiver", "groupLabels", "commonLabels", "commonAnnotations",
                     "externalURL", "alerts"}
ALERT_KEYS = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}


def test_webhook_keeps_alertmanager_fields_is_signed_and_a_tampered_body_fails(tmp_path, hook):
    cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                 [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}])
    with CollectorThread(cfg) as running:
        s = spike(1)
        observe(running, s)
        (got,) = hook.wait_events(1)
        observe(running, ended(s))
        resolved = hook.wait_events(2)[1]

    body = got.json
    assert set(body) >= ALERTMANAGER_KEYS and body["version"] == "4" and body["status"] == "firing"
    assert body["receiver"] == "pager" and body["externalURL"] == PUBLIC
    assert body["groupLabels"] == {"service": "gateway", "cause": "span preprocess: SELECT features"}
    (alert,) = body["alerts"]
    assert set(alert) >= ALERT_KEYS
    assert alert["labels"]["service"] == "gateway" and alert["labels"]["operation"] == "POST /v1/predict"
    assert alert["startsAt"] == "2026-01-01T00:00:01Z" and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == f"{PUBLIC}/ui/spikes/{s.id}"
    (shown,) = body["spikehound"]["spikes"]
    assert [c["summary"] for c in shown["causes"]] == [SLOW_QUERY.summary, PREPROCESS.summary]
    assert shown["p99_ms"] == 219.0 and shown["baseline_p99_ms"] == 69.0
    assert body["spikehound"]["idempotency_key"] == got.key

    assert resolved.json["status"] == "resolved" and resolved.json["alerts"][0]["endsAt"] == "2026-01-01T00:01:01Z"
    assert resolved.json["alerts"][0]["fingerprint"] == alert["fingerprint"]  # the same alert, now resolved

    # The receiver accepted both (its own HMAC check); change one byte and the same check refuses it.
    assert all(r.status == 200 for r in hook.requests)
    assert hook.signature_ok(got.headers, got.body)
    tampered = got.body.replace(b'"firing"', b'"resolvd"', 1)
    assert not hook.signature_ok(got.headers, tampered)
    answer = requests.post(hook.url, data=tampered, headers={k: v for k, v in got.headers.items()
                                                             if k.lower() not in ("content-length", "host")},
                           timeout=5)
    assert answer.status_code == 401
    assert not signature_ok(b"another secret", got.headers, got.body)


@pytest.mark.slow
def test_a_receiver_that_is_down_then_back_gets_each_event_exactly_once(db_url):
    with HookReceiver(secret=SECRET, work_then_fail=True) as hook:
        hook.down()
        cfg = config(db_url, [{"name": "pager", "type": "webhook", "url": hook.url,
                               "signing_secret": SECRET.decode()}])
        with CollectorThread(cfg) as running:
            s = spike(1)
            observe(running, s)
            first = eventually(lambda: [n for n in outbox(running) if n["attempts"] >= 2], "failed attempts")
            assert "cannot connect" in first[0]["last_error"]
            # Back, but the first two answers are lost after the work was done: the sender must retry.
            hook.answers = [500, 500]
            hook.up()
            eventually(lambda: outbox(running, "delivered"), "delivery")
            observe(running, ended(s))
            eventually(lambda: len(outbox(running, "delivered")) == 2, "the resolve notice")
            rows = outbox(running)
            delivered = running.metric("spikehound_alert_delivery_attempts_total", receiver="pager",
                                       result="delivered")

    assert [r["state"] for r in rows] == ["delivered", "delivered"]
    keys = [r.key for r in hook.requests]
    assert len(hook.events) == 2 and set(keys) == set(hook.events)  # two events, each done once
    firing_key = rows[1]["idempotency_key"]
    retries = [r for r in hook.requests if r.key == firing_key]
    assert len(retries) == 3 and len({r.body for r in retries}) == 1  # the same body every time
    assert [r.status for r in retries] == [500, 500, 200]
    assert hook.events[firing_key].json["status"] == "firing"
    assert delivered == 2


def test_429_retry_after_is_honoured(tmp_path, hook):
    hook.answers, hook.retry_after = [429], "2"
    cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                 [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}])
    with CollectorThread(cfg) as running:
        observe(running, spike(1))
        hook.wait_events(1)
    refused, accepted = hook.requests
    assert (refused.status, accepted.status) == (429, 200)
    assert accepted.at - refused.at >= 1.9  # the backoff alone would have retried within half a second
    assert refused.key == accepted.key and refused.body == accepted.body


@pytest.mark.parametrize("retry_after", ["²", "Thu, 01 Jan 99999 00:00:00 GMT", "soon"])
def test_an_unreadable_retry_after_is_ignored_and_the_outbox_moves_on(tmp_path, hook, retry_after):
    # str.isdigit() says '²' is a digit and float() refuses it: the attempt must still count, back off and
    # end in the dead letters, not be tried again and again uncounted.
    hook.answers, hook.retry_after = [429] * 3, retry_after
    cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                 [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}],
                 alerts__max_attempts=2)
    with CollectorThread(cfg) as running:
        observe(running, spike(1))
        (dead,) = eventually(lambda: outbox(running, "dead"), "a dead letter", 60)
        assert dead["attempts"] == 2 and dead["last_error"].startswith("HTTP 429")
        assert running.metric("spikehound_alert_delivery_attempts_total", receiver="pager", result="retry") == 1
        observe(running, spike(2, service="model-server"))  # the receiver's queue is not jammed behind it
        hook.wait_events(1)
    assert [r.status for r in hook.requests] == [429, 429, 429, 200]


@pytest.mark.slow
def test_dead_letters_are_visible_through_the_api_and_can_be_sent_again(db_url, hook):
    hook.answers = [503] * 3 + [404]
    cfg = config(db_url, [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}],
                 alerts__max_attempts=3,
                 route={"services": ["gateway"]})
    extra = {"name": "other", "type": "webhook", "url": hook.url + "/other", "signing_secret": SECRET.decode()}
    cfg.alerts.receivers.append(replace(cfg.alerts.receivers[0], **extra))
    cfg.alerts.routes.append(replace(cfg.alerts.routes[0], receiver="other", name="other", services=["model-*"]))
    with CollectorThread(cfg) as running:
        observe(running, spike(1))
        (dead,) = eventually(lambda: outbox(running, "dead"), "a dead letter")
        assert dead["attempts"] == 3 and dead["last_error"].startswith("HTTP 503")
        assert running.metric("spikehound_alert_delivery_attempts_total", receiver="pager", result="dead") == 1

        # A refusal that retrying cannot fix is dead at once.
        observe(running, spike(2, service="model-server"))
        refused = eventually(lambda: [n for n in outbox(running, "dead") if n["receiver"] == "other"],
                             "the refused one")
        assert refused[0]["attempts"] == 1 and "HTTP 404" in refused[0]["last_error"]

        api = client_of(running.api)
        one = api.get_json(f"/api/v1/alerts/outbox/{dead['id']}")
        assert one["body"]["status"] == "firing" and one["body"]["alerts"][0]["labels"]["service"] == "gateway"

        # Fixed: send it again by hand.
        r = api.post(f"/api/v1/alerts/outbox/{dead['id']}/retry")
        # The answer is the row as it stands: queued again, or already delivered when delivery was that quick.
        assert r.status_code == 200 and r.json()["state"] in ("pending", "delivered")
        eventually(lambda: any(n["id"] == dead["id"] for n in outbox(running, "delivered")), "redelivery")
        again = api.post(f"/api/v1/alerts/outbox/{dead['id']}/retry")
        assert again.status_code == 409 and "delivered" in again.json()["error"]
        assert api.post("/api/v1/alerts/outbox/999999/retry").status_code == 404


def test_the_slack_url_is_never_logged_nor_shown(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with HookReceiver() as slack:
        slack.down()
        cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                     [{"name": "oncall", "type": "slack", "url_secret": slack.url + "/services/T0/B0/TOPSECRET"}],
                     alerts__max_attempts=2)
        with CollectorThread(cfg) as running:
            observe(running, spike(1))
            (dead,) = eventually(lambda: outbox(running, "dead"), "a dead letter")
            api_text = request("GET", f"{running.api}/api/v1/alerts/outbox/{dead['id']}").text
    from spikehound.config import effective, to_toml

    assert "TOPSECRET" not in caplog.text and "TOPSECRET" not in api_text
    assert "TOPSECRET" not in to_toml(effective(cfg))
    assert "cannot connect" in dead["last_error"] and "oncall" in caplog.text


# --- silences through the API ------------------------------------------------------------------


@pytest.mark.parametrize(("body", "needle"), [
    ("not json", "not JSON"),
    ({"matchers": {}, "duration_seconds": 60}, "at least one"),
    ({"matchers": {"host": "x"}, "duration_seconds": 60}, "unknown host"),
    ({"matchers": {"service": "gateway"}}, "must expire"),
    ({"matchers": {"service": "gateway"}, "ends_at": "2001-01-01T00:00:00Z"}, "in the future"),
    ({"matchers": {"cause_kind": "gpu"}, "duration_seconds": 60}, "not one of span"),
    ({"matchers": {"service": "gateway"}, "duration_seconds": -5}, "duration_seconds"),
])
def test_a_bad_silence_is_refused_with_the_reason(sqlite_collector, body, needle):
    data = body if isinstance(body, str) else orjson.dumps(body)
    r = request("POST", f"{sqlite_collector.api}/api/v1/silences", data=data,
                headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]


def test_silences_are_created_listed_and_ended(db_url):
    with CollectorThread(collector_config(db_url)) as running:
        api, silences = client_of(running.api), "/api/v1/silences"
        made = api.post(silences, json={"matchers": {"service": "gateway", "cause_kind": "resource"},
                                         "duration_seconds": 3600, "comment": "GPU swap", "created_by": "ana"})
        assert made.status_code == 201
        silence = made.json()
        assert silence["state"] == "active" and silence["matchers"] == {"service": "gateway", "cause_kind": "resource"}
        assert [s["id"] for s in api.get_json(silences)["silences"]] == [silence["id"]]

        gone = api.delete(f"{silences}/{silence['id']}")
        assert gone.status_code == 200 and gone.json()["state"] == "expired"
        assert api.get_json(silences)["silences"] == []
        assert [s["state"] for s in api.get_json(silences, state="all")["silences"]] == ["expired"]
        assert api.delete(f"{silences}/nope").status_code == 404
        assert api.get_json(f"{silences}/{silence['id']}")["comment"] == "GPU swap"


def test_a_flapping_spike_does_not_make_a_storm(tmp_path, hook):
    # Alerting's clock is the test's: the resolve wait runs out when the test says, not when a stall of a
    # loaded machine happens to last longer than it between two of the flaps.
    now = [time.time()]
    cfg = config(f"sqlite:///{tmp_path / 'db.sqlite'}",
                 [{"name": "pager", "type": "webhook", "url": hook.url, "signing_secret": SECRET.decode()}],
                 route={"resolve_wait_seconds": 3})
    with CollectorThread(cfg, clock=lambda: now[0]) as running:
        # Six spikes on one stream for one reason, each ending and the next opening a moment later (the
        # detector gives each a new id, as it does when a stream flaps around its threshold).
        def observed(*spikes: Spike) -> None:  # handed over and taken in at the clock's present time
            observe(running, *spikes)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), running.loop).result(10)  # runs after it

        for n in range(6):
            s = spike(n)
            observed(s)
            now[0] += 0.2
            observed(ended(s))
            now[0] += 0.2
        firing = hook.wait_events(1)
        now[0] += 3  # the resolve wait passes after the last flap
        hook.wait_events(2)
        # Both delivered is what ends the sending: nothing is pending, and with the clock held no timer is due.
        rows = eventually(lambda: (r := outbox(running)) and all(
            n["state"] == "delivered" for n in r) and r, "both delivered")
    assert firing[0].json["status"] == "firing"
    assert [e.json["status"] for e in hook.events.values()] == ["firing", "resolved"]
    assert len(hook.requests) == 2 and len(rows) == 2
