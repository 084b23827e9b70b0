"""What the CPU did differently during a spike: sampled call stacks of the spike's windows against those before it.

Every function is identified by its name and file (the line is ignored: one function, whatever line a sample
stopped on). For each period it gets two shares of the period's samples:

* **self**: samples whose *leaf* frame is the function, time spent in its own code;
* **total**: samples with the function *anywhere* on the stack, counted once per stack however often it
  recurses, time spent in it or in what it called.

A caller whose callee got hot grows in total share only; the callee grows in both. Functions are ranked by the
growth of their self share (spike share minus baseline share), then of their total share, so the code that
burns the extra CPU comes first and its callers after it. The raw sample counts are kept beside the shares.

A **clear culprit** is named only when the data can carry it (the thresholds below say why each is what it
is): enough samples in both periods, a top self-share growth that is large, beyond sampling noise, and well
ahead of the runner-up's. Otherwise :attr:`StackDiff.culprit` is None and :attr:`StackDiff.why_unclear` says
what was missing.

Stacks are folded as they are read (:class:`StackFolder`): a stack becomes the numbers of its functions
(:class:`FrameTable` holds each name and file once), its samples go to per-function counters and its first
:data:`TREE_MAX_DEPTH` functions to the flame tree's paths, and its frames are let go; the table stops at
:data:`MAX_FRAMES` frames, :data:`MAX_FUNCTIONS` functions or :data:`MAX_FUNCTION_CHARS` characters of names and
files, and says so in :attr:`StackDiff.partial`.

>>> from spikehound.model import ProfileStack
>>> def stack(leaf, samples):
...     return ProfileStack(host="gpu-1", service="preprocess", pid=42, process="python3", start_unix_nano=0,
...                         end_unix_nano=10**10, samples=samples,
...                         frames=(("handle", "stack.py", 210), (leaf, "stack.py", 180)))
>>> diff = diff_stacks([stack("burn_cpu", 82), stack("parse", 118)], [stack("burn_cpu", 12), stack("parse", 188)])
>>> top = diff.changes[0]
>>> top.function, round(top.self_spike, 2), round(top.self_baseline, 2), top.self_samples_spike
('burn_cpu', 0.41, 0.06, 82)
>>> sentence(top, "preprocess")
'burn_cpu in preprocess: 41% of samples during the spike against 6% before'
>>> diff.culprit is top
True
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spikehound.model import Frame, ProfileStack

FunctionKey = tuple[str, str]  # (function, file): a function whatever line the sample stopped on

# --- when a culprit is clear ------------------------------------------------------------------
# 50 samples are 2.6 s of one busy thread at 19 Hz: with fewer, one function's share swings by tens of points
# from one sampled second to the next, and no ranking of them means anything.
MIN_SPIKE_SAMPLES = 50
MIN_BASELINE_SAMPLES = 50
# A function whose self share grew by less than 10 points took less than a tenth of the CPU more: too little to
# explain a p99 that grew by multiples, and within the drift of a process's mix from one minute to the next.
MIN_SELF_GROWTH = 0.10
# The growth, over the standard error of the difference of two proportions: samples of one thread within a
# window are not independent (a hot loop is sampled many times in a row), so 3 rather than the usual 2.
MIN_Z = 3.0
# Twice the runner-up's growth: two functions that grew alike (allocation and the GC it triggers, two halves of
# one slow path) are one change, and naming one of them as *the* culprit would mislead.
MIN_LEAD = 2.0
# A function that already ran most of the time cannot grow much in share (73% -> 85%), yet may run four times
# as often: on-CPU samples a second are CPU time. It is a culprit when its own samples a second at least
# doubled, beyond noise (MIN_Z, as counts over time), and it carries more than half of its process's growth.
MIN_RATE_RATIO = 2.0
MIN_GROWTH_CARRIED = 0.5
# ... and its share grew by 5 points at least: twice the load doubles every function's samples a second, and
# changes no function's share.
MIN_SELF_GROWTH_BY_RATE = 0.05
# The flame tree drops nodes under 0.5% of the samples of both periods, and stops at this depth and size, so a
# page gets a tree it can draw (the dropped samples show as the gap under their parent).
TREE_MIN_SHARE = 0.005
TREE_MAX_DEPTH = 64
TREE_MAX_NODES = 2000
# What one diff reads at most, whatever senders stored: a real process runs a few thousand distinct stacks of a
# few dozen frames and a few thousand functions; beyond these the diff says it is partial (docs/profile-diff.md).
MAX_FRAMES = 2_000_000
MAX_FUNCTIONS = 100_000
# Characters of the distinct names and files one diff holds: real ones are a few dozen characters, so a few
# thousand functions take well under a MB; a sender may store names and files of a thousand characters each, and
# the function count alone would then let one diff hold 200 MB.
MAX_FUNCTION_CHARS = 4_000_000


@dataclass(frozen=True, slots=True)
class FunctionChange:
    """One function's shares of the samples in each period (0..1), and the counts they come from."""

    function: str
    file: str
    self_spike: float
    self_baseline: float
    total_spike: float
    total_baseline: float
    samples_spike: int  # samples with the function on the stack (its total), during the spike
    samples_baseline: int  # the same before it
    self_samples_spike: int = 0  # samples with the function as the leaf (its self), during the spike
    self_samples_baseline: int = 0
    self_rate_spike: float = 0.0  # its self samples a second of profiled time, during the spike (0: unknown)
    self_rate_baseline: float = 0.0

    @property
    def self_growth(self) -> float:
        return self.self_spike - self.self_baseline

    @property
    def total_growth(self) -> float:
        return self.total_spike - self.total_baseline


