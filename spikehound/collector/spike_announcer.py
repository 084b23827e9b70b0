"""What becomes of spike states once they are committed: a log line when a spike opens or ends, the spike
counters, and the listeners (alerting). Shared by the pipeline (one collector) and a cluster's leader."""

from __future__ import annotations

import logging
from collections.abc import Callable

from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.detectors.engine import Detection
from spikehound.model import Spike
from spikehound.text import printable

log = logging.getLogger("spikehound.collector.pipeline")


class SpikeAnnouncer:
    """Told of every committed detector step (``written``); knows which spikes are open (``open_ids``)."""

    def __init__(self, telemetry: CollectorTelemetry) -> None:
        self.telemetry = telemetry
        # Called on the event loop with every spike state written (opened, updated, resolved).
        self.listeners: list[Callable[[list[Spike]], None]] = []
        self.open_ids: set[str] = set()

    def written(self, done: Detection) -> None:
        """Account for windows and spikes that were just committed, and tell the listeners."""
        self.telemetry.windows_closed.inc(len(done.windows))
        if not done.spikes:
            return
        for spike in done.spikes:
            self.telemetry.spikes.labels(self._announce(spike)).inc()
        for listener in self.listeners:
            try:
                listener(done.spikes)
            except Exception:
                log.exception("spike listener failed")

    def _announce(self, spike: Spike) -> str:
        # Names come from senders: shown escaped, so a span name cannot forge or recolour a log line.
        what = (f"{printable(spike.service, 255)} {spike.operation[:1024]!r}: p99 {spike.p99_ns / 1e6:.1f} ms "
                f"against {spike.baseline_p99_ns / 1e6:.1f} ms")
        top = printable(spike.causes[0].summary, 2048) if spike.causes else "no cause found yet"
        if spike.state == "resolved":
            self.open_ids.discard(spike.id)
            log.info("spike %s resolved on %s", spike.id, what)
            return "resolved"
        if spike.id not in self.open_ids:
            self.open_ids.add(spike.id)
            log.warning("spike %s opened on %s; top cause: %s", spike.id, what, top)
            return "opened"
        return "updated"
