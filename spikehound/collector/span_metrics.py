"""Span metrics on ``/metrics``: RED metrics derived from every committed span.

Two sets of series, both fed in bulk after each commit: by the detection process, which decodes every
committed span anyway, when detection runs in its own (its counts come back with its answers and are added
here, ``add_counts``), else from the writer thread (the ``add`` commit hook):

* The OpenTelemetry Collector **spanmetrics connector**'s series (v0.109 and later, as its Prometheus
  exporter writes them), so that Jaeger's Monitor tab and existing spanmetrics dashboards work unchanged:
  ``traces_span_metrics_calls_total`` and the histogram ``traces_span_metrics_duration_milliseconds``
  (``le`` in milliseconds, the connector's default buckets), labelled ``service_name``, ``span_name``,
  ``span_kind`` (``SPAN_KIND_SERVER``, ...) and ``status_code`` (``STATUS_CODE_UNSET``, ...). Every span
  counts, whatever its kind.
* ``model_inference_latency_seconds``: a histogram per ``service``, ``operation`` and ``host`` of entry
  spans (trace roots and SERVER spans), the name monitoring articles and their dashboards use. ``host`` (the
  resource's ``host.name``, empty when unknown) is what joins it to ``gpu_utilization_percentage{host}`` in
  the p99-high / GPU-low alert.

Series are bounded (``collector.span_metrics_max_series`` per set), and so are the characters of their label
values (``LABEL_CHARS_PER_SERIES`` on average per series, so that a few thousand long span names cannot make
``/metrics`` hundreds of megabytes: each series is written some twenty times). A span of a new series beyond
either bound is counted in ``spikehound_span_metrics_overflow_spans_total`` and aggregated into one overflow
series labelled ``otel_metric_overflow="true"``, as the connector does, so totals stay right. A series that
counted nothing for ``SERIES_IDLE_SECONDS`` (10 minutes) is dropped, as the connector's ``metrics_expiration``
does: the slots that one-off names took (a badly templated route) come free for the series that follow, and
Prometheus reads a series that comes back as a counter reset.

Why not ``Histogram.labels().observe()``: at 60,000 spans/s that costs several microseconds a span under
locks. Here a batch is one loop of dict look-ups and ``bisect`` into plain lists, written as text when
Prometheus scrapes (``exposition``).

>>> from spikehound.model import Span, SpanKind, StatusCode
>>> m = SpanMetrics(max_series=10)
>>> m.add_spans([Span(trace_id=b"\\x01" * 16, span_id=b"\\x02" * 8, parent_span_id=None, service="gateway",
...                   host=None, name="POST /predict", kind=SpanKind.SERVER, start_unix_nano=0,
...                   end_unix_nano=7_000_000, status=StatusCode.OK)])
>>> from prometheus_client.parser import text_string_to_metric_families
>>> calls, duration = list(text_string_to_metric_families(m.exposition().decode()))[:2]
>>> [(s.name, s.labels["span_kind"], s.value) for s in calls.samples]
[('traces_span_metrics_calls_total', 'SPAN_KIND_SERVER', 1.0)]
>>> [(s.labels["le"], s.value) for s in duration.samples if s.name.endswith("_bucket")][2:5]
[('6', 0.0), ('8', 1.0), ('10', 1.0)]
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.utils import floatToGoString

from spikehound.model import Span, SpanKind, StatusCode
from spikehound.units import MS, NS

log = logging.getLogger("collector.span_metrics")

# The spanmetrics connector's default explicit buckets, in milliseconds.
DURATION_BUCKETS_MS: tuple[float, ...] = (2, 4, 6, 8, 10, 50, 100, 200, 400, 800, 1000, 1400, 2000, 5000, 10_000,
                                          15_000)
INFERENCE_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                          10.0, 30.0, 60.0)
OVERFLOW_LABELS = {"otel_metric_overflow": "true"}
# Label value characters a set holds, per series it may hold: typical names take a fifth of it.
LABEL_CHARS_PER_SERIES = 128
SERIES_IDLE_SECONDS = 600.0  # a series that counted nothing for this long is dropped

_KIND_LABELS = {k: f"SPAN_KIND_{k.name}" for k in SpanKind}
_STATUS_LABELS = {s: f"STATUS_CODE_{s.name}" for s in StatusCode}
_SERVER = SpanKind.SERVER


def le_label(bound: float) -> str:
    """A bucket bound as Go's Prometheus client writes it (``2``, not ``2.0``).

    >>> le_label(2.0), le_label(0.0025), le_label(15000)
    ('2', '0.0025', '15000')
    """
    return format(bound, "g")


def _label_chars(key: tuple[Any, ...]) -> int:
    """Characters of a series key's string label values (what LABEL_CHARS_PER_SERIES budgets)."""
    return sum(len(part) for part in key if isinstance(part, str))


