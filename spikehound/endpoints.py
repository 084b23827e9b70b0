"""The agent's ``agent.collector``: one collector endpoint, a list of them, a DNS name or a file of them.

Pure parsing, shared by the configuration check and the agent (which resolves and watches the dynamic forms).
An endpoint's ``key`` is its normalized form (``host:port``, ``https://host:port`` for TLS): the name a
collector goes by in routing, metrics and spool directories.

>>> parse_collectors("http://a.example:4317, https://B.example:4317/").endpoints
(Endpoint(host='a.example', port=4317, tls=False), Endpoint(host='b.example', port=4317, tls=True))
>>> [e.key for e in parse_collectors("[::1]:4317,10.0.0.5:4317").endpoints]
['[::1]:4317', '10.0.0.5:4317']
>>> source = parse_collectors("dns:///collectors.internal:4317"); (source.kind, source.host, source.port)
('dns', 'collectors.internal', 4317)
>>> parse_collectors("file:///etc/spikehound/collectors").path
'/etc/spikehound/collectors'
>>> parse_collectors("a:4317,dns:///b:4317")
Traceback (most recent call last):
...
ValueError: dns:/// stands alone, not in a list
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# A host name of labels of letters, digits, ``-`` and ``_`` (container names), neither starting nor ending with
# ``-`` or ``_``, at most 63 each and 253 in all (a final dot allowed); or an IPv6 address in brackets.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"(?=.{{1,254}}$)(?:{_LABEL}\.)*{_LABEL}\.?|\[[0-9A-Fa-f:.]+\]")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One collector's OTLP/gRPC address; ``tls`` for https://."""

    host: str  # lower case; an IPv6 address without brackets
    port: int
    tls: bool = False

    @property
    def key(self) -> str:
        """``host:port`` (``[v6]:port``), with ``https://`` in front for TLS."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https://' if self.tls else ''}{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class CollectorSource:
    """Where the members come from: a fixed list, a DNS name's A/AAAA records, or a file of endpoints."""

    kind: Literal["static", "dns", "file"]
    endpoints: tuple[Endpoint, ...] = ()  # static
    host: str = ""  # dns: the name
    port: int = 0  # dns: the port every address listens on
    path: str = ""  # file

    @property
    def single(self) -> bool:
        """One fixed endpoint: the agent forwards everything to it, without routing."""
        return self.kind == "static" and len(self.endpoints) == 1


def parse_endpoint(text: str) -> Endpoint:
    """``host:port``, ``http://host:port`` or ``https://host:port`` (a trailing ``/`` is allowed)."""
    raw = text.strip()
    tls = raw.startswith("https://")
    rest = raw.removeprefix("https://").removeprefix("http://").rstrip("/")
    if "://" in rest or "/" in rest:
        raise ValueError(f"expected host:port, http://host:port or https://host:port, got {text.strip()!r}")
    host, port = _host_port(rest, text)
    return Endpoint(host, port, tls)


def _host_port(rest: str, text: str) -> tuple[str, int]:
    host, sep, port = rest.rpartition(":")
    # isdigit alone takes other scripts' digits (and superscripts), which int() reads or chokes on.
    if not sep or not (port.isascii() and port.isdigit()) or not _HOST.fullmatch(host):
        raise ValueError(f"expected host:port, http://host:port or https://host:port, got {text.strip()!r}")
    if not 0 < int(port) <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535 in {text.strip()!r}")
    return host.strip("[]").lower(), int(port)


def parse_collectors(text: str) -> CollectorSource:
    """``agent.collector`` as a CollectorSource; ValueError saying what is wrong."""
    raw = text.strip()
    if raw.startswith("dns://"):
        if not raw.startswith("dns:///"):
            raise ValueError(f"expected dns:///name:port (no DNS server in the URL), got {raw!r}")
        if "," in raw:
            raise ValueError("dns:/// stands alone, not in a list")
        host, port = _host_port(raw[len("dns:///"):].rstrip("/"), raw)
        return CollectorSource("dns", host=host, port=port)
    if raw.startswith("file://"):
        path = raw[len("file://"):]
        if "," in raw:
            raise ValueError("file:/// stands alone, not in a list")
        if not path.startswith("/") or path == "/":
            raise ValueError(f"expected file:///absolute/path, got {raw!r}")
        return CollectorSource("file", path=path)
    items = [item for item in raw.split(",") if item.strip()]
    if not items:
        raise ValueError("no collector endpoint given")
    for item in items:
        if item.strip().startswith(("dns:", "file:")):
            raise ValueError(f"{item.strip().split(':')[0]}:/// stands alone, not in a list")
    endpoints = tuple(dict.fromkeys(parse_endpoint(item) for item in items))  # a repeated one is one member
    return CollectorSource("static", endpoints=endpoints)


def parse_endpoint_lines(text: str) -> list[Endpoint]:
    """A membership file: one endpoint a line, ``#`` starts a comment; ValueError naming the line.

    >>> [e.key for e in parse_endpoint_lines("# the cluster\\na:4317\\n\\nhttps://b:4317  # TLS\\n")]
    ['a:4317', 'https://b:4317']
    """
    found: dict[Endpoint, None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            found[parse_endpoint(entry)] = None
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return list(found)
