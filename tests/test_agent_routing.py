"""The agent routing whole traces to one of several collectors (``agent/rendezvous.py``, ``agent/dispatcher.py``,
``agent/membership.py``, ``agent/reroute.py`` in ``spikehound/``).

Unit: rendezvous hashing moves only the changed member's traces and agrees across processes; a real OTLP
request is split by owner with every trace whole; the dispatcher keeps traces on their member across a
membership change and reroutes what a departed, silent member holds. Live: a real agent between the
OpenTelemetry SDK and two or three real collectors on SQLite, each database checked for whole traces.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.daemons import AgentProcess, CollectorThread, collector_config
from harness.ports import free_port
from harness.waiting import eventually
from spikehound.agent.dispatcher import Dispatcher, RouteTimes
from spikehound.agent.member_forwarding import MEMBERS_DIR, QueueSettings, safe_name
from spikehound.agent.membership_lookup import MembershipError, resolve
from spikehound.agent.rendezvous import Rendezvous, StickyMap
from spikehound.agent.request_split import partition_request
from spikehound.agent.spool import DiskSpool, Item, Signal
from spikehound.config import ConfigError, load
from spikehound.endpoints import parse_collectors
from spikehound.model import Span, SpanKind, StatusCode
from spikehound.otlp import encode_spans
from tests.support.served import stored_spans
from tests.support.trace_sender import TraceSender, whole_traces

ROOT = Path(__file__).resolve().parents[1]
HOST = "gpu-node-7"


# --- rendezvous ------------------------------------------------------------------------------------


def test_adding_a_member_moves_a_quarter_of_the_traces_all_to_it_and_removing_one_moves_only_its_own():
    ids = [os.urandom(16) for _ in range(20_000)]
    three = Rendezvous(["a:4317", "b:4317", "c:4317"])
    four = Rendezvous(["a:4317", "b:4317", "c:4317", "d:4317"])
    before = {t: three.owner(t) for t in ids}
    after = {t: four.owner(t) for t in ids}
    moved = [t for t in ids if before[t] != after[t]]
    assert 0.20 * len(ids) < len(moved) < 0.30 * len(ids)
    assert {after[t] for t in moved} == {"d:4317"}
    assert all(after[t] == "d:4317" for t in moved) and all(before[t] == after[t] for t in ids if t not in moved)

    without_b = Rendezvous(["a:4317", "c:4317", "d:4317"])
    changed = {t for t in ids if without_b.owner(t) != after[t]}
    assert changed == {t for t in ids if after[t] == "b:4317"}  # exactly b's traces, spread over the rest
    assert Counter(without_b.owner(t) for t in changed).keys() == {"a:4317", "c:4317", "d:4317"}


def test_every_process_agrees_on_the_owners():
    ids = [i.to_bytes(16, "big") for i in range(0, 2000, 7)]
    ring = Rendezvous(["10.0.0.1:4317", "10.0.0.2:4317", "https://c.example:4317"])
    here = "".join(ring.owner(t)[-6] for t in ids)  # one character that differs between the three
    script = ("from spikehound.agent.rendezvous import Rendezvous\n"
              "ring = Rendezvous(['https://c.example:4317', '10.0.0.2:4317', '10.0.0.1:4317'])\n"
              "print(''.join(ring.owner(i.to_bytes(16, 'big'))[-6] for i in range(0, 2000, 7)))\n")
    for seed in ("1", "4242"):  # Python's own hash is salted per process: it must play no part
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}).stdout.strip()
        assert out == here
    assert len(set(here)) == 3


# --- splitting a request by owner -----------------------------------------------------------------


def _spans(traces: int) -> list[Span]:
    """``traces`` traces of four spans, each trace's spans spread over three services on two hosts."""
    now = time.time_ns()
    out = []
    for t in range(traces):
        trace_id = os.urandom(16)
        for s, (service, host) in enumerate([("api", "h1"), ("llm", "h2"), ("llm", "h2"), ("db", "h1")]):
            out.append(Span(trace_id=trace_id, span_id=os.urandom(8), parent_span_id=None, service=service,
                            host=host, name=f"op-{s}", kind=SpanKind.SERVER, start_unix_nano=now - 1000 * t,
                            end_unix_nano=now, status=StatusCode.OK, attributes={"i": t},
                            resource={"service.version": f"{service}-1"}))
    return out


