"""The profile diff at spike time: which processes' sampled stacks to compare, over which periods, read from
storage and handed to ``spikehound.detectors.stack_diff``; shared by the API, the spike page, the CLI and alerts.

Which processes: those of the services the spike's causes name, on the hosts they name, in the causes' order:
the top cause's service first (the process serving the slow span), then the other causes' services (a network
cause's callee, then its caller), then the spike's own service. A cause that names a host but no service (a
resource) brings every profiled process of that host.

Which periods: the spike's ``[start, end]`` (an open spike: up to now), against a baseline of the same length
(at least 5, at most 30 minutes) ending :data:`GAP_NS` before the spike's start. A profile window (10 s) belongs
to the period holding its midpoint, so the window that straddles the onset counts once, in neither when it
falls in the gap.

>>> from spikehound.model import Cause, CauseKind
>>> spike = Spike(id="s", service="gateway", operation="POST /v1/predict", state="open", start_unix_nano=0,
...               end_unix_nano=None, p99_ns=1, baseline_p99_ns=1, causes=(
...     Cause(CauseKind.SPAN, 0.8, "slow", service="preprocess", operation="burn", host="gpu-1"),
...     Cause(CauseKind.RESOURCE, 0.1, "cpu", host="gpu-1", resource="system.cpu.utilization"),
...     Cause(CauseKind.NETWORK, 0.1, "hop", service="model-server", peer_service="gateway")))
>>> targets(spike)
[('preprocess', 'gpu-1'), (None, 'gpu-1'), ('model-server', None), ('gateway', None)]
>>> [p / NS for p in periods(spike, now_ns=120 * NS)]
[0.0, 120.0, -310.0, -10.0]
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter as Metric

from spikehound.detectors.stack_diff import (
    MAX_FRAMES,
    MAX_FUNCTION_CHARS,
    MAX_FUNCTIONS,
    FrameTable,
    FunctionChange,
    StackDiff,
    StackFolder,
    sentence,
)
from spikehound.model import CauseKind, Spike
from spikehound.storage.reader import MAX_PROFILE_ROWS, Reader
from spikehound.timefmt import rfc3339
from spikehound.units import NS

log = logging.getLogger("spikehound.collector.spike_profile")

BASELINE_MIN_NS = 5 * 60 * NS  # a shorter baseline holds too few samples of a 19 Hz profiler to compare
BASELINE_MAX_NS = 30 * 60 * NS  # further back, deploys and load changes make the baseline another process
# A spike starts at the onset its slow requests show (docs/detection.md), which may trail the code's change by a
# request's length; one profile window keeps that stretch out of the baseline without giving up a minute of it.
GAP_NS = 10 * NS
MAX_GROUPS = 6  # (service, host) groups compared per spike: the causes name a few, the page shows each
DEFAULT_CHANGES = 20
# Distinct stacks one diff counts: a real process runs a few thousand; each costs the diff a few hundred bytes.
MAX_DIFF_STACKS = 50_000
# Diffs running at once in one collector, the API's and the spike page's together: each holds a few tens of MB
# at its bounds and keeps a core busy for seconds; more at once would only share the same cores and hold more.
MAX_CONCURRENT_DIFFS = 2
# Processes of one group a diff keeps by name (pid, process, samples), per period and kind of sample; others met
# after them are only counted. A service runs a few to a few dozen; a sender may store thousands of made-up ones.
MAX_KEPT_PROCESSES = 1000
# Processes listed per group in the answer, the busiest during the spike first; the rest are counted.
MAX_LISTED_PROCESSES = 100
DIFF_RETRY_AFTER_SECONDS = 2
PROFILES_DOC = "docs/profiles.md"


@dataclass(frozen=True, slots=True)
class ProfileGroup:
    """The diff of one service's processes on one host."""

    service: str
    host: str
    kind: str  # cpu | wall
    processes: tuple[tuple[int, str], ...]  # (pid, process name), by pid: the busiest MAX_LISTED_PROCESSES
    diff: StackDiff
    processes_omitted: int = 0  # distinct processes profiled but not listed

    @property
    def where(self) -> str:
        return f"{self.service or 'an unnamed service'} on {self.host}"


