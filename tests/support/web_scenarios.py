"""Data and a browser for the web page tests: real spikes from the scenario generator, and Debian's Chromium.

``spike_database()`` sends two scenarios of ``harness/scenarios/traffic.py`` as real
OTLP/HTTP requests to a real collector, once per test session, and keeps the
SQLite file; each test module starts its own collector on a copy of it:

* ``gpu_drop``: the GPU of gpu-2 slows down (its utilization falls, its clocks
  throttle); the spike on ``gateway POST /v1/predict`` names it.
* one hour later, ``slow_db`` sent by a hostile service: the slow feature query
  is named ``<img src=x onerror=alert(1)>`` and carries script in its
  attributes, and the postprocess service calls itself ``<svg/onload=...>``.
  The spike's causes, waterfalls and every list then carry these names.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.daemons import CollectorThread, collector_config
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Batch, Scenario
from spikehound.model import Span
from spikehound.units import NS

EVIL_SPAN = "<img src=x onerror=alert(1)>"
EVIL_ATTRIBUTE = "<script>alert(2)</script>"
EVIL_SERVICE = "<svg/onload=alert(3)>"
START_S = 1_767_225_600  # 2026-01-01T00:00:00Z


class HostileScenario(Scenario):
    """A scenario whose senders put markup in span names, service names and attributes."""

    def batches(self) -> Iterator[Batch]:
        for batch in super().batches():
            batch.spans = [_hostile(s) for s in batch.spans]
            yield batch


def _hostile(s: Span) -> Span:
    name = EVIL_SPAN if s.name == "SELECT features" else s.name
    service = EVIL_SERVICE if s.service == "postprocess" else s.service
    if (name, service) == (s.name, s.service):
        return s
    attributes = {"db.statement": EVIL_ATTRIBUTE, EVIL_ATTRIBUTE: "a key with markup"} if name == EVIL_SPAN else {}
    return Span(trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_span_id, service=service,
                host=s.host, name=name, kind=s.kind, start_unix_nano=s.start_unix_nano,
                end_unix_nano=s.end_unix_nano, status=s.status, attributes=attributes, resource=s.resource)


def scenarios() -> list[Scenario]:
    common: dict[str, Any] = {"strength": "large", "seed": 3, "minutes": 5, "onset_s": 212.0, "fault_s": 60.0}
    return [Scenario("gpu_drop", start_ns=START_S * NS, **common),
            HostileScenario("slow_db", start_ns=(START_S + 3600) * NS, **common)]


@dataclass(frozen=True, slots=True)
class SpikeData:
    path: Path  # a SQLite database holding both scenarios, their windows, samples and spikes
    gpu_spike: dict[str, Any]  # the gpu_drop spike on gateway POST /v1/predict (API shape)
    hostile_spike: dict[str, Any]  # the slow_db spike on gateway POST /v1/predict, named by the hostile sender


@functools.cache
def spike_database() -> SpikeData:
    """Built once per test session (about 40 s on two cores), removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="spikehound-web-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "spikes.db"
    with CollectorThread(collector_config(f"sqlite:///{path}")) as collector:
        for sc in scenarios():
            send(collector.http_endpoint, scenario_requests(sc))
        spikes = _settled(collector)
    gateway = sorted((s for s in spikes if (s["service"], s["operation"]) == ("gateway", "POST /v1/predict")),
                     key=lambda s: s["start"])
    assert len(gateway) == 2, f"expected a spike on the gateway in each scenario, got {spikes}"
    return SpikeData(path, gateway[0], gateway[1])


def _settled(collector: CollectorThread, timeout: float = 60) -> list[dict[str, Any]]:
    """The spikes once detection has settled (no window open, every judged window written:
    ``harness.daemons.detection_settled``) and every spike is resolved."""
    return collector.spikes_once_settled(timeout, done=lambda spikes: bool(spikes) and all(
        s["state"] == "resolved" for s in spikes))


def collector_on_copy(data: SpikeData, folder: Path, **settings: Any) -> CollectorThread:
    """A collector (not started) on a copy of the scenario database."""
    copy = folder / "spikes.db"
    for part in data.path.parent.glob(data.path.name + "*"):  # the database, and its WAL if one is left
        shutil.copyfile(part, folder / part.name)
    return CollectorThread(collector_config(f"sqlite:///{copy}", **settings))
