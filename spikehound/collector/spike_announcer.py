"""What becomes of spike states once they are committed: a log line when a spike opens or ends, the spike
counters, and the listeners (alerting). The detection driver announces through it, for a single collector and
a cluster's leader alike."""

from __future__ import annotations

import logging
from typing import Protocol

from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.detectors.engine import Detection
from spikehound.model import Spike
from spikehound.text import printable

log = logging.getLogger("spikehound.collector.detection")


class SpikeListener(Protocol):
    """Told of spike states once they are committed (alerting's ``observe``).

    Called on the event loop, after the commit that wrote the states (a single collector's pipeline task, or
    the leader's task), with every state in the order the detectors produced them: a spike that opened and
    resolved between two commits comes as both. It must not block (it holds up ingest or the leader's next
    step: anything slow goes to a task or a thread of its own) and should not raise; an exception is logged
    with its traceback and the other listeners are still told, but the states are not told again.
    """

    def __call__(self, spikes: list[Spike], /) -> None: ...


class SpikeAnnouncer:
    """Told of every committed detector step (``written``); knows which spikes are open (``open_ids``)."""

    def __init__(self, telemetry: CollectorTelemetry) -> None:
        self.telemetry = telemetry
        # Called with every spike state written (opened, updated, resolved); see SpikeListener.
        self.listeners: list[SpikeListener] = []
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