@dataclass(frozen=True, slots=True)
class SpikeProfile:
    spike: Spike
    spike_period: tuple[int, int]
    baseline_period: tuple[int, int]
    groups: tuple[ProfileGroup, ...]
    reason: str | None  # why there is nothing to compare; None when groups were found
    partial: str | None = None  # what the diff left unread at its bounds (DiffBounds); None when it read all

    @property
    def culprit(self) -> tuple[ProfileGroup, FunctionChange] | None:
        """The first group (in the causes' order) that names a clear culprit."""
        for g in self.groups:
            if g.diff.culprit is not None:
                return g, g.diff.culprit
        return None


def targets(spike: Spike) -> list[tuple[str | None, str | None]]:
    """(service, host) filters in the order the causes rank them; None matches any."""
    out: list[tuple[str | None, str | None]] = []

    def add(service: str | None, host: str | None) -> None:
        if (service or host) and (service, host) not in out and (service, None) not in out:
            out.append((service, host))

    for c in spike.causes:
        if c.kind == CauseKind.RESOURCE and not c.service:
            add(None, c.host)
            continue
        add(c.service, c.host)
        if c.kind == CauseKind.NETWORK:
            add(c.peer_service, None)  # the caller's process may be the slow side of the hop
    add(spike.service, None)
    return out


def periods(spike: Spike, now_ns: int) -> tuple[int, int, int, int]:
    """(spike start, spike end, baseline start, baseline end) in ns."""
    start = spike.start_unix_nano
    end = spike.end_unix_nano if spike.end_unix_nano is not None else max(now_ns, start + NS)
    length = min(max(end - start, BASELINE_MIN_NS), BASELINE_MAX_NS)
    return start, end, start - GAP_NS - length, start - GAP_NS


@dataclass(frozen=True, slots=True)
class DiffBounds:
    """What one diff may read and how long it may take, whatever senders stored; beyond any of them it stops
    and says what it left out (:attr:`SpikeProfile.partial`)."""

    rows: int = MAX_PROFILE_ROWS  # (process, window, stack) rows of each read: one per target and period
    stacks: int = MAX_DIFF_STACKS  # distinct stacks counted, the rows of others left out
    frames: int = MAX_FRAMES  # frames read, heaviest stacks first
    functions: int = MAX_FUNCTIONS  # distinct (function, file)
    chars: int = MAX_FUNCTION_CHARS  # characters of the distinct function names and files held
    seconds: float | None = None  # None: as long as it takes


# The alert path's diff runs beside detection, by itself, when a routed spike opens: a fixed, small amount of
# memory (a few tens of MB at most) and the alert's own time budget.
ALERT_BOUNDS = DiffBounds(rows=20_000, stacks=5_000, frames=500_000, functions=20_000, chars=1_000_000)

ProcessKey = tuple[int, str]  # (pid, process name)