def test_a_request_splits_into_one_piece_per_owner_with_every_trace_whole_and_its_resources_kept():
    spans = _spans(60)
    payload = encode_spans(spans).SerializeToString()
    ring = Rendezvous(["a:4317", "b:4317", "c:4317"])
    asked: Counter[bytes] = Counter()

    def owner(trace_id: bytes) -> str:
        asked[trace_id] += 1
        return ring.owner(trace_id)

    pieces = partition_request(payload, owner)
    assert set(pieces) == {"a:4317", "b:4317", "c:4317"}
    assert set(asked.values()) == {1}  # each distinct trace id hashed once, not each span
    seen: Counter[tuple[bytes, bytes]] = Counter()
    for member, (piece, count) in pieces.items():
        request = ExportTraceServiceRequest.FromString(piece)
        in_piece = 0
        for rs in request.resource_spans:
            attributes = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
            assert attributes["service.version"] == f"{attributes['service.name']}-1"
            assert attributes["host.name"] in ("h1", "h2")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    assert ring.owner(sp.trace_id) == member
                    seen[sp.trace_id, sp.span_id] += 1
                    in_piece += 1
        assert in_piece == count
    assert seen == Counter({(s.trace_id, s.span_id): 1 for s in spans})

    one_owner = partition_request(payload, lambda _trace_id: "only")
    assert one_owner == {"only": (payload, len(spans))}  # kept as encoded, not rebuilt


# --- the dispatcher, in process ------------------------------------------------------------------------


def _trace_item(trace_ids: list[bytes]) -> Item:
    spans = [s for t in trace_ids for s in _spans(1)]
    for s, trace_id in zip(spans, [t for t in trace_ids for _ in range(4)], strict=True):
        s.trace_id = trace_id
    return Item(Signal.TRACES, encode_spans(spans).SerializeToString(), len(spans))


def _queued_traces(dispatcher: Dispatcher) -> dict[str, set[bytes]]:
    """member -> trace ids in its queue."""
    out: dict[str, set[bytes]] = {}
    for key, member in dispatcher.members.items():
        ids = out.setdefault(key, set())
        for batch in member.queue.peek_batches(1 << 30):
            for item in batch:
                for rs in ExportTraceServiceRequest.FromString(item.payload).resource_spans:
                    ids.update(sp.trace_id for ss in rs.scope_spans for sp in ss.spans)
    return out


def test_after_a_membership_change_known_traces_keep_their_member_and_a_silent_departed_one_is_rerouted(tmp_path):
    ports = [free_port() for _ in range(3)]  # nothing listens: forwarding fails, queues keep what they got
    a, b, c = (f"127.0.0.1:{p}" for p in ports)
    members = tmp_path / "collectors"
    members.write_text(f"# the cluster\n{a}\n{b}\n")
    now = [1000.0]

    async def scenario() -> None:
        queues = QueueSettings(tmp_path / "spool", 1 << 20, 1 << 24)
        dispatcher = Dispatcher(parse_collectors(f"file://{members}"), HOST, queues,
                            times=RouteTimes(sticky_seconds=60, reroute_after=300), clock=lambda: now[0])
        await dispatcher.start()
        assert [m.key for m in dispatcher.active] == [a, b]
        first = [os.urandom(16) for _ in range(40)]
        assert dispatcher.put_all([_trace_item(first)])
        owner_before = {t: Rendezvous([a, b]).owner(t) for t in first}
        assert _queued_traces(dispatcher) == {k: {t for t in first if owner_before[t] == k} for k in (a, b)}

        members.write_text(f"{b}\n{c}\n")  # a leaves, c joins
        await dispatcher.refresh()
        assert [m.key for m in dispatcher.active] == [b, c] and dispatcher.membership_changes == 1
        later = [os.urandom(16) for _ in range(40)]
        assert dispatcher.put_all([_trace_item(first + later)])  # more spans of the first traces, and new ones
        queued = _queued_traces(dispatcher)
        new_owner = Rendezvous([b, c])
        for t in first:  # seen before the change: still with the member they had, the departed a too
            assert t in queued[owner_before[t]] and sum(t in ids for ids in queued.values()) == 1
        for t in later:
            assert t in queued[new_owner.owner(t)] and sum(t in ids for ids in queued.values()) == 1
        held = len(dispatcher.members[a].queue)
        assert held and dispatcher.members[a].state == "departing"

        # a never answers: once it has been silent for REROUTE_AFTER since it left, its queue moves.
        await dispatcher.members[a].forwarder.flush(timeout=0.5)
        assert dispatcher.members[a].forwarder.stalled_seconds == 0  # its first failure: the silence starts now
        now[0] += 301
        await dispatcher.tend()
        assert a not in dispatcher.members and dispatcher.rerouter.rerouted_requests == held
        queued = _queued_traces(dispatcher)
        assert set(queued) == {b, c}
        for t in first + later:
            assert sum(t in ids for ids in queued.values()) == 1
        assert not (tmp_path / "spool" / MEMBERS_DIR / safe_name(a)).exists()
        # the departed forwarder's counts stay in the totals
        assert dispatcher.totals.stats().failures["unavailable"] >= 1
        await dispatcher.close_forwarders()
        dispatcher.close()

    asyncio.run(scenario())


