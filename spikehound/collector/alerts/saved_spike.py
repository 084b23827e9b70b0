"""A spike as an alert group's saved state holds it, and back into the model when the state is restored.

The saved form is the one routing has always written: the spike as the REST API shows it, plus the event-time
nanoseconds of its start, end and detection (``start_ns``, ``end_ns``, ``detected_ns``). Keeping it means groups
saved by an earlier version restore as they are, and a downgrade reads what this one saved.

>>> from spikehound.model import Cause, CauseKind, Spike
>>> spike = Spike(id="ab12", service="gateway", operation="POST /v1/predict", state="open",
...               start_unix_nano=1_700_000_000_123_456_789, end_unix_nano=None, p99_ns=312_345_678,
...               baseline_p99_ns=100_000_001, exemplar_trace_ids=(bytes(15) + b"\\x01",), detected_unix_nano=7,
...               causes=(Cause(kind=CauseKind.SPAN, score=0.9, summary="resize", service="preprocess"),))
>>> doc = saved_form(spike)
>>> doc["start"], doc["start_ns"], doc["p99_ms"]
('2023-11-14T22:13:20.123456789Z', 1700000000123456789, 312.345678)
>>> from_saved_form(doc) == spike
True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spikehound.model import Spike
from spikehound.model_json import spike_from_json, spike_json


def saved_form(spike: Spike) -> dict[str, Any]:
    """The JSON-ready document of ``spike`` in a group's saved state."""
    doc = spike_json(spike)
    doc["start_ns"] = spike.start_unix_nano
    doc["end_ns"] = spike.end_unix_nano
    doc["detected_ns"] = spike.detected_unix_nano
    return doc


def from_saved_form(doc: dict[str, Any]) -> Spike:
    """The spike a saved document holds."""
    return replace(spike_from_json(doc), start_unix_nano=doc["start_ns"], end_unix_nano=doc["end_ns"],
                   detected_unix_nano=doc.get("detected_ns"))
