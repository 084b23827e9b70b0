"""Which collector owns a trace: rendezvous (highest random weight) hashing, a sticky map, and the membership.

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

import errno
import hashlib
import ipaddress
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable, Sequence

import psutil

from spikehound.config import HostPort
from spikehound.endpoints import CollectorSource, Endpoint, parse_endpoint_lines

log = logging.getLogger("spikehound.agent.routing")

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

    def reassign(self, old: str, new_owner: Callable[[bytes], str]) -> int:
        """Point the traces of member ``old`` at ``new_owner(trace id)``; how many moved."""
        moved = 0
        for generation in (self._current, self._previous):
            for trace_id, member in generation.items():
                if member == old:
                    generation[trace_id] = new_owner(trace_id)
                    moved += 1
        return moved


# --- membership ----------------------------------------------------------------------------------


class MembershipError(Exception):
    """The DNS answer or the file could not be had or read; the last good membership stands."""


MAX_MEMBERSHIP_FILE_BYTES = 1 << 20
MAX_MEMBERS = 256  # a file or DNS answer naming more is refused: each member costs a channel, a queue, a spool
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def resolve(source: CollectorSource) -> list[Endpoint]:
    """The members ``source`` names now (blocking: DNS and file reads; call it in a thread).

    Raises MembershipError when the name does not resolve, the file cannot be read or parsed, or either names
    more than MAX_MEMBERS collectors. An empty answer is returned as it is: the caller keeps the last membership.
    """
    if source.kind == "static":
        return list(source.endpoints)
    if source.kind == "dns":
        name = f"dns:///{source.host}:{source.port}"
        try:
            answers = socket.getaddrinfo(source.host, source.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise MembershipError(f"{name} does not resolve: {exc}") from None
        # One address family: a collector listens on 0.0.0.0 (IPv4) by default, and a dual-stack name would
        # otherwise make each collector two members, one of them nobody listens on. IPv4 when there is any.
        v4 = {str(a[4][0]) for a in answers if a[0] == socket.AF_INET}
        addresses = v4 or {str(a[4][0]) for a in answers}
        return _bounded(name, [Endpoint(address.lower(), source.port) for address in sorted(addresses)])
    text = read_membership_file(source.path)
    try:
        return _bounded(source.path, parse_endpoint_lines(text))
    except ValueError as exc:
        raise MembershipError(f"{source.path} {exc}") from None


def _bounded(name: str, endpoints: list[Endpoint]) -> list[Endpoint]:
    if len(endpoints) > MAX_MEMBERS:
        raise MembershipError(f"{name} names {len(endpoints)} collectors; at most {MAX_MEMBERS} are taken")
    return endpoints


def read_membership_file(path: str) -> str:
    """The text of the membership file ``path``: opened once, and only if it is a regular file of at most
    MAX_MEMBERSHIP_FILE_BYTES; MembershipError otherwise.

    What is checked is what is read: the descriptor is opened without following a link and without blocking (a
    FIFO would block ``open`` for ever), then looked at with ``fstat``, and the read stops one byte past the
    limit whatever the file does meanwhile. A path checked and then opened again could be swapped in between
    for a link to ``/dev/zero`` or a FIFO.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MembershipError(f"{path} is a symbolic link, which is not followed: name the file itself") from None
        raise MembershipError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MembershipError(f"{path} is not a regular file")
        if info.st_size > MAX_MEMBERSHIP_FILE_BYTES:
            raise MembershipError(f"{path} is larger than {MAX_MEMBERSHIP_FILE_BYTES} bytes")
        chunks: list[bytes] = []
        left = MAX_MEMBERSHIP_FILE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:  # it grew past the limit after fstat
            raise MembershipError(f"{path} is larger than {MAX_MEMBERSHIP_FILE_BYTES} bytes")
        return b"".join(chunks).decode()
    except OSError as exc:
        raise MembershipError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MembershipError(f"{path} is not UTF-8 text") from None
    finally:
        os.close(fd)


# --- the agent itself as a member ----------------------------------------------------------------------


def own_members(endpoints: Sequence[Endpoint], listens: Sequence[HostPort], look_up: bool = True) -> list[Endpoint]:
    """Those of ``endpoints`` that are this agent itself: one of its ``listens`` addresses (blocking when
    ``look_up``: a member named by host name is looked up; call it in a thread).

    A listen address on ``0.0.0.0`` or ``::`` is every address of this host; ``localhost`` and the loopback
    networks are this host too. A name that does not resolve, or any name but localhost when not ``look_up``,
    is no address of ours (a loop through it is caught by the instance id on what the agent forwards).

    >>> own_members([Endpoint("localhost", 4317), Endpoint("127.0.0.1", 4318), Endpoint("10.9.9.9", 4317)],
    ...             [HostPort("127.0.0.1", 4317)], look_up=False)
    [Endpoint(host='localhost', port=4317, tls=False)]
    """
    ports = {listen.port for listen in listens if listen.port}
    candidates = [e for e in endpoints if e.port in ports]
    if not candidates:
        return []
    local = local_addresses()
    own = []
    for endpoint in candidates:
        addresses = _addresses(endpoint.host, endpoint.port, look_up)
        for listen in listens:
            if listen.port != endpoint.port:
                continue
            bound = _addresses(listen.host, listen.port, True) if listen.host else set()
            wildcard = not bound or any(a.is_unspecified for a in bound)
            if any(_is_local(a, local) if wildcard else _same(a, bound) for a in addresses):
                own.append(endpoint)
                break
    return own


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def local_addresses() -> set[Address]:
    """Every address of this host's interfaces (psutil), loopback included."""
    found: set[Address] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                address = _address(entry.address)
                if address is not None:
                    found.add(address)
    return found


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


_LOCALHOST = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _addresses(host: str, port: int, look_up: bool) -> set[Address]:
    """``host`` as addresses: itself when it is one, loopback for localhost, else what it resolves to when
    ``look_up`` (nothing when it does not)."""
    literal = _address(host)
    if literal is not None:
        return {literal}
    if host.lower() in _LOCALHOST:
        return {ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")}
    if not look_up:
        return set()
    try:
        answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {a for a in (_address(str(answer[4][0])) for answer in answers) if a is not None}


def _is_local(address: Address, local: set[Address]) -> bool:
    # A connection to 0.0.0.0 or :: reaches this host too.
    return address.is_loopback or address.is_unspecified or address in local


def _same(address: Address, bound: set[Address]) -> bool:
    """A connection to ``address`` reaches a socket bound to one of ``bound``."""
    if address.is_unspecified:  # connecting to 0.0.0.0 reaches the loopback address
        return any(b.is_loopback for b in bound)
    return address in bound


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


SAFE_NAME_READABLE = 200  # characters of a key kept in its directory name (all ASCII: one byte each)
