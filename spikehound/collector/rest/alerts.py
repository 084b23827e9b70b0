"""The alert routes of the REST API: silences, and the outbox with its dead letters.

``POST /api/v1/silences`` takes ``{"matchers": {"service": "gateway", ...},
"ends_at": "2026-12-01T18:00:00Z" | "duration_seconds": 3600, "comment",
"created_by"}`` and answers 201 with the silence; ``GET`` lists silences not
yet expired (``?state=all`` adds the expired ones); ``DELETE
/api/v1/silences/{id}`` ends one now. ``GET /api/v1/alerts/outbox`` lists
notifications (``?state=pending|delivered|dead``), ``GET
/api/v1/alerts/outbox/{id}`` shows one with the body it sends, and ``POST
/api/v1/alerts/outbox/{id}/retry`` sends a dead-lettered one again.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from spikehound.collector.alerts.silences import FIELDS, Silence
from spikehound.collector.rest.common import ALERTING, ApiError, json_response, limit_param, whole_number
from spikehound.collector.rest.openapi import (
    BAD_REQUEST,
    NOT_FOUND,
    TIME,
    OpenApiFragment,
    json_body,
    limit_query,
    nullable,
    query_param,
    schema_object,
    whole_schema,
)
from spikehound.storage.alerts import OutboxRow
from spikehound.timefmt import rfc3339

INT64_MAX = 2**63 - 1  # storage's ids are 64-bit


ROUTES = web.RouteTableDef()


def add_routes(app: web.Application) -> None:
    """The routes; they act on ``app[ALERTING]``."""
    app.add_routes(ROUTES)


def outbox_json(row: OutboxRow, body: bool = False) -> dict[str, Any]:
    out = {"id": row.id, "idempotency_key": row.idempotency_key, "receiver": row.receiver, "route": row.route,
           "group_id": row.group_id, "status": row.status, "state": row.state, "attempts": row.attempts,
           "created_at": rfc3339(row.created_at),
           "next_attempt_at": rfc3339(row.next_attempt_at) if row.state == "pending" else None,
           "delivered_at": rfc3339(row.delivered_at), "last_error": row.last_error}
    if body:
        out["body"] = orjson.loads(row.body)
    return out


@ROUTES.post("/api/v1/silences")
async def create_silence(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ApiError(400, "the body is not JSON") from None
    alerting = request.app[ALERTING]
    try:
        silence = await alerting.create_silence(body)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    return json_response(silence.to_json(int(alerting.clock() * 1e9)), 201)


@ROUTES.get("/api/v1/silences")
async def list_silences(request: web.Request) -> web.Response:
    state = request.query.get("state") or "active"
    if state not in ("active", "all"):
        raise ApiError(400, "state must be active (not yet expired, the default) or all")
    alerting = request.app[ALERTING]
    now_ns = int(alerting.clock() * 1e9)
    found = await alerting.silences(include_expired=state == "all")
    return json_response({"silences": [s.to_json(now_ns) for s in found]})


@ROUTES.get("/api/v1/silences/{silence_id}")
async def get_silence(request: web.Request) -> web.Response:
    alerting = request.app[ALERTING]
    row = await alerting.store.silence(request.match_info["silence_id"])
    if row is None:
        raise ApiError(404, f"silence {request.match_info['silence_id']} not found")
    return json_response(Silence.from_row(row).to_json(int(alerting.clock() * 1e9)))


@ROUTES.delete("/api/v1/silences/{silence_id}")
async def delete_silence(request: web.Request) -> web.Response:
    alerting = request.app[ALERTING]
    silence = await alerting.expire_silence(request.match_info["silence_id"])
    if silence is None:
        raise ApiError(404, f"silence {request.match_info['silence_id']} not found")
    return json_response(silence.to_json(int(alerting.clock() * 1e9)))


@ROUTES.get("/api/v1/alerts/outbox")
async def list_outbox(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    if state not in (None, "pending", "delivered", "dead"):
        raise ApiError(400, "state must be pending, delivered or dead")
    rows = await request.app[ALERTING].outbox(state, limit_param(request, 100, 1000))
    return json_response({"notifications": [outbox_json(r) for r in rows]})


def _row_id(request: web.Request) -> int:
    raw = request.match_info["row_id"]
    return whole_number(raw, "the notification id", 0, 1, INT64_MAX)


@ROUTES.get("/api/v1/alerts/outbox/{row_id}")
async def get_outbox(request: web.Request) -> web.Response:
    row = await request.app[ALERTING].outbox_row(_row_id(request))
    if row is None:
        raise ApiError(404, f"notification {request.match_info['row_id']} not found")
    return json_response(outbox_json(row, body=True))


@ROUTES.post("/api/v1/alerts/outbox/{row_id}/retry")
async def retry_outbox(request: web.Request) -> web.Response:
    alerting = request.app[ALERTING]
    row_id = _row_id(request)
    if not await alerting.retry(row_id):
        row = await alerting.outbox_row(row_id)
        if row is None:
            raise ApiError(404, f"notification {row_id} not found")
        raise ApiError(409, f"notification {row_id} is {row.state}; only dead letters are retried")
    row = await alerting.outbox_row(row_id)
    assert row is not None
    return json_response(outbox_json(row))


# --- the OpenAPI description of these routes --------------------------------------------------

SCHEMAS: dict[str, Any] = {
    "Silence": schema_object({
        "id": {"type": "string"},
        "matchers": {"type": "object", "properties": {k: {"type": "string"} for k in FIELDS},
                     "description": "shell-style patterns; all must match (cause fields: one cause)"},
        "comment": {"type": "string"}, "created_by": {"type": "string"}, "starts_at": TIME,
        "ends_at": TIME, "created_at": TIME, "state": {"enum": ["pending", "active", "expired"]}}),
    "NewSilence": schema_object({
        "matchers": {"type": "object", "properties": {k: {"type": "string"} for k in FIELDS}},
        "starts_at": {"type": ["string", "number"], "description": "default now"},
        "ends_at": {"type": ["string", "number"], "description": "RFC 3339 or unix seconds"},
        "duration_seconds": {"type": "number", "description": "instead of ends_at"},
        "comment": {"type": "string"}, "created_by": {"type": "string"}}, ["matchers"]),
    "Silences": schema_object({"silences": {"type": "array", "items": {"$ref": "#/components/schemas/Silence"}}}),
    "Notification": schema_object({
        "id": {"type": "integer"}, "idempotency_key": {"type": "string"}, "receiver": {"type": "string"},
        "route": {"type": "string"}, "group_id": {"type": "string"}, "status": {"enum": ["firing", "resolved"]},
        "state": {"enum": ["pending", "delivered", "dead"]}, "attempts": {"type": "integer"},
        "created_at": TIME, "next_attempt_at": nullable("string"), "delivered_at": nullable("string"),
        "last_error": nullable("string"), "body": {"type": "object", "description": "only for one notification"}},
        ["id", "idempotency_key", "receiver", "route", "status", "state", "attempts", "created_at"]),
    "Notifications": schema_object({"notifications": {"type": "array",
                                                      "items": {"$ref": "#/components/schemas/Notification"}}}),
}

_SILENCE_ID = [{"name": "silence_id", "in": "path", "required": True, "schema": {"type": "string"}}]
_ROW_ID = [{"name": "row_id", "in": "path", "required": True, "schema": whole_schema(1, INT64_MAX)}]

PATHS: dict[str, Any] = {
    "/api/v1/silences": {
        "get": {"summary": "Silences not yet expired (state=all: also the expired ones)",
                "parameters": [query_param("state", "active (default) or all", schema={"enum": ["active", "all"]})],
                "responses": {"200": {"description": "silences, newest first", **json_body("Silences")},
                              **BAD_REQUEST}},
        "post": {"summary": "Silence alerts whose spike matches, until ends_at",
                 "requestBody": {"required": True, **json_body("NewSilence")},
                 "responses": {"201": {"description": "the silence", **json_body("Silence")}, **BAD_REQUEST}}},
    "/api/v1/silences/{silence_id}": {
        "get": {"summary": "One silence", "parameters": _SILENCE_ID,
                "responses": {"200": {"description": "the silence", **json_body("Silence")}, **NOT_FOUND}},
        "delete": {"summary": "End a silence now (it stays listed as expired)", "parameters": _SILENCE_ID,
                   "responses": {"200": {"description": "the expired silence", **json_body("Silence")}, **NOT_FOUND}}},
    "/api/v1/alerts/outbox": {"get": {
        "summary": "Notifications, newest first; state=dead lists the dead letters",
        "parameters": [query_param("state", "pending, delivered or dead",
                                   schema={"enum": ["pending", "delivered", "dead"]}),
                       limit_query("most (default 100)", 1000)],
        "responses": {"200": {"description": "notifications", **json_body("Notifications")}, **BAD_REQUEST}}},
    "/api/v1/alerts/outbox/{row_id}": {"get": {
        "summary": "One notification with the body it sends", "parameters": _ROW_ID,
        "responses": {"200": {"description": "the notification", **json_body("Notification")}, **BAD_REQUEST,
                      **NOT_FOUND}}},
    "/api/v1/alerts/outbox/{row_id}/retry": {"post": {
        "summary": "Send a dead-lettered notification again", "parameters": _ROW_ID,
        "responses": {"200": {"description": "queued again", **json_body("Notification")}, **BAD_REQUEST, **NOT_FOUND,
                      "409": {"description": "not a dead letter", **json_body("Error")}}}},
}

OPENAPI = OpenApiFragment(paths=PATHS, schemas=SCHEMAS)