class _Histograms:
    """Per-key bucket counts in plain lists: ``row[i]`` counts durations in bucket i, ``row[-1]`` sums them (ns).

    A duration equal to a bound falls in that bound's bucket (``le`` is inclusive). Not thread-safe:
    ``SpanMetrics`` holds its lock around every use.
    """

    def __init__(self, bounds_ns: Sequence[int], max_series: int) -> None:
        self.bounds_ns = list(bounds_ns)
        self.max_series = max_series
        self.max_label_chars = max_series * LABEL_CHARS_PER_SERIES
        self.label_chars = 0  # of the string label values of every row's key
        self.rows: dict[Any, list[int]] = {}
        self.overflow_row = self.new_row()
        self.overflow_spans = 0

    def new_row(self) -> list[int]:
        return [0] * (len(self.bounds_ns) + 2)

    def row_for_new(self, key: tuple[Any, ...], spans: int = 1) -> list[int]:
        """The row a key without one gets: its own while both bounds allow, else the overflow row (which then
        counts ``spans`` more spans of keys that got none)."""
        if len(self.rows) < self.max_series:  # once full, every span of a new key comes here: keep it cheap
            chars = _label_chars(key)
            if self.label_chars + chars <= self.max_label_chars:
                self.label_chars += chars
                row = self.rows[key] = self.new_row()
                return row
        self.overflow_spans += spans
        return self.overflow_row

    def add_rows(self, rows: dict[Any, list[int]]) -> None:
        """Add rows counted elsewhere (``SpanCounts``), key by key, within the bounds."""
        get = self.rows.get
        for key, counted in rows.items():
            row = get(key)
            if row is None:
                row = self.row_for_new(key, sum(counted[:-1]))
            for i, n in enumerate(counted):
                row[i] += n

    def take_rows(self) -> dict[Any, list[int]]:
        """The rows counted so far, which start again from none."""
        rows, self.rows, self.label_chars = self.rows, {}, 0
        return rows

    def drop_idle(self, counted_before: dict[Any, int]) -> dict[Any, int]:
        """Drop the rows whose count is what ``counted_before`` (the last sweep's return) says; each row's count."""
        counts: dict[Any, int] = {}
        for key, row in list(self.rows.items()):
            n = sum(row[:-1])
            if counted_before.get(key) == n:
                del self.rows[key]
                self.label_chars -= _label_chars(key)
            else:
                counts[key] = n
        return counts

    def snapshot(self) -> tuple[list[tuple[Any, list[int]]], list[int]]:
        return [(k, row[:]) for k, row in self.rows.items()], self.overflow_row[:]


@dataclass(frozen=True, slots=True)
class SpanCounts:
    """Rows of both sets counted by one instance, to be added to another's (``SpanMetrics.add_counts``)."""

    calls: dict[Any, list[int]]
    entry: dict[Any, list[int]]


