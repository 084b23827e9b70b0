"""The faults the demo injects, and what a correct explanation of each one names.

A spike's top cause *names* a fault when it is the component the fault was
injected into: the span that was made slow (or, where all of its work
slowed, its service), or the network hop that was delayed. The top line is
judged by itself: a resource cause on top names the fault only when the
resource is the fault (the GPU's clock throttling; the CPU for CPU-bound
work), never because the component it was joined to would have (CPU steal
rising on the host of a delayed hop explains nothing about the hop).

The causes are the model's (:class:`spikehound.model.Cause`); the demo reads
them from the API's JSON with :mod:`spikehound.model_json`.

>>> def cause(kind, service, operation, **more):
...     return Cause(kind=kind, score=0.5, summary="", service=service, operation=operation, **more)
>>> cpu = FAULTS["cpu"]
>>> cpu.matches(cause(CauseKind.SPAN, "preprocess", "resize"))
True
>>> cpu.matches(cause(CauseKind.NETWORK, "preprocess", "POST /preprocess", peer_service="gateway"))
False
>>> FAULTS["gpu"].matches(cause(CauseKind.RESOURCE, "model-server", "queue_wait", resource="nvidia.gpu.throttle"))
True
>>> steal = cause(CauseKind.RESOURCE, "model-server", "POST /infer", resource="system.cpu.utilization")
>>> hop = cause(CauseKind.NETWORK, "model-server", "POST /infer", peer_service="gateway")
>>> FAULTS["network"].named_by([hop, steal]), FAULTS["network"].named_by([steal, hop])
(True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spikehound.demo import feature_store
from spikehound.model import Cause, CauseKind


@dataclass(frozen=True, slots=True)
class Fault:
    key: str  # its name on the command line
    title: str
    injected: str  # what the demo really does, in one line
    kind: CauseKind  # SPAN or NETWORK: the component a cause should name
    service: str
    operation: str
    peer_service: str | None = None
    service_ok: bool = False  # the whole service is an acceptable answer (all of its work slowed)
    resources: tuple[str, ...] = ()  # resource causes on the service that name the fault itself
    resource_anywhere: bool = False  # ... whichever component they were joined to (the GPU itself is the fault)
    simulated: bool = False

    @property
    def expected(self) -> str:
        if self.kind == CauseKind.NETWORK:
            return f"network hop {self.peer_service} -> {self.service}"
        extra = f" or {'/'.join(self.resources)}" if self.resources else ""
        return f"span {self.operation} of {self.service}{extra}"

    def matches(self, cause: Cause) -> bool:
        """Does ``cause`` name the component this fault was injected into?"""
        kind, service = cause.kind, cause.service
        if self.kind == CauseKind.NETWORK:
            return kind == CauseKind.NETWORK and service == self.service and cause.peer_service == self.peer_service
        if kind == CauseKind.SPAN:
            return service == self.service and cause.operation == self.operation
        if kind == CauseKind.SERVICE:
            return self.service_ok and service == self.service
        if kind == CauseKind.RESOURCE:
            return cause.resource in self.resources and (self.resource_anywhere or service == self.service)
        return False

    def named_by(self, causes: Sequence[Cause]) -> bool:
        """Does the first of ``causes``, itself, name this fault?"""
        return bool(causes) and self.matches(causes[0])


def component_of(causes: Sequence[Cause]) -> Cause | None:
    """The component the first cause is about: itself, or for a resource cause the first non-resource one after it."""
    return next((c for c in causes if c.kind != CauseKind.RESOURCE), None)


FAULTS: dict[str, Fault] = {f.key: f for f in (
    Fault("cpu", "CPU-bound preprocessing", "preprocess burns 10 ms more CPU in resize per request",
          CauseKind.SPAN, "preprocess", "resize", service_ok=True, resources=("system.cpu.utilization",)),
    Fault("slow-query", "slow feature query", "DROP INDEX on the feature store: each lookup scans the table",
          CauseKind.SPAN, "preprocess", feature_store.SPAN_NAME),
    Fault("network", "network delay on one hop", "the TCP proxy gateway -> model-server holds each request 100 ms",
          CauseKind.NETWORK, "model-server", "POST /infer", peer_service="gateway"),
    Fault("gpu", "GPU stall (SIMULATED GPU)", "the SIMULATED GPU is clock-throttled (hw_slowdown), kernels 8x slower",
          CauseKind.SPAN, "model-server", "forward", service_ok=True,
          resources=("nvidia.gpu.throttle", "hw.gpu.utilization"), resource_anywhere=True, simulated=True),
)}
