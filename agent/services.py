"""Which service a local process serves: pid -> ``service.name``, learnt from the spans the agent receives.

The profiler labels each process's stacks with the service whose spans that process exports, so the
collector can join profiles to spans. Two ways to learn it, both off the hot path:

* the resource of a request carries ``process.pid`` (SDKs with the process resource detector set it): read
  when the enricher first sees that resource (it caches resources, so once per sender);
* otherwise the connection it came by: the gRPC peer (``ipv4:127.0.0.1:54321``) or the HTTP peer address is
  the local end of the sender's TCP socket, so the process owning a socket bound to that address is the
  sender. The request's first ``service.name`` is noted on the first request of a connection; the socket
  table (``psutil.net_connections``, which walks every process's file descriptors) is read later, in a
  thread, before a profile window and at most every ``rescan_seconds``.

>>> services = ServiceMap()
>>> services.note_peer("ipv4:127.0.0.1:54321", "llm-server")
>>> services.pending
1
>>> services.learn(4242, "preprocess"); services.service_of(4242), services.service_of(7)
('preprocess', '')
>>> parse_peer("ipv6:%5B::1%5D:4317"), parse_peer(("127.0.0.1", 5000)), parse_peer("unix:/tmp/s")
(('::1', 4317), ('127.0.0.1', 5000), None)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any
from urllib.parse import unquote

import psutil
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

log = logging.getLogger("spikehound.agent.services")

Address = tuple[str, int]
RESCAN_SECONDS = 30.0  # socket-table reads at most this often while connections wait to be resolved
MAX_PEERS = 4096  # connections remembered; a host with more (short-lived senders) starts over
MAX_PIDS = 4096
RESOLVE_TRIES = 3  # socket-table reads a connection waits through before it is given up (closed, not ours)


def parse_peer(peer: Hashable) -> Address | None:
    """A gRPC peer string or an asyncio peername tuple as (ip, port); None for unix sockets and the unknown."""
    if isinstance(peer, tuple) and len(peer) >= 2 and isinstance(peer[0], str) and isinstance(peer[1], int):
        return _plain_ip(peer[0]), peer[1]
    if not isinstance(peer, str):
        return None
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = unquote(rest).rpartition(":")
    if not port.isdigit() or not host:
        return None
    return _plain_ip(host.strip("[]")), int(port)


def _plain_ip(ip: str) -> str:
    # An IPv4 sender on a dual-stack socket shows as ::ffff:a.b.c.d on one side and a.b.c.d on the other.
    return ip.removeprefix("::ffff:").split("%", 1)[0]


class ServiceMap:
    """pid -> service.name of local senders; use from the event loop (``refresh`` reads sockets in a thread)."""

    def __init__(self, psutil_module: Any = None, *, rescan_seconds: float = RESCAN_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ps: Any = psutil_module or psutil
        self.rescan_seconds = rescan_seconds
        self._clock = clock
        self._services: dict[int, str] = {}
        self._from_resource: set[int] = set()  # pids a resource named: what a connection says does not override
        self._peers: dict[Hashable, int] = {}  # every connection seen -> resolve tries left (0: done or given up)
        self._pending: dict[Address, tuple[Hashable, str]] = {}  # address -> (connection, its service.name)
        self._next_scan = 0.0
        self.scans = 0
        self.scan_errors = 0
        self._warned = False

    # -- learning (hot path: first sight only) ------------------------------------------------------------------

    def learn(self, pid: int, service: str, *, from_resource: bool = True) -> None:
        if not service or pid <= 0 or (not from_resource and pid in self._from_resource):
            return
        if len(self._services) >= MAX_PIDS and pid not in self._services:
            self._services.clear()
            self._from_resource.clear()
        self._services[pid] = service
        if from_resource:
            self._from_resource.add(pid)

    def learn_resource(self, resource: Resource) -> None:
        """A resource seen for the first time: its ``process.pid`` and ``service.name``, when it has both."""
        pid, service = 0, ""
        for kv in resource.attributes:
            if kv.key == "process.pid":
                pid = kv.value.int_value or (int(kv.value.string_value) if kv.value.string_value.isdigit() else 0)
            elif kv.key == "service.name":
                service = kv.value.string_value
        self.learn(pid, service)

    def knows_peer(self, peer: Hashable) -> bool:
        """Whether this connection was seen before: the one check made on every request."""
        return peer in self._peers

    def note_peer(self, peer: Hashable, service: str) -> None:
        """The first request of a connection, from ``service``: resolve its process at the next refresh."""
        if len(self._peers) >= MAX_PEERS:
            self._peers.clear()
            self._pending.clear()
        address = parse_peer(peer)
        if address is None or not service or service == "unknown":
            self._peers[peer] = 0
            return
        self._peers[peer] = RESOLVE_TRIES
        self._pending[address] = (peer, service)

    # -- reading --------------------------------------------------------------------------------------------------

    def service_of(self, pid: int) -> str:
        return self._services.get(pid, "")

    @property
    def pending(self) -> int:
        """Connections waiting for their process to be found."""
        return len(self._pending)

    async def refresh(self, *, force: bool = False) -> None:
        """Find the processes of connections seen since the last time (a socket-table read in a thread)."""
        now = self._clock()
        if not self._pending or (not force and now < self._next_scan):
            return
        self._next_scan = now + self.rescan_seconds
        wanted = set(self._pending)
        owners = await asyncio.to_thread(self._owners, wanted)
        self.scans += 1
        for address in wanted:
            entry = self._pending.get(address)
            if entry is None:
                continue
            peer, service = entry
            pid = owners.get(address)
            if pid is not None:
                self.learn(pid, service, from_resource=False)
                log.debug("connection %s is pid %d, service %r", peer, pid, service)
            elif self._peers.get(peer, 0) > 1:
                self._peers[peer] -= 1
                continue
            self._peers[peer] = 0
            del self._pending[address]

    def _owners(self, wanted: set[Address]) -> dict[Address, int]:
        """The pids owning TCP sockets bound to the ``wanted`` local addresses (runs in a thread)."""
        try:
            connections = self._ps.net_connections(kind="tcp")
        except Exception as exc:  # AccessDenied off Linux, a /proc race: try again at the next rescan
            self.scan_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("cannot read the host's TCP sockets to tell which process sends which spans (%s); "
                            "profiles carry service.name only for senders that set process.pid", exc)
            return {}
        owners: dict[Address, int] = {}
        for conn in connections:
            if conn.pid and conn.laddr:
                address = (_plain_ip(conn.laddr[0]), conn.laddr[1])
                if address in wanted:
                    owners[address] = conn.pid
        return owners
