"""The ingest queue: what a waiting request holds, and its bound."""

from __future__ import annotations

import asyncio

import pytest

from spikehound.collector.ingest_queue import IngestQueue
from spikehound.export_outcome import QueueFull
from spikehound.otlp import encode_spans
from tests.support.storage_data import make_span, tid


@pytest.mark.parametrize("keep_spans", [False, True])
def test_a_waiting_request_holds_its_block_and_its_spans_only_where_they_are_read(keep_spans):
    """With the detection process (keep_spans off) a queued request holds its encoding and what the writer
    needs, not eight Python objects a span: a queue filled in a stall must not leave Python's arenas holding
    that peak for good."""
    spans = [make_span(1, 1), make_span(1, 2, 1, name="forward"), make_span(2, 1, host="gpu-2")]
    payload = encode_spans(spans).SerializeToString()

    async def offered():
        queue = IngestQueue(10, keep_spans=keep_spans)
        sub = queue.offer(spans, [], payload)
        return queue, sub

    queue, sub = asyncio.run(offered())
    assert (len(sub), queue.items, sub.block.payload) == (3, 3, payload)
    assert sorted(sub.block.operations) == [("gateway", "POST /predict"), ("gateway", "forward")]
    assert (sorted(sub.block.trace_id_list()), sorted(sub.block.hosts)) == ([tid(1), tid(2)], ["gpu-1", "gpu-2"])
    assert sub.spans == (spans if keep_spans else [])


def test_a_request_that_does_not_fit_is_refused_and_takes_no_room():
    async def run():
        queue = IngestQueue(4, keep_spans=False)
        queue.offer([make_span(1, i) for i in range(1, 4)], [])
        with pytest.raises(QueueFull, match="3 of 4"):
            queue.offer([make_span(2, 1), make_span(2, 2)], [])
        return queue.items

    assert asyncio.run(run()) == 3
