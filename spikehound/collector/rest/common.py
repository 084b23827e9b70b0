"""What every REST route module shares: the application's keys, errors, JSON answers, query parsers and the
hop onto the API's thread pool.

A handler raises :class:`ApiError` and the application's middleware answers it as ``{"error": "..."}`` with
its status (``spikehound.collector.rest.app``). Queries run on the API's executor (:func:`run_blocking`) so that a slow
read never stalls the event loop that also serves ingest.

>>> whole_number("42", "limit", 7, 1, 100), whole_number(None, "limit", 7, 1, 100)
(42, 7)
>>> whole_number("²", "limit", 7, 1, 100)
Traceback (most recent call last):
...
spikehound.collector.rest.common.ApiError: limit must be a whole number from 1 to 100
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from spikehound.collector.alerts.alerting import Alerting
from spikehound.collector.spike_profile import DiffGate
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.storage.reader import Reader
from spikehound.storage.resolved_spikes import ResolvedSpikes
from spikehound.timefmt import MIN_NS, parse_time
from spikehound.units import NS

T = TypeVar("T")
DEFAULT_RANGE_NS = 3600 * NS  # a range without since starts an hour before its end
_WHOLE = re.compile(r"^[0-9]{1,19}$")  # ASCII only: str.isdigit() also takes '²', which int() refuses

READER = web.AppKey("reader", Reader)
TELEMETRY = web.AppKey("telemetry", CollectorTelemetry)
READY = web.AppKey("ready", Callable[[], Awaitable[tuple[bool, str]]])
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
ALERTING = web.AppKey("alerting", Alerting)
API_TOKEN = web.AppKey("api_token", str)  # "" when the API is open
DIFF_GATE = web.AppKey("diff_gate", DiffGate)  # the profile diffs running at once: the API's and the page's
# Resolved spikes' JSON, by the object the reader built (one it keeps while the spike stays as it is).
ENCODED_SPIKES = web.AppKey("encoded_spikes", ResolvedSpikes)


class ApiError(Exception):
    """A request the API refuses: answered as ``{"error": message}`` with ``status`` (and ``Retry-After`` when
    ``retry_after`` seconds are given)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def run_blocking(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``executor`` (the API's thread pool), awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


# --- query parameters -------------------------------------------------------------------------


def time_param(request: web.Request, name: str, default: int) -> int:
    """A time parameter (RFC 3339 or unix seconds) in nanoseconds; ``default`` when absent or empty."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse_time(raw)
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}") from None


def time_range(request: web.Request) -> tuple[int, int]:
    """``since`` and ``until``: until defaults to now, since to an hour before until."""
    until = time_param(request, "until", time.time_ns())
    since = time_param(request, "since", max(MIN_NS, until - DEFAULT_RANGE_NS))  # stored times are int64
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


def limit_param(request: web.Request, default: int, most: int) -> int:
    """The ``limit`` parameter, 1 to ``most``."""
    return whole_number(request.query.get("limit"), "limit", default, 1, most)
