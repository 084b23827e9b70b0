"""The critical path of one trace: the chain of spans that really set its end time.

Walk backwards from a span's end: the child that finished last (but not after
the cursor) is what the span was waiting for; recurse into it, move the cursor
to that child's start and look again among the children that finished before
it. Time a span spends with no such child under the cursor is its own self
time, so the span itself is always on the path. Children that overrun their
parent are cut at the parent's end; children that start at or after the
cursor are skipped (nothing before the end was waiting for them), and so are
children that ended before their parent started (clock skew across hosts).

The walk is iterative (deep traces cannot overflow the stack), visits each span
once (cycles and duplicated span ids cannot make it loop) and sorts each
visited span's children once, so it costs O(n log n). Where many paths of one
trace are wanted (one per stream that saw it), a :class:`TraceIndex` built
once lets each walk cost only the subtree it starts at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spikehound.model import Span, SpanKind

__all__ = ["TraceIndex", "critical_path", "critical_path_times", "hop_callees"]


@dataclass(slots=True)
class TraceIndex:
    """One trace's spans by id and by parent (of duplicated ids the first counts).

    ``budget`` is how many spans the walks over it may still visit in all: a walk that would go past it
    finds no path (and uses the budget up). Many walks of one odd trace (a chain of thousands of spans, each
    its own stream) would otherwise cost the square of its length.
    """

    by_id: dict[bytes, Span]
    children: dict[bytes, list[Span]]
    roots: list[Span]  # spans without a parent, or whose parent is not in the trace (or is themselves)
    budget: int = 2**62

    @classmethod
    def of(cls, spans: Sequence[Span], budget: int = 2**62) -> TraceIndex:
        by_id: dict[bytes, Span] = {}
        for s in spans:
            by_id.setdefault(s.span_id, s)
        children: dict[bytes, list[Span]] = {}
        roots: list[Span] = []
        for s in by_id.values():
            parent = s.parent_span_id
            if parent is None or parent == s.span_id or parent not in by_id:
                roots.append(s)
            else:
                children.setdefault(parent, []).append(s)
        return cls(by_id, children, roots, budget)


def critical_path(spans: Sequence[Span] | TraceIndex, root: bytes | None = None) -> list[bytes]:
    """Span ids on the critical path of the trace made of ``spans``, ordered by start time.

    The path starts at ``root`` when given (the entry span of a stream deep in a
    trace), otherwise at the trace's root: a span without a parent, or whose
    parent is not among ``spans`` (or is itself). With several such spans, the
    one that ended last is taken (ties: the longest). Of duplicated span ids
    the first occurrence counts.

    >>> from spikehound.model import SpanKind, StatusCode
    >>> def span(i, parent, start, end):
    ...     return Span(trace_id=bytes(16), span_id=bytes([i]), parent_span_id=parent and bytes([parent]),
    ...                 service="svc", host=None, name=f"op{i}", kind=SpanKind.INTERNAL,
    ...                 start_unix_nano=start, end_unix_nano=end, status=StatusCode.UNSET, attributes={})
    >>> trace = [span(1, None, 0, 100),   # root
    ...          span(2, 1, 5, 20),       # cache lookup, overlapped by the db query
    ...          span(3, 1, 10, 60),      # db query
    ...          span(4, 1, 60, 95)]      # render, waits for the db query
    >>> [s[0] for s in critical_path(trace)]
    [1, 3, 4]
    >>> critical_path(trace, root=bytes([3]))
    [b'\\x03']
    >>> critical_path([])
    []
    """
    return [span.span_id for span, _ in critical_path_times(spans, root)]


def critical_path_times(spans: Sequence[Span] | TraceIndex, root: bytes | None = None) -> list[tuple[Span, int]]:
    """The critical path as ``(span, self_ns)`` pairs, ordered by start time.

    ``self_ns`` is the time on the path that the span spent itself: its
    (clamped) duration less the time of the path children it waited for. The
    self times add up to the root's duration. For a CLIENT span whose path
    child is a SERVER span, its self time is the network and queueing time of
    that hop.

    >>> from spikehound.model import SpanKind, StatusCode
    >>> def span(i, parent, start, end):
    ...     return Span(trace_id=bytes(16), span_id=bytes([i]), parent_span_id=parent and bytes([parent]),
    ...                 service="svc", host=None, name=f"op{i}", kind=SpanKind.INTERNAL,
    ...                 start_unix_nano=start, end_unix_nano=end, status=StatusCode.UNSET, attributes={})
    >>> trace = [span(1, None, 0, 100), span(2, 1, 5, 20), span(3, 1, 10, 60), span(4, 1, 60, 95)]
    >>> [(s.name, t) for s, t in critical_path_times(trace)]
    [('op1', 15), ('op3', 50), ('op4', 35)]
    """
    index = spans if isinstance(spans, TraceIndex) else TraceIndex.of(spans)
    by_id, children, roots = index.by_id, index.children, index.roots
    if not by_id or (root is not None and root not in by_id) or index.budget <= 0:
        return []

    if root is not None:
        top = by_id[root]
    else:
        # Only a pure parent cycle leaves no root; then any span is as good a start
        # as another, so use the same rule over all of them.
        candidates = roots or list(by_id.values())
        top = max(candidates, key=lambda s: (s.end_unix_nano, s.duration_ns, s.span_id))

    # (start, depth, span, self time): depth breaks start ties so a parent precedes a
    # child that starts with it.
    on_path: list[tuple[int, int, bytes, Span, int]] = []
    visited: set[bytes] = set()
    spent = 0
    # (span, its start and end cut to its parent's effective interval, depth)
    top_end = max(top.end_unix_nano, top.start_unix_nano)
    stack: list[tuple[Span, int, int, int]] = [(top, top.start_unix_nano, top_end, 0)]
    while stack:
        span, eff_start, eff_end, depth = stack.pop()
        if span.span_id in visited:
            continue
        visited.add(span.span_id)
        waited = 0
        kids = children.get(span.span_id)
        spent += 1 + (len(kids) if kids else 0)  # each span on the path, and the children it sorts
        if spent > index.budget:
            index.budget = 0
            return []
        if kids:
            # Latest (clamped) end first; on equal ends the longer child, then the
            # span id, so the answer does not depend on input order.
            ordered = sorted(
                kids,
                key=lambda c: (min(c.end_unix_nano, eff_end), -c.start_unix_nano, c.span_id),
                reverse=True,
            )
            cursor = eff_end
            for child in ordered:
                child_end = min(child.end_unix_nano, eff_end)
                if cursor <= eff_start or child_end <= eff_start:
                    # Nothing left to wait for; and a child that ended before the span (clock skew) was not
                    # waited for: counting it would take negative time off the span's own.
                    break
                if child_end > cursor or child.start_unix_nano >= cursor or child.span_id in visited:
                    # Ends after the cursor (overlapped by a later pick), or lies
                    # wholly after it: the parent was not waiting on it.
                    continue
                child_start = max(child.start_unix_nano, eff_start)
                stack.append((child, child_start, child_end, depth + 1))
                waited += child_end - child_start
                cursor = child.start_unix_nano
        on_path.append((span.start_unix_nano, depth, span.span_id, span, max(eff_end - eff_start - waited, 0)))

    index.budget -= spent
    on_path.sort(key=lambda p: (p[0], p[1], p[2]))
    return [(span, self_ns) for _, _, _, span, self_ns in on_path]


def hop_callees(path: Sequence[tuple[Span, int]]) -> dict[bytes, Span]:
    """For each CLIENT span on ``path`` whose path child is a SERVER span: that callee, by the CLIENT's span id.

    The CLIENT span's self time on the path is then the network and queueing
    time of the hop to the callee. Of several SERVER children on the path
    (retries), the last to start counts.
    """
    on_path = {span.span_id: span for span, _ in path}
    callees: dict[bytes, Span] = {}
    for span, _ in path:
        parent = span.parent_span_id
        caller = on_path.get(parent) if parent is not None and parent != span.span_id else None
        if span.kind == SpanKind.SERVER and caller is not None and caller.kind == SpanKind.CLIENT:
            callees[caller.span_id] = span
    return callees
