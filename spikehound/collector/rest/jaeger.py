"""The Jaeger query API (``/api/...``) on the collector's API port, in the JSON shapes of Jaeger's query service.

Grafana's Jaeger data source and other Jaeger clients can then search and open spikehound's traces:

* ``GET /api/services`` and ``GET /api/services/{service}/operations``: names (``data``, ``total``);
* ``GET /api/traces?service=&operation=&tags=&tag=&minDuration=&maxDuration=&limit=&start=&end=`` (times in
  microseconds since the epoch, durations as Go writes them: ``1.5s``, ``300ms``, ``250us``; ``tags`` a JSON
  object, ``tag`` repeated ``key:value``), or ``?traceID=..`` (repeated) for given traces;
* ``GET /api/traces/{traceID}``: one trace, 404 when unknown;
* ``GET /api/dependencies?endTs=&lookback=`` (milliseconds): calls between services.

Every answer is ``{"data", "total", "limit", "offset", "errors"}``; a failure has ``"data": null`` and
``"errors": [{"code", "msg"}]`` with the same HTTP status. Spans are converted as Jaeger converts OTLP: span
attributes become ``tags`` (plus ``span.kind``, ``otel.status_code`` and ``error``), resource attributes the
``processes`` entry that ``processID`` names, events ``logs`` (always a list), the parent a ``CHILD_OF``
reference and links ``FOLLOWS_FROM`` references; times and durations are in microseconds.

>>> go_duration_ns("1h2m3.5s"), go_duration_ns("250us"), go_duration_ns("0")
(3723500000000, 250000, 0)
>>> jaeger_trace_id(bytes(8) + bytes.fromhex("00000000000000ff")), parse_trace_id("ff") == bytes(15) + b"\\xff"
('00000000000000ff', True)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from aiohttp import web

from spikehound.collector.rest.common import EXECUTOR, READER, run_blocking
from spikehound.collector.rest.openapi import OpenApiFragment
from spikehound.model import Span, StatusCode
from spikehound.storage.trace_search import TraceQuery
from spikehound.timefmt import MAX_NS, MIN_NS
from spikehound.units import MS, NS

log = logging.getLogger("spikehound.collector.jaeger_api")

DEFAULT_LIMIT = 100  # Jaeger's default number of traces
MAX_LIMIT = 1_500  # the most Jaeger's UI asks for
DEFAULT_SEARCH_LOOKBACK_US = 2 * 24 * 3600 * 1_000_000  # Jaeger: two days before ``end``
DEFAULT_DEPENDENCY_LOOKBACK_MS = 24 * 3600 * 1000
# Times storage can hold (signed 64-bit nanoseconds), in the API's microseconds and milliseconds.
_US_RANGE = (-(-MIN_NS // 1_000), MAX_NS // 1_000)
_MS_RANGE = (-(-MIN_NS // MS), MAX_NS // MS)
_HEX = re.compile(r"^[0-9a-fA-F]{1,32}$")
_INTEGER = re.compile(r"^-?[0-9]{1,20}$")  # ASCII digits: int() would also read '١٢' and '1_000'
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": MS, "s": NS,
            "m": 60_000_000_000, "h": 3_600_000_000_000}


class JaegerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _answer(data: Any, status: int = 200, total: int = 0, errors: list[dict[str, Any]] | None = None
            ) -> web.Response:
    body = {"data": data, "total": total, "limit": 0, "offset": 0, "errors": errors}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _answer(None, status, errors=[{"code": status, "msg": message}])


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _jaeger(handler: Handler) -> Handler:
    """Answer failures in Jaeger's error form: 4xx for bad requests, 500 (logged) for anything else."""

    async def wrapped(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except JaegerError as exc:
            return _error(exc.status, str(exc))
        except Exception as exc:
            log.exception("Jaeger API %s failed", request.path)
            return _error(500, f"internal error: {exc.__class__.__name__}")

    return wrapped


def add_routes(app: web.Application) -> None:
    """Add the Jaeger query routes to the REST API application (before it starts)."""
    r = app.router
    r.add_get("/api/services", _jaeger(get_services))
    r.add_get("/api/services/{service}/operations", _jaeger(get_operations))
    r.add_get("/api/traces", _jaeger(find_traces))
    r.add_get("/api/traces/{trace_id}", _jaeger(get_trace))
    r.add_get("/api/dependencies", _jaeger(get_dependencies))


# --- parameters -------------------------------------------------------------------------------


def go_duration_ns(text: str) -> int:
    """Nanoseconds of a duration as Go's ``time.ParseDuration`` reads it (``1.5s``, ``2h45m``, ``300ms``)."""
    text = text.strip()
    if not text:
        raise ValueError("empty duration")
    if text in ("0", "+0", "-0"):
        return 0
    pos, total = 0, 0.0
    while pos < len(text):
        part = _DURATION_PART.match(text, pos)
        if part is None:
            raise ValueError(f"invalid duration {text!r} (expected e.g. 1.5s, 300ms, 250us)")
        total += float(part.group(1)) * _UNIT_NS[part.group(2)]
        pos = part.end()
    if not total <= MAX_NS:  # also inf, from hundreds of digits
        raise ValueError(f"duration {text[:40]!r} is longer than storage's 292 years")
    return round(total)


def parse_trace_id(text: str) -> bytes:
    """A trace id as Jaeger accepts it: 1 to 32 hex digits, zero-padded on the left to 128 bits."""
    if not _HEX.match(text):
        raise ValueError(f"trace id {text[:40]!r} is not 1 to 32 hex digits")
    return bytes.fromhex(text.rjust(32, "0"))


def jaeger_trace_id(trace_id: bytes) -> str:
    """Jaeger writes a 128-bit id with a zero upper half as 16 hex digits."""
    return trace_id[8:].hex() if not any(trace_id[:8]) else trace_id.hex()


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """An integer parameter within [low, high]; a 400 naming it otherwise (never an overflow in storage)."""
    raw = request.query.get(name, "")
    if raw == "":
        return default
    if not _INTEGER.match(raw):
        raise JaegerError(400, f"unable to parse {name}: {raw[:40]!r} is not an integer")
    if not low <= int(raw) <= high:
        raise JaegerError(400, f"{name} {raw} is out of range {low} to {high}")
    return int(raw)


def _duration_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name, "")
    if raw == "":
        return None
    try:
        return go_duration_ns(raw)
    except ValueError as exc:
        raise JaegerError(400, f"cannot parse {name}: {exc}") from None


