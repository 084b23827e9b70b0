"""A trace laid out as waterfall rows: tree order, depth, bar position, the critical path and grown spans.

Pure computation on the core model; the page template draws the rows. Bars
are placed in percent of a time scale, which is the trace's own duration, or
a longer one when two traces are drawn side by side on the same scale.

>>> from spikehound.model import Span, SpanKind, StatusCode
>>> def span(i, parent, start_ms, end_ms, name):
...     return Span(trace_id=bytes(16), span_id=bytes([i]) * 8, parent_span_id=parent and bytes([parent]) * 8,
...                 service="svc", host="h", name=name, kind=SpanKind.INTERNAL, start_unix_nano=start_ms * MS,
...                 end_unix_nano=end_ms * MS, status=StatusCode.UNSET, attributes={})
>>> slow = layout([span(1, None, 0, 100, "root"), span(2, 1, 10, 90, "query")])
>>> [(r.depth, r.span.name, r.offset_pct, r.width_pct, r.on_path) for r in slow.rows]
[(0, 'root', 0.0, 100.0, True), (1, 'query', 10.0, 80.0, True)]
>>> normal = layout([span(1, None, 0, 40, "root"), span(2, 1, 10, 30, "query")], scale_ns=100 * MS)
>>> normal.rows[1].width_pct
20.0
>>> mark_grown(slow, normal)
>>> [(r.span.name, r.grown_ns and r.grown_ns // MS) for r in slow.rows]  # the query's own time: 60 ms more
[('root', None), ('query', 60)]

Ten decode steps under one parent are one row, a group:

>>> steps = layout([span(1, None, 0, 100, "generate")] + [span(i, 1, 10 * i - 18, 10 * i - 10, "step")
...                                                      for i in range(2, 12)])
>>> [(i.span.name, i.count if i.is_group else 1) for i in steps.items], steps.items[1].width_pct
([('generate', 1), ('step', 10)], 98.0)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from spikehound.detectors.critical_path import critical_path_times
from spikehound.model import Span, SpanKind
from spikehound.units import MS

# A component of the slow trace is "grown" when its critical-path time rose by at least this much...
GROWN_MIN_NS = 1 * MS
# ...and by this share of the whole trace's added latency, and of its own normal time.
GROWN_SHARE_OF_ADDED = 0.10
GROWN_SHARE_OF_NORMAL = 0.20
# This many siblings in a row with the same service and name are shown as one row.
GROUP_MIN = 8


@dataclass(slots=True, eq=False)
class Row:
    """One span of a waterfall."""

    span: Span
    depth: int
    offset_pct: float  # where the bar starts, in percent of the scale
    width_pct: float
    on_path: bool  # on the critical path
    path_self_ns: int  # its own time on the critical path (0 when off the path)
    grown_ns: int | None = None  # critical-path time added against the normal trace, when grown
    normal_ns: int | None = None  # that component's critical-path time in the normal trace
    group: Group | None = None  # the group of repeated siblings it is folded into
    is_group = False

    @property
    def anchor(self) -> str:
        """The id of what shows this span on a page: its own row, or the group it is folded into."""
        return self.group.anchor if self.group is not None else self.span.span_id.hex()


@dataclass(slots=True, eq=False)
class Group:
    """A run of GROUP_MIN or more siblings with the same service and name (a thousand decode steps, a fan-out
    of shard reads), shown as one row; ``rows`` are the members with their subtrees, in tree order."""

    first: Row
    count: int  # members
    rows: list[Row]
    offset_pct: float
    width_pct: float  # from the first member's start to the last member's end
    total_ns: int  # the members' durations added up
    grown_ns: int | None = None
    is_group = True

    @property
    def span(self) -> Span:
        return self.first.span

    @property
    def depth(self) -> int:
        return self.first.depth

    @property
    def anchor(self) -> str:
        return self.first.span.span_id.hex()

    @property
    def on_path(self) -> bool:
        return any(r.on_path for r in self.rows)

    @property
    def path_self_ns(self) -> int:
        return sum(r.path_self_ns for r in self.rows)


@dataclass(slots=True)
class Waterfall:
    """A trace's rows in tree order (children by start time), and what the page says about it."""

    trace_id: str
    rows: list[Row]
    start_ns: int
    duration_ns: int
    scale_ns: int
    path_ns: dict[tuple[str, str], int] = field(default_factory=dict)  # critical-path time per (service, name)
    items: list[Row | Group] = field(default_factory=list)  # what a page shows: rows, and groups in their place

    def shown(self, most: int) -> tuple[list[Row | Group], int]:
        """At most ``most`` items, the critical path and grown ones first, in tree order; and how many spans
        that leaves out."""
        if len(self.items) <= most:
            return self.items, 0
        keep = [i for i, item in enumerate(self.items) if item.on_path or item.grown_ns is not None][:most]
        chosen = set(keep)
        keep += [i for i in range(len(self.items)) if i not in chosen][:most - len(keep)]
        items = [self.items[i] for i in sorted(keep)]
        return items, len(self.rows) - sum(len(i.rows) if isinstance(i, Group) else 1 for i in items)

    @property
    def path_count(self) -> int:
        return sum(1 for r in self.rows if r.on_path)

    @property
    def grown_count(self) -> int:
        return sum(1 for r in self.rows if r.grown_ns is not None)

    def find(self, service: str, name: str | None = None, *, kind: SpanKind | None = None) -> Row | None:
        """The row of ``service`` (and span ``name``, and ``kind``) that matters most: on the path, longest there."""
        best: Row | None = None
        for r in self.rows:
            s = r.span
            if s.service != service or (name is not None and s.name != name) or (kind is not None and s.kind != kind):
                continue
            if best is None or (r.on_path, r.path_self_ns) > (best.on_path, best.path_self_ns):
                best = r
        return best

    def find_hop(self, caller: str, callee: str, operation: str | None) -> Row | None:
        """The CLIENT span of ``caller`` whose child is a SERVER span of ``callee``: the network hop."""
        parents = {r.span.span_id: r for r in self.rows}
        hops = [parents[r.span.parent_span_id] for r in self.rows
                if r.span.service == callee and r.span.kind == SpanKind.SERVER and r.span.parent_span_id in parents
                and parents[r.span.parent_span_id].span.service == caller
                and parents[r.span.parent_span_id].span.kind == SpanKind.CLIENT]
        if operation is not None:
            hops = [h for h in hops if h.span.name == operation] or hops
        return max(hops, key=lambda r: (r.on_path, r.path_self_ns), default=None)


