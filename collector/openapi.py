"""The OpenAPI 3.1 document served at ``/api/v1/openapi.json``."""

from __future__ import annotations

from functools import cache
from typing import Any

from spikehound import __version__


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required if required is not None else list(props)}


def _nullable(kind: str) -> dict[str, Any]:
    return {"type": [kind, "null"]}


def _query(name: str, description: str, required: bool = False,
           schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A query parameter; a required one must not be empty (the API reads an empty value as none given)."""
    kind = schema or ({"type": "string", "minLength": 1} if required else {"type": "string"})
    return {"name": name, "in": "query", "required": required, "description": description, "schema": kind}


def _whole(low: int, high: int) -> dict[str, Any]:
    """The schema of a whole-number parameter (ASCII digits, within [low, high])."""
    return {"type": "integer", "minimum": low, "maximum": high}


def _limit_param(description: str, most: int) -> dict[str, Any]:
    return _query("limit", description, schema=_whole(1, most))


def _ok(schema_ref: str, description: str) -> dict[str, Any]:
    return {"200": {"description": description,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}}},
            "400": {"$ref": "#/components/responses/BadRequest"}}


TIME = {"type": "string", "format": "date-time", "description": "RFC 3339, UTC"}
# What parse_time reads; both within 1677-09-21 to 2262-04-11, what storage's 64-bit nanoseconds hold.
TIME_PARAM = {"anyOf": [{"type": "string", "format": "date-time"},
                        {"type": "string", "pattern": "^[0-9]{1,11}(\\.[0-9]+)?$", "description": "unix seconds"}]}
SINCE = _query("since", "RFC 3339 time or unix seconds; default one hour before until", schema=TIME_PARAM)
UNTIL = _query("until", "RFC 3339 time or unix seconds; default now", schema=TIME_PARAM)

SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": {"type": "string"}}),
    "Span": _obj({
        "trace_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "span_id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "parent_span_id": _nullable("string"), "service": {"type": "string"}, "host": _nullable("string"),
        "name": {"type": "string"},
        "kind": {"enum": ["SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER"]},
        "start": TIME, "start_unix_nano": {"type": "integer"}, "duration_ns": {"type": "integer"},
        "status": {"enum": ["UNSET", "OK", "ERROR"]}, "attributes": {"type": "object"},
        "resource": {"type": "object"}, "events": {"type": "array", "items": {"type": "object"}},
    }),
    "Trace": _obj({"trace_id": {"type": "string"},
                   "spans": {"type": "array", "items": {"$ref": "#/components/schemas/Span"}},
                   "critical_path": {"type": "array", "items": {"type": "string"},
                                     "description": "span ids that determined the trace's end time"}}),
    "Services": _obj({"services": {"type": "array", "items": _obj({
        "service": {"type": "string"}, "operations": {"type": "array", "items": {"type": "string"}}})}}),
    "Latency": _obj({"points": {"type": "array", "items": _obj({
        "t": TIME, "operation": {"type": "string"}, "count": {"type": "integer"},
        "p50_ms": {"type": "number"}, "p95_ms": {"type": "number"}, "p99_ms": {"type": "number"},
        "max_ms": {"type": "number"}})}}),
    "Hosts": _obj({"hosts": {"type": "array", "items": _obj({
        "host": {"type": "string"}, "last_seen": TIME,
        "metrics": {"type": "array", "items": {"type": "string"}}})}}),
    "Metrics": _obj({"series": {"type": "array", "items": _obj({
        "host": {"type": "string"}, "name": {"type": "string"}, "attributes": {"type": "object"},
        "unit": {"type": "string"},
        "points": {"type": "array", "items": _obj({"t": TIME, "value": {"type": "number"}})}})},
        "truncated": {"type": "boolean"}}),
    "Cause": _obj({
        "kind": {"enum": ["span", "service", "network", "resource"]}, "service": _nullable("string"),
        "operation": _nullable("string"), "peer_service": _nullable("string"), "host": _nullable("string"),
        "resource": _nullable("string"), "score": {"type": "number", "minimum": 0, "maximum": 1},
        "baseline": _nullable("number"), "observed": _nullable("number"), "unit": _nullable("string"),
        "summary": {"type": "string"}}),
    "AffectedStream": _obj({
        "service": {"type": "string"}, "operation": {"type": "string"}, "peer_service": _nullable("string"),
        "start": TIME, "last_anomalous_end": TIME, "p99_ms": {"type": "number"},
        "baseline_p99_ms": {"type": "number"}, "evidence": {"type": "number"},
        "slow_requests": {"type": "integer"}}),
    "Spike": _obj({
        "id": {"type": "string"}, "service": {"type": "string"}, "operation": {"type": "string"},
        "peer_service": _nullable("string"),
        "state": {"enum": ["open", "resolved"]}, "start": TIME, "end": {"type": ["string", "null"]},
        "p99_ms": {"type": "number"}, "baseline_p99_ms": {"type": "number"},
        "causes": {"type": "array", "items": {"$ref": "#/components/schemas/Cause"}},
        "exemplar_trace_ids": {"type": "array", "items": {"type": "string"}},
        "affected_streams": {"type": "array", "maxItems": 50, "items": {"$ref": "#/components/schemas/AffectedStream"},
                             "description": "The streams the spike moved, the leading one first, then the most "
                                            "user-facing (at most 50)."}}),
    "Spikes": _obj({"spikes": {"type": "array", "items": {"$ref": "#/components/schemas/Spike"}}}),
}


@cache
def openapi_document() -> dict[str, Any]:
    doc = _core_document()
    from collector.alerts.api import OPENAPI_PATHS, OPENAPI_SCHEMAS  # imports this module: not at the top

    doc["paths"].update(OPENAPI_PATHS)
    doc["components"]["schemas"] = {**doc["components"]["schemas"], **OPENAPI_SCHEMAS}
    _add_refusals(doc)
    return doc


# What collector/cross_site.py answers before any handler (docs/operations.md, Security).
_REFUSALS = {
    "MisdirectedRequest": ("421", "the Host header is not a name of this collector (DNS rebinding); see "
                                  "collector.allowed_hosts"),
    "CrossOrigin": ("403", "sent on behalf of another site's page (Origin or Sec-Fetch-Site)"),
    "TooLarge": ("413", "the request body is over 1 MiB"),
    "UnsupportedMediaType": ("415", "a request body that is not application/json"),
}


def _add_refusals(doc: dict[str, Any]) -> None:
    """Every operation may be refused for its Host; those that change state also for their origin and body."""
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    doc["components"]["responses"].update({name: {"description": text, **error}
                                           for name, (_, text) in _REFUSALS.items()})
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            names = [] if path in ("/healthz", "/readyz") else ["MisdirectedRequest"]
            if method not in ("get", "head", "options"):
                names += ["CrossOrigin", "TooLarge", "UnsupportedMediaType"]
            operation["responses"].update({_REFUSALS[n][0]: {"$ref": f"#/components/responses/{n}"} for n in names})


def _core_document() -> dict[str, Any]:
    not_found = {"404": {"$ref": "#/components/responses/NotFound"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "spikehound collector API", "version": __version__,
                 "description": "p99 spikes, their causes and the evidence: traces, latency and host metrics."},
        "paths": {
            "/api/v1/traces/{trace_id}": {"get": {
                "summary": "All spans of one trace, with its critical path",
                "parameters": [{"name": "trace_id", "in": "path", "required": True,
                                "schema": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"}}],
                "responses": {**_ok("Trace", "the trace"), **not_found}}},
            "/api/v1/services": {"get": {"summary": "Services and their operations (span names)",
                                         "responses": _ok("Services", "services")}},
            "/api/v1/latency": {"get": {
                "summary": "p50/p95/p99 per closed event-time window of a stream",
                "parameters": [_query("service", "service name (for a hop stream: the callee)", True),
                               _query("operation", "operation (span name); all when omitted"),
                               _query("peer_service", "the caller: the hop stream of its calls into service "
                                                      "(its CLIENT spans); the entry streams when omitted"),
                               SINCE, UNTIL, _limit_param("most points (default 10000)", 100_000)],
                "responses": _ok("Latency", "windows, oldest first")}},
            "/api/v1/hosts": {"get": {"summary": "Hosts that sent data, with their metric names",
                                      "responses": _ok("Hosts", "hosts")}},
            "/api/v1/metrics": {"get": {
                "summary": "Resource samples by host and/or metric name",
                "parameters": [_query("host", "host.name"), _query("name", "metric name"), SINCE, UNTIL,
                               _limit_param("most points in all (default 20000)", 200_000)],
                "responses": _ok("Metrics", "series, points oldest first")}},
            "/api/v1/spikes": {"get": {
                "summary": "Spikes, newest first",
                "parameters": [_query("service", "spikes led by this service or that moved one of its streams"),
                               SINCE, UNTIL, _query("state", "open or resolved", schema={"enum": ["open", "resolved"]}),
                               _limit_param("most spikes (default 500)", 10_000)],
                "responses": _ok("Spikes", "spikes")}},
            "/api/v1/spikes/{spike_id}": {"get": {
                "summary": "One spike with its ranked causes and exemplar traces",
                "parameters": [{"name": "spike_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {**_ok("Spike", "the spike"), **not_found}}},
            "/healthz": {"get": {"summary": "The process is alive", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {"get": {"summary": "Receivers listen and storage answers",
                                "responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus text exposition of the collector's own metrics",
                                 "responses": {"200": {"description": "metrics"}}}},
            **ANALYSIS_PATHS,
        },
        "components": {
            "schemas": {**SCHEMAS, **ANALYSIS_SCHEMAS},
            "responses": {
                "BadRequest": {"description": "invalid parameter",
                               "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                "NotFound": {"description": "no such object",
                             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "required when collector.api_token is set"}},
        },
    }


# --- the regression gate and the serving analyses (collector/analysis_api.py) ------------------

_MS = {"type": ["number", "null"], "description": "milliseconds"}
_QUANTILES = _obj({"count": {"type": "integer"}, "p50_ms": _MS, "p95_ms": _MS, "p99_ms": _MS})
_DELTA = {"type": "object", "description": "candidate minus baseline per quantile (p50, p95, p99), with the "
          "bootstrap interval, in ms and relative (ratio - 1; null when the baseline is 0)",
          "additionalProperties": _obj({"ms": {"type": "number"}, "ms_ci": {"type": "array"},
                                        "relative": _nullable("number"), "relative_ci": _nullable("array")})}
_STAGE = {"kind": {"enum": ["span", "network"]}, "service": {"type": "string"}, "name": {"type": "string"},
          "peer_service": _nullable("string"), "label": {"type": "string"}}
# The requests an analysis read: what selected them, and the time range (collector.analysis.Selection).
_SELECTION = {"selector": {"type": "string"}, "since": TIME, "until": TIME}
_SIDE = _obj({**_SELECTION,
              "spans": {"type": "integer", "description": "spans of the selection read"},
              "operations": {"type": "integer"},
              "path_traces": {"type": "integer", "description": "traces whose critical paths were walked"},
              "path_sampled": {"type": "boolean", "description": "true when those traces are a sample"}},
             required=["selector", "operations", "path_traces"])
_SELECTOR = ("KEY=VALUE (resource attribute), a service.version value, or SINCE..UNTIL "
             "(RFC 3339 or unix seconds)")
_MAX_TRACES = _query("max_traces", "traces whose critical paths are walked (default 20000)",
                     schema=_whole(1, 1_000_000))


def _number_with(units: list[str]) -> dict[str, Any]:
    """A decimal number, optionally followed by one of ``units`` (collector/analysis_api.py reads it)."""
    return {"type": "string", "pattern": f"^\\s*[0-9]*\\.?[0-9]+\\s*({'|'.join(units)})?\\s*$"}


_SHARE = _obj({"ms": {"type": "number"}, "share": {"type": "number"}})

ANALYSIS_SCHEMAS: dict[str, Any] = {
    "Comparison": _obj({
        "verdict": {"enum": ["ok", "regression", "insufficient"]},
        "exit_code": {"enum": [0, 1, 2], "description": "what spikehound compare exits with"},
        "message": {"type": "string"}, "max_regression": {"type": "number"}, "min_requests": {"type": "integer"},
        "confidence": {"type": "number"}, "seed": {"type": "integer"}, "baseline": _SIDE, "candidate": _SIDE,
        "operations": {"type": "array", "items": _obj({
            "service": {"type": "string"}, "operation": {"type": "string"}, "judged": {"type": "boolean"},
            "reason": _nullable("string"), "regression": {"type": "boolean"}, "baseline": _QUANTILES,
            "candidate": _QUANTILES, "delta": _DELTA,
            "grew": {"type": ["object", "null"], "description": "the critical-path stage whose p99 grew most"},
            "stages": {"type": "array", "items": _obj({**_STAGE, "baseline": _QUANTILES, "candidate": _QUANTILES,
                                                        "delta": _DELTA})}})}}),
    "Profile": {"type": "object", "description": "one selection's latency profile: what spikehound baseline "
                "save writes and compare --baseline-file reads", "required": ["format", "operations"],
                "properties": {**_SIDE["properties"], "format": {"const": "spikehound-profile/1"},
                               "operations": {"type": "array"}}},
    "Batching": _obj({
        **_SELECTION, "service": {"type": "string"}, "attribute": {"type": "string"},
        "p99_target_ms": _nullable("number"),
        "recommended": _nullable("string"), "reference": _nullable("string"),
        "throughput_gain": _nullable("number"), "message": {"type": "string"},
        "requests_without_attribute": {"type": "integer"},
        "groups": {"type": "array", "items": _obj({
            "batch": {"type": "string"}, "size": _nullable("number"), "count": {"type": "integer"},
            "p50_ms": {"type": "number"}, "p95_ms": {"type": "number"}, "p99_ms": {"type": "number"},
            "p99_ci_ms": {"type": "array"}, "throughput_rps": _nullable("number"),
            "active_seconds": {"type": "number"}, "hosts": {"type": "array", "items": {"type": "string"}},
            "gpu_utilization": _nullable("number"), "gpu_samples": {"type": "integer"},
            "enough_data": {"type": "boolean"}})}},
        required=["service", "attribute", "groups", "recommended", "message", *_SELECTION]),
    "Pipeline": _obj({**_SELECTION, "service": {"type": "string"}, "operations": {"type": "array", "items": _obj({
        "service": {"type": "string"}, "operation": {"type": "string"}, "requests": {"type": "integer"},
        "median": {"type": "object"}, "p99": {"type": "object"}, "headline": {"type": "string"},
        "stages": {"type": "array", "items": _obj({**_STAGE, "median": _SHARE, "p99": _SHARE})},
        "services": {"type": "array", "items": _obj({"service": {"type": "string"}, "median": _SHARE,
                                                      "p99": _SHARE})}})}},
        required=["service", "operations", *_SELECTION]),
}

ANALYSIS_PATHS: dict[str, Any] = {
    "/api/v1/compare": {"get": {
        "summary": "Regression gate: baseline against candidate per operation and critical-path stage",
        "parameters": [_query("baseline", _SELECTOR, True), _query("candidate", _SELECTOR, True), SINCE, UNTIL,
                       _query("service", "judge only this service"), _query("operation", "judge only this operation"),
                       _query("max_regression", "allowed p99 growth, 0 to 10: 0.05 or 5% (default)",
                              schema=_number_with(["%"])),
                       _query("min_requests", "requests per side before an operation is judged (default 100)",
                              schema=_whole(1, 10_000_000)),
                       _query("confidence", "of the bootstrap intervals, 0.5 to 0.999 (default 0.95)",
                              schema=_number_with(["%"])),
                       _query("replicates", "bootstrap replicates (default 2000)", schema=_whole(100, 100_000)),
                       _query("seed", "of the bootstrap draws (default 0)", schema=_whole(0, 2**32 - 1)),
                       _MAX_TRACES],
        "responses": _ok("Comparison", "the comparison; exit_code is what spikehound compare exits with")}},
    "/api/v1/profile": {"get": {
        "summary": "The latency profile of one selection (a saved baseline)",
        "parameters": [_query("select", _SELECTOR, True), SINCE, UNTIL, _MAX_TRACES],
        "responses": _ok("Profile", "the profile")}},
    "/api/v1/analyze/batching": {"get": {
        "summary": "Latency, throughput and GPU utilization per batch size, and the sweet spot for a p99 target",
        "parameters": [_query("service", "service name", True),
                       _query("attribute", "batch-size span attribute (default batch.size)"),
                       _query("p99_target", "p99 target in ms (or with unit: 50ms, 0.05s), at most an hour",
                              schema=_number_with(["ms", "s"])),
                       _query("select", "only these requests: " + _SELECTOR), SINCE, UNTIL,
                       _query("min_requests", "requests a batch size needs to be judged (default 100)",
                              schema=_whole(1, 10_000_000))],
        "responses": _ok("Batching", "per batch size, smallest first")}},
    "/api/v1/analyze/pipeline": {"get": {
        "summary": "Share of critical-path time by stage, for median and for p99 requests",
        "parameters": [_query("service", "service name", True), _query("operation", "only this operation"),
                       _query("select", "only these requests: " + _SELECTOR), SINCE, UNTIL, _MAX_TRACES],
        "responses": _ok("Pipeline", "one breakdown per operation, busiest first")}},
}
