"""Which collector owns a trace: rendezvous (highest random weight) hashing, and a sticky map across changes.

Every member scores a trace id with the first 8 bytes of ``blake2b(member key + trace id)``; the highest
score owns it. The score depends on the member and the trace alone, so every agent agrees without talking
to the others, and a change of membership moves only what it must: a member that joins takes about 1/N
of the traces (the ones it now outscores everyone on), all of them from the others; a member that leaves
gives up exactly its own traces, spread over the rest. Python's ``hash`` is never used (it is salted per
process); blake2b is the same in every agent.

>>> ring = Rendezvous(["a:4317", "b:4317", "c:4317"])
>>> ring.owner(bytes.fromhex("5b8efff798038103d269b633813fc60c"))
'b:4317'
>>> bigger = Rendezvous(["a:4317", "b:4317", "c:4317", "d:4317"])
>>> ids = [i.to_bytes(16, "big") for i in range(1000)]
>>> moved = [t for t in ids if ring.owner(t) != bigger.owner(t)]
>>> {bigger.owner(t) for t in moved}, 150 < len(moved) < 350
({'d:4317'}, True)

The sticky map keeps a trace on the member it was first sent to for ``seconds`` after it was last seen,
so a membership change does not split the traces an agent has in flight.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable

STICKY_MAX_ENTRIES = 500_000  # about 45 MB at most (a 16-byte key and a dict slot each)


class Rendezvous:
    """Highest-random-weight owner among ``members`` (their keys); at least one member."""

    def __init__(self, members: Iterable[str]) -> None:
        self.members = tuple(sorted(set(members)))
        if not self.members:
            raise ValueError("no members")
        # A hasher fed the member key already: scoring a trace id copies it and adds the id.
        self._seeds = [(hashlib.blake2b(member.encode(), digest_size=8), member) for member in self.members]

    def score(self, member: str, key: bytes) -> int:
        """The 64-bit weight of ``key`` (a trace id, a host name) for ``member``."""
        return int.from_bytes(hashlib.blake2b(member.encode() + key, digest_size=8).digest(), "big")

    def owner(self, key: bytes) -> str:
        if len(self._seeds) == 1:
            return self.members[0]
        best, owner = -1, self.members[0]
        for seed, member in self._seeds:
            hasher = seed.copy()
            hasher.update(key)
            score = int.from_bytes(hasher.digest(), "big")
            if score > best:  # members are sorted and a tie of 64-bit scores all but never happens: still stable
                best, owner = score, member
        return owner


class StickyMap:
    """Trace id -> member for ``seconds`` after the trace was last seen, at most ``max_entries`` (oldest go first).

    Two generations instead of a timestamp per entry (half the memory): entries seen in the current period,
    and in the one before. Every ``seconds`` the older generation is forgotten, so an entry lives between
    ``seconds`` and twice that after it was last seen. When the map is full the older generation is dropped
    early; what it held is counted in ``evictions``.

    >>> clock = [0.0]
    >>> sticky = StickyMap(60, clock=lambda: clock[0])
    >>> sticky.put(b"t1", "a:4317"); sticky.get(b"t1")
    'a:4317'
    >>> clock[0] = 130.0; sticky.get(b"t1") is None
    True
    """

    def __init__(self, seconds: float, max_entries: int = STICKY_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.max_entries = max_entries
        self._clock = clock
        self._current: dict[bytes, str] = {}
        self._previous: dict[bytes, str] = {}
        self._rotated = clock()
        self.evictions = 0  # entries forgotten early because the map was full

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def _age(self) -> None:
        now = self._clock()
        if now - self._rotated < self.seconds:
            return
        # Two periods or more without a rotation (idle): both generations are stale.
        self._previous = self._current if now - self._rotated < 2 * self.seconds else {}
        self._current = {}
        self._rotated = now

    def get(self, trace_id: bytes) -> str | None:
        """The trace's member, if it was seen recently; a hit counts as seeing it again."""
        if not self.seconds:
            return None
        self._age()
        member = self._current.get(trace_id)
        if member is None:
            member = self._previous.pop(trace_id, None)
            if member is not None:
                self._current[trace_id] = member
        return member

    def put(self, trace_id: bytes, member: str) -> None:
        if not self.seconds:
            return
        self._age()
        self._previous.pop(trace_id, None)
        self._current[trace_id] = member
        if len(self._current) + len(self._previous) > self.max_entries:
            if self._previous:  # the oldest generation goes first
                self.evictions += len(self._previous)
                self._previous = {}
            else:  # the current one alone is full: it becomes the old one
                self._previous, self._current = self._current, {}
                self._rotated = self._clock()
