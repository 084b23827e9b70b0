"""The REST API (JSON under ``/api/v1``), health endpoints and ``/metrics``.

Shapes are the contract of the design brief, section 3. Queries run in a
thread pool so a slow read never stalls ingest. Errors are JSON:
``{"error": "..."}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from collector.cross_site import Site, cross_site_middleware
from collector.ingest import bearer_ok
from collector.openapi import openapi_document
from collector.rest.serialize import span_json, spike_json
from collector.telemetry import CollectorTelemetry
from collector.web.routes import add_web_pages, is_web_path
from detectors.critical_path import critical_path
from spikehound.timefmt import MIN_NS, NS, parse_time, rfc3339
from storage.reader import Reader

T = TypeVar("T")
DEFAULT_RANGE_NS = 3600 * NS
_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
_OPEN_PATHS = ("/healthz", "/readyz")
_WHOLE = re.compile(r"^[0-9]{1,19}$")  # ASCII only: str.isdigit() also takes '²', which int() refuses
MAX_BODY_BYTES = 1024**2  # aiohttp's own limit on a request body, refused up front by Content-Length

READER = web.AppKey("reader", Reader)
TELEMETRY = web.AppKey("telemetry", CollectorTelemetry)
READY = web.AppKey("ready", Callable[[], Awaitable[tuple[bool, str]]])
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def make_api(reader: Reader, telemetry: CollectorTelemetry, ready: Callable[[], Awaitable[tuple[bool, str]]],
             token: str, site: Site | None = None) -> web.Application:
    """The API's application; ``site`` names the hosts and origin it answers to (loopback and addresses only
    when not given), see ``collector.cross_site``."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if (token and request.path not in _OPEN_PATHS and not is_web_path(request.path)  # pages check it themselves
                and not bearer_ok(request.headers.get("Authorization"), token)):
            telemetry.api_refused.labels("unauthenticated").inc()
            return _json({"error": "missing or wrong bearer token"}, 401)
        try:
            return await handler(request)
        except ApiError as exc:
            return _json({"error": str(exc)}, exc.status)

    cross_site = cross_site_middleware(site or Site(), MAX_BODY_BYTES, telemetry.api_refused)
    app = web.Application(middlewares=[cross_site, guard], client_max_size=MAX_BODY_BYTES)
    app[READER] = reader
    app[TELEMETRY] = telemetry
    app[READY] = ready
    app[EXECUTOR] = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spikehound-api")

    async def shutdown_executor(app: web.Application) -> None:
        app[EXECUTOR].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(shutdown_executor)
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/api/v1/openapi.json", openapi)
    r.add_get("/api/v1/traces/{trace_id}", get_trace)
    r.add_get("/api/v1/services", get_services)
    r.add_get("/api/v1/latency", get_latency)
    r.add_get("/api/v1/hosts", get_hosts)
    r.add_get("/api/v1/metrics", get_metrics)
    r.add_get("/api/v1/spikes", get_spikes)
    r.add_get("/api/v1/spikes/{spike_id}", get_spike)
    add_web_pages(app, reader, app[EXECUTOR], token, telemetry.registry)
    from collector.analysis_api import add_analysis_routes  # here: it builds on this module's helpers

    add_analysis_routes(app)
    return app


async def _run(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(request.app[EXECUTOR], fn, *args)


def _time_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse_time(raw)
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}") from None


def _range(request: web.Request) -> tuple[int, int]:
    until = _time_param(request, "until", time.time_ns())
    since = _time_param(request, "since", max(MIN_NS, until - DEFAULT_RANGE_NS))  # stored times are int64
    if since >= until:
        raise ApiError(400, "since must be before until")
    return since, until


def whole_number(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    """A whole-number parameter within [low, high]; ApiError 400 naming it otherwise."""
    if raw is None or raw == "":
        return default
    if not _WHOLE.match(raw) or not low <= int(raw) <= high:
        raise ApiError(400, f"{name} must be a whole number from {low} to {high}")
    return int(raw)


def _limit(request: web.Request, default: int, most: int) -> int:
    return whole_number(request.query.get("limit"), "limit", default, 1, most)


# --- handlers ---------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ok, reason = await request.app[READY]()
    return _json({"status": "ready" if ok else "not ready", "reason": reason}, 200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    # Off the event loop: span metrics can be tens of thousands of samples, and the spike metrics query storage.
    body = await _run(request, generate_latest, request.app[TELEMETRY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


async def get_trace(request: web.Request) -> web.Response:
    trace_id = request.match_info["trace_id"]
    if not _TRACE_ID.match(trace_id):
        raise ApiError(400, "trace id must be 32 hex digits")
    spans = await _run(request, request.app[READER].trace, bytes.fromhex(trace_id))
    if not spans:
        raise ApiError(404, f"trace {trace_id.lower()} not found")
    path = critical_path(spans)
    return _json({"trace_id": trace_id.lower(), "spans": [span_json(s) for s in spans],
                  "critical_path": [p.hex() for p in path]})


async def get_services(request: web.Request) -> web.Response:
    services = await _run(request, request.app[READER].services)
    return _json({"services": [{"service": name, "operations": ops} for name, ops in services]})


async def get_latency(request: web.Request) -> web.Response:
    service = request.query.get("service")
    if not service:
        raise ApiError(400, "service is required")
    operation = request.query.get("operation") or None
    since, until = _range(request)
    windows = await _run(request, request.app[READER].latency, service, operation, since, until,
                         _limit(request, 10_000, 100_000), request.query.get("peer_service") or None)
    return _json({"points": [{"t": rfc3339(w.start_unix_nano), "operation": w.operation, "count": w.count,
                              "p50_ms": w.p50_ns / 1e6, "p95_ms": w.p95_ns / 1e6, "p99_ms": w.p99_ns / 1e6,
                              "max_ms": w.max_ns / 1e6} for w in windows]})


async def get_hosts(request: web.Request) -> web.Response:
    hosts = await _run(request, request.app[READER].hosts)
    return _json({"hosts": [{"host": h.host, "last_seen": rfc3339(h.last_seen_unix_nano),
                             "metrics": list(h.metrics)} for h in hosts]})


async def get_metrics(request: web.Request) -> web.Response:
    host = request.query.get("host") or None
    name = request.query.get("name") or None
    if host is None and name is None:
        raise ApiError(400, "give host, name or both")
    since, until = _range(request)
    series, truncated = await _run(request, request.app[READER].metrics, host, name, since, until,
                                   _limit(request, 20_000, 200_000))
    return _json({"series": [{"host": s.host, "name": s.name, "attributes": s.attributes, "unit": s.unit,
                              "points": [{"t": rfc3339(t), "value": v} for t, v in s.points]}
                             for s in series], "truncated": truncated})


async def get_spikes(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    if state not in (None, "open", "resolved"):
        raise ApiError(400, "state must be open or resolved")
    since = _time_param(request, "since", 0) if "since" in request.query else None
    until = _time_param(request, "until", 0) if "until" in request.query else None
    spikes = await _run(request, request.app[READER].spikes, request.query.get("service") or None,
                        since, until, state, _limit(request, 500, 10_000))
    return _json({"spikes": [spike_json(s) for s in spikes]})


async def get_spike(request: web.Request) -> web.Response:
    spike_id = request.match_info["spike_id"]
    spike = await _run(request, request.app[READER].spike, spike_id)
    if spike is None:
        raise ApiError(404, f"spike {spike_id} not found")
    return _json(spike_json(spike))