class SpanMetrics:
    """Aggregates committed spans; written on ``/metrics`` after the registry (``CollectorTelemetry.expositions``)."""

    def __init__(self, max_series: int = 5_000, clock: Callable[[], float] = time.monotonic, *,
                 drop_idle: bool = True) -> None:
        self._lock = threading.Lock()
        self._calls = _Histograms([round(b * MS) for b in DURATION_BUCKETS_MS], max_series)
        self._entry = _Histograms([round(b * NS) for b in INFERENCE_BUCKETS_S], max_series)
        self.errors = 0
        self.dropped_series = 0
        self._clock = clock
        # An instance that only counts for another (``take_counts``) holds one message's counts at a time: a row
        # of it that counted as much as at the last sweep is not idle, and must not be dropped uncounted.
        self._next_sweep = clock() + SERIES_IDLE_SECONDS if drop_idle else math.inf
        self._counted: tuple[dict[Any, int], dict[Any, int]] = ({}, {})  # each row's count at the last sweep

    def add(self, batch: Any) -> None:
        """Commit hook of the ingest pipeline: take the spans of a committed ``WriteBatch``.

        It runs after the commit, so it must never raise: a failure is logged once and counted.
        """
        spans = batch.spans
        if not spans:
            return
        try:
            self.add_spans(spans)
        except Exception as exc:
            self.errors += 1
            if self.errors == 1:
                log.exception("span metrics could not take a batch (%s); counting in "
                              "spikehound_span_metrics_errors_total from now on", exc.__class__.__name__)

    def add_counts(self, counts: SpanCounts) -> None:
        """Take what ``take_counts`` of another instance returned (the detection process counts the spans it
        decodes, and the collector's instance, the one scraped, adds its counts after each commit)."""
        with self._lock:
            self._calls.add_rows(counts.calls)
            self._entry.add_rows(counts.entry)
            if self._clock() >= self._next_sweep:
                self._drop_idle()

    def take_counts(self) -> SpanCounts:
        """What was counted since the last call (or since start), which starts again from nothing; for an
        instance that only counts (``max_series`` as large as a message's distinct series can be, and
        ``drop_idle=False``)."""
        with self._lock:
            return SpanCounts(self._calls.take_rows(), self._entry.take_rows())

    def add_spans(self, spans: Iterable[Span]) -> None:
        calls, entry = self._calls, self._entry
        calls_get, entry_get = calls.rows.get, entry.rows.get
        calls_bounds, entry_bounds = calls.bounds_ns, entry.bounds_ns
        with self._lock:
            for s in spans:  # the hot loop: ~0.5 us a span; keep it free of calls that are not needed
                duration = s.end_unix_nano - s.start_unix_nano
                key = (s.service, s.name, s.kind, s.status)
                row = calls_get(key)
                if row is None:
                    row = calls.row_for_new(key)
                row[bisect_left(calls_bounds, duration)] += 1
                row[-1] += duration
                if s.parent_span_id is None or s.kind == _SERVER:
                    stream = (s.service, s.name, s.host)
                    row = entry_get(stream)
                    if row is None:
                        row = entry.row_for_new(stream)
                    row[bisect_left(entry_bounds, duration)] += 1
                    row[-1] += duration
            if self._clock() >= self._next_sweep:
                self._drop_idle()

    def _drop_idle(self) -> None:
        """Under the lock, every SERIES_IDLE_SECONDS: the series that counted nothing since the last sweep go."""
        before = len(self._calls.rows) + len(self._entry.rows)
        self._counted = (self._calls.drop_idle(self._counted[0]), self._entry.drop_idle(self._counted[1]))
        self.dropped_series += before - len(self._calls.rows) - len(self._entry.rows)
        self._next_sweep = self._clock() + SERIES_IDLE_SECONDS

    @property
    def overflow_spans(self) -> int:
        return self._calls.overflow_spans + self._entry.overflow_spans

    @property
    def series(self) -> int:
        return len(self._calls.rows) + len(self._entry.rows)

    def exposition(self) -> bytes:
        """The span metrics in Prometheus's text format (what ``/metrics`` appends to the registry's).

        Written series by series, not through ``prometheus_client``'s sample objects: a scrape of 2,000 series
        made 40,000 of them (a labels dict and a tuple each) alive at once, a burst of 21 MB in Python's
        small-object arenas every scrape, which objects allocated meanwhile by ingest kept from being given
        back. Here each series' lines are joined into one string as soon as they are written (a histogram's,
        some 3 KB, is the C allocator's, which gives it back), so a scrape holds a string and a labels dict a
        series: no arena more (``benchmarks/arena_bursts.py``), and a sixth of the time.
        """
        with self._lock:
            calls_rows, calls_overflow = self._calls.snapshot()
            entry_rows, entry_overflow = self._entry.snapshot()
            overflow_spans = (self._calls.overflow_spans, self._entry.overflow_spans)
        calls_series = [({"service_name": service, "span_name": name, "span_kind": _KIND_LABELS[kind],
                          "status_code": _STATUS_LABELS[status]}, row)
                        for (service, name, kind, status), row in calls_rows]
        if sum(calls_overflow[:-1]):
            calls_series.append((OVERFLOW_LABELS, calls_overflow))
        entry_series = [({"service": service, "operation": operation, "host": host or ""}, row)
                        for (service, operation, host), row in entry_rows]
        if sum(entry_overflow[:-1]):
            entry_series.append((OVERFLOW_LABELS, entry_overflow))
        calls_les = [le_label(b) for b in DURATION_BUCKETS_MS]
        entry_les = [le_label(b) for b in INFERENCE_BUCKETS_S]
        chunks = [_family("traces_span_metrics_calls_total", "counter", "Spans received, by service, span name, "
                          "kind and status (OpenTelemetry spanmetrics connector).")]
        chunks += [f"traces_span_metrics_calls_total{{{_labels(labels)}}} {_number(_total(row))}\n"
                   for labels, row in calls_series]
        chunks.append(_family("traces_span_metrics_duration_milliseconds", "histogram", "Span durations in "
                              "milliseconds (OpenTelemetry spanmetrics connector)."))
        chunks += [_histogram("traces_span_metrics_duration_milliseconds", labels, row, calls_les, 1e6)
                   for labels, row in calls_series]
        chunks.append(_family("model_inference_latency_seconds", "histogram", "Latency of entry spans (trace roots "
                              "and SERVER spans) per service, operation and host, in seconds."))
        chunks += [_histogram("model_inference_latency_seconds", labels, row, entry_les, 1e9)
                   for labels, row in entry_series]
        chunks += [
            _family("spikehound_span_metrics_overflow_spans_total", "counter", "Spans aggregated into the overflow "
                    "series because collector.span_metrics_max_series (or the label characters those series may "
                    "hold) was reached."),
            f'spikehound_span_metrics_overflow_spans_total{{set="spanmetrics"}} {_number(overflow_spans[0])}\n'
            f'spikehound_span_metrics_overflow_spans_total{{set="model_inference"}} {_number(overflow_spans[1])}\n',
            _family("spikehound_span_metrics_dropped_series_total", "counter", "Span metric series dropped after "
                    "counting nothing for 10 minutes (their slots come free for new series)."),
            f"spikehound_span_metrics_dropped_series_total {_number(self.dropped_series)}\n",
            _family("spikehound_span_metrics_errors_total", "counter",
                    "Committed batches the span metrics could not take."),
            f"spikehound_span_metrics_errors_total {_number(self.errors)}\n"]
        return "".join(chunks).encode()


