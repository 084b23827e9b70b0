"""Operator and CUDA kernel times of sampled requests, as span events, for PyTorch model servers.

A model server that already sends OpenTelemetry spans wraps its model call::

    from spikehound.torch_profiling import profile_request

    with profile_request(sample_rate=0.01, top=10):
        output = model(batch)

One request in a hundred then runs under ``torch.profiler.profile`` (CPU, and CUDA when
``torch.cuda.is_available()``), and the current span gets ``torch.profiled = true`` and one
``torch.op`` event per operator of the ``top`` that took longest (self CPU time plus device time),
longest first, with the attributes ``torch.op.name``, ``torch.op.self_cpu_time_us``,
``torch.op.cuda_time_us`` and ``torch.op.count``. A spike's slow traces then show what the GPU ran.

* **Which requests.** With a trace id, the decision is the one of OpenTelemetry's
  ``TraceIdRatioBased`` sampler (the trace id's low 64 bits below ``sample_rate * 2**64``), so every
  hop of a sampled trace, in every process that uses the same rate, is profiled; without one, a
  random draw.
* **Cost.** An unsampled request costs a span lookup and a comparison. A sampled one pays the
  profiler (typically a few % of its time, more for many small operators) and the summary at its end.
* **One at a time.** The profiler is process-wide: a request that comes while another one is being
  profiled runs unprofiled, and so does one that finds a profiler started by someone else.
* **Without torch** (it is not a dependency of spikehound, and is imported only when first needed)
  the helper is a no-op and says so once in the log.

The ``with`` statement gives a :class:`RequestProfile`, also useful without a span::

    >>> with profile_request(sample_rate=0.0) as profile:
    ...     pass
    >>> profile.sampled, profile.operators
    (False, [])
"""

from __future__ import annotations

import functools
import importlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from opentelemetry import trace

__all__ = ["OperatorTime", "RequestProfile", "load_torch", "profile_request", "sampled_by_trace_id", "top_operators"]

log = logging.getLogger(__name__)

_TRACE_ID_LOW_BITS = (1 << 64) - 1
_busy = threading.Lock()  # held while a request is profiled (the profiler is process-wide)
_said: set[str] = set()  # the once-only log messages already written


@dataclass(frozen=True, slots=True)
class OperatorTime:
    """One row of ``key_averages()``: an operator (or CUDA kernel) summed over the request."""

    name: str
    self_cpu_time_us: float
    cuda_time_us: float
    count: int

    @property
    def total_us(self) -> float:
        """What the operators are ranked by: CPU time outside child operators plus device time."""
        return self.self_cpu_time_us + self.cuda_time_us


@dataclass(slots=True)
class RequestProfile:
    """What ``profile_request`` did for one request; ``operators`` is filled when the block ends."""

    sampled: bool = False
    operators: list[OperatorTime] = field(default_factory=list)


def sampled_by_trace_id(trace_id: int, rate: float) -> bool:
    """OpenTelemetry's ``TraceIdRatioBased`` rule: the same trace id gives the same answer in every process.

    >>> sampled_by_trace_id(0x0123456789abcdef_0000000000000001, 0.01)
    True
    >>> sampled_by_trace_id(0x0123456789abcdef_ffffffffffffffff, 0.01)
    False
    """
    return (trace_id & _TRACE_ID_LOW_BITS) < round(rate * (_TRACE_ID_LOW_BITS + 1))


def top_operators(rows: Any, top: int) -> list[OperatorTime]:
    """The ``top`` longest rows of a profiler's ``key_averages()``, longest (self CPU + device time) first.

    Newer torch names the device time ``device_time_total`` (``cuda_time_total`` warns there); older
    releases know only ``cuda_time_total``.
    """
    operators = []
    for row in rows:
        device = getattr(row, "device_time_total", None)
        if device is None:
            device = getattr(row, "cuda_time_total", 0.0)
        operators.append(OperatorTime(str(row.key), float(row.self_cpu_time_total), float(device or 0.0),
                                      int(row.count)))
    operators.sort(key=lambda op: (-op.total_us, op.name))
    return operators[:top]


def _say_once(key: str, message: str, *args: object, level: int = logging.INFO) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


@functools.cache
def load_torch() -> ModuleType | None:
    """torch, imported on first use (a server that uses it has it in ``sys.modules`` already); None without it."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        log.info("torch is not installed: profile_request profiles nothing")  # once: the answer is cached
        return None


def _decide(span: trace.Span, rate: float, draw: Callable[[], float]) -> bool:
    if rate <= 0.0:
        return False
    context = span.get_span_context()
    if context.is_valid:
        return sampled_by_trace_id(context.trace_id, rate)
    return draw() < rate


def _activities(torch: Any) -> list[Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _stop(profiler: Any, exc: BaseException | None) -> None:
    try:
        profiler.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    except Exception as failure:  # the request's own outcome stands
        _say_once(f"stop:{type(failure).__name__}", "torch.profiler did not stop cleanly: %s", failure,
                  level=logging.WARNING)


def _record(span: trace.Span, operators: list[OperatorTime], rate: float) -> None:
    span.set_attribute("torch.profiled", True)
    span.set_attribute("torch.profiler.sample_rate", rate)
    for op in operators:
        span.add_event("torch.op", {"torch.op.name": op.name, "torch.op.self_cpu_time_us": op.self_cpu_time_us,
                                    "torch.op.cuda_time_us": op.cuda_time_us, "torch.op.count": op.count})


@contextmanager
def profile_request(sample_rate: float = 0.01, top: int = 10, *, torch_module: Any = None,
                    span: trace.Span | None = None,
                    draw: Callable[[], float] = random.random) -> Iterator[RequestProfile]:
    """Profile the block with ``torch.profiler`` when the request is sampled; record its top operators.

    ``span`` defaults to the current span. ``torch_module`` replaces ``import torch`` (tests pass a
    stand-in; anything with ``profiler.profile``, ``profiler.ProfilerActivity`` and
    ``cuda.is_available`` does); ``draw`` is the random source for requests without a trace id.
    An exception of the block goes on unchanged; what was profiled up to it is recorded.
    """
    profile = RequestProfile()
    span = span if span is not None else trace.get_current_span()
    torch = torch_module if torch_module is not None else load_torch()
    if torch is None or not _decide(span, sample_rate, draw) or not _busy.acquire(blocking=False):
        yield profile
        return
    try:
        profiler = torch.profiler.profile(activities=_activities(torch))
        profiler.__enter__()
    except Exception as exc:  # e.g. another profiler already runs: the request must not fail for it
        _busy.release()
        _say_once(f"start:{type(exc).__name__}", "torch.profiler could not start (%s): requests run unprofiled "
                  "while it cannot", exc, level=logging.WARNING)
        yield profile
        return
    try:
        profile.sampled = True
        try:
            yield profile
        except BaseException as exc:
            _stop(profiler, exc)
            raise
        else:
            _stop(profiler, None)
        finally:
            # Only once the profiler stopped; a failing summary costs the events, never the request.
            try:
                profile.operators = top_operators(profiler.key_averages(), top)
            except Exception as exc:
                _say_once(f"summary:{type(exc).__name__}", "torch.profiler summary failed: %s", exc,
                          level=logging.WARNING)
            _record(span, profile.operators, sample_rate)
    finally:
        _busy.release()
