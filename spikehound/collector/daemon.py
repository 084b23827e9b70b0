"""The collector daemon: wires storage, the ingest pipeline, detection, retention, the receivers and the API.

>>> from spikehound.config import load
>>> c = Collector(load(env={}, flags={"storage.url": "sqlite:///:memory:"}))
>>> c.name
'collector'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import ssl
import sys
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from spikehound.collector.alerts.alerting import Alerting, public_url
from spikehound.collector.cluster.leader import DetectionLeader
from spikehound.collector.cluster.member import ClusterMember, default_member_name
from spikehound.collector.commit_hooks import CommitHooks
from spikehound.collector.cross_site import Site
from spikehound.collector.detection_driver import DetectionDriver, DriverSettings
from spikehound.collector.detection_process import ProcessDetection
from spikehound.collector.exported_metrics import install_exported_metrics
from spikehound.collector.ingest import Ingest
from spikehound.collector.ingest_queue import IngestQueue
from spikehound.collector.local_detection import LocalDetection
from spikehound.collector.memory_metrics import ProcessMemoryMetrics
from spikehound.collector.otlp_grpc import start_grpc
from spikehound.collector.otlp_http import HttpReceiver
from spikehound.collector.pipeline import CommitPath, IngestPipeline, PipelineParts, PipelineSettings
from spikehound.collector.profiles_ingest import ProfileIngest
from spikehound.collector.rest.app import build_app
from spikehound.collector.retention import RetentionRunner, RetentionSchedule
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.tls import ServerTls, describe
from spikehound.collector.writer_thread import WriterThread
from spikehound.components import ComponentStack, Stage
from spikehound.config import Config, check_otlp_exposure, redact_url
from spikehound.grpc_server import GrpcServer
from spikehound.http_server import HttpServer
from spikehound.live_config import ALERT_KEYS, COLLECTOR_LIVE_KEYS, RETENTION_KEYS, apply_live
from spikehound.storage.engine import in_memory, make_engine, unavailable
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.retention import Retention
from spikehound.storage.writer import Writer

log = logging.getLogger("spikehound.collector")

GRPC_GRACE_SECONDS = 10.0
SWITCH_INTERVAL_SECONDS = 0.0005
GC_THRESHOLDS = (50_000, 50, 100)


def single_collector_pipeline(cfg: Config, writer: Writer, queue: IngestQueue, writer_thread: WriterThread,
                              telemetry: CollectorTelemetry, health: StorageHealth, *,
                              clock: Callable[[], float] = time.monotonic
                              ) -> tuple[IngestPipeline, LocalDetection | ProcessDetection]:
    """The pipeline of a collector that detects over its own commits, with its detection and retention.

    The detectors get a process of their own (``detection.own_process``) unless the database lives in this
    process's memory, where no other process could read it back.
    """
    engine = writer.engine
    settings = DriverSettings.from_config(cfg)
    detection: LocalDetection | ProcessDetection
    if cfg.detection.own_process and not in_memory(engine):
        url = engine.url.render_as_string(hide_password=False)  # the writer's database, whatever cfg names
        detection = ProcessDetection(settings, url, cfg.storage.sqlite_synchronous, engine,
                                     writer_thread, health, telemetry, clock=clock)
    else:
        driver = DetectionDriver(settings, telemetry, advance_while_held=False, clock=clock)
        detection = LocalDetection(driver, engine, writer_thread, health, telemetry, clock=clock)
    retention = RetentionSchedule(RetentionRunner(Retention(engine), telemetry, writer_thread), cfg, clock=clock)
    parts = PipelineParts(CommitHooks(on_failure=detection.failures.commit_hook_failed), detection, retention)
    pipeline = IngestPipeline(PipelineSettings.from_config(cfg.collector), queue,
                              CommitPath(writer, writer_thread, health, telemetry), parts, clock=clock)
    return pipeline, detection


class Collector:
    """One collector process. Ports given as 0 are chosen by the OS; see ``*_port`` after start."""

    name = "collector"

    def __init__(self, cfg: Config, *, alerting_clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        # Alerting's wall clock (timers, silences, outbox); tests step it instead of sleeping.
        self.alerting_clock = alerting_clock
        self.telemetry = CollectorTelemetry()
        # Started in order, stopped in reverse (see start).
        self.components = ComponentStack()
        self._api: HttpServer | None = None
        self._grpc: GrpcServer | None = None
        self._http: HttpServer | None = None
        self.pipeline: IngestPipeline | None = None
        self.detection: LocalDetection | ProcessDetection | None = None  # a single collector's; None in a cluster
        self.leader: DetectionLeader | None = None  # in a cluster (cluster.enabled): this member's campaign to lead
        self.retention: RetentionSchedule | None = None
        self.profiles: ProfileIngest | None = None  # the receivers' profiles path (tests reach its limits)
        self._listening = False
        self._reload_tasks: set[asyncio.Task[object]] = set()
        self.alerting: Alerting | None = None
        self._tls: ServerTls | None = None

    @property
    def api_port(self) -> int:
        return self._api.port if self._api is not None else 0

    @property
    def grpc_port(self) -> int:
        return self._grpc.port if self._grpc is not None else 0

    @property
    def http_port(self) -> int:
        return self._http.port if self._http is not None else 0

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
        url = cfg.database_url
        log.info("storage %s", redact_url(url))
        self.engine = engine = make_engine(url, sqlite_synchronous=cfg.storage.sqlite_synchronous)
        try:
            await self._start_on(engine, tls)
        except BaseException:
            engine.dispose()  # whatever failed, the pool's connections (and a SQLite file's lock) go with it
            raise
        self._listening = True

    async def _start_on(self, engine: Engine, tls: ServerTls | None) -> None:
        """Build the components on ``engine`` and start them in order (see the comment at the stack)."""
        cfg, c = self.cfg, self.cfg.collector
        reader = Reader(engine)
        writer_thread = WriterThread()
        queue = IngestQueue(c.queue_capacity)
        self.telemetry.queue_capacity.set(c.queue_capacity)
        health = StorageHealth(self.telemetry)  # told by the pipeline's commits; asked by receivers and /readyz
        writer = Writer(engine)
        self.alerting = alerting = Alerting(cfg, engine, self.telemetry.registry, writer_thread,
                                            clock=self.alerting_clock, health=health)
        member: ClusterMember | None = None
        if cfg.cluster.enabled:
            # Each member stores its share and stamps its feed; the leader, whichever member holds the lock,
            # detects over every member's feed and alone routes alerts and runs retention.
            name = cfg.cluster.member or default_member_name(c.otlp_grpc.port)
            member = ClusterMember(cfg.cluster, engine, name, lambda: self._links(self.api_port), health)
            self.leader = leader = DetectionLeader(cfg, engine, name, self.telemetry, alerting,
                                                   lambda: self._links(self.api_port))
            self.retention = RetentionSchedule(RetentionRunner(Retention(engine), self.telemetry, writer_thread),
                                               cfg, lambda: leader.leading)
            parts = PipelineParts(CommitHooks(on_failure=leader.driver.failures.commit_hook_failed),
                                  retention=self.retention, member=member)
            self.pipeline = pipeline = IngestPipeline(PipelineSettings.from_config(c), queue,
                                                      CommitPath(writer, writer_thread, health, self.telemetry), parts)
            detecting: LocalDetection | ProcessDetection | DetectionDriver = leader.driver
            self.telemetry.registry.register(leader.metrics)
        else:
            pipeline, detection = single_collector_pipeline(cfg, writer, queue, writer_thread, self.telemetry, health)
            self.pipeline, self.detection, self.retention = pipeline, detection, pipeline.parts.retention
            detecting = detection
        self.telemetry.registry.register(detecting.metrics)
        self.telemetry.registry.register(ProcessMemoryMetrics())
        detecting.announcer.listeners.append(alerting.observe)
        install_exported_metrics(cfg, pipeline, self.telemetry, reader)
        ingest = Ingest.configured(queue, self.telemetry, c, health)
        # Profiles skip the queue: each export is its own transaction on the writer thread (low volume).
        self.profiles = profiles = ProfileIngest(ingest, pipeline.write_aside, writer.write_profiles)
        if c.allow_unauthenticated_otlp and not (c.otlp_token or c.tls_client_ca_file) and not (
                c.otlp_grpc.is_loopback and c.otlp_http.is_loopback):
            log.warning("OTLP receivers listen beyond loopback without collector.otlp_token or client certificates "
                        "(collector.allow_unauthenticated_otlp = true): any host that reaches them can send data")
        site = Site.from_config(c, links=self._links(c.api.port))  # the hosts and origin it answers to
        api = build_app(reader, self.telemetry, self._ready, c.api_token, alerting, site)
        self._api = HttpServer(api, c.api, "API" + describe(tls, c.api_tls_client_ca_file),
                               ssl_context=tls.http_context(c.api_tls_client_ca_file) if tls else None)
        self._grpc = GrpcServer("OTLP/gRPC", functools.partial(
            start_grpc, ingest, c.otlp_grpc, c.otlp_token, c.max_request_bytes,
            credentials=tls.grpc_credentials() if tls else None, secured=describe(tls, c.tls_client_ca_file),
            profiles=profiles),
            grace_seconds=GRPC_GRACE_SECONDS)  # in-flight exports still get their commit
        self._http = HttpServer(HttpReceiver(ingest, c.otlp_token, c.max_request_bytes, profiles).app(), c.otlp_http,
                                "OTLP/HTTP" + describe(tls, c.tls_client_ca_file),
                                ssl_context=tls.http_context(c.tls_client_ca_file) if tls else None)
        # Alerting's groups and silences are restored before the API takes requests (a silence created
        # meanwhile would be overwritten by the restore). Stopped in the reverse order: the receivers first;
        # the pipeline commits what they accepted and hands its last spikes to alerting, which commits its last
        # decisions; the API (alerting's routes) goes; the writer thread ends once every write ran, and
        # storage closes last.
        # In a cluster the member's heartbeats and the campaign to lead take alerting's place: the leader
        # routes and delivers while it leads, and commits its last decisions when it stops.
        cluster_parts = [member, self.leader] if member is not None and self.leader is not None else [
            Stage("alerting", start=self._start_alerting, stop=alerting.stop)]
        await self.components.start(
            Stage("storage", start=self._open_storage, stop=self._close_storage),
            writer_thread,
            Stage("alert state", start=functools.partial(alerting.restore, reader)),
            self._api,
            *cluster_parts,
            pipeline,
            self._grpc,
            self._http,
        )

    async def _open_storage(self) -> None:
        try:
            revision = await asyncio.get_running_loop().run_in_executor(None, upgrade, self.engine)
        except (OperationalError, OSError) as exc:  # the first connection: the server is down, or the file unusable
            raise unavailable(exc, self.cfg.database_url) from None
        log.info("schema at revision %s", revision)

    async def _close_storage(self) -> None:
        self.engine.dispose()

    async def _start_alerting(self) -> None:
        """Route and deliver; links point at the bound API port."""
        assert self.alerting is not None
        self.alerting.start(self._links(self.api_port))

    def _links(self, api_port: int) -> str:
        """Where links in alerts point; https:// when the API serves TLS and no collector.public_url says otherwise."""
        url = public_url(self.cfg, api_port)
        if self._tls is not None and not self.cfg.collector.public_url:
            return "https://" + url.removeprefix("http://")
        return url

    def failed(self) -> asyncio.Future[None]:
        assert self.pipeline is not None, "start() first"
        return self.pipeline.failed()

    async def _ready(self) -> tuple[bool, str]:
        if not self._listening:
            return False, "starting"
        if self.pipeline is None:
            return False, "starting"
        if not self.pipeline.health.available:
            return False, self.pipeline.health.describe()
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
        if (self.retention is not None and RETENTION_KEYS.intersection(change.applied)
                and self.retention.runs_here()):  # in a cluster, the leader's
            task = asyncio.create_task(self.retention.run(), name="retention-after-reload")
            self._reload_tasks.add(task)
            task.add_done_callback(self._reload_tasks.discard)

    async def stop(self) -> None:
        """Stop taking data, commit everything accepted, then close."""
        self._listening = False
        for task in list(self._reload_tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.components.stop()
