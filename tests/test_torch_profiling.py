"""spikehound.torch_profiling: operator times of sampled requests as events on the exported span.

A stand-in torch (just what the helper uses) drives most tests, with the real OpenTelemetry SDK and an
in-memory exporter; real torch is used where it is installed (the CUDA test on a GPU host).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from spikehound.torch_profiling import load_torch, profile_request, sampled_by_trace_id

LOW = 0x0123456789ABCDEF_0000000000000005  # low 64 bits tiny: sampled at any rate above 0
HIGH = 0x0123456789ABCDEF_FFFFFFFFFFFFFF00  # low 64 bits near the top: sampled only at rate 1


@dataclass
class Row:
    """A ``key_averages()`` row of torch 2.4+ (``device_time_total``)."""

    key: str
    self_cpu_time_total: float
    device_time_total: float
    count: int


@dataclass
class OldRow:
    """A row of torch before 2.4, which knows only ``cuda_time_total``."""

    key: str
    self_cpu_time_total: float
    cuda_time_total: float
    count: int


ROWS = [Row("aten::addmm", 120.0, 900.0, 4), Row("aten::relu", 30.0, 50.0, 4),
        Row("cudaLaunchKernel", 400.0, 0.0, 12), Row("aten::empty", 5.0, 0.0, 20),
        Row("void gemm_kernel<float>", 0.0, 850.0, 4)]


class StandInTorch:
    """torch as far as profile_request uses it; remembers each profiler it made."""

    def __init__(self, rows: list[Any] = ROWS, *, cuda: bool = True, fail_start: bool = False) -> None:
        self.rows, self.started, self.fail_start = rows, [], fail_start
        self.profiler = SimpleNamespace(profile=self.profile,
                                        ProfilerActivity=SimpleNamespace(CPU="CPU", CUDA="CUDA"))
        self.cuda = SimpleNamespace(is_available=lambda: cuda)

    def profile(self, activities: list[str]) -> StandInProfile:
        if self.fail_start:
            raise RuntimeError("Can't profile while another profiler is running")
        profiler = StandInProfile(activities, self.rows)
        self.started.append(profiler)
        return profiler


class StandInProfile:
    def __init__(self, activities: list[str], rows: list[Any]) -> None:
        self.activities, self.rows, self.state, self.exit_args = activities, rows, "new", None

    def __enter__(self) -> StandInProfile:
        self.state = "running"
        return self

    def __exit__(self, *exc: object) -> None:
        self.state, self.exit_args = "stopped", exc

    def key_averages(self) -> list[Any]:
        assert self.state == "stopped", "summarised only once the profiler stopped"
        return self.rows


class FixedTraceIds(IdGenerator):
    """Trace ids from a list (the last one repeats), so that the sampling decision is known in advance."""

    def __init__(self, *trace_ids: int) -> None:
        self.trace_ids, self.spans = list(trace_ids), RandomIdGenerator()

    def generate_trace_id(self) -> int:
        return self.trace_ids.pop(0) if len(self.trace_ids) > 1 else self.trace_ids[0]

    def generate_span_id(self) -> int:
        return self.spans.generate_span_id()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def provider(exporter: InMemorySpanExporter, *trace_ids: int) -> TracerProvider:
    tracer_provider = TracerProvider(id_generator=FixedTraceIds(*trace_ids)) if trace_ids else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer_provider


def ops(span: ReadableSpan) -> list[dict[str, Any]]:
    return [dict(event.attributes or {}) for event in span.events if event.name == "torch.op"]


def test_a_sampled_request_gets_its_top_operators_as_events_longest_first(exporter):
    torch = StandInTorch()
    tracer = provider(exporter, LOW).get_tracer("model-server")
    with tracer.start_as_current_span("POST /infer"), profile_request(0.01, top=3, torch_module=torch) as profile:
        assert torch.started[0].state == "running"  # the model runs under the profiler

    (span,) = exporter.get_finished_spans()
    assert span.attributes["torch.profiled"] is True
    assert span.attributes["torch.profiler.sample_rate"] == 0.01
    assert {event.name for event in span.events} == {"torch.op"}
    assert ops(span) == [
        {"torch.op.name": "aten::addmm", "torch.op.self_cpu_time_us": 120.0, "torch.op.cuda_time_us": 900.0,
         "torch.op.count": 4},
        {"torch.op.name": "void gemm_kernel<float>", "torch.op.self_cpu_time_us": 0.0,
         "torch.op.cuda_time_us": 850.0, "torch.op.count": 4},
        {"torch.op.name": "cudaLaunchKernel", "torch.op.self_cpu_time_us": 400.0, "torch.op.cuda_time_us": 0.0,
         "torch.op.count": 12},
    ]
    assert profile.sampled and [op.name for op in profile.operators] == [e["torch.op.name"] for e in ops(span)]
    assert torch.started[0].activities == ["CPU", "CUDA"]
    assert torch.started[0].exit_args == (None, None, None)


def test_without_cuda_only_the_cpu_is_profiled_and_old_rows_are_read(exporter):
    torch = StandInTorch([OldRow("aten::conv2d", 10.0, 70.0, 2), OldRow("aten::add", 40.0, 0.0, 1)], cuda=False)
    tracer = provider(exporter, LOW).get_tracer("model-server")
    with tracer.start_as_current_span("infer"), profile_request(0.5, torch_module=torch):
        pass

    (span,) = exporter.get_finished_spans()
    assert torch.started[0].activities == ["CPU"]
    assert [(e["torch.op.name"], e["torch.op.cuda_time_us"]) for e in ops(span)] == [("aten::conv2d", 70.0),
                                                                                     ("aten::add", 0.0)]


def test_an_unsampled_request_is_not_profiled_and_its_span_gets_nothing(exporter):
    torch = StandInTorch()
    tracer = provider(exporter, HIGH).get_tracer("model-server")
    with tracer.start_as_current_span("infer"), profile_request(0.5, torch_module=torch) as profile:
        pass

    (span,) = exporter.get_finished_spans()
    assert torch.started == []
    assert span.events == () or list(span.events) == []
    assert not any(key.startswith("torch.") for key in span.attributes or {})
    assert not profile.sampled and profile.operators == []


def test_the_decision_follows_the_trace_id_so_every_hop_of_a_trace_agrees(exporter):
    torch = StandInTorch()
    tracer = provider(exporter, LOW, HIGH).get_tracer("model-server")
    for _ in range(2):  # the two traces, each with a parent hop and a child hop
        with tracer.start_as_current_span("gateway"):
            with profile_request(0.25, torch_module=torch):
                pass
            with tracer.start_as_current_span("model-server"), profile_request(0.25, torch_module=torch):
                pass

    profiled = {(span.context.trace_id, span.name) for span in exporter.get_finished_spans() if span.events}
    assert profiled == {(LOW, "gateway"), (LOW, "model-server")}
    assert sampled_by_trace_id(LOW, 0.25) and not sampled_by_trace_id(HIGH, 0.25)
    assert sampled_by_trace_id(HIGH, 1.0) and not sampled_by_trace_id(LOW, 0.0)


def test_without_a_trace_the_decision_is_a_random_draw():
    torch = StandInTorch()
    with profile_request(0.1, torch_module=torch, draw=lambda: 0.05) as drawn_in:
        pass
    with profile_request(0.1, torch_module=torch, draw=lambda: 0.5) as drawn_out:
        pass
    assert drawn_in.sampled and drawn_in.operators[0].name == "aten::addmm"  # the caller still gets them
    assert not drawn_out.sampled and len(torch.started) == 1


def test_the_block_s_exception_goes_on_and_what_ran_is_recorded(exporter):
    torch = StandInTorch()
    tracer = provider(exporter, LOW).get_tracer("model-server")
    with pytest.raises(ValueError, match="bad input"), tracer.start_as_current_span("infer"), \
            profile_request(1.0, torch_module=torch):
        raise ValueError("bad input")

    (span,) = exporter.get_finished_spans()
    assert torch.started[0].exit_args[0] is ValueError
    assert len(ops(span)) == 5 and [e.name for e in span.events][-1] == "exception"  # the SDK's, after ours


def test_one_request_at_a_time_is_profiled_and_a_busy_profiler_costs_no_request(exporter, caplog):
    torch = StandInTorch()
    tracer = provider(exporter, LOW).get_tracer("model-server")
    with (tracer.start_as_current_span("outer"), profile_request(1.0, torch_module=torch),
          tracer.start_as_current_span("inner"), profile_request(1.0, torch_module=torch) as inner):
        pass
    assert not inner.sampled and len(torch.started) == 1

    failing = StandInTorch(fail_start=True)
    with caplog.at_level(logging.WARNING, logger="spikehound.torch_profiling"):
        for _ in range(3):
            with tracer.start_as_current_span("refused"), profile_request(1.0, torch_module=failing) as refused:
                pass
            assert not refused.sampled
    assert sum("could not start" in r.getMessage() for r in caplog.records) <= 1  # said once per process
    assert not [s for s in exporter.get_finished_spans() if s.name == "refused" and (s.events or s.attributes)]
    with profile_request(1.0, torch_module=StandInTorch()) as after:  # a failed start left nothing held
        pass
    assert after.sampled


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    load_torch.cache_clear()
    yield
    load_torch.cache_clear()


def test_without_torch_the_helper_is_a_no_op_that_says_so_once(no_torch, exporter, caplog):
    tracer = provider(exporter, LOW).get_tracer("model-server")
    with caplog.at_level(logging.INFO, logger="spikehound.torch_profiling"):
        for _ in range(3):
            with tracer.start_as_current_span("infer"), profile_request(1.0) as profile:
                result = 6 * 7
            assert not profile.sampled and result == 42
    said = [r.getMessage() for r in caplog.records if r.name == "spikehound.torch_profiling"]
    assert said == ["torch is not installed: profile_request profiles nothing"]
    assert all(not span.events and not span.attributes for span in exporter.get_finished_spans())


def real_torch() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (it is optional: pip install torch to run this test)")
    return torch


def test_real_torch_cpu_operators(exporter):
    torch = real_torch()
    tracer = provider(exporter, LOW).get_tracer("model-server")
    x = torch.randn(64, 64)
    with tracer.start_as_current_span("infer"), profile_request(1.0, top=5):
        torch.relu(x @ x)

    (span,) = exporter.get_finished_spans()
    names = [e["torch.op.name"] for e in ops(span)]
    assert span.attributes["torch.profiled"] is True and 0 < len(names) <= 5
    assert {"aten::mm", "aten::matmul", "aten::relu"} & set(names), names


@pytest.mark.gpu
def test_real_torch_cuda_kernel_times(exporter):
    torch = real_torch()
    if not torch.cuda.is_available():
        pytest.skip("torch is installed but sees no CUDA device")
    tracer = provider(exporter, LOW).get_tracer("model-server")
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    with tracer.start_as_current_span("infer"), profile_request(1.0, top=10):
        y = torch.relu(x @ x)
        torch.cuda.synchronize()
    assert y.shape == (2048, 2048)

    (span,) = exporter.get_finished_spans()
    events = ops(span)
    assert events and max(e["torch.op.cuda_time_us"] for e in events) > 0, events
    totals = [e["torch.op.self_cpu_time_us"] + e["torch.op.cuda_time_us"] for e in events]
    assert totals == sorted(totals, reverse=True)