@dataclass(slots=True)
class FlameNode:
    """One frame of the merged call tree: samples through it in each period, its callees by spike samples."""

    function: str
    file: str
    spike: int = 0
    baseline: int = 0
    children: dict[FunctionKey, FlameNode] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """The tree as the API and the page read it; children sorted by spike samples, then baseline.

        >>> FlameNode("all", "", 3, 1, {("f", "a.py"): FlameNode("f", "a.py", 3, 1)}).to_json()["children"][0]
        {'function': 'f', 'file': 'a.py', 'spike': 3, 'baseline': 1, 'children': []}
        """
        kids = sorted(self.children.values(), key=lambda n: (-n.spike, -n.baseline, n.function, n.file))
        return {"function": self.function, "file": self.file, "spike": self.spike, "baseline": self.baseline,
                "children": [k.to_json() for k in kids]}


@dataclass(frozen=True, slots=True)
class StackDiff:
    """The ranked changes (largest self-share growth first), the clear culprit if any, the counts and the tree."""

    changes: tuple[FunctionChange, ...]
    samples_spike: int
    samples_baseline: int
    culprit: FunctionChange | None
    why_unclear: str | None  # None when a culprit is named
    tree: FlameNode
    partial: str | None = None  # what the diff left unread at its bounds; None when it read everything


_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


class FrameTable:
    """The functions of one diff's stacks, each (name, file) held once and numbered, and what reading them cost.

    Stored stacks repeat the same few hundred functions thousands of times: a stack is kept as the numbers of
    its functions, never as frames, and the table stops taking stacks beyond ``max_frames`` frames read,
    ``max_functions`` distinct functions or ``max_chars`` characters of the distinct names and files it holds,
    saying so in :attr:`partial`.
    """

    def __init__(self, max_frames: int = MAX_FRAMES, max_functions: int = MAX_FUNCTIONS,
                 max_chars: int = MAX_FUNCTION_CHARS) -> None:
        self.max_frames, self.max_functions, self.max_chars = max_frames, max_functions, max_chars
        self.chars = 0  # characters of the distinct strings held
        self.keys: list[FunctionKey] = []
        self._ids: dict[FunctionKey, int] = {}
        self._strings: dict[str, str] = {}
        self.frames_read = 0
        self.partial: str | None = None

    def function_ids(self, frames: Sequence[Sequence[Any]]) -> list[int] | None:
        """The numbers of ``frames``' functions, root first; None when the stack would go beyond the table's bounds.

        A comprehension's frame is merged into the function that runs it. Up to Python 3.11 a comprehension
        runs in a frame of its own (``burn_cpu.<locals>.<listcomp>``; 3.10 names it bare, ``<listcomp>``); it
        is the function's own code all the same, and 3.12 inlines it (PEP 709). Merged, a function's self
        share is the same whichever Python the server runs. A qualified name says whose it is; a bare one is
        taken for its caller's.
        """
        if self.frames_read + len(frames) > self.max_frames:
            self.partial = f"the diff read {self.frames_read} frames, its limit being {self.max_frames}"
            return None
        self.frames_read += len(frames)
        ids: list[int] = []
        known = self._ids.get
        last_name = last_file = ""
        for frame in frames:
            name, file = frame[0], frame[1]
            if (ids and name.endswith(_COMPREHENSIONS) and last_file == file
                    and (".<locals>." not in name or name.startswith(last_name + "."))):
                continue  # its function's own code: the identity stays the caller's
            key = (name, file)
            fid = known(key)
            if fid is None:
                if len(self.keys) >= self.max_functions:
                    self.partial = f"the diff met {self.max_functions} distinct functions, its limit"
                    return None
                strings = self._strings
                grown = (0 if name in strings else len(name)) + (0 if file in strings or file == name else len(file))
                if self.chars + grown > self.max_chars:
                    self.partial = (f"the diff held {self.chars} characters of function names and files, its "
                                    f"limit being {self.max_chars}")
                    return None
                self.chars += grown
                key = (strings.setdefault(name, name), strings.setdefault(file, file))
                fid = self._ids[key] = len(self.keys)
                self.keys.append(key)
            ids.append(fid)
            last_name, last_file = name, file
        return ids


