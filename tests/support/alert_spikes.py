"""Spikes as the detectors hand them to alerting, at fixed times, for the routing and delivery tests."""

from __future__ import annotations

from dataclasses import replace

from spikehound.model import Cause, CauseKind, Spike

S = 1_000_000_000
MS = 1_000_000
T0 = 1_767_225_600 * S  # 2026-01-01T00:00:00Z: spike(n) starts n seconds later unless told otherwise

SLOW_QUERY = Cause(kind=CauseKind.SPAN, score=0.96, service="preprocess", operation="SELECT features", host="gpu-1",
                   baseline=9.8, observed=79.6, unit="ms",
                   summary="Span SELECT features of preprocess took 79.6 ms of the critical path per slow request "
                           "against 9.8 ms normally.")
PREPROCESS = Cause(kind=CauseKind.SERVICE, score=0.84, service="preprocess", baseline=32.8, observed=94.3, unit="ms",
                   summary="Service preprocess held the critical path for 94.3 ms per slow request against 32.8 ms "
                           "normally.")
GPU_DROP = Cause(kind=CauseKind.RESOURCE, score=0.6, service="model-server", operation="forward", host="gpu-2",
                 resource="hw.gpu.utilization", baseline=70.0, observed=25.0, unit="%",
                 summary="GPU utilization (GPU-2) fell from 70 % to 25 % on gpu-2, which served the slow forward.")
NETWORK = Cause(kind=CauseKind.NETWORK, score=0.8, service="model-server", operation="POST /infer",
                peer_service="gateway", summary="The hop gateway -> model-server took 60 ms more.")
EXEMPLARS = (bytes.fromhex("e5bf1bc448df2524ea2e57ed82473184"), bytes.fromhex("7405ed0e396377d8687a8585b69ac1d9"))


def spike_id(n: int) -> str:
    """The id of ``spike(n)``: 16 hex digits, as the collector makes them."""
    return f"{n:016x}"


def spike(n: int, *, state: str = "open", service: str = "gateway", operation: str = "POST /v1/predict",
          start_s: float | None = None, end_s: float | None = None, p99_ms: float = 219, baseline_ms: float = 69,
          causes: tuple[Cause, ...] = (SLOW_QUERY, PREPROCESS), detected_s: float = 15) -> Spike:
    """Spike ``n``, starting ``start_s`` (by default ``n``) seconds after T0, detected ``detected_s`` later."""
    start = T0 + int((n if start_s is None else start_s) * S)
    return Spike(id=spike_id(n), service=service, operation=operation, state=state, start_unix_nano=start,
                 end_unix_nano=None if end_s is None else T0 + int(end_s * S), p99_ns=int(p99_ms * MS),
                 baseline_p99_ns=int(baseline_ms * MS), causes=causes, exemplar_trace_ids=EXEMPLARS,
                 detected_unix_nano=start + int(detected_s * S))


def ended(s: Spike, end_s: float | None = None) -> Spike:
    """``s`` resolved at ``end_s`` seconds after T0 (by default a minute after it started)."""
    end = s.start_unix_nano + 60 * S if end_s is None else T0 + int(end_s * S)
    return replace(s, state="resolved", end_unix_nano=end)
