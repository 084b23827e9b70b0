"""The API's aiohttp application on the collector's API port: every route module mounted behind one set of
middlewares, and the OpenAPI document merged from their fragments.

Middlewares, outermost first: the cross-site checks (``spikehound.collector.cross_site``: Host, origin, body size and
type), then the guard: the bearer token (except for the health endpoints and the web pages, which check it
themselves), :class:`~spikehound.collector.rest.common.ApiError` answered as ``{"error": "..."}``, and a database that
cannot be reached answered 503 with ``Retry-After``, never 500.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from aiohttp import web

from spikehound.collector.alerts.alerting import Alerting
from spikehound.collector.cross_site import Site, cross_site_middleware
from spikehound.collector.rest import alerts, analysis, core, jaeger, profiles
from spikehound.collector.rest.auth import bearer_ok
from spikehound.collector.rest.common import (
    ALERTING,
    API_TOKEN,
    DIFF_GATE,
    ENCODED_SPIKES,
    EXECUTOR,
    READER,
    READY,
    TELEMETRY,
    ApiError,
    json_response,
)
from spikehound.collector.rest.openapi import merge_document
from spikehound.collector.spike_profile import DiffGate
from spikehound.collector.storage_health import DATABASE_AWAY, READ_RETRY_AFTER_SECONDS, read_refusal
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.web import routes as web_pages
from spikehound.storage.reader import Reader
from spikehound.storage.resolved_spikes import ResolvedSpikes

log = logging.getLogger("spikehound.collector.api")

MAX_BODY_BYTES = 1024**2  # aiohttp's own limit on a request body, refused up front by Content-Length
OPEN_PATHS = ("/healthz", "/readyz")  # the health endpoints: probes carry no token
# Mounted in this order; the OpenAPI document lists their paths in the same order.
ROUTE_MODULES = (core, profiles, analysis, alerts, jaeger)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@cache
def openapi_document() -> dict[str, Any]:
    """The document served at ``/api/v1/openapi.json`` (built once: it depends on no setting)."""
    return merge_document(module.OPENAPI for module in ROUTE_MODULES)


def build_app(reader: Reader, telemetry: CollectorTelemetry, ready: Callable[[], Awaitable[tuple[bool, str]]],
              token: str, alerting: Alerting, site: Site | None = None) -> web.Application:
    """The API's application; ``site`` names the hosts and origin it answers to (loopback and addresses only
    when not given), see ``spikehound.collector.cross_site``."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (token and request.path not in OPEN_PATHS and not web_pages.is_web_path(request.path)
                and not bearer_ok(request.headers.get("Authorization"), token)):
            telemetry.api_refused.labels("unauthenticated").inc()
            return json_response({"error": "missing or wrong bearer token"}, 401)
        try:
            return await handler(request)
        except ApiError as exc:
            refusal = json_response({"error": str(exc)}, exc.status)
            if exc.retry_after is not None:
                refusal.headers["Retry-After"] = str(exc.retry_after)
            return refusal
        except DATABASE_AWAY as exc:  # a retry will do, not a 500; the pipeline says it once in the log
            log.debug("%s %s: %s", request.method, request.path, read_refusal(exc))
            response = json_response({"error": read_refusal(exc)}, 503)
            response.headers["Retry-After"] = str(READ_RETRY_AFTER_SECONDS)
            return response

    cross_site = cross_site_middleware(site or Site(), MAX_BODY_BYTES, telemetry.api_refused)
    app = web.Application(middlewares=[cross_site, guard], client_max_size=MAX_BODY_BYTES)
    app[READER] = reader
    app[TELEMETRY] = telemetry
    app[READY] = ready
    app[API_TOKEN] = token
    app[ALERTING] = alerting
    app[EXECUTOR] = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spikehound-api")
    app[DIFF_GATE] = DiffGate(refused=telemetry.profile_diffs_refused)
    app[ENCODED_SPIKES] = ResolvedSpikes()

    async def shutdown_executor(app: web.Application) -> None:
        app[EXECUTOR].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(shutdown_executor)
    app.router.add_get("/api/v1/openapi.json", serve_openapi)
    for module in ROUTE_MODULES:
        module.add_routes(app)
    web_pages.add_routes(app)
    return app


async def serve_openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())
