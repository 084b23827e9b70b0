"""This collector as a member of a cluster: the numbers of its feed rows and its heartbeats.

Every commit of the member's pipeline that holds data is stamped with the member's next feed number
(``stamp``), on the writer thread, and the number is taken once the commit succeeded (``committed``). A
commit that failed may still have committed (its answer was lost with the connection): the next stamp asks
the database again (``forget``), so a number is never used twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
import socket
from collections.abc import Callable

from sqlalchemy import Engine

from spikehound.collector.storage_health import StorageHealth
from spikehound.config import ClusterConfig, ConfigError
from spikehound.storage import cluster
from spikehound.storage.cluster import FeedStamp

log = logging.getLogger("spikehound.collector.cluster")


def default_member_name(grpc_port: int) -> str:
    """The host name and the OTLP/gRPC port: unique per collector on a host, stable across restarts (a port
    the OS chooses, 0, gives the process id instead).

    >>> default_member_name(4317).endswith(":4317")
    True
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "collector"
    suffix = f":{grpc_port}" if grpc_port else f":pid{os.getpid()}"
    if len(host) + len(suffix) > 64:  # cut, with a hash of the whole name: hosts alike in front stay apart
        digest = hashlib.blake2b(host.encode(), digest_size=4).hexdigest()
        host = f"{host[:64 - len(suffix) - 9]}-{digest}"
    return host + suffix


class ClusterMember:
    """A component: heartbeats from ``start`` to ``stop``; ``stamp``/``committed``/``forget`` on the writer
    thread."""

    name = "cluster membership"

    def __init__(self, cfg: ClusterConfig, engine: Engine, member: str, api_url: Callable[[], str],
                 health: StorageHealth) -> None:
        self.cfg = cfg
        self.engine = engine
        self.member = member
        self.api_url = api_url
        self.health = health
        self._seq: int | None = None  # the last feed number committed; None: ask the database
        self.instance = secrets.token_hex(8)  # this process, among any that are given the same name
        self._displaced = False  # another process has taken the name (said once)
        self._task: asyncio.Task[None] | None = None

    def stamp(self) -> FeedStamp:
        if self._seq is None:
            self._seq = cluster.last_seq(self.engine, self.member)
        return FeedStamp(self.member, self._seq + 1)

    def committed(self, stamp: FeedStamp) -> None:
        self._seq = stamp.seq

    def forget(self) -> None:
        self._seq = None

    def probe(self) -> None:
        """A small real write (during a storage outage with no sender's data): the heartbeat."""
        if cluster.heartbeat(self.engine, self.member, self.instance, self._seq or 0):
            self._displaced = False
        elif not self._displaced:
            self._displaced = True
            log.error("another collector has started as member %s: this one's heartbeats no longer count, and both "
                      "number their commits over each other; stop one, or give each its own cluster.member",
                      self.member)

    async def start(self) -> None:
        """Join as ``member``; ConfigError (exit status 2) when another live collector runs under that name."""
        try:
            await asyncio.to_thread(cluster.join, self.engine, self.member, self.instance, self.api_url(),
                                    heartbeat_s=self.cfg.heartbeat_seconds, timeout_s=self.cfg.member_timeout_seconds)
        except cluster.MemberNameInUse as exc:
            raise ConfigError(f"cluster.member: {exc}") from None
        log.info("member %s of the cluster on this database", self.member)
        self._task = asyncio.create_task(self._beat(), name="cluster-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_seconds)
            try:
                await asyncio.to_thread(self.probe)
            except Exception as exc:  # the leader counts this member gone meanwhile; never die of it
                self.health.note("cluster heartbeat", exc)
