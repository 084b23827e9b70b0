"""Attribution between a caller's network and its callee's: the same slowed hops are in both sums."""

from __future__ import annotations

from spikehound.detectors.attribution import NormalProfile, attribute, breakdown
from spikehound.model import CauseKind, Span, SpanKind, StatusCode

MS = 1_000_000


def _request(into_execute_ms: float, into_order_ms: float, out_of_execute_ms: float = 0.0) -> list[Span]:
    """gateway -> execute, which calls order twice; each hop's network time as given (1 ms when normal).

    ``into_order_ms`` is added in front of order (every call into it waits), ``out_of_execute_ms`` on
    execute's own way out, ``into_execute_ms`` on the gateway's hop into execute.
    """
    spans: list[Span] = []

    def span(parent: int | None, service: str, name: str, kind: SpanKind, start: float, end: float) -> int:
        spans.append(Span(trace_id=bytes(16), span_id=bytes([len(spans) + 1]) * 8,
                          parent_span_id=bytes([parent]) * 8 if parent else None, service=service, host=service,
                          name=name, kind=kind, start_unix_nano=int(start * MS), end_unix_nano=int(end * MS),
                          status=StatusCode.UNSET))
        return len(spans)

    root = span(None, "gateway", "GET /execute", SpanKind.SERVER, 0, 0)
    call = span(root, "gateway", "HTTP GET", SpanKind.CLIENT, 1, 0)
    server = span(call, "execute", "GET /execute", SpanKind.SERVER, 2 + into_execute_ms / 2, 0)
    t = spans[server - 1].start_unix_nano / MS + 2
    for name in ("GET /order", "PUT /order"):
        client = span(server, "execute", "HTTP", SpanKind.CLIENT, t, 0)
        callee = span(client, "order", name, SpanKind.SERVER, t + 1 + out_of_execute_ms, 0)
        callee_end = spans[callee - 1].start_unix_nano / MS + 5
        spans[callee - 1].end_unix_nano = int(callee_end * MS)
        t = callee_end + 1 + into_order_ms
        spans[client - 1].end_unix_nano = int(t * MS)
        t += 1
    spans[server - 1].end_unix_nano = int((t + 2) * MS)
    spans[call - 1].end_unix_nano = int((t + 3 + into_execute_ms / 2) * MS)
    spans[root - 1].end_unix_nano = int((t + 4 + into_execute_ms / 2) * MS)
    return spans


def _top(slow: list[Span]) -> tuple[str, str | None, str | None]:
    profile = NormalProfile()
    for _ in range(20):
        profile.learn(breakdown(_request(1, 0), bytes([1]) * 8))
    causes = attribute([breakdown(slow, bytes([1]) * 8)], profile, flags=[], max_causes=3)
    assert causes and causes[0].kind is CauseKind.NETWORK
    return causes[0].service or "", causes[0].operation, causes[0].peer_service


def test_a_delay_in_front_of_a_service_names_it_not_the_caller_whose_calls_waited():
    # Both calls into order waited a second; the way into execute was a little slower than usual too.
    assert _top(_request(into_execute_ms=40, into_order_ms=1000)) == ("order", None, None)


def test_a_callers_own_network_names_the_caller_when_its_inbound_hop_slowed_as_much():
    # execute's interface is slow: its calls leave late and the gateway's call into it waits as long.
    assert _top(_request(into_execute_ms=1000, into_order_ms=0, out_of_execute_ms=1000))[0] == "execute"
