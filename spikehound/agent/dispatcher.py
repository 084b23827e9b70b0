"""Where the agent's receivers, profiler and samplers queue: each request's pieces go to the collectors that own
them, one forward queue, disk spool and forwarder per collector.

The ``Dispatcher`` splits each trace request by owner (``spikehound.agent.rendezvous``: rendezvous hashing on the
trace id, a sticky map across membership changes) and sends a whole metrics or profiles request to the member
that owns the agent's host name. Pieces of one request are queued all or none: every owner must have room
(memory, or its spool within the shared ``agent.spool_max_bytes``) before any is queued, else the senders are
pushed back. A member that is away has its share spooled, never sent elsewhere; the others keep flowing.

Who the members are is ``spikehound.agent.membership``'s; the forwarding to each of them,
``spikehound.agent.member_forwarding``'s; what departed members still hold, ``spikehound.agent.reroute``'s; the
totals on ``/metrics``, ``spikehound.agent.forward_totals``'. The dispatcher applies each new membership and runs
the upkeep of all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spikehound.agent.forward_queue import COLLECTOR_MAX_REQUEST_BYTES
from spikehound.agent.forward_totals import ForwardTotals
from spikehound.agent.member_forwarding import ForwardSettings, Member, MemberForwarding, QueueSettings
from spikehound.agent.membership import Membership
from spikehound.agent.membership_lookup import MembershipError
from spikehound.agent.rendezvous import Rendezvous, StickyMap
from spikehound.agent.request_split import partition_request
from spikehound.agent.reroute import REROUTE_AFTER_SECONDS, Rerouter
from spikehound.agent.spool import Item, Signal
from spikehound.config import HostPort
from spikehound.endpoints import CollectorSource, Endpoint
from spikehound.protowire import WireError

log = logging.getLogger("spikehound.agent.dispatcher")

TEND_SECONDS = 1.0  # departed members and the membership are looked at this often


@dataclass(frozen=True, slots=True)
class RouteTimes:
    """``sticky_seconds``: how long a trace stays with its member across a change; ``resolve_seconds``: how often
    the membership is looked up; ``reroute_after``: how long a departed member may be silent before what it
    holds goes to the current members."""

    sticky_seconds: float = 60.0
    resolve_seconds: float = 30.0
    reroute_after: float = REROUTE_AFTER_SECONDS


class Dispatcher:
    """The members and the routing between them; use from the event loop only (``start`` first).

    ``host``: the agent's host name, whose owner takes its metrics and profiles; ``listens`` gives the agent's
    own OTLP listen addresses (never members).
    """

    def __init__(self, source: CollectorSource, host: str, queues: QueueSettings,
                 forwarding: ForwardSettings | None = None, times: RouteTimes | None = None, *,
                 listens: Callable[[], Sequence[HostPort]] = tuple,
                 clock: Callable[[], float] = time.monotonic) -> None:
        times = times or RouteTimes()
        self.source = source
        self.host = host.encode()
        self._clock = clock
        # A fixed list never changes: nothing to keep traces across, so no map to fill.
        self.sticky = StickyMap(times.sticky_seconds if source.kind != "static" else 0, clock=clock)
        self.membership = Membership(source, resolve_seconds=times.resolve_seconds, listens=listens, clock=clock)
        self.forwarders = MemberForwarding(queues, forwarding or ForwardSettings(), single=source.single,
                                           clock=clock)
        self.rerouter = Rerouter(self.forwarders, self.put_all, hold_seconds=self.sticky.seconds,
                                 reroute_after=times.reroute_after, clock=clock)
        self.totals = ForwardTotals(self.forwarders, lambda: self.active)
        self._active: list[str] = []
        self._ring: Rendezvous | None = None
        self.membership_changes = 0
        self.tend_errors = 0  # failures (bugs) of the membership upkeep, logged once
        self.refused: Counter[str] = Counter()  # member -> requests pushed back for want of its room

    @property
    def members(self) -> dict[str, Member]:
        """Every member held, active and departed, by key."""
        return self.forwarders.members

    @property
    def active(self) -> list[Member]:
        return [self.forwarders.members[key] for key in self._active]

    async def start(self) -> None:
        """Open the spools (current members and earlier ones found on disk) and learn the first membership."""
        membership = self.membership
        endpoints: list[Endpoint] = []
        try:
            endpoints = membership.leave_out_self(await membership.lookup())
        except MembershipError as exc:
            membership.failed(str(exc), len(self._active))
        if not endpoints and not self.source.single and not membership.own:
            log.warning("no collector to forward to yet (%s); local senders are pushed back until there is one",
                        membership.describe())
        for endpoint in endpoints:
            if self.forwarders.add(endpoint.key, at_start=True):
                self._active.append(endpoint.key)
        self._set_ring()
        self.rerouter.adopt_leftovers()
        membership.schedule(len(self._active))

    # --- routing ----------------------------------------------------------------------------------

    @property
    def max_request_bytes(self) -> int:
        """The largest request every member takes (each forwarder lowers its own on a refusal)."""
        limits = [member.queue.max_request_bytes for member in self.active]
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
            if self.source.single:  # one fixed collector: whole requests, nothing to split
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
        members = self.forwarders.members
        for key, pieces in plan.items():
            if not members[key].queue.has_room(sum(piece.size for piece in pieces)):
                self.refused[key] += 1
                return False
        for key, pieces in plan.items():
            # Room was checked: only the disk refusing a write (SpoolWriteError) can stop this half way.
            members[key].queue.put_all(pieces)
        return True

    def _trace_owner(self, trace_id: bytes) -> str:
        owner = self.sticky.get(trace_id)
        if owner is not None:
            member = self.forwarders.members.get(owner)
            if member is not None and member.forwarder is not None:  # still forwarding: the trace stays whole
                return owner
        assert self._ring is not None
        owner = self._ring.owner(trace_id)
        self.sticky.put(trace_id, owner)
        return owner

    def _set_ring(self) -> None:
        self._ring = Rendezvous(self._active) if self._active else None
        self.forwarders.share_memory(self._active)

    # --- membership -------------------------------------------------------------------------------

    def apply(self, endpoints: list[Endpoint]) -> None:
        """A new membership (from DNS or the file); an empty one is ignored (never route to nobody)."""
        keys = list(dict.fromkeys(e.key for e in endpoints))
        if not keys:
            self.membership.failed(f"{self.membership.describe()} names no collector", len(self._active))
            return
        self.membership.answered()
        if set(keys) == set(self._active):
            return
        now = self._clock()
        removed = [key for key in self._active if key not in keys]
        kept = [key for key in self._active if key in keys]
        # The new state is worked out first and set at once: a member that cannot be opened is left out (said
        # by MemberForwarding.add), never left half applied with the ring of the old membership.
        added = [key for key in keys if key not in kept and self.forwarders.add(key)]
        self._active = kept + added
        for key in removed:
            self.forwarders.members[key].removed_at = now
        if not added and not removed:
            return
        self._set_ring()
        self.membership_changes += 1
        log.info("collector membership changed: added %s, removed %s; %d members", added or "none",
                 removed or "none", len(self._active))

    async def refresh(self) -> None:
        """Look the membership up again (DNS or the file, in a thread) and apply it."""
        membership = self.membership
        try:
            lookup = await membership.lookup()
        except MembershipError as exc:
            membership.failed(str(exc), len(self._active))
            return
        endpoints = membership.leave_out_self(lookup)
        if endpoints or not lookup[0]:
            await self.rerouter.trim(room=len({e.key for e in endpoints} - set(self.forwarders.members)))
            self.apply(endpoints)
            await self.rerouter.trim()
        else:  # it names this agent alone: said once by leave_out_self; the last good membership stands
            membership.named_only_self()

    # --- running ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Forward to every member, follow the membership, tend departed members; cancel to stop."""
        self.forwarders.start()
        try:
            while True:
                await asyncio.sleep(TEND_SECONDS)
                self.forwarders.check()  # a bug: fail the agent
                try:
                    if self.membership.due():
                        await self.refresh()
                        self.membership.schedule(len(self._active))
                    await self.tend()
                except Exception:  # a bug here must not stop forwarding: say so once, try again next time
                    self.tend_errors += 1
                    if self.tend_errors == 1:
                        log.exception("collector membership upkeep failed; forwarding goes on")
        finally:
            await self.forwarders.stop()

    async def tend(self) -> None:
        """Leave out members found to be this agent; close departed members that are empty; reroute what those
        silent too long (or left out) still hold."""
        for member in self.forwarders.looped():
            await self._leave_out_loop(member)
        await self.rerouter.tend()

    async def _leave_out_loop(self, member: Member) -> None:
        """``member`` is this agent: what was forwarded there came back to its own receiver. It leaves the
        membership while it is listed, and what it holds goes to the other members (no wait: it never answers)."""
        key = member.key
        self.membership.note_loop(key)
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
        await self.forwarders.disconnect(member)

    # --- stopping ---------------------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        """Forward what every member holds until ``seconds`` have passed (at shutdown), side by side."""
        await self.forwarders.drain(seconds)

    async def close_forwarders(self) -> None:
        await self.forwarders.close_forwarders()

    def spill_memory(self) -> int:
        """Every member's unsent memory to the head of its spool; how many requests did not fit."""
        return self.forwarders.spill_memory()

    def close(self) -> None:
        """Close every spool; those of departed members that hold nothing go, directory and all."""
        self.forwarders.close()
