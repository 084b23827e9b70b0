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

from spikehound.model import DEFAULT_PERIOD_NS, Frame, ProfileStack
from spikehound.otlp import MAX_ERRORS_KEPT, MAX_TIME_NS, Limits, attributes, parse_body
from spikehound.units import NS

__all__ = ["DEFAULT_PERIOD_NS", "MAX_COUNT", "MAX_FRAMES", "MAX_FRAME_CHARS_PER_REQUEST", "MAX_STACKS_PER_REQUEST",
           "MIN_TIME_NS", "DecodedProfiles", "cut_frames", "decode_profiles", "encode_profiles",
           "parse_profiles_request", "profile_samples", "stacks_of_samples"]

MAX_FRAMES = 256  # frames kept per stack: a deeper one keeps its root-most and leaf-most (cut_frames)
MAX_STACKS_PER_REQUEST = 10_000  # rows of one write: a profiler sends a few hundred; an IN list stays bounded
# Characters of frames (function + file names, FRAME_OVERHEAD a frame) the distinct stacks of one request may
# hold: what it expands to in memory and in profile_stacks' frames JSON, however few bytes it came in (its
# strings are sent once and referred to by index). The agent's windows hold a few hundred stacks of tens of
# ~100-character frames, about 1 MiB at most; 8 MiB leaves that eight times over and still bounds a hostile
# request to tens of MB written (against 2 GB for a 1.6 MB request of 256-frame stacks of 2 KB names).
MAX_FRAME_CHARS_PER_REQUEST = 8 << 20
FRAME_OVERHEAD = 16  # a frame's JSON besides its names: brackets, quotes, the line number
MAX_STACK_SAMPLES = 2**31 - 1  # one stack's samples in one profile: a 32-bit integer column on PostgreSQL
MAX_COUNT = 2**63 - 1  # counts saturate here: the largest an OTLP int64 (rejected_profiles) holds
MIN_TIME_NS = 946_684_800 * NS  # 2000-01-01: a profile dated before is from a clock that was never set
SCOPE_NAME = "spikehound.agent.profiler"
_KINDS = ("cpu", "wall")


@dataclass(slots=True)
class DecodedProfiles:
    """The stacks of one export request, and what was refused or cut."""

    stacks: list[ProfileStack] = field(default_factory=list)
    rejected: int = 0  # samples refused
    errors: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)  # what was cut: frames, function_name, ...
    # Samples refused for being dated after the receiver's clock plus the allowed skew, by (service, host).
    future: dict[tuple[str, str], int] = field(default_factory=dict)

    def reject(self, message: str, samples: int = 1) -> None:
        self.rejected = min(MAX_COUNT, self.rejected + max(0, samples))
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
                    not_after_ns: int = MAX_TIME_NS, max_stacks: int = MAX_STACKS_PER_REQUEST,
                    max_frame_chars: int = MAX_FRAME_CHARS_PER_REQUEST) -> DecodedProfiles:
    """Validate and convert every sample of a request into :class:`ProfileStack` records.

    A sample whose stack, location or function index points outside the dictionary, or with a negative
    count, is refused with a reason; so is a profile dated after ``not_after_ns`` or before
    :data:`MIN_TIME_NS`, or without a host. Names are cut to ``limits`` and stacks to :data:`MAX_FRAMES`,
    counted in ``truncated``. Samples of one stack in one profile are summed (saturating at
    :data:`MAX_COUNT`).

    What one request expands to is bounded while it is decoded, not after: at most ``max_stacks`` stacks,
    and at most ``max_frame_chars`` characters of frames (function and file names, plus
    :data:`FRAME_OVERHEAD` a frame) over its distinct stacks. The samples of the stacks past either bound
    are refused with a reason, and their stacks are not resolved once the bound is reached.
    """
    out = DecodedProfiles()
    d = req.dictionary
    name_limit = limits.name if limits is not None else None
    host_limit = limits.resource_name if limits is not None else None
    budget = _Budget(max_stacks, max_frame_chars)
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
                _decode_profile(out, profile, d, frames_of, budget, host, service, pid, process, not_after_ns)
    return out


def profile_samples(profile: profiles_pb2.Profile) -> int:
    """The samples a profile refused as a whole counts: a sample without a value is one, one with a negative
    count (invalid) is one refused sample, and the sum saturates at :data:`MAX_COUNT`.

    >>> p = profiles_pb2.Profile()
    >>> _ = p.samples.add(values=[-5]), p.samples.add(), p.samples.add(values=[0])
    >>> profile_samples(p)
    2
    >>> _ = p.samples.add(values=[MAX_COUNT]), p.samples.add(values=[MAX_COUNT])
    >>> profile_samples(p) == MAX_COUNT
    True
    """
    total = 0
    for sample in profile.samples:
        count = sample.values[0] if sample.values else 1
        total = min(MAX_COUNT, total + (count if count >= 0 else 1))
    return total


class _Budget:
    """What the stacks of one request may still expand to: stacks, and characters of their frames."""

    def __init__(self, max_stacks: int, max_frame_chars: int) -> None:
        self.stacks_left = max_stacks
        self.chars_left = max_frame_chars
        self.max_stacks = max_stacks
        self.max_frame_chars = max_frame_chars
        self.charged: set[tuple[Frame, ...]] = set()  # distinct stacks already paid for
        self.full = ""  # why no further new stack is taken, once one was refused


