"""REST routes of the regression gate and the serving analyses (see ``spikehound.collector.analysis``).

* ``GET /api/v1/compare``: baseline against candidate, as ``spikehound compare`` prints it;
* ``GET /api/v1/profile``: one selection's latency profile (``spikehound baseline save`` keeps it);
* ``GET /api/v1/analyze/batching`` and ``GET /api/v1/analyze/pipeline``.

They read whole time ranges of spans, so they run on the API's thread pool
like every query, and take seconds on millions of spans.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from aiohttp import web

from spikehound.collector import analysis
from spikehound.collector.rest.common import (
    EXECUTOR,
    READER,
    ApiError,
    json_response,
    run_blocking,
    time_range,
    whole_number,
)
from spikehound.collector.rest.openapi import (
    SINCE,
    TIME,
    UNTIL,
    OpenApiFragment,
    nullable,
    ok_responses,
    query_param,
    schema_object,
    whole_schema,
)
from spikehound.detectors.compare import CompareOptions
from spikehound.timefmt import MAX_NS
from spikehound.units import NS

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|ms|s)?\s*$")


ROUTES = web.RouteTableDef()


def add_routes(app: web.Application) -> None:
    app.add_routes(ROUTES)


def _number(request: web.Request, name: str, default: float | None, low: float, high: float,
            units: dict[str | None, float]) -> float | None:
    """A query number within [low, high] after its unit (``None`` key: no unit) is applied."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    match = _NUMBER.match(raw)
    if not match or match[2] not in units:
        suffixes = ", ".join(u for u in units if u)
        raise ApiError(400, f"{name} must be a number" + (f" (optional unit: {suffixes})" if suffixes else ""))
    value = float(match[1]) * units[match[2]]
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low:g} and {high:g}")
    return value


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    return whole_number(request.query.get(name), name, default, low, high)


def _selection(request: web.Request, name: str, *, required: bool = True) -> analysis.Selection:
    since, until = time_range(request)
    text = request.query.get(name, "")
    if not text:
        if required:
            raise ApiError(400, f"{name} is required: KEY=VALUE, a service.version value, or SINCE..UNTIL")
        return _readable(analysis.Selection("all spans", None, since, until))
    try:
        return _readable(analysis.parse_selection(text, since, until))
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}") from None


# Storage reads the span blocks of a range up to an hour past its end (Reader.span_payloads): a range ending
# later than this would take that bound past the 64-bit nanoseconds it compares with (an overflow, a 500).
_LAST_READABLE_NS = MAX_NS - 3600 * NS


def _readable(selection: analysis.Selection) -> analysis.Selection:
    """``selection`` ending no later than storage can read; the answer's ``until`` says where it ended."""
    if selection.until_ns <= _LAST_READABLE_NS:
        return selection
    return dataclasses.replace(selection, until_ns=_LAST_READABLE_NS)


def _required(request: web.Request, name: str) -> str:
    value = request.query.get(name, "")
    if not value:
        raise ApiError(400, f"{name} is required")
    return value


@ROUTES.get("/api/v1/compare")
async def get_compare(request: web.Request) -> web.Response:
    baseline, candidate = _selection(request, "baseline"), _selection(request, "candidate")
    options = CompareOptions(
        max_regression=_number(request, "max_regression", 0.05, 0.0, 10.0, {None: 1.0, "%": 0.01}) or 0.0,
        min_requests=_int(request, "min_requests", 100, 1, 10_000_000),
        confidence=_number(request, "confidence", 0.95, 0.5, 0.999, {None: 1.0, "%": 0.01}) or 0.95,
        replicates=_int(request, "replicates", 2000, 100, 100_000),
        seed=_int(request, "seed", 0, 0, 2**32 - 1),
        service=request.query.get("service") or None, operation=request.query.get("operation") or None)
    max_traces = _max_traces(request)
    report: dict[str, Any] = await run_blocking(request.app[EXECUTOR], lambda: analysis.compare_selections(
        request.app[READER], baseline, candidate, options, max_traces=max_traces))
    return json_response(report)


def _max_traces(request: web.Request) -> int:
    return _int(request, "max_traces", analysis.DEFAULT_MAX_TRACES, 1, 1_000_000)


@ROUTES.get("/api/v1/profile")
async def get_profile(request: web.Request) -> web.Response:
    selection, max_traces = _selection(request, "select"), _max_traces(request)
    found = await run_blocking(request.app[EXECUTOR], lambda: analysis.profile(
        request.app[READER], selection, max_traces=max_traces))
    return json_response(found.to_json())