def test_a_request_is_queued_all_or_none_and_pushed_back_when_one_owner_has_no_room(tmp_path):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ring = Rendezvous([a, b])
    to_a = [t for t in (os.urandom(16) for _ in range(200)) if ring.owner(t) == a]
    to_b = [t for t in (os.urandom(16) for _ in range(200)) if ring.owner(t) == b]

    async def scenario() -> None:
        dispatcher = Dispatcher(parse_collectors(f"{a},{b}"), HOST, QueueSettings(tmp_path / "spool", 16_000, 8_000))
        await dispatcher.start()
        queue_a, queue_b = dispatcher.members[a].queue, dispatcher.members[b].queue
        while dispatcher.put_all([_trace_item([to_a.pop()])]):  # fill a: its memory share, then the shared spool
            pass
        assert queue_a.memory_items and len(queue_a.spool)
        assert dispatcher.refused == {a: 1} and len(queue_b) == 0
        assert not dispatcher.put_all([_trace_item([to_a.pop(), to_b.pop()])])  # b has room, a has none: neither
        assert len(queue_b) == 0 and dispatcher.refused == {a: 2}
        assert dispatcher.put_all([_trace_item([to_b.pop()])])  # b alone still flows
        assert len(queue_b) == 1
        await dispatcher.close_forwarders()
        dispatcher.close()

    asyncio.run(scenario())


def test_a_bad_or_empty_membership_file_keeps_the_last_good_one(tmp_path, caplog):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    members = tmp_path / "collectors"
    members.write_text(f"{a}\n{b}\n")

    async def scenario() -> None:
        queues = QueueSettings(tmp_path / "spool", 1 << 20, 1 << 24)
        dispatcher = Dispatcher(parse_collectors(f"file://{members}"), HOST, queues)
        await dispatcher.start()
        for text in ("a-host-without-a-port\n", "# nothing\n", None, "nowhere:99999\n"):
            if text is None:
                members.unlink()
            else:
                members.write_text(text)
            await dispatcher.refresh()
            assert [m.key for m in dispatcher.active] == [a, b]
        assert dispatcher.membership.resolve_failures == 4 and dispatcher.membership_changes == 0
        members.write_text(f"{a}\n")
        await dispatcher.refresh()
        assert [m.key for m in dispatcher.active] == [a] and dispatcher.membership_changes == 1
        await dispatcher.close_forwarders()
        dispatcher.close()

    with caplog.at_level("WARNING", logger="spikehound.agent.membership"):
        asyncio.run(scenario())
    assert len([r for r in caplog.records if "keeping the last good one" in r.getMessage()]) == 1  # one episode


