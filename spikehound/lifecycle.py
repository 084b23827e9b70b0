"""The lifecycle every daemon follows: start (ready when it returns), run, reload on SIGHUP, stop on SIGTERM.

``serve`` installs the signal handlers, starts the service, tells systemd (``READY=1`` once ``start``
returned, that is once the receivers accept connections; ``WATCHDOG=1`` pings from this event loop, so that
a hung loop stops them; ``STOPPING=1`` on SIGTERM), then waits for a signal or for the service to fail,
and stops it within a deadline. Without systemd the notifications are no-ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from spikehound import logs
from spikehound.config import Config, HostPort
from spikehound.systemd_notify import Notifier

log = logging.getLogger("spikehound")


class Service(Protocol):
    """A daemon: ``start`` returns once it accepts work; ``stop`` drains and flushes."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def reload(self, cfg: Config) -> None:
        """Apply what a re-read configuration may change without dropping data (SIGHUP)."""
        ...

    def failed(self) -> asyncio.Future[None]:
        """Completes (with the error) if a background task of the service dies."""
        ...


async def serve(service: Service, stop_timeout: float = 30.0, reload_config: Callable[[], Config] | None = None,
                notifier: Notifier | None = None) -> int:
    """Run ``service`` until SIGTERM/SIGINT; return the process exit status.

    ``reload_config`` re-reads the configuration layers for SIGHUP; without it SIGHUP is logged and ignored.
    """
    loop = asyncio.get_running_loop()
    notifier = notifier or Notifier()
    stop, reload = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload.set)
    watchdog = asyncio.create_task(_watchdog(notifier), name="systemd-watchdog") \
        if notifier.watchdog_interval else None
    try:
        notifier.status(f"{service.name} starting")
        try:
            await service.start()
        except BaseException as exc:
            notifier.status(f"{service.name} failed to start: {exc}")
            raise
        log.info("%s ready", service.name)
        notifier.ready(f"{service.name} running")
        status = await _run(service, stop, reload, reload_config, notifier)
        notifier.stopping(f"{service.name} stopping: draining and flushing")
        try:
            await asyncio.wait_for(service.stop(), stop_timeout)
        except TimeoutError:
            log.error("%s did not stop within %.0f s", service.name, stop_timeout)
            status = status or 1
        log.info("%s stopped", service.name)
        return status
    finally:
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        notifier.close()


async def _run(service: Service, stop: asyncio.Event, reload: asyncio.Event,
               reload_config: Callable[[], Config] | None, notifier: Notifier) -> int:
    """Wait for a stop signal or a failure, reloading on every SIGHUP meanwhile; the exit status."""
    failed = service.failed()
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        while True:
            reload_wait = asyncio.ensure_future(reload.wait())
            await asyncio.wait([stop_wait, failed, reload_wait], return_when=asyncio.FIRST_COMPLETED)
            reload_wait.cancel()
            if failed.done():
                log.critical("%s failed: %s", service.name,
                             (failed.exception() if not failed.cancelled() else None) or "background task ended")
                return 1
            if stop.is_set():
                log.info("%s stopping", service.name)
                return 0
            reload.clear()
            await _reload(service, reload_config, notifier)
    finally:
        stop_wait.cancel()


async def _reload(service: Service, reload_config: Callable[[], Config] | None, notifier: Notifier) -> None:
    if reload_config is None:
        log.info("SIGHUP: %s has nothing to reload", service.name)
        return
    log.info("SIGHUP: %s reloading its configuration", service.name)
    notifier.reloading(f"{service.name} reloading")
    try:
        cfg = reload_config()
        logs.configure(cfg)
        await service.reload(cfg)
    except Exception as exc:  # a bad file must never take the running daemon down
        log.error("reload failed; the running configuration stays in effect: %s", exc)
        notifier.ready(f"{service.name} running; last reload failed: {exc}")
        return
    notifier.ready(f"{service.name} running; configuration reloaded")


async def _watchdog(notifier: Notifier) -> None:
    """Ping from the event loop itself: when the loop hangs the pings stop, and systemd restarts the service."""
    assert notifier.watchdog_interval is not None
    while True:
        notifier.watchdog()
        await asyncio.sleep(notifier.watchdog_interval)


async def start_http(app: web.Application, listen: HostPort, what: str,
                     ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``listen`` (over TLS with ``ssl_context``); return the runner (``cleanup()`` stops it)
    and the bound port.

    Raises OSError with one readable line when the address cannot be bound.
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, listen.host, listen.port, reuse_address=True, ssl_context=ssl_context).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen for {what} on {listen}: {exc.strerror}") from None
    port = runner.addresses[0][1]
    log.info("%s listening on %s", what, HostPort(listen.host, port))
    return runner, port
