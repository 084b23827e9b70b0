"""The agent's collectors: one forward queue, disk spool and forwarder per member, and the routing between them.

The receivers, the profiler and the samplers queue into the ``Router``. It splits each trace request by
owner (``spikehound.agent.routing``: rendezvous hashing on the trace id, a sticky map across membership changes) and
sends a whole metrics or profiles request to the member that owns the agent's host name. Pieces of one
request are queued all or none: every owner must have room (memory, or its spool within the shared
``agent.spool_max_bytes``) before any is queued, else the senders are pushed back.

A member that is away has its share spooled, never sent elsewhere; the others keep flowing. A member that
leaves the membership keeps its queue forwarded to it until it is empty; when it has not answered for
``REROUTE_AFTER_SECONDS`` since it left, what it still holds is routed over the current members by trace
(counted), so nothing acknowledged is lost. Spool directories of earlier members found at start are
handled the same way. The spool directory of a member gone for good is removed once it holds nothing (when
it is forgotten, or when the agent stops).

The agent never forwards to itself: a member that is one of its own OTLP listen addresses is left out of
the membership (one WARNING while it is listed, counted), and every forwarded request carries the agent's
random instance id, so that one that comes back to its own receiver through a name or a proxy is refused
there (FAILED_PRECONDITION, marked); the forwarder then leaves that member out the same way and what it held
is routed over the other members.

With one fixed endpoint (``agent.collector = "host:port"``) the spool is the spool directory itself, as it
always was, so an upgraded agent replays an old spool; members of a list, a DNS name or a file each get
``spool_dir/members/<name>/`` with an ``endpoint`` file naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

from spikehound.agent.forward_queue import COLLECTOR_MAX_REQUEST_BYTES, ForwardQueue
from spikehound.agent.forwarder import AgentChain, Forwarder, ForwardStats
from spikehound.agent.request_split import DropLog, partition_request
from spikehound.agent.routing import (
    MAX_MEMBERS,
    MembershipError,
    Rendezvous,
    StickyMap,
    own_members,
    resolve,
    safe_name,
)
from spikehound.agent.spool import DiskSpool, Item, Signal, SpoolBudget, SpoolWriteError
from spikehound.config import HostPort
from spikehound.endpoints import CollectorSource, Endpoint, parse_endpoint
from spikehound.protowire import WireError

log = logging.getLogger("spikehound.agent.members")

MEMBERS_DIR = "members"
ENDPOINT_FILE = "endpoint"
REROUTE_AFTER_SECONDS = 300.0  # a departed member silent this long loses what it holds to the current members
TEND_SECONDS = 1.0  # departed members and the membership are looked at this often
REROUTE_BATCH = 256  # requests moved off a departed member per tend, so the event loop is not held long
EMPTY_RETRY_SECONDS = 2.0  # with no member at all (the first lookup failed), look again this often
RESOLVE_TIMEOUT_SECONDS = 10.0  # a DNS lookup or file read that takes longer counts as failed
MAX_HELD_MEMBERS = 2 * MAX_MEMBERS  # active and departed together: each costs a channel, a task and a spool
MAX_HUNG_LOOKUPS = 4  # abandoned lookup threads still running; while this many hang, no other is started

Lookup = tuple[list[Endpoint], list[Endpoint]]  # (members named, those of them that are this agent itself)


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


class Router:
    """The members and the routing between them; use from the event loop only (``start`` first)."""

    def __init__(self, source: CollectorSource, spool_dir: Path, *, host: str, memory_bytes: int,
                 spool_max_bytes: int, token: str = "", credentials: grpc.ChannelCredentials | None = None,
                 drop_log: DropLog | None = None, sticky_seconds: float = 60.0, resolve_seconds: float = 30.0,
                 reroute_after: float = REROUTE_AFTER_SECONDS, clock: Callable[[], float] = time.monotonic,
                 listens: Callable[[], Sequence[HostPort]] = tuple, chain: AgentChain | None = None) -> None:
        """``listens`` gives the agent's own OTLP listen addresses (never members); ``chain`` (the agent's id and
        those of the agents forwarding to it) marks what the forwarders send, so that an agent's receiver knows
        requests that come back to it."""
        self.source = source
        self.spool_dir = spool_dir
        self.host = host.encode()
        self.memory_bytes = memory_bytes
        self.budget = SpoolBudget(spool_max_bytes)
        self.token = token
        self.credentials = credentials
        self.drop_log = drop_log or DropLog()
        self.resolve_seconds = resolve_seconds
        self.reroute_after = reroute_after
        self.listens = listens
        self.chain = chain
        self._clock = clock
        # A fixed list never changes: nothing to keep traces across, so no map to fill.
        self.sticky = StickyMap(sticky_seconds if source.kind != "static" else 0, clock=clock)
        self.members: dict[str, Member] = {}  # active and departed members by key
        self._active: list[str] = []
        self._ring: Rendezvous | None = None
        self._running = False
        self._resolve_failing = False
        self._next_resolve = 0.0
        self._hung: list[threading.Thread] = []  # lookups abandoned past their deadline, maybe still running
        self._own: set[str] = set()  # members left out as this agent's own listen address, at the last lookup
        self._looped: set[str] = set()  # members left out because what was forwarded there came back
        self._answered = False  # a lookup has answered (a fixed list is looked at again until one has)
        # Counters of members that are gone (so totals never go down) and of routing itself.
        self.retired = ForwardStats()
        self.retired_spool: Counter[str] = Counter()
        self.membership_changes = 0
        self.resolve_failures = 0
        self.abandoned_lookups = 0
        self.self_members: Counter[str] = Counter()  # reason (address, loop) -> members left out as this agent
        self.rerouted_requests = 0
        self.retired_early = 0  # departed members forgotten before their time: too many members held
        self._trimming = False  # over MAX_HELD_MEMBERS: said once per episode
        self.tend_errors = 0  # failures (bugs) of the membership upkeep, logged once
        self.refused: Counter[str] = Counter()  # member -> requests pushed back for want of its room

    # --- start ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the spools (current members and earlier ones found on disk) and learn the first membership."""
        endpoints: list[Endpoint] = []
        try:
            endpoints = self._leave_out_self(await self._resolve())
            self._answered = True
        except MembershipError as exc:
            self._resolve_failed(str(exc))
        if not endpoints and not self.source.single and not self._own:
            log.warning("no collector to forward to yet (%s); local senders are pushed back until there is one",
                        self._describe())
        for endpoint in endpoints:
            if self._add(endpoint.key, at_start=True):
                self._active.append(endpoint.key)
        self._set_ring()
        self._adopt_leftovers()
        self._next_resolve = self._clock() + self._resolve_wait()

    def _resolve_wait(self) -> float:
        return self.resolve_seconds if self._active else min(self.resolve_seconds, EMPTY_RETRY_SECONDS)

    def _describe(self) -> str:
        s = self.source
        return {"dns": f"dns:///{s.host}:{s.port}", "file": f"file://{s.path}"}.get(s.kind, "the list")

    def _directory(self, key: str) -> Path:
        return self.spool_dir if self.source.single else self.spool_dir / MEMBERS_DIR / safe_name(key)

    def _open(self, key: str, directory: Path, forward: bool) -> Member:
        queue = ForwardQueue(self.memory_bytes, DiskSpool(directory, self.budget.max_bytes, budget=self.budget))
        member = Member(key, queue, directory, root=directory == self.spool_dir)
        if forward:
            self._connect(member)
        return member

    def _connect(self, member: Member) -> None:
        member.forwarder = Forwarder(member.queue, member.key, self.token, drop_log=self.drop_log,
                                     credentials=self.credentials, clock=self._clock, chain=self.chain)
        if self._running:
            self._start_task(member)

    def _add(self, key: str, at_start: bool = False) -> bool:
        """Open ``key``'s queue, spool and forwarder (or revive it, departed), for the caller to make it active;
        False when its spool cannot be opened (raised at start, where an unusable spool directory stops the
        agent as it always did)."""
        member = self.members.get(key)
        if member is not None:  # came back before it was drained
            member.removed_at = None
            if member.forwarder is None:
                self._connect(member)
        else:
            directory = self._directory(key)
            existed = True
            try:
                existed = directory.exists()
                member = self._open(key, directory, forward=True)
                _write_endpoint(directory, key)
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

    def _adopt_leftovers(self) -> None:
        """Spools of members no longer configured: forwarded to their endpoint, or rerouted when it is gone."""
        places = [d for d in sorted((self.spool_dir / MEMBERS_DIR).glob("*")) if d.is_dir()]
        if not self.source.single:
            places.insert(0, self.spool_dir)  # the spool of a single-endpoint agent, before the upgrade to many
        now = self._clock()
        for directory in places:
            if any(m.directory == directory for m in self.members.values()):
                continue
            key = _read_endpoint(directory)
            try:
                spool = DiskSpool(directory, self.budget.max_bytes, budget=self.budget)
            except OSError as exc:
                log.error("cannot read the spool left in %s (%s); it stays there", directory, exc)
                continue
            if not len(spool):
                spool.close()
                if directory != self.spool_dir:
                    shutil.rmtree(directory, ignore_errors=True)
                continue
            # An endpoint that is a member again already has its own spool: this one is moved into the queues.
            forward = key is not None and key not in self.members
            name = key if forward and key is not None else f"{directory.name} (left over)"
            member = Member(name, ForwardQueue(self.memory_bytes, spool), directory, removed_at=now,
                            root=directory == self.spool_dir)
            if forward:
                self._connect(member)
            self.members[name] = member
            log.info("%d requests (%d bytes) spooled for %s, which is no longer a member: %s", len(spool),
                     spool.bytes_used, name, "forwarding them to it while it answers" if forward else
                     "routing them over the current members")

    # --- routing ----------------------------------------------------------------------------------

    @property
    def max_request_bytes(self) -> int:
        """The largest request every member takes (each forwarder lowers its own on a refusal)."""
        limits = [self.members[key].queue.max_request_bytes for key in self._active]
        return min(limits, default=COLLECTOR_MAX_REQUEST_BYTES)

    def put_all(self, items: list[Item]) -> bool:
        """Queue ``items`` (one request's pieces) with their owners, all or none; False: push back.

        Raises SpoolWriteError when a spool had to be written and the disk refused.
        """
        plan = self._plan(items)
        if plan is None:
            return False
        return self._queue(plan)

    def _plan(self, items: list[Item]) -> dict[str, list[Item]] | None:
        ring = self._ring
        if ring is None:
            return None
        plan: dict[str, list[Item]] = {}
        for item in items:
            if self.source.single:  # one fixed collector: whole requests, as before routing existed
                plan.setdefault(ring.members[0], []).append(item)
                continue
            if item.signal is Signal.TRACES:
                try:
                    pieces = partition_request(item.payload, self._trace_owner)
                except (WireError, IndexError):  # the receivers parsed it: only a bug gets here; keep it whole
                    pieces = {ring.owner(self.host): (item.payload, item.count)}
                for owner, (payload, count) in pieces.items():
                    plan.setdefault(owner, []).append(Item(Signal.TRACES, payload, count))
            else:  # a host's samples and profiles go to one collector while the membership holds
                plan.setdefault(ring.owner(self.host), []).append(item)
        return plan

    def _queue(self, plan: dict[str, list[Item]]) -> bool:
        for key, pieces in plan.items():
            if not self.members[key].queue.has_room(sum(piece.size for piece in pieces)):
                self.refused[key] += 1
                return False
        for key, pieces in plan.items():
            # Room was checked: only the disk refusing a write (SpoolWriteError) can stop this half way.
            self.members[key].queue.put_all(pieces)
        return True

    def _trace_owner(self, trace_id: bytes) -> str:
        owner = self.sticky.get(trace_id)
        if owner is not None:
            member = self.members.get(owner)
            if member is not None and member.forwarder is not None:  # still forwarding: the trace stays whole
                return owner
        assert self._ring is not None
        owner = self._ring.owner(trace_id)
        self.sticky.put(trace_id, owner)
        return owner

    def _set_ring(self) -> None:
        self._ring = Rendezvous(self._active) if self._active else None
        share = self.memory_bytes // max(len(self._active), 1)
        for key in self._active:  # the memory budget is shared; a member away spools rather than take it all
            self.members[key].queue.memory_bytes = share

    # --- membership -------------------------------------------------------------------------------

    def apply(self, endpoints: list[Endpoint]) -> None:
        """A new membership (from DNS or the file); an empty one is ignored (never route to nobody)."""
        keys = list(dict.fromkeys(e.key for e in endpoints))
        if not keys:
            self._resolve_failed(f"{self._describe()} names no collector")
            return
        self._resolved()
        if set(keys) == set(self._active):
            return
        now = self._clock()
        removed = [key for key in self._active if key not in keys]
        kept = [key for key in self._active if key in keys]
        # The new state is worked out first and set at once: a member that cannot be opened is left out (said
        # by _add), never left half applied with the ring of the old membership.
        added = [key for key in keys if key not in kept and self._add(key)]
        self._active = kept + added
        for key in removed:
            self.members[key].removed_at = now
        if not added and not removed:
            return
        self._set_ring()
        self.membership_changes += 1
        log.info("collector membership changed: added %s, removed %s; %d members", added or "none",
                 removed or "none", len(self._active))

    async def _trim(self, room: int = 0) -> None:
        """Hold at most MAX_HELD_MEMBERS members: past that, departed ones go first, oldest first, before their
        time. One that still holds requests loses its channel and forwarder and has them routed over the current
        members (what does not fit yet stays in its queue and spool, moved by ``tend``): nothing is dropped.
        ``room``: members about to be added, made room for first."""
        cap = max(MAX_HELD_MEMBERS - room, 0)
        if len(self.members) <= cap:
            if len(self.members) <= MAX_HELD_MEMBERS // 2:  # the episode is over once half the cap is free
                self._trimming = False
            return
        if not self._trimming:
            self._trimming = True
            log.warning("the collector membership changes faster than departed members are forgotten (%d held, at "
                        "most %d): the oldest departed ones are forgotten early, what they hold goes to the current "
                        "members", len(self.members), MAX_HELD_MEMBERS)
        departed = sorted((m for m in self.members.values() if m.removed_at is not None and not m.root),
                          key=lambda m: m.removed_at or 0.0)
        for member in departed:
            if len(self.members) <= cap:
                break
            if len(member.queue):
                await self._disconnect(member)
                self._reroute(member)
                if len(member.queue):
                    continue
            await self._retire(member, quiet=True)
            self.retired_early += 1

    def _resolve_failed(self, why: str) -> None:
        self.resolve_failures += 1
        if not self._resolve_failing:  # once per episode
            self._resolve_failing = True
            log.warning("collector membership: %s; keeping the last good one (%d members)", why, len(self._active))

    def _resolved(self) -> None:
        if self._resolve_failing:
            self._resolve_failing = False
            log.info("collector membership: %s answers again", self._describe())

    async def refresh(self) -> None:
        """Look the membership up again (DNS or the file, in a thread) and apply it."""
        try:
            lookup = await self._resolve()
        except MembershipError as exc:
            self._resolve_failed(str(exc))
            return
        self._answered = True
        endpoints = self._leave_out_self(lookup)
        if endpoints or not lookup[0]:
            await self._trim(room=len({e.key for e in endpoints} - set(self.members)))
            self.apply(endpoints)
            await self._trim()
        else:  # it names this agent alone: said once by _leave_out_self; the last good membership stands
            self.resolve_failures += 1

    def _leave_out_self(self, lookup: Lookup) -> list[Endpoint]:
        """The members of ``lookup`` that are not this agent itself; a WARNING for each one that is, once while
        it is listed."""
        endpoints, own = lookup
        listed = {e.key for e in endpoints}
        self._looped &= listed  # a loop no longer listed is forgotten: listed again, it is tried again
        own_keys = {e.key for e in own} - self._looped
        for key in sorted(own_keys - self._own):
            self.self_members["address"] += 1
            log.warning("collector %s is left out of the membership: it is this agent's own OTLP listen address "
                        "(%s), and forwarding there would send everything back to this agent for ever",
                        key, ", ".join(str(listen) for listen in self.listens()))
        self._own = own_keys
        return [e for e in endpoints if e.key not in own_keys and e.key not in self._looped]

    async def _resolve(self) -> Lookup:
        """``resolve`` on a daemon thread of its own, waited for at most RESOLVE_TIMEOUT_SECONDS: a lookup that hangs
        (a dead DNS server, a hung network file system) must hold neither the membership's upkeep nor the
        agent's exit. One that does not answer in time is abandoned (counted): the next interval starts a fresh
        one. Abandoned threads that still hang are capped (MAX_HUNG_LOOKUPS): past that none is started until
        one of them ends, so a source that never answers cannot pile threads up."""
        self._hung = [thread for thread in self._hung if thread.is_alive()]
        if len(self._hung) >= MAX_HUNG_LOOKUPS:
            raise MembershipError(f"{len(self._hung)} lookups of {self._describe()} have not answered; no other "
                                  "is started until one of them does")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Lookup] = loop.create_future()
        source, listens = self.source, list(self.listens())

        def lookup() -> None:
            found: Lookup | None = None
            error: Exception | None = None
            try:
                endpoints = resolve(source)
                # A fixed list is not looked up in DNS: a slow answer must not cost the agent its collectors at
                # start. A name there that is this host is caught by the instance id instead.
                found = (endpoints, own_members(endpoints, listens, look_up=source.kind != "static"))
            except Exception as exc:  # handed to the waiting coroutine
                error = exc
            with contextlib.suppress(RuntimeError):  # the agent has stopped meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, answer, found, error)

        thread = threading.Thread(target=lookup, name="collector-membership", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(answer), RESOLVE_TIMEOUT_SECONDS)
        except TimeoutError:
            answer.cancel()  # a late answer is dropped
            self._hung.append(thread)
            self.abandoned_lookups += 1
            raise MembershipError(f"{self._describe()} gave no answer within {RESOLVE_TIMEOUT_SECONDS:g} s; "
                                  "the lookup is abandoned") from None

    # --- running ----------------------------------------------------------------------------------

    def _start_task(self, member: Member) -> None:
        assert member.forwarder is not None
        member.task = asyncio.create_task(member.forwarder.run(), name=f"forwarder {member.key}")

    async def run(self) -> None:
        """Forward to every member, follow the membership, tend departed members; cancel to stop."""
        self._running = True
        for member in self.members.values():
            if member.forwarder is not None:
                self._start_task(member)
        try:
            while True:
                await asyncio.sleep(TEND_SECONDS)
                for member in list(self.members.values()):
                    task = member.task
                    if task is not None and task.done() and not task.cancelled():  # a bug: fail the agent
                        raise task.exception() or RuntimeError(f"forwarder to {member.key} ended")
                try:
                    if (self.source.kind != "static" or not self._answered) and self._clock() >= self._next_resolve:
                        await self.refresh()
                        self._next_resolve = self._clock() + self._resolve_wait()
                    await self.tend()
                except Exception:  # a bug here must not stop forwarding: say so once, try again next time
                    self.tend_errors += 1
                    if self.tend_errors == 1:
                        log.exception("collector membership upkeep failed; forwarding goes on")
        finally:
            self._running = False
            await asyncio.gather(*(self._stop_task(m) for m in self.members.values()))

    async def _stop_task(self, member: Member) -> None:
        if member.task is not None:
            member.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await member.task
            member.task = None

    async def tend(self) -> None:
        """Leave out members found to be this agent; close departed members that are empty; reroute what those
        silent too long (or left out) still hold."""
        for member in [m for m in self.members.values() if m.forwarder is not None and m.forwarder.looped]:
            await self._leave_out_loop(member)
        now = self._clock()
        for member in [m for m in self.members.values() if m.removed_at is not None]:
            forwarder, gone_for = member.forwarder, now - member.removed_at
            if forwarder is not None and not len(member.queue):
                # Empty; kept while the sticky map may still send it spans of the traces it has.
                if gone_for >= self.sticky.seconds:
                    await self._retire(member)
                continue
            if forwarder is not None and (gone_for < self.reroute_after
                                          or forwarder.stalled_seconds < self.reroute_after):
                continue
            if forwarder is not None and len(member.queue):
                log.warning("collector %s left the membership and has not answered for %.0f s; rerouting the %d "
                            "requests it still holds over the current members", member.key,
                            forwarder.stalled_seconds, len(member.queue))
                await self._disconnect(member)
            self._reroute(member)
            if not len(member.queue):
                await self._retire(member)
        await self._trim()

    async def _leave_out_loop(self, member: Member) -> None:
        """``member`` is this agent: what was forwarded there came back to its own receiver. It leaves the
        membership while it is listed, and what it holds goes to the other members (no wait: it never answers)."""
        key = member.key
        self.self_members["loop"] += 1
        self._looped.add(key)
        if key in self._active:
            self._active.remove(key)
            self._set_ring()
            self.membership_changes += 1
        if member.removed_at is None:
            member.removed_at = self._clock()
        log.warning("collector %s is this agent itself or leads back to it: what was forwarded there came back to "
                    "an agent it had gone through (this one, through a name or a proxy, or one that forwards to "
                    "this one); it is left out of the membership while it is listed, and the %d "
                    "requests it holds go to the other members (%d)", key, len(member.queue), len(self._active))
        await self._disconnect(member)

    def _reroute(self, member: Member) -> None:
        """Move up to REROUTE_BATCH of ``member``'s requests to their owners among the current members."""
        for _ in range(REROUTE_BATCH):
            item = member.queue.peek()
            if item is None:
                return
            plan = self._plan([item])
            try:
                if plan is None or not self._queue(plan):
                    return  # no member, or no room: next time
            except SpoolWriteError:
                return
            member.queue.pop()
            self.rerouted_requests += 1

    async def _disconnect(self, member: Member) -> None:
        await self._stop_task(member)
        if member.forwarder is not None:
            self._retire_stats(member.forwarder.stats)
            await member.forwarder.close()
            member.forwarder = None

    async def _retire(self, member: Member, quiet: bool = False) -> None:
        """``member`` left and holds nothing: forget it, its spool directory too."""
        await self._disconnect(member)
        spool = member.queue.spool
        for name in ("corrupt_records", "skipped_bytes", "write_errors"):
            self.retired_spool[name] += getattr(spool, name)
        self.retired_spool["spilled_items"] += member.queue.spilled_items
        member.queue.close()
        del self.members[member.key]
        if not member.root:
            shutil.rmtree(member.directory, ignore_errors=True)
        if not quiet:  # early retirements are counted and said once per episode by _trim
            log.info("collector %s: nothing left to forward to it; forgotten", member.key)

    def _retire_stats(self, stats: ForwardStats) -> None:
        for f in fields(ForwardStats):
            value = getattr(stats, f.name)
            if isinstance(value, Counter):
                getattr(self.retired, f.name).update(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                setattr(self.retired, f.name, getattr(self.retired, f.name) + value)

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

    # --- totals, for /metrics -----------------------------------------------------------------------

    @property
    def active(self) -> list[Member]:
        return [self.members[key] for key in self._active]

    def stats(self) -> ForwardStats:
        """Forwarding counters summed over every member, the gone ones too; connected when all active are."""
        total = ForwardStats()
        for stats in [self.retired, *(m.forwarder.stats for m in self.members.values() if m.forwarder)]:
            for f in fields(ForwardStats):
                value = getattr(stats, f.name)
                if isinstance(value, Counter):
                    getattr(total, f.name).update(value)
                elif isinstance(value, int) and not isinstance(value, bool):
                    setattr(total, f.name, getattr(total, f.name) + value)
        total.connected = bool(self._active) and all(
            m.forwarder is not None and m.forwarder.stats.connected for m in self.active)
        return total

    @property
    def stalled_seconds(self) -> float:
        return max((m.forwarder.stalled_seconds for m in self.members.values() if m.forwarder), default=0.0)

    def spool_total(self, name: str) -> int:
        """A spool counter (``corrupt_records``, ``skipped_bytes``, ``write_errors``) over all members."""
        return self.retired_spool[name] + sum(getattr(m.queue.spool, name) for m in self.members.values())

    @property
    def spilled_items(self) -> int:
        return self.retired_spool["spilled_items"] + sum(m.queue.spilled_items for m in self.members.values())

    @property
    def memory_used(self) -> int:
        return sum(m.queue.memory_used for m in self.members.values())

    @property
    def spool_bytes(self) -> int:
        return sum(m.queue.spool.bytes_used for m in self.members.values())

    @property
    def spool_requests(self) -> int:
        return sum(len(m.queue.spool) for m in self.members.values())

    def __len__(self) -> int:
        return sum(len(m.queue) for m in self.members.values())


def _write_endpoint(directory: Path, key: str) -> None:
    """Name the member a spool directory belongs to, so that a later start knows where its records go."""
    path = directory / ENDPOINT_FILE
    try:
        if not path.exists() or path.read_text().strip() != key:
            path.write_text(key + "\n")
    except OSError as exc:  # only a later start with other members needs it
        log.warning("cannot write %s (%s)", path, exc)


def _read_endpoint(directory: Path) -> str | None:
    try:
        return parse_endpoint(next(line for line in (directory / ENDPOINT_FILE).read_text().splitlines()
                                   if line.strip())).key
    except (OSError, StopIteration, ValueError):
        return None


def _settle(future: asyncio.Future[Lookup], found: Lookup | None, exc: Exception | None) -> None:
    if future.done():  # abandoned past its deadline
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(found or ([], []))
