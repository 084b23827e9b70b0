"""Host resource samples on ``/metrics`` under the names monitoring articles and their dashboards use.

Fed from the writer thread with every committed batch of metric points (OpenTelemetry semantic-convention
names, from the agent or any OTLP sender), each series keeps its latest sample:

* ``gpu_utilization_percentage{host, gpu, gpu_uuid}`` from ``hw.gpu.utilization`` (a 0..1 ratio in OTLP;
  unit ``%`` is taken as it is). ``gpu`` is the ``gpu.index`` attribute, else ``hw.id``; only the general
  engine counts (no ``hw.gpu.task`` other than ``general``).
* ``cpu_load_average{host}`` from ``system.cpu.load_average.1m``.
* ``network_io_bytes_total``, ``network_errors_total`` and ``network_dropped_packets_total``
  ``{host, interface, direction}`` from the cumulative ``system.network.io`` / ``.errors`` / ``.dropped``
  (delta sums are added up). One series per interface: ``sum by (host) (rate(...))`` then survives an
  interface that disappears or an agent that restarts, which a pre-summed counter would turn into a spike.

A series not updated for ``stale_after_seconds`` (wall clock, by arrival) is dropped, so a host that went
away stops showing its last value. Series are bounded; points of further series are counted in
``spikehound_resource_metrics_overflow_points_total``.

>>> from spikehound.model import MetricKind, MetricPoint
>>> r = ResourceMetrics()
>>> r.add_points([MetricPoint(host="gpu-1", name="hw.gpu.utilization", attributes={"hw.id": "GPU-9a", "gpu.index": 0},
...                           time_unix_nano=1, value=0.25, kind=MetricKind.GAUGE, unit="1")])
>>> [(s.name, s.labels, s.value) for f in r.collect() for s in f.samples if s.name.startswith("gpu")]
[('gpu_utilization_percentage', {'host': 'gpu-1', 'gpu': '0', 'gpu_uuid': 'GPU-9a'}, 25.0)]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from spikehound.model import MetricKind, MetricPoint


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # the sample name as exposed
    kind: str  # "gauge" or "counter"
    doc: str
    labels: Callable[[MetricPoint], dict[str, str] | None]  # None: this point is not for the family
    scale: Callable[[MetricPoint], float] = lambda p: p.value


def _gpu_labels(p: MetricPoint) -> dict[str, str] | None:
    a = p.attributes
    if a.get("hw.gpu.task", "general") != "general":
        return None
    uuid = str(a.get("hw.id", ""))
    index = a.get("gpu.index")
    return {"host": p.host, "gpu": str(index) if index is not None else uuid or "0", "gpu_uuid": uuid}


def _network_labels(p: MetricPoint) -> dict[str, str]:
    a = p.attributes
    return {"host": p.host, "interface": str(a.get("network.interface.name", a.get("device", ""))),
            "direction": str(a.get("network.io.direction", a.get("direction", "")))}


def _network(name: str, doc: str) -> Family:
    return Family(name, "counter", doc, _network_labels)


FAMILIES: dict[str, Family] = {
    "hw.gpu.utilization": Family(
        "gpu_utilization_percentage", "gauge", "GPU utilization in percent (from hw.gpu.utilization).",
        _gpu_labels, lambda p: p.value if p.unit == "%" else p.value * 100.0),
    "system.cpu.load_average.1m": Family(
        "cpu_load_average", "gauge", "One-minute load average of the host (from system.cpu.load_average.1m).",
        lambda p: {"host": p.host}),
    "system.network.io": _network("network_io_bytes", "Bytes sent and received per interface "
                                  "(from system.network.io)."),
    "system.network.errors": _network("network_errors", "Network errors per interface "
                                      "(from system.network.errors)."),
    "system.network.dropped": _network("network_dropped_packets", "Packets dropped per interface "
                                       "(from system.network.dropped)."),
}


@dataclass(slots=True)
class _Latest:
    labels: dict[str, str]
    time_unix_nano: int
    value: float
    seen_at: float  # monotonic arrival, for staleness


class ResourceMetrics(Collector):
    """Latest value per series; a commit hook of the ingest pipeline, read when scraped."""

    def __init__(self, max_series: int = 5_000, stale_after_seconds: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_series = max_series
        self.stale_after_seconds = stale_after_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], _Latest] = {}
        self.overflow_points = 0

    def add(self, batch: Any) -> None:
        """Commit hook: take the metric points of a committed ``WriteBatch``."""
        if batch.points:
            self.add_points(batch.points)

    def add_points(self, points: Iterable[MetricPoint]) -> None:
        now = self._clock()
        with self._lock:
            for p in points:
                family = FAMILIES.get(p.name)
                if family is None:
                    continue
                labels = family.labels(p)
                if labels is None:
                    continue
                key = (family.name, tuple(labels.items()))
                latest = self._series.get(key)
                value = family.scale(p)
                if latest is None:
                    if len(self._series) >= self.max_series:
                        self.overflow_points += 1
                        continue
                    self._series[key] = _Latest(labels, p.time_unix_nano, value, now)
                elif p.kind == MetricKind.SUM_DELTA:
                    latest.value += value
                    latest.time_unix_nano, latest.seen_at = max(latest.time_unix_nano, p.time_unix_nano), now
                elif p.time_unix_nano >= latest.time_unix_nano:  # a replayed older sample never wins
                    latest.value, latest.time_unix_nano, latest.seen_at = value, p.time_unix_nano, now

    def collect(self) -> Iterator[Metric]:
        cutoff = self._clock() - self.stale_after_seconds
        with self._lock:
            for key in [k for k, v in self._series.items() if v.seen_at < cutoff]:
                del self._series[key]
            rows = [(name, latest.labels, latest.value) for (name, _), latest in self._series.items()]
            overflow = self.overflow_points
        families = {f.name: Metric(f.name, f.doc, f.kind) for f in FAMILIES.values()}
        for name, labels, value in sorted(rows, key=lambda r: (r[0], sorted(r[1].items()))):
            family = families[name]
            family.add_sample(name + ("_total" if family.type == "counter" else ""), labels, value)
        yield from (f for f in families.values() if f.samples)
        dropped = Metric("spikehound_resource_metrics_overflow_points", "Resource samples not exported because "
                         "collector.span_metrics_max_series resource series were already tracked.", "counter")
        dropped.add_sample("spikehound_resource_metrics_overflow_points_total", {}, overflow)
        yield dropped
