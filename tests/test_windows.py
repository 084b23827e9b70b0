"""Event-time latency windows: quantiles, stream selection, lateness, idleness, cardinality."""

from __future__ import annotations

import random

import pytest

from spikehound.detectors.trace_buffer import TraceBuffer
from spikehound.detectors.windows import LatencyWindows, nearest_rank
from spikehound.model import LatencyWindow, Span, SpanKind, StatusCode

MS = 1_000_000
S = 1_000_000_000

_ids = iter(range(1, 10**9))


def make_span(
    end_ns: int,
    duration_ns: int,
    *,
    service: str = "gateway",
    name: str = "POST /predict",
    kind: SpanKind = SpanKind.SERVER,
    parent: bytes | None = None,
) -> Span:
    return Span(
        trace_id=bytes(16),
        span_id=next(_ids).to_bytes(8, "big"),
        parent_span_id=parent,
        service=service,
        host="gpu-1",
        name=name,
        kind=kind,
        start_unix_nano=end_ns - duration_ns,
        end_unix_nano=end_ns,
        status=StatusCode.UNSET,
        attributes={},
    )


def as_tuples(windows: list[LatencyWindow]) -> list[tuple]:
    return [
        (w.service, w.operation, w.start_unix_nano, w.end_unix_nano, w.count, w.p50_ns, w.p95_ns, w.p99_ns,
         w.max_ns)
        for w in windows
    ]


def test_constructor_arguments_are_kept_as_attributes():
    lw = LatencyWindows(window_ns=3 * S, allowed_lateness_ns=2 * S, max_streams=7)
    assert (lw.window_ns, lw.allowed_lateness_ns, lw.max_streams) == (3 * S, 2 * S, 7)
    assert (lw.open_windows, lw.streams, lw.late_spans, lw.overflow_spans) == (0, 0, 0, 0)


def test_exact_nearest_rank_quantiles_on_1_to_100_ms():
    lw = LatencyWindows()
    base = 1_700_000_000 * S  # a multiple of 10 s
    spans = [make_span(base + 1 * S + i * MS, (i + 1) * MS) for i in range(100)]
    random.Random(7).shuffle(spans)
    lw.add(spans)
    (w,) = lw.flush()
    assert w.count == 100
    assert (w.p50_ns, w.p95_ns, w.p99_ns, w.max_ns) == (50 * MS, 95 * MS, 99 * MS, 100 * MS)
    assert (w.start_unix_nano, w.end_unix_nano) == (base, base + 10 * S)
    assert (w.service, w.operation) == ("gateway", "POST /predict")


def test_nearest_rank_returns_observed_values():
    assert nearest_rank([10, 20, 30, 40], 0.5) == 20
    assert nearest_rank([10, 20, 30, 40], 0.99) == 40
    assert nearest_rank([5], 0.99) == 5
    assert nearest_rank([1, 2, 3], 0.0) == 1
    # 0.57 * 100 is 56.99999999999999 in floats; the rank must still be 57.
    assert nearest_rank(list(range(1, 101)), 0.57) == 57
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def test_entry_spans_and_client_spans_count_inner_work_does_not():
    parent = b"\x00" * 7 + b"\x01"
    spans = [
        make_span(1 * S, 10 * MS, kind=SpanKind.SERVER, parent=parent),  # remote entry: counts
        make_span(1 * S, 20 * MS, kind=SpanKind.INTERNAL, parent=None, name="batch-job"),  # root: counts
        make_span(1 * S, 30 * MS, kind=SpanKind.CLIENT, parent=parent, name="SELECT x"),  # a hop of its caller
        make_span(1 * S, 40 * MS, kind=SpanKind.INTERNAL, parent=parent),  # inner work: ignored
    ]
    lw = LatencyWindows()
    lw.add(spans)
    out = lw.flush()
    # Nobody answered the CLIENT span: a window later (its callee's spans might have been on their way) its
    # hop is named by what it says it called (nothing here).
    assert [(w.start_unix_nano, w.peer_service, w.service, w.operation, w.count, w.max_ns) for w in out] == [
        (0, None, "gateway", "POST /predict", 1, 10 * MS),
        (0, None, "gateway", "batch-job", 1, 20 * MS),
        (10 * S, "gateway", "(uninstrumented)", "SELECT x", 1, 30 * MS),
    ]
    without_hops = LatencyWindows(hops=False)
    without_hops.add(spans)
    assert [(w.operation, w.count) for w in without_hops.flush()] == [("POST /predict", 1), ("batch-job", 1)]


