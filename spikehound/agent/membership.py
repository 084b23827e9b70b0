"""Who the collectors are: the members ``agent.collector`` names (a fixed list, a ``dns:///`` name or a ``file://``
membership file), looked up again every ``agent.collector_resolve_seconds``, less the agent itself.

A lookup runs on a thread of its own and is waited for at most RESOLVE_TIMEOUT_SECONDS: one that hangs (a dead
DNS server, a hung network file system) must hold neither the membership's upkeep nor the agent's exit. A lookup
that fails, times out or names nobody leaves the last good membership standing; the failure is said once per
episode and counted.

The agent never forwards to itself: a member that is one of its own OTLP listen addresses is left out of the
membership (one WARNING while it is listed, counted), and every forwarded request carries the agent's random
instance id, so that one that comes back to its own receiver through a name or a proxy is refused there
(FAILED_PRECONDITION, marked); the forwarder then reports it looped, and the member is left out the same way
while it is listed (``note_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from spikehound.agent.membership_lookup import MembershipError, own_members, resolve
from spikehound.config import HostPort
from spikehound.endpoints import CollectorSource, Endpoint

log = logging.getLogger("spikehound.agent.membership")

EMPTY_RETRY_SECONDS = 2.0  # with no member at all (the first lookup failed), look again this often
RESOLVE_TIMEOUT_SECONDS = 10.0  # a DNS lookup or file read that takes longer counts as failed
MAX_HUNG_LOOKUPS = 4  # abandoned lookup threads still running; while this many hang, no other is started

Lookup = tuple[list[Endpoint], list[Endpoint]]  # (members named, those of them that are this agent itself)


class Membership:
    """The lookups of ``source``'s members and what they found of this agent; use from the event loop only.

    ``listens`` gives the agent's own OTLP listen addresses (never members).
    """

    def __init__(self, source: CollectorSource, *, resolve_seconds: float = 30.0,
                 listens: Callable[[], Sequence[HostPort]] = tuple,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.resolve_seconds = resolve_seconds
        self.listens = listens
        self._clock = clock
        self._failing = False  # in a failure episode: said when it starts and when it ends
        self._next = 0.0  # when the next lookup is due
        self._hung: list[threading.Thread] = []  # lookups abandoned past their deadline, maybe still running
        self._own: set[str] = set()  # members left out as this agent's own listen address, at the last lookup
        self._looped: set[str] = set()  # members left out because what was forwarded there came back
        self._answered = False  # a lookup has answered (a fixed list is looked at again until one has)
        self.resolve_failures = 0
        self.abandoned_lookups = 0
        self.self_members: Counter[str] = Counter()  # reason (address, loop) -> members left out as this agent

    def describe(self) -> str:
        s = self.source
        return {"dns": f"dns:///{s.host}:{s.port}", "file": f"file://{s.path}"}.get(s.kind, "the list")

    @property
    def own(self) -> bool:
        """The last lookup named this agent's own listen address."""
        return bool(self._own)

    def due(self) -> bool:
        """A lookup is due: the source can change (or has not answered yet) and its interval has passed."""
        return (self.source.kind != "static" or not self._answered) and self._clock() >= self._next

    def schedule(self, members: int) -> None:
        """Set when the next lookup is due: sooner while there is no member to forward to."""
        wait = self.resolve_seconds if members else min(self.resolve_seconds, EMPTY_RETRY_SECONDS)
        self._next = self._clock() + wait

    def failed(self, why: str, members: int) -> None:
        """A lookup failed (or named nobody): counted, said once per episode; ``members`` stay."""
        self.resolve_failures += 1
        if not self._failing:
            self._failing = True
            log.warning("collector membership: %s; keeping the last good one (%d members)", why, members)

    def answered(self) -> None:
        """A lookup gave a membership: a failure episode, if any, is over."""
        if self._failing:
            self._failing = False
            log.info("collector membership: %s answers again", self.describe())

    def named_only_self(self) -> None:
        """The lookup named this agent alone (said by ``leave_out_self``): a failed lookup; the last good
        membership stands."""
        self.resolve_failures += 1

    def note_loop(self, key: str) -> None:
        """``key`` turned out to be this agent (what was forwarded there came back): left out while listed."""
        self.self_members["loop"] += 1
        self._looped.add(key)

    def leave_out_self(self, lookup: Lookup) -> list[Endpoint]:
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

    async def lookup(self) -> Lookup:
        """``resolve`` on a daemon thread of its own, waited for at most RESOLVE_TIMEOUT_SECONDS; MembershipError
        when it fails or does not answer in time.

        One that does not answer in time is abandoned (counted): the next interval starts a fresh one. Abandoned
        threads that still hang are capped (MAX_HUNG_LOOKUPS): past that none is started until one of them ends,
        so a source that never answers cannot pile threads up."""
        self._hung = [thread for thread in self._hung if thread.is_alive()]
        if len(self._hung) >= MAX_HUNG_LOOKUPS:
            raise MembershipError(f"{len(self._hung)} lookups of {self.describe()} have not answered; no other "
                                  "is started until one of them does")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Lookup] = loop.create_future()
        source, listens = self.source, list(self.listens())

        def look() -> None:
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

        thread = threading.Thread(target=look, name="collector-membership", daemon=True)
        thread.start()
        try:
            found = await asyncio.wait_for(asyncio.shield(answer), RESOLVE_TIMEOUT_SECONDS)
        except TimeoutError:
            answer.cancel()  # a late answer is dropped
            self._hung.append(thread)
            self.abandoned_lookups += 1
            raise MembershipError(f"{self.describe()} gave no answer within {RESOLVE_TIMEOUT_SECONDS:g} s; "
                                  "the lookup is abandoned") from None
        self._answered = True
        return found


def _settle(future: asyncio.Future[Lookup], found: Lookup | None, exc: Exception | None) -> None:
    if future.done():  # abandoned past its deadline
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(found or ([], []))
