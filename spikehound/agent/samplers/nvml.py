"""GPU sampling through NVML, and a recorder that captures NVML's raw answers as a replayable JSON fixture.

The sampler is written against an *injected* nvml module: the real ``pynvml`` (PyPI package ``nvidia-ml-py``) on a
GPU host, or :class:`~spikehound.agent.samplers.nvml_replay.RecordedNvml` in tests. Each reading is one NVML
query; a query the GPU does not support is remembered and never retried, any other NVML error is counted in
``errors`` and does not stop the other queries. Without a driver, ``start()`` logs one warning and returns False
and the agent runs on.

Clock event ("throttle") reasons are decoded from NVML's bitmask:

>>> decode_reasons(0x4 | 0x8)
['sw_power_cap', 'hw_slowdown']

Record a fixture on a GPU host with ``python -m spikehound.agent.samplers.nvml --record FILE [--samples N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from spikehound.agent.sample import Kind, Sample

log = logging.getLogger(__name__)

FORMAT = "spikehound-nvml-recording/1"

# Clock event reason bits; the values of pynvml's nvmlClocksEventReason* (and the older, identical
# nvmlClocksThrottleReason*) constants. The names are a contract: dashboards and detectors key on them.
REASONS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# query name -> (pynvml function, names of the pynvml constants passed after the device handle).
# The sampler runs these; the recorder stores their answers under call_key(function, constants).
QUERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "utilization": ("nvmlDeviceGetUtilizationRates", ()),
    "memory": ("nvmlDeviceGetMemoryInfo", ()),
    "temperature": ("nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU",)),
    "power": ("nvmlDeviceGetPowerUsage", ()),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit", ()),
    "clock_sm": ("nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM",)),
    "clock_memory": ("nvmlDeviceGetClockInfo", ("NVML_CLOCK_MEM",)),
    "clock_event_reasons": ("nvmlDeviceGetCurrentClocksEventReasons", ()),
    # Older name of the same call: only used where the driver or pynvml lacks the one above.
    "clock_throttle_reasons": ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
    "pcie_tx": ("nvmlDeviceGetPcieThroughput", ("NVML_PCIE_UTIL_TX_BYTES",)),
    "pcie_rx": ("nvmlDeviceGetPcieThroughput", ("NVML_PCIE_UTIL_RX_BYTES",)),
    "ecc_corrected": ("nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC")),
    "ecc_uncorrected": ("nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC")),
    "compute_processes": ("nvmlDeviceGetComputeRunningProcesses", ()),
    "graphics_processes": ("nvmlDeviceGetGraphicsRunningProcesses", ()),
}
# Takes the last-seen timestamp as its argument, so it is recorded under its bare name.
PROCESS_UTILIZATION = "nvmlDeviceGetProcessUtilization"

# pynvml's error codes, for a module that lacks the constants (they are fixed by the NVML C API).
_NOT_SUPPORTED, _NOT_FOUND, _TIMEOUT, _FUNCTION_NOT_FOUND = 3, 6, 10, 13
_UNSUPPORTED_CODES = (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND)  # the GPU, driver or pynvml lacks the query
# Bound on XID events read per tick, so an event storm cannot stall the sampling loop.
_MAX_EVENTS_PER_TICK = 1000


def call_key(function: str, constants: Sequence[str] = ()) -> str:
    """The fixture key of one NVML call.

    >>> call_key("nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM",))
    'nvmlDeviceGetClockInfo(NVML_CLOCK_SM)'
    """
    return f"{function}({','.join(constants)})" if constants else function


def decode_reasons(mask: int) -> list[str]:
    """Names of the known clock event reasons set in an NVML reasons bitmask, lowest bit first.

    >>> decode_reasons(0)
    []
    >>> decode_reasons(0x1 | 0x1000)
    ['gpu_idle']
    """
    return [name for bit, name in REASONS.items() if mask & bit]


class _Missing:
    """Marks a query that produced no value (unsupported or failed); None is a legitimate NVML answer."""


_NONE: Any = _Missing()


def _text(value: object) -> str:
    """pynvml returns str for names and UUIDs, but older releases (and raw ctypes) return bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: object) -> object:
    """A hashable identity for a device handle: real handles are ctypes pointers, which compare by object."""
    if hasattr(handle, "contents"):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


@dataclass(slots=True)
class _Gpu:
    handle: Any
    index: int
    uuid: str
    name: str
    attributes: dict[str, str | int | float | bool]
    xid_registered: bool = False
    xid_count: int = 0
    last_xid: int | None = None
    last_process_ts: int = 0