@dataclass(slots=True)
class _Processes:
    """One period's processes of one kind of sample: at most MAX_KEPT_PROCESSES by name with their samples, the
    others as hashes only (to count them), and the profiled seconds of all their windows.

    When the kept ones reach their bound, the less busy half is let go (counted among the others): a busy
    process gathers samples window after window and stays, so the busiest are kept whatever their number."""

    kept: dict[ProcessKey, int] = field(default_factory=dict)
    others: set[int] = field(default_factory=set)
    seconds: float = 0.0

    def add(self, key: ProcessKey, samples: int) -> None:
        samples = max(samples, 0)
        if key in self.kept:
            self.kept[key] += samples
            return
        if len(self.kept) >= MAX_KEPT_PROCESSES:
            ranked = sorted(self.kept, key=lambda k: -self.kept[k])
            for gone in ranked[MAX_KEPT_PROCESSES // 2:]:
                self.others.add(hash(gone))
                del self.kept[gone]
        self.kept[key] = samples


@dataclass(slots=True)
class _Period:
    """One group's rows of one period, folded as they stream: samples per stack, and the processes and profiled
    seconds, by kind.

    A read comes ordered by (start, host, pid) and a group is one host, so the rows of one (start, pid) come
    together: a window, (pid, process, start, end) of one kind, is told from those already counted among them
    only, by hash; what the period holds does not grow with the windows read."""

    rows: int = 0
    samples: dict[str, Counter[int]] = field(default_factory=dict)
    processes: dict[str, _Processes] = field(default_factory=dict)
    run: tuple[int, int] = (-1, -1)  # the (start, pid) of the rows being read
    seen: set[int] = field(default_factory=set)  # hashes of the windows of that (start, pid) counted

    def add_window(self, kind: str, pid: int, process: str, start: int, end: int, samples: int) -> None:
        if self.run != (start, pid):
            self.run = (start, pid)
            self.seen.clear()
        procs = self.processes.get(kind)
        if procs is None:
            procs = self.processes[kind] = _Processes()
        procs.add((pid, process), samples)
        window = hash((kind, process, end))
        if window not in self.seen:
            self.seen.add(window)
            procs.seconds += (end - start) / 1e9

    def of(self, kind: str) -> tuple[Counter[int], _Processes]:
        return self.samples.get(kind, Counter()), self.processes.get(kind, _Processes())


class _Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def spike_profile(reader: Reader, spike: Spike, now_ns: int | None = None,
                  max_rows: int | None = None, bounds: DiffBounds = DiffBounds()) -> SpikeProfile:
    """Read the stacks of the spike's processes in both periods and diff them per (service, host).

    Rows are streamed and folded per stack as they come (no frames); then the frames of the stacks counted
    are read, heaviest first, each folded into per-function counters and the flame tree's paths and let go.
    What one diff holds is bounded by ``bounds`` (``max_rows``, when given, replaces its ``rows``), whatever
    is stored.
    """
    if max_rows is not None:
        bounds = dataclasses.replace(bounds, rows=max_rows)
    deadline = _Deadline(bounds.seconds)
    start, end, b_start, b_end = periods(spike, time.time_ns() if now_ns is None else now_ns)
    by_group: dict[tuple[str, str], tuple[_Period, _Period]] = {}
    order: list[tuple[str, str]] = []
    wanted = targets(spike)
    counted: set[int] = set()  # distinct stacks counted, at most bounds.stacks
    left_out = 0  # rows of stacks beyond that
    partial: list[str] = []
    for service, host in wanted:
        fresh: dict[tuple[str, str], int] = {}
        for side, (since, until) in enumerate(((start, end), (b_start, b_end))):
            read = 0
            rows = reader.profile_rows(since, until, service=service, host=host, limit=bounds.rows)
            for r in rows:
                read += 1
                if read % 1024 == 0 and deadline.passed():
                    break
                if not since <= (r.start_ns + r.end_ns) // 2 < until:
                    continue  # a window belongs to the period holding its midpoint
                key = (r.service, r.host)
                if key in by_group and key not in fresh:
                    continue  # read already through an earlier target: counted once
                if key not in by_group:
                    by_group[key] = (_Period(), _Period())
                    fresh[key] = 0
                period = by_group[key][side]
                period.rows += 1
                period.add_window(r.kind, r.pid, r.process, r.start_ns, r.end_ns, r.samples)
                if side == 0:
                    fresh[key] += r.samples
                if r.samples <= 0:
                    continue
                if r.stack_id not in counted:
                    if len(counted) >= bounds.stacks:
                        left_out += 1
                        continue
                    counted.add(r.stack_id)
                period.samples.setdefault(r.kind, Counter())[r.stack_id] += r.samples
            rows.close()  # a deadline may have stopped the read early: its cursor goes now
            if read >= bounds.rows:
                partial.append(f"a read stopped at its limit of {bounds.rows} rows")
        # Within one target (a host's processes), the busiest during the spike first.
        order += sorted(fresh, key=lambda k: (-fresh[k], k))
        if deadline.passed():
            break
    if left_out:
        partial.append(f"the diff counted {bounds.stacks} distinct stacks, its limit, and left out {left_out} "
                       "rows of others")
    chosen = []
    for key in order[:MAX_GROUPS]:
        during, before = by_group[key]
        if not during.rows:
            continue  # profiled before the spike only: nothing to say about the spike
        kinds = during.processes.keys() | before.processes.keys()
        kind = "wall" if kinds == {"wall"} else "cpu"  # as pick_kind: idle threads dilute wall-clock shares
        chosen.append((key, kind, during.of(kind), before.of(kind)))
    table = FrameTable(bounds.frames, bounds.functions, bounds.chars)
    folders = [StackFolder(table) for _ in chosen]
    weight: Counter[int] = Counter()
    for _, _, (d_samples, _), (b_samples, _) in chosen:
        weight.update(d_samples)
        weight.update(b_samples)
    # Heaviest first: what bounds leave out is the rarest stacks, the ones that move a share least.
    ids = sorted(weight, key=lambda i: (-weight[i], i))
    with closing(reader.stack_frames(ids)) as stacks:  # closed at once when the bounds stop it early
        for stack_id, frames in stacks:
            if deadline.passed():
                break
            if not all(folder.add(frames, d_samples.get(stack_id, 0), b_samples.get(stack_id, 0))
                       for folder, (_, _, (d_samples, _), (b_samples, _)) in zip(folders, chosen, strict=True)):
                break
    if table.partial:
        partial.append(table.partial)
    if deadline.passed():
        partial.append(f"the diff ran out of its {bounds.seconds:g} s")
    cut = f"{'; '.join(partial)}: the shares are of what was read" if partial else None
    groups = []
    for ((service, host), kind, (_, d_procs), (_, b_procs)), folder in zip(chosen, folders, strict=True):
        processes, omitted = _listed(d_procs, b_procs)
        diff = folder.diff(d_procs.seconds, b_procs.seconds, cut)
        groups.append(ProfileGroup(service, host, kind, processes, diff, omitted))
    reason = None if groups else _no_profiles(wanted)
    return SpikeProfile(spike, (start, end), (b_start, b_end), tuple(groups), reason, cut)


def _listed(during: _Processes, before: _Processes) -> tuple[tuple[ProcessKey, ...], int]:
    """The processes to list, the busiest during the spike (then before it) first, by pid; and how many others
    were profiled."""
    kept = during.kept.keys() | before.kept.keys()
    rank = sorted(kept, key=lambda k: (-during.kept.get(k, 0), -before.kept.get(k, 0), k))
    listed = tuple(sorted(rank[:MAX_LISTED_PROCESSES]))
    others = (during.others | before.others) - {hash(k) for k in kept}
    return listed, len(kept) - len(listed) + len(others)


def _no_profiles(wanted: Sequence[tuple[str | None, str | None]]) -> str:
    names = []
    for service, host in wanted[:3]:
        names.append(f"{service} on {host}" if service and host else service or f"any process on {host}")
    what = ", ".join(names) or "the spike's services"
    return f"no profiles of {what} in the spike's windows: is the agent profiling? see {PROFILES_DOC}"


def culprit_line(reader: Reader, spike: Spike, now_ns: int | None = None,
                 bounds: DiffBounds = ALERT_BOUNDS) -> str | None:
    """The line alerts add when the profile names a clear culprit (the ``profile`` annotation); None otherwise.

    Alerts are rendered when the spike opens (after the route's group wait), so this reads what is stored by
    then: the spike's first windows, enough for a culprit that is clear; a later notification of the same
    spike (a repeat, the resolve notice) reads again and may name it when the first could not. A diff cut at
    its bounds names no culprit here: an alert's line must not rest on part of the samples (the page and the
    API show the partial diff, saying so).
    """
    profile = spike_profile(reader, spike, now_ns, bounds=bounds)
    found = profile.culprit
    if found is None or profile.partial is not None:
        return None
    group, change = found
    return f"{sentence(change, group.service or group.host)} (on {group.host})"


# --- the JSON of the API, the page and the CLI ------------------------------------------------


def change_json(change: FunctionChange, where: str) -> dict[str, Any]:
    return {"function": change.function, "file": change.file,
            "self_spike": round(change.self_spike, 6), "self_baseline": round(change.self_baseline, 6),
            "total_spike": round(change.total_spike, 6), "total_baseline": round(change.total_baseline, 6),
            "samples_spike": change.samples_spike, "samples_baseline": change.samples_baseline,
            "self_samples_spike": change.self_samples_spike, "self_samples_baseline": change.self_samples_baseline,
            "self_rate_spike": round(change.self_rate_spike, 3),
            "self_rate_baseline": round(change.self_rate_baseline, 3),
            "sentence": sentence(change, where)}


def profile_json(profile: SpikeProfile, changes: int = DEFAULT_CHANGES) -> dict[str, Any]:
    """The API's answer for a spike's profile diff (``GET /api/v1/spikes/{id}/profile``)."""
    found = profile.culprit
    out = []
    for g in profile.groups:
        where = g.service or g.host
        out.append({"service": g.service, "host": g.host, "kind": g.kind,
                    "processes": [{"pid": pid, "process": name} for pid, name in g.processes],
                    "processes_omitted": g.processes_omitted,
                    "samples_spike": g.diff.samples_spike, "samples_baseline": g.diff.samples_baseline,
                    "culprit": change_json(g.diff.culprit, where) if g.diff.culprit else None,
                    "why_unclear": g.diff.why_unclear,
                    "changes": [change_json(c, where) for c in g.diff.changes[:changes]],
                    "flame": g.diff.tree.to_json()})
    return {"spike_id": profile.spike.id,
            "spike_period": {"start": rfc3339(profile.spike_period[0]), "end": rfc3339(profile.spike_period[1])},
            "baseline_period": {"start": rfc3339(profile.baseline_period[0]),
                                "end": rfc3339(profile.baseline_period[1])},
            "culprit": None if found is None else {"service": found[0].service, "host": found[0].host,
                                                   **change_json(found[1], found[0].service or found[0].host)},
            "profiles": out, "reason": profile.reason, "partial": profile.partial}


# --- how many diffs at once ---------------------------------------------------------------------


class DiffGate:
    """At most ``most`` diffs at once in one collector: the API's and the spike page's share one gate.

    A slot is taken on the event loop before the diff is handed to the thread pool and given back by the
    thread when the diff is done, so a client that hangs up does not free a slot its diff still uses.
    """

    def __init__(self, most: int = MAX_CONCURRENT_DIFFS, refused: Metric | None = None) -> None:
        self.most = most
        self._free = threading.BoundedSemaphore(most)
        self._refused = refused

    def enter(self, surface: str) -> bool:
        """Take a slot for a diff asked for by ``surface`` (``api``, ``page``); False, counted, when none is free."""
        if self._free.acquire(blocking=False):
            return True
        if self._refused is not None:
            self._refused.labels(surface).inc()
        return False

    def leave(self) -> None:
        self._free.release()

    def busy(self) -> str:
        return (f"{self.most} profile diffs are running already (the collector's limit); retry in "
                f"{DIFF_RETRY_AFTER_SECONDS} s")
