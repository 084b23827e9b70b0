"""Silences: "do not page about this until then", created and ended through the API.

A silence has matchers (patterns on ``service``, ``operation``, ``cause_kind``,
``cause_service``, ``cause_resource``; see :mod:`spikehound.collector.alerts.matchers`)
and a time range. While it is active, routing leaves out every alert whose
spike it matches: no firing message, and no resolve notice for an alert that
was never announced. Ending it (``DELETE``) sets its end to now; it stays
listed as expired.

>>> s = Silence.parse({"matchers": {"service": "gateway"}, "duration_seconds": 3600,
...                    "comment": "deploy", "created_by": "sre"}, now_ns=0, new_id="s1")
>>> s.state(1), s.state(3600 * 10**9)
('active', 'expired')
>>> Silence.parse({"matchers": {}, "duration_seconds": 60}, now_ns=0)
Traceback (most recent call last):
...
ValueError: matchers: give at least one of service, operation, cause_kind, cause_service, cause_resource
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from spikehound.collector.alerts.matchers import SpikeMatcher
from spikehound.model import CauseKind, Spike
from spikehound.storage.alerts import SilenceRow
from spikehound.timefmt import MAX_NS, parse_time, rfc3339
from spikehound.units import NS

FIELDS = ("service", "operation", "cause_kind", "cause_service", "cause_resource")
MAX_PATTERN = 1024
MAX_TEXT = 4096


@dataclass(frozen=True, slots=True)
class Silence:
    id: str
    matchers: dict[str, str]
    comment: str
    created_by: str
    starts_at: int  # unix ns
    ends_at: int
    created_at: int

    @property
    def matcher(self) -> SpikeMatcher:
        m = self.matchers
        return SpikeMatcher(**{name: (m[key],) for name, key in (
            ("services", "service"), ("operations", "operation"), ("cause_kinds", "cause_kind"),
            ("cause_services", "cause_service"), ("cause_resources", "cause_resource")) if key in m})

    def state(self, now_ns: int) -> str:
        if now_ns >= self.ends_at:
            return "expired"
        return "active" if now_ns >= self.starts_at else "pending"

    def mutes(self, spike: Spike, now_ns: int) -> bool:
        """Active and matching ``spike``'s leading stream (one stream's silence must not hide an outage)."""
        return self.state(now_ns) == "active" and self.matcher.matches(spike, moved=False)

    def to_json(self, now_ns: int) -> dict[str, Any]:
        return {"id": self.id, "matchers": self.matchers, "comment": self.comment, "created_by": self.created_by,
                "starts_at": rfc3339(self.starts_at), "ends_at": rfc3339(self.ends_at),
                "created_at": rfc3339(self.created_at), "state": self.state(now_ns)}

    def to_row(self) -> SilenceRow:
        return SilenceRow(id=self.id, matchers=orjson.dumps(self.matchers, option=orjson.OPT_SORT_KEYS).decode(),
                          comment=self.comment, created_by=self.created_by, starts_at=self.starts_at,
                          ends_at=self.ends_at, created_at=self.created_at)

    @classmethod
    def from_row(cls, r: SilenceRow) -> Silence:
        return cls(id=r.id, matchers=orjson.loads(r.matchers), comment=r.comment, created_by=r.created_by,
                   starts_at=r.starts_at, ends_at=r.ends_at, created_at=r.created_at)

    @classmethod
    def parse(cls, body: Any, now_ns: int, new_id: str | None = None) -> Silence:
        """A silence from the API's POST body; ValueError names the field that is wrong."""
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        unknown = set(body) - {"matchers", "starts_at", "ends_at", "duration_seconds", "comment", "created_by"}
        if unknown:
            raise ValueError(f"unknown fields: {', '.join(sorted(unknown))}")
        matchers = body.get("matchers")
        if not isinstance(matchers, dict):
            raise ValueError("matchers: expected an object such as {\"service\": \"gateway\"}")
        wrong = set(matchers) - set(FIELDS)
        if wrong:
            raise ValueError(f"matchers: unknown {', '.join(sorted(wrong))}; use {', '.join(FIELDS)}")
        if not matchers:
            raise ValueError(f"matchers: give at least one of {', '.join(FIELDS)}")
        for key, pattern in matchers.items():
            if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN:
                raise ValueError(f"matchers.{key}: expected a pattern of 1 to {MAX_PATTERN} characters")
        kind = matchers.get("cause_kind")
        kinds = [k.value for k in CauseKind]
        if kind is not None and not any(ch in kind for ch in "*?[") and kind not in kinds:
            raise ValueError(f"matchers.cause_kind: {kind!r} is not one of {', '.join(kinds)}")
        starts_at = _time(body, "starts_at", now_ns)
        if "ends_at" in body and "duration_seconds" in body:
            raise ValueError("give ends_at or duration_seconds, not both")
        if "duration_seconds" in body:
            seconds = body["duration_seconds"]
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 10 * 365 * 86400:
                raise ValueError("duration_seconds: expected a positive number of seconds (at most ten years)")
            ends_at = starts_at + int(seconds * NS)
        elif "ends_at" in body:
            ends_at = _time(body, "ends_at", now_ns)
        else:
            raise ValueError("give ends_at (RFC 3339 or unix seconds) or duration_seconds: a silence must expire")
        if ends_at > MAX_NS:
            raise ValueError("ends_at: after 2262-04-11, the last time storage holds")
        if ends_at <= max(starts_at, now_ns):
            raise ValueError("ends_at must be after starts_at and in the future")
        texts = {}
        for key in ("comment", "created_by"):
            value = body.get(key, "")
            if not isinstance(value, str) or len(value) > MAX_TEXT:
                raise ValueError(f"{key}: expected a string of at most {MAX_TEXT} characters")
            texts[key] = value
        return cls(id=new_id or uuid.uuid4().hex, matchers=dict(matchers), comment=texts["comment"],
                   created_by=texts["created_by"][:255], starts_at=starts_at, ends_at=ends_at, created_at=now_ns)


def _time(body: dict[str, Any], key: str, default: int) -> int:
    raw = body.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{key}: expected RFC 3339 or unix seconds")
    try:
        return parse_time(str(raw))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
