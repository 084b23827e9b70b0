"""Spike state on ``/metrics``, read from storage when Prometheus scrapes.

* ``spikehound_open_spikes{service}``: spikes open now, per service (services without one are not listed;
  ``sum(spikehound_open_spikes) or vector(0)`` gives the total);
* ``spikehound_spikes_opened_total{cause_kind}``: spikes stored so far by the kind of their top-ranked cause
  (``span``, ``service``, ``network``, ``resource``; ``none`` while attribution has found nothing). Spikes are
  never deleted, so the count only grows; a spike whose top cause changes kind while it lasts moves between
  the series.

The detection engine writes the ``spikes`` and ``causes`` tables; this module only reads them, at most once
per ``refresh_seconds`` however many scrapers ask (both queries are small: the table holds spikes, not spans).
A failing query is logged, counted in ``spikehound_spike_metrics_errors_total`` and leaves the spike series
out of that scrape rather than showing stale numbers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from spikehound.storage.reader import Reader

log = logging.getLogger("spikehound.collector.spike_metrics")

MAX_OPEN_SPIKES_READ = 100_000


class SpikeMetrics(Collector):
    """Open spikes per service and spikes opened per top cause kind, cached for ``refresh_seconds``."""

    def __init__(self, reader: Reader, refresh_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = reader
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._lock = threading.Lock()  # one query at a time; concurrent scrapes share its answer
        self._read_at: float | None = None
        self._open: dict[str, int] | None = None
        self._opened: dict[str, int] | None = None
        self.errors = 0

    def _refresh(self) -> None:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self.refresh_seconds:
            return
        self._read_at = now
        try:
            spikes = self.reader.spikes(state="open", limit=MAX_OPEN_SPIKES_READ)
            opened = self.reader.spikes_by_top_cause_kind()
        except Exception as exc:
            self.errors += 1
            self._open = self._opened = None
            log.warning("spike metrics: reading spikes failed: %s: %s", exc.__class__.__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "")
            return
        self._open = dict(Counter(s.service for s in spikes))
        self._opened = opened

    def describe(self) -> Iterator[Metric]:
        """The families, without querying storage (the registry asks when this collector is registered)."""
        yield Metric("spikehound_open_spikes", "", "gauge")
        yield Metric("spikehound_spikes_opened", "", "counter")
        yield Metric("spikehound_spike_metrics_errors", "", "counter")

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._refresh()
            open_by_service, opened = self._open, self._opened
        if open_by_service is not None and opened is not None:
            gauge = Metric("spikehound_open_spikes", "Spikes open now, per service.", "gauge")
            for service, n in sorted(open_by_service.items()):
                gauge.add_sample("spikehound_open_spikes", {"service": service}, n)
            yield gauge
            counter = Metric("spikehound_spikes_opened", "Spikes opened so far, by the kind of their top cause "
                             "(none: no cause found yet).", "counter")
            for kind, n in sorted(opened.items()):
                counter.add_sample("spikehound_spikes_opened_total", {"cause_kind": kind}, n)
            yield counter
        errors = Metric("spikehound_spike_metrics_errors", "Scrapes whose spike query failed.", "counter")
        errors.add_sample("spikehound_spike_metrics_errors_total", {}, self.errors)
        yield errors
