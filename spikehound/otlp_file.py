"""Recorded OTLP files, as ``spikehound replay`` reads them.

Two layouts are understood, whichever the file holds:

- **JSON lines**, as the OpenTelemetry Collector's file exporter (and the
  OTLP file exporter specification) write them: one ``TracesData`` or
  ``MetricsData`` object per line, in the OTLP JSON encoding (hex ids);
  log lines are skipped and counted;
- **protobuf**: a sequence of ``TracesData`` / ``MetricsData`` messages,
  each preceded by its length as a 4-byte big-endian integer (the file
  exporter's ``format: proto``), or one bare message (an export request body
  saved as it was sent). Protobuf carries no type name, so a message that
  yields valid spans is traces, and otherwise metrics.

Records come back in file order, decoded and validated exactly as the
receivers do it; what fails validation is counted, never fatal.

>>> import tempfile, os
>>> line = ('{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"api"}}]},'
...         '"scopeSpans":[{"spans":[{"traceId":"5b8efff798038103d269b633813fc60c","spanId":"eee19b7ec3c1b174",'
...         '"name":"GET /","kind":2,"startTimeUnixNano":"1700000000000000000",'
...         '"endTimeUnixNano":"1700000000050000000"}]}]}]}')
>>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
...     _ = f.write(line + "\\n")
>>> records = list(read_otlp_file(f.name))
>>> [(r.signal, len(r.decoded.spans), r.decoded.spans[0].service) for r in records]
[('traces', 1, 'api')]
>>> os.unlink(f.name)
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from spikehound.otlp import (
    Decoded,
    PayloadError,
    decode_metrics,
    decode_spans,
    parse_metrics_request,
    parse_trace_request,
)

__all__ = ["OtlpFileError", "Record", "read_otlp_file"]


class OtlpFileError(ValueError):
    """The file is not recorded OTLP; the message says where and why."""


@dataclass(slots=True)
class Record:
    signal: str  # "traces" | "metrics" | "logs" (logs are skipped: decoded is empty)
    decoded: Decoded
    position: str  # "line 3" or "message 3", for messages about it


def read_otlp_file(path: str | os.PathLike[str]) -> Iterator[Record]:
    """Every record of one recorded OTLP file, in order."""
    with open(path, "rb") as f:
        data = f.read()
    if data.lstrip()[:1] == b"{":
        yield from _json_lines(path, data)
    else:
        yield from _protobuf(path, data)


def _json_lines(path: str | os.PathLike[str], data: bytes) -> Iterator[Record]:
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise OtlpFileError(f"{path}: {where}: not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise OtlpFileError(f"{path}: {where}: expected a JSON object")
        try:
            if "resourceSpans" in doc:
                req = parse_trace_request(line, json=True)
                yield Record("traces", decode_spans(req), where)
            elif "resourceMetrics" in doc:
                yield Record("metrics", decode_metrics(parse_metrics_request(line, json=True)), where)
            elif "resourceLogs" in doc:
                yield Record("logs", Decoded(), where)
            else:
                raise OtlpFileError(f"{path}: {where}: neither resourceSpans, resourceMetrics nor resourceLogs")
        except PayloadError as exc:
            raise OtlpFileError(f"{path}: {where}: {exc}") from None


def _protobuf(path: str | os.PathLike[str], data: bytes) -> Iterator[Record]:
    messages = _length_prefixed(data)
    if messages is None:
        messages = [data]  # one bare message
    for number, body in enumerate(messages, 1):
        where = f"message {number}"
        try:
            traces = decode_spans(parse_trace_request(body), body)
        except PayloadError:
            traces = Decoded()
        if traces.spans:
            yield Record("traces", traces, where)
            continue
        try:
            metrics = decode_metrics(parse_metrics_request(body))
        except PayloadError as exc:
            raise OtlpFileError(f"{path}: {where}: not an OTLP traces or metrics message: {exc}") from None
        if not metrics.points and not metrics.rejected and traces.rejected:
            yield Record("traces", traces, where)  # spans, all of them invalid: say so through the counts
        else:
            yield Record("metrics", metrics, where)


def _length_prefixed(data: bytes) -> list[bytes] | None:
    """Split ``data`` into 4-byte-length-prefixed messages; None when the lengths do not chain to the end."""
    out, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            return None
        (size,) = struct.unpack_from(">I", data, at)
        at += 4
        if size > len(data) - at:
            return None
        out.append(data[at:at + size])
        at += size
    return out or None
