"""One very long trace shaped like the scenario suite's requests: the web pages' worst case for a waterfall."""

from __future__ import annotations

from spikehound.model import Span, SpanKind, StatusCode
from spikehound.units import MS


def long_trace(trace_id: bytes, start_ns: int, spans: int = 2000) -> list[Span]:
    """One gateway request shaped like the scenario's, whose forward pass on gpu-2 has many decode steps.

    >>> trace = long_trace(bytes(15) + b"\\x01", 0)
    >>> len(trace), len({s.span_id for s in trace}), trace[0].name
    (2000, 2000, 'POST /v1/predict')
    """
    made: list[Span] = []

    def span(parent: Span | None, service: str, host: str, name: str, kind: SpanKind, start: int, end: int) -> Span:
        s = Span(trace_id=trace_id, span_id=(len(made) + 1).to_bytes(8, "big"),
                 parent_span_id=parent.span_id if parent else None, service=service, host=host, name=name, kind=kind,
                 start_unix_nano=start, end_unix_nano=end, status=StatusCode.UNSET,
                 attributes={"gen_ai.request.model": "llama-3-8b"} if name == "forward" else {})
        made.append(s)
        return s

    t = start_ns
    root = span(None, "gateway", "edge-1", "POST /v1/predict", SpanKind.SERVER, t, 0)
    client = span(root, "gateway", "edge-1", "POST /preprocess", SpanKind.CLIENT, t + MS, t + 20 * MS)
    server = span(client, "preprocess", "gpu-2", "/preprocess", SpanKind.SERVER, t + MS + MS // 2, t + 19 * MS)
    for i, name in enumerate(("decode_image", "resize", "SELECT features")):
        span(server, "preprocess", "gpu-2", name, SpanKind.CLIENT if name.startswith("SELECT") else SpanKind.INTERNAL,
             t + (2 + 5 * i) * MS, t + (6 + 5 * i) * MS)
    t += 21 * MS
    tail = 4  # the postprocess hop after the forward pass: client, server and two children
    steps = (spans - len(made) - 4 - tail) // 2
    client = span(root, "gateway", "edge-1", "POST /infer", SpanKind.CLIENT, t, 0)
    server = span(client, "model-server", "gpu-2", "/infer", SpanKind.SERVER, t + MS // 2, 0)
    span(server, "model-server", "gpu-2", "batch_queue", SpanKind.INTERNAL, t + MS, t + 3 * MS)
    forward = span(server, "model-server", "gpu-2", "forward", SpanKind.INTERNAL, t + 3 * MS, 0)
    cursor = forward.start_unix_nano + MS // 10
    for i in range(steps):
        step = span(forward, "model-server", "gpu-2", "decode_step", SpanKind.INTERNAL, cursor, cursor + 600_000)
        span(step, "model-server", "gpu-2", "sample_token", SpanKind.INTERNAL, cursor + 450_000, cursor + 590_000)
        cursor = step.end_unix_nano + 10_000 * (1 + i % 3)
    forward.end_unix_nano = cursor + MS // 10
    server.end_unix_nano = forward.end_unix_nano + MS // 5
    client.end_unix_nano = server.end_unix_nano + MS // 2
    t = client.end_unix_nano + MS // 5
    post = span(root, "gateway", "edge-1", "POST /postprocess", SpanKind.CLIENT, t, t + 9 * MS)
    pserver = span(post, "postprocess", "gpu-3", "/postprocess", SpanKind.SERVER, t + MS // 2, t + 8 * MS)
    span(pserver, "postprocess", "gpu-3", "decode_output", SpanKind.INTERNAL, t + MS, t + 4 * MS)
    span(pserver, "postprocess", "gpu-3", "render", SpanKind.INTERNAL, t + 4 * MS, t + 7 * MS)
    while len(made) < spans:  # whatever the division left over: more sampling spans on the last step
        span(forward, "model-server", "gpu-2", "sample_token", SpanKind.INTERNAL, cursor - 500_000, cursor - 400_000)
    root.end_unix_nano = post.end_unix_nano + MS
    return made
