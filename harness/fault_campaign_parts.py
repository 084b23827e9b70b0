"""Pieces of the storage-fault campaign (``benchmarks/fault_campaign.py``) that tests may share.

* :func:`build_dataset`: deterministic span traffic (the scenario suite's generator, seeded, several faults
  chained one after another on one continuous timeline) anchored at the run's own start, so that it arrives as
  live traffic does (backlogs after a fault are data from before it, live data is not); cut per second and
  per host, each (second, host) already encoded as an OTLP ``ExportTraceServiceRequest``.
* :class:`PacedSender`: one thread that posts its host's requests to one agent's OTLP/HTTP receiver at
  real-time pace (second ``i`` of event time once ``i + 1`` wall seconds have passed since the start),
  retrying what is refused, and records every span the agent acknowledged.
* :func:`post_until_acked`: one export request posted until the agent takes it (the soak's sender uses it too).
* :func:`notifications`: what a :class:`harness.webhook_receiver.WebhookReceiver` was sent, per alert.
* :func:`served_once`: every acknowledged span checked against ``GET /api/v1/traces/{id}``.
* :func:`spike_summary`, :func:`compare_spikes`: what is compared between a faulted and a fault-free run:
  spikes by their stream and their start relative to the run's, since the runs start at different times.

>>> ds = build_dataset(("slow_db",), warmup_s=20, fault_s=5, gap_s=5, seed=1, epoch_ns=EPOCH_NS)
>>> ds.seconds >= 30, sorted(ds.hosts), ds.spans > 1000
(True, ['edge-1', 'gpu-1', 'gpu-2', 'gpu-3'], True)
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from harness.scenarios.traffic import Scenario
from harness.webhook_receiver import WebhookReceiver
from spikehound.model import Span
from spikehound.otlp import encode_spans
from spikehound.timefmt import parse_time
from spikehound.units import NS

EPOCH_NS = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z: where a dataset built only to be described starts
GRID_NS = 60 * NS  # runs start on a whole minute: the windows (10 s) cut every run's traffic alike
PROTOBUF = {"Content-Type": "application/x-protobuf"}
SpanKey = tuple[str, str]  # (trace id hex, span id hex)


@dataclass(slots=True)
class Dataset:
    """Per second of event time, per host: the encoded request and the keys of its spans."""

    seconds: int
    by_host: dict[str, list[tuple[int, bytes, list[SpanKey]]]]
    spans: int
    faults: list[tuple[str, float, float]]  # (fault, onset s, end s) from the dataset's start
    epoch_ns: int  # where its event time starts

    @property
    def hosts(self) -> list[str]:
        return list(self.by_host)


def next_start_ns(lead_s: float = 3.0) -> int:
    """The first whole minute at least ``lead_s`` from now: where a run's event time starts."""
    earliest = time.time_ns() + int(lead_s * NS)
    return -(-earliest // GRID_NS) * GRID_NS


def build_dataset(faults: Sequence[str], *, warmup_s: float = 150.0, fault_s: float = 40.0, gap_s: float = 60.0,
                  tail_s: float = 0.0, seed: int = 7, rate: float = 20.0, epoch_ns: int) -> Dataset:
    """Normal traffic for ``warmup_s``, then each fault for ``fault_s`` followed by ``gap_s`` of normal traffic,
    then ``tail_s`` more of normal traffic; one segment per fault, each its own seeded scenario, back to back.

    Spans are delivered up to 2 s after they end (the generator's exporters), so a segment's last seconds spill
    into the next; all of it is merged per second of the one timeline.
    """
    per_second: dict[int, list[Span]] = defaultdict(list)
    offset_s = 0.0
    marks: list[tuple[str, float, float]] = []
    for i, fault in enumerate(faults):
        lead = warmup_s if i == 0 else 0.0
        length = lead + fault_s + gap_s + (tail_s if i == len(faults) - 1 else 0.0)
        start_ns = epoch_ns + int(offset_s * NS)
        sc = Scenario(fault, "large", seed=seed + i, minutes=length / 60, onset_s=lead, fault_s=fault_s, rate=rate,
                      start_ns=start_ns)
        marks.append((fault, offset_s + lead, offset_s + lead + fault_s))
        for batch in sc.batches():
            per_second[(batch.time_ns - epoch_ns) // NS].extend(batch.spans)
        offset_s += length
    seconds = max(per_second) + 1
    by_host: dict[str, list[tuple[int, bytes, list[SpanKey]]]] = defaultdict(list)
    total = 0
    for second in range(seconds):
        hosts: dict[str, list[Span]] = defaultdict(list)
        for span in per_second.get(second, []):
            hosts[span.host or "unknown"].append(span)
        for host, spans in sorted(hosts.items()):
            keys = [(s.trace_id.hex(), s.span_id.hex()) for s in spans]
            by_host[host].append((second, encode_spans(spans).SerializeToString(), keys))
            total += len(spans)
    return Dataset(seconds, dict(sorted(by_host.items())), total, marks, epoch_ns)


class PacedSender(threading.Thread):
    """Posts one host's requests to an agent's OTLP/HTTP receiver at real-time pace; records what was acked.

    A request is retried (after ``Retry-After`` or half a second) until the agent answers 200; its spans count
    as acknowledged then, less any the answer's ``partial_success`` rejected (counted in ``rejected``).
    """

    def __init__(self, host: str, endpoint: str, items: list[tuple[int, bytes, list[SpanKey]]], start_wall: float,
                 stop: threading.Event) -> None:
        super().__init__(name=f"sender-{host}", daemon=True)
        self.host, self.endpoint, self.items, self.start_wall, self.stop_event = host, endpoint, items, start_wall, stop
        self.acked: list[SpanKey] = []
        self.rejected = 0
        self.retries = 0
        self.max_lag_s = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with requests.Session() as session:
                for second, body, keys in self.items:
                    due = self.start_wall + second + 1
                    wait = due - time.time()
                    if wait > 0:
                        if self.stop_event.wait(wait):
                            return
                    else:
                        self.max_lag_s = max(self.max_lag_s, -wait)
                    self._post(session, body, keys)
        except BaseException as exc:  # reported by the campaign
            self.error = exc

    def _post(self, session: requests.Session, body: bytes, keys: list[SpanKey]) -> None:
        outcome = post_until_acked(session, self.endpoint, body, self.stop_event)
        if outcome is None:
            return
        self.retries += outcome.retries
        self.rejected += outcome.rejected
        if not outcome.rejected:  # which ones were rejected is not said: count none of this request as acked
            self.acked.extend(keys)


@dataclass(frozen=True, slots=True)
class Acked:
    """An export request the agent answered 200 to: after how many retries, with how many spans rejected."""

    retries: int
    rejected: int


def post_until_acked(session: requests.Session, endpoint: str, body: bytes, stop: threading.Event | Any
                     ) -> Acked | None:
    """POST ``body`` to ``endpoint``'s ``/v1/traces`` until it answers 200 (after ``Retry-After`` or half a
    second when refused or unreachable); None when ``stop`` was set first. Any other answer raises."""
    retries = 0
    while not stop.is_set():
        try:
            r = session.post(f"{endpoint}/v1/traces", data=body, headers=PROTOBUF, timeout=30)
        except requests.RequestException:
            retries += 1
            time.sleep(0.5)
            continue
        if r.status_code == 200:
            rejected = 0
            if r.content:
                rejected = ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans
            return Acked(retries, rejected)
        if r.status_code not in (429, 502, 503, 504):
            raise RuntimeError(f"agent {endpoint} answered {r.status_code}: {r.text[:300]}")
        retries += 1
        try:
            delay = float(r.headers.get("Retry-After", "0.5"))
        except ValueError:
            delay = 0.5
        time.sleep(min(max(delay, 0.1), 5.0))
    return None


def notifications(hook: WebhookReceiver) -> set[tuple[str, str, str]]:
    """(spike id, alert status, group's cause label) of every alert of every notification ``hook`` received."""
    out = set()
    for body in hook.bodies():
        for alert in body.get("alerts", []):
            out.add((alert.get("annotations", {}).get("spike_id", "?"), alert.get("status", "?"),
                     alert.get("labels", {}).get("cause", "?")))
    return out


def alert_config(hook_url: str) -> str:
    """The collector's TOML: one webhook receiver for every spike, timers short enough for a campaign."""
    return f"""
[[alerts.receivers]]
name = "campaign"
type = "webhook"
url = "{hook_url}"

[[alerts.routes]]
receiver = "campaign"
group_interval_seconds = 1
resolve_wait_seconds = 5
max_per_hour = 1000
"""


def served_once(api: str, acked: Iterable[SpanKey], workers: int = 8) -> tuple[int, int, int]:
    """(acknowledged spans, lost, duplicated) as ``GET /api/v1/traces/{id}`` serves every acked trace.

    Lost: an acked span the trace's answer does not hold (or the trace answers 404); duplicated: an acked span
    the answer holds more than once.
    """
    by_trace: dict[str, set[str]] = defaultdict(set)
    for trace, span in acked:
        by_trace[trace].add(span)
    local = threading.local()

    def check(trace: str) -> tuple[int, int]:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
        for _ in range(5):
            r = session.get(f"{api}/api/v1/traces/{trace}", timeout=30)
            if r.status_code in (200, 404):
                break
            time.sleep(1)
        wanted = by_trace[trace]
        if r.status_code == 404:
            return len(wanted), 0
        r.raise_for_status()
        counts: dict[str, int] = defaultdict(int)
        for span in r.json()["spans"]:
            counts[span["span_id"]] += 1
        return sum(1 for s in wanted if counts[s] == 0), sum(counts[s] - 1 for s in wanted if counts[s] > 1)

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(check, sorted(by_trace)))
    return sum(len(s) for s in by_trace.values()), sum(r[0] for r in results), sum(r[1] for r in results)


def _top_cause(spike: dict[str, Any]) -> tuple[Any, ...] | None:
    if not spike.get("causes"):
        return None
    c = spike["causes"][0]
    return (c["kind"], c["service"], c["operation"], c["peer_service"], c["host"], c["resource"])


def spike_key(spike: dict[str, Any], epoch_ns: int) -> str:
    """A spike named as runs of the same dataset started at different times can compare it: its stream and its
    start in seconds after the run's."""
    start_s = (parse_time(spike["start"]) - epoch_ns) / NS
    return f"{spike['service']} {spike['operation']!r} peer={spike.get('peer_service')} +{start_s:.0f}s"


def spike_summary(spikes: Iterable[dict[str, Any]], epoch_ns: int) -> dict[str, tuple[Any, ...]]:
    """key (see spike_key) -> (service, operation, start offset s, state, top cause (kind, service, operation,
    peer, host, resource))."""
    return {spike_key(s, epoch_ns): (s["service"], s["operation"], (parse_time(s["start"]) - epoch_ns) // NS,
                                     s["state"], _top_cause(s)) for s in spikes}


def compare_spikes(expected: dict[str, tuple[Any, ...]], got: dict[str, tuple[Any, ...]]) -> list[str]:
    """Every difference, one line each: a missing spike, an extra one, or a field that differs."""
    names = ("service", "operation", "start", "state", "top cause")
    out = [f"missing {i}: {expected[i]}" for i in sorted(expected.keys() - got.keys())]
    out += [f"extra {i}: {got[i]}" for i in sorted(got.keys() - expected.keys())]
    for i in sorted(expected.keys() & got.keys()):
        for name, a, b in zip(names, expected[i], got[i], strict=True):
            if a != b:
                out.append(f"spike {i}: {name} {a!r} in the fault-free run, {b!r} here")
    return out


@dataclass(slots=True)
class Recovery:
    """From a fault's end until the collector is ready and the agents' forwarded counters move again."""

    ready_s: float | None = None
    moving_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        if self.ready_s is None or self.moving_s is None:
            return None
        return max(self.ready_s, self.moving_s)


def wait_recovery(ready: Callable[[], bool], forwarded: Callable[[], float], since: float, before: float,
                  timeout: float = 180.0) -> Recovery:
    """Poll until ``ready()`` and ``forwarded()`` has grown past ``before``; times are from ``since`` (wall)."""
    out = Recovery()
    deadline = time.time() + timeout
    while time.time() < deadline and (out.ready_s is None or out.moving_s is None):
        now = time.time()
        if out.ready_s is None:
            try:
                if ready():
                    out.ready_s = now - since
            except Exception:  # refused while starting
                pass
        if out.moving_s is None:
            try:
                if forwarded() > before:
                    out.moving_s = now - since
            except Exception:  # an agent's /metrics slow to answer: next time
                pass
        time.sleep(0.1)
    if out.seconds is None:
        out.notes.append(f"not recovered within {timeout:g} s (ready {out.ready_s}, moving {out.moving_s})")
    return out
