"""What taking in one OTLP export request comes to, for the agent's receivers and the collector's alike.

``Accepted``: the request was taken (queued to forward by the agent, committed by the collector), maybe with some
of its records refused, which the sender learns from ``partial_success``. ``QueueFull``: there is no room for it
now; the receivers answer RESOURCE_EXHAUSTED / 429 with a retry delay, so the sender keeps the data and retries
instead of anything being dropped.

>>> Accepted(2, "2 spans dropped", kept=8)
Accepted(rejected=2, message='2 spans dropped', kept=8)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Accepted:
    """An export request taken in: ``rejected`` records refused, ``message`` for the sender's ``partial_success``
    (a warning when nothing was rejected), ``kept`` records taken where the receiver counts them."""

    rejected: int = 0
    message: str = ""
    kept: int = 0


class QueueFull(Exception):
    """No room for this request right now; the sender should retry after a pause."""
