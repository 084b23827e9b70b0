"""The data of a spike page's charts: the stream's latency and its hosts' resources, on one time axis.

Pure computation; the page embeds the result as JSON and ``static/spikehound.js``
draws it with uPlot. Every panel covers the same range (``ChartRange``), so the
charts line up under each other. Resource samples are averaged into buckets
(a few hundred per chart; a chart is a few hundred pixels wide), and counters
become rates per second.

>>> r = ChartRange(since_ns=0, until_ns=60 * NS, window_start_ns=20 * NS, window_end_ns=40 * NS)
>>> step_seconds(r)
1
>>> bucket_means([(0, 1.0), (500_000_000, 3.0), (2 * NS, 5.0)], since_ns=0, until_ns=3 * NS, step_ns=NS)
[2.0, None, 5.0]
>>> rates([(0, 100.0), (NS, 160.0), (2 * NS, 10.0), (3 * NS, 40.0)], MetricKind.SUM_CUMULATIVE)
[(1000000000, 60.0), (3000000000, 30.0)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spikehound.model import Cause, LatencyWindow, MetricKind
from spikehound.storage.reader import KindedSeries
from spikehound.units import NS

MAX_BUCKETS = 360
NICE_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
MAX_SERIES_PER_PANEL = 12
MAX_HOSTS = 4


@dataclass(slots=True, frozen=True)
class ChartRange:
    """The shared time axis of a spike page, and the spike's window on it (ns)."""

    since_ns: int
    until_ns: int
    window_start_ns: int
    window_end_ns: int


@dataclass(slots=True, frozen=True)
class PanelSpec:
    """One resource chart of a host: which metrics, how to show them."""

    key: str
    title: str
    names: tuple[str, ...]
    unit: str  # how the page formats values: "%", "B/s", "/s" or a unit to print as is
    skip_attribute_keys: tuple[str, ...] = ()
    keep: tuple[tuple[str, str], ...] = ()  # (attribute, value): only series with one of these
    optional: bool = False  # all zero, named by no cause, beside a throughput chart: left out


# What the issue asks for under the latency chart: GPU utilization, CPU, network. Where the agent's `.rate`
# gauges exist they are used; the raw counters (from any other sender) become rates here.
HOST_PANELS = (
    PanelSpec("gpu", "GPU utilization", ("hw.gpu.utilization",), "%"),
    PanelSpec("cpu", "CPU", ("system.cpu.utilization",), "%", skip_attribute_keys=("cpu.logical_number",),
              keep=(("cpu.mode", "busy"), ("cpu.mode", "steal"), ("cpu.mode", "iowait"))),
    PanelSpec("net", "Network throughput", ("system.network.io.rate", "system.network.io"), "B/s"),
    PanelSpec("neterr", "Network errors, drops, retransmits",
              ("system.network.errors.rate", "system.network.errors", "system.network.dropped.rate",
               "system.network.dropped", "system.network.tcp.retransmits"), "/s", optional=True),
)
# Titles of charts drawn because a cause names their metric.
EXTRA_TITLES = {"nvidia.gpu.throttle": "GPU clock throttling", "nvidia.gpu.xid.errors": "GPU XID errors",
                "system.memory.utilization": "Memory", "system.paging.utilization": "Paging",
                "hw.gpu.memory.utilization": "GPU memory"}
PANEL_METRICS = frozenset(n for p in HOST_PANELS for n in p.names)
# Attributes that only repeat what another one says (the GPU's model and index beside its hw.id).
_NOISE_ATTRIBUTES = frozenset({"hw.name", "gpu.index", "hw.type"})


def step_seconds(r: ChartRange) -> int:
    """The smallest nice bucket (seconds) that keeps a chart at MAX_BUCKETS points or fewer."""
    span_s = max((r.until_ns - r.since_ns) / NS, 1)
    return next((s for s in NICE_STEPS if span_s / s <= MAX_BUCKETS), NICE_STEPS[-1])


def bucket_means(points: Iterable[tuple[int, float]], *, since_ns: int, until_ns: int,
                 step_ns: int) -> list[float | None]:
    """The mean of the points in each bucket of [since, until); None where a bucket has none."""
    n = max(math.ceil((until_ns - since_ns) / step_ns), 1)
    sums, counts = [0.0] * n, [0] * n
    for t, v in points:
        i = (t - since_ns) // step_ns
        if 0 <= i < n and math.isfinite(v):
            sums[i] += v
            counts[i] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def rates(points: Sequence[tuple[int, float]], kind: MetricKind) -> list[tuple[int, float]]:
    """A counter's points as (time, per second) since the previous point; a reset (the total fell) is skipped."""
    out = []
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        dt = (t1 - t0) / NS
        if dt <= 0:
            continue
        delta = v1 if kind == MetricKind.SUM_DELTA else v1 - v0
        if delta >= 0:
            out.append((t1, delta / dt))
    return out


def _round(values: list[float | None], digits: int = 4) -> list[float | None]:
    def one(v: float | None) -> float | None:
        if v is None or v == 0:
            return v
        return round(v, max(digits - 1 - math.floor(math.log10(abs(v))), 0))

    return [one(v) for v in values]


def _axis(r: ChartRange, step_ns: int) -> list[float]:
    n = max(math.ceil((r.until_ns - r.since_ns) / step_ns), 1)
    return [(r.since_ns + i * step_ns) / NS for i in range(n)]


