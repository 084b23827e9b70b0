"""What a web page on another site can make a browser send to the API, refused before any handler runs.

Three checks, in this order, on the API's port (REST API, Jaeger API, web pages, ``/metrics``):

* **Host** (DNS rebinding): a page on ``evil.example`` whose name the attacker re-points at 127.0.0.1 is
  same-origin with everything it then fetches, so the browser lets it read the answers; only the ``Host``
  header still says ``evil.example``. A Host must be an IP address (a browser sends one only when the user
  typed it, and an address cannot be rebound), ``localhost`` or a name under ``.localhost``, this machine's
  host name, the host of ``collector.api`` or of the links in alerts (``collector.public_url``), or one of
  ``collector.allowed_hosts`` (``"*"`` turns the check off). Otherwise: 421. ``/healthz`` and ``/readyz``
  are exempt: they reveal nothing, and probes send whatever Host their configuration names.
* **Origin** (cross-site request forgery), on methods other than GET, HEAD and OPTIONS: the scheme of Go's
  ``net/http.CrossOriginProtection``. ``Sec-Fetch-Site: same-origin`` or ``none`` passes, any other value
  is refused; without it (an old browser) an ``Origin`` must name this Host or the origin of
  ``collector.public_url``; neither header means the sender is no browser (curl, scripts) and passes.
  Otherwise: 403.
* **Content type**, on the same methods under ``/api/``: a body must be ``application/json`` (415), and none
  may exceed the API's body limit (413, before it is read). A page can send text/plain, a form or a blob
  to any site without asking the browser's leave (no CORS preflight); it cannot send JSON. The login form
  under ``/ui/`` is a form, so the Origin check alone guards it.

>>> site = Site(frozenset({"spikehound.example.com", "proxy.internal"}))
>>> [site.allows(h) for h in ("127.0.0.1:8470", "[::1]:8470", "localhost:8470", "LINKS.localhost",
...                            "spikehound.example.com", "proxy.internal:443", "10.2.3.4", None)]
[True, True, True, True, True, True, True, True]
>>> site.allows("evil.example:8470"), site.allows("127.0.0.1.evil.example")
(False, False)
>>> same_origin("POST", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1:8470", "")
False
>>> same_origin("POST", {"Origin": "http://127.0.0.1:8470"}, "127.0.0.1:8470", ""), same_origin("POST", {}, "h", "")
(True, True)
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from prometheus_client import Counter

from spikehound.config import CollectorConfig

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Probes (systemd, Kubernetes, load balancers) call these by whatever name or address they were given.
HOST_EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})
JSON = "application/json"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _host_name(authority: str) -> str:
    """The host of a ``Host`` header or URL authority, lowercase, without port, brackets or a final dot."""
    text = authority.strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    if text.count(":") == 1:
        text = text.partition(":")[0]
    return text.rstrip(".")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Site:
    """Who this collector is: the host names it answers to (IP addresses and ``localhost`` always) and the
    origin of ``collector.public_url``."""

    names: frozenset[str] = frozenset()
    public_origin: str = ""
    any_host: bool = False

    @classmethod
    def from_config(cls, c: CollectorConfig, links: str = "") -> Site:
        """From the ``[collector]`` settings; ``links`` is where alert links point (their host is answered)."""
        names = {socket.gethostname().lower()} | {_host_name(a) for a in c.allowed_hosts}
        if c.api.host not in WILDCARD_HOSTS:
            names.add(_host_name(c.api.host))
        for url in (c.public_url, links):
            names.add((urlsplit(url).hostname or "").rstrip("."))
        return cls(frozenset(names - {""}), origin_of(c.public_url), "*" in c.allowed_hosts)

    def allows(self, host_header: str | None) -> bool:
        """Whether a request with this ``Host`` header may be answered."""
        if host_header is None or self.any_host:  # no Host at all: HTTP/1.0 from a script, never a browser
            return True
        host = _host_name(host_header)
        return _is_address(host) or host == "localhost" or host.endswith(".localhost") or host in self.names


def same_origin(method: str, headers: Mapping[str, str], host_header: str | None, public_origin: str) -> bool:
    """Whether a request may change state: not sent by a browser on behalf of another site."""
    if method in SAFE_METHODS:
        return True
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site in ("same-origin", "none")
    origin = headers.get("Origin")
    if origin is None:
        return True
    if public_origin and origin.rstrip("/").lower() == public_origin:
        return True
    return host_header is not None and urlsplit(origin).netloc.lower() == host_header.strip().lower()


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of a URL, lowercase, as a browser writes it in ``Origin``.

    >>> origin_of("https://Spikehound.example.com/ui/"), origin_of("")
    ('https://spikehound.example.com', '')
    """
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else ""


def _refuse(status: int, message: str) -> web.Response:
    return web.Response(body=orjson.dumps({"error": message}), status=status, content_type=JSON)


def cross_site_middleware(site: Site, max_body_bytes: int,
                          refused: Counter) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The aiohttp middleware of the three checks; ``refused`` counts refusals by reason."""

    @web.middleware
    async def cross_site(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if request.path not in HOST_EXEMPT_PATHS and not site.allows(host):
            refused.labels("host").inc()
            return _refuse(421, f"Host {(host or '')[:100]!r} is not a name of this collector, so the request "
                                "may come from a web page through DNS rebinding; if the name is yours, add it to "
                                "collector.allowed_hosts")
        if request.method in SAFE_METHODS:
            return await handler(request)
        if not same_origin(request.method, request.headers, host, site.public_origin):
            refused.labels("cross_origin").inc()
            origin = request.headers.get("Sec-Fetch-Site") or request.headers.get("Origin") or ""
            return _refuse(403, f"cross-origin request refused ({origin[:100]!r} is not this collector): "
                                "state-changing requests must come from the collector's own pages or from "
                                "a client that is not a browser")
        if request.path.startswith("/api/"):
            if request.content_length is not None and request.content_length > max_body_bytes:
                refused.labels("too_large").inc()
                return _refuse(413, f"request body of {request.content_length} bytes exceeds {max_body_bytes}")
            if (request.body_exists or "Content-Type" in request.headers) and request.content_type != JSON:
                refused.labels("media_type").inc()
                given = request.headers.get("Content-Type", "")
                return _refuse(415, f"Content-Type must be {JSON}, got {given[:100]!r}"
                               if given else f"a request body needs Content-Type: {JSON}")
        return await handler(request)

    return cross_site
