"""A gRPC server as a component (see ``spikehound.components``): the receivers of both daemons."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc


class GrpcServer:
    """Started by ``serve`` (which binds, starts and returns the server and its port); ``stop`` gives the calls
    in flight ``grace_seconds`` to finish."""

    def __init__(self, name: str, serve: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]],
                 grace_seconds: float) -> None:
        self.name = name
        self.serve = serve
        self.grace_seconds = grace_seconds
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self._server, self.port = await self.serve()

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(self.grace_seconds)
