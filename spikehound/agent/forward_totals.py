"""The agent's forwarding and queue counters summed over its collectors, forgotten ones included (for /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from spikehound.agent.forwarder import ForwardStats
from spikehound.agent.member_forwarding import Member, MemberForwarding, add_stats


class ForwardTotals:
    """Totals over the members ``forwarding`` holds and those it forgot; ``active`` gives the current members."""

    def __init__(self, forwarding: MemberForwarding, active: Callable[[], Sequence[Member]]) -> None:
        self._forwarding = forwarding
        self._active = active

    def stats(self) -> ForwardStats:
        """Forwarding counters summed over every member, the gone ones too; connected when all active are."""
        total = ForwardStats()
        members = self._forwarding.members.values()
        for stats in [self._forwarding.retired.forward, *(m.forwarder.stats for m in members if m.forwarder)]:
            add_stats(total, stats)
        active = self._active()
        total.connected = bool(active) and all(m.forwarder is not None and m.forwarder.stats.connected
                                               for m in active)
        return total

    @property
    def stalled_seconds(self) -> float:
        return max((m.forwarder.stalled_seconds for m in self._forwarding.members.values() if m.forwarder),
                   default=0.0)

    def spool_total(self, name: str) -> int:
        """A spool counter (``corrupt_records``, ``skipped_bytes``, ``write_errors``) over all members."""
        members = self._forwarding.members.values()
        return self._forwarding.retired.spool[name] + sum(getattr(m.queue.spool, name) for m in members)

    @property
    def spilled_items(self) -> int:
        members = self._forwarding.members.values()
        return self._forwarding.retired.spool["spilled_items"] + sum(m.queue.spilled_items for m in members)

    @property
    def memory_used(self) -> int:
        return sum(m.queue.memory_used for m in self._forwarding.members.values())

    @property
    def spool_bytes(self) -> int:
        return sum(m.queue.spool.bytes_used for m in self._forwarding.members.values())

    @property
    def spool_requests(self) -> int:
        return sum(len(m.queue.spool) for m in self._forwarding.members.values())

    @property
    def requests(self) -> int:
        """Requests queued (memory and spool) for every member."""
        return sum(len(m.queue) for m in self._forwarding.members.values())
