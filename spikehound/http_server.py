"""An aiohttp application served on an address, as a component (see ``spikehound.components``)."""

from __future__ import annotations

import ssl

from aiohttp import web

from spikehound.config import HostPort
from spikehound.lifecycle import start_http


class HttpServer:
    """Serves ``app`` on ``listen`` from ``start`` until ``stop``; ``port`` is the bound port once started."""

    def __init__(self, app: web.Application, listen: HostPort, what: str,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.name = what
        self.app = app
        self.listen = listen
        self.ssl_context = ssl_context
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; OSError with one readable line when the address cannot be bound."""
        self._runner, self.port = await start_http(self.app, self.listen, self.name, ssl_context=self.ssl_context)

    async def stop(self) -> None:
        """Stop listening and let the requests in progress finish."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
