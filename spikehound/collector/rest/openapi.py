"""The OpenAPI 3.1 document served at ``/api/v1/openapi.json``: the schema builders the route modules describe
their routes with, and the merge of their fragments into one document.

Each route module exports an :class:`OpenApiFragment` (its paths and the schemas they name); ``rest.app``
merges them with :func:`merge_document`, which adds what is shared: the ``Error`` schema, the ``BadRequest`` and
``NotFound`` responses, the bearer scheme (optional: asked for when ``collector.api_token`` is set, else 401), and
the refusals ``spikehound/collector/cross_site.py`` answers before any handler.

>>> query_param("service", "service name", True)["schema"]
{'type': 'string', 'minLength': 1}
>>> merge_document([OpenApiFragment(paths={"/x": {"post": {"responses": {}}}})])["paths"]["/x"]["post"]["responses"]
{'401': {'$ref': '#/components/responses/Unauthorized'}, '421': {'$ref': '#/components/responses/MisdirectedRequest'}, \
'503': {'$ref': '#/components/responses/StorageUnavailable'}, '403': {'$ref': '#/components/responses/CrossOrigin'}, \
'413': {'$ref': '#/components/responses/TooLarge'}, '415': {'$ref': '#/components/responses/UnsupportedMediaType'}}
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spikehound import __version__
from spikehound.collector.cross_site import HOST_EXEMPT_PATHS


@dataclass(frozen=True)
class OpenApiFragment:
    """What one route module adds to the document: its paths and the component schemas they refer to."""

    paths: dict[str, Any] = field(default_factory=dict)
    schemas: dict[str, Any] = field(default_factory=dict)


# --- schema builders --------------------------------------------------------------------------


def schema_object(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema; every property is required unless ``required`` names fewer."""
    return {"type": "object", "properties": props, "required": required if required is not None else list(props)}


def nullable(kind: str) -> dict[str, Any]:
    return {"type": [kind, "null"]}


def query_param(name: str, description: str, required: bool = False,
                schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A query parameter; a required one must not be empty (the API reads an empty value as none given)."""
    kind = schema or ({"type": "string", "minLength": 1} if required else {"type": "string"})
    return {"name": name, "in": "query", "required": required, "description": description, "schema": kind}


def whole_schema(low: int, high: int) -> dict[str, Any]:
    """The schema of a whole-number parameter (ASCII digits, within [low, high])."""
    return {"type": "integer", "minimum": low, "maximum": high}


def limit_query(description: str, most: int) -> dict[str, Any]:
    """The ``limit`` parameter, 1 to ``most``."""
    return query_param("limit", description, schema=whole_schema(1, most))


def json_body(ref: str) -> dict[str, Any]:
    """A JSON body (request or response) of the component schema ``ref``."""
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def ok_responses(schema_ref: str, description: str) -> dict[str, Any]:
    """200 with a ``schema_ref`` body, or 400 for a bad parameter."""
    return {"200": {"description": description, **json_body(schema_ref)},
            "400": {"$ref": "#/components/responses/BadRequest"}}


BAD_REQUEST = {"400": {"$ref": "#/components/responses/BadRequest"}}
NOT_FOUND = {"404": {"$ref": "#/components/responses/NotFound"}}
TIME = {"type": "string", "format": "date-time", "description": "RFC 3339, UTC"}
# What parse_time reads; both within 1677-09-21 to 2262-04-11, what storage's 64-bit nanoseconds hold.
TIME_PARAM = {"anyOf": [{"type": "string", "format": "date-time"},
                        {"type": "string", "pattern": "^[0-9]{1,11}(\\.[0-9]+)?$", "description": "unix seconds"}]}
SINCE = query_param("since", "RFC 3339 time or unix seconds; default one hour before until", schema=TIME_PARAM)
UNTIL = query_param("until", "RFC 3339 time or unix seconds; default now", schema=TIME_PARAM)


# --- the document -----------------------------------------------------------------------------

_ERROR_BODY = json_body("Error")
# What spikehound/collector/cross_site.py answers before any handler (docs/operations.md, Security).
_REFUSALS = {
    "Unauthorized": ("401", "no bearer token, or a wrong one, while collector.api_token is set"),
    "MisdirectedRequest": ("421", "the Host header is not a name of this collector (DNS rebinding); see "
                                  "collector.allowed_hosts"),
    "CrossOrigin": ("403", "sent on behalf of another site's page (Origin or Sec-Fetch-Site)"),
    "TooLarge": ("413", "the request body is over 1 MiB"),
    "UnsupportedMediaType": ("415", "a request body that is not application/json"),
    # Answered by spikehound/collector/rest/app.py for any handler whose read the database could not serve.
    "StorageUnavailable": ("503", "the database cannot be reached now (restarting, stopped); retry after the "
                                  "Retry-After header's seconds"),
}


def merge_document(fragments: Iterable[OpenApiFragment]) -> dict[str, Any]:
    """One document of the fragments' paths and schemas, in their order, with the shared parts and refusals."""
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {"Error": schema_object({"error": {"type": "string"}})}
    for fragment in fragments:
        paths.update(copy.deepcopy(fragment.paths))  # the refusals are added per operation: not to the fragment
        schemas.update(fragment.schemas)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "spikehound collector API", "version": __version__,
                 "description": "p99 spikes, their causes and the evidence: traces, latency and host metrics."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": {"BadRequest": {"description": "invalid parameter", **_ERROR_BODY},
                          "NotFound": {"description": "no such object", **_ERROR_BODY}},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "required when collector.api_token is set"}},
        },
        "security": [{}, {"bearer": []}],  # optional: the token is asked for only when one is configured
    }
    _add_refusals(doc)
    return doc


def _add_refusals(doc: dict[str, Any]) -> None:
    """Every operation may be refused for its Host; those that change state also for their origin and body."""
    doc["components"]["responses"].update({name: {"description": text, **_ERROR_BODY}
                                           for name, (_, text) in _REFUSALS.items()})
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            # The health probes are answered to any Host and carry no token (rest/app.py OPEN_PATHS).
            names = [] if path in HOST_EXEMPT_PATHS else ["Unauthorized", "MisdirectedRequest", "StorageUnavailable"]
            if method not in ("get", "head", "options"):
                names += ["CrossOrigin", "TooLarge", "UnsupportedMediaType"]
            operation["responses"].update({_REFUSALS[n][0]: {"$ref": f"#/components/responses/{n}"} for n in names})
