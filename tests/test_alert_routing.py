"""Routing as an SRE sees it: which spikes page whom, how often, and what a flapping stream does.

The router is pure bookkeeping with an injected clock, so these tests feed it
the Spike objects the detectors produce and step the clock; delivery over
HTTP is tested in test_alert_delivery.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from spikehound.collector.alerts.routing import GroupState, Router
from spikehound.collector.alerts.silences import Silence
from spikehound.config import AlertsConfig, ReceiverConfig, RouteConfig
from spikehound.model import AffectedStream, CauseKind
from spikehound.model_json import spike_json
from tests.support.alert_spikes import GPU_DROP, MS, NETWORK, SLOW_QUERY, T0, S, ended, spike, spike_id

ROOT = Path(__file__).resolve().parents[1]

class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def config(*routes: RouteConfig) -> AlertsConfig:
    receivers = sorted({r.receiver for r in routes})
    for r in routes:
        r.name = r.name or r.receiver
    return AlertsConfig(receivers=[ReceiverConfig(name=n, url="http://127.0.0.1:9/") for n in receivers],
                        routes=list(routes))


def sent(router: Router) -> list[tuple[str, str, tuple[str, ...]]]:
    """(receiver, status, spike ids) of every notification due now."""
    return [(n.receiver, n.status, tuple(a.spike.id for a in n.alerts)) for n in router.evaluate().notifications]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_flapping_stream_pages_once_and_resolves_once(clock):
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=120)), clock=clock)
    messages = []
    # Ten spikes on the same stream for the same reason, each 40 s long with 50 s calm between: a flap.
    for n in range(10):
        s = spike(n, start_s=90 * n)
        router.observe([s])
        messages += sent(router)
        clock.tick(40)
        router.observe([ended(s, 90 * n + 40)])
        messages += sent(router)
        clock.tick(50)
        messages += sent(router)
    clock.tick(120)
    messages += sent(router)

    assert messages == [("oncall", "firing", (spike_id(0),)), ("oncall", "resolved", (spike_id(9),))]


def test_without_a_resolve_wait_every_flap_is_two_messages(clock):
    # The contrast to the test above: resolve_wait is what keeps a flapping stream quiet.
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    messages = []
    for n in range(3):
        s = spike(n, start_s=90 * n)
        router.observe([s])
        messages += sent(router)
        clock.tick(40)
        router.observe([ended(s, 90 * n + 40)])
        messages += sent(router)
        clock.tick(50)
    assert [m[1] for m in messages] == ["firing", "resolved"] * 3


def test_streams_are_grouped_by_service_and_top_cause(clock):
    router = Router(config(RouteConfig(receiver="oncall", group_interval_seconds=300)), clock=clock)
    router.observe([spike(1)])
    assert sent(router) == [("oncall", "firing", (spike_id(1),))]

    # Another operation of the same service, slowed by the same query: same group, told at the group interval.
    clock.tick(30)
    router.observe([spike(2, operation="GET /v1/models")])
    assert sent(router) == []
    clock.tick(270)
    assert sent(router) == [("oncall", "firing", (spike_id(1), spike_id(2)))]

    # The same service slowed by something else is another group, told at once.
    router.observe([spike(3, operation="POST /v1/embed", causes=(NETWORK,))])
    assert sent(router) == [("oncall", "firing", (spike_id(3),))]


def test_the_group_key_keeps_the_first_top_cause_while_causes_are_re_ranked(clock):
    router = Router(config(RouteConfig(receiver="oncall")), clock=clock)
    s = spike(1)
    router.observe([s])
    (note,) = router.evaluate().notifications
    router.observe([replace(s, causes=(NETWORK, SLOW_QUERY))])  # an update re-ranks the causes
    assert sent(router) == []
    clock.tick(4 * 3600)
    (repeat,) = router.evaluate().notifications
    assert repeat.group_id == note.group_id and repeat.idempotency_key != note.idempotency_key
    assert repeat.alerts[0].spike.causes[0].kind == CauseKind.NETWORK  # the message shows the latest ranking


def test_minimum_severity_and_duration(clock):
    router = Router(config(RouteConfig(receiver="oncall", min_ratio=2.0, min_duration_seconds=60)), clock=clock)
    mild = spike(1, p99_ms=100, baseline_ms=70)  # 1.4x
    router.observe([mild])
    clock.tick(120)
    assert sent(router) == []
    router.observe([replace(mild, p99_ns=200 * MS)])  # it grew to 2.9x, and has lasted long enough
    assert sent(router) == [("oncall", "firing", (spike_id(1),))]

    # 15 s old when detected: announced once it has lasted 60 s, i.e. 45 s later.
    router.observe([spike(2, service="model-server", detected_s=15)])
    clock.tick(44)
    assert sent(router) == []
    clock.tick(1)
    assert sent(router) == [("oncall", "firing", (spike_id(2),))]

    # One that ends sooner is never announced, and counted.
    short = spike(3, service="postprocess")
    router.observe([short])
    clock.tick(20)
    router.observe([ended(short, 35)])
    assert sent(router) == []
    assert router.counts["too_short", ""] == 1


def test_a_spike_found_only_after_it_ended_pages_and_resolves_as_it_would_have_live(clock):
    # After a storage outage or a restart the collector judges the senders' backlog at once: a spike's open
    # and resolved states reach alerting together. Live, a 40-s spike would have paged, then resolved.
    router = Router(config(RouteConfig(receiver="oncall", min_duration_seconds=30, resolve_wait_seconds=5)),
                    clock=clock)
    late, blip = spike(1), spike(2, service="model-server")
    router.observe([late, ended(late, 40), blip, ended(blip, 10)])
    assert sent(router) == [("oncall", "firing", (spike_id(1),))]
    assert sent(router) == []  # its end is applied once the page went out; then resolve_wait
    clock.tick(5)
    assert sent(router) == [("oncall", "resolved", (spike_id(1),))]
    assert router.counts["too_short", ""] == 1  # the 10-s blip, too short for the route in event time too
    assert not router.groups and sent(router) == []


def test_a_silenced_spike_found_only_after_it_ended_sends_nothing_and_is_let_go(clock):
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    router.set_silences([Silence.parse({"matchers": {"service": "gateway"}, "duration_seconds": 3600},
                                       now_ns=int(clock.now * S))])
    late = spike(1)
    router.observe([late, ended(late, 40)])
    assert sent(router) == [] and sent(router) == []
    assert not router.groups and not router.open_spike_ids()


def test_latency_high_while_gpu_utilization_is_low_goes_to_its_own_route(clock):
    gpu = RouteConfig(receiver="gpu-team", cause_kinds=["resource"], cause_resources=["hw.gpu.utilization"],
                      min_cause_score=0.2)
    router = Router(config(gpu, RouteConfig(receiver="oncall")), clock=clock)
    router.observe([spike(1, causes=(SLOW_QUERY, GPU_DROP)), spike(2, service="model-server")])
    assert sorted(sent(router)) == [("gpu-team", "firing", (spike_id(1),)), ("oncall", "firing", (spike_id(2),))]


def test_continue_matching_sends_to_the_next_route_too(clock):
    first = RouteConfig(receiver="gpu-team", cause_kinds=["resource"], continue_matching=True)
    router = Router(config(first, RouteConfig(receiver="oncall")), clock=clock)
    router.observe([spike(1, causes=(GPU_DROP,))])
    assert sorted(sent(router)) == [("gpu-team", "firing", (spike_id(1),)), ("oncall", "firing", (spike_id(1),))]


def test_routes_match_service_and_operation_patterns(clock):
    router = Router(config(RouteConfig(receiver="models", services=["model-*"], operations=["POST *"])), clock=clock)
    router.observe([spike(1, service="model-server", operation="POST /infer"),
                    spike(2, service="model-server", operation="GET /health"),
                    spike(3, service="gateway", operation="POST /v1/predict")])
    assert sent(router) == [("models", "firing", (spike_id(1),))]
    assert router.counts["routed", "models"] == 1


def test_a_firing_group_is_repeated_at_the_repeat_interval(clock):
    router = Router(config(RouteConfig(receiver="oncall", repeat_interval_seconds=3600)), clock=clock)
    router.observe([spike(1)])
    keys = [n.idempotency_key for n in router.evaluate().notifications]
    clock.tick(3599)
    assert sent(router) == []
    clock.tick(1)
    keys += [n.idempotency_key for n in router.evaluate().notifications]
    assert len(keys) == len(set(keys)) == 2


def test_the_rate_limit_holds_notifications_and_sends_the_latest_state_later(clock):
    router = Router(config(RouteConfig(receiver="oncall", max_per_hour=2)), clock=clock)
    router.observe([spike(n, service=f"svc-{n}") for n in range(4)])
    assert [m[2] for m in sent(router)] == [(spike_id(0),), (spike_id(1),)]
    assert sent(router) == []
    assert router.counts["rate_limited", "oncall"] == 2
    clock.tick(3600)
    assert [m[2] for m in sent(router)] == [(spike_id(2),), (spike_id(3),)]


def test_a_silence_suppresses_the_alert_and_its_resolve(clock):
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    silence = Silence.parse({"matchers": {"service": "gateway", "cause_kind": "span"}, "duration_seconds": 3600},
                            now_ns=int(clock.now * S))
    router.set_silences([silence])
    muted, other = spike(1), spike(2, service="model-server")
    router.observe([muted, other])
    assert sent(router) == [("oncall", "firing", (spike_id(2),))]
    router.observe([ended(muted, 60), ended(other, 60)])
    assert sent(router) == [("oncall", "resolved", (spike_id(2),))]
    assert router.counts["silenced", "oncall"] == 1

    # Once the silence has expired, the next spike on the stream pages again.
    clock.tick(3600)
    router.observe([spike(3, start_s=4000)])
    assert sent(router) == [("oncall", "firing", (spike_id(3),))]


def test_a_silence_made_after_the_page_holds_back_the_resolve_until_it_ends(clock):
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    s = spike(1)
    router.observe([s])
    assert len(sent(router)) == 1
    router.set_silences([Silence.parse({"matchers": {"operation": "POST /v1/*"}, "duration_seconds": 600},
                                       now_ns=int(clock.now * S))])
    clock.tick(10)
    assert sent(router) == []  # still firing, silenced: no message, and certainly no "resolved"
    router.observe([ended(s, 100)])
    assert sent(router) == []  # ended while silenced: the group closes quietly
    assert router.groups == {}


def test_reload_keeps_the_state_of_routes_that_remain(clock):
    cfg = config(RouteConfig(receiver="oncall"))
    router = Router(cfg, clock=clock)
    router.observe([spike(1)])
    assert len(sent(router)) == 1
    router.reload(config(RouteConfig(receiver="oncall"), RouteConfig(receiver="gpu-team", cause_kinds=["resource"])))
    assert sent(router) == []  # no second page for the same group
    router.reload(config(RouteConfig(receiver="gpu-team", name="gpu", cause_kinds=["resource"])))
    decision = router.evaluate()
    assert router.groups == {} and decision.removed  # its route is gone: the group is dropped and deleted


def test_saved_state_continues_without_a_second_page(clock):
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    s = spike(1)
    router.observe([s])
    decision = router.evaluate()
    (first,) = decision.notifications
    saved = [(gid, route, state) for gid, (route, state) in decision.saved.items()]

    # A new process: the saved groups, then the stored state of the spikes it held open.
    again = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    again.restore(saved)
    assert again.open_spike_ids() == {spike_id(1)}
    again.observe([s])
    assert sent(again) == []
    again.observe([ended(s, 100)])
    (resolved,) = again.evaluate().notifications
    assert resolved.status == "resolved" and resolved.group_id == first.group_id
    assert resolved.idempotency_key != first.idempotency_key
    assert GroupState.from_json(saved[0][2]).seq == 1


def test_a_saved_group_holds_the_spike_as_the_api_shows_it_and_restores_it_exactly(clock):
    # The saved form predates typed routing: groups saved by an earlier version must restore, and it must read ours.
    moved = AffectedStream(service="model-server", operation="POST /infer", peer_service="gateway",
                           start_unix_nano=T0 + 123_456_789, last_anomalous_end_unix_nano=T0 + 20 * S + 1,
                           p99_ns=180_654_321, baseline_p99_ns=40_000_007, evidence=14.2, slow_requests=31)
    s = replace(spike(1, causes=(GPU_DROP, NETWORK), p99_ms=221.123457), peer_service="edge", affected=(moved,))
    router = Router(config(RouteConfig(receiver="oncall")), clock=clock)
    router.observe([s])
    ((_, state),) = router.evaluate().saved.values()

    (alert,) = orjson.loads(state)["alerts"].values()
    assert alert["spike"] == {**spike_json(s), "start_ns": s.start_unix_nano, "end_ns": None,
                              "detected_ns": s.detected_unix_nano}
    restored = GroupState.from_json(state)
    assert next(iter(restored.alerts.values())).spike == s
    assert restored.to_json() == state


def test_routing_loads_no_web_framework():
    """Routing is pure bookkeeping: importing it, and the notifiers, loads neither aiohttp nor jinja2."""
    code = ("import sys, spikehound.collector.alerts.routing, spikehound.collector.alerts.silences, "
            "spikehound.collector.notifiers.slack, "
            "spikehound.collector.notifiers.webhook\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'jinja2'}))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)

    assert loaded.stdout.strip() == "[]"


def test_a_saved_group_that_no_longer_reads_is_dropped_and_the_rest_restore(clock, caplog):
    """A state written by another version, or damaged, costs that group only: the collector still starts."""
    router = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    router.observe([spike(1)])
    decision = router.evaluate()
    (gid, (route, state)), = decision.saved.items()
    doc = orjson.loads(state)
    next(iter(doc["alerts"].values()))["spike"]["causes"][0]["kind"] = "gpu"  # a kind this version lacks

    again = Router(config(RouteConfig(receiver="oncall", resolve_wait_seconds=0)), clock=clock)
    again.restore([("damaged", route, orjson.dumps(doc).decode()), ("torn", route, state[:40]), (gid, route, state)])

    assert set(again.groups) == {gid} and again.open_spike_ids() == {spike_id(1)}
    assert again.evaluate().removed == {"damaged", "torn"}  # deleted from storage, not read again at each start
    assert caplog.text.count("its saved state does not read") == 2
