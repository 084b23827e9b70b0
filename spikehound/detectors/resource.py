"""Resource detectors: per (host, metric) flags for the drops and rises that slow requests down.

Metric samples from any sender (the agent's, or anything else that speaks the
OpenTelemetry semantic conventions) are cut into the same event-time windows
as latency. Each series that a :data:`RULES` entry watches gets a
:class:`ResourceDetector` (River) that learns the series' normal window value
and flags a window that moved the harmful way by more than both a minimum
change and a few standard deviations, and past a level that matters (a GPU
falling from 90 % to 60 % busy, not from 3 % to 1 %). Gauges are averaged over
the window; counters become a rate per second (resets are survived).

Flags are only *evidence*: attribution joins them to a spike when they sit on
a host that served the slow part of the slow requests, in the spike's window.

>>> from spikehound.model import CauseKind, MetricKind, MetricPoint
>>> watch = ResourceWatch(window_ns=10 * NS)
>>> def gpu(t, value):
...     return MetricPoint(host="gpu-2", name="hw.gpu.utilization", attributes={"hw.id": "GPU-7"},
...                        time_unix_nano=t * NS, value=value, kind=MetricKind.GAUGE, unit="1")
>>> watch.add([gpu(t, 0.9) for t in range(0, 60)] + [gpu(t, 0.3) for t in range(60, 70)])
>>> [(f.host, f.metric, f.baseline, f.observed) for f in watch.close(70 * NS)]
[('gpu-2', 'hw.gpu.utilization', 0.9, 0.3)]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from river import base, stats

from spikehound.model import CauseKind, MetricKind, MetricPoint
from spikehound.units import NS

__all__ = ["RULES", "ResourceDetector", "ResourceFlag", "ResourceWatch", "Rule"]


@dataclass(frozen=True, slots=True)
class Rule:
    """Which series to watch and what a harmful move of it is."""

    metric: str
    label: str  # how a sentence names it: "GPU utilization"
    direction: int  # -1: a drop hurts; +1: a rise hurts
    min_change: float  # the smallest harmful move, in the window value's unit
    level: float  # a drop needs a baseline at least this high; a rise an observed value at least this high
    match: tuple[tuple[str, str], ...] = ()  # attributes that must have these values
    absent: tuple[str, ...] = ()  # attributes that must not be there (whole machine, not one core)
    ignore: tuple[tuple[str, tuple[str, ...]], ...] = ()  # attribute values that are never harmful
    percent: bool = False  # shown as a percentage in sentences
    # Cause kinds whose growth this resource can explain on the host that served them: a GPU or CPU for a
    # span's own work, the network for a hop. Attribution joins a flag only to such a cause.
    explains: tuple[CauseKind, ...] = (CauseKind.SPAN, CauseKind.SERVICE)
    # How much slower it can make the work it explains: "capacity" (a CPU: work that had 1 - baseline of it
    # spare now has 1 - observed), "ratio" (a GPU doing baseline / observed less), or "unbounded" (errors,
    # throttling, swapping: timeouts and retries have no ceiling).
    slowdown: str = "unbounded"

    def max_slowdown(self, baseline: float, observed: float) -> float:
        """The largest factor by which this move of the resource can slow the work it explains.

        >>> steal = Rule("system.cpu.utilization", "CPU steal", +1, 0.1, 0.2, slowdown="capacity")
        >>> round(steal.max_slowdown(0.04, 0.14), 2)
        1.12
        """
        if self.slowdown == "capacity":
            return (1.0 - min(baseline, 0.99)) / (1.0 - min(observed, 0.99))
        if self.slowdown == "ratio":
            return baseline / observed if observed > 0 else math.inf
        return math.inf

    def matches(self, attributes: dict[str, Any]) -> bool:
        return (all(attributes.get(k) == v for k, v in self.match)
                and not any(k in attributes for k in self.absent)
                and not any(attributes.get(k) in values for k, values in self.ignore))


# Benign clock event reasons: an idle GPU, or clocks set on purpose.
_BENIGN_REASONS = ("gpu_idle", "applications_clocks_setting", "sync_boost", "display_clock_setting")

RULES: tuple[Rule, ...] = (
    Rule("hw.gpu.utilization", "GPU utilization", -1, 0.15, 0.2, percent=True, slowdown="ratio"),
    Rule("nvidia.gpu.throttle", "GPU clock throttling", +1, 0.5, 0.5,
         ignore=(("nvidia.throttle.reason", _BENIGN_REASONS),), percent=True),
    Rule("nvidia.gpu.xid.errors", "GPU XID errors", +1, 1e-6, 1e-6),
    Rule("system.cpu.utilization", "CPU utilization", +1, 0.15, 0.85, match=(("cpu.mode", "busy"),),
         absent=("cpu.logical_number",), percent=True, slowdown="capacity"),
    # Steal of a few percent comes and goes on any shared VM; a fifth of the CPU taken away slows real work.
    Rule("system.cpu.utilization", "CPU steal", +1, 0.1, 0.2, match=(("cpu.mode", "steal"),),
         absent=("cpu.logical_number",), percent=True, slowdown="capacity"),
    Rule("system.network.errors", "network errors", +1, 1.0, 1.0, explains=(CauseKind.NETWORK,)),
    Rule("system.network.dropped", "dropped packets", +1, 1.0, 1.0, explains=(CauseKind.NETWORK,)),
    Rule("system.network.tcp.retransmits", "TCP retransmits", +1, 5.0, 5.0, explains=(CauseKind.NETWORK,)),
    Rule("system.memory.utilization", "memory utilization", +1, 0.03, 0.92, percent=True),
    Rule("system.paging.utilization", "swap utilization", +1, 0.1, 0.1, percent=True),
)
_RULES_BY_METRIC: dict[str, tuple[Rule, ...]] = {}
for _rule in RULES:
    _RULES_BY_METRIC[_rule.metric] = (*_RULES_BY_METRIC.get(_rule.metric, ()), _rule)


@dataclass(frozen=True, slots=True)
class ResourceFlag:
    """One window in which a host's resource moved the harmful way."""

    host: str
    metric: str
    series: str  # the point attributes as canonical JSON (which GPU, which interface)
    window_start_ns: int
    window_end_ns: int
    baseline: float
    observed: float
    unit: str
    severity: float  # the detector's score: robust standard deviations the harmful way
    summary: str
    explains: tuple[CauseKind, ...] = (CauseKind.SPAN, CauseKind.SERVICE)  # cause kinds it can explain (Rule.explains)
    max_slowdown: float = math.inf  # the most it can slow the work it explains (see Rule.max_slowdown)


