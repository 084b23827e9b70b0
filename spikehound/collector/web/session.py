"""How a browser proves it knows the API token: a signed session cookie.

A browser cannot send ``Authorization: Bearer`` when someone clicks a link in an
alert, so when ``collector.api_token`` is set the pages accept three things:

* the header itself (curl, scripts);
* a session cookie, ``spikehound_session``, set after the token was given once,
  through the login form (``POST /ui/login``) or a ``?token=`` query parameter on
  any page (answered with a redirect to the same URL without it, so the token
  does not stay in the address bar or the history);
* nothing else: without either, a page answers 401 with the login form.

The cookie holds its issue time and an HMAC-SHA256 of it keyed by the token, never
the token: it opens the pages, not the API, it expires after ``SESSION_SECONDS``,
and changing the token ends every session. It is ``HttpOnly`` (page scripts cannot
read it), ``SameSite=Lax`` (sent when a link from Slack or a mail is followed, not
with requests other sites make in the background) and ``Secure`` when the request
came over HTTPS.

>>> cookie = issue("s3cret", now=1_000)
>>> valid(cookie, "s3cret", now=1_060), valid(cookie, "other", now=1_060)
(True, False)
>>> valid(cookie, "s3cret", now=1_000 + SESSION_SECONDS + 1), valid("²." + cookie.partition(".")[2], "s3cret", 1_060)
(False, False)
"""

from __future__ import annotations

import hashlib
import hmac

COOKIE = "spikehound_session"
SESSION_SECONDS = 12 * 3600
_CONTEXT = b"spikehound web session v1:"


def _mac(token: str, issued: int) -> str:
    return hmac.new(token.encode(), _CONTEXT + str(issued).encode(), hashlib.sha256).hexdigest()


def issue(token: str, now: float) -> str:
    """A new session cookie value."""
    issued = int(now)
    return f"{issued}.{_mac(token, issued)}"


def valid(cookie: str | None, token: str, now: float) -> bool:
    """True for a cookie this token issued within the last SESSION_SECONDS."""
    if not cookie or "." not in cookie:
        return False
    issued_text, _, mac = cookie.partition(".")
    # isascii(): isdigit() alone takes '²', which int() refuses.
    if not issued_text.isascii() or not issued_text.isdigit() or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    if not issued - 60 <= now <= issued + SESSION_SECONDS:  # a minute of clock skew between restarts
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, issued).encode())


def token_matches(given: str | None, token: str) -> bool:
    """Constant-time comparison of a token typed or passed by the user."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def safe_next(target: str | None, default: str) -> str:
    """Where to go after logging in: only a path of the pages, never another site (``//evil``, ``/\\evil``).

    >>> safe_next("/ui/spikes/abc?state=open", "/ui/"), safe_next("//evil.example/ui/", "/ui/")
    ('/ui/spikes/abc?state=open', '/ui/')
    """
    if not target or not target.startswith("/ui/") or "\\" in target or any(ord(c) < 32 for c in target):
        return default
    return target
