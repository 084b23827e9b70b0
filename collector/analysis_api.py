"""REST endpoints of the regression gate and the serving analyses (see ``collector.analysis``).

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

from collector import analysis
from collector.api import READER, ApiError, _json, _range, _run, whole_number
from detectors.compare import CompareOptions
from spikehound.timefmt import MAX_NS, NS

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|ms|s)?\s*$")


def add_analysis_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/api/v1/compare", get_compare)
    r.add_get("/api/v1/profile", get_profile)
    r.add_get("/api/v1/analyze/batching", get_batching)
    r.add_get("/api/v1/analyze/pipeline", get_pipeline)


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
    since, until = _range(request)
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
    report: dict[str, Any] = await _run(request, lambda: analysis.compare_selections(
        request.app[READER], baseline, candidate, options, max_traces=max_traces))
    return _json(report)


def _max_traces(request: web.Request) -> int:
    return _int(request, "max_traces", analysis.DEFAULT_MAX_TRACES, 1, 1_000_000)


async def get_profile(request: web.Request) -> web.Response:
    selection, max_traces = _selection(request, "select"), _max_traces(request)
    found = await _run(request, lambda: analysis.profile(request.app[READER], selection, max_traces=max_traces))
    return _json(found.to_json())


async def get_batching(request: web.Request) -> web.Response:
    service = _required(request, "service")
    selection = _selection(request, "select", required=False)
    target = _number(request, "p99_target", None, 0.0, 3_600_000.0, {None: 1.0, "ms": 1.0, "s": 1000.0})
    attribute = request.query.get("attribute") or "batch.size"
    min_requests = _int(request, "min_requests", 100, 1, 10_000_000)
    report = await _run(request, lambda: analysis.batching(
        request.app[READER], service, selection, attribute=attribute,
        p99_target_ns=None if target is None else target * 1e6, min_requests=min_requests))
    return _json({"service": service, "attribute": attribute, **selection.describe(), **report.to_json()})


async def get_pipeline(request: web.Request) -> web.Response:
    service = _required(request, "service")
    selection, max_traces = _selection(request, "select", required=False), _max_traces(request)
    operation = request.query.get("operation") or None
    found = await _run(request, lambda: analysis.pipeline(request.app[READER], service, operation, selection,
                                                          max_traces=max_traces))
    return _json({"service": service, **selection.describe(), "operations": [b.to_json() for b in found]})