class ResourceDetector(base.AnomalyDetector):
    """How far, in standard deviations, a window value moved the harmful way from the learned normal.

    Parameters
    ----------
    direction
        -1 when a drop hurts (GPU utilization), +1 when a rise hurts (errors, saturation).
    min_sigma
        Floor of the standard deviation, so that a series that never moved still needs a real change.
    fading_factor
        Weight of the newest window in the exponentially weighted mean and variance.
    grace_period
        Windows to learn before any score is given.

    ``x`` holds ``"value"``: the window's mean (gauges) or rate (counters).

    >>> detector = ResourceDetector(direction=-1, min_sigma=0.05)
    >>> for _ in range(10):
    ...     detector.learn_one({"value": 0.9})
    >>> round(detector.score_one({"value": 0.6}), 1), detector.score_one({"value": 0.95}) <= 0
    (6.0, True)
    """

    def __init__(self, direction: int = 1, min_sigma: float = 0.01, fading_factor: float = 0.1,
                 grace_period: int = 3) -> None:
        self.direction = direction
        self.min_sigma = min_sigma
        self.fading_factor = fading_factor
        self.grace_period = grace_period
        self._mean = stats.EWMean(fading_factor=fading_factor)
        self._var = stats.EWVar(fading_factor=fading_factor)
        self.n_learned = 0

    @classmethod
    def _unit_test_params(cls) -> Any:
        yield {"direction": -1, "min_sigma": 0.05}

    def learn_one(self, x: dict[str, Any]) -> None:
        self._mean.update(float(x["value"]))
        self._var.update(float(x["value"]))
        self.n_learned += 1

    def score_one(self, x: dict[str, Any]) -> float:
        if self.n_learned < self.grace_period:
            return 0.0
        return self.direction * (float(x["value"]) - self._mean.get()) / self.sigma

    @property
    def sigma(self) -> float:
        return max(math.sqrt(max(self._var.get(), 0.0)), self.min_sigma)

    @property
    def baseline(self) -> float:
        return self._mean.get()