def test_spools_keep_their_place_across_a_change_between_one_endpoint_and_many(tmp_path):
    a, b, c = (f"127.0.0.1:{free_port()}" for _ in range(3))
    spool_dir = tmp_path / "spool"
    old = DiskSpool(spool_dir, 1 << 24)  # what an agent from before routing left: the spool directory itself
    old.extend([_trace_item([os.urandom(16)]) for _ in range(5)])
    old.close()

    async def start(collector: str) -> Dispatcher:
        dispatcher = Dispatcher(parse_collectors(collector), HOST, QueueSettings(spool_dir, 1 << 20, 1 << 24),
                            times=RouteTimes(sticky_seconds=0))
        await dispatcher.start()
        return dispatcher

    async def stop(dispatcher: Dispatcher) -> None:
        dispatcher.spill_memory()
        await dispatcher.close_forwarders()
        dispatcher.close()

    async def scenario() -> None:
        one = await start(a)  # one endpoint: the old spool is its spool, replayed first
        assert [(m.key, m.directory, len(m.queue)) for m in one.members.values()] == [(a, spool_dir, 5)]
        await stop(one)

        many = await start(f"{b},{c}")  # now a list: what a single-endpoint agent spooled is no member's
        assert (spool_dir / "endpoint").read_text() == f"{a}\n"
        assert {k: m.state for k, m in many.members.items()} == {b: "active", c: "active", a: "departing"}
        assert many.put_all([_trace_item([os.urandom(16) for _ in range(10)])])
        assert {m.directory for m in many.active} == {spool_dir / MEMBERS_DIR / safe_name(k) for k in (b, c)}
        await stop(many)

        # One endpoint again: the spool directory is b's, as it always was (a's five records in it go to b);
        # c's spool goes to c while it answers, b's spool of the list is moved into b's queue.
        back = await start(b)
        states = {k: (m.state, m.forwarder is not None) for k, m in back.members.items()}
        leftover = [k for k in states if k.endswith("(left over)")]
        assert states == {b: ("active", True), c: ("departing", True), leftover[0]: ("rerouting", False)}
        assert back.members[b].directory == spool_dir and len(back.members[b].queue) == 5
        held = len(back.members[leftover[0]].queue)
        await back.tend()
        assert leftover[0] not in back.members and back.rerouter.rerouted_requests == held
        assert len(back.members[b].queue) == 5 + held
        await stop(back)

    asyncio.run(scenario())


def test_a_dns_name_resolves_to_every_address_and_a_bad_one_is_an_error():
    found = resolve(parse_collectors("dns:///localhost:4317"))
    assert "127.0.0.1:4317" in [e.key for e in found]
    with pytest.raises(MembershipError):
        resolve(parse_collectors("dns:///no-such-host.invalid:4317"))


def test_a_dual_stack_name_gives_one_member_per_collector(monkeypatch: pytest.MonkeyPatch):
    """A name with A and AAAA records (a dual-stack headless service): the IPv4 addresses only, as a collector
    listens on 0.0.0.0 by default. (The answer is faked: this machine has no such name.)"""
    answers = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 4317, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 4317))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
    assert [e.key for e in resolve(parse_collectors("dns:///collectors.internal:4317"))] == ["10.0.0.7:4317"]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers[:1])  # IPv6 only: those
    assert [e.key for e in resolve(parse_collectors("dns:///collectors.internal:4317"))] == ["[fd00::7]:4317"]


def test_a_membership_file_that_is_no_regular_file_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "collectors"
    os.mkfifo(fifo)  # a read would block until someone writes
    with pytest.raises(MembershipError, match="is not a regular file"):
        resolve(parse_collectors(f"file://{fifo}"))
    big = tmp_path / "big"
    big.write_text("127.0.0.1:4317\n" * 100_000)
    with pytest.raises(MembershipError, match="larger than"):
        resolve(parse_collectors(f"file://{big}"))


def test_the_sticky_map_forgets_after_its_time_and_evicts_the_oldest_when_full():
    now = [0.0]
    sticky = StickyMap(60, max_entries=4, clock=lambda: now[0])
    for i in range(4):
        sticky.put(bytes([i]), "a")
    now[0] = 70  # a new period: these four are now the older generation
    assert sticky.get(bytes([0])) == "a"  # seen again: kept
    sticky.put(b"\x09", "b")
    sticky.put(b"\x0a", "b")  # five entries: the older generation (three left in it) goes
    assert sticky.evictions == 3 and sticky.get(bytes([1])) is None and sticky.get(bytes([0])) == "a"
    now[0] = 200
    assert sticky.get(bytes([0])) is None and len(sticky) == 0


