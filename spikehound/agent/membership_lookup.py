"""Who the collectors are, looked up once: the members a source names (a fixed list, a ``dns:///`` name, a
``file://`` membership file), and which of them are this agent itself.

Everything here blocks (DNS, file reads): ``spikehound.agent.membership`` calls it on a thread of its own.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import stat
from collections.abc import Sequence

import psutil

from spikehound.config import HostPort
from spikehound.endpoints import CollectorSource, Endpoint, parse_endpoint_lines


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


# --- which members are this agent itself ----------------------------------------------------------------------


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
