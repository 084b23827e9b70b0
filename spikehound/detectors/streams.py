"""Latency streams: what is judged, and how a stream is named.

Two kinds of stream are judged, each keyed by a :class:`StreamKey`:

- an **entry stream** is one (service, operation) of entry spans, trace roots
  and SERVER spans: the latency a service answers with;
- a **hop stream** is one caller -> callee edge measured on the caller's CLIENT
  span: the latency the caller sees, network, queues and the callee included.
  A delay in front of a service grows only its callers' CLIENT spans, so it
  shows here even where no entry stream moves. It is keyed like a ``network``
  cause: ``service`` and ``operation`` name the callee (its SERVER span, when
  the callee is instrumented; else what the CLIENT span says it called) and
  ``peer_service`` the caller.

An entry operation with a **generic name** (``/*``, ``GET``, ``HTTP GET``)
says nothing about the request: one gateway operation then carries every
route, and one slow route is averaged into all of them. Such a stream is split
by route (``http.route`` or ``url.template`` when the span has one), else by
where the request goes (the operations its own calls reach).

>>> StreamKey("ts-order-service", "GET /api/v1/orders", "ts-preserve-service").label
'ts-preserve-service -> ts-order-service GET /api/v1/orders'
>>> [is_generic_operation(n) for n in ("HTTP GET", "GET", "/*", "GET /**", "POST /v1/predict", "resize")]
[True, True, True, True, False, False]
>>> split_operation("HTTP GET", route="/api/v1/orders/{id}")
'HTTP GET /api/v1/orders/{id}'
>>> split_operation("/*", callees=["ts-order-service GET /orders", "ts-auth-service POST /verify"])
'/* -> ts-auth-service POST /verify, ts-order-service GET /orders'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["ROUTE_ATTRIBUTES", "UNINSTRUMENTED", "StreamKey", "is_generic_operation", "peer_label", "route_attribute",
           "split_operation"]

HTTP_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT", "_OTHER"})
# Where the route of a request is written (current and older semantic conventions).
ROUTE_ATTRIBUTES = ("http.route", "url.template")
# What a CLIENT span says it called, best first: the callee's service name, then its address.
PLACE_ATTRIBUTES = ("peer.service", "server.address", "net.peer.name")
PEER_ATTRIBUTES = (*PLACE_ATTRIBUTES, "db.system", "rpc.service", "messaging.system")
UNINSTRUMENTED = "(uninstrumented)"
MAX_CALLEES_IN_NAME = 4
MAX_SPLIT_NAME = 400
MAX_PEER_LABEL = 255


class StreamKey(NamedTuple):
    """One judged stream; ``peer_service`` is None for an entry stream and the caller for a hop stream."""

    service: str
    operation: str
    peer_service: str | None = None

    @property
    def is_hop(self) -> bool:
        return self.peer_service is not None

    @property
    def order(self) -> tuple[str, str, str]:
        """A sort key: entry streams before the hops into the same operation."""
        return (self.service, self.operation, self.peer_service or "")

    @property
    def label(self) -> str:
        """How people read it: ``service operation``, or ``caller -> callee operation`` for a hop."""
        if self.peer_service is None:
            return f"{self.service} {self.operation}"
        return f"{self.peer_service} -> {self.service} {self.operation}"


def is_generic_operation(name: str) -> bool:
    """True for names that say nothing about the request: an HTTP method alone, or a catch-all path."""
    rest = name.strip()
    if rest[:5].upper() == "HTTP ":
        rest = rest[5:].strip()
    head, _, tail = rest.partition(" ")
    if head.upper() in HTTP_METHODS:
        rest = tail.strip()
    return not rest.strip("/*")


def route_attribute(attributes: Mapping[str, Any]) -> str | None:
    """The request's route template from ``attributes``, unless it is itself a catch-all."""
    for key in ROUTE_ATTRIBUTES:
        value = attributes.get(key)
        if isinstance(value, str) and value.strip("/* "):
            return value
    return None


def peer_label(attributes: Mapping[str, Any]) -> tuple[str, bool]:
    """What a CLIENT span with no instrumented callee says it called, and whether that names a place.

    ``peer.service``, ``server.address`` and ``net.peer.name`` name one place (a host, a service); a
    ``db.system`` such as ``mysql`` only names a kind of thing, which many unrelated places share.
    """
    for key in PEER_ATTRIBUTES:
        value = attributes.get(key)
        if isinstance(value, str) and value:
            # It names a stream's service: no longer than a service name may be.
            return value[:MAX_PEER_LABEL], key in PLACE_ATTRIBUTES
    return UNINSTRUMENTED, False


def split_operation(name: str, route: str | None = None, callees: Iterable[str] = ()) -> str:
    """The operation of one part of a generic entry stream: by route, else by the operations its calls reach."""
    if route is not None:
        return f"{name} {route}"[:MAX_SPLIT_NAME]
    reached = sorted(set(callees))
    if not reached:
        return name
    shown = ", ".join(reached[:MAX_CALLEES_IN_NAME])
    more = f" (+{len(reached) - MAX_CALLEES_IN_NAME})" if len(reached) > MAX_CALLEES_IN_NAME else ""
    return f"{name} -> {shown}{more}"[:MAX_SPLIT_NAME]
