"""Critical path of a trace: which spans really determined its end time."""

from __future__ import annotations

import random
import time

from spikehound.detectors.critical_path import critical_path, critical_path_times, hop_callees
from spikehound.model import Span, SpanKind, StatusCode


def sid(i: int) -> bytes:
    return i.to_bytes(8, "big")


def make_span(i: int, parent: int | None, start: int, end: int, name: str | None = None) -> Span:
    return Span(
        trace_id=bytes(15) + b"\x01",
        span_id=sid(i),
        parent_span_id=None if parent is None else sid(parent),
        service="svc",
        host=None,
        name=name or f"op{i}",
        kind=SpanKind.SERVER if parent is None else SpanKind.INTERNAL,
        start_unix_nano=start,
        end_unix_nano=end,
        status=StatusCode.UNSET,
        attributes={},
    )


def ids(path: list[bytes]) -> list[int]:
    return [int.from_bytes(b, "big") for b in path]


def test_empty_trace_has_no_path():
    assert critical_path([]) == []


def test_single_span_is_its_own_path():
    assert ids(critical_path([make_span(1, None, 0, 10)])) == [1]


def test_sequential_children_are_all_on_the_path_in_start_order():
    trace = [
        make_span(1, None, 0, 100),
        make_span(4, 1, 60, 100),
        make_span(2, 1, 0, 30),
        make_span(3, 1, 30, 60),
    ]
    assert ids(critical_path(trace)) == [1, 2, 3, 4]


def test_gaps_are_parent_self_time_and_earlier_children_still_count():
    trace = [make_span(1, None, 0, 100), make_span(2, 1, 10, 20), make_span(3, 1, 50, 60)]
    assert ids(critical_path(trace)) == [1, 2, 3]


def test_parallel_children_only_the_last_ending_one_is_on_the_path():
    trace = [
        make_span(1, None, 0, 100),
        make_span(2, 1, 0, 10),  # preprocessing before the fan-out
        make_span(3, 1, 10, 40),
        make_span(4, 1, 10, 80),  # slowest shard: the request waited for this one
        make_span(5, 1, 10, 60),
        make_span(6, 4, 15, 75),  # inside the slowest shard
        make_span(7, 3, 12, 38),  # inside a fast shard: not on the path
    ]
    assert ids(critical_path(trace)) == [1, 2, 4, 6]


def test_child_overrunning_its_parent_is_cut_at_the_parent_end():
    trace = [
        make_span(1, None, 0, 100),
        make_span(2, 1, 0, 60),
        make_span(3, 1, 50, 150),  # overruns the root, counts up to 100
        make_span(4, 3, 55, 90),  # inside the overrun child, before the cut
        make_span(5, 3, 120, 140),  # wholly after the cut: not what the root waited for
    ]
    # Child 3 (cut to end at 100) is picked; child 2 ends at 60, after 3 started: overlapped.
    assert ids(critical_path(trace)) == [1, 3, 4]


def test_children_after_the_parent_end_are_skipped():
    trace = [make_span(1, None, 0, 100), make_span(2, 1, 100, 130), make_span(3, 1, 20, 70)]
    assert ids(critical_path(trace)) == [1, 3]


def test_a_child_that_ended_before_its_parent_started_is_not_waited_for():
    # Clock skew: the child (on another host) ended 4 ms before its parent began. The parent was not waiting
    # for it, so it is not on the path and the self times still add up to the root's duration.
    trace = [make_span(1, None, 0, 100), make_span(2, 1, 40, 80), make_span(3, 2, 30, 36), make_span(4, 2, 50, 70)]
    path = critical_path_times(trace)
    assert [(int.from_bytes(s.span_id, "big"), t) for s, t in path] == [(1, 60), (2, 20), (4, 20)]
    assert sum(t for _, t in path) == 100


def test_hop_callees_name_the_server_behind_each_client_on_the_path():
    def span(i: int, parent: int | None, kind: SpanKind, start: int, end: int) -> Span:
        s = make_span(i, parent, start, end)
        s.kind = kind
        return s

    trace = [span(1, None, SpanKind.SERVER, 0, 100), span(2, 1, SpanKind.CLIENT, 10, 90),
             span(3, 2, SpanKind.SERVER, 12, 40),   # the first attempt
             span(4, 2, SpanKind.SERVER, 45, 85),   # the retry: the hop's callee on the path is the last
             span(5, 1, SpanKind.CLIENT, 91, 99)]   # a database call: no SERVER span behind it
    callees = hop_callees(critical_path_times(trace))
    assert {int.from_bytes(k, "big"): int.from_bytes(v.span_id, "big") for k, v in callees.items()} == {2: 4}


def test_deep_chain_of_2000_spans_does_not_recurse():
    depth = 2_000
    trace = [make_span(i, None if i == 0 else i - 1, i, 10_000 - i) for i in range(depth)]
    random.Random(3).shuffle(trace)
    t0 = time.perf_counter()
    path = critical_path(trace)
    assert time.perf_counter() - t0 < 2.0
    assert ids(path) == list(range(depth))


def test_wide_trace_is_fast_and_picks_the_chain():
    # Root with 2,000 back-to-back children of 1 ns each, plus 2,000 overlapped ones.
    seq = [make_span(i, 0, i, i + 1) for i in range(1, 2_001)]
    overlapped = [make_span(10_000 + i, 0, i, i + 1) for i in range(1, 2_001)]
    trace = [make_span(0, None, 0, 2_001), *overlapped, *seq]
    path = ids(critical_path(trace))
    assert path[0] == 0
    assert len(path) == 2_001
    # Equal ends and starts: the choice among twins is deterministic whatever the input order.
    assert ids(critical_path(list(reversed(trace)))) == path


def test_orphans_the_last_ending_subtree_wins():
    # The real root was never received; two orphan subtrees remain.
    trace = [
        make_span(10, 99, 0, 50),
        make_span(11, 10, 5, 45),
        make_span(20, 98, 10, 80),
        make_span(21, 20, 20, 70),
        make_span(22, 20, 15, 30),
    ]
    assert ids(critical_path(trace)) == [20, 21]


def test_root_ties_prefer_the_longest_span():
    trace = [make_span(1, None, 50, 100), make_span(2, None, 0, 100), make_span(3, 2, 10, 90)]
    assert ids(critical_path(trace)) == [2, 3]


def test_garbage_cycles_self_parents_and_duplicates_do_not_hang():
    self_parent = make_span(1, 1, 0, 100)
    trace = [
        self_parent,
        make_span(2, 1, 10, 90),
        make_span(2, 1, 10, 95),  # duplicate id: the first one counts
        make_span(3, 4, 20, 30),  # 3 <-> 4: a cycle unreachable from the root
        make_span(4, 3, 20, 30),
    ]
    assert ids(critical_path(trace)) == [1, 2]

    pure_cycle = [make_span(1, 2, 0, 10), make_span(2, 1, 0, 20)]
    path = ids(critical_path(pure_cycle))
    assert path[0] == 2
    assert len(path) == len(set(path)) <= 2