def latency_panel(windows: Sequence[LatencyWindow], r: ChartRange, baseline_ms: float,
                  before: Sequence[LatencyWindow]) -> dict[str, Any]:
    """p50/p95/p99 per window (a gap where a window had no request), the detector's baseline p99, and the
    band of normal p99: the 5th to 95th percentile of the window p99s before the spike (``before``)."""
    step = min((w.end_unix_nano - w.start_unix_nano for w in windows), default=10 * NS) or 10 * NS
    # The axis starts on a window boundary at or before the range, so every window has its slot.
    first = r.since_ns - (r.since_ns % step)
    n = max(math.ceil((r.until_ns - first) / step), 1)
    slots: list[list[float | None]] = [[None] * n for _ in range(3)]
    for w in windows:
        i = (w.start_unix_nano - first) // step
        if 0 <= i < n:
            for k, value in enumerate((w.p50_ns, w.p95_ns, w.p99_ns)):
                slots[k][i] = value / 1e6
    panel: dict[str, Any] = {
        "id": "latency", "kind": "latency", "title": "Latency", "unit": "ms",
        "x": [(first + i * step) / NS for i in range(n)],
        "series": [{"label": label, "values": _round(values)}
                   for label, values in zip(("p50", "p95", "p99"), slots, strict=True)],
        "baseline": round(baseline_ms, 3), "band": None, "window_seconds": step / NS,
    }
    normal = sorted(w.p99_ns / 1e6 for w in before)
    if len(normal) >= 6:
        panel["band"] = [round(_quantile(normal, 0.05), 3), round(_quantile(normal, 0.95), 3)]
    return panel


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted values (a p99 that really happened)."""
    return ordered[min(max(math.ceil(q * len(ordered)) - 1, 0), len(ordered) - 1)]


def hosts_of(causes: Sequence[Cause]) -> list[str]:
    """The hosts the causes name, best-ranked first, at most MAX_HOSTS."""
    hosts: list[str] = []
    for c in causes:
        if c.host and c.host not in hosts:
            hosts.append(c.host)
    return hosts[:MAX_HOSTS]


def extra_metrics(causes: Sequence[Cause], host: str) -> list[str]:
    """Metrics a resource cause on ``host`` names that no standard panel shows (throttling, XID, memory)."""
    out: list[str] = []
    for c in causes:
        if c.host == host and c.resource and c.resource not in PANEL_METRICS and c.resource not in out:
            out.append(c.resource)
    return out


def _label(series: KindedSeries) -> str:
    attrs = {k: v for k, v in sorted(series.attributes.items()) if k not in _NOISE_ATTRIBUTES}
    return " ".join(str(v) for v in attrs.values()) or series.name


def _values(series: KindedSeries, r: ChartRange, step_ns: int, unit: str) -> list[float | None]:
    points: Sequence[tuple[int, float]] = series.points
    if series.kind != MetricKind.GAUGE:
        points = rates(points, series.kind)
    scale = 100.0 if unit == "%" else 1.0
    return _round([None if v is None else v * scale
                   for v in bucket_means(points, since_ns=r.since_ns, until_ns=r.until_ns, step_ns=step_ns)])


def host_panels(host: str, series: Sequence[KindedSeries], r: ChartRange, causes: Sequence[Cause],
                first_id: int = 0) -> list[dict[str, Any]]:
    """The resource panels of one host, from the series ``host_series`` read for ``panel_metric_names``."""
    step_ns = step_seconds(r) * NS
    named = {c.resource for c in causes if c.host == host and c.resource}
    specs = [*HOST_PANELS, *(PanelSpec(f"x-{name}", EXTRA_TITLES.get(name, name), (name,), "")
                             for name in extra_metrics(causes, host))]
    panels: list[dict[str, Any]] = []
    for spec in specs:
        chosen: list[KindedSeries] = []
        for name in spec.names:  # the first name with data wins (a `.rate` gauge over its raw counter)
            found = [s for s in series if s.name == name and _kept(s, spec)]
            if found and not any(c.name.removesuffix(".rate") == name.removesuffix(".rate") for c in chosen):
                chosen += found
        if not chosen:
            continue
        unit = spec.unit or _unit(chosen[0])
        lines = [{"label": _label(s) if len(spec.names) == 1 else f"{_short(s.name)} {_label(s)}".strip(),
                  "values": _values(s, r, step_ns, unit)} for s in chosen[:MAX_SERIES_PER_PANEL]]
        quiet = not any(v for line in lines for v in line["values"])
        if spec.optional and quiet and not named & set(spec.names) and any(p["key"] == "net" for p in panels):
            continue
        panels.append({"id": f"p{first_id + len(panels)}", "kind": "resource", "key": spec.key, "host": host,
                       "title": spec.title, "unit": unit, "metrics": sorted({s.name for s in chosen}),
                       "x": _axis(r, step_ns), "series": lines,
                       "more": max(len(chosen) - MAX_SERIES_PER_PANEL, 0)})
    return panels


def panel_metric_names(causes: Sequence[Cause], host: str) -> list[str]:
    """Every metric name the panels of ``host`` may draw."""
    return [n for spec in HOST_PANELS for n in spec.names] + extra_metrics(causes, host)


def _kept(s: KindedSeries, spec: PanelSpec) -> bool:
    return not spec.keep or any(s.attributes.get(k) == v for k, v in spec.keep)


def _short(name: str) -> str:
    """``system.network.errors.rate`` -> ``errors``."""
    return name.removesuffix(".rate").rsplit(".", 1)[-1]


def _unit(s: KindedSeries) -> str:
    if s.kind != MetricKind.GAUGE:
        return "/s"
    return "%" if s.unit == "1" else s.unit