def _call(trace: int, caller: str, callee: str, operation: str, end_ns: int, client_ms: int, server_ms: int,
          client_name: str = "HTTP GET", attributes: dict | None = None) -> tuple[Span, Span]:
    """A CLIENT span of ``caller`` and the SERVER span of ``callee`` that answered it."""
    client = make_span(end_ns, client_ms * MS, service=caller, name=client_name, kind=SpanKind.CLIENT,
                       parent=b"\x09" * 8)
    client.trace_id = trace.to_bytes(16, "big")
    client.attributes.update(attributes or {})
    server = make_span(end_ns - MS, server_ms * MS, service=callee, name=operation, parent=client.span_id)
    server.trace_id = client.trace_id
    return client, server


@pytest.mark.parametrize("server_first", [True, False])
def test_a_client_span_is_a_hop_named_by_the_server_that_answered_it_in_either_order(server_first):
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    calls = [_call(i, "preserve", "ts-order", "GET /orders/{id}", 3 * S + i * MS, 200 + i, 5) for i in range(3)]
    for client, server in calls:
        lw.add([server, client] if server_first else [client, server])
    out = lw.flush()
    hops = [w for w in out if w.peer_service is not None]
    assert [(w.peer_service, w.service, w.operation, w.count, w.max_ns) for w in hops] == [
        ("preserve", "ts-order", "GET /orders/{id}", 3, 202 * MS)]
    # The callee's own SERVER spans are its entry stream: the time in front of it is not in them.
    assert [(w.service, w.max_ns) for w in out if w.peer_service is None] == [("ts-order", 5 * MS)]


def test_a_hop_nobody_answered_is_named_by_the_client_spans_peer_attributes():
    lw = LatencyWindows()
    client = make_span(3 * S, 9 * MS, service="api", name="GET", kind=SpanKind.CLIENT, parent=b"\x01" * 8)
    client.attributes.update({"server.address": "payments.internal"})
    lw.add([client])
    (w,) = lw.flush()
    assert (w.peer_service, w.service, w.operation) == ("api", "payments.internal", "GET")


def test_a_database_that_moved_is_named_anew_within_64_calls():
    """Calls that always say the same are read one time in 64: a new address shows within 64 calls."""
    lw = LatencyWindows()

    def query(i: int, address: str) -> Span:
        span = make_span(S + i * 50 * MS, 2 * MS, service="api", name="SELECT users", kind=SpanKind.CLIENT,
                         parent=b"\x01" * 8)
        span.trace_id = i.to_bytes(16, "big")
        span.attributes.update({"db.system": "postgresql", "server.address": address})
        return span

    lw.add([query(i, "db-1") for i in range(100)] + [query(i, "db-2") for i in range(100, 200)])
    named: dict[str, int] = {}
    for w in lw.flush():
        named[w.service] = named.get(w.service, 0) + w.count
    assert named["db-2"] >= 100 - 64 and named["db-1"] + named["db-2"] == 200, named


def test_a_callee_whose_spans_come_a_window_late_still_names_the_hop():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    client, server = _call(1, "gateway", "preprocess", "POST /preprocess", 3 * S, 9, 7)
    lw.add([client])
    lw.add([make_span(16 * S, MS, name="tick")])  # the caller's next spans close its window: no callee yet
    assert lw.close() == []  # the hop waits for its second chance
    lw.add([server])  # the callee's exporter sends on its own, slower schedule
    lw.add([make_span(26 * S, MS, name="tick")])
    hops = [w for w in lw.close() if w.peer_service is not None]
    assert [(w.peer_service, w.service, w.operation, w.max_ns) for w in hops] == [
        ("gateway", "preprocess", "POST /preprocess", 9 * MS)]


def _late_answer_run(client_name: str, callees: list[tuple[str, str]]) -> LatencyWindows:
    """Twenty answered calls of ``gateway``'s ``client_name`` (callees in turn), then one whose answer never comes."""
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    for i in range(20):
        callee, operation = callees[i % len(callees)]
        lw.add(list(_call(100 + i, "gateway", callee, operation, 3 * S + i * 100 * MS, 40, 30, client_name)))
    client, _server = _call(200, "gateway", callees[0][0], callees[0][1], 23 * S, 900, 880, client_name)
    lw.add([client])  # its SERVER span is lost (or comes after the windows closed)
    for t in (36, 46, 56):
        lw.add([make_span(t * S, MS, name="tick")])
    return lw


