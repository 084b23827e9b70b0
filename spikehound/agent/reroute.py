"""What departed collectors hold: forwarded to them while they answer, else routed over the current members.

A member that leaves the membership keeps its queue forwarded to it until it is empty; when it has not answered
for ``reroute_after`` seconds since it left (REROUTE_AFTER_SECONDS, five minutes), what it still holds is
routed over the current members by trace (counted), so nothing acknowledged is lost. Spool directories of
earlier members found at start are handled the same way. The spool directory of a member gone for good is
removed once it holds nothing (when it is forgotten, or when the agent stops). At most MAX_HELD_MEMBERS members
are held: a membership that changes faster than departed members drain has the oldest of them rerouted and
forgotten early.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable

from spikehound.agent.member_forwarding import MEMBERS_DIR, Member, MemberForwarding, read_endpoint
from spikehound.agent.membership_lookup import MAX_MEMBERS
from spikehound.agent.spool import Item, SpoolWriteError

log = logging.getLogger("spikehound.agent.reroute")

REROUTE_AFTER_SECONDS = 300.0  # a departed member silent this long loses what it holds to the current members
REROUTE_BATCH = 256  # requests moved off a departed member per tend, so the event loop is not held long
MAX_HELD_MEMBERS = 2 * MAX_MEMBERS  # active and departed together: each costs a channel, a task and a spool


class Rerouter:
    """Tends the departed members of ``forwarding``; ``place`` queues requests with their current owners (False:
    no member, or no room yet). ``hold_seconds``: how long an empty departed member is kept, while spans of its
    traces may still be sent to it."""

    def __init__(self, forwarding: MemberForwarding, place: Callable[[list[Item]], bool], *, hold_seconds: float,
                 reroute_after: float = REROUTE_AFTER_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.forwarding = forwarding
        self._place = place
        self.hold_seconds = hold_seconds
        self.reroute_after = reroute_after
        self._clock = clock
        self.rerouted_requests = 0
        self.retired_early = 0  # departed members forgotten before their time: too many members held
        self._trimming = False  # over MAX_HELD_MEMBERS: said once per episode

    def adopt_leftovers(self) -> None:
        """Spools of members no longer configured: forwarded to their endpoint, or rerouted when it is gone."""
        fw = self.forwarding
        spool_dir = fw.queues.spool_dir
        places = [d for d in sorted((spool_dir / MEMBERS_DIR).glob("*")) if d.is_dir()]
        if not fw.single:
            places.insert(0, spool_dir)  # the spool directory itself holds the spool of a single endpoint
        now = self._clock()
        for directory in places:
            if any(m.directory == directory for m in fw.members.values()):
                continue
            key = read_endpoint(directory)
            try:
                spool = fw.open_spool(directory)
            except OSError as exc:
                log.error("cannot read the spool left in %s (%s); it stays there", directory, exc)
                continue
            if not len(spool):
                spool.close()
                if directory != spool_dir:
                    shutil.rmtree(directory, ignore_errors=True)
                continue
            # An endpoint that is a member again already has its own spool: this one is moved into the queues.
            forward = key is not None and key not in fw.members
            name = key if forward and key is not None else f"{directory.name} (left over)"
            fw.adopt(name, spool, directory, removed_at=now, forward=forward)
            log.info("%d requests (%d bytes) spooled for %s, which is no longer a member: %s", len(spool),
                     spool.bytes_used, name, "forwarding them to it while it answers" if forward else
                     "routing them over the current members")

    async def tend(self) -> None:
        """Close departed members that are empty; reroute what those silent too long (or left out) still hold."""
        fw = self.forwarding
        now = self._clock()
        for member in fw.departed():
            forwarder, gone_for = member.forwarder, now - (member.removed_at or 0.0)
            if forwarder is not None and not len(member.queue):
                # Empty; kept while the sticky map may still send it spans of the traces it has.
                if gone_for >= self.hold_seconds:
                    await fw.retire(member)
                continue
            if forwarder is not None and (gone_for < self.reroute_after
                                          or forwarder.stalled_seconds < self.reroute_after):
                continue
            if forwarder is not None and len(member.queue):
                log.warning("collector %s left the membership and has not answered for %.0f s; rerouting the %d "
                            "requests it still holds over the current members", member.key,
                            forwarder.stalled_seconds, len(member.queue))
                await fw.disconnect(member)
            self.reroute(member)
            if not len(member.queue):
                await fw.retire(member)
        await self.trim()

    async def trim(self, room: int = 0) -> None:
        """Hold at most MAX_HELD_MEMBERS members: past that, departed ones go first, oldest first, before their
        time. One that still holds requests loses its channel and forwarder and has them routed over the current
        members (what does not fit yet stays in its queue and spool, moved by ``tend``): nothing is dropped.
        ``room``: members about to be added, made room for first."""
        fw = self.forwarding
        cap = max(MAX_HELD_MEMBERS - room, 0)
        if len(fw.members) <= cap:
            if len(fw.members) <= MAX_HELD_MEMBERS // 2:  # the episode is over once half the cap is free
                self._trimming = False
            return
        if not self._trimming:
            self._trimming = True
            log.warning("the collector membership changes faster than departed members are forgotten (%d held, at "
                        "most %d): the oldest departed ones are forgotten early, what they hold goes to the current "
                        "members", len(fw.members), MAX_HELD_MEMBERS)
        departed = sorted((m for m in fw.departed() if not m.root), key=lambda m: m.removed_at or 0.0)
        for member in departed:
            if len(fw.members) <= cap:
                break
            if len(member.queue):
                await fw.disconnect(member)
                self.reroute(member)
                if len(member.queue):
                    continue
            await fw.retire(member, quiet=True)
            self.retired_early += 1

    def reroute(self, member: Member) -> None:
        """Move up to REROUTE_BATCH of ``member``'s requests to their owners among the current members."""
        for _ in range(REROUTE_BATCH):
            item = member.queue.peek()
            if item is None:
                return
            try:
                if not self._place([item]):
                    return  # no member, or no room: next time
            except SpoolWriteError:
                return
            member.queue.pop()
            self.rerouted_requests += 1