def _family(name: str, kind: str, help_text: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def _escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def _number(value: float) -> str:
    return floatToGoString(value)


def _total(row: list[int]) -> int:
    """A row's spans: its buckets and the count above the last bound (``row[-2]``)."""
    return sum(row[:-1])


def _histogram(name: str, labels: dict[str, str], row: list[int], les: list[str], per_unit: float) -> str:
    """One series' cumulative buckets, +Inf, sum and count, as one string.

    >>> print(_histogram("d", {"span_name": 'a"b'}, [1, 2, 3, 7], ["5", "10"], 1.0), end="")
    d_bucket{le="5",span_name="a\\"b"} 1.0
    d_bucket{le="10",span_name="a\\"b"} 3.0
    d_bucket{le="+Inf",span_name="a\\"b"} 6.0
    d_sum{span_name="a\\"b"} 7.0
    d_count{span_name="a\\"b"} 6.0
    """
    # Labels sorted, ``le`` among them, as prometheus_client writes them.
    before = _labels({k: v for k, v in labels.items() if k < "le"})
    after = _labels({k: v for k, v in labels.items() if k > "le"})
    head = f"{name}_bucket{{{before}{',' if before else ''}le=\""
    tail = f"\"{',' if after else ''}{after}}} "
    lines, cumulative = [], 0
    for le, n in zip(les, row, strict=False):
        cumulative += n
        lines.append(f"{head}{le}{tail}{_number(cumulative)}\n")
    total = cumulative + row[-2]
    plain = _labels(labels)
    lines.append(f"{head}+Inf{tail}{_number(total)}\n{name}_sum{{{plain}}} {_number(row[-1] / per_unit)}\n"
                 f"{name}_count{{{plain}}} {_number(total)}\n")
    return "".join(lines)