def test_a_call_whose_answer_never_came_is_counted_where_its_calls_go_not_as_an_uninstrumented_place():
    lw = _late_answer_run("HTTP GET", [("ts-order", "GET /orders/{id}")])
    hops = [w for w in lw.close() + lw.flush() if w.peer_service is not None]
    assert {(w.service, w.operation) for w in hops} == {("ts-order", "GET /orders/{id}")}
    assert max(w.max_ns for w in hops) == 900 * MS and lw.unjoined_calls == 0


def test_a_call_whose_answer_never_came_is_left_out_and_counted_where_several_callees_answer_such_calls():
    lw = _late_answer_run("HTTP POST", [("ts-order", "POST /orders"), ("ts-travel", "POST /trips")])
    hops = [w for w in lw.close() + lw.flush() if w.peer_service is not None]
    assert {w.service for w in hops} == {"ts-order", "ts-travel"}  # no "(uninstrumented)" stream
    assert max(w.max_ns for w in hops) == 40 * MS and lw.unjoined_calls == 1


def test_a_generic_entry_whose_call_lost_its_answer_is_split_by_who_answers_such_calls():
    buffer = TraceBuffer()
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S, route_of=buffer.callees_of)

    def request(trace: int, end_ns: int, callee: str, operation: str, client_name: str, answered: bool = True):
        root = make_span(end_ns, 50 * MS, name="HTTP GET")
        root.trace_id = trace.to_bytes(16, "big")
        client, server = _call(trace, "gateway", callee, operation, end_ns - MS, 40, 30, client_name)
        client.parent_span_id = root.span_id
        spans = [root, client] + ([server] if answered else [])
        buffer.add(spans)
        lw.add(spans)

    for i in range(10):
        request(i, 3 * S + i * 100 * MS, "ts-order", "GET /orders", "GET order")
        request(50 + i, 3 * S + i * 100 * MS, "ts-order" if i % 2 else "ts-travel", "GET /x", "HTTP GET")
    request(90, 23 * S, "ts-order", "GET /orders", "GET order", answered=False)
    request(91, 23 * S, "ts-order", "GET /x", "HTTP GET", answered=False)
    for t in (36, 46, 56):
        lw.add([make_span(t * S, MS, service="clock", name="tick")])
    entries = {w.operation for w in lw.close() + lw.flush() if w.service == "gateway" and w.peer_service is None}
    assert entries == {"HTTP GET -> ts-order GET /orders", "HTTP GET -> ts-order GET /x",
                       "HTTP GET -> ts-travel GET /x"}  # never "HTTP GET -> GET order" nor "-> HTTP GET"
    assert lw.unjoined_calls >= 1  # the entry whose call several callees answer, and that call's hop


def test_a_trace_counts_once_per_stream_and_window_with_its_slowest_call():
    lw = LatencyWindows()
    spans = []
    for i, ms in enumerate((10, 40, 20)):  # one trace calls the same edge three times in a loop
        client, server = _call(7, "seat", "ts-order", "POST /tickets", 3 * S + i * 100 * MS, ms, 1)
        spans += [client, server]
    lw.add(spans)
    hop = next(w for w in lw.flush() if w.peer_service == "seat")
    assert (hop.count, hop.max_ns) == (1, 40 * MS)


def test_a_generic_entry_is_split_by_its_route_attribute_or_by_where_it_goes():
    routes = {b"\x01": ["ts-travel POST /trips/left"], b"\x02": ["ts-order POST /refresh"], b"\x03": []}
    lw = LatencyWindows(route_of=lambda trace_id, span_id: routes[trace_id[-1:]])
    spans = []
    for i, route in enumerate((None, None, None, "/api/v1/users/login")):
        root = make_span(3 * S + i * MS, 100 * MS, name="HTTP POST")
        root.trace_id = bytes(15) + bytes([i + 1 if route is None else 9])
        if route:
            root.attributes["http.route"] = route
        spans.append(root)
    lw.add(spans)
    assert [(w.start_unix_nano, w.operation) for w in lw.flush()] == [
        (0, "HTTP POST -> ts-order POST /refresh"),
        (0, "HTTP POST -> ts-travel POST /trips/left"),
        (0, "HTTP POST /api/v1/users/login"),
        (10 * S, "HTTP POST"),  # its calls were never seen (a window later either): nothing to split by
    ]


