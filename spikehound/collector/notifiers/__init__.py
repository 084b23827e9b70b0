"""Notifiers: one file per kind of receiver; each renders a notification into the bytes it POSTs.

A notifier renders once, when the notification is queued in the outbox, so
every retry sends the same body; the headers (a fresh signature timestamp) are
made per attempt.
"""

from __future__ import annotations

from typing import Protocol

from spikehound.collector.alerts.notification import Notification
from spikehound.collector.notifiers.slack import SlackNotifier
from spikehound.collector.notifiers.webhook import WebhookNotifier
from spikehound.config import ReceiverConfig

__all__ = ["Notifier", "notifier_for"]


class Notifier(Protocol):
    def render(self, note: Notification) -> bytes:
        """The request body for ``note``."""
        ...

    def headers(self, body: bytes, idempotency_key: str, now: float) -> dict[str, str]:
        """The request headers of one delivery attempt."""
        ...


def notifier_for(receiver: ReceiverConfig) -> Notifier:
    """The notifier of ``receiver``'s type.

    >>> notifier_for(ReceiverConfig(name="x", type="slack", url_secret="https://hooks.example/1")).__class__.__name__
    'SlackNotifier'
    """
    if receiver.type == "slack":
        return SlackNotifier()
    return WebhookNotifier(receiver.signing_secret, receiver.bearer_token)