class StackFolder:
    """One group's stacks of both periods, folded as they are read into what the diff needs and nothing more:
    each function's self and total samples per period, and each stack's first :data:`TREE_MAX_DEPTH`
    functions (the flame tree's paths), merged with every stack that shares them."""

    def __init__(self, table: FrameTable) -> None:
        self.table = table
        self.self_counts: tuple[Counter[int], Counter[int]] = (Counter(), Counter())
        self.total_counts: tuple[Counter[int], Counter[int]] = (Counter(), Counter())
        self.samples = [0, 0]
        self.paths: dict[tuple[int, ...], list[int]] = {}

    def add(self, frames: Sequence[Sequence[Any]], spike: int, baseline: int) -> bool:
        """Count one stack's samples in each period (counts under 1 are not samples); False when the table's
        bounds refused it."""
        spike, baseline = max(spike, 0), max(baseline, 0)
        if not frames or not (spike or baseline):
            return True
        ids = self.table.function_ids(frames)
        if ids is None:
            return False
        leaf, once = ids[-1], set(ids)  # once per stack: a recursive function is not counted twice
        for side, n in ((0, spike), (1, baseline)):
            if n:
                self.self_counts[side][leaf] += n
                totals = self.total_counts[side]
                for key in once:
                    totals[key] += n
                self.samples[side] += n
        path = tuple(ids[:TREE_MAX_DEPTH])
        counts = self.paths.get(path)
        if counts is None:
            counts = self.paths[path] = [0, 0]
        counts[0] += spike
        counts[1] += baseline
        return True

    def diff(self, t_spike: float, t_base: float, partial: str | None = None) -> StackDiff:
        """The diff of what was added; ``t_spike`` and ``t_base`` are the profiled seconds of each period."""
        keys = self.table.keys
        (s_self, b_self), (s_total, b_total) = self.self_counts, self.total_counts
        n_spike, n_base = self.samples
        changes = []
        for fid in s_total.keys() | b_total.keys():
            function, file = keys[fid]
            changes.append(FunctionChange(
                function=function, file=file,
                self_spike=_share(s_self[fid], n_spike), self_baseline=_share(b_self[fid], n_base),
                total_spike=_share(s_total[fid], n_spike), total_baseline=_share(b_total[fid], n_base),
                samples_spike=s_total[fid], samples_baseline=b_total[fid],
                self_samples_spike=s_self[fid], self_samples_baseline=b_self[fid],
                self_rate_spike=_share(s_self[fid], t_spike), self_rate_baseline=_share(b_self[fid], t_base)))
        changes.sort(key=lambda c: (-c.self_growth, -c.total_growth, -c.samples_spike, c.function, c.file))
        culprit, why = judge(changes, n_spike, n_base, t_spike, t_base)
        return StackDiff(tuple(changes), n_spike, n_base, culprit, why,
                         _tree(self.paths, keys, n_spike, n_base), partial)


def _share(count: int, whole: int) -> float:
    return count / whole if whole else 0.0


