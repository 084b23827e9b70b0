"""The collector daemon: wires storage, the ingest pipeline, the receivers and the API.

>>> from spikehound.config import load
>>> c = Collector(load(env={}, flags={"storage.url": "sqlite:///:memory:"}))
>>> c.name
'collector'
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import ssl
import sys
import time
from collections.abc import Callable

import grpc
from aiohttp import web

from collector.alerts.alerting import Alerting, public_url
from collector.alerts.api import add_alert_routes
from collector.api import make_api
from collector.cross_site import Site
from collector.exported_metrics import install_exported_metrics
from collector.ingest import Ingest
from collector.ingest_queue import IngestQueue
from collector.jaeger_api import add_jaeger_api
from collector.otlp_grpc import start_grpc
from collector.otlp_http import HttpReceiver
from collector.pipeline import IngestPipeline
from collector.telemetry import CollectorTelemetry
from collector.tls import ServerTls, describe
from spikehound.config import Config, check_otlp_exposure, redact_url
from spikehound.lifecycle import start_http
from spikehound.live_config import ALERT_KEYS, COLLECTOR_LIVE_KEYS, RETENTION_KEYS, apply_live
from storage.engine import make_engine
from storage.migrate import upgrade
from storage.reader import Reader
from storage.writer import Writer

log = logging.getLogger("spikehound.collector")

GRPC_GRACE_SECONDS = 10.0
SWITCH_INTERVAL_SECONDS = 0.0005
GC_THRESHOLDS = (50_000, 50, 100)


class Collector:
    """One collector process. Ports given as 0 are chosen by the OS; see ``*_port`` after start."""

    name = "collector"

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock  # alerting's wall clock (timers, silences, outbox); tests step it instead of sleeping
        self.telemetry = CollectorTelemetry()
        self.grpc_port = self.http_port = self.api_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._pipeline: IngestPipeline | None = None
        self._pipeline_task: asyncio.Task[None] | None = None
        self._failed: asyncio.Future[None] | None = None
        self._listening = False
        self._reload_tasks: set[asyncio.Task[object]] = set()
        self.alerting: Alerting | None = None
        self._tls: ServerTls | None = None

    async def start(self) -> None:
        cfg, c = self.cfg, self.cfg.collector
        check_otlp_exposure(cfg)  # ConfigError: exit status 2, before anything is opened
        self._tls = tls = ServerTls.from_config(c)
        # The writer thread gives up the GIL inside every SQLite statement and needs it back to bind the next
        # one; with the default 5 ms switch interval it waits behind the receivers' decoding (a GIL convoy).
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
        # The detectors hold hundreds of thousands of small records (recent traces, open windows); with the
        # default thresholds the cyclic collector walks all of them every few thousand allocations, which
        # cost a third of ingest. Collect young objects less often, and leave start-up's objects alone.
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        url = cfg.database_url
        log.info("storage %s", redact_url(url))
        engine = make_engine(url, sqlite_synchronous=cfg.storage.sqlite_synchronous)
        revision = await loop.run_in_executor(None, upgrade, engine)
        log.info("schema at revision %s", revision)
        self.engine = engine
        queue = IngestQueue(c.queue_capacity)
        self.telemetry.queue_capacity.set(c.queue_capacity)
        self._pipeline = IngestPipeline(cfg, queue, Writer(engine), self.telemetry)
        await self._pipeline.restore()
        install_exported_metrics(cfg, self._pipeline, self.telemetry, Reader(engine))
        self.alerting = Alerting(cfg, engine, self.telemetry.registry, run_on_writer=self._pipeline.on_writer,
                                 clock=self.clock)
        await self.alerting.restore(Reader(engine))
        self._pipeline.spike_listeners.append(self.alerting.observe)
        self._pipeline_task = asyncio.create_task(self._pipeline.run(), name="ingest-pipeline")
        self._pipeline_task.add_done_callback(self._watch)
        ingest = Ingest.configured(queue, self.telemetry, c)
        if c.allow_unauthenticated_otlp and not (c.otlp_token or c.tls_client_ca_file) and not (
                c.otlp_grpc.is_loopback and c.otlp_http.is_loopback):
            log.warning("OTLP receivers listen beyond loopback without collector.otlp_token or client certificates "
                        "(collector.allow_unauthenticated_otlp = true): any host that reaches them can send data")
        try:
            site = Site.from_config(c, links=self._links(c.api.port))  # the hosts and origin it answers to
            api = make_api(Reader(engine), self.telemetry, self._ready, c.api_token, site)
            add_jaeger_api(api)
            add_alert_routes(api, self.alerting)
            runner, self.api_port = await start_http(
                api, c.api, "API" + describe(tls, c.api_tls_client_ca_file),
                ssl_context=tls.http_context(c.api_tls_client_ca_file) if tls else None)
            self._runners.append(runner)
            self._grpc, self.grpc_port = await start_grpc(
                ingest, c.otlp_grpc, c.otlp_token, c.max_request_bytes,
                credentials=tls.grpc_credentials() if tls else None, secured=describe(tls, c.tls_client_ca_file))
            http = HttpReceiver(ingest, c.otlp_token, c.max_request_bytes).app()
            runner, self.http_port = await start_http(
                http, c.otlp_http, "OTLP/HTTP" + describe(tls, c.tls_client_ca_file),
                ssl_context=tls.http_context(c.tls_client_ca_file) if tls else None)
            self._runners.append(runner)
        except BaseException:
            await self.stop()
            raise
        self.alerting.start(self._links(self.api_port))
        self._listening = True

    def _links(self, api_port: int) -> str:
        """Where links in alerts point; https:// when the API serves TLS and no collector.public_url says otherwise."""
        url = public_url(self.cfg, api_port)
        if self._tls is not None and not self.cfg.collector.public_url:
            return "https://" + url.removeprefix("http://")
        return url

    def _watch(self, task: asyncio.Task[None]) -> None:
        if self._failed is None or self._failed.done():
            return
        if task.cancelled():
            self._failed.set_exception(RuntimeError("ingest pipeline cancelled"))
        elif task.exception() is not None:
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]
        elif self._listening:
            self._failed.set_exception(RuntimeError("ingest pipeline ended"))

    def failed(self) -> asyncio.Future[None]:
        assert self._failed is not None, "start() first"
        return self._failed

    async def _ready(self) -> tuple[bool, str]:
        if not self._listening:
            return False, "starting"
        if self._pipeline is None or not self._pipeline.healthy:
            return False, "storage writes are failing"
        return True, "ok"

    async def reload(self, cfg: Config) -> None:
        """SIGHUP: log settings, retention caps and alert receivers and routes change at once (changed caps run
        retention now), and a renewed TLS certificate and key are re-read; any other change waits for a restart."""
        change = apply_live(self.cfg, cfg, COLLECTOR_LIVE_KEYS, ignore_sections={"agent"})
        change.report(log)
        if self._tls is not None:  # a renewed certificate, at the same paths
            try:
                if self._tls.reload():
                    log.info("TLS certificate re-read from %s; new connections get it", self._tls.cert_file)
            except (OSError, ssl.SSLError) as exc:
                log.error("TLS certificate not re-read, the running one stays: %s", exc)
        if self.alerting is not None and ALERT_KEYS.intersection(change.applied):
            self.alerting.reload(self.cfg)
        if self._pipeline is not None and RETENTION_KEYS.intersection(change.applied):
            task = asyncio.create_task(self._pipeline.run_retention(), name="retention-after-reload")
            self._reload_tasks.add(task)
            task.add_done_callback(self._reload_tasks.discard)

    async def stop(self) -> None:
        """Stop taking data, commit everything accepted, then close."""
        self._listening = False
        for task in list(self._reload_tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._grpc is not None:
            await self._grpc.stop(GRPC_GRACE_SECONDS)  # in-flight exports still get their commit
        for runner in reversed(self._runners[1:]):  # receivers first, the API last
            await runner.cleanup()
        if self._pipeline is not None and self._pipeline_task is not None:
            self._pipeline.stop()
            if not self._pipeline_task.done():
                await self._pipeline_task
            if self.alerting is not None:  # after the last spikes were written, before the writer thread ends
                await self.alerting.stop()
            self._pipeline.close()
        if self._runners:
            await self._runners[0].cleanup()
        self._runners.clear()
        if self._failed is not None and not self._failed.done():
            self._failed.cancel()
        if getattr(self, "engine", None) is not None:
            self.engine.dispose()
