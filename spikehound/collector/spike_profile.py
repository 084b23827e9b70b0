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

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spikehound.detectors.stack_diff import FunctionChange, StackDiff, diff_stacks, pick_kind, sentence
from spikehound.model import CauseKind, ProfileStack, Spike
from spikehound.storage.reader import MAX_PROFILE_ROWS, Reader
from spikehound.timefmt import NS, rfc3339

log = logging.getLogger("spikehound.collector.spike_profile")

BASELINE_MIN_NS = 5 * 60 * NS  # a shorter baseline holds too few samples of a 19 Hz profiler to compare
BASELINE_MAX_NS = 30 * 60 * NS  # further back, deploys and load changes make the baseline another process
# A spike starts at the onset its slow requests show (docs/detection.md), which may trail the code's change by a
# request's length; one profile window keeps that stretch out of the baseline without giving up a minute of it.
GAP_NS = 10 * NS
MAX_GROUPS = 6  # (service, host) groups compared per spike: the causes name a few, the page shows each
DEFAULT_CHANGES = 20
PROFILES_DOC = "docs/profiles.md"


@dataclass(frozen=True, slots=True)
class ProfileGroup:
    """The diff of one service's processes on one host."""

    service: str
    host: str
    kind: str  # cpu | wall
    processes: tuple[tuple[int, str], ...]  # (pid, process name), by pid
    diff: StackDiff

    @property
    def where(self) -> str:
        return f"{self.service or 'an unnamed service'} on {self.host}"

    def culprit_sentence(self) -> str | None:
        c = self.diff.culprit
        return sentence(c, self.service or self.host) if c is not None else None


@dataclass(frozen=True, slots=True)
class SpikeProfile:
    spike: Spike
    spike_period: tuple[int, int]
    baseline_period: tuple[int, int]
    groups: tuple[ProfileGroup, ...]
    reason: str | None  # why there is nothing to compare; None when groups were found

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


def _inside(s: ProfileStack, since: int, until: int) -> bool:
    mid = (s.start_unix_nano + s.end_unix_nano) // 2
    return since <= mid < until


def spike_profile(reader: Reader, spike: Spike, now_ns: int | None = None,
                  max_rows: int = MAX_PROFILE_ROWS) -> SpikeProfile:
    """Read the stacks of the spike's processes in both periods and diff them per (service, host).

    ``max_rows`` bounds each read (one per target and period): the alert path passes a small one.
    """
    start, end, b_start, b_end = periods(spike, time.time_ns() if now_ns is None else now_ns)
    by_group: dict[tuple[str, str], tuple[list[ProfileStack], list[ProfileStack]]] = {}
    order: list[tuple[str, str]] = []
    wanted = targets(spike)
    for service, host in wanted:
        found = [s for s in reader.profile_stacks(start, end, service=service, host=host, limit=max_rows)
                 if _inside(s, start, end)]
        before = [s for s in reader.profile_stacks(b_start, b_end, service=service, host=host, limit=max_rows)
                  if _inside(s, b_start, b_end)]
        fresh: dict[tuple[str, str], int] = {}
        for side, stacks in ((0, found), (1, before)):
            for s in stacks:
                key = (s.service, s.host)
                if key in by_group and key not in fresh:
                    continue  # read already through an earlier target: counted once
                if key not in by_group:
                    by_group[key] = ([], [])
                    fresh[key] = 0
                by_group[key][side].append(s)
                if side == 0:
                    fresh[key] += s.samples
        # Within one target (a host's processes), the busiest during the spike first.
        order += sorted(fresh, key=lambda k: (-fresh[k], k))
    groups = []
    for key in order[:MAX_GROUPS]:
        during, before = by_group[key]
        if not during:
            continue  # profiled before the spike only: nothing to say about the spike
        kind = pick_kind(during + before)
        during = [s for s in during if s.kind == kind]
        before = [s for s in before if s.kind == kind]
        processes = tuple(sorted({(s.pid, s.process) for s in during + before}))
        groups.append(ProfileGroup(key[0], key[1], kind, processes, diff_stacks(during, before)))
    reason = None if groups else _no_profiles(wanted)
    return SpikeProfile(spike, (start, end), (b_start, b_end), tuple(groups), reason)


def _no_profiles(wanted: Sequence[tuple[str | None, str | None]]) -> str:
    names = []
    for service, host in wanted[:3]:
        names.append(f"{service} on {host}" if service and host else service or f"any process on {host}")
    what = ", ".join(names) or "the spike's services"
    return f"no profiles of {what} in the spike's windows: is the agent profiling? see {PROFILES_DOC}"


def culprit_line(reader: Reader, spike: Spike, now_ns: int | None = None, max_rows: int = 20_000) -> str | None:
    """The line alerts add when the profile names a clear culprit (the ``profile`` annotation); None otherwise.

    Alerts are rendered when the spike opens (after the route's group wait), so this reads what is stored by
    then: the spike's first windows, enough for a culprit that is clear; a later notification of the same
    spike (a repeat, the resolve notice) reads again and may name it when the first could not.
    """
    found = spike_profile(reader, spike, now_ns, max_rows).culprit
    if found is None:
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
            "profiles": out, "reason": profile.reason}