def test_windows_are_cut_by_end_time_and_aligned_to_the_epoch():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=15 * S)
    lw.add([
        make_span(12 * S, 5 * S),  # started at 7 s, ended at 12 s: belongs to [10 s, 20 s)
        make_span(20 * S, 1 * MS),  # ends exactly on a boundary: the next window
        make_span(9 * S, 1 * MS),
    ])
    out = lw.flush()
    assert [(w.start_unix_nano, w.end_unix_nano, w.count) for w in out] == [
        (0, 10 * S, 1),
        (10 * S, 20 * S, 1),
        (20 * S, 30 * S, 1),
    ]
    assert out[1].max_ns == 5 * S
    assert lw.late_spans == 0


def test_late_spans_are_counted_and_excluded():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    lw.add([make_span(31 * S, 1 * MS)])  # watermark 26 s: [0, 10) and [10, 20) are closed
    lw.add([make_span(5 * S, 7 * MS)])  # window [0, 10) closed: late
    lw.add([make_span(19 * S, 7 * MS)])  # window [10, 20) closed: late
    lw.add([make_span(27 * S, 3 * MS)])  # window [20, 30) still open (30 > 26)
    assert lw.late_spans == 2
    out = lw.flush()
    assert [(w.start_unix_nano, w.count) for w in out] == [(20 * S, 1), (30 * S, 1)]
    assert all(w.max_ns != 7 * MS for w in out)


def test_out_of_order_within_lateness_gives_the_same_windows_as_in_order():
    rng = random.Random(1234)
    lateness = 5 * S
    spans = []
    for _ in range(3000):
        end = rng.randrange(0, 120 * S)
        spans.append(make_span(end, rng.randrange(1, 500) * MS, service=rng.choice(["a", "b"]),
                               name=rng.choice(["x", "y", "z"])))
    in_order = sorted(spans, key=lambda s: s.end_unix_nano)
    # Jitter each arrival by less than half the lateness: no span arrives more
    # than the lateness behind the largest end time already seen.
    jitter = {s.span_id: rng.randrange(0, lateness // 2) for s in spans}
    shuffled = sorted(spans, key=lambda s: s.end_unix_nano + jitter[s.span_id])
    assert shuffled != in_order

    def run(feed: list[Span], batch: int) -> list[tuple]:
        lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=lateness)
        out = []
        for i in range(0, len(feed), batch):
            lw.add(feed[i:i + batch])
            out += lw.close()
        out += lw.flush()
        assert lw.late_spans == 0
        return as_tuples(out)

    expected = run(in_order, 100)
    assert len(expected) == 12 * 6
    assert run(shuffled, 100) == expected
    assert run(shuffled, 7) == expected
    assert sum(t[4] for t in expected) == 3000


def test_close_at_watermark_boundary():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    lw.add([
        make_span(3 * S, 1 * MS, service="b", name="op"),
        make_span(4 * S, 1 * MS, service="a", name="zz"),
        make_span(5 * S, 1 * MS, service="a", name="aa"),
        make_span(14 * S, 2 * MS, service="a", name="aa"),
    ])
    assert lw.close() == []  # watermark 9 s < 10 s: nothing closed yet
    lw.add([make_span(15 * S, 2 * MS, service="a", name="aa")])  # watermark exactly 10 s
    out = lw.close()
    assert [(w.service, w.operation, w.start_unix_nano) for w in out] == [
        ("a", "aa", 0),
        ("a", "zz", 0),
        ("b", "op", 0),
    ]
    assert lw.open_windows == 1
    assert lw.close() == []  # emitted windows are forgotten, not emitted twice


def test_idle_advance_closes_the_open_window_and_never_moves_back():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    lw.add([make_span(12 * S, 40 * MS), make_span(13 * S, 60 * MS)])
    assert lw.close() == []
    assert lw.open_windows == 1
    # Input went idle: the caller advances by the lateness plus 8 s of wall clock.
    out = lw.close(idle_advance_ns=5 * S + 8 * S)  # watermark 13 + 8 = 21 s >= 20 s
    assert [(w.start_unix_nano, w.count, w.max_ns) for w in out] == [(10 * S, 2, 60 * MS)]
    assert lw.open_windows == 0
    # The advance is kept: a later close without it does not reopen anything,
    # and a straggler for the emitted window is late rather than a second result.
    assert lw.close() == []
    lw.add([make_span(14 * S, 1 * MS)])
    assert lw.late_spans == 1
    assert lw.flush() == []


def test_cardinality_bomb_is_bounded_and_counted():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S, max_streams=1_000)
    lw.add(make_span(1 * S + i, 1 * MS, name=f"GET /item/{i}") for i in range(100_000))
    assert lw.streams <= 1_000
    assert lw.open_windows <= 1_000
    assert lw.overflow_spans == 99_000
    # Known streams keep being accepted while the table is full.
    lw.add([make_span(2 * S, 1 * MS, name="GET /item/0")])
    assert lw.overflow_spans == 99_000
    out = lw.flush()
    assert len(out) == 1_000
    assert sum(w.count for w in out) == 1_001


