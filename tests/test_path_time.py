"""Critical-path time per stage (spikehound.detectors.path_time): what each span and each network hop held."""

from __future__ import annotations

import random

from spikehound.detectors.critical_path import critical_path
from spikehound.detectors.path_time import Stage, entry_stage_times
from spikehound.model import Span, SpanKind, StatusCode

MS = 1_000_000


def span(i: int, parent: int | None, service: str, name: str, start_ms: float, end_ms: float,
         kind: SpanKind = SpanKind.INTERNAL) -> Span:
    return Span(trace_id=b"\x07" * 16, span_id=i.to_bytes(8, "big"),
                parent_span_id=None if parent is None else parent.to_bytes(8, "big"), service=service, host=None,
                name=name, kind=kind, start_unix_nano=int(start_ms * MS), end_unix_nano=int(end_ms * MS),
                status=StatusCode.UNSET)


def inference_trace(net_ms: float = 1.0) -> list[Span]:
    return [
        span(1, None, "gateway", "POST /v1/predict", 0, 30, SpanKind.SERVER),
        span(2, 1, "gateway", "POST /preprocess", 1, 9, SpanKind.CLIENT),
        span(3, 2, "preprocess", "POST /preprocess", 1 + net_ms / 2, 9 - net_ms / 2, SpanKind.SERVER),
        span(4, 3, "preprocess", "resize", 2, 7),
        span(5, 3, "preprocess", "cache lookup", 2, 3),  # overlapped by resize: not on the path
        span(6, 1, "gateway", "POST /infer", 10, 28, SpanKind.CLIENT),
        span(7, 6, "model", "POST /infer", 10 + net_ms / 2, 28 - net_ms / 2, SpanKind.SERVER),
        span(8, 7, "model", "forward", 12, 26),
    ]


def stages_of(result, service: str) -> dict[str, float]:
    stages = next(st for e, st in result if e.service == service)
    return {stage.label: ns / MS for stage, ns in stages.items()}


def test_self_times_and_network_gaps_add_up_to_the_request():
    result = entry_stage_times(inference_trace())
    assert [e.service for e, _ in result] == ["gateway", "preprocess", "model"]
    gateway = stages_of(result, "gateway")
    assert gateway == {
        "gateway: POST /v1/predict": 4.0,  # 0-1, 9-10, 28-30
        "network gateway -> preprocess POST /preprocess": 1.0,
        "preprocess: POST /preprocess": 2.0,  # 1.5-2 and 7-8.5 of the server span
        "preprocess: resize": 5.0,
        "network gateway -> model POST /infer": 1.0,
        "model: POST /infer": 3.0,
        "model: forward": 14.0,
    }
    assert sum(gateway.values()) == 30.0
    assert "preprocess: cache lookup" not in gateway
    assert stages_of(result, "model") == {"model: POST /infer": 3.0, "model: forward": 14.0}


def test_children_outside_their_parent_are_cut_to_it():
    # The model server's clock runs 5 ms ahead: its spans overrun the gateway's client span.
    trace = inference_trace()
    trace[6] = span(7, 6, "model", "POST /infer", 15, 33, SpanKind.SERVER)
    trace[7] = span(8, 7, "model", "forward", 17, 31)
    gateway = stages_of(entry_stage_times(trace), "gateway")
    assert sum(gateway.values()) == 30.0
    assert all(v >= 0 for v in gateway.values())


def test_an_entry_off_the_path_gets_its_own_subtree():
    # A parallel feature lookup on another service, shorter than the inference call, so off the trace's path.
    trace = [*inference_trace(),
             span(9, 1, "gateway", "GET /features", 10, 14, SpanKind.CLIENT),
             span(10, 9, "features", "GET /features", 10.5, 13.5, SpanKind.SERVER)]
    result = entry_stage_times(trace)
    assert stages_of(result, "features") == {"features: GET /features": 3.0}
    assert "features: GET /features" not in stages_of(result, "gateway")


def test_a_partial_trace_books_each_root_and_never_twice():
    # Only the model server's spans were selected (by service.version): the SERVER span's parent is missing.
    trace = [s for s in inference_trace() if s.service == "model"]
    (entry, stages), = entry_stage_times(trace)
    assert entry.name == "POST /infer" and sum(stages.values()) == 18 * MS - 1 * MS


def test_random_traces_always_add_up():
    rng = random.Random(5)
    for _ in range(300):
        spans = [span(1, None, "svc", "root", 0, 100, SpanKind.SERVER)]
        for i in range(2, rng.randrange(2, 25)):
            parent = rng.choice(spans)
            start = rng.uniform(parent.start_unix_nano / MS - 5, parent.end_unix_nano / MS)
            kind = rng.choice([SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.SERVER])
            spans.append(span(i, int.from_bytes(parent.span_id, "big"), rng.choice("abc"), f"op{i % 4}", start,
                              start + rng.uniform(0, 40), kind))
        result = dict((e.span_id, st) for e, st in entry_stage_times(spans))
        root_stages = result[spans[0].span_id]
        assert sum(root_stages.values()) == spans[0].duration_ns
        on_path = set(critical_path(spans))
        assert {s for s in on_path if s in result} <= set(result)
        assert all(isinstance(stage, Stage) and ns >= 0 for stage, ns in root_stages.items())