@dataclass(slots=True)
class _Series:
    rule: Rule
    host: str
    metric: str
    series: str
    unit: str
    detector: ResourceDetector
    cumulative: bool
    # window start -> [sum, count, point times] for gauges, [increase, count, point times] for counters
    open: dict[int, list[float]] = field(default_factory=dict)
    last: tuple[int, float] | None = None  # the previous counter point (time, value)


class ResourceWatch:
    """Windows, detectors and recent flags for every watched (host, metric, attributes) series."""

    duplicate_points = 0  # class default: a checkpoint from before the count was kept has none

    def __init__(self, window_ns: int = 10 * NS, z_threshold: float = 3.0, max_series: int = 20_000,
                 keep_windows: int = 30) -> None:
        self.window_ns = window_ns
        self.z_threshold = z_threshold
        self.max_series = max_series
        self.keep_windows = keep_windows
        self.late_points = 0
        self.overflow_points = 0
        self.duplicate_points = 0
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._closed_until = -(2**62)  # windows ending at or before this are closed
        self._flags: deque[ResourceFlag] = deque()

    def add(self, points: Iterable[MetricPoint]) -> None:
        window_ns = self.window_ns
        for p in points:
            rules = _RULES_BY_METRIC.get(p.name)
            if rules is None:
                continue
            rule = next((r for r in rules if r.matches(p.attributes)), None)
            if rule is None:
                continue
            start = p.time_unix_nano // window_ns * window_ns
            if start + window_ns <= self._closed_until:
                self.late_points += 1
                continue
            series = self._get_series(rule, p)
            if series is None:
                self.overflow_points += 1
                continue
            acc = series.open.get(start)
            if acc is None:
                series.open[start] = acc = [0.0, 0.0, set()]
            elif len(acc) < 3:  # a window from a checkpoint written before the times were kept
                acc.append(set())
            # The same point twice (a retried export whose first commit succeeded; storage keeps one) must
            # not count twice: a delta counter's rate would double.
            times = acc[2]
            if p.time_unix_nano in times:
                self.duplicate_points += 1
                continue
            times.add(p.time_unix_nano)
            if p.kind == MetricKind.GAUGE:
                acc[0] += p.value
            elif p.kind == MetricKind.SUM_DELTA:
                acc[0] += p.value * NS / window_ns  # per second
            else:
                last = series.last
                if last is not None and p.time_unix_nano > last[0]:
                    # A counter that went down was restarted: it counted p.value since.
                    increase = p.value - last[1] if p.value >= last[1] else p.value
                    acc[0] += increase * NS / window_ns
                if last is None or p.time_unix_nano > last[0]:
                    series.last = (p.time_unix_nano, p.value)
            acc[1] += 1

    def judged(self, time_ns: int) -> bool:
        """Whether the window of a sample at ``time_ns`` was judged already (a sample for it is late)."""
        return time_ns // self.window_ns * self.window_ns + self.window_ns <= self._closed_until

    def close(self, watermark_ns: int) -> list[ResourceFlag]:
        """Judge every window that ends at or before ``watermark_ns``; return the new flags."""
        if watermark_ns <= self._closed_until:
            return []
        crossed = watermark_ns // self.window_ns != self._closed_until // self.window_ns
        self._closed_until = watermark_ns
        if not crossed:  # windows end on multiples of window_ns: none can have closed since the last call
            return []
        flags: list[ResourceFlag] = []
        for series in self._series.values():
            for start in sorted(s for s in series.open if s + self.window_ns <= watermark_ns):
                acc = series.open.pop(start)
                total, count = acc[0], acc[1]
                value = total if series.cumulative else total / count  # counters already hold a rate
                flag = self._judge(series, start, value)
                if flag is not None:
                    flags.append(flag)
        self._flags.extend(flags)
        horizon = watermark_ns - self.keep_windows * self.window_ns
        while self._flags and self._flags[0].window_end_ns < horizon:
            self._flags.popleft()
        return flags

    def limit(self, latest_ns: int) -> bool:
        """Bring event time back to at most ``latest_ns``; True when it had run past (see LatencyWindows.limit)."""
        if self._closed_until <= latest_ns:
            return False
        self._closed_until = latest_ns
        for series in self._series.values():
            for start in [s for s in series.open if s >= latest_ns]:
                del series.open[start]
            if series.last is not None and series.last[0] > latest_ns:
                series.last = None
        return True

    def flags(self, hosts: Sequence[str] | None, start_ns: int, end_ns: int) -> list[ResourceFlag]:
        """Flags on ``hosts`` (all when None) whose window overlaps [start_ns, end_ns)."""
        wanted = None if hosts is None else set(hosts)
        return [f for f in self._flags
                if (wanted is None or f.host in wanted) and f.window_start_ns < end_ns and f.window_end_ns > start_ns]

    @property
    def series(self) -> int:
        return len(self._series)

    def _get_series(self, rule: Rule, p: MetricPoint) -> _Series | None:
        attrs = orjson.dumps(p.attributes, option=orjson.OPT_SORT_KEYS).decode()
        key = (p.host, p.name, attrs)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= self.max_series:
                return None
            detector = ResourceDetector(direction=rule.direction, min_sigma=rule.min_change / self.z_threshold)
            series = self._series[key] = _Series(rule=rule, host=p.host, metric=p.name, series=attrs, unit=p.unit,
                                                 detector=detector, cumulative=p.kind != MetricKind.GAUGE)
        return series

    def _judge(self, series: _Series, start: int, value: float) -> ResourceFlag | None:
        rule, detector = series.rule, series.detector
        x = {"value": value}
        score = detector.score_one(x)
        baseline = detector.baseline
        change = rule.direction * (value - baseline)
        harmful = (detector.n_learned >= detector.grace_period and score >= self.z_threshold
                   and change >= rule.min_change
                   and (baseline >= rule.level if rule.direction < 0 else value >= rule.level))
        if not harmful:
            detector.learn_one(x)
            return None
        return ResourceFlag(host=series.host, metric=series.metric, series=series.series, window_start_ns=start,
                            window_end_ns=start + self.window_ns, baseline=round(baseline, 4),
                            observed=round(value, 4), unit=series.unit, severity=round(score, 2),
                            summary=_sentence(rule, series, baseline, value), explains=rule.explains,
                            max_slowdown=rule.max_slowdown(baseline, value))


def _sentence(rule: Rule, series: _Series, baseline: float, value: float) -> str:
    verb = "fell" if rule.direction < 0 else "rose"
    what = rule.label
    attrs = orjson.loads(series.series)
    detail = attrs.get("hw.id") or attrs.get("nvidia.throttle.reason") or attrs.get("network.interface.name")
    if detail:
        what = f"{what} ({detail})"
    if rule.percent:
        return f"{what} {verb} from {baseline:.0%} to {value:.0%}"
    return f"{what} {verb} from {baseline:.2f}/s to {value:.2f}/s"
