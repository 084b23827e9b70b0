"""Generic webhooks: Alertmanager's webhook payload (version 4), signed, with a ``spikehound`` section.

Receivers written for Alertmanager read it as they are (``version``,
``groupKey``, ``status``, ``receiver``, ``groupLabels``, ``commonLabels``,
``commonAnnotations``, ``externalURL``, ``alerts[]`` with ``labels``,
``annotations``, ``startsAt``, ``endsAt``, ``generatorURL`` and
``fingerprint``). The ``spikehound`` section holds each spike as the API
shows it, with its ranked causes, its page (``url``), its severity
(``ratio``, p99 over baseline) and its slowest trace (``trace_url``).

Every request carries:

* ``Idempotency-Key``: the same on every retry of one notification, different
  between notifications; a receiver that saw it already can answer 2xx and
  do nothing.
* ``X-Spikehound-Signature: t=<unix seconds>,v1=<hex>``, where ``hex`` is
  HMAC-SHA256 with the receiver's ``signing_secret`` over ``"<t>." + body``.
  A receiver recomputes it, compares in constant time and refuses a ``t``
  more than a few minutes old (a replayed request).

>>> header = sign(b"s3cret", b'{"a":1}', 1700000000)
>>> header
't=1700000000,v1=1698a50bc74d1ff1db85c4e0a5297c2ad9fdba245d5737cdb789e4cc6e098940'
>>> verify(b"s3cret", header, b'{"a":1}', now=1700000010)
True
>>> verify(b"s3cret", header, b'{"a":2}', now=1700000010), verify(b"s3cret", header, b'{"a":1}', now=1700009999)
(False, False)
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import orjson

from spikehound import __version__
from spikehound.collector.alerts.notification import AlertItem, Notification, ratio
from spikehound.model_json import spike_json
from spikehound.timefmt import rfc3339

SIGNATURE_HEADER = "X-Spikehound-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of a firing alert
DEFAULT_TOLERANCE_SECONDS = 300


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    digest = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: bytes, header: str, body: bytes, now: float,
           tolerance: float = DEFAULT_TOLERANCE_SECONDS) -> bool:
    """What a receiver does: the signature matches the body and its timestamp is recent."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance:
        return False
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def _common(maps: list[dict[str, str]]) -> dict[str, str]:
    if not maps:
        return {}
    first = maps[0]
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in maps[1:])}


def _alert(item: AlertItem) -> dict[str, Any]:
    return {"status": item.status, "labels": item.labels, "annotations": item.annotations,
            "startsAt": rfc3339(item.starts_at_ns),
            "endsAt": rfc3339(item.ends_at_ns) if item.ends_at_ns is not None else ZERO_TIME,
            "generatorURL": item.spike_url, "fingerprint": item.fingerprint}


def spike_document(item: AlertItem) -> dict[str, Any]:
    """The alert's spike as the API shows it, with links to its evidence and its severity."""
    return {**spike_json(item.spike), "url": item.spike_url, "ratio": round(ratio(item.spike), 3),
            "trace_url": item.trace_url}


def payload(note: Notification) -> dict[str, Any]:
    """The JSON document of ``note``."""
    return {
        "version": "4",
        "groupKey": note.group_key,
        "truncatedAlerts": 0,
        "status": note.status,
        "receiver": note.receiver,
        "groupLabels": note.group_labels,
        "commonLabels": _common([a.labels for a in note.alerts]),
        "commonAnnotations": _common([a.annotations for a in note.alerts]),
        "externalURL": note.external_url,
        "alerts": [_alert(a) for a in note.alerts],
        "spikehound": {"idempotency_key": note.idempotency_key, "route": note.route, "group_id": note.group_id,
                       "spikes": [spike_document(a) for a in note.alerts]},
    }


class WebhookNotifier:
    """Alertmanager-compatible JSON, signed with the receiver's ``signing_secret`` when it has one."""

    def __init__(self, signing_secret: str = "", bearer_token: str = "") -> None:
        self._secret = signing_secret.encode()
        self._token = bearer_token

    def render(self, note: Notification) -> bytes:
        return orjson.dumps(payload(note))

    def headers(self, body: bytes, idempotency_key: str, now: float) -> dict[str, str]:
        headers = {"Content-Type": "application/json", IDEMPOTENCY_HEADER: idempotency_key,
                   "User-Agent": f"spikehound/{__version__}"}
        if self._secret:
            headers[SIGNATURE_HEADER] = sign(self._secret, body, int(now))
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers
