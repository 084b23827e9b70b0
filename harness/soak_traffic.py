"""The soak's traffic (``benchmarks/soak.py``): a day of mesh-shaped spans, made as it is sent, faster than real time.

:class:`SoakPlan` says what the event time holds: the mesh family's traffic
(:class:`harness.scenarios.mesh_traffic.MeshTimeline`, an hour per segment, each segment its own seed) at a
chosen span rate, a latency fault every ``fault_every_s`` of event time (kinds and services drawn from the
seed), a tenfold load drop now and then (between faults, so that a drop and its recovery are two 10x swings
the detectors must not page on), and name churn: a share of spans renamed to names never seen before, as a
badly templated route does (``GET /orders/8f3a..`` instead of ``GET /orders/{id}``).

Event time runs ``speed`` times faster than the wall clock and starts far enough in the past that it reaches
the present as the run ends (the collector refuses spans from its future, never ones from its past): a
two-hour run at speed 12 covers a day of event time.

:func:`send` is the body of the traffic process: it makes each second of event time when it is due, cuts it per
agent (the mesh's four nodes split between the agents), posts it as OTLP/HTTP protobuf and counts what the
agents acknowledged; a sample of acknowledged spans (canaries) goes back to the soak, which looks each one up
through the API: one not served once is lost or duplicated.

>>> plan = SoakPlan(seed=1, start_ns=1_767_225_600 * NS, seconds=3 * 3600, spans_per_s=300)
>>> [round(f.onset_s / 60) for f in plan.faults()][:3], plan.swings()  # minutes; the drop after the 6th fault
([16, 36, 51], [(7227, 8034)])
>>> import itertools
>>> first_minute = itertools.islice(plan.event_seconds(), 60)
>>> 150 < sum(len(spans) for _, spans in first_minute) / 60 < 450  # spans_per_s on average
True
"""

from __future__ import annotations

import contextlib
import multiprocessing.synchronize
import queue
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import requests

from harness.fault_campaign_parts import post_until_acked
from harness.scenarios.mesh_traffic import FAULT_KINDS, GATEWAY, NODES, MeshFault, MeshTimeline, reach
from spikehound.model import Span
from spikehound.otlp import encode_spans
from spikehound.units import NS

SEGMENT_S = 3600  # event seconds per MeshTimeline (each its own seed)
CHURN_MARK = "~"  # churned names carry it: "GET /api/v1/orders/~3f9c1a20"
_SPANS_PER_REQUEST = 40.5  # the mesh's average tree, measured (calibrate: 40.6 and 40.5 for seeds 1 and 2)


@dataclass(frozen=True, slots=True)
class SoakPlan:
    """What the soak's event time holds (see the module). Everything follows from ``seed``."""

    seed: int
    start_ns: int  # event time of second 0
    seconds: int  # event seconds in all
    spans_per_s: float  # per second of event time
    fault_every_s: float = 1200.0
    warmup_s: float = 600.0  # no fault before: baselines are learned
    swing_every: int = 6  # a tenfold drop after every sixth fault (every two hours at the default)
    churn: float = 0.01  # share of spans renamed to a name never seen before

    def faults(self) -> list[MeshFault]:
        """One fault per ``fault_every_s`` after the warm-up: 3.25 to 3.75 minutes, at a random point of its slot."""
        rng = random.Random(f"soak-faults/{self.seed}")
        shares = reach()
        targets = sorted(s for s, share in shares.items() if s != GATEWAY and share >= 0.04)
        out, slot = [], self.warmup_s
        while slot + self.fault_every_s <= self.seconds:
            onset = slot + rng.uniform(0, self.fault_every_s - 600)
            kind = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))]
            size = rng.uniform(1000, 2000) if kind != "cpu" else rng.uniform(200, 700)
            out.append(MeshFault(kind, rng.choice(targets), round(onset, 1), rng.uniform(195, 225), size))
            slot += self.fault_every_s
        return out

    def swings(self) -> list[tuple[float, float]]:
        """(start s, end s) of the tenfold load drops: from a minute after a fault's end to a minute before the
        next fault's onset, after every ``swing_every``-th fault."""
        faults = self.faults()
        out = []
        for i in range(self.swing_every - 1, len(faults) - 1, self.swing_every):
            start = faults[i].onset_s + faults[i].duration_s + 60
            end = faults[i + 1].onset_s - 60
            if end - start >= 300:
                out.append((round(start), round(end)))
        return out

    def pauses(self) -> list[tuple[float, float, str]]:
        """(start s, length s, service) of the calm service pauses of every hour (:attr:`MeshTimeline.pauses`)."""
        return [(k * SEGMENT_S + start, length, service) for k in range(-(-self.seconds // SEGMENT_S))
                for start, length, service in self.segment(k).pauses if k * SEGMENT_S + start < self.seconds]

    def rate_per_min(self) -> float:
        """User requests a minute that give ``spans_per_s`` on average."""
        return self.spans_per_s * 60 / _SPANS_PER_REQUEST

    def segment(self, k: int) -> MeshTimeline:
        """The ``k``-th hour of event time, with the faults and drops that overlap it (times relative to it)."""
        lo, hi = k * SEGMENT_S, (k + 1) * SEGMENT_S
        faults = [MeshFault(f.kind, f.service, f.onset_s - lo, f.duration_s, f.size_ms) for f in self.faults()
                  if f.onset_s < hi and f.onset_s + f.duration_s > lo]
        drop = next(((a - lo) / 3600, (b - lo) / 3600) for a, b in [*self.swings(), (-1e9, -1e9)]
                    if (a < hi and b > lo) or a == -1e9)
        return MeshTimeline(seed=self.seed * 1000 + k, hours=SEGMENT_S / 3600, faults=faults,
                            rate_per_min=self.rate_per_min(), load_drop=None if drop[0] < -1e5 else drop,
                            metrics=False, start_ns=self.start_ns + lo * NS)

    def event_seconds(self) -> Iterator[tuple[int, list[Span]]]:
        """(event second, the spans delivered in it), segment after segment; a segment's late deliveries spill
        into the next one's first seconds. Churned names are applied here."""
        rng = random.Random(f"soak-churn/{self.seed}")
        spill: dict[int, list[Span]] = defaultdict(list)
        churned = 0
        for k in range(-(-self.seconds // SEGMENT_S)):
            base = k * SEGMENT_S
            for batch in self.segment(k).batches():
                second = (batch.time_ns - self.start_ns) // NS
                if second >= self.seconds:
                    break  # the plan ends inside this segment: the rest of its hour is never generated
                if second >= base + SEGMENT_S:
                    spill[second].extend(batch.spans)
                    continue
                spans = spill.pop(second, []) + batch.spans
                for span in spans:
                    if rng.random() < self.churn:
                        churned += 1
                        span.name = f"{span.name.rsplit('/', 1)[0]}/{CHURN_MARK}{churned:x}{rng.getrandbits(24):06x}"
                yield second, spans
        for second in sorted(spill):
            if second < self.seconds:
                yield second, spill.pop(second)


def calibrate(seed: int = 1, minutes: float = 10.0) -> float:
    """Spans per user request of the mesh's traffic (what ``_SPANS_PER_REQUEST`` was set from)."""
    tl = MeshTimeline(seed=seed, hours=minutes / 60, faults=0, metrics=False)
    spans = sum(len(b.spans) for b in tl.batches())
    return spans / max(tl.requests, 1)


def agent_of(host: str | None, agents: int) -> int:
    """Which agent a host's spans go through: the nodes split evenly between the agents."""
    return NODES.index(host) % agents if host in NODES else 0


def send(plan: SoakPlan, endpoints: list[str], start_wall: float, speed: float,
         stop: multiprocessing.synchronize.Event, reports: Any, canary_every: int = 500) -> None:
    """The traffic process: event second ``i`` is sent once ``(i + 1) / speed`` wall seconds have passed since
    ``start_wall``. Puts a progress report on ``reports`` every 5 wall seconds and a last one (``done``)."""
    sessions = [requests.Session() for _ in endpoints]
    acked = rejected = retries = requests_sent = 0
    lag_s = max_lag_s = 0.0
    canaries: list[tuple[str, str, int]] = []  # (trace id hex, span id hex, end ns)
    last_report, second = time.monotonic(), -1
    error = ""

    def report(done: bool = False) -> None:
        nonlocal canaries
        body = {"acked": acked, "rejected": rejected, "retries": retries, "lag_s": lag_s, "max_lag_s": max_lag_s,
                "event_second": second, "canaries": canaries, "done": done, "error": error}
        canaries = []
        with contextlib.suppress(queue.Full):  # a soak that stopped reading: the last figures are enough
            reports.put(body, timeout=30)

    try:
        for second, spans in plan.event_seconds():
            if stop.is_set():
                break
            due = start_wall + (second + 1) / speed
            wait = due - time.time()
            if wait > 0:
                if stop.wait(wait):
                    break
                lag_s = 0.0
            else:
                lag_s = -wait
                max_lag_s = max(max_lag_s, lag_s)
            by_agent: dict[int, list[Span]] = defaultdict(list)
            for span in spans:
                by_agent[agent_of(span.host, len(endpoints))].append(span)
            for i, part in sorted(by_agent.items()):
                body = encode_spans(part).SerializeToString()
                outcome = post_until_acked(sessions[i], endpoints[i], body, stop)
                if outcome is None:
                    break
                retries += outcome.retries
                rejected += outcome.rejected
                if outcome.rejected:
                    continue
                acked += len(part)
                requests_sent += 1
                if requests_sent % canary_every == 0:
                    span = part[len(part) // 2]
                    canaries.append((span.trace_id.hex(), span.span_id.hex(), span.end_unix_nano))
            if time.monotonic() - last_report >= 5:
                report()
                last_report = time.monotonic()
    except Exception as exc:  # reported to the soak, which says so
        error = f"{exc.__class__.__name__}: {exc}"
    finally:
        report(done=True)
        for s in sessions:
            s.close()


__all__ = ["CHURN_MARK", "SoakPlan", "agent_of", "calibrate", "send"]
