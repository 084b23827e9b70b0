"""``spikehound replay``: recorded OTLP through the collector's own detectors, in event time.

The files are read in the order given, record by record, and every record goes
through the same :class:`spikehound.detectors.engine.DetectionEngine` the collector runs
after each commit, with the same settings (from the same configuration). No
clock is involved: a replay of last month's capture takes seconds and finds
what the collector found, with the same spike ids.

>>> result = replay([])
>>> result.spikes, result.records
([], 0)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from spikehound.detectors.engine import Detection, DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import Spike
from spikehound.otlp_file import read_otlp_file

__all__ = ["ReplayResult", "replay"]


@dataclass(slots=True)
class ReplayResult:
    spikes: list[Spike] = field(default_factory=list)  # final states, newest start first (as the API lists them)
    records: int = 0
    spans: int = 0
    points: int = 0
    rejected: int = 0  # spans and points that failed validation
    skipped: int = 0  # records of other signals (logs)
    windows: int = 0


def replay(paths: Sequence[str | os.PathLike[str]], settings: DetectionSettings | None = None) -> ReplayResult:
    """Run the recorded files through a fresh detection engine; raise OtlpFileError on an unreadable file."""
    detection = DetectionEngine(settings or DetectionSettings())
    result = ReplayResult()
    latest: dict[str, Spike] = {}

    def take(step: Detection) -> None:
        result.windows += len(step.windows)
        for spike in step.spikes:
            latest[spike.id] = spike

    for path in paths:
        for record in read_otlp_file(path):
            result.records += 1
            decoded = record.decoded
            result.rejected += decoded.rejected
            if record.signal == "logs":
                result.skipped += 1
                continue
            result.spans += len(decoded.spans)
            result.points += len(decoded.points)
            detection.add(decoded.spans, decoded.points)
            take(detection.advance())
    take(detection.flush())
    result.spikes = sorted(latest.values(), key=lambda s: (s.start_unix_nano, s.id), reverse=True)
    return result
