"""Scale-out end to end (docs/scale-out.md): real agents routing by trace id to real collector processes that
share a real PostgreSQL, against one collector fed the same data through the same agents.

* Three collectors behind two agents find the spikes one collector finds (every field of them); the leader's
  SIGKILL in the middle of the spike hands detection to another collector within 15 s, and the spike is
  neither lost nor opened twice, its alert sent once, and every span the agents acknowledged is stored.
* A collector added to and removed from the agents' membership during ingest: no trace is split across the
  collectors' shares, and every acknowledged span is stored once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy import select

from harness.api_client import get_json, list_spikes
from harness.daemons import AgentProcess, CollectorProcess, CollectorThread, collector_config
from harness.scenarios.traffic import Scenario
from harness.scrape import sample, scrape
from harness.waiting import eventually
from spikehound.otlp import encode_points, encode_spans, spans_of_block
from spikehound.storage import schema
from spikehound.storage.engine import make_engine
from tests.support.alert_receivers import HookReceiver
from tests.support.spike_fields import spike_fields
from tests.support.trace_sender import TraceSender, whole_traces

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SECRET = "scale-out-signing-secret"
SPEED = 8.0  # scenario seconds per wall-clock second
UNIT_RESTART_SEC = 5.0  # systemd/spikehound-collector.service: RestartSec=5
ENTRY_HOST = "edge-1"  # the agent of the gateway's host
GPU_HOST = "gpu-pool"  # the agent of the services' hosts
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _scenario() -> Scenario:
    # Three and a half minutes of warm-up (21 windows), a one-minute slow feature query, then calm.
    return Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)


def _config(path: Path, hook_url: str) -> Path:
    """The same settings for the cluster's collectors and the single one. The agents forward about once a
    second, SPEED scenario seconds: the lateness allowed covers that; no idle flush while a collector
    restarts."""
    path.write_text(f"""
[collector]
allowed_lateness_seconds = 30
idle_flush_seconds = 10

[detection]
checkpoint_seconds = 1

[cluster]
heartbeat_seconds = 0.5
member_timeout_seconds = 5

[alerts]
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0

[[alerts.receivers]]
name = "pager"
url = "{hook_url}"
signing_secret = "{SECRET}"

