"""Per-interface network counters and rates through psutil, and TCP retransmits from ``/proc/net/snmp``.

Per interface, with ``network.interface.name`` and ``network.io.direction`` (``transmit`` / ``receive``):

- cumulative COUNTERs as the OpenTelemetry semantic conventions define them: ``system.network.io`` (``By``),
  ``system.network.packets`` (``{packet}``), ``system.network.errors`` (``{error}``) and
  ``system.network.dropped`` (``{packet}``);
- per-second GAUGEs of the same over the interval since the previous sample, for detectors that want a rate
  without keeping state: ``system.network.io.rate`` (``By/s``), ``system.network.packets.rate``
  (``{packet}/s``), ``system.network.errors.rate`` (``{error}/s``) and ``system.network.dropped.rate``
  (``{packet}/s``). None on the first sample, on an interface's first appearance, or after its counters went
  backwards (interface re-created, counter wrapped).

``interfaces`` lists the interfaces to sample; empty means every interface except loopback (``lo``, ``lo0``...),
which is only sampled when listed. A listed interface that is absent is counted once in ``errors``
(``interface_missing``) each time it disappears.

Host-wide, from the ``Tcp:`` lines of ``snmp_path``: ``system.network.tcp.retransmits`` (``{segment}``, COUNTER,
``RetransSegs``) and ``system.network.tcp.retransmit.ratio`` (``1``): retransmitted / sent segments over the
interval, 0 when nothing was sent. Neither has a semconv name; both follow the ``system.network.*`` family. A
missing or unparsable file is counted once (``snmp``) and TCP sampling stops (there is no such file off Linux).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psutil

from spikehound.agent.sample import Kind, Sample

log = logging.getLogger(__name__)

SNMP_PATH = "/proc/net/snmp"
_LOOPBACK = re.compile(r"lo\d*")

# metric base name, unit, (psutil snetio field for transmit, field for receive)
NETWORK_METRICS: tuple[tuple[str, str, tuple[str, str]], ...] = (
    ("system.network.io", "By", ("bytes_sent", "bytes_recv")),
    ("system.network.packets", "{packet}", ("packets_sent", "packets_recv")),
    ("system.network.errors", "{error}", ("errout", "errin")),
    ("system.network.dropped", "{packet}", ("dropout", "dropin")),
)
_DIRECTIONS = ("transmit", "receive")


def parse_tcp(text: str) -> dict[str, int]:
    """The ``Tcp:`` fields of a /proc/net/snmp text, by name; ValueError where they are absent or malformed.

    >>> parse_tcp("Tcp: RetransSegs OutSegs\\nTcp: 3 100\\n")
    {'RetransSegs': 3, 'OutSegs': 100}
    """
    lines = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(lines) < 2 or len(lines[0]) != len(lines[1]):
        raise ValueError("no Tcp: header and values lines")
    return {name: int(value) for name, value in zip(lines[0], lines[1], strict=True)}


class NetworkSampler:
    """Samples per-interface byte, packet, error and drop counters and rates, and TCP retransmits."""

    name = "network"

    def __init__(self, interfaces: Sequence[str] = (), psutil_module: Any = None,
                 snmp_path: str = SNMP_PATH) -> None:
        self.interfaces = interfaces
        self.snmp_path = snmp_path
        self._wanted = frozenset(interfaces)
        self._ps: Any = psutil_module or psutil  # injected in tests
        self._started = False
        self._prev: dict[str, Any] = {}
        self._prev_at = 0.0
        self._prev_tcp: tuple[int, int] | None = None
        self._tcp_enabled = True
        self._missing: set[str] = set()
        self.errors: Counter[str] = Counter()
        self._warned: set[str] = set()

    def start(self) -> bool:
        """Begin sampling (psutil is a dependency: always possible)."""
        self._started = True
        return True

    def close(self) -> None:
        """Forget the previous readings; safe to call more than once."""
        self._started = False
        self._prev.clear()
        self._prev_tcp = None

    def _count_error(self, query: str, detail: str) -> None:
        self.errors[query] += 1
        level = logging.DEBUG if query in self._warned else logging.WARNING  # once per query, not every second
        self._warned.add(query)
        log.log(level, "network sampler: %s failed: %s", query, detail)

    def _selected(self, name: str) -> bool:
        return name in self._wanted if self._wanted else _LOOPBACK.fullmatch(name) is None

    def sample(self) -> list[Sample]:
        """One reading of every selected interface and of TCP; [] before start()."""
        if not self._started:
            return []
        out: list[Sample] = []
        self._sample_interfaces(out)
        self._sample_tcp(out)
        return out

    def _sample_interfaces(self, out: list[Sample]) -> None:
        try:
            counters: dict[str, Any] = self._ps.net_io_counters(pernic=True)
        except Exception as exc:  # one broken reading must not take the TCP metrics (or the agent) with it
            self._count_error("net_io_counters", f"{exc} ({type(exc).__name__})")
            return
        at = time.monotonic()
        elapsed = at - self._prev_at
        current: dict[str, Any] = {}
        for nic, io in counters.items():
            if not self._selected(nic):
                continue
            current[nic] = io
            before = self._prev.get(nic)
            for metric, unit, fields in NETWORK_METRICS:
                for direction, field in zip(_DIRECTIONS, fields, strict=True):
                    value = getattr(io, field)
                    attributes = {"network.interface.name": nic, "network.io.direction": direction}
                    out.append(Sample(metric, float(value), unit, attributes, Kind.COUNTER))
                    if before is not None and elapsed > 0 and value >= getattr(before, field):
                        rate = (value - getattr(before, field)) / elapsed
                        out.append(Sample(f"{metric}.rate", rate, f"{unit}/s", dict(attributes)))
        for nic in self._wanted - current.keys() - self._missing:
            self._count_error("interface_missing", f"interface {nic!r} not found")
        self._missing = set(self._wanted - current.keys())
        self._prev, self._prev_at = current, at

    def _sample_tcp(self, out: list[Sample]) -> None:
        if not self._tcp_enabled:
            return
        try:
            with open(self.snmp_path, encoding="ascii", errors="replace") as file:
                tcp = parse_tcp(file.read())
            retrans, sent = tcp["RetransSegs"], tcp["OutSegs"]
        except (OSError, ValueError, KeyError) as exc:
            # Counted once: the file is either there (Linux) or not, so retrying every second only adds noise.
            self._tcp_enabled = False
            self._count_error("snmp", f"{self.snmp_path}: {exc} ({type(exc).__name__}); TCP metrics disabled")
            return
        out.append(Sample("system.network.tcp.retransmits", float(retrans), "{segment}", {}, Kind.COUNTER))
        if self._prev_tcp is not None:
            d_retrans, d_sent = retrans - self._prev_tcp[0], sent - self._prev_tcp[1]
            if d_retrans >= 0 and d_sent >= 0:  # a reset (namespace re-created) yields no ratio this tick
                ratio = d_retrans / d_sent if d_sent > 0 else 0.0
                out.append(Sample("system.network.tcp.retransmit.ratio", ratio, "1", {}))
        self._prev_tcp = (retrans, sent)