# --- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "keys"), [
    ("collector.internal:4317", ["collector.internal:4317"]),
    ("http://10.0.0.5:4317/", ["10.0.0.5:4317"]),
    ("https://C.example:4317", ["https://c.example:4317"]),
    ("a:4317, https://b:4317,[fd00::7]:4317", ["a:4317", "https://b:4317", "[fd00::7]:4317"]),
])
def test_each_endpoint_form_parses(text, keys):
    cfg = load(env={}, flags={"agent.collector": text})
    assert [e.key for e in parse_collectors(cfg.agent.collector).endpoints] == keys


def test_dns_and_file_forms_parse():
    cfg = load(env={"SPIKEHOUND_AGENT_COLLECTOR": "dns:///collectors.svc:4317",
                    "SPIKEHOUND_AGENT_COLLECTOR_RESOLVE_SECONDS": "5"})
    assert (cfg.agent.collector_resolve_seconds, parse_collectors(cfg.agent.collector).kind) == (5, "dns")
    assert parse_collectors(load(env={}, flags={"agent.collector": "file:///etc/c.list"}).agent.collector).path \
        == "/etc/c.list"


@pytest.mark.parametrize("entry", ["..:4317", "-:4317", "_:4317", "a..b:4317", "-a.example:4317", "a-.example:4317",
                                   "a:\uff14\uff13\uff11\uff17", "a:\u0664\u0663\u0661\u0667", "a:\u00b2"])
def test_a_host_that_is_no_host_name_or_a_port_of_other_digits_is_refused_naming_the_entry(entry):
    with pytest.raises(ValueError, match=re.escape(repr(entry))):
        parse_collectors(f"good.example:4317,{entry}")


@pytest.mark.parametrize(("settings", "message"), [
    ({"agent.collector": "collector"}, "agent.collector: expected host:port"),
    ({"agent.collector": "a:4317,b"}, "agent.collector: expected host:port"),
    ({"agent.collector": "a:70000"}, "agent.collector: port 70000 is out of range"),
    ({"agent.collector": "ftp://a:21"}, "agent.collector: expected host:port"),
    ({"agent.collector": ","}, "agent.collector: no collector endpoint given"),
    ({"agent.collector": "dns://8.8.8.8/c:4317"}, "agent.collector: expected dns:///name:port"),
    ({"agent.collector": "dns:///c"}, "agent.collector: expected host:port"),
    ({"agent.collector": "a:4317,file:///x"}, "agent.collector: file:/// stands alone"),
    ({"agent.collector": "file://relative/x"}, "agent.collector: expected file:///absolute/path"),
    ({"agent.collector_resolve_seconds": "0"}, "agent.collector_resolve_seconds: must be greater than 0"),
    ({"agent.route_sticky_seconds": "-1"}, "agent.route_sticky_seconds: must not be negative"),
])
def test_a_bad_collector_setting_names_the_key(settings, message):
    env = {f"SPIKEHOUND_{k.upper().replace('.', '_')}": v for k, v in settings.items()}
    with pytest.raises(ConfigError) as raised:
        load(env=env)
    assert str(raised.value).startswith(message.replace(":", f" (from {next(iter(env))}):", 1)), raised.value


# --- live: real collectors, a real agent ----------------------------------------------------------


class Cluster:
    """Collectors on SQLite, each on a fixed OTLP/gRPC port so that it can be stopped and started again."""

    def __init__(self, tmp_path: Path, names: str) -> None:
        self.dbs = {name: tmp_path / f"{name}.db" for name in names}
        self.ports = {name: free_port() for name in names}
        self.running: dict[str, CollectorThread] = {}

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        cfg = collector_config(f"sqlite:///{self.dbs[name]}", collector__otlp_grpc=self.endpoint(name))
        self.running[name] = CollectorThread(cfg).__enter__()

    def stop(self, name: str) -> None:
        self.running.pop(name).stop()

    def stored(self) -> dict[str, set[tuple[str, str]]]:
        return {name: stored_spans(db) for name, db in self.dbs.items()}

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[[str], Cluster]]:
    made: list[Cluster] = []

    def make(names: str) -> Cluster:
        made.append(Cluster(tmp_path, names))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    made: list[AgentProcess] = []

    def make(collector: str, **env: str) -> AgentProcess:
        made.append(AgentProcess(collector, tmp_path, env={"SPIKEHOUND_AGENT_HOST_NAME": HOST,
                                                           "SPIKEHOUND_AGENT_PROFILING": "false", **env}))
        return made[-1].start()

    yield make
    for agent in made:
        agent.kill()


