"""A webhook receiver on loopback for benchmarks: aiohttp on its own thread, keeping every POST and when it came.

>>> with WebhookReceiver() as hook:
...     _ = requests.post(hook.url, json={"status": "firing"}, timeout=5)
...     hook.bodies()
[{'status': 'firing'}]
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import requests  # noqa: F401  (the doctest's)
from aiohttp import web


class WebhookReceiver:
    """Answers every POST 200 and keeps ``(arrival time, body)`` in ``arrivals``."""

    def __init__(self) -> None:
        # Bound here, not picked by free_port(): receivers started at once in parallel runs must not race for one.
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        self.arrivals: list[tuple[float, bytes]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="webhook", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def bodies(self) -> list[dict[str, Any]]:
        """Every body received, as JSON."""
        return [json.loads(body) for _, body in list(self.arrivals)]

    async def _handle(self, request: web.Request) -> web.Response:
        self.arrivals.append((time.time(), await request.read()))
        return web.Response(text="ok")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, self._socket).start()

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
