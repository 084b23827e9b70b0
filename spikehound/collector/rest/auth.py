"""The bearer-token check of the REST API, the web pages and the OTLP receivers.

>>> bearer_ok(None, ""), bearer_ok("Bearer s3cret", "s3cret"), bearer_ok("Bearer guess", "s3cret")
(True, True, False)
"""

from __future__ import annotations

import hmac


def bearer_ok(header: str | None, token: str) -> bool:
    """True when no token is configured or the Authorization header carries it."""
    if not token:
        return True
    # Constant time: the comparison must not tell a guesser how much of the token it got right.
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())
