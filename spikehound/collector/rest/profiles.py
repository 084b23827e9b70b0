"""REST route of the profile diff at spike time (``spikehound.collector.spike_profile``, docs/profile-diff.md).

* ``GET /api/v1/spikes/{spike_id}/profile``: per profiled (service, host) the functions whose share of the
  sampled stacks grew most during the spike against the period before it, the clear culprit if any, the
  sample counts and the merged differential flame tree.

A spike without profiles is answered 200 with no groups and a ``reason``: the spike exists, its processes were
just not profiled (or not in its windows), which the reason says. A diff cut at its bounds says so in
``partial``. Beyond the diffs the collector runs at once (``DiffGate``), 429 with ``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from spikehound.collector.rest.common import (
    DIFF_GATE,
    EXECUTOR,
    READER,
    TELEMETRY,
    ApiError,
    json_response,
    limit_param,
    run_blocking,
)
from spikehound.collector.rest.openapi import (
    NOT_FOUND,
    TIME,
    OpenApiFragment,
    limit_query,
    nullable,
    ok_responses,
    schema_object,
)
from spikehound.collector.spike_profile import (
    DEFAULT_CHANGES,
    DIFF_RETRY_AFTER_SECONDS,
    MAX_CONCURRENT_DIFFS,
    MAX_LISTED_PROCESSES,
    DiffGate,
    profile_json,
    spike_profile,
)
from spikehound.storage.reader import Reader

MAX_CHANGES = 200

ROUTES = web.RouteTableDef()


def add_routes(app: web.Application) -> None:
    app.add_routes(ROUTES)


def _read(gate: DiffGate, reader: Reader, spike_id: str, changes: int) -> dict[str, Any] | None:
    try:
        spike = reader.spike(spike_id)
        if spike is None:
            return None
        return profile_json(spike_profile(reader, spike), changes)
    finally:
        gate.leave()  # on the worker thread, when the diff is done: never while it still runs


@ROUTES.get("/api/v1/spikes/{spike_id}/profile")
async def get_spike_profile(request: web.Request) -> web.Response:
    spike_id = request.match_info["spike_id"]
    changes = limit_param(request, DEFAULT_CHANGES, MAX_CHANGES)
    gate = request.app[DIFF_GATE]
    if not gate.enter("api"):
        raise ApiError(429, gate.busy(), retry_after=DIFF_RETRY_AFTER_SECONDS)
    body = await run_blocking(request.app[EXECUTOR], _read, gate, request.app[READER], spike_id, changes)
    if body is None:
        raise ApiError(404, f"spike {spike_id} not found")
    if body["partial"] is not None:
        request.app[TELEMETRY].profile_diffs_partial.labels("api").inc()
    return json_response(body)


# --- the OpenAPI description -----------------------------------------------------------------

_SHARE = {"type": "number", "minimum": 0, "maximum": 1}
_COUNT = {"type": "integer", "minimum": 0}
_PERIOD = schema_object({"start": TIME, "end": TIME})
_CHANGE_PROPS: dict[str, Any] = {
    "function": {"type": "string"}, "file": {"type": "string"},
    "self_spike": {**_SHARE, "description": "share of the spike's samples with the function as the leaf frame"},
    "self_baseline": {**_SHARE, "description": "the same before the spike"},
    "total_spike": {**_SHARE, "description": "share of the spike's samples with the function anywhere on the "
                                            "stack (once per stack, however deep it recurses)"},
    "total_baseline": {**_SHARE, "description": "the same before the spike"},
    "samples_spike": {**_COUNT, "description": "samples with the function on the stack, during the spike"},
    "samples_baseline": {**_COUNT, "description": "the same before the spike"},
    "self_samples_spike": {**_COUNT, "description": "samples with the function as the leaf, during the spike"},
    "self_samples_baseline": {**_COUNT, "description": "the same before the spike"},
    "self_rate_spike": {"type": "number", "minimum": 0,
                        "description": "its leaf samples a second of profiled time during the spike (on-CPU "
                                       "samples: its CPU time)"},
    "self_rate_baseline": {"type": "number", "minimum": 0, "description": "the same before the spike"},
    "sentence": {"type": "string", "description": "the self shares in words"},
}

SCHEMAS: dict[str, Any] = {
    "FunctionChange": schema_object(_CHANGE_PROPS),
    "FlameNode": {**schema_object({
        "function": {"type": "string"}, "file": {"type": "string"},
        "spike": {**_COUNT, "description": "samples through this frame during the spike (its width)"},
        "baseline": {**_COUNT, "description": "samples through it before the spike"},
        "children": {"type": "array", "items": {"$ref": "#/components/schemas/FlameNode"}}}),
        "description": "a frame of the merged call tree (root: 'all'), callees by spike samples"},
    "ProcessProfile": schema_object({
        "service": {"type": "string"}, "host": {"type": "string"}, "kind": {"enum": ["cpu", "wall"]},
        "processes": {"type": "array", "items": schema_object({"pid": {"type": "integer"},
                                                               "process": {"type": "string"}}),
                      "description": f"the profiled processes, by pid: at most {MAX_LISTED_PROCESSES}, the "
                                     "busiest during the spike"},
        "processes_omitted": {**_COUNT, "description": "profiled processes not listed in processes (0 when all "
                                                       "are)"},
        "samples_spike": _COUNT, "samples_baseline": _COUNT,
        "culprit": {"anyOf": [{"$ref": "#/components/schemas/FunctionChange"}, {"type": "null"}]},
        "why_unclear": {**nullable("string"), "description": "why no culprit is named (null when one is)"},
        "changes": {"type": "array", "items": {"$ref": "#/components/schemas/FunctionChange"},
                    "description": "largest growth of self share first, then of total share"},
        "flame": {"$ref": "#/components/schemas/FlameNode"}}),
    "SpikeProfile": schema_object({
        "spike_id": {"type": "string"}, "spike_period": _PERIOD, "baseline_period": _PERIOD,
        "culprit": {"anyOf": [schema_object({"service": {"type": "string"}, "host": {"type": "string"},
                                             **_CHANGE_PROPS}), {"type": "null"}],
                    "description": "the first clear culprit, in the causes' order of the processes"},
        "profiles": {"type": "array", "items": {"$ref": "#/components/schemas/ProcessProfile"},
                     "description": "one per profiled service and host, in the causes' order"},
        "reason": {**nullable("string"), "description": "why there is nothing to compare (null when profiles "
                                                        "were found)"},
        "partial": {**nullable("string"), "description": "what the diff left unread at the collector's bounds "
                                                         "(distinct stacks, frames, functions, rows), the shares "
                                                         "being of what was read; null when it read everything "
                                                         "(docs/profile-diff.md)"}}),
}

PATHS: dict[str, Any] = {
    "/api/v1/spikes/{spike_id}/profile": {"get": {
        "summary": "The profile diff at spike time: which functions took more of the CPU during the spike",
        "parameters": [{"name": "spike_id", "in": "path", "required": True, "schema": {"type": "string"}},
                       limit_query(f"most function changes per process (default {DEFAULT_CHANGES})", MAX_CHANGES)],
        "responses": {**ok_responses("SpikeProfile", "the diff; no profiles: an empty list and a reason"),
                      **NOT_FOUND,
                      "429": {"description": f"{MAX_CONCURRENT_DIFFS} profile diffs (this API's and the spike "
                                             "pages') are running already; retry after the Retry-After header's "
                                             "seconds",
                              "headers": {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}},
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}},
}

OPENAPI = OpenApiFragment(paths=PATHS, schemas=SCHEMAS)
