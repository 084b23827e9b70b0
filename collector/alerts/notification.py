"""What one alert notification says, before a notifier renders it for Slack or a webhook.

A spike becomes an *alert* identified by its labels (service, operation, top
cause), so that a spike which ends and comes back on the same stream for the
same reason is the same alert, not a new one. Alerts are grouped by (route,
service, top cause), and one notification covers one group.

>>> doc = {"id": "ab12", "service": "gateway", "operation": "POST /v1/predict", "causes": [
...     {"kind": "span", "service": "preprocess", "operation": "SELECT features", "peer_service": None,
...      "host": "gpu-1", "resource": None, "score": 0.9}]}
>>> cause_label(doc)
'span preprocess: SELECT features'
>>> fingerprint(alert_labels(doc))
'b949e4c45482a96b'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from collector.rest.serialize import spike_json
from spikehound.model import Spike

ALERT_NAME = "P99LatencySpike"
NO_CAUSE = "no cause found yet"


def spike_doc(spike: Spike) -> dict[str, Any]:
    """The spike as the API shows it, plus what routing needs (event-time ns of start and detection)."""
    doc = spike_json(spike)
    doc["start_ns"] = spike.start_unix_nano
    doc["end_ns"] = spike.end_unix_nano
    doc["detected_ns"] = spike.detected_unix_nano
    return doc


def ratio(doc: dict[str, Any]) -> float:
    """How many times its baseline the spike's p99 is (the severity routes filter on)."""
    baseline = doc["baseline_p99_ms"]
    return doc["p99_ms"] / baseline if baseline > 0 else float("inf")


def cause_label(doc: dict[str, Any]) -> str:
    """The top cause in a few words; with the service it names the alert's group."""
    if not doc["causes"]:
        return NO_CAUSE
    c = doc["causes"][0]
    kind = c["kind"]
    if kind == "span":
        return f"span {c['service']}: {c['operation']}"
    if kind == "network":
        return f"network {c['peer_service']} -> {c['service']}: {c['operation']}"
    if kind == "resource":
        return f"resource {c['resource']} on {c['host']}"
    return f"service {c['service']}"


def alert_labels(doc: dict[str, Any]) -> dict[str, str]:
    causes = doc["causes"]
    return {"alertname": ALERT_NAME, "service": doc["service"], "operation": doc["operation"],
            "cause": cause_label(doc), "cause_kind": causes[0]["kind"] if causes else "none"}


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
    spike: dict[str, Any]  # the API's Spike, with "url" and "ratio"
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


def stream_label(stream: dict[str, Any]) -> str:
    """A stream of the API's Spike or AffectedStream in words: ``service operation``, a hop as
    ``caller -> callee operation``."""
    what = f"{stream['service']} {stream['operation']}"
    return f"{stream['peer_service']} -> {what}" if stream.get("peer_service") else what


def affected_summary(doc: dict[str, Any], shown: int = 3) -> str | None:
    """The other streams the spike moved, in one line (None when it moved only its own).

    >>> affected_summary({"affected_streams": [
    ...     {"service": "gw", "operation": "GET /a", "peer_service": None, "p99_ms": 900.0, "baseline_p99_ms": 300.0},
    ...     {"service": "db", "operation": "SELECT", "peer_service": "api", "p99_ms": 2100.0, "baseline_p99_ms": 9.0}]})
    'It also moved 1 stream: api -> db SELECT (p99 2100.0 ms against 9.0 ms).'
    """
    others = doc.get("affected_streams", [])[1:]
    if not others:
        return None
    parts = [f"{stream_label(a)} (p99 {a['p99_ms']:.1f} ms against {a['baseline_p99_ms']:.1f} ms)"
             for a in others[:shown]]
    more = f" and {len(others) - shown} more" if len(others) > shown else ""
    noun = "stream" if len(others) == 1 else "streams"
    return f"It also moved {len(others)} {noun}: {'; '.join(parts)}{more}."


def describe(doc: dict[str, Any]) -> str:
    """One line: the stream, its p99 against the baseline."""
    return (f"p99 of {stream_label(doc)} is {doc['p99_ms']:.1f} ms against a baseline of "
            f"{doc['baseline_p99_ms']:.1f} ms ({ratio(doc):.1f}x)")
