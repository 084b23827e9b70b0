"""The agent's membership under attack: a membership file swapped for links and FIFOs, lookups that never answer,
an agent named as its own collector (by address, by a ``dns:///`` name, through a proxy), and spool directories
of members gone for good. Real agents and collectors on loopback; the storm runs in a child process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.daemons import AgentProcess, CollectorThread, collector_config
from harness.membership_storm import storm
from harness.ports import free_port
from harness.waiting import eventually
from spikehound.agent import membership as membership_module
from spikehound.agent import reroute as reroute_module
from spikehound.agent.dispatcher import Dispatcher
from spikehound.agent.member_forwarding import MEMBERS_DIR, QueueSettings, safe_name
from spikehound.agent.membership_lookup import MembershipError, resolve
from spikehound.agent.rendezvous import Rendezvous
from spikehound.agent.spool import Item, Signal
from spikehound.endpoints import Endpoint, parse_collectors
from tests.support.served import stored_spans
from tests.support.tcp_relay import TcpRelay
from tests.support.trace_sender import TraceSender

HOST = "gpu-node-7"
AGENT_ENV = {"SPIKEHOUND_AGENT_HOST_NAME": HOST, "SPIKEHOUND_AGENT_PROFILING": "false",
             "SPIKEHOUND_AGENT_COLLECTOR_RESOLVE_SECONDS": "0.2", "SPIKEHOUND_AGENT_DRAIN_SECONDS": "1"}
ADDRESS_SPACE_CAP = 2 << 30  # an agent that reads /dev/zero stops here, not at the test machine's memory


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    made: list[AgentProcess] = []
    yield made
    for agent in made:
        agent.kill()


def new_agent(made: list[AgentProcess], tmp_path: Path, collector: str = "", **env: str) -> AgentProcess:
    """An agent not yet started (its ports are known: a membership can name it), under an address-space cap."""
    agent = AgentProcess(collector, tmp_path, interval=0.2, env={**AGENT_ENV, **env})
    if shutil.which("prlimit"):
        agent.prefix = ["prlimit", f"--as={ADDRESS_SPACE_CAP}", "--"]
    made.append(agent)
    return agent


def write_members(path: Path, lines: list[str]) -> None:
    """As config management does: a whole new file renamed into place."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    tmp.replace(path)


# --- the membership file is opened once, never followed, never blocked on --------------------------------


def test_a_link_at_the_membership_path_is_refused_not_followed(tmp_path: Path):
    real = tmp_path / "real"
    real.write_text("127.0.0.1:4317\n")
    link = tmp_path / "collectors"
    link.symlink_to(real)
    with pytest.raises(MembershipError, match="collectors is a symbolic link, which is not followed"):
        resolve(parse_collectors(f"file://{link}"))
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(MembershipError, match="symbolic link"):
        resolve(parse_collectors(f"file://{tmp_path / 'zero'}"))


def test_lookups_racing_a_rename_storm_never_read_past_the_limit_nor_block(tmp_path: Path):
    """The path is swapped for a link to a 4 MiB file and for a FIFO between a check and a read: every lookup
    answers at once, with the good membership or an error, never with what the link points at."""
    big = tmp_path / "big"
    big.write_text("10.9.9.9:1\n" * 400_000)
    path = tmp_path / "collectors"
    path.write_text("127.0.0.1:4317\n")
    source = parse_collectors(f"file://{path}")
    seen: dict[str, int] = {"good": 0, "refused": 0, "followed": 0}
    calls = [0]
    stop = threading.Event()

    def lookups() -> None:
        while not stop.is_set():
            calls[0] += 1
            try:
                found = resolve(source)
            except MembershipError:
                seen["refused"] += 1
                continue
            seen["followed" if Endpoint("10.9.9.9", 1) in found else "good"] += 1

    reader = threading.Thread(target=lookups, name="lookups", daemon=True)
    with storm(path, str(big), 4.0) as running:
        reader.start()
        while running.running:
            before = calls[0]
            # A lookup that blocks (a FIFO opened for reading) stops the count: fail rather than wait for ever.
            eventually(lambda before=before: calls[0] > before, "the lookups to go on during the storm", 5, 0.01)
    stop.set()
    reader.join(5)
    assert not reader.is_alive()
    assert seen["followed"] == 0, seen
    assert seen["good"] and seen["refused"], seen
    assert resolve(source) == [Endpoint("127.0.0.1", 4317)]