@pytest.mark.slow
def test_two_collectors_get_whole_traces_and_one_away_has_its_share_spooled_until_it_returns(cluster,
                                                                                          agent_process):
    c = cluster("ab")
    c.start("a")
    c.start("b")
    a, b = c.endpoint("a"), c.endpoint("b")
    agent = agent_process(f"{a},http://{b}")
    sender = TraceSender(agent.grpc_endpoint)
    ring = Rendezvous([a, b])
    try:
        sender.send(30)
        first = sender.sent()
        assert len(first) == 90
        eventually(lambda: set().union(*c.stored().values()) >= first, "the first 30 traces stored", 20)
        where = whole_traces(c.stored())
        assert {where[t] for t, _ in first} == {"a", "b"}
        assert all(ring.owner(bytes.fromhex(t)) == c.endpoint(where[t]) for t, _ in first)

        c.stop("b")
        sender.send(30)
        second = sender.sent() - first
        owned_by = {k: {s for s in second if ring.owner(bytes.fromhex(s[0])) == c.endpoint(k)} for k in "ab"}
        assert owned_by["a"] and owned_by["b"]
        eventually(lambda: c.stored()["a"] >= owned_by["a"], "a's share while b is away", 20)
        assert agent.metric("spikehound_agent_forward_queue_requests", collector=b) > 0
        eventually(lambda: agent.metric("spikehound_agent_collector_member_up", collector=b) == 0,
                   "the agent to see b down", 10)
        assert agent.metric("spikehound_agent_collector_member_up", collector=a) == 1
        assert agent.metric("spikehound_agent_collector_members") == 2

        c.start("b")
        eventually(lambda: c.stored()["b"] >= owned_by["b"], "b's spooled share once it is back", 30)
        eventually(lambda: agent.metric("spikehound_agent_forward_queue_requests", collector=b) == 0,
                   "b's queue drained", 10)
        stored = c.stored()
        whole_traces(stored)
        assert set().union(*stored.values()) == sender.sent()  # nothing lost, nothing extra
        assert agent.metric("spikehound_agent_forwarded_total", signal="spans") >= 180
    finally:
        sender.stop()
    assert agent.terminate(30) == 0, agent.log_tail()


@pytest.mark.slow
def test_a_file_membership_changing_under_load_splits_no_trace_and_stores_every_span_once(cluster, agent_process,
                                                                                         tmp_path):
    c = cluster("abc")
    for name in "abc":
        c.start(name)
    members = tmp_path / "collectors"

    def write(names: str) -> None:  # as config management does: a whole new file, renamed into place
        tmp = members.with_suffix(".tmp")
        tmp.write_text("".join(f"{c.endpoint(n)}\n" for n in names))
        tmp.replace(members)

    write("ab")
    agent = agent_process(f"file://{members}", SPIKEHOUND_AGENT_COLLECTOR_RESOLVE_SECONDS="0.3")
    sender = TraceSender(agent.grpc_endpoint).start()
    with ExitStack() as stack:
        stack.callback(sender.stop)
        time.sleep(2.5)
        write("abc")  # a third collector joins
        eventually(lambda: agent.metric("spikehound_agent_collector_members") == 3, "c to join", 10)
        time.sleep(2.5)
        write("bc")  # a leaves (it keeps running: what the agent holds for it still goes to it)
        eventually(lambda: agent.metric("spikehound_agent_collector_members") == 2, "a to leave", 10)
        time.sleep(2.5)
    sent = sender.sent()
    assert len(sent) > 100
    eventually(lambda: set().union(*c.stored().values()) >= sent, "every span stored", 30)
    stored = c.stored()
    where = whole_traces(stored)
    assert set().union(*stored.values()) == sent
    assert {where[t] for t, _ in sent} == {"a", "b", "c"}
    assert agent.metric("spikehound_agent_membership_changes_total") == 2
    log = agent.log_text()
    assert log.count("collector membership changed") == 2, log
    assert agent.terminate(30) == 0, agent.log_tail()
