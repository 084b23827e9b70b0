"""A SIMULATED GPU for the demo's model server, on machines without one.

The model runs as ``instances`` copies on the device (as Triton's instance
groups do), each one kernel at a time; the server thread waits for its kernel
as a CPU thread waits on a CUDA stream, here by sleeping for the device time.
The device reports what NVML would, as OpenTelemetry metrics under the names
of the agent's NVML sampler: ``hw.gpu.utilization``
(share of the time a kernel was running) and ``nvidia.gpu.throttle`` (1 while
a clock-event reason holds). Every series carries ``hw.id`` =
``SIMULATED-GPU-0`` and a ``hw.name`` that says SIMULATED, so nobody mistakes
it for hardware.

The stall fault is a hardware slowdown (a power brake or thermal event
engaging ``hw_slowdown``): the clocks drop and every kernel takes
``slowdown`` times longer.

>>> gpu = SimulatedGpu(kernel_ms=1.0)
>>> gpu.acquire(); gpu.execute(batch=1); gpu.release()
>>> 0.0 < gpu.utilization() <= 1.0, gpu.throttle_reasons()["hw_slowdown"]
(True, 0)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

DEVICE = {"hw.id": "SIMULATED-GPU-0", "hw.name": "spikehound demo SIMULATED GPU", "gpu.index": 0}
REASONS = ("hw_slowdown", "sw_power_cap", "sw_thermal_slowdown", "gpu_idle")


class SimulatedGpu:
    """One device: ``instances`` slots for kernels, busy-time accounting and a throttle switch."""

    def __init__(self, kernel_ms: float = 6.0, per_item_ms: float = 0.5, slowdown: float = 8.0,
                 instances: int = 4) -> None:
        self.kernel_ms = kernel_ms
        self.per_item_ms = per_item_ms
        self.slowdown = slowdown
        self.throttled = False
        self._device = threading.Semaphore(instances)
        self._books = threading.Lock()
        self._busy_ns = 0  # time with a kernel running, up to the last start or end of one
        self._running = 0  # kernels running now
        self._since = time.monotonic_ns()  # when _running last changed
        self._last_read = time.monotonic_ns()

    def acquire(self) -> None:
        """Wait for the device (the model server's queue)."""
        self._device.acquire()

    def release(self) -> None:
        self._device.release()

    def execute(self, batch: int) -> None:
        """Run one forward kernel for ``batch`` inputs; the caller holds a slot of the device."""
        seconds = (self.kernel_ms + self.per_item_ms * batch) / 1000 * (self.slowdown if self.throttled else 1.0)
        self._count(+1)
        try:
            time.sleep(seconds)
        finally:
            self._count(-1)

    def _count(self, change: int) -> None:
        with self._books:
            now = time.monotonic_ns()
            if self._running:
                self._busy_ns += now - self._since
            self._running += change
            self._since = now

    def utilization(self) -> float:
        """Share of the time since the last reading during which a kernel ran (what NVML reports)."""
        with self._books:
            now = time.monotonic_ns()
            busy = self._busy_ns + (now - self._since if self._running else 0)
            elapsed = max(now - self._last_read, 1)
            self._busy_ns = 0
            self._since = self._last_read = now
        return min(busy / elapsed, 1.0)

    def throttle_reasons(self) -> dict[str, int]:
        return {"hw_slowdown": int(self.throttled), "sw_power_cap": 0, "sw_thermal_slowdown": 0, "gpu_idle": 0}


def report_metrics(gpu: SimulatedGpu, meter_provider: Any) -> None:
    """Register the device's observable gauges on an OpenTelemetry SDK ``MeterProvider``."""
    from opentelemetry.metrics import CallbackOptions, Observation

    meter = meter_provider.get_meter("spikehound.demo.gpu")

    def utilization(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(gpu.utilization(), DEVICE)]

    def throttle(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(on, {**DEVICE, "nvidia.throttle.reason": reason})
                for reason, on in gpu.throttle_reasons().items()]

    meter.create_observable_gauge("hw.gpu.utilization", callbacks=[utilization], unit="1",
                                  description="SIMULATED: share of time a kernel ran")
    meter.create_observable_gauge("nvidia.gpu.throttle", callbacks=[throttle], unit="1",
                                  description="SIMULATED: 1 while the clock-event reason holds")