def component(span: Span) -> tuple[str, str]:
    return span.service, span.name


def layout(spans: Sequence[Span], *, scale_ns: int | None = None) -> Waterfall:
    """Rows of ``spans`` in tree order; spans whose parent is missing start trees of their own."""
    by_id: dict[bytes, Span] = {}
    for s in spans:
        by_id.setdefault(s.span_id, s)
    if not by_id:
        return Waterfall(trace_id="", rows=[], start_ns=0, duration_ns=0, scale_ns=scale_ns or 1)
    children: dict[bytes, list[Span]] = defaultdict(list)
    roots: list[Span] = []
    for s in by_id.values():
        if s.parent_span_id is None or s.parent_span_id == s.span_id or s.parent_span_id not in by_id:
            roots.append(s)
        else:
            children[s.parent_span_id].append(s)
    start = min(s.start_unix_nano for s in by_id.values())
    end = max(s.end_unix_nano for s in by_id.values())
    duration = max(end - start, 1)
    scale = max(scale_ns or duration, duration)

    path = {s.span_id: self_ns for s, self_ns in critical_path_times(list(by_id.values()))}
    path_ns: dict[tuple[str, str], int] = defaultdict(int)
    for span_id, self_ns in path.items():
        path_ns[component(by_id[span_id])] += self_ns

    def order(group: list[Span]) -> list[Span]:
        return sorted(group, key=lambda s: (s.start_unix_nano, s.span_id))

    rows: list[Row] = []
    seen: set[bytes] = set()
    # Iterative depth-first walk (deep traces cannot overflow the stack); a cycle cannot make it loop.
    stack = [(s, 0) for s in reversed(order(roots))]
    while stack:
        s, depth = stack.pop()
        if s.span_id in seen:
            continue
        seen.add(s.span_id)
        rows.append(Row(span=s, depth=depth,
                        offset_pct=round(100 * (s.start_unix_nano - start) / scale, 3),
                        width_pct=round(100 * max(s.duration_ns, 0) / scale, 3),
                        on_path=s.span_id in path, path_self_ns=path.get(s.span_id, 0)))
        stack += [(c, depth + 1) for c in reversed(order(children.get(s.span_id, [])))]
    return Waterfall(trace_id=next(iter(by_id.values())).trace_id.hex(), rows=rows, start_ns=start,
                     duration_ns=duration, scale_ns=scale, path_ns=dict(path_ns), items=_grouped(rows, scale))


def _grouped(rows: list[Row], scale: int) -> list[Row | Group]:
    """Rows in tree order with every run of GROUP_MIN or more same-named siblings folded into a Group."""
    n = len(rows)
    end = list(range(n))  # the last row of each row's subtree
    open_rows: list[int] = []
    for i, r in enumerate(rows):
        while open_rows and rows[open_rows[-1]].depth >= r.depth:
            open_rows.pop()
        open_rows.append(i)
        for j in open_rows:
            end[j] = i
    items: list[Row | Group] = []
    i = 0
    while i < n:
        r = rows[i]
        members = [i]
        while len(members) < n:  # the siblings after it with the same service and name
            k = end[members[-1]] + 1
            if k >= n or rows[k].depth != r.depth or rows[k].span.parent_span_id != r.span.parent_span_id \
                    or component(rows[k].span) != component(r.span):
                break
            members.append(k)
        if len(members) < GROUP_MIN:
            items.append(r)
            i += 1
            continue
        last = rows[members[-1]].span
        group = Group(first=r, count=len(members), rows=rows[i:end[members[-1]] + 1], offset_pct=r.offset_pct,
                      width_pct=round(100 * max(last.end_unix_nano - r.span.start_unix_nano, 0) / scale, 3),
                      total_ns=sum(rows[m].span.duration_ns for m in members))
        for member in group.rows:
            member.group = group
        items.append(group)
        i = end[members[-1]] + 1
    return items


def mark_grown(slow: Waterfall, normal: Waterfall) -> None:
    """Mark the slow trace's critical-path spans whose component (service, span name) took materially longer
    on the critical path than in the normal trace. Self time is compared, so a parent is not marked for
    what its children added, and a CLIENT span is marked for a slower network hop."""
    added = max(slow.duration_ns - normal.duration_ns, 0)
    for r in slow.rows:
        if not r.on_path:
            continue
        key = component(r.span)
        before, after = normal.path_ns.get(key, 0), slow.path_ns.get(key, 0)
        grown = after - before
        if grown >= max(GROWN_MIN_NS, GROWN_SHARE_OF_ADDED * added, GROWN_SHARE_OF_NORMAL * before):
            r.grown_ns, r.normal_ns = grown, before
    for item in slow.items:
        if isinstance(item, Group):
            grown_by = {component(r.span): r.grown_ns for r in item.rows if r.grown_ns is not None}
            item.grown_ns = sum(grown_by.values()) if grown_by else None