def test_quiet_streams_are_forgotten_so_new_ones_fit():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S, max_streams=2)
    lw.add([make_span(1 * S, 1 * MS, name="a"), make_span(1 * S, 1 * MS, name="b")])
    lw.add([make_span(2 * S, 1 * MS, name="c")])
    assert lw.overflow_spans == 1
    # Much later event time: "a" and "b" went quiet and are dropped on close.
    lw.add([make_span(100 * S, 1 * MS, name="a")])
    lw.close()
    assert lw.streams == 1
    lw.add([make_span(101 * S, 1 * MS, name="c")])
    assert lw.overflow_spans == 1
    assert lw.streams == 2


def test_flush_closes_everything():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S)
    lw.add([make_span(t * S, 1 * MS, name=n) for t in (1, 11, 21, 31) for n in ("x", "y")])
    assert lw.open_windows > 0
    out = lw.flush()
    assert lw.open_windows == 0
    assert len(out) == 8
    assert [w.start_unix_nano for w in out] == sorted(w.start_unix_nano for w in out)
    # After a flush a span for an emitted window cannot produce a duplicate.
    lw.add([make_span(31 * S, 1 * MS, name="x")])
    assert lw.late_spans == 1
    assert lw.flush() == []


def test_nothing_seen_closes_to_nothing():
    lw = LatencyWindows()
    assert lw.close(idle_advance_ns=60 * S) == []
    assert lw.flush() == []
    assert lw.watermark is None


def test_streams_that_only_overflowed_get_in_once_the_old_ones_go_quiet():
    lw = LatencyWindows(window_ns=10 * S, allowed_lateness_ns=5 * S, max_streams=2)
    lw.add([make_span(1 * S, 1 * MS, name="a"), make_span(1 * S, 1 * MS, name="b")])
    lw.close()
    # From now on only "c" has traffic: it has no window of its own, yet it must get in.
    for second in range(20, 80, 2):
        lw.add([make_span(second * S, 1 * MS, name="c")])
        lw.close()
    assert lw.streams == 1 and lw.overflow_spans < 10
    assert [w.operation for w in lw.flush()][-1] == "c"


def test_a_generic_entry_without_a_route_is_split_by_the_operations_its_calls_reached():
    buffer = TraceBuffer()
    lw = LatencyWindows(route_of=buffer.callees_of)
    spans = []
    for trace, backend in ((1, "POST /trips/left"), (2, "GET /orders"), (3, "POST /trips/left")):
        root = make_span(3 * S + trace * MS, 90 * MS, name="/*")
        handler = make_span(3 * S, 80 * MS, name="route", kind=SpanKind.INTERNAL, parent=root.span_id)
        call = make_span(3 * S, 70 * MS, name="HTTP POST", kind=SpanKind.CLIENT, parent=handler.span_id)
        answer = make_span(3 * S, 60 * MS, service="ts-backend", name=backend, parent=call.span_id)
        for span in (root, handler, call, answer):
            span.trace_id = trace.to_bytes(16, "big")
        spans += [root, handler, call, answer]
    buffer.add(spans)  # the engine buffers a trace before its windows close
    lw.add(spans)
    entries = [(w.operation, w.count) for w in lw.flush() if w.peer_service is None and w.service == "gateway"]
    assert entries == [("/* -> ts-backend GET /orders", 1), ("/* -> ts-backend POST /trips/left", 2)]