[[alerts.routes]]
receiver = "pager"
services = ["gateway"]
resolve_wait_seconds = 0
""")
    return path


class Traffic:
    """The scenario through two agents, as two hosts would send it: the gateway's spans and the edge host's
    samples through one, every other service's spans and the GPU hosts' samples through the other, so every
    trace crosses both agents. Paced at SPEED scenario seconds a wall-clock second."""

    def __init__(self, agents: Sequence[AgentProcess]) -> None:
        self.batches = list(_scenario().batches())
        self.seconds: list[list[tuple[AgentProcess, str, bytes]]] = []
        for batch in self.batches:
            entry = [s for s in batch.spans if s.service == "gateway"]
            rest = [s for s in batch.spans if s.service != "gateway"]
            edge = [p for p in batch.points if p.host == ENTRY_HOST]
            gpus = [p for p in batch.points if p.host != ENTRY_HOST]
            second = []
            for agent, spans, points in ((agents[0], entry, edge), (agents[1], rest, gpus)):
                if spans:
                    second.append((agent, "traces", encode_spans(spans).SerializeToString()))
                if points:
                    second.append((agent, "metrics", encode_points(points).SerializeToString()))
            self.seconds.append(second)
        self.sent = 0  # scenario seconds sent
        self.session = requests.Session()

    def send_until(self, scenario_second: float) -> None:
        started, first = time.monotonic(), self.sent
        while self.sent < min(len(self.seconds), scenario_second):
            for agent, signal, body in self.seconds[self.sent]:
                answer = self.session.post(f"http://127.0.0.1:{agent.http_port}/v1/{signal}", data=body,
                                           headers=PROTOBUF, timeout=30)
                assert answer.status_code == 200, answer.text
            self.sent += 1
            time.sleep(max(0.0, started + (self.sent - first) / SPEED - time.monotonic()))

    def send_rest(self) -> None:
        self.send_until(len(self.seconds))

    def span_ids(self) -> set[tuple[bytes, bytes]]:
        return {(s.trace_id, s.span_id) for batch in self.batches for s in batch.spans}


def _agents(stack: ExitStack, tmp_path: Path, collectors: str) -> list[AgentProcess]:
    agents = []
    for name, host in (("entry", ENTRY_HOST), ("gpus", GPU_HOST)):
        # Its own host samples (dated now, not in the scenario's time) only at start: the scenario carries the
        # hosts' samples, and a collector must see its input go idle once the scenario has been sent.
        agent = AgentProcess(collectors, _dir(tmp_path / name), interval=3600, env={
            "SPIKEHOUND_AGENT_HOST_NAME": host, "SPIKEHOUND_AGENT_PROFILING": "false"})
        stack.callback(agent.kill)
        agents.append(agent.start())
    return agents


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _metric(api: str, name: str) -> float:
    return sample(scrape(api), name) or 0.0


def _leader(collectors: Sequence[CollectorProcess]) -> CollectorProcess | None:
    leading = [c for c in collectors if c.running and _metric(c.api, "spikehound_cluster_leader") == 1]
    assert len(leading) <= 1, "two collectors lead at once"
    return leading[0] if leading else None


def _resolved(api: str, timeout: float = 120) -> list[dict[str, Any]]:
    """The spikes once there are some and none is open (the scenario's fault ends before its last minute)."""
    def check() -> tuple[list[dict[str, Any]]] | None:
        spikes = list_spikes(api)
        return (spikes,) if spikes and all(s["state"] == "resolved" for s in spikes) else None

    (spikes,) = eventually(check, "the spikes to resolve", timeout=timeout, every=0.5)
    return spikes


def _stored_span_ids(db_url: str) -> set[tuple[bytes, bytes]]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            payloads = [bytes(p) for (p,) in conn.execute(select(schema.span_blocks.c.payload))]
    finally:
        engine.dispose()
    return {(s.trace_id, s.span_id) for p in payloads for s in spans_of_block(p)}


def _database(pg_url: str, name: str) -> str:
    base = pg_url.rsplit("/", 1)[0]
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"


@pytest.fixture
def hook() -> Iterator[HookReceiver]:
    with HookReceiver(secret=SECRET.encode()) as receiver:
        yield receiver


def test_three_collectors_find_what_one_finds_and_a_killed_leader_loses_and_repeats_nothing(
        tmp_path: Path, pg_url: str, hook: HookReceiver):
    config = _config(tmp_path / "spikehound.toml", hook.url)
    onset = _scenario().onset_s
    env = {"SPIKEHOUND_CONFIG": str(config)}

    # One collector, fed through the same two agents.
    with ExitStack() as stack:
        one = CollectorProcess(_database(pg_url, "one"), _dir(tmp_path / "one"), env=env)
        stack.callback(one.kill)
        one.start()
        traffic = Traffic(_agents(stack, tmp_path / "one-agents", f"127.0.0.1:{one.grpc_port}"))
        traffic.send_rest()
        reference = _resolved(one.api)
        hook.wait_events(2, timeout=60)  # its firing and resolved notices
    assert [(s["service"], s["causes"][0]["service"]) for s in reference] == [("gateway", "preprocess")]
    hook.requests.clear()
    hook.events.clear()

    # Three collectors sharing one database, behind the same two agents.
    url = _database(pg_url, "cluster")
    with ExitStack() as stack:
        collectors = []
        for i in range(3):
            c = CollectorProcess(url, _dir(tmp_path / f"member-{i}"), env={
                **env, "SPIKEHOUND_CLUSTER_ENABLED": "true", "SPIKEHOUND_CLUSTER_MEMBER": f"member-{i}"})
            stack.callback(c.kill)
            collectors.append(c.start())
        endpoints = ",".join(f"127.0.0.1:{c.grpc_port}" for c in collectors)
        agents = _agents(stack, tmp_path / "cluster-agents", endpoints)
        traffic = Traffic(agents)
        # Into the fault: the spike is open and its page delivered.
        traffic.send_until(onset + 40)
        eventually(lambda: [s for s in list_spikes(collectors[0].api) if s["state"] == "open"], "the spike to open",
                   timeout=60)
        (page,) = hook.wait_events(1, timeout=60)
        eventually(lambda: all(n["state"] == "delivered" for n in
                               get_json(f"{collectors[1].api}/api/v1/alerts/outbox")["notifications"]),
                   "the page to be recorded as delivered", timeout=30)
        before = list_spikes(collectors[2].api)

        old = _leader(collectors)
        assert old is not None
        old.kill()  # SIGKILL: the leader's session, and its lock, end with it
        killed = time.monotonic()
        new = eventually(lambda: _leader(collectors), "another collector to lead", timeout=30, every=0.2)
        failover_s = time.monotonic() - killed
        # Traffic goes on. The killed member's share waits in the agents' spools until it is back (it is not sent
        # elsewhere mid-trace), as the shipped unit's Restart= brings it back, RestartSec=5 after the kill; the
        # new leader holds the windows for it.
        traffic.send_until(onset + 45)
        time.sleep(max(0.0, killed + UNIT_RESTART_SEC - time.monotonic()))  # the unit's own delay, not a guess
        old.start()
        traffic.send_rest()
        spikes = _resolved(new.api)
        hook.wait_events(2, timeout=60)
        stored = _stored_span_ids(url)
        takeovers = sum(_metric(c.api, "spikehound_cluster_leader_takeovers_total") for c in collectors)
        late = _metric(new.api, "spikehound_latency_late_spans_total")

    assert failover_s <= 15, f"another collector led {failover_s:.1f} s after the leader's SIGKILL"
    assert takeovers >= 1
    # Back after the unit's delay, within cluster.member_gone_seconds: none of its share was counted late.
    assert late == 0
    # The spike open at the kill is the one the cluster ends with: same id, not lost, not opened again, and
    # every field as one collector found it.
    assert [s["id"] for s in before] == [s["id"] for s in spikes] == [s["id"] for s in reference]
    assert [spike_fields(s) for s in spikes] == [spike_fields(s) for s in reference]
    # Its page was sent once (and its resolved notice once), whoever led.
    assert page.json["status"] == "firing"
    assert sorted(e.json["status"] for e in hook.events.values()) == ["firing", "resolved"]
    assert len(hook.requests) == 2, [(r.key, r.json["status"]) for r in hook.requests]
    # Every span the agents acknowledged (all of them: each answer was 200) is stored.
    assert stored == traffic.span_ids()


def test_a_collector_added_and_removed_during_ingest_splits_no_trace_and_loses_nothing(tmp_path: Path,
                                                                                        pg_url: str):
    """Three collectors of one cluster on fixed ports; the agent's membership file lists two, then three, then
    two again. Each collector's share is what its feed says it committed."""
    members = tmp_path / "collectors"

    def write(endpoints: Sequence[str]) -> None:  # as config management does: a whole file renamed into place
        tmp = members.with_suffix(".tmp")
        tmp.write_text("".join(f"{e}\n" for e in endpoints))
        tmp.replace(members)

    cfgs = [collector_config(pg_url, cluster__enabled=True, cluster__member=f"member-{i}",
                             detection__checkpoint_seconds=3600)  # the feed is kept: it says who stored what
            for i in range(3)]
    with ExitStack() as stack:
        running = []
        for cfg in cfgs:
            c = CollectorThread(cfg)
            stack.callback(c.stop)
            running.append(c.__enter__())
        endpoints = [c.grpc_endpoint for c in running]
        write(endpoints[:2])
        agent = AgentProcess(f"file://{members}", _dir(tmp_path / "agent"), env={
            "SPIKEHOUND_AGENT_PROFILING": "false", "SPIKEHOUND_AGENT_COLLECTOR_RESOLVE_SECONDS": "0.3"})
        stack.callback(agent.kill)
        agent.start()
        sender = TraceSender(agent.grpc_endpoint).start()
        with ExitStack() as sending:
            sending.callback(sender.stop)
            _traffic_flows(sender)
            write(endpoints)  # a third collector joins
            eventually(lambda: agent.metric("spikehound_agent_collector_members") == 3, "the third to join", 10)
            _traffic_flows(sender)
            write(endpoints[1:])  # the first leaves (it keeps running: what the agent holds for it goes to it)
            eventually(lambda: agent.metric("spikehound_agent_collector_members") == 2, "the first to leave", 10)
            _traffic_flows(sender)
        sent = sender.sent()
        eventually(lambda: set().union(*_shares(running, pg_url).values()) >= sent, "every span stored", 30)
        shares = _shares(running, pg_url)

    assert len(sent) > 100
    where = whole_traces(shares)  # fails on a trace in two shares, or a span stored by two collectors
    assert set().union(*shares.values()) == sent
    assert {where[t] for t, _ in sent} == {"member-0", "member-1", "member-2"}


def _traffic_flows(sender: TraceSender, spans: int = 60) -> None:
    """Wait until the agent has taken ``spans`` more spans under the membership of the moment."""
    before = len(sender.sent())
    eventually(lambda: len(sender.sent()) >= before + spans, f"{spans} more spans through the agent", 20)


def _shares(running: Sequence[CollectorThread], db_url: str) -> dict[str, set[tuple[str, str]]]:
    """Per member: (trace id, span id) of the spans of the blocks its feed rows committed."""
    engine = make_engine(db_url)
    f, b = schema.cluster_feed, schema.span_blocks
    try:
        with engine.connect() as conn:
            owner: dict[int, str] = {}
            for member, block_ids in conn.execute(select(f.c.member, f.c.block_ids)):
                owner.update((int(i), member) for i in _ids(block_ids))
            blocks = conn.execute(select(b.c.id, b.c.payload)).all()
    finally:
        engine.dispose()
    shares: dict[str, set[tuple[str, str]]] = {cfg.cluster.member: set() for cfg in (r.cfg for r in running)}
    for block_id, payload in blocks:
        for rs in ExportTraceServiceRequest.FromString(bytes(payload)).resource_spans:
            for ss in rs.scope_spans:
                shares[owner[block_id]].update((sp.trace_id.hex(), sp.span_id.hex()) for sp in ss.spans)
    return shares


def _ids(text: str) -> list[int]:
    return [int(i) for i in orjson.loads(text)]