def _tags_param(request: web.Request) -> dict[str, str]:
    tags: dict[str, str] = {}
    for tag in request.query.getall("tag", []):
        key, sep, value = tag.partition(":")
        if not sep:
            raise JaegerError(400, f"malformed 'tag' parameter, expecting key:value, received: {tag[:80]}")
        tags[key] = value
    for raw in request.query.getall("tags", []):
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise JaegerError(400, f"malformed 'tags' parameter, cannot unmarshal JSON: {exc}") from None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise JaegerError(400, "malformed 'tags' parameter: expected a JSON object of strings")
        tags.update(doc)
    return tags


# --- conversion -------------------------------------------------------------------------------


def _key_value(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    return {"key": key, "type": "string", "value": orjson.dumps(value, default=str).decode()}


def _tag_text(value: Any) -> str:
    """A tag value as a search compares it: Jaeger compares the string form (``true``, ``200``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else orjson.dumps(value, default=str).decode()


def span_tags(s: Span) -> list[dict[str, Any]]:
    """The span's attributes plus the tags Jaeger derives from OTLP fields."""
    tags = [_key_value(k, v) for k, v in s.attributes.items()]
    tags.append(_key_value("span.kind", s.kind.name.lower()))
    if s.status != StatusCode.UNSET:
        tags.append(_key_value("otel.status_code", s.status.name))
        description = getattr(getattr(s.message, "status", None), "message", "")
        if description:
            tags.append(_key_value("otel.status_description", description))
    if s.status == StatusCode.ERROR:
        tags.append(_key_value("error", True))
    return tags


def process_tags(s: Span) -> list[dict[str, Any]]:
    tags = [_key_value(k, v) for k, v in s.resource.items()]
    if s.host is not None:
        tags.append(_key_value("host.name", s.host))
    return tags


def _logs(s: Span) -> list[dict[str, Any]]:
    return [{"timestamp": e["time_unix_nano"] // 1000,
             "fields": [_key_value("event", e["name"])]
             + [_key_value(k, v) for k, v in (e.get("attributes") or {}).items()]} for e in s.events]


def _references(s: Span, trace_id: str) -> list[dict[str, str]]:
    refs = []
    if s.parent_span_id is not None:
        refs.append({"refType": "CHILD_OF", "traceID": trace_id, "spanID": s.parent_span_id.hex()})
    for link in getattr(s.message, "links", ()):
        refs.append({"refType": "FOLLOWS_FROM", "traceID": jaeger_trace_id(link.trace_id),
                     "spanID": link.span_id.hex()})
    return refs


def jaeger_trace(trace_id: bytes, spans: Iterable[Span]) -> dict[str, Any]:
    """One trace in Jaeger's UI model: spans with ``processID``s, and the ``processes`` they name."""
    tid = jaeger_trace_id(trace_id)
    process_ids: dict[bytes, str] = {}
    processes: dict[str, dict[str, Any]] = {}
    out = []
    for s in spans:
        key = orjson.dumps([s.service, s.host, s.resource], option=orjson.OPT_SORT_KEYS, default=str)
        pid = process_ids.get(key)
        if pid is None:
            pid = process_ids[key] = f"p{len(process_ids) + 1}"
            processes[pid] = {"serviceName": s.service, "tags": process_tags(s)}
        out.append({"traceID": tid, "spanID": s.span_id.hex(), "flags": 1, "operationName": s.name,
                    "references": _references(s, tid), "startTime": s.start_unix_nano // 1000,
                    "duration": s.duration_ns // 1000, "tags": span_tags(s), "logs": _logs(s),
                    "processID": pid, "warnings": None})
    return {"traceID": tid, "spans": out, "processes": processes, "warnings": None}


def _tag_condition(tags: dict[str, str]) -> Callable[[Span], bool]:
    """Every tag must equal (as text) a tag of the span or of its process."""

    def holds(s: Span) -> bool:
        have = {t["key"]: _tag_text(t["value"]) for t in process_tags(s) + span_tags(s)}
        return all(have.get(k) == v for k, v in tags.items())

    return holds


# --- handlers ---------------------------------------------------------------------------------


async def get_services(request: web.Request) -> web.Response:
    services = [name for name, _ in await run_blocking(request.app[EXECUTOR], request.app[READER].services)]
    return _answer(services, total=len(services))


async def get_operations(request: web.Request) -> web.Response:
    wanted = request.match_info["service"]
    services = dict(await run_blocking(request.app[EXECUTOR], request.app[READER].services))
    operations = services.get(wanted, [])
    return _answer(operations, total=len(operations))


async def get_trace(request: web.Request) -> web.Response:
    raw = request.match_info["trace_id"]
    try:
        trace_id = parse_trace_id(raw)
    except ValueError as exc:
        raise JaegerError(400, str(exc)) from None
    spans = await run_blocking(request.app[EXECUTOR], request.app[READER].trace, trace_id)
    if not spans:
        raise JaegerError(404, "trace not found")
    return _answer([jaeger_trace(trace_id, spans)])


async def find_traces(request: web.Request) -> web.Response:
    q = request.query
    reader = request.app[READER]
    ids = q.getall("traceID", [])
    if ids:
        try:
            wanted = [parse_trace_id(i) for i in ids]
        except ValueError as exc:
            raise JaegerError(400, f"cannot parse traceID param: {exc}") from None
        found = await run_blocking(request.app[EXECUTOR], reader.traces, wanted)
        errors = [{"msg": "trace not found", "traceID": jaeger_trace_id(t)} for t in wanted if t not in found]
        return _answer([jaeger_trace(t, found[t]) for t in wanted if t in found], errors=errors or None)
    service = q.get("service", "")
    if not service:
        raise JaegerError(400, "parameter 'service' is required")
    end_us = _int_param(request, "end", time.time_ns() // 1000, *_US_RANGE)
    start_us = _int_param(request, "start", max(_US_RANGE[0], end_us - DEFAULT_SEARCH_LOOKBACK_US), *_US_RANGE)
    limit = _int_param(request, "limit", DEFAULT_LIMIT, 0, 2**31) or DEFAULT_LIMIT
    min_ns, max_ns = _duration_param(request, "minDuration"), _duration_param(request, "maxDuration")
    if min_ns and max_ns and max_ns < min_ns:
        raise JaegerError(400, "'maxDuration' should be greater than 'minDuration'")
    tags = _tags_param(request)
    query = TraceQuery(service=service, start_ns=start_us * 1000, end_ns=end_us * 1000,
                       operation=q.get("operation") or None, min_duration_ns=min_ns or None,
                       max_duration_ns=max_ns or None, limit=min(limit, MAX_LIMIT),
                       conditions=(_tag_condition(tags),) if tags else ())

    def search() -> list[dict[str, Any]]:
        trace_ids = reader.find_trace_ids(query)
        found = reader.traces(trace_ids)
        return [jaeger_trace(t, found[t]) for t in trace_ids if t in found]

    return _answer(await run_blocking(request.app[EXECUTOR], search))


async def get_dependencies(request: web.Request) -> web.Response:
    end_ms = _int_param(request, "endTs", time.time_ns() // MS, *_MS_RANGE)
    lookback_ms = _int_param(request, "lookback", 0, 0, _MS_RANGE[1] - _MS_RANGE[0]) or DEFAULT_DEPENDENCY_LOOKBACK_MS
    links = await run_blocking(request.app[EXECUTOR], request.app[READER].dependencies,
                               max(MIN_NS, (end_ms - lookback_ms) * MS), end_ms * MS)
    service = request.query.get("service")
    return _answer([{"parent": parent, "child": child, "callCount": n} for parent, child, n in links
                    if not service or service in (parent, child)])


# Jaeger's API is Jaeger's to document: /api/v1/openapi.json describes spikehound's own API only.
OPENAPI = OpenApiFragment()