def z_score(spike_count: int, spike_total: int, base_count: int, base_total: int) -> float:
    """How many standard errors apart two shares are (the pooled two-proportion test); 0 without data.

    >>> round(z_score(82, 200, 12, 200), 1), z_score(1, 1, 0, 0)
    (8.3, 0.0)
    """
    if not spike_total or not base_total:
        return 0.0
    pooled = (spike_count + base_count) / (spike_total + base_total)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / spike_total + 1 / base_total))
    if spread == 0:
        return 0.0
    return (spike_count / spike_total - base_count / base_total) / spread


def _tree(paths: dict[tuple[int, ...], list[int]], keys: Sequence[FunctionKey], n_spike: int,
          n_base: int) -> FlameNode:
    """The merged call tree of ``paths`` (function numbers, root first: their samples in each period), built
    one level at a time and pruned as it grows (:func:`_prune_level`): it never holds more than one level of
    nodes beyond those it keeps, however many distinct stacks there are."""
    root = FlameNode("all", "", n_spike, n_base)
    live = [(path, counts[0], counts[1], root) for path, counts in paths.items()]
    frontier, kept, depth = [root], 1, 0
    while frontier:
        grown = []
        for path, spike, baseline, node in live:
            if len(path) > depth:
                key = keys[path[depth]]
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = FlameNode(*key)
                child.spike += spike
                child.baseline += baseline
                grown.append((path, spike, baseline, child))
        frontier, kept = _prune_level(frontier, kept, n_spike, n_base)
        stay = {id(node) for node in frontier}
        live = [entry for entry in grown if id(entry[3]) in stay]
        depth += 1
    return root


def _prune_level(frontier: list[FlameNode], kept: int, n_spike: int, n_base: int) -> tuple[list[FlameNode], int]:
    """Drop the children of ``frontier`` too small to see in either period, then the smallest beyond the size
    cap (breadth first); the children kept, and how many nodes the tree keeps so far."""
    nxt = []
    for node in frontier:
        big = [k for k, c in node.children.items()
               if _share(c.spike, n_spike) >= TREE_MIN_SHARE or _share(c.baseline, n_base) >= TREE_MIN_SHARE]
        big.sort(key=lambda k: -max(_share(node.children[k].spike, n_spike),
                                    _share(node.children[k].baseline, n_base)))
        big = big[:max(0, TREE_MAX_NODES - kept)]
        node.children = {k: node.children[k] for k in big}
        kept += len(big)
        nxt.extend(node.children.values())
    return nxt, kept


def profiled_seconds(stacks: Iterable[ProfileStack]) -> float:
    """The seconds of sampling ``stacks`` stand for: each process's windows once, however many stacks they hold.

    >>> a = ProfileStack("h", "s", 1, "p", 0, 10**10, (("f", "a.py", 1),), 3)
    >>> profiled_seconds([a, ProfileStack("h", "s", 1, "p", 0, 10**10, (("g", "a.py", 2),), 5)])
    10.0
    """
    windows = {(s.host, s.service, s.pid, s.process, s.start_unix_nano, s.end_unix_nano) for s in stacks}
    return sum(w[5] - w[4] for w in windows) / 1e9


def diff_stacks(spike: Iterable[ProfileStack], baseline: Iterable[ProfileStack],
                table: FrameTable | None = None) -> StackDiff:
    """The stacks of the spike's windows against those of the windows before it (one kind of sample each)."""
    spike, baseline = list(spike), list(baseline)
    # Windows and processes repeat the same stacks: each distinct one is folded once, with both periods' samples.
    folded: dict[tuple[Frame, ...], list[int]] = {}
    for side, stacks in ((0, spike), (1, baseline)):
        for s in stacks:
            if s.samples > 0 and s.frames:
                counts = folded.get(s.frames)
                if counts is None:
                    counts = folded[s.frames] = [0, 0]
                counts[side] += s.samples
    table = table or FrameTable()
    folder = StackFolder(table)
    for frames, (n_spike, n_base) in folded.items():
        folder.add(frames, n_spike, n_base)
    partial = f"{table.partial}: the shares are of what was read" if table.partial else None
    return folder.diff(profiled_seconds(spike), profiled_seconds(baseline), partial)


