"""Where a request's time went: the critical path of each entry span, cut into stages.

``detectors.critical_path`` says which spans set a trace's end time; this
module says how much of that time each of them holds. Along the path every
span has an effective interval (its own, cut to its parent's effective
interval, as the path walk cuts it); its *self time* is that interval less the
intervals of its children on the path, which never overlap. The self times of
a path add up to the duration of the span it starts from.

A stage is what the time is booked to: a span's own work (``kind="span"``:
service and span name), or, for a CLIENT span whose child on the path is the
remote SERVER span, the time the call spent outside the callee: the network
and queue gap on that edge (``kind="network"``: the callee's service and
operation, the caller as ``peer_service``, as for network causes).

Every entry span of the trace (roots and SERVER spans, as in the latency
streams) gets the stages of its own part of the path. An entry span that the
trace's path does not pass through (a parallel branch, or a second root of a
partial trace) gets the path of its own subtree.

>>> from spikehound.model import Span, SpanKind, StatusCode
>>> def span(i, parent, service, name, kind, start, end):
...     return Span(trace_id=bytes(16), span_id=bytes([i]) * 8, parent_span_id=parent and bytes([parent]) * 8,
...                 service=service, host=None, name=name, kind=kind, start_unix_nano=start, end_unix_nano=end,
...                 status=StatusCode.UNSET)
>>> trace = [span(1, None, "gateway", "POST /predict", SpanKind.SERVER, 0, 100),
...          span(2, 1, "gateway", "POST /infer", SpanKind.CLIENT, 10, 90),
...          span(3, 2, "model", "POST /infer", SpanKind.SERVER, 15, 85),
...          span(4, 3, "model", "forward", SpanKind.INTERNAL, 20, 80)]
>>> [(e.service, sorted((s.label, t) for s, t in stages.items())) for e, stages in entry_stage_times(trace)]
... # doctest: +NORMALIZE_WHITESPACE
[('gateway', [('gateway: POST /predict', 20), ('model: POST /infer', 10), ('model: forward', 60),
              ('network gateway -> model POST /infer', 10)]),
 ('model', [('model: POST /infer', 10), ('model: forward', 60)])]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from detectors.critical_path import critical_path
from spikehound.model import Span, SpanKind

__all__ = ["Stage", "entry_stage_times"]

_SERVER, _CLIENT = SpanKind.SERVER, SpanKind.CLIENT


class Stage(NamedTuple):
    """What a piece of critical-path time is booked to (a tuple: cheap to hash, millions are)."""

    kind: str  # "span" (the span's own work) or "network" (a CLIENT call's time outside its SERVER span)
    service: str  # the span's service; for network, the callee
    name: str  # the span name; for network, the callee's operation
    peer_service: str | None = None  # for network: the caller

    @property
    def label(self) -> str:
        if self.kind == "network":
            return f"network {self.peer_service} -> {self.service} {self.name}"
        return f"{self.service}: {self.name}"


def _is_entry(s: Span) -> bool:
    return s.parent_span_id is None or s.kind == _SERVER


def entry_stage_times(spans: Sequence[Span]) -> list[tuple[Span, dict[Stage, int]]]:
    """For each entry span of one trace: nanoseconds of its critical path per stage, in start order."""
    by_id: dict[bytes, Span] = {}
    for s in spans:
        by_id.setdefault(s.span_id, s)
    done: dict[bytes, dict[Stage, int]] = {}
    _book_path(list(by_id.values()), by_id, done)
    entries = [s for s in by_id.values() if _is_entry(s)]
    missed = [e for e in entries if e.span_id not in done]
    if missed:  # entries off the trace's path: each walks its own subtree
        children: dict[bytes, list[Span]] = {}
        for s in by_id.values():
            parent = s.parent_span_id
            if parent is not None and parent != s.span_id and parent in by_id:
                children.setdefault(parent, []).append(s)
        for entry in sorted(missed, key=lambda s: (s.start_unix_nano, s.span_id)):
            if entry.span_id not in done:
                _book_path(_subtree(entry, children), by_id, done)
    entries.sort(key=lambda s: (s.start_unix_nano, s.span_id))
    return [(e, done[e.span_id]) for e in entries if e.span_id in done]


def _subtree(root: Span, children: dict[bytes, list[Span]]) -> list[Span]:
    out, stack, seen = [], [root], {root.span_id}
    while stack:
        span = stack.pop()
        out.append(span)
        for child in children.get(span.span_id, ()):
            if child.span_id not in seen:
                seen.add(child.span_id)
                stack.append(child)
    return out


def _book_path(spans: list[Span], by_id: dict[bytes, Span], done: dict[bytes, dict[Stage, int]]) -> None:
    """Compute the critical path of ``spans`` and book its self times to every entry span on it."""
    path = critical_path(spans)
    if not path:
        return
    on_path = set(path)
    kids: dict[bytes, list[Span]] = {}
    root: Span | None = None
    for span_id in path:
        span = by_id[span_id]
        parent = span.parent_span_id
        if parent is not None and parent != span_id and parent in on_path:
            kids.setdefault(parent, []).append(span)
        elif root is None:
            root = span
    assert root is not None
    # Walk from the root: (span, effective start, effective end, stage dicts of the entry spans above it).
    stack: list[tuple[Span, int, int, list[dict[Stage, int]]]] = [(root, root.start_unix_nano, root.end_unix_nano, [])]
    while stack:
        span, start, end, above = stack.pop()
        if _is_entry(span) and span.span_id not in done:  # an entry is booked by one path only
            above = [*above, done.setdefault(span.span_id, {})]
        own = end - start
        remote = None
        for child in kids.get(span.span_id, ()):
            c_end = min(child.end_unix_nano, end)
            c_start = min(max(child.start_unix_nano, start), c_end)
            own -= c_end - c_start
            if span.kind == _CLIENT and child.kind == _SERVER:
                remote = child
            stack.append((child, c_start, c_end, above))
        stage = (Stage("network", remote.service, remote.name, span.service) if remote is not None
                 else Stage("span", span.service, span.name))
        own = max(own, 0)
        for stages in above:
            stages[stage] = stages.get(stage, 0) + own