def test_a_membership_file_naming_too_many_collectors_is_refused_naming_the_file(tmp_path: Path):
    path = tmp_path / "collectors"
    path.write_text("".join(f"127.0.0.1:{port}\n" for port in range(10_000, 11_000)))
    with pytest.raises(MembershipError, match=f"{path} names 1000 collectors; at most"):
        resolve(parse_collectors(f"file://{path}"))


def test_a_lookup_that_never_answers_is_abandoned_and_hung_lookups_are_capped(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """A lookup that hangs (a dead DNS server, a hung network file system: neither can be had on loopback, so
    ``resolve`` is made to hang) must not freeze the lookups after it."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    path = tmp_path / "collectors"
    path.write_text(f"{a}\n")
    release = threading.Event()
    real_resolve = membership_module.resolve

    def hang(source: object) -> list[Endpoint]:
        release.wait(60)
        raise MembershipError("released")

    def lookup_threads() -> int:
        return sum(t.name == "collector-membership" and t.is_alive() for t in threading.enumerate())

    async def scenario() -> None:
        queues = QueueSettings(tmp_path / "spool", 1 << 20, 1 << 24)
        dispatcher = Dispatcher(parse_collectors(f"file://{path}"), HOST, queues)
        await dispatcher.start()
        monkeypatch.setattr(membership_module, "RESOLVE_TIMEOUT_SECONDS", 0.2)
        monkeypatch.setattr(membership_module, "resolve", hang)
        await dispatcher.refresh()  # hangs past its deadline: the last good membership stands
        assert [m.key for m in dispatcher.active] == [a] and dispatcher.membership.resolve_failures == 1

        monkeypatch.setattr(membership_module, "resolve", real_resolve)
        path.write_text(f"{a}\n{b}\n")
        await dispatcher.refresh()  # a fresh lookup, although the first still hangs
        assert [m.key for m in dispatcher.active] == [a, b]
        assert dispatcher.membership.abandoned_lookups == 1

        monkeypatch.setattr(membership_module, "resolve", hang)
        for _ in range(10):  # a storm of lookups that hang: the threads stop growing at the cap
            await dispatcher.refresh()
        assert lookup_threads() == membership_module.MAX_HUNG_LOOKUPS
        assert dispatcher.membership.abandoned_lookups == membership_module.MAX_HUNG_LOOKUPS
        assert dispatcher.membership.resolve_failures == 11
        release.set()
        eventually(lambda: lookup_threads() == 0, "the hung lookups to end once released", 5, 0.01)
        monkeypatch.setattr(membership_module, "resolve", real_resolve)
        path.write_text(f"{b}\n")
        await dispatcher.refresh()
        assert [m.key for m in dispatcher.active] == [b]
        await dispatcher.close_forwarders()
        dispatcher.close()

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_rename_storm_leaves_the_agent_small_and_the_next_real_change_is_applied(tmp_path: Path, agents):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nobody listens: only the membership counts
    path = tmp_path / "collectors"
    write_members(path, [a])
    agent = new_agent(agents, tmp_path, f"file://{path}").start()
    process = psutil.Process(agent.proc.pid if agent.proc else 0)
    idle = peak = process.memory_info().rss
    with storm(path, "/dev/zero", 3.0) as running:
        while running.running:
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.05)  # sampling the agent's memory while the storm runs, not waiting for anything
    peak = max(peak, process.memory_info().rss)
    write_members(path, [a, b])
    eventually(lambda: agent.metric("spikehound_agent_collector_members") == 2, "the change after the storm", 5)
    assert agent.running
    assert peak - idle < 50 << 20, f"agent RSS went from {idle >> 20} MB to {peak >> 20} MB"
    log = agent.log_text()
    assert "upkeep failed" not in log and "MemoryError" not in log, log[-3000:]


# --- an agent never forwards to itself ----------------------------------------------------------------------


def test_own_addresses_are_every_local_address_behind_a_wildcard_and_only_the_bound_one_otherwise():
    from spikehound.agent.membership_lookup import own_members
    from spikehound.config import HostPort

    local = sorted(str(a.address) for entries in psutil.net_if_addrs().values() for a in entries
                   if a.family == socket.AF_INET and not a.address.startswith("127."))
    members = [Endpoint("localhost", 4317), Endpoint("127.0.0.5", 4317), Endpoint("0.0.0.0", 4317),
               Endpoint("192.0.2.7", 4317), Endpoint("127.0.0.1", 4399), *(Endpoint(a, 4317) for a in local)]
    wildcard = own_members(members, [HostPort("0.0.0.0", 4317), HostPort("0.0.0.0", 4318)])
    assert [e.host for e in wildcard] == ["localhost", "127.0.0.5", "0.0.0.0", *local]
    assert [e.host for e in own_members(members, [HostPort("::", 4317)])] == [e.host for e in wildcard]
    loopback = own_members(members, [HostPort("127.0.0.1", 4317)])
    assert [e.host for e in loopback] == ["localhost", "0.0.0.0"]
    assert own_members(members, [HostPort("localhost", 4399)]) == [Endpoint("127.0.0.1", 4399)]
    named = Endpoint(socket.gethostname().lower(), 4317)  # this host by its name: looked up, unless told not to
    try:
        answers = {str(a[4][0]) for a in socket.getaddrinfo(named.host, 4317, type=socket.SOCK_STREAM)}
    except OSError:  # a host whose name does not resolve: no address of its own by that name
        answers = set()
    expected = any(a in local or a.startswith("127.") or a == "::1" for a in answers)
    assert bool(own_members([named], [HostPort("0.0.0.0", 4317)])) == expected
    assert own_members([named], [HostPort("0.0.0.0", 4317)], look_up=False) == []


def _loop_free(agent: AgentProcess, spans: int) -> None:
    """The agent took ``spans`` spans once, and no more: nothing it forwarded came back to it."""
    assert agent.metric("spikehound_agent_received_total", signal="spans") == spans
    assert agent.metric("spikehound_agent_received_total", signal="metrics") == 0


@pytest.mark.parametrize("named", ["address", "dns"])
def test_an_agent_named_as_its_own_collector_leaves_itself_out_says_so_once_and_forwards_nothing(
        tmp_path: Path, agents, named: str):
    agent = new_agent(agents, tmp_path)
    if named == "address":
        path = tmp_path / "collectors"
        write_members(path, [agent.grpc_endpoint])
        agent.collector = f"file://{path}"
    else:  # a name that resolves to this host
        agent.collector = f"dns:///localhost:{agent.grpc_port}"
    agent.start()
    eventually(lambda: agent.metric("spikehound_agent_sampler_runs_total") >= 15, "three seconds of samples", 20)
    _loop_free(agent, 0)
    assert agent.metric("spikehound_agent_forwarded_total") == 0
    assert agent.metric("spikehound_agent_collector_members") == 0
    assert agent.metric("spikehound_agent_self_members_total", reason="address") == 1
    log = agent.log_text()
    assert log.count("own OTLP listen address") == 1, log[-3000:]
    assert agent.terminate(30) == 0, agent.log_tail()


def _sent_and_stored_once(agent: AgentProcess, db: Path) -> set[tuple[str, str]]:
    """20 traces sent through ``agent``: each span stored once in ``db``, host samples forwarded, no loop."""
    sender = TraceSender(agent.grpc_endpoint)
    try:
        sender.send(20)
    finally:
        sender.stop()
    sent = sender.sent()
    eventually(lambda: stored_spans(db) >= sent, "every span stored", 20)
    eventually(lambda: agent.metric("spikehound_agent_forward_requests_total", signal="metrics") >= 2,
               "two requests of host samples forwarded", 20)
    assert stored_spans(db) == sent
    _loop_free(agent, len(sent))
    return sent


def test_an_agent_listed_beside_a_collector_sends_everything_to_the_collector_once(tmp_path: Path, agents):
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'c.db'}")) as collector:
        agent = new_agent(agents, tmp_path)
        path = tmp_path / "collectors"
        write_members(path, [agent.grpc_endpoint, collector.grpc_endpoint])
        agent.collector = f"file://{path}"
        agent.start()
        _sent_and_stored_once(agent, tmp_path / "c.db")
        assert agent.metric("spikehound_agent_collector_members") == 1
        assert agent.metric("spikehound_agent_self_members_total", reason="address") == 1
        assert agent.log_text().count("own OTLP listen address") == 1
        assert agent.terminate(30) == 0, agent.log_tail()


def test_a_loop_through_a_proxy_is_detected_counted_and_broken_and_nothing_is_lost(tmp_path: Path, agents):
    """The agent reaches itself through a relay on another port: no address of its own gives it away, the
    instance id on what it forwards does. What it had queued for the relay goes to the real collector."""
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'c.db'}")) as collector:
        agent = new_agent(agents, tmp_path)
        with TcpRelay(agent.grpc_port) as relay:
            relayed = f"127.0.0.1:{relay.port}"
            path = tmp_path / "collectors"
            write_members(path, [relayed, collector.grpc_endpoint])
            agent.collector = f"file://{path}"
            agent.start()
            sent = _sent_and_stored_once(agent, tmp_path / "c.db")
            ring = Rendezvous([relayed, collector.grpc_endpoint])
            assert {ring.owner(bytes.fromhex(t)) for t, _ in sent} == {relayed, collector.grpc_endpoint}
            assert agent.metric("spikehound_agent_forward_loops_total") >= 1
            assert agent.metric("spikehound_agent_self_members_total", reason="loop") == 1
            assert agent.metric("spikehound_agent_collector_members") == 1
            log = agent.log_text()
            assert log.count("is this agent itself") == 1, log[-3000:]
            assert agent.terminate(30) == 0, agent.log_tail()


# --- spool directories of members gone for good -------------------------------------------------------------


def test_the_spool_directories_of_members_gone_for_good_are_removed(tmp_path: Path, agents):
    keys = [f"127.0.0.1:{free_port()}" for _ in range(4)]  # nobody listens
    stays = Rendezvous(keys).owner(HOST.encode())  # the host's samples go to it: the others hold nothing
    path = tmp_path / "collectors"
    write_members(path, keys)
    agent = new_agent(agents, tmp_path, f"file://{path}").start()
    spools = agent.spool_dir / MEMBERS_DIR
    assert sorted(d.name for d in spools.iterdir()) == sorted(safe_name(k) for k in keys)
    write_members(path, [stays])
    eventually(lambda: agent.metric("spikehound_agent_collector_members") == 1, "three members to leave", 10)
    assert agent.terminate(30) == 0, agent.log_tail()  # before their sticky period is over
    assert [d.name for d in spools.iterdir()] == [safe_name(stays)]
    assert os.listdir(spools / safe_name(stays))  # the member that stays keeps its spool


# --- names too long for a directory, membership churn, agents forwarding to each other ----------------------

LONG_NAME = ".".join(["a" * 62] * 4)[:249] + "x"  # a valid DNS name of 250 characters, labels of at most 63


def test_any_valid_member_name_maps_to_a_directory_name_that_keeps_members_apart():
    names = [f"{LONG_NAME}:4317", f"https://{LONG_NAME}:4317", f"{LONG_NAME[:-1]}y:4317", f"{LONG_NAME}:4318"]
    dirs = [safe_name(name) for name in names]
    assert len(set(dirs)) == len(names)
    assert all(len(d.encode()) <= 255 for d in dirs), [len(d) for d in dirs]
    assert dirs[0].startswith("a" * 62 + ".")  # still readable


@pytest.mark.parametrize("form", ["file", "list"])
def test_a_member_name_too_long_for_a_directory_is_a_member_at_start_and_after_a_change(tmp_path: Path, form: str):
    good = f"127.0.0.1:{free_port()}"
    long = f"{LONG_NAME}:4317"
    path = tmp_path / "collectors"
    write_members(path, [good, long])

    async def scenario() -> None:
        dispatcher = Dispatcher(parse_collectors(f"file://{path}" if form == "file" else f"{good},{long}"), HOST,
                            QueueSettings(tmp_path / "spool", 1 << 20, 1 << 24))
        await dispatcher.start()
        assert sorted(m.key for m in dispatcher.active) == sorted([good, long])
        if form == "file":
            write_members(path, [good])
            await dispatcher.refresh()
            write_members(path, [long])
            await dispatcher.refresh()
            assert [m.key for m in dispatcher.active] == [long] and dispatcher.membership_changes == 2
            assert dispatcher._ring is not None and dispatcher._ring.members == (long,)
        await dispatcher.close_forwarders()
        dispatcher.close()

    asyncio.run(scenario())


def test_membership_churn_holds_at_most_the_cap_of_members_and_loses_nothing_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A file rewritten with new members faster than departed ones are forgotten: what the agent holds stays
    capped; empty departed members go at once (counted), one that holds data has it rerouted, never dropped."""
    monkeypatch.setattr(reroute_module, "MAX_HELD_MEMBERS", 8)
    path = tmp_path / "collectors"
    ports = iter(range(20000, 20400))
    now = [1000.0]

    def batch() -> list[str]:
        return [f"127.0.0.1:{next(ports)}" for _ in range(4)]  # nobody listens there

    async def scenario() -> None:
        write_members(path, batch())
        queues = QueueSettings(tmp_path / "spool", 1 << 20, 1 << 24)
        dispatcher = Dispatcher(parse_collectors(f"file://{path}"), HOST, queues,
                            clock=lambda: now[0])
        await dispatcher.start()
        assert dispatcher.put_all([Item(Signal.METRICS, b"\x0a\x00", 1)])  # held by the host's owner
        for _ in range(30):
            write_members(path, batch())
            await dispatcher.refresh()
            now[0] += 0.3
            assert len(dispatcher.members) <= 8, len(dispatcher.members)  # before a change is applied, too
            assert dispatcher.totals.requests == 1  # the queued request moved, never lost
        assert dispatcher.rerouter.retired_early >= 30 * 4 - 8
        assert len(list((tmp_path / "spool" / MEMBERS_DIR).iterdir())) <= 8
        await dispatcher.close_forwarders()
        dispatcher.close()

    asyncio.run(scenario())


def test_two_agents_forwarding_to_each_other_break_the_loop_and_say_so_once(tmp_path: Path, agents):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = new_agent(agents, tmp_path / "a")
    second = new_agent(agents, tmp_path / "b")
    first.collector, second.collector = second.grpc_endpoint, first.grpc_endpoint
    first.start()
    second.start()
    sender = TraceSender(first.grpc_endpoint)
    try:
        sender.send(5)
    finally:
        sender.stop()
    both = (first, second)

    def loops() -> int:
        return sum(a.metric("spikehound_agent_forward_loops_total") for a in both)

    eventually(lambda: loops() >= 1, "the loop refused by one of the agents", 15)
    eventually(lambda: sum(a.metric("spikehound_agent_self_members_total", reason="loop") for a in both) >= 1,
               "the member leading back left out", 15)
    runs = first.metric("spikehound_agent_sampler_runs_total")
    eventually(lambda: first.metric("spikehound_agent_sampler_runs_total") >= runs + 10, "two more seconds", 15)
    sent = len(sender.sent())
    # What the sender sent never came back to the first agent, and the second got it once at most.
    assert first.metric("spikehound_agent_received_total", signal="spans") == sent
    assert second.metric("spikehound_agent_received_total", signal="spans") <= sent
    for agent in both:
        assert agent.metric("spikehound_agent_collector_members") in (0, 1)
    assert sum(a.log_text().count("is this agent itself") for a in both) \
        == sum(a.metric("spikehound_agent_self_members_total", reason="loop") for a in both)
    for agent in both:
        assert agent.terminate(30) == 0, agent.log_tail()