def judge(changes: Sequence[FunctionChange], n_spike: int, n_base: int, t_spike: float = 0.0, t_base: float = 0.0
          ) -> tuple[FunctionChange | None, str | None]:
    """The clear culprit among ``changes`` (ranked as :func:`diff_stacks` ranks them), or None and why not.

    By share (the top change); failing that, by samples a second when the profiled seconds of both periods
    (``t_spike``, ``t_base``) are known. A function whose share grew while its own samples a second fell grew
    only because the rest shrank (a thread blocked on a slower peer): never the culprit.

    >>> judge([], 10, 400)
    (None, 'only 10 samples during the spike (50 needed)')
    """
    if n_spike < MIN_SPIKE_SAMPLES:
        return None, f"only {n_spike} samples during the spike ({MIN_SPIKE_SAMPLES} needed)"
    if n_base < MIN_BASELINE_SAMPLES:
        return None, f"only {n_base} samples before the spike ({MIN_BASELINE_SAMPLES} needed)"
    top, why = _by_share(changes, n_spike, n_base)
    timed = t_spike > 0 and t_base > 0
    if top is not None and timed and top.self_rate_spike < top.self_rate_baseline:
        top, why = None, (f"{top.function}'s share grew only as the rest shrank: {top.self_rate_spike:.1f} samples "
                          f"a second during the spike against {top.self_rate_baseline:.1f} before")
    if top is None and timed:
        by_rate = _by_rate(changes, n_spike / t_spike - n_base / t_base, t_spike, t_base)
        if by_rate is not None:
            return by_rate, None
    return top, why


def _by_rate(changes: Sequence[FunctionChange], growth: float, t_spike: float, t_base: float
             ) -> FunctionChange | None:
    """The function whose own samples a second grew most, when that growth is clear (see MIN_RATE_RATIO)."""
    if growth <= 0 or not changes:
        return None
    top = max(changes, key=lambda c: (c.self_rate_spike - c.self_rate_baseline, c.function, c.file))
    rise = top.self_rate_spike - top.self_rate_baseline
    spread = math.sqrt(top.self_samples_spike / t_spike**2 + top.self_samples_baseline / t_base**2)
    if (rise > MIN_GROWTH_CARRIED * growth and top.self_rate_spike >= MIN_RATE_RATIO * top.self_rate_baseline
            and top.self_growth >= MIN_SELF_GROWTH_BY_RATE and spread > 0 and rise / spread >= MIN_Z):
        return top
    return None


def _by_share(changes: Sequence[FunctionChange], n_spike: int, n_base: int
              ) -> tuple[FunctionChange | None, str | None]:
    if not changes or changes[0].self_growth < MIN_SELF_GROWTH:
        grew = f"{changes[0].self_growth * 100:.0f} points" if changes else "nothing"
        return None, f"no function's own share grew by {MIN_SELF_GROWTH * 100:.0f} points (the most: {grew})"
    top = changes[0]
    z = z_score(top.self_samples_spike, n_spike, top.self_samples_baseline, n_base)
    if z < MIN_Z:
        return None, f"{top.function}'s growth is within sampling noise (z {z:.1f} < {MIN_Z:g})"
    runner_up = changes[1].self_growth if len(changes) > 1 else 0.0
    if runner_up > 0 and top.self_growth < MIN_LEAD * runner_up:
        return None, (f"{top.function} and {changes[1].function} grew alike "
                      f"({top.self_growth * 100:.0f} and {runner_up * 100:.0f} points)")
    return top, None


def percent(share: float) -> str:
    """A share as the sentences state it; under 1% as "<1%" rather than a misleading 0%.

    >>> percent(0.41), percent(0.003), percent(0.0)
    ('41%', '<1%', '0%')
    """
    if 0 < share < 0.005:
        return "<1%"
    return f"{share * 100:.0f}%"


def sentence(change: FunctionChange, where: str, *, total: bool = False) -> str:
    """One change in words: the self share (``total``: the share with its callees) in each period."""
    if total:
        return (f"{change.function} in {where} (with what it calls): {percent(change.total_spike)} of samples "
                f"during the spike against {percent(change.total_baseline)} before")
    return (f"{change.function} in {where}: {percent(change.self_spike)} of samples during the spike against "
            f"{percent(change.self_baseline)} before")


def pick_kind(stacks: Iterable[ProfileStack]) -> str:
    """The kind of sample to compare: ``cpu`` when there is any (idle threads would dilute wall-clock shares),
    else ``wall``.

    >>> pick_kind([]), pick_kind([ProfileStack("h", "s", 1, "p", 0, 1, (("f", "a.py", 1),), 3, kind="wall")])
    ('cpu', 'wall')
    """
    kinds = {s.kind for s in stacks}
    return "wall" if kinds == {"wall"} else "cpu"
