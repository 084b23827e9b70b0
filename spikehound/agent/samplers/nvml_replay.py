"""Replay a fixture of ``python -m spikehound.agent.samplers.nvml --record`` as a stand-in for ``pynvml``.

:class:`RecordedNvml` offers the part of pynvml that the NVML sampler and the recorder use, under the same names and
returning the same types (pynvml's own ctypes structs and friendly objects, so attribute names match). Recorded
failures are raised as the real ``pynvml.NVMLError`` subclasses; constants and error classes come from pynvml.
Each (device, call) steps through its recorded readings one per call -- one per sample tick, since the sampler
makes each call once a tick -- and repeats the last; XID events come out one recorded batch per drain.

>>> nvml = RecordedNvml({"devices": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3",
...                                   "calls": {"nvmlDeviceGetPowerUsage": [70123, 512000, {"error": 15}]}}]})
>>> nvml.nvmlInit()
>>> handle = nvml.nvmlDeviceGetHandleByIndex(0)
>>> nvml.nvmlDeviceGetPowerUsage(handle), nvml.nvmlDeviceGetPowerUsage(handle)
(70123, 512000)
>>> nvml.nvmlDeviceGetPowerUsage(handle)
Traceback (most recent call last):
pynvml.NVMLError_GpuIsLost: GPU is lost
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from spikehound.agent.samplers.nvml import PROCESS_UTILIZATION, QUERIES, call_key


@dataclass(frozen=True, slots=True)
class RecordedHandle:
    """A device handle of the replay: hashable, so the sampler can map XID events back to their GPU."""

    index: int


@dataclass(slots=True)
class RecordedEventSet:
    """An event set of the replay: which devices registered for which event types."""

    registered: dict[int, int] = field(default_factory=dict)


def _struct(cls: type) -> Callable[[dict[str, Any]], Any]:
    names = {f[0] for f in cls._fields_}  # type: ignore[attr-defined]
    return lambda d: cls(**{k: v for k, v in d.items() if k in names})


# How pynvml returns each recorded reading that is not a plain number.
_BUILDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "nvmlDeviceGetUtilizationRates": _struct(pynvml.c_nvmlUtilization_t),
    "nvmlDeviceGetMemoryInfo": _struct(pynvml.c_nvmlMemory_t),
    "nvmlDeviceGetComputeRunningProcesses": pynvml.nvmlFriendlyObject,
    "nvmlDeviceGetGraphicsRunningProcesses": pynvml.nvmlFriendlyObject,
    PROCESS_UTILIZATION: _struct(pynvml.c_nvmlProcessUtilizationSample_t),
}


def _raise_if_error(value: Any) -> Any:
    if isinstance(value, dict) and "error" in value:
        raise pynvml.NVMLError(int(value["error"]))  # maps the code to pynvml's subclass, e.g. NVMLError_NotSupported
    return value


class RecordedNvml:
    """The subset of ``pynvml`` the NVML sampler uses, answering from a recorded JSON fixture (path or dict)."""

    def __init__(self, fixture: str | Path | dict[str, Any]) -> None:
        self.fixture: dict[str, Any] = fixture if isinstance(fixture, dict) else json.loads(Path(fixture).read_text())
        self.devices: list[dict[str, Any]] = self.fixture["devices"]
        self.calls: Counter[tuple[int, str]] = Counter()  # (device index, call key) -> times called
        self._init_count = 0
        self._event_tick = 0
        self._event_pos = 0
        # (function, constant values) -> call key, so a call with pynvml's constants finds its recording
        self._keys: dict[tuple[str, tuple[int, ...]], str] = {
            (function, tuple(getattr(pynvml, name) for name in constants)): call_key(function, constants)
            for function, constants in QUERIES.values()}

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*, nvmlEventType*, nvmlClocksEventReason*) and error classes are pynvml's own;
        # its functions are not offered, since they would talk to a real driver.
        value = getattr(pynvml, name)
        if isinstance(value, int | type):
            return value
        raise AttributeError(f"RecordedNvml does not replay {name}")

    # -- library and devices ------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        _raise_if_error(self.fixture.get("init"))
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._check_init()
        self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return str(_raise_if_error(self.fixture.get("driver_version", "unknown")))

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> RecordedHandle:
        self._check_init()
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return RecordedHandle(index)

    def nvmlDeviceGetIndex(self, handle: RecordedHandle) -> int:
        return int(self._device(handle)["index"])

    def nvmlDeviceGetUUID(self, handle: RecordedHandle) -> str:
        return str(_raise_if_error(self._device(handle)["uuid"]))

    def nvmlDeviceGetName(self, handle: RecordedHandle) -> str:
        return str(_raise_if_error(self._device(handle)["name"]))

    # -- readings -----------------------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: RecordedHandle) -> Any:
        return self._reading("nvmlDeviceGetUtilizationRates", handle)

    def nvmlDeviceGetMemoryInfo(self, handle: RecordedHandle) -> Any:
        return self._reading("nvmlDeviceGetMemoryInfo", handle)

    def nvmlDeviceGetTemperature(self, handle: RecordedHandle, sensor: int) -> int:
        return self._reading("nvmlDeviceGetTemperature", handle, sensor)

    def nvmlDeviceGetPowerUsage(self, handle: RecordedHandle) -> int:
        return self._reading("nvmlDeviceGetPowerUsage", handle)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: RecordedHandle) -> int:
        return self._reading("nvmlDeviceGetEnforcedPowerLimit", handle)

    def nvmlDeviceGetClockInfo(self, handle: RecordedHandle, clock_type: int) -> int:
        return self._reading("nvmlDeviceGetClockInfo", handle, clock_type)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: RecordedHandle) -> int:
        return self._reading("nvmlDeviceGetCurrentClocksEventReasons", handle)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: RecordedHandle) -> int:
        return self._reading("nvmlDeviceGetCurrentClocksThrottleReasons", handle)

    def nvmlDeviceGetPcieThroughput(self, handle: RecordedHandle, counter: int) -> int:
        return self._reading("nvmlDeviceGetPcieThroughput", handle, counter)

    def nvmlDeviceGetTotalEccErrors(self, handle: RecordedHandle, error_type: int, counter_type: int) -> int:
        return self._reading("nvmlDeviceGetTotalEccErrors", handle, error_type, counter_type)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: RecordedHandle) -> list[Any]:
        return self._reading("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: RecordedHandle) -> list[Any]:
        return self._reading("nvmlDeviceGetGraphicsRunningProcesses", handle)

    def nvmlDeviceGetProcessUtilization(self, handle: RecordedHandle, timestamp: int) -> list[Any]:
        samples = [s for s in self._reading(PROCESS_UTILIZATION, handle) if s.timeStamp > timestamp]
        if not samples:  # as NVML: nothing newer than the last-seen timestamp
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    # -- XID events ---------------------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: RecordedHandle) -> int:
        return int(_raise_if_error(self._device(handle).get("supported_event_types", 0)))

    def nvmlEventSetCreate(self) -> RecordedEventSet:
        self._check_init()
        _raise_if_error(self.fixture.get("event_set"))
        return RecordedEventSet()

    def nvmlDeviceRegisterEvents(self, handle: RecordedHandle, event_types: int, event_set: RecordedEventSet) -> None:
        _raise_if_error(self._device(handle).get("register_events"))
        event_set.registered[handle.index] = event_set.registered.get(handle.index, 0) | int(event_types)

    def nvmlEventSetWait(self, event_set: RecordedEventSet, timeoutms: int) -> SimpleNamespace:
        """The next recorded event of this tick's batch; TIMEOUT (ending the tick) when the batch is spent."""
        self._check_init()
        batches: list[list[dict[str, Any]]] = self.fixture.get("events", [])
        while self._event_tick < len(batches) and self._event_pos < len(batches[self._event_tick]):
            entry = batches[self._event_tick][self._event_pos]
            self._event_pos += 1
            if "error" in entry:  # a failed wait ends the drain, as it ends the sampler's
                self._event_tick, self._event_pos = self._event_tick + 1, 0
                _raise_if_error(entry)
            index = entry.get("device_index")
            if index is None or not event_set.registered.get(index, 0) & entry["eventType"]:
                continue  # the set was not registered for this device and event type
            return SimpleNamespace(device=RecordedHandle(index), eventType=entry["eventType"],
                                   eventData=entry["eventData"], gpuInstanceId=entry.get("gpuInstanceId", 0),
                                   computeInstanceId=entry.get("computeInstanceId", 0))
        self._event_tick, self._event_pos = self._event_tick + 1, 0
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: RecordedEventSet) -> None:
        event_set.registered.clear()

    # -- internals ----------------------------------------------------------------------------------------------

    def _check_init(self) -> None:
        if self._init_count <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: RecordedHandle) -> dict[str, Any]:
        self._check_init()
        if not isinstance(handle, RecordedHandle) or not 0 <= handle.index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[handle.index]

    def _reading(self, function: str, handle: RecordedHandle, *args: int) -> Any:
        """The recorded answer to this call's next tick (the last one repeated), as pynvml would return it."""
        device = self._device(handle)
        key = self._keys.get((function, tuple(args)), function)
        readings = device["calls"].get(key)
        if not readings:  # not recorded: as a driver that lacks the function
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        self.calls[(handle.index, key)] += 1
        value = _raise_if_error(readings[min(self.calls[(handle.index, key)], len(readings)) - 1])
        build = _BUILDERS.get(function)
        if build is None:
            return value
        return [build(item) for item in value] if isinstance(value, list) else build(value)
