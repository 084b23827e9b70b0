"""Which service a local process serves: pid -> ``service.name``, learnt from the spans the agent receives.

The profiler labels each process's stacks with the service whose spans that process exports, so the
collector can join profiles to spans. Learnt off the hot path, from the first request of each connection:
the gRPC peer (``ipv4:127.0.0.1:54321``) or the HTTP peer address is the local end of the sender's TCP
socket, so the process owning a socket bound to that address is the sender. The request's first
``service.name`` (and its ``process.pid``, if the resource has one) is noted on the first request of a
connection; the socket table (``psutil.net_connections``, which walks every process's file descriptors) is
read later, in a thread, before a profile window and at most every ``rescan_seconds``.

Whom to believe. A resource's ``process.pid`` is what the sender claims (and inside a container it is the
pid in the container's namespace, another process on the host); the socket table is what the kernel says.
So:

* the socket table wins: when it names the process owning the connection, that pid gets the connection's
  service, and no resource's claim ever overrides it (nor is a pid the kernel mapped given to a claimant);
* a connection the socket table names as one pid while its resource claims another: the claim is refuted,
  and that claimed pid is given no service by any later claim either;
* a claimed pid is used only where the socket table cannot say: it could not be read (no permission), or the
  connection is no TCP address (a unix socket); and only a pid in range that exists on the host. A TCP
  connection the table was read for and did not show (closed before the read, or from another host) leaves
  its claim unused;
* ``process.pid`` is read as an int attribute or a string of ASCII digits, 1..``kernel.pid_max``; anything
  else is no claim. Nothing here raises into the span path: a failure is counted (``errors``) and logged once.

No socket-table read is added for claims: one ``pid_exists`` (a signal-0 ``kill``) per connection's claim.

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
from pathlib import Path
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


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text().strip())
    except (OSError, ValueError):
        return 1 << 22  # the largest pid_max Linux allows


PID_MAX = _pid_max()


def claimed_pid(resource: Resource) -> int:
    """The resource's ``process.pid``: an int attribute, or a string of ASCII digits, in 1..PID_MAX; else 0.

    >>> r = Resource(); r.attributes.add(key="process.pid").value.string_value = "\\u00b2"; claimed_pid(r)
    0
    >>> r.attributes[0].value.string_value = "4242"; claimed_pid(r)
    4242
    """
    for kv in resource.attributes:
        if kv.key != "process.pid":
            continue
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "int_value":
            pid = value.int_value
        elif kind == "string_value" and value.string_value.isascii() and value.string_value.isdigit() \
                and len(value.string_value) <= 10:
            pid = int(value.string_value)
        else:
            return 0
        return pid if 0 < pid <= PID_MAX else 0
    return 0


def resource_service(resource: Resource) -> str:
    """The resource's ``service.name``; "" without one."""
    for kv in resource.attributes:
        if kv.key == "service.name":
            return kv.value.string_value
    return ""


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
        self._services: dict[int, str] = {}  # what the socket table said: never overridden by a claim
        self._claims: dict[int, str] = {}  # what resources claimed, where the socket table could not say
        self._refuted: set[int] = set()  # pids claimed by a connection the socket table named as another pid
        self._peers: dict[Hashable, int] = {}  # every connection seen -> resolve tries left (0: done or given up)
        # address -> (connection, its service.name, the pid its resource claims or 0, whether a read of the
        # socket table succeeded while it waited)
        self._pending: dict[Address, tuple[Hashable, str, int, bool]] = {}
        self._next_scan = 0.0
        self.scans = 0
        self.scan_errors = 0
        self.errors = 0  # failures while learning (a bug): counted and logged once, never raised to the spans
        self.refuted_claims = 0  # resources whose process.pid the socket table contradicted
        self._warned = False
        self._warned_error = False

    # -- learning (hot path: first sight only) ------------------------------------------------------------------

    def learn(self, pid: int, service: str, *, from_resource: bool = False) -> None:
        """``pid`` serves ``service``: as the socket table says, or (``from_resource``) as a resource claims."""
        if not service or not 0 < pid <= PID_MAX:
            return
        if from_resource:
            if pid in self._services or pid in self._refuted:  # the kernel's word stands
                return
            table = self._claims
        else:
            table = self._services
            self._claims.pop(pid, None)
        if len(table) >= MAX_PIDS and pid not in table:
            table.clear()
            if from_resource:
                self._refuted.clear()
        table[pid] = service

    def _claim(self, pid: int, service: str) -> None:
        """A resource's claim, where the socket table cannot say: used if ``pid`` is a process on this host."""
        if pid and service and service != "unknown" and self._ps.pid_exists(pid):
            self.learn(pid, service, from_resource=True)

    def _refute(self, pid: int) -> None:
        self.refuted_claims += 1
        if len(self._refuted) >= MAX_PIDS:
            self._refuted.clear()
        self._refuted.add(pid)
        self._claims.pop(pid, None)

    def failed(self, what: str, exc: BaseException) -> None:
        """A bug while learning: counted, logged once (with its traceback), and the spans go on."""
        self.errors += 1
        if not self._warned_error:
            self._warned_error = True
            log.warning("learning which process sends which service failed (%s); the spans are taken all the same",
                        what, exc_info=exc)

    def knows_peer(self, peer: Hashable) -> bool:
        """Whether this connection was seen before: the one check made on every request."""
        return peer in self._peers

    def note_peer(self, peer: Hashable, service: str, claimed: int = 0) -> None:
        """The first request of a connection, from ``service`` (whose resource claims pid ``claimed``, or 0):
        resolve its process at the next refresh. Never raises."""
        try:
            if len(self._peers) >= MAX_PEERS:
                self._peers.clear()
                self._pending.clear()
            address = parse_peer(peer)
            if not service or service == "unknown":
                self._peers[peer] = 0
                return
            if address is None:  # no TCP address (a unix socket): the socket table cannot say; the claim may
                self._peers[peer] = 0
                self._claim(claimed, service)
                return
            self._peers[peer] = RESOLVE_TRIES
            self._pending[address] = (peer, service, claimed, False)
        except Exception as exc:
            self.failed("a connection", exc)

    # -- reading --------------------------------------------------------------------------------------------------

    def service_of(self, pid: int) -> str:
        return self._services.get(pid) or self._claims.get(pid, "")

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
        owners: dict[Address, int] | None
        try:
            owners = await asyncio.to_thread(self._owners, wanted)
        except Exception as exc:  # a bug reading it, not a table that cannot be read: claims stay unused
            self.failed("the socket table", exc)
            owners = {}
        self.scans += 1
        try:
            self._resolve(wanted, owners)
        except Exception as exc:
            self.failed("the socket table", exc)

    def _resolve(self, wanted: set[Address], owners: dict[Address, int] | None) -> None:
        for address in wanted:
            entry = self._pending.get(address)
            if entry is None:
                continue
            peer, service, claimed, table_read = entry
            pid = owners.get(address) if owners is not None else None
            if pid is not None:
                self.learn(pid, service)
                if claimed and claimed != pid:
                    self._refute(claimed)
                    log.debug("connection %s is pid %d, its resource claims pid %d: not believed", peer, pid,
                              claimed)
                log.debug("connection %s is pid %d, service %r", peer, pid, service)
            else:
                table_read = table_read or owners is not None
                if self._peers.get(peer, 0) > 1:
                    self._peers[peer] -= 1
                    self._pending[address] = (peer, service, claimed, table_read)
                    continue
                if not table_read:  # the socket table could never be read: the claim is all there is
                    self._claim(claimed, service)
            self._peers[peer] = 0
            del self._pending[address]

    def _owners(self, wanted: set[Address]) -> dict[Address, int] | None:
        """The pids owning TCP sockets bound to the ``wanted`` local addresses (runs in a thread); None when the
        socket table cannot be read."""
        try:
            connections = self._ps.net_connections(kind="tcp")
        except Exception as exc:  # AccessDenied off Linux, a /proc race: try again at the next rescan
            self.scan_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("cannot read the host's TCP sockets to tell which process sends which spans (%s); "
                            "profiles carry service.name only for senders that set process.pid", exc)
            return None
        owners: dict[Address, int] = {}
        for conn in connections:
            if conn.pid and conn.laddr:
                address = (_plain_ip(conn.laddr[0]), conn.laddr[1])
                if address in wanted:
                    owners[address] = conn.pid
        return owners
