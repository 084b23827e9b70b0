"""Where a request's time went: the critical path of each entry span, cut into stages.

``spikehound.detectors.critical_path`` says which spans set a trace's end time; this
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

from spikehound.detectors.critical_path import critical_path_times, hop_callees
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
    _book_path(list(by_id.values()), done)
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
                _book_path(_subtree(entry, children), done)
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


def _book_path(spans: list[Span], done: dict[bytes, dict[Stage, int]]) -> None:
    """Book the self times of the critical path of ``spans`` to every entry span above them on it."""
    path = critical_path_times(spans)
    on_path = {span.span_id: span for span, _ in path}

    def path_parent(span: Span) -> Span | None:
        parent = span.parent_span_id
        return on_path.get(parent) if parent is not None and parent != span.span_id else None

    remote = hop_callees(path)
    # The stage dicts of the entry spans at and above each span on the path, filled parents first (a child
    # that starts before its parent, by clock skew, sorts before it in the path).
    above: dict[bytes, list[dict[Stage, int]]] = {}

    def entries_above(span: Span) -> list[dict[Stage, int]]:
        chain: list[Span] = []
        node: Span | None = span
        while node is not None and node.span_id not in above:
            chain.append(node)
            node = path_parent(node)
        inherited = above[node.span_id] if node is not None else []
        for link in reversed(chain):
            if _is_entry(link) and link.span_id not in done:  # an entry is booked by one path only
                inherited = [*inherited, done.setdefault(link.span_id, {})]
            above[link.span_id] = inherited
        return inherited

    for span, self_ns in path:
        callee = remote.get(span.span_id)
        stage = (Stage("network", callee.service, callee.name, span.service) if callee is not None
                 else Stage("span", span.service, span.name))
        for stages in entries_above(span):
            stages[stage] = stages.get(stage, 0) + self_ns
