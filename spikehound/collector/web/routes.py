"""Wires the web pages into the API's aiohttp application (``spikehound.collector.rest.app``), under ``/ui/``.

==============================  ==============================================
``/``                           redirects to the overview
``/ui/``                        overview: streams now, open spikes first
``/ui/spikes``                  spikes, filtered by service, state, time range
``/ui/spikes/{id}``             one spike: charts, causes, waterfalls
``/ui/traces/{trace_id}``       a trace's waterfall (``/ui/traces?id=`` finds one)
``/ui/login``, ``/ui/logout``   the session cookie (when the API has a token)
``/ui/static/...``              style sheet, script, vendored uPlot
==============================  ==============================================

The API's bearer-token guard lets these paths through (``is_web_path``): the
pages check the token themselves, accepting the session cookie as well
(``session.py``). Static files hold nothing secret and are served to anyone,
so the login page has its style sheet.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from spikehound.collector.rest.common import API_TOKEN, DIFF_GATE, EXECUTOR, READER, TELEMETRY
from spikehound.collector.web.links import PREFIX
from spikehound.collector.web.pages import WebPages

STATIC = Path(__file__).parent / "static"
# Scripts and styles from the collector only: even a value that escaped escaping could not run.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
WEB_PAGES = web.AppKey("web_pages", WebPages)


def is_web_path(path: str) -> bool:
    """Paths the pages answer (they check the token themselves)."""
    return path in ("/", PREFIX) or path.startswith(PREFIX + "/")


def add_routes(app: web.Application) -> None:
    """Add the pages' routes to ``app`` (the API's application): they read through its reader on its executor,
    check its token, and count refused requests in its telemetry's registry."""
    static = app.router.add_static(f"{PREFIX}/static", STATIC, name="web-static", append_version=True)
    urls = {p.relative_to(STATIC).as_posix(): str(static.url_for(filename=p.relative_to(STATIC).as_posix()))
            for p in STATIC.rglob("*") if p.is_file()}
    pages = WebPages(app[READER], app[EXECUTOR], app[API_TOKEN], app[TELEMETRY].registry, urls.__getitem__,
                     app.get(DIFF_GATE), app[TELEMETRY].profile_diffs_partial)
    app[WEB_PAGES] = pages
    r = app.router
    r.add_get("/", pages.root)
    r.add_get(PREFIX, pages.root)
    r.add_get(f"{PREFIX}/", pages.page(pages.overview))
    r.add_get(f"{PREFIX}/spikes", pages.page(pages.spikes))
    r.add_get(f"{PREFIX}/spikes/{{spike_id}}", pages.page(pages.spike))
    r.add_get(f"{PREFIX}/traces", pages.page(pages.trace_lookup))
    r.add_get(f"{PREFIX}/traces/{{trace_id}}", pages.page(pages.trace))
    r.add_get(f"{PREFIX}/login", pages.login_form)
    r.add_post(f"{PREFIX}/login", pages.login)
    r.add_post(f"{PREFIX}/logout", pages.logout)
    app.on_response_prepare.append(_security_headers)


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    if not is_web_path(request.path):
        return
    h = response.headers
    h.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    h.setdefault("X-Content-Type-Options", "nosniff")
    # A page URL never leaves for another site; same-origin requests keep theirs, so that browsers without
    # Sec-Fetch-Site still send a real Origin (not "null") with the login form (spikehound/collector/cross_site.py).
    h.setdefault("Referrer-Policy", "same-origin")
    h.setdefault("X-Frame-Options", "DENY")
    if request.path.startswith(f"{PREFIX}/static/"):
        # The URLs carry a hash of the file (?v=), so a new version is a new URL.
        h.setdefault("Cache-Control", "public, max-age=86400" if "v" in request.query else "no-cache")
    else:
        h.setdefault("Cache-Control", "no-store")  # pages show private data and may sit behind a token