class NvmlSampler:
    """Samples every GPU through NVML: utilization, memory, temperature, power, clocks, throttle reasons,
    PCIe throughput, ECC and XID errors, and per-process memory and utilization."""

    name = "nvml"

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml: Any = nvml
        self._gpus: list[_Gpu] = []
        self._by_handle: dict[object, _Gpu] = {}
        self._event_set: Any = None
        self._started = False
        self.errors: Counter[str] = Counter()
        self.unsupported: set[tuple[str, str]] = set()  # (GPU uuid, query name)
        self._warned: set[tuple[str, str]] = set()

    @property
    def gpus(self) -> list[dict[str, str | int | float | bool]]:
        """The identifying attributes of the GPUs found at start."""
        return [dict(gpu.attributes) for gpu in self._gpus]

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Initialise NVML and find the GPUs; False (with one warning) where NVML or its driver is missing."""
        if self._started:
            return True
        try:
            nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
        except ImportError as exc:
            return self._unavailable(exc)
        self._nvml = nvml
        initialised = False
        try:
            nvml.nvmlInit()
            initialised = True
            count = int(nvml.nvmlDeviceGetCount())
        except (nvml.NVMLError, OSError) as exc:
            if initialised:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlShutdown()
            return self._unavailable(exc)
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                # One lost or unhealthy GPU must not hide the others.
                self._count_error(f"gpu-{index}", "handle", exc)
                continue
            gpu = _Gpu(handle=handle, index=index, uuid=f"gpu-{index}", name="unknown", attributes={})
            uuid = self._call(gpu, "uuid", nvml.nvmlDeviceGetUUID)
            name = self._call(gpu, "name", nvml.nvmlDeviceGetName)
            gpu.uuid = _text(uuid) if uuid is not _NONE else gpu.uuid
            gpu.name = _text(name) if name is not _NONE else gpu.name
            gpu.attributes = {"hw.id": gpu.uuid, "gpu.index": index, "hw.name": gpu.name}
            self._gpus.append(gpu)
            self._by_handle[_handle_key(handle)] = gpu
        self._setup_xid()
        self._started = True
        log.info("NVML: sampling %d GPU(s)", len(self._gpus))
        return True

    def close(self) -> None:
        """Free the XID event set and shut NVML down; safe to call more than once."""
        if not self._started:
            return
        self._started = False
        nvml = self._nvml
        if self._event_set is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
        self._gpus.clear()
        self._by_handle.clear()

    def _unavailable(self, exc: BaseException) -> bool:
        log.warning("NVML unavailable (%s): GPU sampling disabled", exc)
        return False

    def _setup_xid(self) -> None:
        """Register every GPU that supports it for XID critical-error events, on one shared event set."""
        nvml = self._nvml
        xid = nvml.nvmlEventTypeXidCriticalError
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            for gpu in self._gpus:
                self._failed(gpu, "xid", exc)
            return
        for gpu in self._gpus:
            supported = self._call(gpu, "xid", nvml.nvmlDeviceGetSupportedEventTypes)
            if supported is _NONE:
                continue
            if not int(supported) & xid:
                self.unsupported.add((gpu.uuid, "xid"))
                continue
            if self._call(gpu, "xid", nvml.nvmlDeviceRegisterEvents, xid, event_set) is not _NONE:
                gpu.xid_registered = True
        if any(gpu.xid_registered for gpu in self._gpus):
            self._event_set = event_set
        else:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(event_set)

    # -- one NVML call ------------------------------------------------------------------------------------------

    def _call(self, gpu: _Gpu, query: str, fn: Callable[..., Any], *args: Any, no_data: Sequence[int] = ()) -> Any:
        """fn(handle, *args), or _NONE where the query is unsupported, failed, or had nothing (no_data codes)."""
        if (gpu.uuid, query) in self.unsupported:
            return _NONE
        nvml = self._nvml
        try:
            return fn(gpu.handle, *args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in no_data:
                return _NONE
            self._failed(gpu, query, exc)
            return _NONE
        except getattr(nvml, "NVMLLibraryMismatchError", ()) as exc:
            # pynvml raises this (not an NVMLError) when the driver lacks an unversioned function.
            self._mark_unsupported(gpu, query, exc)
            return _NONE

    def _query(self, gpu: _Gpu, query: str) -> Any:
        """Run one of QUERIES on a GPU."""
        function, constants = QUERIES[query]
        fn = getattr(self._nvml, function, None)
        if fn is None:  # an older pynvml without this call
            self.unsupported.add((gpu.uuid, query))
            return _NONE
        return self._call(gpu, query, fn, *(getattr(self._nvml, name) for name in constants))

    def _failed(self, gpu: _Gpu, query: str, exc: BaseException) -> None:
        if getattr(exc, "value", None) in _UNSUPPORTED_CODES:
            self._mark_unsupported(gpu, query, exc)
        else:
            self._count_error(gpu.uuid, query, exc)

    def _mark_unsupported(self, gpu: _Gpu, query: str, exc: BaseException) -> None:
        # Remembered so the query is not retried (and not logged) every second for the agent's lifetime.
        self.unsupported.add((gpu.uuid, query))
        log.debug("NVML %s not supported on GPU %d (%s): %s", query, gpu.index, gpu.uuid, exc)

    def _count_error(self, ident: str, query: str, exc: BaseException) -> None:
        self.errors[query] += 1
        # Warn once per GPU and query; a GPU that fell off the bus would otherwise log every second.
        level = logging.DEBUG if (ident, query) in self._warned else logging.WARNING
        self._warned.add((ident, query))
        log.log(level, "NVML %s failed on %s: %s (%s)", query, ident, exc, type(exc).__name__)

    # -- sampling -----------------------------------------------------------------------------------------------

    def sample(self) -> list[Sample]:
        """One reading of every GPU; [] when NVML is not started."""
        if not self._started:
            return []
        self._drain_xid()
        samples: list[Sample] = []
        for gpu in self._gpus:
            samples.extend(self._sample_gpu(gpu))
        return samples

    def _drain_xid(self) -> None:
        """Read every pending XID event without waiting (timeout 0 ms) and count it against its GPU."""
        if self._event_set is None:
            return
        nvml = self._nvml
        xid = nvml.nvmlEventTypeXidCriticalError
        timeout = getattr(nvml, "NVML_ERROR_TIMEOUT", _TIMEOUT)
        for _ in range(_MAX_EVENTS_PER_TICK):
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != timeout:  # TIMEOUT just means "no more events now"
                    self._count_error("event set", "xid", exc)
                return
            if not int(data.eventType) & xid:
                continue
            gpu = self._by_handle.get(_handle_key(data.device))
            if gpu is None:
                log.debug("XID %s on a GPU not being sampled", data.eventData)
                continue
            gpu.xid_count += 1
            gpu.last_xid = int(data.eventData)

    def _sample_gpu(self, gpu: _Gpu) -> list[Sample]:
        out: list[Sample] = []

        def add(name: str, value: float, unit: str, extra: dict[str, str | int | float | bool] | None = None,
                kind: Kind = Kind.GAUGE) -> None:
            out.append(Sample(name, float(value), unit, {**gpu.attributes, **(extra or {})}, kind))

        util = self._query(gpu, "utilization")
        if util is not _NONE:
            add("hw.gpu.utilization", util.gpu / 100, "1")
            add("hw.gpu.memory.utilization", util.memory / 100, "1")
        memory = self._query(gpu, "memory")
        if memory is not _NONE:
            add("hw.gpu.memory.usage", memory.used, "By")
            add("hw.gpu.memory.limit", memory.total, "By")
            add("nvidia.gpu.memory.free", memory.free, "By")
        temperature = self._query(gpu, "temperature")
        if temperature is not _NONE:
            add("hw.temperature", temperature, "Cel", {"hw.type": "gpu"})
        power = self._query(gpu, "power")
        if power is not _NONE:
            add("hw.power", power / 1000, "W")  # NVML reports milliwatts
        limit = self._query(gpu, "power_limit")
        if limit is not _NONE:
            add("nvidia.gpu.power.limit", limit / 1000, "W")
        for query, metric in (("clock_sm", "nvidia.gpu.clock.sm"), ("clock_memory", "nvidia.gpu.clock.memory")):
            clock = self._query(gpu, query)
            if clock is not _NONE:
                add(metric, clock, "MHz")
        mask = self._reasons(gpu)
        if mask is not _NONE:
            add("nvidia.gpu.clock_event_reasons", mask, "1")
            # Every known reason, 0 when clear, so a dashboard sees a throttle end rather than a gap.
            for bit, reason in REASONS.items():
                add("nvidia.gpu.throttle", 1 if int(mask) & bit else 0, "1", {"nvidia.throttle.reason": reason})
        for query, direction in (("pcie_tx", "transmit"), ("pcie_rx", "receive")):
            kbps = self._query(gpu, query)
            if kbps is not _NONE:
                add("nvidia.gpu.pcie.throughput", kbps * 1024, "By/s", {"network.io.direction": direction})
        for query, error_type in (("ecc_corrected", "corrected"), ("ecc_uncorrected", "uncorrected")):
            count = self._query(gpu, query)
            if count is not _NONE:
                add("nvidia.gpu.ecc.errors", count, "{error}", {"error.type": error_type}, Kind.COUNTER)
        if gpu.xid_registered:
            add("nvidia.gpu.xid.errors", gpu.xid_count, "{error}", kind=Kind.COUNTER)
            if gpu.last_xid is not None:
                add("nvidia.gpu.xid.last", gpu.last_xid, "1", {"nvidia.xid": gpu.last_xid})
        for pid, used in sorted(self._process_memory(gpu).items()):
            add("nvidia.gpu.process.memory.usage", used, "By", {"process.pid": pid})
        for pid, sm_util in sorted(self._process_utilization(gpu).items()):
            add("nvidia.gpu.process.utilization", sm_util / 100, "1", {"process.pid": pid})
        return out

    def _reasons(self, gpu: _Gpu) -> Any:
        """The clock event reasons bitmask, through the older throttle-reasons call where the new one is missing."""
        for query in ("clock_event_reasons", "clock_throttle_reasons"):
            mask = self._query(gpu, query)
            if mask is not _NONE or (gpu.uuid, query) not in self.unsupported:
                return mask  # a value, or a real error that the older call must not mask
        return _NONE

    def _process_memory(self, gpu: _Gpu) -> dict[int, int]:
        usage: dict[int, int] = {}
        for query in ("compute_processes", "graphics_processes"):
            processes = self._query(gpu, query)
            for process in [] if processes is _NONE else processes:
                if process.usedGpuMemory is None:  # NVML cannot attribute memory here (WDDM, some containers)
                    continue
                # A process doing both compute and graphics is listed twice with the same memory.
                usage[int(process.pid)] = max(usage.get(int(process.pid), 0), int(process.usedGpuMemory))
        return usage

    def _process_utilization(self, gpu: _Gpu) -> dict[int, float]:
        """Latest SM utilization (percent) per pid since the previous call."""
        fn = getattr(self._nvml, PROCESS_UTILIZATION, None)
        if fn is None:
            self.unsupported.add((gpu.uuid, "process_utilization"))
            return {}
        # NOT_FOUND: no samples since last_process_ts; pynvml raises NVMLError(0) when the count comes back 0.
        no_data = (getattr(self._nvml, "NVML_ERROR_NOT_FOUND", _NOT_FOUND), 0)
        raw = self._call(gpu, "process_utilization", fn, gpu.last_process_ts, no_data=no_data)
        latest: dict[int, Any] = {}
        for item in [] if raw is _NONE else raw:
            pid = int(item.pid)
            if pid not in latest or item.timeStamp > latest[pid].timeStamp:
                latest[pid] = item
            gpu.last_process_ts = max(gpu.last_process_ts, int(item.timeStamp))
        return {pid: float(item.smUtil) for pid, item in latest.items()}


# -- recorder -------------------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": int(getattr(exc, "value", 999)), "name": type(exc).__name__}


def _is_error(value: object) -> bool:
    return isinstance(value, dict) and "error" in value


def _jsonable(value: Any) -> Any:
    """pynvml's answer as JSON: ctypes structs and pynvml's friendly objects become dicts of their fields."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    fields = getattr(value, "_fields_", None)
    if fields is not None:
        return {field[0]: _jsonable(getattr(value, field[0])) for field in fields}
    if hasattr(value, "__dict__"):
        return {key: _jsonable(item) for key, item in vars(value).items()}
    return repr(value)


