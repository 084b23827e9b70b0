"""The detection settings: one frozen record shared by every detector, live and in replay.

The collector builds it from the ``[detection]`` and ``[collector]`` sections of
its configuration; tests and ``spikehound replay`` build it directly. All
durations are nanoseconds so that nothing here needs a clock.

>>> DetectionSettings().window_ns, DetectionSettings(min_rise=0.5).min_rise
(10000000000, 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DetectionSettings"]

MS = 1_000_000
S = 1_000_000_000


@dataclass(frozen=True, slots=True)
class DetectionSettings:
    """How windows are cut, when a rise is a spike, and how much memory the detectors may hold."""

    # False: latency windows only (for /api/v1/latency); no spike detection, attribution or resource flags.
    enabled: bool = True

    # Event-time windows (see detectors.windows).
    window_ns: int = 10 * S
    allowed_lateness_ns: int = 5 * S
    max_streams: int = 10_000
    # The p99 spike detector (see detectors.p99_spike and detectors.spike_tracker).
    baseline_windows: int = 90  # learned windows the rolling baseline covers
    grace_windows: int = 12  # learned windows before a stream is judged at all
    min_requests: int = 40  # fewer requests than this and a window is merged with the ones before it
    max_merge_windows: int = 12  # how far back a low-traffic stream may merge (12 x 10 s = 2 min)
    min_rise: float = 0.2  # a spike's p99 is at least 20 % above the baseline
    min_abs_rise_ns: int = 5 * MS  # ... and at least 5 ms above it, so 2 ms -> 3 ms pages nobody
    min_score: float = 6.0  # ... and its count of requests over the baseline p99 has odds under 1e-6
    resolve_windows: int = 2  # calm judged windows in a row that resolve a spike
    adapt_after_windows: int = 180  # a spike open this long is a new normal: the baseline learns again
    # Attribution (see detectors.attribution).
    trace_buffer_spans: int = 200_000
    slow_traces_per_window: int = 32  # tail traces of each anomalous window compared with the normal profile
    max_slow_traces: int = 256  # most slow-trace breakdowns a spike keeps (thinned evenly beyond)
    normal_traces_per_window: int = 3  # tail traces of each normal window learned into the profile
    max_causes: int = 5
    # Resource detectors (see detectors.resource).
    max_resource_series: int = 20_000
    resource_flag_windows: int = 30  # how long a resource flag stays available to attribution
