"""Realistic AI-inference traffic with injected faults: the scenario suite's generator.

A request enters the gateway (edge-1) and fans out, one hop at a time, to three
services on three GPU hosts (gpu-1..3, picked per request as a load balancer
would): preprocess (image decode and resize, plus a feature-store query in
PostgreSQL), the model server (batching queue, then the forward pass on the
GPU) and postprocess (decode and render). Every hop is a CLIENT span on the
caller and a SERVER span on the callee, with network time in between.
Durations are log-normal (heavy-tailed), and a rare request stalls for tens of
milliseconds somewhere. Beside the main endpoint, every scenario carries a
low-traffic endpoint (``GET /v1/models``, one request every few seconds) and a
microsecond health check that jitters between 20 and 200 µs. Every host sends
CPU, memory and network samples every second, and the GPU hosts NVML-style GPU
samples, under the agent's metric names.

Faults (:data:`FAULTS`) are injected after a warm-up, each at a large strength
and a subtle one that lifts the gateway's p99 by about 30 %; controls
(:data:`CONTROLS`) must raise nothing. Everything is drawn from one seeded
generator, so a scenario is the same every time.

>>> sc = Scenario("slow_db", "large", seed=1, minutes=3, onset_s=120, fault_s=30)
>>> batches = list(sc.batches())
>>> sum(len(b.spans) for b in batches) > 10_000, sc.truth().service
(True, 'preprocess')
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from spikehound.model import MetricKind, MetricPoint, Span, SpanKind, StatusCode
from spikehound.units import MS, NS

__all__ = ["CONTROLS", "FAULTS", "Batch", "Scenario", "Truth", "poisson"]

GPU_HOSTS = ("gpu-1", "gpu-2", "gpu-3")
ENTRY = ("gateway", "POST /v1/predict")

FAULTS = ("cpu_preprocess", "slow_db", "network_hop", "gpu_drop", "queue_wait", "downstream_slow")
CONTROLS = ("steady", "diurnal_ramp", "traffic_gap", "single_outliers", "microsecond_jitter", "low_traffic")

# Added milliseconds per affected request for each fault at each strength. The subtle ones lift the
# gateway's p99 (about 75 ms here) by roughly 30 %.
_FAULT_MS = {
    "large": {"cpu_preprocess": 60.0, "slow_db": 60.0, "network_hop": 60.0, "gpu_drop": 70.0,
              "queue_wait": 60.0, "downstream_slow": 60.0},
    "subtle": {"cpu_preprocess": 24.0, "slow_db": 24.0, "network_hop": 24.0, "gpu_drop": 28.0,
               "queue_wait": 24.0, "downstream_slow": 24.0},
}


@dataclass(frozen=True, slots=True)
class Truth:
    """What an injected fault is, as a cause would name it."""

    fault: str
    kind: str  # the cause kind that names it best
    service: str
    operation: str | None = None
    peer_service: str | None = None
    host: str | None = None
    resources: tuple[str, ...] = ()


_TRUTH = {
    "cpu_preprocess": Truth("cpu_preprocess", "span", "preprocess", "resize", resources=("system.cpu.utilization",)),
    "slow_db": Truth("slow_db", "span", "preprocess", "SELECT features"),
    "network_hop": Truth("network_hop", "network", "model-server", "POST /infer", peer_service="gateway"),
    "gpu_drop": Truth("gpu_drop", "resource", "model-server", "forward", host="gpu-2",
                      resources=("hw.gpu.utilization", "nvidia.gpu.throttle")),
    "queue_wait": Truth("queue_wait", "span", "model-server", "batch_queue"),
    "downstream_slow": Truth("downstream_slow", "service", "postprocess"),
}


@dataclass(slots=True)
class Batch:
    """One second of telemetry as it reaches the collector."""

    time_ns: int
    spans: list[Span] = field(default_factory=list)
    points: list[MetricPoint] = field(default_factory=list)


class Scenario:
    """One run: a fault at a strength, or a control (strength is then ignored)."""

    def __init__(self, name: str, strength: str = "large", seed: int = 0, minutes: float = 14.0,
                 onset_s: float | None = None, fault_s: float = 180.0, rate: float = 20.0,
                 start_ns: int = 1_767_225_600 * NS) -> None:
        if name not in FAULTS and name not in CONTROLS:
            raise ValueError(f"unknown scenario {name!r}")
        self.name = name
        self.strength = strength
        self.seed = seed
        self.duration_s = minutes * 60
        # After 8 minutes of warm-up, anywhere within a window: detection delay depends on where.
        self.onset_s = onset_s if onset_s is not None else 480.0 + (seed * 3.7 + 1.3) % 10
        self.fault_s = fault_s
        self.rate = rate
        self.start_ns = start_ns
        self._rng = random.Random(f"{name}/{strength}/{seed}")
        self._next_id = 1

    # -- what happened -------------------------------------------------------

    @property
    def is_fault(self) -> bool:
        return self.name in FAULTS

    @property
    def onset_ns(self) -> int:
        return self.start_ns + int(self.onset_s * NS)

    @property
    def fault_end_ns(self) -> int:
        return self.onset_ns + int(self.fault_s * NS)

    @property
    def end_ns(self) -> int:
        return self.start_ns + int(self.duration_s * NS)

    def truth(self) -> Truth:
        return _TRUTH[self.name]

    def label(self) -> str:
        return f"{self.name}/{self.strength}" if self.is_fault else self.name

    # -- traffic -------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Telemetry second by second, spans arriving up to 2 s out of order as exporters batch them."""
        rng = self._rng
        pending: dict[int, Batch] = {}
        seconds = int(self.duration_s)
        for second in range(seconds):
            t0 = self.start_ns + second * NS
            rate = self._rate(second)
            for _ in range(poisson(rng, rate)):
                self._request(t0 + rng.randrange(NS), pending, second)
            for _ in range(poisson(rng, 0.3)):
                self._simple_request(t0 + rng.randrange(NS), "GET /v1/models", 8.0, 0.4, pending, second)
            for _ in range(poisson(rng, 5.0)):
                self._health(t0 + rng.randrange(NS), pending, second)
            batch = pending.setdefault(second, Batch(t0))
            batch.points.extend(self._samples(t0, second))
            yield pending.pop(second)
        for second in sorted(pending):
            yield pending.pop(second)

    def _rate(self, second: int) -> float:
        if self.name == "diurnal_ramp":
            # Morning ramp: a quarter of the load to double it, across the run.
            return self.rate * (0.5 + 1.5 * second / self.duration_s)
        if self.name == "traffic_gap" and self.onset_s <= second < self.onset_s + 120:
            return 0.0
        if self.name == "low_traffic":
            return 0.5  # the main endpoint itself: five requests a window, judged over merged windows
        return self.rate

    def _active(self, t_ns: int) -> bool:
        return self.is_fault and self.onset_ns <= t_ns < self.fault_end_ns

    def _extra_ms(self, rng: random.Random) -> float:
        return _FAULT_MS[self.strength][self.name] * rng.lognormvariate(0.0, 0.15)

    def _load_factor(self, second: int) -> float:
        return 1.0 if self.name == "low_traffic" else self._rate(second) / self.rate

    # -- one request ---------------------------------------------------------

    def _request(self, start: int, pending: dict[int, Batch], second: int) -> None:
        rng = self._rng
        host = rng.choice(GPU_HOSTS)
        fault = self.name if self._active(start) else None
        load = self._load_factor(second)
        trace = rng.getrandbits(128).to_bytes(16, "big")
        spans: list[Span] = []

        def ms(median: float, sigma: float) -> int:
            return int(median * rng.lognormvariate(0.0, sigma) * MS)

        def outlier() -> int:
            # A rare stall anywhere (GC pause, page fault): one request in 2,000 per component.
            if rng.random() < (0.02 if self.name == "single_outliers" else 0.0005):
                return int(rng.uniform(40, 150) * MS)
            return 0

        root = self._span(trace, None, "gateway", "edge-1", ENTRY[1], SpanKind.SERVER, start, 0)
        spans.append(root)
        cursor = start + ms(0.8, 0.3) + outlier()

        def hop(service: str, operation: str, work: list[tuple[str, int, SpanKind]], net_extra: int = 0) -> None:
            nonlocal cursor
            client = self._span(trace, root.span_id, "gateway", "edge-1", operation, SpanKind.CLIENT, cursor, 0)
            out_net = ms(0.4, 0.3) + net_extra + outlier()
            server = self._span(trace, client.span_id, service, host, operation.split(" ", 1)[1], SpanKind.SERVER,
                                cursor + out_net, 0)
            t = server.start_unix_nano + ms(0.3, 0.3)
            children = []
            for name, duration, kind in work:
                child = self._span(trace, server.span_id, service, host, name, kind, t, t + duration + outlier())
                children.append(child)
                t = child.end_unix_nano + ms(0.05, 0.3)
            server.end_unix_nano = t + ms(0.3, 0.3)
            client.end_unix_nano = server.end_unix_nano + ms(0.4, 0.3)
            cursor = client.end_unix_nano + ms(0.2, 0.3)
            spans.extend([client, server, *children])

        extra = self._extra_ms(rng) if fault else 0.0
        resize = ms(9.0, 0.25) + (int(extra * MS) if fault == "cpu_preprocess" else 0)
        db = ms(5.0, 0.35) + (int(extra * MS) if fault == "slow_db" else 0)
        hop("preprocess", "POST /preprocess", [("decode_image", ms(3.0, 0.25), SpanKind.INTERNAL),
                                               ("resize", resize, SpanKind.INTERNAL),
                                               ("SELECT features", db, SpanKind.CLIENT)])
        queue = ms(2.0 * load, 0.6) + (int(extra * MS) if fault == "queue_wait" else 0)
        forward = ms(22.0, 0.12) + (int(extra * MS) if fault == "gpu_drop" and host == "gpu-2" else 0)
        hop("model-server", "POST /infer", [("batch_queue", queue, SpanKind.INTERNAL),
                                            ("forward", forward, SpanKind.INTERNAL)],
            net_extra=int(extra * MS) if fault == "network_hop" else 0)
        slow_post = fault == "downstream_slow"
        hop("postprocess", "POST /postprocess",
            [("decode_output", ms(3.0, 0.25) + (int(extra * 0.5 * MS) if slow_post else 0), SpanKind.INTERNAL),
             ("render", ms(3.5, 0.25) + (int(extra * 0.5 * MS) if slow_post else 0), SpanKind.INTERNAL)])
        root.end_unix_nano = cursor + ms(0.5, 0.3)
        self._deliver(spans, pending, second)

    def _simple_request(self, start: int, operation: str, median_ms: float, sigma: float,
                        pending: dict[int, Batch], second: int) -> None:
        rng = self._rng
        trace = rng.getrandbits(128).to_bytes(16, "big")
        duration = int(median_ms * rng.lognormvariate(0.0, sigma) * MS)
        root = self._span(trace, None, "gateway", "edge-1", operation, SpanKind.SERVER, start, start + duration)
        child = self._span(trace, root.span_id, "gateway", "edge-1", "list_models", SpanKind.INTERNAL,
                           start + duration // 10, start + duration - duration // 10)
        self._deliver([root, child], pending, second)

    def _health(self, start: int, pending: dict[int, Batch], second: int) -> None:
        rng = self._rng
        micros = rng.uniform(20, 200) if self.name == "microsecond_jitter" or rng.random() < 0.5 else 20.0
        trace = rng.getrandbits(128).to_bytes(16, "big")
        span = self._span(trace, None, "gateway", "edge-1", "GET /healthz", SpanKind.SERVER, start,
                          start + int(micros * 1000))
        self._deliver([span], pending, second)

    def _span(self, trace: bytes, parent: bytes | None, service: str, host: str, name: str, kind: SpanKind,
              start: int, end: int) -> Span:
        self._next_id += 1
        return Span(trace_id=trace, span_id=self._next_id.to_bytes(8, "big"), parent_span_id=parent,
                    service=service, host=host, name=name, kind=kind, start_unix_nano=start, end_unix_nano=end,
                    status=StatusCode.UNSET, attributes={})

    def _deliver(self, spans: list[Span], pending: dict[int, Batch], second: int) -> None:
        # Each service's exporter sends on its own schedule: up to 2 s after the span ended.
        rng = self._rng
        for span in spans:
            at = max((span.end_unix_nano - self.start_ns) // NS, second) + rng.choice((0, 0, 1, 2))
            pending.setdefault(at, Batch(self.start_ns + at * NS)).spans.append(span)

    # -- resource samples ----------------------------------------------------

    def _samples(self, t0: int, second: int) -> list[MetricPoint]:
        rng = self._rng
        t = t0 + 500 * MS
        load = self._load_factor(second)
        fault = self.name if self._active(t) else None
        strong = self.strength == "large"
        out: list[MetricPoint] = []

        def gauge(host: str, name: str, value: float, attrs: dict | None = None, unit: str = "1") -> None:
            out.append(MetricPoint(host=host, name=name, attributes=attrs or {}, time_unix_nano=t,
                                   value=value, kind=MetricKind.GAUGE, unit=unit))

        def counter(host: str, name: str, value: float, attrs: dict | None = None) -> None:
            out.append(MetricPoint(host=host, name=name, attributes=attrs or {}, time_unix_nano=t, value=value,
                                   kind=MetricKind.SUM_CUMULATIVE, unit="{error}", start_unix_nano=self.start_ns))

        for host in ("edge-1", *GPU_HOSTS):
            cpu = min(0.25 + 0.15 * load + rng.gauss(0, 0.03), 1.0)
            if host != "edge-1" and fault == "cpu_preprocess":
                cpu = min(cpu + (0.6 if strong else 0.3), 1.0)
            gauge(host, "system.cpu.utilization", max(cpu, 0.0), {"cpu.mode": "busy"})
            gauge(host, "system.cpu.utilization", max(rng.gauss(0.002, 0.001), 0.0), {"cpu.mode": "steal"})
            gauge(host, "system.cpu.load_average.1m", 4 * cpu, unit="{thread}")
            gauge(host, "system.memory.utilization", 0.55 + rng.gauss(0, 0.005), {"system.memory.state": "used"})
            counter(host, "system.network.errors", 0.0, {"network.interface.name": "eth0",
                                                        "network.io.direction": "receive"})
            counter(host, "system.network.dropped", 0.0, {"network.interface.name": "eth0",
                                                         "network.io.direction": "receive"})
            if host == "edge-1":
                continue
            util = min(0.35 + 0.35 * load + rng.gauss(0, 0.03), 1.0)
            throttled = 0.0
            if fault == "gpu_drop" and host == "gpu-2":
                util *= 0.35 if strong else 0.55
                throttled = 1.0 if strong else 0.0
            attrs = {"hw.id": f"GPU-{host[-1]}", "gpu.index": 0, "hw.name": "NVIDIA H100"}
            gauge(host, "hw.gpu.utilization", max(util, 0.0), attrs)
            gauge(host, "hw.gpu.memory.utilization", 0.4 + rng.gauss(0, 0.01), attrs)
            gauge(host, "hw.power", 300 * util + 80, attrs, unit="W")
            for reason in ("gpu_idle", "sw_power_cap", "hw_slowdown"):
                value = throttled if reason == "hw_slowdown" else 0.0
                gauge(host, "nvidia.gpu.throttle", value, {**attrs, "nvidia.throttle.reason": reason})
            counter(host, "nvidia.gpu.xid.errors", 0.0, attrs)
        return out


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method is fine for the small rates used here)."""
    if lam <= 0:
        return 0
    if lam > 30:
        return max(int(rng.gauss(lam, math.sqrt(lam)) + 0.5), 0)
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
