"""The page handlers: read what a page shows (on the API's thread pool), render it with Jinja2, answer HTML.

Every value reaches the page through a Jinja2 template with autoescaping on,
and chart data through its ``tojson`` filter (``<``, ``>``, ``&`` and quotes
escaped), so span names and attributes from untrusted senders show as text.
The pages' Content-Security-Policy (``routes.py``) allows scripts from the
collector only, as a second line of defence.
"""

from __future__ import annotations

import logging
import re
import time
import weakref
import zlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from spikehound.collector.rest.auth import bearer_ok
from spikehound.collector.rest.common import run_blocking
from spikehound.collector.spike_profile import DiffGate, SpikeProfile, periods, spike_profile
from spikehound.collector.storage_health import DATABASE_AWAY, READ_RETRY_AFTER_SECONDS, read_refusal
from spikehound.collector.web import charts, links, session
from spikehound.collector.web.streams import streams_now
from spikehound.collector.web.waterfall import Group, Row, Waterfall, layout, mark_grown
from spikehound.detectors.stack_diff import percent
from spikehound.model import Cause, CauseKind, Span, Spike
from spikehound.storage.reader import Reader
from spikehound.text import recurrence
from spikehound.timefmt import parse_time, rfc3339
from spikehound.units import NS

log = logging.getLogger("spikehound.web")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
STREAM_LOOKBACK_NS = 5 * 60 * NS  # the overview shows streams heard from in the last 5 minutes of their service
BAND_LOOKBACK_NS = 3600 * NS  # the normal p99 band is drawn from the hour before a spike
BEFORE_NS, AFTER_NS = 15 * 60 * NS, 5 * 60 * NS  # the spike page's time axis around the spike
COLLAPSE_OVER_ROWS = 300  # larger waterfalls open with the critical path only (a click shows every row)
SPIKE_PAGE_ROWS = 400  # a spike page shows at most this many rows of a trace; its trace page shows all
SPIKE_LIST_LIMIT = 500
PROFILE_ROWS = 10  # functions in each process's table on the spike page; the API gives more
DASH, TIMES = "\u2013", "\u00d7"  # what a missing value shows; "2.3x" as a person writes it


