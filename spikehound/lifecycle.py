"""The lifecycle every daemon follows: start (ready when it returns), run, stop on a signal.

``serve`` installs SIGTERM/SIGINT handlers, starts the service, waits for a
signal or for the service to fail, then stops it within a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from aiohttp import web

from spikehound.config import HostPort

log = logging.getLogger("spikehound")


class Service(Protocol):
    """A daemon: ``start`` returns once it accepts work; ``stop`` drains and flushes."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def failed(self) -> asyncio.Future[None]:
        """Completes (with the error) if a background task of the service dies."""
        ...


async def serve(service: Service, stop_timeout: float = 30.0) -> int:
    """Run ``service`` until SIGTERM/SIGINT; return the process exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    log.info("%s ready", service.name)
    failed = service.failed()
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stop_wait, failed], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if failed.done():
        log.critical("%s failed: %s", service.name, failed.exception() or "background task ended")
        status = 1
    else:
        log.info("%s stopping", service.name)
    stop_wait.cancel()
    try:
        await asyncio.wait_for(service.stop(), stop_timeout)
    except TimeoutError:
        log.error("%s did not stop within %.0f s", service.name, stop_timeout)
        status = status or 1
    log.info("%s stopped", service.name)
    return status


async def start_http(app: web.Application, listen: HostPort, what: str) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``listen``; return the runner (``cleanup()`` stops it) and the bound port.

    Raises OSError with one readable line when the address cannot be bound.
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, listen.host, listen.port, reuse_address=True).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen for {what} on {listen}: {exc.strerror}") from None
    port = runner.addresses[0][1]
    log.info("%s listening on %s", what, HostPort(listen.host, port))
    return runner, port
