"""The soak's event time through one detection engine, without daemons (``python -m benchmarks.soak --replay``).

A soak's accuracy mixes the detectors with what the machine did to the daemons: a starved collector counts
spans late, judges windows on part of their requests and names hops without their callee. The replay feeds
the same plan (:class:`harness.soak_traffic.SoakPlan`: the same seed, rate, faults, swings and churned names)
second by second, in event order, to one :class:`DetectionEngine` and scores it as the run is scored. It is
deterministic: the same settings give the same spikes on any machine, in the engine's time (about
38 us a span: the default 25 hours of event time, 63 million spans, took 40 minutes of one core). A run's own figures
should come close to it when its machine kept up; where they do not, the difference is the run's.

It also says what the detectors hold as event time goes by, with no restart in the way: at the start of every
event hour the size of the engine's checkpoint (its learned state, pickled) and the process's resident memory
(``state_mb_by_hour``, ``rss_mb_by_hour``; the plan of ``--hours 2 --speed 12.5 --rate 2000 --seed 41``:
7.4 MiB at hour 1, 12.2-13.0 MiB from hour 3 to hour 24, the process 394-417 MiB from hour 12). A state that
grows with time, not with the traffic's shape, shows there first.
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from harness.soak import SoakSettings, accuracy_figures, lateness_s, score
from harness.soak_traffic import SoakPlan
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.model import Spike
from spikehound.model_json import spike_json
from spikehound.units import NS

REPLAY_START_NS = 1_767_225_600 * NS  # 2026-01-01: any whole minute would do


def replay(settings: SoakSettings, state_every_s: int = 3600) -> dict[str, Any]:
    """The accuracy figures of a soak with ``settings`` (its storage, operations and samples play no part), and
    the detectors' state every ``state_every_s`` of event time."""
    plan = SoakPlan(seed=settings.seed, start_ns=REPLAY_START_NS, seconds=int(settings.hours * 3600 * settings.speed),
                    spans_per_s=settings.rate / settings.speed, fault_every_s=settings.fault_every,
                    churn=settings.churn)
    engine = DetectionEngine(DetectionSettings(allowed_lateness_ns=int(lateness_s(settings.speed) * NS)))
    spikes: dict[str, Spike] = {}
    spans = 0
    state_mb: list[float] = []
    rss_mb: list[float] = []
    held = 0.0  # process seconds spent measuring the state, left out of the engine's cost
    began = time.process_time()
    for second, (_, batch) in enumerate(plan.event_seconds()):
        if second % state_every_s == 0:
            measured = time.process_time()
            state_mb.append(round(len(engine.snapshot()) / 2**20, 2))
            rss_mb.append(round(psutil.Process().memory_info().rss / 2**20, 1))
            held += time.process_time() - measured
        engine.add(batch, [])
        spans += len(batch)
        spikes.update((s.id, s) for s in engine.advance().spikes)
    spikes.update((s.id, s) for s in engine.flush().spikes)
    accuracy = score(plan, [spike_json(s) for s in spikes.values()], float(plan.seconds))
    return {"storage": "replay", "event_hours": plan.seconds / 3600, "spans": spans,
            "engine_us_per_span": (time.process_time() - began - held) / max(spans, 1) * 1e6,
            "state_mb_by_hour": state_mb, "rss_mb_by_hour": rss_mb, **accuracy_figures(accuracy)}