def _filters() -> dict[str, Callable[..., Any]]:
    def ms(ns: float | None) -> str:
        if ns is None:
            return DASH
        value = ns / 1e6
        return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms" if value >= 1 else f"{value:.3f} ms"

    def when(ns: int | None) -> str:
        text = rfc3339(ns)
        return text[:19].replace("T", " ") + " UTC" if text else "now"

    def clock(ns: int | None) -> str:
        text = rfc3339(ns)
        return text[11:19] if text else "now"

    def span_of(ns: int) -> str:
        seconds = max(ns // NS, 0)
        if seconds < 60:
            return f"{seconds} s"
        if seconds < 3600:
            return f"{seconds // 60} min {seconds % 60} s" if seconds % 60 else f"{seconds // 60} min"
        if seconds < 2 * 86400:
            return f"{seconds // 3600} h {seconds % 3600 // 60} min"
        return f"{seconds // 86400} days"

    def ago(ns: int | None) -> str:
        return DASH if ns is None else span_of(time.time_ns() - ns) + " ago"

    def hue(name: str) -> str:
        return f"c{zlib.crc32(name.encode()) % 8}"

    def rate(value: float) -> str:
        return f"{value:.0f}" if value >= 10 else f"{value:.1f}" if value >= 0.1 else f"{value:.2f}"

    def tip(item: Row | Group) -> str:
        """The hover text of a waterfall row."""
        s = item.span
        if isinstance(item, Group):
            return f"{item.count} {TIMES} {s.service} · {s.name} · {ms(item.total_ns)} in all, {len(item.rows)} spans"
        parts = [s.service, s.name, s.kind.name, ms(s.duration_ns), *([s.host] if s.host else [])]
        if item.on_path:
            parts.append(f"{ms(item.path_self_ns)} of its own on the critical path")
        if item.grown_ns is not None:
            parts.append(f"{ms(item.normal_ns)} in the typical request")
        return " · ".join(parts)

    def ratio(spike: Spike) -> str:
        return f"{spike.p99_ns / spike.baseline_p99_ns:.1f}{TIMES}" if spike.baseline_p99_ns > 0 else "no baseline"

    def points(growth: float) -> str:
        """A change of share in percentage points, signed."""
        return f"{growth * 100:+.0f} pts" if abs(growth) >= 0.005 else "±0 pts"

    return {"ms": ms, "when": when, "clock": clock, "span_of": span_of, "ago": ago, "hue": hue, "rate": rate,
            "pct": percent, "points": points, "tip": tip, "value": format_value, "attrtext": format_attribute,
            "ratio": ratio}


def format_value(value: float | None, unit: str | None) -> str:
    """A cause's baseline or observed number with its unit, as a person reads it.

    >>> format_value(0.698, "1"), format_value(24.252, "ms"), format_value(3.0, "/s")
    ('70%', '24.3 ms', '3 /s')
    """
    if value is None:
        return DASH
    if unit == "1":
        return f"{value * 100:.0f}%"
    number = f"{value:.1f}" if abs(value) < 1000 and value != int(value) else f"{value:,.0f}"
    return f"{number} {unit}" if unit else number


def format_attribute(value: Any) -> str:
    """An attribute value as text (the template escapes it)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return orjson.dumps(value, default=str).decode()
    return str(value)


_REJECTIONS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def _rejections(registry: CollectorRegistry) -> Counter:
    """The refusal counter of ``registry``, made once (an application built twice on one registry shares it)."""
    if registry not in _REJECTIONS:
        _REJECTIONS[registry] = Counter(
            "spikehound_web_rejected_requests", "Page requests refused: no or expired session, wrong token, "
            "bad input, or nothing found.", ["reason"], registry=registry)
    return _REJECTIONS[registry]


@dataclass(slots=True)
class CauseView:
    rank: int
    cause: Cause
    evidence: list[tuple[str, str]]  # (href, what it shows)


class WebPages:
    """The handlers of every page, sharing the API's reader and thread pool."""

    def __init__(self, reader: Reader, executor: ThreadPoolExecutor, token: str, registry: CollectorRegistry,
                 static_url: Callable[[str], str], diff_gate: DiffGate | None = None,
                 diff_partial: Counter | None = None) -> None:
        self.reader = reader
        self.executor = executor
        self.token = token
        self.diff_gate = diff_gate or DiffGate()  # shared with the API's profile route when the app gives one
        self.diff_partial = diff_partial
        self.rejected = _rejections(registry)
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("spikehound.collector.web", "templates"),
                                      autoescape=True,
                                      undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(_filters())
        self.env.globals.update(static=static_url, links=links, auth=bool(token))

    # --- plumbing -----------------------------------------------------------------------------

    def render(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(**context)

    def _html(self, html: str, status: int = 200) -> web.Response:
        response = web.Response(text=html, status=status, content_type="text/html", charset="utf-8")
        response.enable_compression()
        return response

    def _authorized(self, request: web.Request) -> bool:
        return (bearer_ok(request.headers.get("Authorization"), self.token)
                or session.valid(request.cookies.get(session.COOKIE), self.token, time.time()))

    def _set_session(self, response: web.StreamResponse, request: web.Request) -> None:
        response.set_cookie(session.COOKIE, session.issue(self.token, time.time()), max_age=session.SESSION_SECONDS,
                            path=links.PREFIX + "/", httponly=True, samesite="Lax", secure=request.secure)

    def _login(self, request: web.Request, status: int, error: str | None = None,
               next_path: str | None = None) -> web.Response:
        target = next_path or session.safe_next(_without_token(request), links.PREFIX + "/")
        return self._html(self.render("login.html", next=target, error=error), status)

    def page(self, handler: Handler) -> Handler:
        """``handler`` behind the token check, with storage failures answered as a page."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.token and not self._authorized(request):
                given = request.query.get("token")
                if given is None:
                    self.rejected.labels("unauthorized").inc()
                    return self._login(request, 401)
                if not session.token_matches(given, self.token):
                    self.rejected.labels("wrong_token").inc()
                    return self._login(request, 401, "That is not the collector's API token.")
                # Trade the token for a session and drop it from the address bar (and the history).
                response = web.Response(status=303, headers={"Location": _without_token(request)})
                self._set_session(response, request)
                return response
            try:
                return await handler(request)
            except PageError as exc:
                self.rejected.labels(exc.reason).inc()
                return self._html(self.render("error.html", title=exc.title, message=str(exc)), exc.status)
            except DATABASE_AWAY as exc:  # a retry will do, not a 500; the pipeline says it once in the log
                log.debug("page %s: %s", request.path, read_refusal(exc))
                page = self._html(self.render("error.html", title="Storage is unavailable",
                                              message="The collector cannot reach its database right now; "
                                                      "reload in a few seconds. Its /readyz says why."), 503)
                page.headers["Retry-After"] = str(READ_RETRY_AFTER_SECONDS)
                return page
            except Exception:
                log.exception("page %s failed", request.path)
                return self._html(self.render("error.html", title="Something went wrong",
                                              message="The collector could not read this page's data; "
                                                      "its log says why."), 500)

        return guarded

    # --- login --------------------------------------------------------------------------------

    async def login_form(self, request: web.Request) -> web.Response:
        return self._html(self.render("login.html", next=session.safe_next(request.query.get("next"), "/ui/"),
                                      error=None))

    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        given, target = form.get("token"), session.safe_next(str(form.get("next") or ""), links.PREFIX + "/")
        if self.token and not session.token_matches(given if isinstance(given, str) else None, self.token):
            self.rejected.labels("wrong_token").inc()
            return self._login(request, 401, "That is not the collector's API token.", next_path=target)
        response = web.Response(status=303, headers={"Location": target})
        if self.token:
            self._set_session(response, request)
        return response

    async def logout(self, request: web.Request) -> web.Response:
        response = web.Response(status=303, headers={"Location": links.PREFIX + "/login"})
        response.del_cookie(session.COOKIE, path=links.PREFIX + "/")
        return response

    # --- pages --------------------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(status=303, headers={"Location": links.PREFIX + "/"})

    async def overview(self, request: web.Request) -> web.Response:
        return self._html(await run_blocking(self.executor, self.overview_html))

    def overview_html(self) -> str:
        open_spikes = self.reader.spikes(state="open", limit=100)
        recent = [s for s in self.reader.spikes(limit=30) if s.state != "open"][:10]
        open_by_stream: dict[tuple[str, str], Spike] = {}
        for s in open_spikes:
            open_by_stream.setdefault((s.service, s.operation), s)
        streams = streams_now(self.reader.recent_windows(STREAM_LOOKBACK_NS))
        streams.sort(key=lambda s: ((s.window.service, s.window.operation) not in open_by_stream,
                                    s.window.service, s.window.operation))
        return self.render("overview.html", open_spikes=open_spikes, recent=recent, streams=streams,
                           open_by_stream=open_by_stream)

    async def spikes(self, request: web.Request) -> web.Response:
        q = request.query
        service, state = q.get("service") or None, q.get("state") or None
        error = None
        if state not in (None, "open", "resolved"):
            error, state = "state must be open or resolved", None
        since = until = None
        try:
            since = parse_time(q["since"]) if q.get("since") else None
            until = parse_time(q["until"]) if q.get("until") else None
        except ValueError as exc:
            error = f"Time range: {exc}"
        if error is None and since is not None and until is not None and since >= until:
            error = "The start of the range must be before its end."
        if error:
            self.rejected.labels("bad_request").inc()
        html = await run_blocking(self.executor, self.spikes_html, service, state, since, until, error, dict(q))
        return self._html(html, 400 if error else 200)

    def spikes_html(self, service: str | None, state: str | None, since: int | None, until: int | None,
                    error: str | None, form: dict[str, str]) -> str:
        found = [] if error else self.reader.spikes(service, since, until, state, SPIKE_LIST_LIMIT)
        services = sorted({name for name, _ in self.reader.services()} | ({service} if service else set()))
        now = time.time_ns()
        presets = [(label, str((now - seconds * NS) // NS)) for label, seconds in
                   (("last hour", 3600), ("last day", 86400), ("last week", 7 * 86400))]
        return self.render("spikes.html", spikes=found, services=services, form=form, error=error,
                           limit=SPIKE_LIST_LIMIT, presets=presets)

    async def spike(self, request: web.Request) -> web.Response:
        status, html = await run_blocking(self.executor, self.spike_html, request.match_info["spike_id"])
        return self._html(html, status)

    def spike_html(self, spike_id: str) -> tuple[int, str]:
        spike = self.reader.spike(spike_id)
        if spike is None:
            raise PageError(404, "not_found", "No such spike", f"There is no spike {spike_id!r}.")
        return 200, self.render("spike.html", **self.spike_context(spike))

    def spike_context(self, spike: Spike) -> dict[str, Any]:
        """Everything the spike page shows, read and computed."""
        r = self.reader
        start = spike.start_unix_nano
        history = r.latency(spike.service, spike.operation, start - BAND_LOOKBACK_NS,
                            max(spike.end_unix_nano or 0, start) + 24 * 3600 * NS, 100_000, spike.peer_service)
        end = spike.end_unix_nano
        if end is None:  # open: up to the newest window of the stream
            end = max((w.end_unix_nano for w in history), default=start + 10 * NS)
        duration = max(end - start, 1)
        # Before the spike: 15 minutes (or as long as the spike lasted), but not before the stream's first window.
        since = max(start - max(BEFORE_NS, duration), min((w.start_unix_nano for w in history), default=start))
        # After it: 5 minutes (or a third of its length), but not past the stream's newest window.
        newest = max((w.end_unix_nano for w in history), default=end)
        until = max(min(end + max(AFTER_NS, duration // 3), newest), end + 10 * NS)
        axis = charts.ChartRange(since_ns=since, until_ns=until, window_start_ns=start, window_end_ns=end)
        shown = [w for w in history if axis.since_ns <= w.start_unix_nano < axis.until_ns]
        before = [w for w in history if w.start_unix_nano < start]
        panels = [charts.latency_panel(shown, axis, spike.baseline_p99_ns / 1e6, before)]
        hosts = []
        for host in charts.hosts_of(spike.causes):
            series = r.host_series(host, charts.panel_metric_names(spike.causes, host), axis.since_ns,
                                   axis.until_ns, skip_attribute_keys=("cpu.logical_number",))
            host_panels = charts.host_panels(host, series, axis, spike.causes, first_id=len(panels))
            panels += host_panels
            hosts.append((host, host_panels))

        ids = [t.hex() for t in spike.exemplar_trace_ids]
        slow_spans = r.trace(spike.exemplar_trace_ids[0]) if ids else []
        normal_spans = r.trace(spike.exemplar_trace_ids[1]) if len(ids) > 1 else []
        scale = max(_duration(slow_spans), _duration(normal_spans), 1)
        slow = layout(slow_spans, scale_ns=scale) if slow_spans else None
        normal = layout(normal_spans, scale_ns=scale) if normal_spans else None
        if slow and normal:
            mark_grown(slow, normal)
        causes = [CauseView(rank, c, _evidence(c, slow, hosts)) for rank, c in enumerate(spike.causes, 1)]
        cause_marks: dict[str, list[int]] = {}
        for view in causes:
            for href, _ in view.evidence:
                if href.startswith("#s-"):
                    cause_marks.setdefault(href[3:], []).append(view.rank)  # the row's anchor
        profile = self._profile(spike)
        return {"spike": spike, "causes": causes, "hosts": hosts, "slow": slow, "normal": normal,
                "recurrence": self._recurrence(spike),
                "profile": profile, "profile_rows": PROFILE_ROWS,
                "slow_id": ids[0] if ids else None, "normal_id": ids[1] if len(ids) > 1 else None,
                "cause_marks": cause_marks, "collapse_over": COLLAPSE_OVER_ROWS, "most_rows": SPIKE_PAGE_ROWS,
                "end": end,
                "chart_data": {"range": [axis.since_ns / NS, axis.until_ns / NS],
                               "window": [start / NS, end / NS], "panels": panels,
                               "flames": _flames(profile)}}

    def _recurrence(self, spike: Spike) -> tuple[str, str] | None:
        """(the first spike's id, "3rd time in 25 min") for a return of a fault; None for a first spike."""
        if spike.recurrence_of is None:
            return None
        since = spike.start_unix_nano - (spike.first_start_unix_nano or spike.start_unix_nano)
        return spike.recurrence_of, recurrence(spike.occurrence, since)

    def _profile(self, spike: Spike) -> SpikeProfile:
        """The spike's profile diff; when as many diffs as the collector runs at once are running, the page is
        shown without it, saying why (the rest of the page is what an incident needs first)."""
        if not self.diff_gate.enter("page"):
            start, end, b_start, b_end = periods(spike, time.time_ns())
            return SpikeProfile(spike, (start, end), (b_start, b_end), (),
                                f"The profile diff was not computed: {self.diff_gate.busy()}; reload the page.")
        try:
            profile = spike_profile(self.reader, spike)
        finally:
            self.diff_gate.leave()
        if profile.partial is not None and self.diff_partial is not None:
            self.diff_partial.labels("page").inc()
        return profile

    async def trace_lookup(self, request: web.Request) -> web.Response:
        trace_id = (request.query.get("id") or "").strip()
        if not _TRACE_ID.match(trace_id):
            raise PageError(400, "bad_request", "Not a trace id", "A trace id is 32 hexadecimal digits.")
        return web.Response(status=303, headers={"Location": links.trace_page_path(trace_id)})

    async def trace(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        if not _TRACE_ID.match(trace_id):
            raise PageError(400, "bad_request", "Not a trace id", "A trace id is 32 hexadecimal digits.")
        expand = request.query.get("expand") or None
        return self._html(await run_blocking(self.executor, self.trace_html, trace_id.lower(), expand))

    def trace_html(self, trace_id: str, expand: str | None = None) -> str:
        spans = self.reader.trace(bytes.fromhex(trace_id))
        if not spans:
            raise PageError(404, "not_found", "No such trace",
                            f"Trace {trace_id} is not stored (never received, or removed by retention).")
        return self.render("trace.html", trace_id=trace_id, wf=layout(spans), expand=expand,
                           collapse_over=COLLAPSE_OVER_ROWS)


class PageError(Exception):
    """A page that cannot be shown: its status, the counter's reason, a title and a sentence."""

    def __init__(self, status: int, reason: str, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.title = status, reason, title


def _without_token(request: web.Request) -> str:
    url = request.rel_url
    rest = [(k, v) for k, v in url.query.items() if k != "token"]
    return str(url.with_query(rest or None))


def _flames(profile: SpikeProfile) -> list[dict[str, Any]]:
    """The merged call tree of each profiled process, drawn by the page's script (spikehound.js)."""
    return [g.diff.tree.to_json() for g in profile.groups]


def _duration(spans: Sequence[Span]) -> int:
    if not spans:
        return 0
    return max(s.end_unix_nano for s in spans) - min(s.start_unix_nano for s in spans)


def _evidence(c: Cause, slow: Waterfall | None, hosts: list[tuple[str, list[dict[str, Any]]]]
              ) -> list[tuple[str, str]]:
    """Links from a cause to what shows it: the span or hop in the slowest trace, the host's chart."""
    out: list[tuple[str, str]] = []
    if slow is not None and c.service:
        if c.kind == CauseKind.NETWORK and c.peer_service:
            row = slow.find_hop(c.peer_service, c.service, c.operation)
            label = f"hop {c.peer_service} → {c.service} in the slowest request"
        elif c.kind == CauseKind.SERVICE:
            row = slow.find(c.service)
            label = f"{c.service} in the slowest request"
        else:
            row = slow.find(c.service, c.operation) if c.operation else slow.find(c.service)
            label = f"span {c.operation or c.service} in the slowest request"
        if row is not None:
            out.append((f"#s-{row.anchor}", label))
    for index, (host, panels) in enumerate(hosts):
        if host != c.host:
            continue
        match = next((p for p in panels if c.resource and c.resource in p["metrics"]), None)
        if match is not None:
            out.insert(0, (f"#{match['id']}", f"{match['title']} on {host}"))
        elif panels:
            out.append((f"#host-{index}", f"charts of {host}"))
    return out

