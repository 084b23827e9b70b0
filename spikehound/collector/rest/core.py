"""The core of the REST API: traces, services, latency, hosts and metrics, spikes (``/api/v1``), the health
endpoints and the collector's own ``/metrics``.

The shapes are a contract with every API client: each route's schema is part of the OpenAPI document the
collector serves, and the tests hold every answer to it. Every query runs on the API's thread pool.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from spikehound.collector.rest.common import (
    ENCODED_SPIKES,
    EXECUTOR,
    READER,
    READY,
    TELEMETRY,
    ApiError,
    json_response,
    limit_param,
    run_blocking,
    time_param,
    time_range,
)
from spikehound.collector.rest.openapi import (
    NOT_FOUND,
    SINCE,
    TIME,
    UNTIL,
    OpenApiFragment,
    limit_query,
    nullable,
    ok_responses,
    query_param,
    schema_object,
)
from spikehound.detectors.critical_path import critical_path
from spikehound.model import CauseKind
from spikehound.model_json import span_json, spike_json
from spikehound.timefmt import rfc3339

_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


ROUTES = web.RouteTableDef()


def add_routes(app: web.Application) -> None:
    app.add_routes(ROUTES)


# --- handlers ---------------------------------------------------------------------------------


@ROUTES.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


@ROUTES.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    ok, reason = await request.app[READY]()
    return json_response({"status": "ready" if ok else "not ready", "reason": reason}, 200 if ok else 503)


@ROUTES.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    # Off the event loop: span metrics can be tens of thousands of samples, and the spike metrics query storage.
    body = await run_blocking(request.app[EXECUTOR], request.app[TELEMETRY].exposition)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@ROUTES.get("/api/v1/traces/{trace_id}")
async def get_trace(request: web.Request) -> web.Response:
    trace_id = request.match_info["trace_id"]
    if not _TRACE_ID.match(trace_id):
        raise ApiError(400, "trace id must be 32 hex digits")
    spans = await run_blocking(request.app[EXECUTOR], request.app[READER].trace, bytes.fromhex(trace_id))
    if not spans:
        raise ApiError(404, f"trace {trace_id.lower()} not found")
    path = critical_path(spans)
    return json_response({"trace_id": trace_id.lower(), "spans": [span_json(s) for s in spans],
                          "critical_path": [p.hex() for p in path]})


@ROUTES.get("/api/v1/services")
async def get_services(request: web.Request) -> web.Response:
    services = await run_blocking(request.app[EXECUTOR], request.app[READER].services)
    return json_response({"services": [{"service": name, "operations": ops} for name, ops in services]})


@ROUTES.get("/api/v1/latency")
async def get_latency(request: web.Request) -> web.Response:
    service = request.query.get("service")
    if not service:
        raise ApiError(400, "service is required")
    operation = request.query.get("operation") or None
    since, until = time_range(request)
    windows = await run_blocking(request.app[EXECUTOR], request.app[READER].latency, service, operation, since,
                                 until, limit_param(request, 10_000, 100_000),
                                 request.query.get("peer_service") or None)
    return json_response({"points": [{"t": rfc3339(w.start_unix_nano), "operation": w.operation,
                                      "count": w.count, "p50_ms": w.p50_ns / 1e6, "p95_ms": w.p95_ns / 1e6,
                                      "p99_ms": w.p99_ns / 1e6, "max_ms": w.max_ns / 1e6} for w in windows]})


@ROUTES.get("/api/v1/hosts")
async def get_hosts(request: web.Request) -> web.Response:
    hosts = await run_blocking(request.app[EXECUTOR], request.app[READER].hosts)
    return json_response({"hosts": [{"host": h.host, "last_seen": rfc3339(h.last_seen_unix_nano),
                                     "metrics": list(h.metrics)} for h in hosts]})


@ROUTES.get("/api/v1/metrics")
async def get_metrics(request: web.Request) -> web.Response:
    host = request.query.get("host") or None
    name = request.query.get("name") or None
    if host is None and name is None:
        raise ApiError(400, "give host, name or both")
    since, until = time_range(request)
    series, truncated = await run_blocking(request.app[EXECUTOR], request.app[READER].metrics, host, name, since,
                                           until, limit_param(request, 20_000, 200_000))
    return json_response({"series": [{"host": s.host, "name": s.name, "attributes": s.attributes, "unit": s.unit,
                                      "points": [{"t": rfc3339(t), "value": v} for t, v in s.points]}
                                     for s in series], "truncated": truncated})


@ROUTES.get("/api/v1/spikes")
async def get_spikes(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    if state not in (None, "open", "resolved"):
        raise ApiError(400, "state must be open or resolved")
    since = time_param(request, "since", 0) if "since" in request.query else None
    until = time_param(request, "until", 0) if "until" in request.query else None
    body = await run_blocking(request.app[EXECUTOR], spike_list_json, request.app, request.query.get("service") or None,
                              since, until, state, limit_param(request, 500, 10_000))
    return web.Response(body=body, content_type="application/json")


def spike_list_json(app: web.Application, service: str | None, since: int | None, until: int | None, state: str | None,
                limit: int) -> bytes:
    """The list's JSON, on the API's threads. A resolved spike the reader kept as built is encoded once: its
    thirty-odd streams' JSON was most of a poll's time (``python -m benchmarks.spike_list``)."""
    encoded = app[ENCODED_SPIKES]
    docs: list[Any] = []
    for spike in app[READER].spikes(service, since, until, state, limit):
        if spike.state != "resolved":
            docs.append(spike_json(spike))
            continue
        kept = encoded.get(id(spike))  # the object itself is kept with its JSON, so its id is not reused
        if kept is None or kept[0] is not spike:
            kept = (spike, orjson.Fragment(orjson.dumps(spike_json(spike))))
            encoded.put(id(spike), kept)
        docs.append(kept[1])
    return orjson.dumps({"spikes": docs})


@ROUTES.get("/api/v1/spikes/{spike_id}")
async def get_spike(request: web.Request) -> web.Response:
    spike_id = request.match_info["spike_id"]
    spike = await run_blocking(request.app[EXECUTOR], request.app[READER].spike, spike_id)
    if spike is None:
        raise ApiError(404, f"spike {spike_id} not found")
    return json_response(spike_json(spike))


# --- the OpenAPI description of these routes --------------------------------------------------

SCHEMAS: dict[str, Any] = {
    "Span": schema_object({
        "trace_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "span_id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "parent_span_id": nullable("string"), "service": {"type": "string"}, "host": nullable("string"),
        "name": {"type": "string"},
        "kind": {"enum": ["SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER"]},
        "start": TIME, "start_unix_nano": {"type": "integer"}, "duration_ns": {"type": "integer"},
        "status": {"enum": ["UNSET", "OK", "ERROR"]}, "attributes": {"type": "object"},
        "resource": {"type": "object"}, "events": {"type": "array", "items": {"type": "object"}},
    }),
    "Trace": schema_object({"trace_id": {"type": "string"},
                            "spans": {"type": "array", "items": {"$ref": "#/components/schemas/Span"}},
                            "critical_path": {"type": "array", "items": {"type": "string"},
                                              "description": "span ids that determined the trace's end time"}}),
    "Services": schema_object({"services": {"type": "array", "items": schema_object({
        "service": {"type": "string"}, "operations": {"type": "array", "items": {"type": "string"}}})}}),
    "Latency": schema_object({"points": {"type": "array", "items": schema_object({
        "t": TIME, "operation": {"type": "string"}, "count": {"type": "integer"},
        "p50_ms": {"type": "number"}, "p95_ms": {"type": "number"}, "p99_ms": {"type": "number"},
        "max_ms": {"type": "number"}})}}),
    "Hosts": schema_object({"hosts": {"type": "array", "items": schema_object({
        "host": {"type": "string"}, "last_seen": TIME,
        "metrics": {"type": "array", "items": {"type": "string"}}})}}),
    "Metrics": schema_object({"series": {"type": "array", "items": schema_object({
        "host": {"type": "string"}, "name": {"type": "string"}, "attributes": {"type": "object"},
        "unit": {"type": "string"},
        "points": {"type": "array", "items": schema_object({"t": TIME, "value": {"type": "number"}})}})},
        "truncated": {"type": "boolean"}}),
    "Cause": schema_object({
        "kind": {"enum": [k.value for k in CauseKind]}, "service": nullable("string"),
        "operation": nullable("string"), "peer_service": nullable("string"), "host": nullable("string"),
        "resource": nullable("string"), "score": {"type": "number", "minimum": 0, "maximum": 1},
        "baseline": nullable("number"), "observed": nullable("number"), "unit": nullable("string"),
        "summary": {"type": "string"}}),
    "AffectedStream": schema_object({
        "service": {"type": "string"}, "operation": {"type": "string"}, "peer_service": nullable("string"),
        "start": TIME, "last_anomalous_end": TIME, "p99_ms": {"type": "number"},
        "baseline_p99_ms": {"type": "number"}, "evidence": {"type": "number"},
        "slow_requests": {"type": "integer"}}),
    "Spike": schema_object({
        "id": {"type": "string"}, "service": {"type": "string"}, "operation": {"type": "string"},
        "peer_service": nullable("string"),
        "state": {"enum": ["open", "resolved"]}, "start": TIME, "end": {"type": ["string", "null"]},
        "p99_ms": {"type": "number"}, "baseline_p99_ms": {"type": "number"},
        "causes": {"type": "array", "items": {"$ref": "#/components/schemas/Cause"}},
        "exemplar_trace_ids": {"type": "array", "items": {"type": "string"}},
        "affected_streams": {"type": "array", "maxItems": 50, "items": {"$ref": "#/components/schemas/AffectedStream"},
                             "description": "The streams the spike moved, the leading one first, then the most "
                                            "user-facing (at most 50)."},
        "recurrence_of": {**nullable("string"),
                          "description": "For a return of a fault at the same place within the hour after an "
                                         "earlier spike there ended: the id of the first spike of the chain "
                                         "(null for a first spike)."},
        "occurrence": {"type": "integer", "minimum": 1,
                       "description": "1 for a first spike, 2 for its first return, and so on."},
        "first_start": {**nullable("string"),
                        "description": "For a return: when the first spike of the chain started (RFC 3339)."}}),
    "Spikes": schema_object({"spikes": {"type": "array", "items": {"$ref": "#/components/schemas/Spike"}}}),
}

PATHS: dict[str, Any] = {
    "/api/v1/traces/{trace_id}": {"get": {
        "summary": "All spans of one trace, with its critical path",
        "parameters": [{"name": "trace_id", "in": "path", "required": True,
                        "schema": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"}}],
        "responses": {**ok_responses("Trace", "the trace"), **NOT_FOUND}}},
    "/api/v1/services": {"get": {"summary": "Services and their operations (span names)",
                                 "responses": ok_responses("Services", "services")}},
    "/api/v1/latency": {"get": {
        "summary": "p50/p95/p99 per closed event-time window of a stream",
        "parameters": [query_param("service", "service name (for a hop stream: the callee)", True),
                       query_param("operation", "operation (span name); all when omitted"),
                       query_param("peer_service", "the caller: the hop stream of its calls into service "
                                                   "(its CLIENT spans); the entry streams when omitted"),
                       SINCE, UNTIL, limit_query("most points (default 10000)", 100_000)],
        "responses": ok_responses("Latency", "windows, oldest first")}},
    "/api/v1/hosts": {"get": {"summary": "Hosts that sent data, with their metric names",
                              "responses": ok_responses("Hosts", "hosts")}},
    "/api/v1/metrics": {"get": {
        "summary": "Resource samples by host and/or metric name",
        "parameters": [query_param("host", "host.name"), query_param("name", "metric name"), SINCE, UNTIL,
                       limit_query("most points in all (default 20000)", 200_000)],
        "responses": ok_responses("Metrics", "series, points oldest first")}},
    "/api/v1/spikes": {"get": {
        "summary": "Spikes, newest first",
        "parameters": [query_param("service", "spikes led by this service or that moved one of its streams"),
                       SINCE, UNTIL,
                       query_param("state", "open or resolved", schema={"enum": ["open", "resolved"]}),
                       limit_query("most spikes (default 500)", 10_000)],
        "responses": ok_responses("Spikes", "spikes")}},
    "/api/v1/spikes/{spike_id}": {"get": {
        "summary": "One spike with its ranked causes and exemplar traces",
        "parameters": [{"name": "spike_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {**ok_responses("Spike", "the spike"), **NOT_FOUND}}},
    "/healthz": {"get": {"summary": "The process is alive", "responses": {"200": {"description": "ok"}}}},
    "/readyz": {"get": {"summary": "Receivers listen and storage answers",
                        "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
    "/metrics": {"get": {"summary": "Prometheus text exposition of the collector's own metrics",
                         "responses": {"200": {"description": "metrics"}}}},
}

OPENAPI = OpenApiFragment(paths=PATHS, schemas=SCHEMAS)
