"""Reading stored spans for analysis: the range query, retried blocks, resource selection, the trace sample."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

from spikehound.model import Span, SpanKind, StatusCode
from spikehound.otlp import encode_spans
from spikehound.span_scan import SpanScan, scan_block
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.writer import SpanBlock, WriteBatch, Writer

S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S


def request(trace: int, end: int, *, version: str = "1.0", service: str = "gateway", ms: int = 5) -> list[Span]:
    """A root SERVER span and one child; the trace id's CRC decides whether it is sampled."""
    tid = trace.to_bytes(16, "big")
    resource = {"service.version": version, "deployment.replica": trace % 3}

    def span(i: int, parent: bytes | None, kind: SpanKind, start: int, stop: int, name: str) -> Span:
        return Span(trace_id=tid, span_id=(trace * 10 + i).to_bytes(8, "big"), parent_span_id=parent,
                    service=service, host="h1", name=name, kind=kind, start_unix_nano=start, end_unix_nano=stop,
                    status=StatusCode.UNSET, attributes={"batch.size": trace % 4}, resource=resource)

    root = span(1, None, SpanKind.SERVER, end - ms * MS, end, "POST /v1/predict")
    return [span(2, root.span_id, SpanKind.INTERNAL, end - ms * MS + 1, end - 1, "forward"), root]


def block(spans: list[Span]) -> bytes:
    return encode_spans(spans).SerializeToString()


def test_the_range_query_reads_blocks_by_event_time_and_serves_a_retried_block_once(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    writer = Writer(engine)
    early = request(1, T0 + 10 * S)
    late = request(2, T0 + 100 * S)
    payload = block(late)
    writer.write(WriteBatch(spans=early), now_ns=T0 + 11 * S)
    writer.write(WriteBatch(spans=late, blocks=[SpanBlock.of(payload, late)]), now_ns=T0 + 101 * S)
    writer.write(WriteBatch(spans=late, blocks=[SpanBlock.of(payload, late)]), now_ns=T0 + 102 * S)  # a retry
    # Stamped two hours ahead of its arrival (a sender's clock, or a replayed capture): found by event time.
    writer.write(WriteBatch(spans=request(3, T0 + 7300 * S)), now_ns=T0 + 50 * S)
    reader = Reader(engine)

    assert list(reader.span_payloads(T0 + 50 * S, T0 + 200 * S)) == [payload]
    assert len(list(reader.span_payloads(T0, T0 + 200 * S))) == 2
    assert len(list(reader.span_payloads(T0 + 7200 * S, T0 + 7400 * S))) == 1
    assert list(reader.span_payloads(T0 - 86_400 * S, T0 - 3600 * S)) == []
    engine.dispose()


def test_selection_by_resource_attribute_and_time():
    spans = request(1, T0 + S) + request(2, T0 + 2 * S, version="2.0") + request(3, T0 + 3 * S, ms=7)
    replica = SpanScan(T0, T0 + 10 * S, attribute=("deployment.replica", "1"))  # an int attribute, as text
    window = SpanScan(T0 + 2 * S, T0 + 10 * S)
    service = SpanScan(T0, T0 + 10 * S, attribute=("service.name", "gateway"), keep_attribute="batch.size")
    scan_block(block(spans), [replica, window, service])
    for scan in (replica, window, service):
        scan.finish()
    assert replica.durations == {("gateway", "POST /v1/predict"): [5 * MS]}
    assert window.durations == {("gateway", "POST /v1/predict"): [5 * MS, 7 * MS]}
    assert sorted(len(t) for t in service.traces()) == [2, 2, 2]
    assert {s.attributes["batch.size"] for t in service.traces() for s in t} == {1, 2, 3}
    assert all(s.attributes == {} for t in window.traces() for s in t)
    assert service.spans == 6 and not service.sampled


def test_the_trace_sample_is_the_smallest_keys_whatever_the_order():
    rng = random.Random(2)
    traces = [request(n, T0 + rng.randrange(1000) * MS) for n in range(1, 2001)]
    blocks = [block([s for t in traces[i:i + 50] for s in t]) for i in range(0, len(traces), 50)]
    expected = sorted((zlib.crc32(t[0].trace_id), t[0].trace_id) for t in traces)[:300]

    kept = []
    for order in (blocks, blocks[::-1], rng.sample(blocks, len(blocks))):
        scan = SpanScan(T0, T0 + 2 * S, max_traces=300)
        for payload in order:
            scan_block(payload, [scan])
        scan.finish()
        assert scan.sampled and len(scan.durations[("gateway", "POST /v1/predict")]) == 2000
        kept.append([t[0].trace_id for t in scan.traces()])
        assert all(len(t) == 2 for t in scan.traces())  # whole traces
    assert kept[0] == kept[1] == kept[2] == [tid for _, tid in expected]