@ROUTES.get("/api/v1/analyze/batching")
async def get_batching(request: web.Request) -> web.Response:
    service = _required(request, "service")
    selection = _selection(request, "select", required=False)
    target = _number(request, "p99_target", None, 0.0, 3_600_000.0, {None: 1.0, "ms": 1.0, "s": 1000.0})
    attribute = request.query.get("attribute") or "batch.size"
    min_requests = _int(request, "min_requests", 100, 1, 10_000_000)
    report = await run_blocking(request.app[EXECUTOR], lambda: analysis.batching(
        request.app[READER], service, selection, attribute=attribute,
        p99_target_ns=None if target is None else target * 1e6, min_requests=min_requests))
    return json_response({"service": service, "attribute": attribute, **selection.describe(), **report.to_json()})


@ROUTES.get("/api/v1/analyze/pipeline")
async def get_pipeline(request: web.Request) -> web.Response:
    service = _required(request, "service")
    selection, max_traces = _selection(request, "select", required=False), _max_traces(request)
    operation = request.query.get("operation") or None
    found = await run_blocking(request.app[EXECUTOR], lambda: analysis.pipeline(
        request.app[READER], service, operation, selection, max_traces=max_traces))
    return json_response({"service": service, **selection.describe(), "operations": [b.to_json() for b in found]})


# --- the OpenAPI description of these routes --------------------------------------------------

_MS = {"type": ["number", "null"], "description": "milliseconds"}
_QUANTILES = schema_object({"count": {"type": "integer"}, "p50_ms": _MS, "p95_ms": _MS, "p99_ms": _MS})
_DELTA = {"type": "object", "description": "candidate minus baseline per quantile (p50, p95, p99), with the "
          "bootstrap interval, in ms and relative (ratio - 1; null when the baseline is 0)",
          "additionalProperties": schema_object({"ms": {"type": "number"}, "ms_ci": {"type": "array"},
                                                 "relative": nullable("number"), "relative_ci": nullable("array")})}
_STAGE = {"kind": {"enum": ["span", "network"]}, "service": {"type": "string"}, "name": {"type": "string"},
          "peer_service": nullable("string"), "label": {"type": "string"}}
# The requests an analysis read: what selected them, and the time range (spikehound.collector.analysis.Selection).
_SELECTION = {"selector": {"type": "string"}, "since": TIME, "until": TIME}
_SIDE = schema_object({**_SELECTION,
                       "spans": {"type": "integer", "description": "spans of the selection read"},
                       "operations": {"type": "integer"},
                       "path_traces": {"type": "integer", "description": "traces whose critical paths were walked"},
                       "path_sampled": {"type": "boolean", "description": "true when those traces are a sample"}},
                      required=["selector", "operations", "path_traces"])
_SELECTOR = ("KEY=VALUE (resource attribute), a service.version value, or SINCE..UNTIL "
             "(RFC 3339 or unix seconds)")
_MAX_TRACES = query_param("max_traces", "traces whose critical paths are walked (default 20000)",
                          schema=whole_schema(1, 1_000_000))


def _number_with(units: list[str]) -> dict[str, Any]:
    """A decimal number, optionally followed by one of ``units`` (``_number`` reads it)."""
    return {"type": "string", "pattern": f"^\\s*[0-9]*\\.?[0-9]+\\s*({'|'.join(units)})?\\s*$"}


_SHARE = schema_object({"ms": {"type": "number"}, "share": {"type": "number"}})

