"""The detection settings: one frozen record shared by every detector, live and in replay.

The collector builds it from the ``[detection]`` and ``[collector]`` sections of
its configuration; tests and ``spikehound replay`` build it directly. All
durations are nanoseconds so that nothing here needs a clock.

>>> DetectionSettings().window_ns, DetectionSettings(min_rise=0.5).min_rise
(10000000000, 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass

from spikehound.units import MS, NS

__all__ = ["DetectionSettings"]


@dataclass(frozen=True, slots=True)
class DetectionSettings:
    """How windows are cut, when a rise is a spike, and how much memory the detectors may hold."""

    # False: latency windows only (for /api/v1/latency); no spike detection, attribution or resource flags.
    enabled: bool = True

    # Event-time windows and the streams cut into them (see detectors.windows and detectors.streams).
    window_ns: int = 10 * NS
    allowed_lateness_ns: int = 5 * NS
    max_streams: int = 10_000
    hop_streams: bool = True  # judge caller -> callee edges on the callers' CLIENT spans too
    split_generic: bool = True  # split a generic entry operation (/*, HTTP GET) by where its requests go
    # The window test: the p99 spike detector (see detectors.p99_spike and detectors.stream_judge).
    baseline_windows: int = 90  # learned windows the rolling baseline covers
    grace_windows: int = 12  # learned windows before a stream is judged at all
    min_requests: int = 40  # fewer requests than this and a window is merged with the ones before it
    max_merge_windows: int = 12  # how far back a low-traffic stream may merge (12 x 10 s = 2 min)
    min_rise: float = 0.2  # a spike's p99 is at least 20 % above the baseline
    min_abs_rise_ns: int = 5 * MS  # ... and at least 5 ms above it, so 2 ms -> 3 ms pages nobody
    min_score: float = 6.0  # ... and its count of requests over the baseline p99 has odds under 1e-6
    resolve_windows: int = 2  # calm busy windows in a row that end a spike (each is end_evidence / resolve_windows)
    adapt_after_windows: int = 720  # a spike open this long (2 h) is a new normal: the baseline learns again
    # The sequential test, request by request (see spikehound.detectors.sequential).
    request_pool: int = 256  # normal requests a stream's pool holds
    pool_per_window: int = 8  # most requests of one window learned into the pool (a busy window is thinned)
    grace_requests: int = 12  # requests learned before a stream's requests are scored
    max_surprise: float = 4.0  # the most one request can say (-log10 of the share of normal ones slower)
    surprise_drift: float = 0.9  # taken off each request's surprise: normal requests bring the evidence down
    slow_surprise: float = 1.5  # a request this surprising (1 in 30) is one of the rise's slow requests
    hot_evidence: float = 1.5  # evidence at which a stream is attributed and grouped
    # A sparse stream's slow requests count toward its place's evidence this long after the last one, in the
    # windows where another stream turns hot (a service of 3 calls a minute spreads a fault over its routes).
    standing_ns: int = 120 * NS
    # How a spike ends (see spikehound.detectors.sequential.RecoveryEvidence) and what it keeps from learning.
    end_evidence: float = 3.0  # evidence toward normal (log10 odds) that ends a spike: 3-4 normal requests
    quiet_min_ns: int = 120 * NS  # a spike whose requests stopped ends after ten of their typical gaps, at least
    quiet_max_ns: int = 600 * NS  # ... this and at most this
    end_hold_ns: int = 30 * NS  # ... once it stayed there 3 request gaps (a window to this): a fault lets calls through
    quarantine_before_ns: int = 60 * NS  # nothing of the minute before a spike's onset is learned as normal
    recurrence_ns: int = 3600 * NS  # a spike at the same place within this of an earlier one's end is its return
    # Incidents (see spikehound.detectors.incidents); both thresholds grow with log10(streams judged / 10).
    min_evidence: float = 4.0  # sequential evidence of a group that opens a spike
    min_slow_requests: int = 2  # ... over at least this many stalls (slow traces all in flight at one instant: one)
    min_spread_ns: int = 2 * NS  # the same for a window whose window test fired (at most a fifth of a window)
    # Attribution (see spikehound.detectors.attribution).
    trace_buffer_spans: int = 200_000
    trace_buffer_bytes: int = 128 * 2**20  # ... and their estimated bytes (long names fill it before the count)
    slow_traces_per_window: int = 32  # tail traces of each anomalous window compared with the normal profile
    max_slow_traces: int = 256  # most slow-trace breakdowns a spike keeps (thinned evenly beyond)
    normal_traces_per_window: int = 3  # tail traces of each normal window learned into the profile
    max_causes: int = 5
    # Resource detectors (see spikehound.detectors.resource).
    max_resource_series: int = 20_000
    resource_flag_windows: int = 30  # how long a resource flag stays available to attribution
