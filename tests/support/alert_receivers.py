"""Real HTTP receivers for alert tests: an aiohttp server on loopback, on its own event loop thread.

It records every request as it arrived and answers as the test says (a status
per request, e.g. 503 twice then 200). Like a careful production receiver, it
deduplicates on ``Idempotency-Key``: ``events`` holds each key's body once,
however often it was retried. With a signing secret it checks
``X-Spikehound-Signature`` as a receiver would, with ``hmac`` from the
standard library (not spikehound's code), and answers 401 when it does not
match.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from harness.daemons import free_port
from harness.waiting import eventually


def signature_ok(secret: bytes, headers: dict[str, str], body: bytes, tolerance: float = 300) -> bool:
    """A receiver's check of X-Spikehound-Signature (t=<unix seconds>,v1=<hex HMAC-SHA256 of "t." + body>)."""
    parts = dict(p.split("=", 1) for p in headers.get("X-Spikehound-Signature", "").split(",") if "=" in p)
    if "t" not in parts or "v1" not in parts or abs(time.time() - int(parts["t"])) > tolerance:
        return False
    expected = hmac.new(secret, parts["t"].encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts["v1"])


@dataclass
class Received:
    at: float  # wall clock when it arrived
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def key(self) -> str:
        return self.headers.get("Idempotency-Key", "")


@dataclass
class HookReceiver:
    """``with HookReceiver() as hook:`` ... ``hook.url``; set ``answers`` to script the replies."""

    secret: bytes = b""
    answers: list[int] = field(default_factory=list)  # statuses to answer first, then 200
    retry_after: str | None = None  # sent with 429/503 answers
    port: int = field(default_factory=free_port)
    requests: list[Received] = field(default_factory=list)
    events: dict[str, Received] = field(default_factory=dict)  # idempotency key -> first accepted request
    on_request: Callable[[Received], None] | None = None
    # True: the receiver does the work, then fails to answer (a lost answer); the sender must retry and
    # the idempotency key keeps the work from being done twice.
    work_then_fail: bool = False

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-receiver", daemon=True)
        self._runner: web.AppRunner | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def __enter__(self) -> HookReceiver:
        self._thread.start()
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def up(self) -> None:
        """Start listening (again, on the same port)."""
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def down(self) -> None:
        """Stop listening: connections are refused, as from a receiver that is away."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def signature_ok(self, headers: dict[str, str], body: bytes) -> bool:
        return signature_ok(self.secret, headers, body)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        with self._lock:
            status = self.answers.pop(0) if self.answers else 200
            if status == 200 and self.secret and not self.signature_ok(headers, body):
                status = 401
            got = Received(time.time(), headers, body, status)
            self.requests.append(got)
            if (status == 200 or (self.work_then_fail and status != 401)) and got.key not in self.events:
                self.events[got.key] = got
        if self.on_request is not None:
            self.on_request(got)
        extra = {"Retry-After": self.retry_after} if self.retry_after and status in (429, 503) else {}
        return web.Response(status=status, text="ok" if status == 200 else "not now", headers=extra)

    def wait_events(self, n: int, timeout: float = 60) -> list[Received]:
        """The first ``n`` distinct events, waiting for them to arrive."""
        def arrived() -> bool:
            assert len(self.events) >= n, f"{len(self.events)} of {n} alerts arrived; requests: " \
                                          f"{[(r.status, r.key[:8]) for r in self.requests]}"
            return True

        eventually(arrived, f"{n} alerts", timeout, every=0.05)
        return list(self.events.values())[:n]