SCHEMAS: dict[str, Any] = {
    "Comparison": schema_object({
        "verdict": {"enum": ["ok", "regression", "insufficient"]},
        "exit_code": {"enum": [0, 1, 2], "description": "what spikehound compare exits with"},
        "message": {"type": "string"}, "max_regression": {"type": "number"}, "min_requests": {"type": "integer"},
        "confidence": {"type": "number"}, "seed": {"type": "integer"}, "baseline": _SIDE, "candidate": _SIDE,
        "operations": {"type": "array", "items": schema_object({
            "service": {"type": "string"}, "operation": {"type": "string"}, "judged": {"type": "boolean"},
            "reason": nullable("string"), "regression": {"type": "boolean"}, "baseline": _QUANTILES,
            "candidate": _QUANTILES, "delta": _DELTA,
            "grew": {"type": ["object", "null"], "description": "the critical-path stage whose p99 grew most"},
            "stages": {"type": "array", "items": schema_object({
                **_STAGE, "baseline": _QUANTILES, "candidate": _QUANTILES, "delta": _DELTA})}})}}),
    "Profile": {"type": "object", "description": "one selection's latency profile: what spikehound baseline "
                "save writes and compare --baseline-file reads", "required": ["format", "operations"],
                "properties": {**_SIDE["properties"], "format": {"const": "spikehound-profile/1"},
                               "operations": {"type": "array"}}},
    "Batching": schema_object({
        **_SELECTION, "service": {"type": "string"}, "attribute": {"type": "string"},
        "p99_target_ms": nullable("number"),
        "recommended": nullable("string"), "reference": nullable("string"),
        "throughput_gain": nullable("number"), "message": {"type": "string"},
        "requests_without_attribute": {"type": "integer"},
        "groups": {"type": "array", "items": schema_object({
            "batch": {"type": "string"}, "size": nullable("number"), "count": {"type": "integer"},
            "p50_ms": {"type": "number"}, "p95_ms": {"type": "number"}, "p99_ms": {"type": "number"},
            "p99_ci_ms": {"type": "array"}, "throughput_rps": nullable("number"),
            "active_seconds": {"type": "number"}, "hosts": {"type": "array", "items": {"type": "string"}},
            "gpu_utilization": nullable("number"), "gpu_samples": {"type": "integer"},
            "enough_data": {"type": "boolean"}})}},
        required=["service", "attribute", "groups", "recommended", "message", *_SELECTION]),
    "Pipeline": schema_object({
        **_SELECTION, "service": {"type": "string"}, "operations": {"type": "array", "items": schema_object({
            "service": {"type": "string"}, "operation": {"type": "string"}, "requests": {"type": "integer"},
            "median": {"type": "object"}, "p99": {"type": "object"}, "headline": {"type": "string"},
            "stages": {"type": "array", "items": schema_object({**_STAGE, "median": _SHARE, "p99": _SHARE})},
            "services": {"type": "array", "items": schema_object({"service": {"type": "string"}, "median": _SHARE,
                                                                  "p99": _SHARE})}})}},
        required=["service", "operations", *_SELECTION]),
}

PATHS: dict[str, Any] = {
    "/api/v1/compare": {"get": {
        "summary": "Regression gate: baseline against candidate per operation and critical-path stage",
        "parameters": [query_param("baseline", _SELECTOR, True), query_param("candidate", _SELECTOR, True),
                       SINCE, UNTIL, query_param("service", "judge only this service"),
                       query_param("operation", "judge only this operation"),
                       query_param("max_regression", "allowed p99 growth, 0 to 10: 0.05 or 5% (default)",
                                   schema=_number_with(["%"])),
                       query_param("min_requests", "requests per side before an operation is judged (default 100)",
                                   schema=whole_schema(1, 10_000_000)),
                       query_param("confidence", "of the bootstrap intervals, 0.5 to 0.999 (default 0.95)",
                                   schema=_number_with(["%"])),
                       query_param("replicates", "bootstrap replicates (default 2000)",
                                   schema=whole_schema(100, 100_000)),
                       query_param("seed", "of the bootstrap draws (default 0)", schema=whole_schema(0, 2**32 - 1)),
                       _MAX_TRACES],
        "responses": ok_responses("Comparison", "the comparison; exit_code is what spikehound compare exits with")}},
    "/api/v1/profile": {"get": {
        "summary": "The latency profile of one selection (a saved baseline)",
        "parameters": [query_param("select", _SELECTOR, True), SINCE, UNTIL, _MAX_TRACES],
        "responses": ok_responses("Profile", "the profile")}},
    "/api/v1/analyze/batching": {"get": {
        "summary": "Latency, throughput and GPU utilization per batch size, and the sweet spot for a p99 target",
        "parameters": [query_param("service", "service name", True),
                       query_param("attribute", "batch-size span attribute (default batch.size)"),
                       query_param("p99_target", "p99 target in ms (or with unit: 50ms, 0.05s), at most an hour",
                                   schema=_number_with(["ms", "s"])),
                       query_param("select", "only these requests: " + _SELECTOR), SINCE, UNTIL,
                       query_param("min_requests", "requests a batch size needs to be judged (default 100)",
                                   schema=whole_schema(1, 10_000_000))],
        "responses": ok_responses("Batching", "per batch size, smallest first")}},
    "/api/v1/analyze/pipeline": {"get": {
        "summary": "Share of critical-path time by stage, for median and for p99 requests",
        "parameters": [query_param("service", "service name", True),
                       query_param("operation", "only this operation"),
                       query_param("select", "only these requests: " + _SELECTOR), SINCE, UNTIL, _MAX_TRACES],
        "responses": ok_responses("Pipeline", "one breakdown per operation, busiest first")}},
}

OPENAPI = OpenApiFragment(paths=PATHS, schemas=SCHEMAS)
