"""Forwarding to each collector the agent holds: its forward queue, disk spool, forwarder and forwarding task.

A member is opened when it joins the membership (or when the spool of an earlier member is found at start) and
kept while it holds anything or may still be sent spans of its traces; ``retire`` forgets it, spool directory
and all. The counters of a forgotten member are kept in ``Retired``, so that the totals on ``/metrics`` never go
down.

With one fixed endpoint (``agent.collector = "host:port"``) the spool is the spool directory itself; members of a
list, a DNS name or a file each get ``spool_dir/members/<name>/`` with an ``endpoint`` file naming them, so that
a later start with other members knows where each spool's records go.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.forwarder import AgentChain, Forwarder, ForwardStats
from spikehound.agent.request_split import DropLog
from spikehound.agent.spool import DiskSpool, SpoolBudget
from spikehound.endpoints import parse_endpoint

log = logging.getLogger("spikehound.agent.member_forwarding")

MEMBERS_DIR = "members"
ENDPOINT_FILE = "endpoint"
SAFE_NAME_READABLE = 200  # characters of a key kept in its directory name (all ASCII: one byte each)
SPOOL_COUNTERS = ("corrupt_records", "skipped_bytes", "write_errors")


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """Where and how much the members queue: ``spool_dir`` (the one endpoint's spool, or where ``members/`` is),
    ``memory_bytes`` shared by the active members, ``spool_max_bytes`` shared by every member's spool."""

    spool_dir: Path
    memory_bytes: int
    spool_max_bytes: int


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    """How every member's forwarder sends: the collectors' bearer token and TLS credentials, where requests
    dropped as too large are said, and the chain of agent ids that marks what is forwarded (so that an agent's
    receiver knows requests that come back to it)."""

    token: str = ""
    credentials: grpc.ChannelCredentials | None = None
    drop_log: DropLog = field(default_factory=DropLog)
    chain: AgentChain | None = None


@dataclass(eq=False)
class Member:
    """One collector's queue and forwarder; ``removed_at`` once it left the membership."""

    key: str
    queue: ForwardQueue
    directory: Path
    forwarder: Forwarder | None = None  # None: what it holds is rerouted, not forwarded
    task: asyncio.Task[None] | None = None
    removed_at: float | None = None
    root: bool = False  # the spool directory itself: never deleted

    @property
    def state(self) -> str:
        if self.removed_at is None:
            return "active"
        return "departing" if self.forwarder is not None else "rerouting"


@dataclass
class Retired:
    """What forgotten members had counted: their forwarders' counters and their spools'."""

    forward: ForwardStats = field(default_factory=ForwardStats)
    spool: Counter[str] = field(default_factory=Counter)

    def add_forwarder(self, stats: ForwardStats) -> None:
        add_stats(self.forward, stats)

    def add_queue(self, queue: ForwardQueue) -> None:
        for name in SPOOL_COUNTERS:
            self.spool[name] += getattr(queue.spool, name)
        self.spool["spilled_items"] += queue.spilled_items


def add_stats(total: ForwardStats, stats: ForwardStats) -> None:
    """Add the counters of ``stats`` to ``total`` (``connected``, a flag, is left alone)."""
    for f in fields(ForwardStats):
        value = getattr(stats, f.name)
        if isinstance(value, Counter):
            getattr(total, f.name).update(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            setattr(total, f.name, getattr(total, f.name) + value)


class MemberForwarding:
    """Every member held, active or departed, by key; use from the event loop only.

    ``single``: one fixed endpoint, whose spool is the spool directory itself.
    """

    def __init__(self, queues: QueueSettings, forwarding: ForwardSettings, *, single: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queues = queues
        self.forwarding = forwarding
        self.single = single
        self._clock = clock
        self.budget = SpoolBudget(queues.spool_max_bytes)
        self.members: dict[str, Member] = {}
        self.retired = Retired()
        self._running = False  # forwarding tasks run: a member connected now gets its task at once

    def directory(self, key: str) -> Path:
        spool_dir = self.queues.spool_dir
        return spool_dir if self.single else spool_dir / MEMBERS_DIR / safe_name(key)

    def open_spool(self, directory: Path) -> DiskSpool:
        """The spool in ``directory``, under the members' shared cap (OSError when it cannot be opened)."""
        return DiskSpool(directory, self.budget.max_bytes, budget=self.budget)

    def add(self, key: str, at_start: bool = False) -> bool:
        """Open ``key``'s queue, spool and forwarder (or revive it, departed), for the caller to make it active;
        False when its spool cannot be opened (raised at start, where an unusable spool directory stops the
        agent)."""
        member = self.members.get(key)
        if member is not None:  # came back before it was drained
            member.removed_at = None
            if member.forwarder is None:
                self.connect(member)
            return True
        directory = self.directory(key)
        existed = True
        try:
            existed = directory.exists()
            member = Member(key, ForwardQueue(self.queues.memory_bytes, self.open_spool(directory)), directory,
                            root=directory == self.queues.spool_dir)
            self.connect(member)
            write_endpoint(directory, key)
        except OSError as exc:
            if at_start:
                raise
            if not existed:  # made for nothing: no member, no spool, no directory
                shutil.rmtree(directory, ignore_errors=True)
            log.error("cannot open the spool of collector %s in %s (%s); it is left out of the membership "
                      "until the next lookup", key, directory, exc)
            return False
        self.members[key] = member
        if len(member.queue.spool):
            log.info("collector %s: %d requests (%d bytes) spooled on disk from an earlier run; forwarding "
                     "them first", key, len(member.queue.spool), member.queue.spool.bytes_used)
        return True

    def adopt(self, name: str, spool: DiskSpool, directory: Path, *, removed_at: float, forward: bool) -> Member:
        """Hold the spool of a member that is no longer one: forwarded to it when ``forward``, else rerouted."""
        member = Member(name, ForwardQueue(self.queues.memory_bytes, spool), directory, removed_at=removed_at,
                        root=directory == self.queues.spool_dir)
        if forward:
            self.connect(member)
        self.members[name] = member
        return member

    def connect(self, member: Member) -> None:
        """Give ``member`` a forwarder (and its task, once forwarding runs)."""
        f = self.forwarding
        member.forwarder = Forwarder(member.queue, member.key, f.token, drop_log=f.drop_log,
                                     credentials=f.credentials, clock=self._clock, chain=f.chain)
        if self._running:
            self._start_task(member)

    def share_memory(self, active: Iterable[str]) -> None:
        """Split the memory budget between the ``active`` members: one that is away spools rather than take it
        all."""
        keys = list(active)
        share = self.queues.memory_bytes // max(len(keys), 1)
        for key in keys:
            self.members[key].queue.memory_bytes = share

    def departed(self) -> list[Member]:
        return [m for m in self.members.values() if m.removed_at is not None]

    def looped(self) -> list[Member]:
        """Members whose forwarder found that what it sent came back to this agent."""
        return [m for m in self.members.values() if m.forwarder is not None and m.forwarder.looped]

    # --- the forwarding tasks ------------------------------------------------------------------------

    def _start_task(self, member: Member) -> None:
        assert member.forwarder is not None
        member.task = asyncio.create_task(member.forwarder.run(), name=f"forwarder {member.key}")

    def start(self) -> None:
        """Start every member's forwarding task; members connected from now on start theirs at once."""
        self._running = True
        for member in self.members.values():
            if member.forwarder is not None:
                self._start_task(member)

    def check(self) -> None:
        """Raise what ended a forwarding task: a forwarder runs until cancelled, so only a bug ends one."""
        for member in list(self.members.values()):
            task = member.task
            if task is not None and task.done() and not task.cancelled():
                raise task.exception() or RuntimeError(f"forwarder to {member.key} ended")

    async def stop(self) -> None:
        """Stop every forwarding task."""
        self._running = False
        await asyncio.gather(*(self._stop_task(m) for m in self.members.values()))

    async def _stop_task(self, member: Member) -> None:
        if member.task is not None:
            member.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await member.task
            member.task = None

    async def disconnect(self, member: Member) -> None:
        """Stop forwarding to ``member`` (its counters kept); what it holds stays in its queue."""
        await self._stop_task(member)
        if member.forwarder is not None:
            self.retired.add_forwarder(member.forwarder.stats)
            await member.forwarder.close()
            member.forwarder = None

    async def retire(self, member: Member, quiet: bool = False) -> None:
        """``member`` left and holds nothing: forget it, its spool directory too."""
        await self.disconnect(member)
        self.retired.add_queue(member.queue)
        member.queue.close()
        del self.members[member.key]
        if not member.root:
            shutil.rmtree(member.directory, ignore_errors=True)
        if not quiet:  # early retirements are counted and said once per episode by the rerouter
            log.info("collector %s: nothing left to forward to it; forgotten", member.key)

    # --- stopping ---------------------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        """Forward what every member holds until ``seconds`` have passed (at shutdown), side by side."""
        deadline = time.monotonic() + seconds

        async def one(forwarder: Forwarder, queue: ForwardQueue) -> None:
            while queue.peek() is not None and time.monotonic() < deadline:
                remaining = deadline - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(forwarder.flush(timeout=max(remaining, 0.1)), remaining)

        await asyncio.gather(*(one(m.forwarder, m.queue) for m in self.members.values() if m.forwarder is not None))

    async def close_forwarders(self) -> None:
        await asyncio.gather(*(m.forwarder.close() for m in self.members.values() if m.forwarder is not None))

    def spill_memory(self) -> int:
        """Every member's unsent memory to the head of its spool; how many requests did not fit."""
        return sum(member.queue.spill_memory() for member in self.members.values())

    def close(self) -> None:
        """Close every spool; those of departed members that hold nothing go, directory and all."""
        for member in self.members.values():
            empty = not len(member.queue)
            member.queue.close()
            if empty and member.removed_at is not None and not member.root:
                shutil.rmtree(member.directory, ignore_errors=True)


def safe_name(key: str) -> str:
    """A member key as a directory name: its characters that are safe (at most SAFE_NAME_READABLE of them), and
    a hash that keeps names apart.

    >>> safe_name("https://[::1]:4317")
    'https_1_4317-98925aad'
    """
    readable = "".join(c if (c.isascii() and c.isalnum()) or c in ".-" else "_" for c in key)
    while "__" in readable:
        readable = readable.replace("__", "_")
    # A valid DNS name (253 characters) plus scheme and port is longer than a directory name may be (255 bytes):
    # the readable part is cut, the hash of the whole key still keeps names apart.
    readable = readable.strip("_")[:SAFE_NAME_READABLE]
    return f"{readable}-{hashlib.blake2b(key.encode(), digest_size=4).hexdigest()}"


def write_endpoint(directory: Path, key: str) -> None:
    """Name the member a spool directory belongs to, so that a later start knows where its records go."""
    path = directory / ENDPOINT_FILE
    try:
        if not path.exists() or path.read_text().strip() != key:
            path.write_text(key + "\n")
    except OSError as exc:  # only a later start with other members needs it
        log.warning("cannot write %s (%s)", path, exc)


def read_endpoint(directory: Path) -> str | None:
    """The member a spool directory belongs to, if its endpoint file names one."""
    try:
        return parse_endpoint(next(line for line in (directory / ENDPOINT_FILE).read_text().splitlines()
                                   if line.strip())).key
    except (OSError, StopIteration, ValueError):
        return None