def _decode_profile(out: DecodedProfiles, profile: profiles_pb2.Profile, d: profiles_pb2.ProfilesDictionary,
                    frames_of: _Frames, budget: _Budget, host: str, service: str, pid: int, process: str,
                    not_after_ns: int) -> None:
    start, duration = profile.time_unix_nano, profile.duration_nano
    if not host:
        out.reject(f"profile of pid {pid}: resource has no host.name attribute", profile_samples(profile))
        return
    if not start or start + duration > MAX_TIME_NS or duration <= 0:
        out.reject(f"profile of pid {pid} on {host}: time {start} + {duration} ns is not a window",
                   profile_samples(profile))
        return
    if start + duration > not_after_ns:
        total = profile_samples(profile)
        out.reject(f"profile of pid {pid} on {host}: dated after the collector's clock plus the allowed skew", total)
        out.future[(service, host)] = min(MAX_COUNT, out.future.get((service, host), 0) + total)
        return
    if start < MIN_TIME_NS:
        out.reject(f"profile of pid {pid} on {host}: dated {start} ns, before 2000-01-01: the sender's clock is "
                   "wrong", profile_samples(profile))
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
        if budget.full and not frames_of.resolved(sample.stack_index):
            _refuse_over_budget(out, budget, count)  # not resolved: past the bound, resolving is the cost
            continue
        frames = frames_of.stack(sample.stack_index)
        if frames is None:
            out.reject(f"profile of pid {pid} on {host}: stack {sample.stack_index} is not in the dictionary", count)
            continue
        if frames not in counts:
            if budget.stacks_left <= 0:
                budget.full = budget.full or (f"more than {budget.max_stacks} stacks in one request: the rest was "
                                              "refused; send fewer at a time")
                _refuse_over_budget(out, budget, count)
                continue
            if frames not in budget.charged:
                cost = sum(len(function) + len(file) + FRAME_OVERHEAD for function, file, _ in frames)
                if cost > budget.chars_left:
                    budget.full = budget.full or (
                        f"the request's stacks hold more than {budget.max_frame_chars} characters of frames: the "
                        "rest was refused; send fewer or shorter stacks at a time")
                    _refuse_over_budget(out, budget, count)
                    continue
                budget.chars_left -= cost
                budget.charged.add(frames)
            budget.stacks_left -= 1
            counts[frames] = 0
        counts[frames] = min(MAX_COUNT, counts[frames] + count)
    period = profile.period if profile.period > 0 else DEFAULT_PERIOD_NS
    for frames, count in counts.items():
        if count > MAX_STACK_SAMPLES:
            out.reject(f"profile of pid {pid} on {host}: a stack counts {count} samples, more than "
                       f"{MAX_STACK_SAMPLES}", count)
            continue
        out.stacks.append(ProfileStack(host=host, service=service, pid=pid, process=process, start_unix_nano=start,
                                       end_unix_nano=start + duration, frames=frames, samples=count, kind=kind,
                                       period_ns=period))


def _refuse_over_budget(out: DecodedProfiles, budget: _Budget, count: int) -> None:
    """Refuse a sample of a stack past the request's bound; the reason is said once."""
    if budget.full not in out.errors:
        out.reject(budget.full, count)
    else:
        out.rejected = min(MAX_COUNT, out.rejected + count)


class _Frames:
    """Stacks of the request's dictionary as root-first frames, each resolved once."""

    def __init__(self, d: profiles_pb2.ProfilesDictionary, name_limit: int | None, truncated: dict[str, int]) -> None:
        self.d = d
        self.name_limit = name_limit
        self.truncated = truncated
        self._stacks: dict[int, tuple[Frame, ...] | None] = {}
        self._locations: dict[int, Frame | None] = {}

    def resolved(self, index: int) -> bool:
        return index in self._stacks

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
                    frames = cut_frames(frames)
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


def cut_frames(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """A root-first stack deeper than :data:`MAX_FRAMES`, cut in its middle: the root-most frames (the caller's
    context, what a diff groups by) and the leaf-most ones (where the time is spent: the self share) are kept,
    with a marker frame ``(N frames cut)`` between them.

    >>> deep = tuple((f"f{i}", "a.py", i) for i in range(1000))
    >>> cut = cut_frames(deep)
    >>> len(cut), cut[0], cut[MAX_FRAMES // 2], cut[-1]
    (256, ('f0', 'a.py', 0), ('(745 frames cut)', '', 0), ('f999', 'a.py', 999))
    """
    if len(frames) <= MAX_FRAMES:
        return frames
    root = MAX_FRAMES // 2
    leaf = MAX_FRAMES - root - 1
    marker: Frame = (f"({len(frames) - root - leaf} frames cut)", "", 0)
    return (*frames[:root], marker, *frames[len(frames) - leaf:])


def _text(value: Any, limit: int | None) -> str:
    text = value if isinstance(value, str) else ""
    return text[:limit] if limit is not None else text


def stacks_of_samples(stacks: Sequence[ProfileStack]) -> int:
    """The samples a list of stacks holds (what a receiver counts as accepted)."""
    return sum(s.samples for s in stacks)

