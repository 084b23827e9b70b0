"""What one alert notification says, before a notifier renders it for Slack or a webhook.

A spike becomes an *alert* identified by its labels (service, operation, top
cause), so that a spike which ends and comes back on the same stream for the
same reason is the same alert, not a new one. Alerts are grouped by (route,
service, top cause), and one notification covers one group.

>>> from spikehound.model import Cause, CauseKind, Spike
>>> spike = Spike(id="ab12", service="gateway", operation="POST /v1/predict", state="open", start_unix_nano=0,
...               end_unix_nano=None, p99_ns=300_000_000, baseline_p99_ns=100_000_000, causes=(
...     Cause(kind=CauseKind.SPAN, score=0.9, summary="slow query", service="preprocess",
...           operation="SELECT features", host="gpu-1"),))
>>> cause_label(spike)
'span preprocess: SELECT features'
>>> fingerprint(alert_labels(spike))
'b949e4c45482a96b'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from spikehound.model import AffectedStream, CauseKind, Spike
from spikehound.text import recurrence

ALERT_NAME = "P99LatencySpike"
NO_CAUSE = "no cause found yet"


def milliseconds(ns: int) -> float:
    """A duration as alerts state it, like the API: nanoseconds / 10**6."""
    return ns / 1e6


def ratio(spike: Spike) -> float:
    """How many times its baseline the spike's p99 is (the severity routes filter on)."""
    # Divided in milliseconds, the unit the API states both in, so that a receiver dividing them gets this number.
    baseline = milliseconds(spike.baseline_p99_ns)
    return milliseconds(spike.p99_ns) / baseline if baseline > 0 else float("inf")


def cause_label(spike: Spike) -> str:
    """The top cause in a few words; with the service it names the alert's group."""
    if not spike.causes:
        return NO_CAUSE
    c = spike.causes[0]
    if c.kind == CauseKind.SPAN:
        return f"span {c.service}: {c.operation}"
    if c.kind == CauseKind.NETWORK:
        return f"network {c.peer_service} -> {c.service}: {c.operation}"
    if c.kind == CauseKind.RESOURCE:
        return f"resource {c.resource} on {c.host}"
    return f"service {c.service}"


def alert_labels(spike: Spike) -> dict[str, str]:
    """The labels that identify the alert of ``spike``'s stream under its top cause."""
    return {"alertname": ALERT_NAME, "service": spike.service, "operation": spike.operation,
            "cause": cause_label(spike), "cause_kind": spike.causes[0].kind.value if spike.causes else "none"}


def fingerprint(labels: dict[str, str]) -> str:
    """A stable 16-hex-digit id of a label set (Alertmanager's ``fingerprint``)."""
    return hashlib.sha256(orjson.dumps(labels, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class AlertItem:
    """One alert in a notification: a stream's latest spike, with links to its evidence."""

    fingerprint: str
    status: str  # firing | resolved
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at_ns: int  # event time
    ends_at_ns: int | None  # event time; None while firing
    spike: Spike
    spike_url: str
    trace_url: str | None  # the spike's slowest trace


@dataclass(frozen=True, slots=True)
class Notification:
    """One message to one receiver about one group of alerts."""

    idempotency_key: str
    receiver: str
    route: str
    group_id: str
    group_key: str
    group_labels: dict[str, str]
    status: str  # firing | resolved
    alerts: tuple[AlertItem, ...]
    external_url: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def firing(self) -> tuple[AlertItem, ...]:
        return tuple(a for a in self.alerts if a.status == "firing")


def stream_label(stream: Spike | AffectedStream) -> str:
    """A spike's leading stream or an affected one in words: ``service operation``, a hop as
    ``caller -> callee operation``."""
    what = f"{stream.service} {stream.operation}"
    return f"{stream.peer_service} -> {what}" if stream.peer_service else what


def affected_summary(spike: Spike, shown: int = 3) -> str | None:
    """The other streams the spike moved, in one line (None when it moved only its own).

    >>> from spikehound.model import AffectedStream
    >>> def moved(service, operation, caller, p99_ms, baseline_ms):
    ...     return AffectedStream(service=service, operation=operation, peer_service=caller, start_unix_nano=0,
    ...                           last_anomalous_end_unix_nano=0, p99_ns=int(p99_ms * 1e6),
    ...                           baseline_p99_ns=int(baseline_ms * 1e6), evidence=20.0)
    >>> affected_summary(Spike(id="s", service="gw", operation="GET /a", state="open", start_unix_nano=0,
    ...                        end_unix_nano=None, p99_ns=900_000_000, baseline_p99_ns=300_000_000, affected=(
    ...     moved("gw", "GET /a", None, 900.0, 300.0), moved("db", "SELECT", "api", 2100.0, 9.0))))
    'It also moved 1 stream: api -> db SELECT (p99 2100.0 ms against 9.0 ms).'
    """
    others = spike.affected[1:]
    if not others:
        return None
    parts = [f"{stream_label(a)} (p99 {milliseconds(a.p99_ns):.1f} ms against "
             f"{milliseconds(a.baseline_p99_ns):.1f} ms)"
             for a in others[:shown]]
    more = f" and {len(others) - shown} more" if len(others) > shown else ""
    noun = "stream" if len(others) == 1 else "streams"
    return f"It also moved {len(others)} {noun}: {'; '.join(parts)}{more}."


def describe(spike: Spike) -> str:
    """One line: the stream, its p99 against the baseline; for a return of a fault, which time it is."""
    line = (f"p99 of {stream_label(spike)} is {milliseconds(spike.p99_ns):.1f} ms against a baseline of "
            f"{milliseconds(spike.baseline_p99_ns):.1f} ms ({ratio(spike):.1f}x)")
    if spike.recurrence_of is not None and spike.first_start_unix_nano is not None:
        line += f", {recurrence(spike.occurrence, spike.start_unix_nano - spike.first_start_unix_nano)}"
    return line