def _capture(nvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) as JSON, or the NVML error it raised as {"error": code, "name": class name}."""
    try:
        return _jsonable(fn(*args))
    except nvml.NVMLError as exc:
        return _error(exc)
    except getattr(nvml, "NVMLLibraryMismatchError", ()):
        return {"error": _FUNCTION_NOT_FOUND, "name": "NVMLError_FunctionNotFound"}


def _drain_events(nvml: Any, event_set: Any, handles: list[Any]) -> list[dict[str, Any]]:
    """Every pending event, as the sampler would read it; a non-timeout error ends the drain and is kept."""
    index_of = {_handle_key(handle): index for index, handle in enumerate(handles)}
    events: list[dict[str, Any]] = []
    for _ in range(_MAX_EVENTS_PER_TICK):
        try:
            data = nvml.nvmlEventSetWait(event_set, 0)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", _TIMEOUT):
                events.append(_error(exc))
            break
        events.append({"device_index": index_of.get(_handle_key(data.device)), "eventType": int(data.eventType),
                       "eventData": int(data.eventData), "gpuInstanceId": int(data.gpuInstanceId),
                       "computeInstanceId": int(data.computeInstanceId)})
    return events


def _pynvml_version() -> str | None:
    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return None


def record(nvml: ModuleType | Any, path: str | Path, samples: int = 5, interval: float = 1.0) -> dict[str, Any]:
    """Call every NVML function the sampler uses ``samples`` times, ``interval`` seconds apart, and write the raw
    answers (per device, per call, a list over time) and the XID events seen as a JSON fixture at ``path``.

    Raises the NVMLError of nvmlInit where there is no driver. Returns the fixture written.
    """
    nvml.nvmlInit()
    try:
        fixture = _record(nvml, samples, interval)
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    Path(path).write_text(json.dumps(fixture, indent=1) + "\n")
    return fixture


def _record(nvml: Any, samples: int, interval: float) -> dict[str, Any]:
    handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(nvml.nvmlDeviceGetCount())]
    devices: list[dict[str, Any]] = [
        {"index": index, "uuid": _capture(nvml, nvml.nvmlDeviceGetUUID, handle),
         "name": _capture(nvml, nvml.nvmlDeviceGetName, handle),
         "supported_event_types": _capture(nvml, nvml.nvmlDeviceGetSupportedEventTypes, handle),
         "register_events": None, "calls": {}}
        for index, handle in enumerate(handles)]
    fixture: dict[str, Any] = {
        "format": FORMAT,
        "source": f"recorded on {socket.gethostname()} {datetime.now(UTC).isoformat(timespec='seconds')}",
        "pynvml_version": _pynvml_version(),
        "driver_version": _capture(nvml, nvml.nvmlSystemGetDriverVersion),
        "interval_s": interval,
        "samples": samples,
        "event_set": None,
        "devices": devices,
        "events": [],
    }
    xid = nvml.nvmlEventTypeXidCriticalError
    event_set: Any = None
    try:
        event_set = nvml.nvmlEventSetCreate()
    except nvml.NVMLError as exc:
        fixture["event_set"] = _error(exc)
    if event_set is not None:
        for device, handle in zip(devices, handles, strict=True):
            supported = device["supported_event_types"]
            if isinstance(supported, int) and supported & xid:
                device["register_events"] = _capture(nvml, nvml.nvmlDeviceRegisterEvents, handle, xid, event_set)
    last_seen = [0] * len(handles)
    try:
        for tick in range(samples):
            if tick:
                time.sleep(interval)
            fixture["events"].append(_drain_events(nvml, event_set, handles) if event_set is not None else [])
            for i, (device, handle) in enumerate(zip(devices, handles, strict=True)):
                calls: dict[str, list[Any]] = device["calls"]
                new_reasons = False
                for query, (function, constants) in QUERIES.items():
                    fn = getattr(nvml, function, None)
                    if fn is None or (query == "clock_throttle_reasons" and new_reasons):
                        continue  # the sampler only falls back to the older call where the new one is unsupported
                    value = _capture(nvml, fn, handle, *(getattr(nvml, name) for name in constants))
                    if query == "clock_event_reasons":
                        new_reasons = not (_is_error(value) and value["error"] in _UNSUPPORTED_CODES)
                    calls.setdefault(call_key(function, constants), []).append(value)
                value = _capture(nvml, getattr(nvml, PROCESS_UTILIZATION), handle, last_seen[i])
                if isinstance(value, list) and value:
                    last_seen[i] = max(last_seen[i], *(item["timeStamp"] for item in value))
                calls.setdefault(PROCESS_UTILIZATION, []).append(value)
    finally:
        if event_set is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(event_set)
    return fixture


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spikehound.agent.samplers.nvml --record FILE``: a replayable NVML fixture of this host's GPUs."""
    parser = argparse.ArgumentParser(prog="python -m spikehound.agent.samplers.nvml",
                                     description="Record raw NVML readings as a JSON fixture for RecordedNvml.")
    parser.add_argument("--record", metavar="FILE", type=Path, required=True, help="fixture file to write")
    parser.add_argument("--samples", metavar="N", type=int, default=5, help="readings per call (default 5)")
    parser.add_argument("--interval", metavar="SECONDS", type=float, default=1.0, help="between readings")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.interval < 0:
        parser.error("--samples must be at least 1 and --interval not negative")
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError as exc:
        print(f"pynvml is not installed ({exc}): pip install nvidia-ml-py", file=sys.stderr)
        return 2
    try:
        fixture = record(pynvml, args.record, samples=args.samples, interval=args.interval)
    except pynvml.NVMLError as exc:
        print(f"NVML unavailable ({exc}): nothing recorded", file=sys.stderr)
        return 1
    print(f"recorded {len(fixture['devices'])} GPU(s) x {args.samples} samples to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
