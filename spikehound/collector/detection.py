"""The collector's detection settings, read from its configuration.

``spikehound replay`` uses the same function, so a replay judges exactly as
the collector with the same configuration file would.

>>> from spikehound.config import load
>>> detection_settings(load(env={"SPIKEHOUND_DETECTION_MIN_RISE": "0.3"})).min_rise
0.3
"""

from __future__ import annotations

from spikehound.config import Config
from spikehound.detectors.settings import DetectionSettings

NS = 1_000_000_000


def detection_settings(cfg: Config) -> DetectionSettings:
    c, d = cfg.collector, cfg.detection
    return DetectionSettings(
        enabled=d.enabled,
        window_ns=int(c.window_seconds * NS),
        allowed_lateness_ns=int(c.allowed_lateness_seconds * NS),
        max_streams=c.max_streams,
        baseline_windows=d.baseline_windows,
        grace_windows=d.grace_windows,
        min_requests=d.min_requests,
        max_merge_windows=d.max_merge_windows,
        min_rise=d.min_rise,
        min_abs_rise_ns=int(d.min_abs_rise_ms * 1_000_000),
        min_score=d.min_score,
        resolve_windows=d.resolve_windows,
        hop_streams=d.hop_streams,
        split_generic=d.split_generic_operations,
        grace_requests=d.grace_requests,
        min_evidence=d.min_evidence,
        min_slow_requests=d.min_slow_requests,
        end_evidence=d.end_evidence,
        trace_buffer_spans=d.trace_buffer_spans,
        max_causes=d.max_causes,
    )
