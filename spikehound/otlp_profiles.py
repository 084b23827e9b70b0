"""OTLP profiles (``opentelemetry.proto.profiles.v1development``): folded stacks in and out.

The agent sends what its sampling profiler aggregated, one ``Profile`` per process and window, through
``ProfilesService/Export`` like spans and metrics; the collector decodes it back into
:class:`~spikehound.model.ProfileStack` records. The signal is still in development upstream, so only what
folded stacks need is used: a sample's ``values[0]`` is its count, its stack is a list of locations
(leaf first, as in pprof) each with one line naming a function and its file. Other producers (an
OpenTelemetry eBPF profiler, an otelcol) are read the same way; a frame without a function name is named
by its address.

>>> stack = ProfileStack(host="gpu-1", service="preprocess", pid=42, process="python3", start_unix_nano=10**18,
...                      end_unix_nano=10**18 + 10**10, frames=(("main", "app.py", 3), ("burn", "app.py", 9)),
...                      samples=57)
>>> decoded = decode_profiles(encode_profiles([stack]))
>>> decoded.stacks == [stack], decoded.rejected
(True, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import ExportProfilesServiceRequest
from opentelemetry.proto.profiles.v1development import profiles_pb2

from spikehound.model import Frame, ProfileStack
from spikehound.otlp import MAX_ERRORS_KEPT, MAX_TIME_NS, Limits, attributes, parse_body

__all__ = ["MAX_FRAMES", "DecodedProfiles", "decode_profiles", "encode_profiles", "parse_profiles_request",
           "stacks_of_samples"]

MAX_FRAMES = 256  # frames kept per stack: deeper recursion keeps its root-most frames (counted as cut)
SCOPE_NAME = "spikehound.agent.profiler"
_KINDS = ("cpu", "wall")


@dataclass(slots=True)
class DecodedProfiles:
    """The stacks of one export request, and what was refused or cut."""

    stacks: list[ProfileStack] = field(default_factory=list)
    rejected: int = 0  # samples refused
    errors: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)  # what was cut: frames, function_name, ...
    future: int = 0  # samples refused for being dated after the receiver's clock plus the allowed skew

    def reject(self, message: str, samples: int = 1) -> None:
        self.rejected += samples
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(message)

    @property
    def error_message(self) -> str:
        return "; ".join(self.errors)


def parse_profiles_request(body: bytes, *, json: bool = False) -> ExportProfilesServiceRequest:
    """Parse an OTLP/HTTP profiles body; raise PayloadError with a reason when unreadable."""
    req = ExportProfilesServiceRequest()
    parse_body(req, body, json, ())
    return req


class _Tables:
    """The request-wide dictionary being built: every table starts with its zero entry, as the spec asks."""

    def __init__(self, dictionary: profiles_pb2.ProfilesDictionary) -> None:
        self.d = dictionary
        self.d.string_table.append("")
        self.d.function_table.add()
        self.d.location_table.add()
        self.d.stack_table.add()
        self.d.mapping_table.add()
        self._strings: dict[str, int] = {"": 0}
        self._functions: dict[tuple[str, str], int] = {}
        self._locations: dict[Frame, int] = {}
        self._stacks: dict[tuple[Frame, ...], int] = {}

    def string(self, text: str) -> int:
        index = self._strings.get(text)
        if index is None:
            index = self._strings[text] = len(self.d.string_table)
            self.d.string_table.append(text)
        return index

    def location(self, frame: Frame) -> int:
        index = self._locations.get(frame)
        if index is None:
            function, file, line = frame
            key = (function, file)
            fn = self._functions.get(key)
            if fn is None:
                fn = self._functions[key] = len(self.d.function_table)
                self.d.function_table.add(name_strindex=self.string(function), filename_strindex=self.string(file))
            index = self._locations[frame] = len(self.d.location_table)
            self.d.location_table.add().lines.add(function_index=fn, line=line)
        return index

    def stack(self, frames: tuple[Frame, ...]) -> int:
        index = self._stacks.get(frames)
        if index is None:
            index = self._stacks[frames] = len(self.d.stack_table)
            # pprof order: the leaf first.
            self.d.stack_table.add(location_indices=[self.location(f) for f in reversed(frames)])
        return index


def encode_profiles(stacks: Iterable[ProfileStack]) -> ExportProfilesServiceRequest:
    """One ``ResourceProfiles`` per process, one ``Profile`` per window and kind, one sample per stack."""
    req = ExportProfilesServiceRequest()
    tables = _Tables(req.dictionary)
    samples_type = (tables.string("samples"), tables.string("count"))
    nanoseconds = tables.string("nanoseconds")
    resources: dict[tuple[str, str, int, str], Any] = {}
    profiles: dict[tuple[tuple[str, str, int, str], str, int, int, int], Any] = {}
    for s in stacks:
        process = (s.host, s.service, s.pid, s.process)
        scope = resources.get(process)
        if scope is None:
            rp = req.resource_profiles.add()
            for key, value in (("host.name", s.host), ("service.name", s.service),
                               ("process.executable.name", s.process)):
                if value:
                    rp.resource.attributes.add(key=key).value.string_value = value
            rp.resource.attributes.add(key="process.pid").value.int_value = s.pid
            scope = resources[process] = rp.scope_profiles.add()
            scope.scope.name = SCOPE_NAME
        key = (process, s.kind, s.start_unix_nano, s.end_unix_nano, s.period_ns)
        profile = profiles.get(key)
        if profile is None:
            profile = profiles[key] = scope.profiles.add(
                time_unix_nano=s.start_unix_nano, duration_nano=s.end_unix_nano - s.start_unix_nano,
                period=s.period_ns)
            profile.sample_type.type_strindex, profile.sample_type.unit_strindex = samples_type
            profile.period_type.type_strindex = tables.string(s.kind)
            profile.period_type.unit_strindex = nanoseconds
        profile.samples.add(stack_index=tables.stack(s.frames), values=[s.samples])
    return req


def decode_profiles(req: ExportProfilesServiceRequest, *, limits: Limits | None = None,
                    not_after_ns: int = MAX_TIME_NS) -> DecodedProfiles:
    """Validate and convert every sample of a request into :class:`ProfileStack` records.

    A sample whose stack, location or function index points outside the dictionary, or with a negative
    count, is refused with a reason; so is a profile dated after ``not_after_ns`` or without a host. Names
    are cut to ``limits`` and stacks to :data:`MAX_FRAMES`, counted in ``truncated``. Samples of one stack
    in one profile are summed.
    """
    out = DecodedProfiles()
    d = req.dictionary
    name_limit = limits.name if limits is not None else None
    host_limit = limits.resource_name if limits is not None else None
    frames_of = _Frames(d, name_limit, out.truncated)
    for rp in req.resource_profiles:
        resource = attributes(rp.resource.attributes)
        host = _text(resource.get("host.name"), host_limit)
        service = _text(resource.get("service.name"), host_limit)
        process = _text(resource.get("process.executable.name") or resource.get("process.command"), name_limit)
        pid = resource.get("process.pid")
        pid = pid if isinstance(pid, int) and 0 <= pid < 1 << 31 else 0
        for sp in rp.scope_profiles:
            for profile in sp.profiles:
                _decode_profile(out, profile, d, frames_of, host, service, pid, process, not_after_ns)
    return out


def _decode_profile(out: DecodedProfiles, profile: profiles_pb2.Profile, d: profiles_pb2.ProfilesDictionary,
                    frames_of: _Frames, host: str, service: str, pid: int, process: str, not_after_ns: int) -> None:
    total = sum(sum(s.values[:1]) for s in profile.samples)
    start, duration = profile.time_unix_nano, profile.duration_nano
    if not host:
        out.reject(f"profile of pid {pid}: resource has no host.name attribute", total)
        return
    if not start or start + duration > MAX_TIME_NS or duration <= 0:
        out.reject(f"profile of pid {pid} on {host}: time {start} + {duration} ns is not a window", total)
        return
    if start + duration > not_after_ns:
        out.reject(f"profile of pid {pid} on {host}: dated after the collector's clock plus the allowed skew", total)
        out.future += total
        return
    strings = d.string_table
    kind_index = profile.period_type.type_strindex
    kind = strings[kind_index] if 0 <= kind_index < len(strings) else ""
    kind = kind if kind in _KINDS else "cpu"
    counts: dict[tuple[Frame, ...], int] = {}
    for sample in profile.samples:
        count = sample.values[0] if sample.values else 1
        if count <= 0:
            if count < 0:
                out.reject(f"profile of pid {pid} on {host}: a sample counts {count}")
            continue
        frames = frames_of.stack(sample.stack_index)
        if frames is None:
            out.reject(f"profile of pid {pid} on {host}: stack {sample.stack_index} is not in the dictionary", count)
            continue
        counts[frames] = counts.get(frames, 0) + count
    period = profile.period if profile.period > 0 else ProfileStack.period_ns
    for frames, count in counts.items():
        out.stacks.append(ProfileStack(host=host, service=service, pid=pid, process=process, start_unix_nano=start,
                                       end_unix_nano=start + duration, frames=frames, samples=count, kind=kind,
                                       period_ns=period))


class _Frames:
    """Stacks of the request's dictionary as root-first frames, each resolved once."""

    def __init__(self, d: profiles_pb2.ProfilesDictionary, name_limit: int | None, truncated: dict[str, int]) -> None:
        self.d = d
        self.name_limit = name_limit
        self.truncated = truncated
        self._stacks: dict[int, tuple[Frame, ...] | None] = {}
        self._locations: dict[int, Frame | None] = {}

    def stack(self, index: int) -> tuple[Frame, ...] | None:
        if index in self._stacks:
            return self._stacks[index]
        table = self.d.stack_table
        result: tuple[Frame, ...] | None = None
        if 0 < index < len(table):
            leaf_first = [self.location(i) for i in table[index].location_indices]
            if leaf_first and all(f is not None for f in leaf_first):
                frames = tuple(f for f in reversed(leaf_first) if f is not None)
                if len(frames) > MAX_FRAMES:
                    self.truncated["frames"] = self.truncated.get("frames", 0) + 1
                    frames = frames[:MAX_FRAMES]
                result = frames
        self._stacks[index] = result
        return result

    def location(self, index: int) -> Frame | None:
        if index in self._locations:
            return self._locations[index]
        d = self.d
        frame: Frame | None = None
        if 0 < index < len(d.location_table):
            location = d.location_table[index]
            if location.lines:
                line = location.lines[-1]  # the outermost of inlined functions: the one the source shows
                if 0 < line.function_index < len(d.function_table):
                    fn = d.function_table[line.function_index]
                    name, file = self.string(fn.name_strindex), self.string(fn.filename_strindex)
                    if name is not None and file is not None:
                        frame = (self.cut(name or f"0x{location.address:x}"), self.cut(file), max(0, line.line))
            elif location.address:
                frame = (f"0x{location.address:x}", "", 0)
        self._locations[index] = frame
        return frame

    def string(self, index: int) -> str | None:
        table = self.d.string_table
        return table[index] if 0 <= index < len(table) else None

    def cut(self, text: str) -> str:
        if self.name_limit is not None and len(text) > self.name_limit:
            self.truncated["function_name"] = self.truncated.get("function_name", 0) + 1
            return text[:self.name_limit]
        return text


def _text(value: Any, limit: int | None) -> str:
    text = value if isinstance(value, str) else ""
    return text[:limit] if limit is not None else text


def stacks_of_samples(stacks: Sequence[ProfileStack]) -> int:
    """The samples a list of stacks holds (what a receiver counts as accepted)."""
    return sum(s.samples for s in stacks)

