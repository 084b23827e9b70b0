"""The per-host agent: samplers, the profiler, local OTLP receivers, the forward queue and the forwarder.

It talks to the collector over OTLP only, and imports nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spikehound import __version__
from spikehound.agent.dispatcher import Dispatcher, RouteTimes
from spikehound.agent.enrich import Enricher, machine_id
from spikehound.agent.forwarder import AgentChain, channel_credentials
from spikehound.agent.intake import Intake
from spikehound.agent.member_forwarding import ForwardSettings, QueueSettings
from spikehound.agent.metrics_out import MetricsBridge
from spikehound.agent.otlp_grpc import start_grpc
from spikehound.agent.otlp_http import http_app
from spikehound.agent.profiler import Profiler
from spikehound.agent.request_split import DropLog
from spikehound.agent.samplers.cpu import CpuSampler
from spikehound.agent.samplers.network import NetworkSampler
from spikehound.agent.samplers.nvml import NvmlSampler
from spikehound.agent.sampling import Sampler, SamplingLoop
from spikehound.agent.services import ServiceMap
from spikehound.agent.spool import Item, Signal, SpoolWriteError
from spikehound.agent.telemetry import AgentMetrics, registry_for
from spikehound.components import ComponentStack, Stage
from spikehound.config import SECTIONS, Config, ConfigError, HostPort
from spikehound.endpoints import parse_collectors
from spikehound.grpc_server import GrpcServer
from spikehound.http_server import HttpServer
from spikehound.live_config import AGENT_LIVE_KEYS, apply_live

log = logging.getLogger("spikehound.agent")


def default_samplers(cfg: Config) -> list[Sampler]:
    a = cfg.agent
    try:
        cpu = CpuSampler(process_patterns=a.process_patterns, pid_files=a.pid_files,
                         max_processes=a.profile_max_processes, users=a.profile_users)
    except ValueError as exc:  # a user name this host does not know: known only here, not when the file is read
        raise ConfigError(f"agent.profile_users: {exc}") from None
    return [NvmlSampler(), cpu, NetworkSampler(interfaces=a.interfaces)]


class Agent:
    """One agent process. Ports given as 0 are chosen by the OS; see ``*_port`` after start."""

    name = "agent"

    def __init__(self, cfg: Config, samplers: list[Sampler] | None = None) -> None:
        self.cfg = cfg
        self._samplers = samplers
        # Started in order, stopped in reverse (see start).
        self.components = ComponentStack()
        self._grpc: GrpcServer | None = None
        self._http: HttpServer | None = None
        self._metrics: HttpServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._failed: asyncio.Future[None] | None = None
        self._running = False  # /healthz says ok once every component started
        self._stopping = False
        # Marks what this process forwards, so that its own receiver knows it if a member turns out to be itself.
        self.chain = AgentChain(secrets.token_hex(8))

    @property
    def grpc_port(self) -> int:
        return self._grpc.port if self._grpc is not None else 0

    @property
    def http_port(self) -> int:
        return self._http.port if self._http is not None else 0

    @property
    def metrics_port(self) -> int:
        return self._metrics.port if self._metrics is not None else 0

    async def start(self) -> None:
        cfg, a = self.cfg, self.cfg.agent
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        spool_dir = Path(a.spool_dir or Path(cfg.data_dir) / "spool")
        self.sampling = SamplingLoop(self._samplers if self._samplers is not None else default_samplers(cfg))
        host = a.host_name or socket.gethostname()
        drop_log = DropLog()
        # One forward queue, spool and forwarder per collector; traces are routed whole to one of them.
        credentials = channel_credentials(a.collector_ca_file, a.collector_cert_file, a.collector_key_file)
        self.dispatcher = Dispatcher(
            parse_collectors(a.collector), host, QueueSettings(spool_dir, a.memory_queue_bytes, a.spool_max_bytes),
            ForwardSettings(token=a.collector_token, credentials=credentials, drop_log=drop_log, chain=self.chain),
            RouteTimes(sticky_seconds=a.route_sticky_seconds, resolve_seconds=a.collector_resolve_seconds),
            listens=self._listens)
        await self.dispatcher.start()
        gpu_ids = [g["hw.id"] for s in self.sampling.samplers if isinstance(s, NvmlSampler) for g in s.gpus]
        identity: dict[str, Any] = {"host.name": host, "host.id": machine_id(), "nvidia.gpu.uuids": gpu_ids}
        self.services = ServiceMap()
        self.profiler = self._make_profiler(host)
        # Only a profiler needs to know which process sends which service.
        services = self.services if self.profiler is not None else None
        # A resource's process.pid is weighed against the socket table, per connection, by the intake (not by
        # the enricher, which sees a resource without the connection it came by).
        self.intake = Intake(Enricher(identity), self.dispatcher, drop_log=drop_log, services=services)
        self.bridge = MetricsBridge({"service.name": "spikehound-agent", "service.version": __version__, **identity},
                                    self._queue_own_metrics)
        registry = registry_for(AgentMetrics(self.intake, self.dispatcher, self.sampling, self.bridge, self.profiler))
        self._metrics = HttpServer(_metrics_app(registry, lambda: self._running), a.metrics_listen, "agent /metrics")
        self._http = HttpServer(http_app(self.intake, a.max_request_bytes), a.otlp_http, "OTLP/HTTP")
        self._grpc = GrpcServer("OTLP/gRPC", functools.partial(start_grpc, self.intake, a.otlp_grpc,
                                                               a.max_request_bytes, self.chain),
                                grace_seconds=2.0)
        # Stopped in the reverse order: the receivers first; then the forwarding and sampling tasks end, the
        # forwarder sends what is queued until the drain deadline (/metrics still up meanwhile), and what is
        # left goes to the disk spool last.
        await self.components.start(
            Stage("forward queue", stop=self._spool_queue),
            Stage("samplers", stop=self._close_samplers),
            self._metrics,
            Stage("forwarder", stop=self._drain_forwarder),
            Stage("forwarding and sampling tasks", start=self._start_tasks, stop=self._end_tasks),
            self._http,
            self._grpc,
        )
        self._running = True
        log.info("host %s, %d GPU(s), forwarding to %s, sampling every %.1f s", host, len(gpu_ids), a.collector,
                 a.interval)

    def _listens(self) -> list[HostPort]:
        """The agent's own OTLP listen addresses (the ports chosen, where 0 was asked for): never a member."""
        a = self.cfg.agent
        return [HostPort(a.otlp_grpc.host, self.grpc_port or a.otlp_grpc.port),
                HostPort(a.otlp_http.host, self.http_port or a.otlp_http.port)]

    def _make_profiler(self, host: str) -> Profiler | None:
        """The profiler of the processes the CPU sampler tracks; None when profiling is off or none is tracked."""
        a = self.cfg.agent
        cpu = next((s for s in self.sampling.samplers if isinstance(s, CpuSampler)), None)
        if not a.profiling or cpu is None or not (cpu.process_patterns or cpu.pid_files):
            return None

        def processes() -> dict[int, str]:
            return {pid: str(attributes.get("process.executable.name", ""))
                    for pid, attributes in cpu.processes.items()}

        return Profiler(processes, self.dispatcher, host, services=self.services, rate_hz=a.profile_rate_hz,
                        window_seconds=a.profile_window_seconds, threads=a.profile_threads,
                        max_processes=a.profile_max_processes)

    async def _start_tasks(self) -> None:
        tasks = [(self.dispatcher.run(), "forwarders"), (self._sample_forever(), "sampling")]
        if self.profiler is not None:
            tasks.append((self.profiler.run(), "profiler"))
        for coro, name in tasks:
            task = asyncio.create_task(coro, name=name)
            task.add_done_callback(self._watch)
            self._tasks.append(task)

    async def _end_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.profiler is not None:  # its py-spy children die with it
            await self.profiler.aclose()

    async def _drain_forwarder(self) -> None:
        await self.dispatcher.drain(self.cfg.agent.drain_seconds)
        await self.dispatcher.close_forwarders()

    async def _spool_queue(self) -> None:
        left = self.dispatcher.spill_memory()
        if left:
            log.error("spool full or not writable at shutdown: %d queued requests could not be kept", left)
        if self.dispatcher.totals.spool_requests:
            log.info("%d requests left in the disk spool for the next start", self.dispatcher.totals.spool_requests)
        self.dispatcher.close()

    async def _close_samplers(self) -> None:
        self.sampling.close()

    def _queue_own_metrics(self, payload: bytes, points: int) -> bool:
        try:
            return self.dispatcher.put_all([Item(Signal.METRICS, payload, points)])
        except SpoolWriteError:  # logged and counted by the spool; the samples of this tick are lost
            return False

    async def _sample_forever(self) -> None:
        interval = self.cfg.agent.interval
        next_tick = time.monotonic()
        while True:
            samples = await self.sampling.tick(timeout=interval * 0.8)
            self.bridge.export(samples)
            next_tick += interval
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (suspended, overloaded): skip ticks rather than burst
                next_tick = time.monotonic()
                delay = 0
            await asyncio.sleep(delay)

    def _watch(self, task: asyncio.Task[None]) -> None:
        if self._stopping or self._failed is None or self._failed.done() or task.cancelled():
            return
        exc = task.exception()
        self._failed.set_exception(exc or RuntimeError(f"{task.get_name()} ended"))

    def failed(self) -> asyncio.Future[None]:
        assert self._failed is not None, "start() first"
        return self._failed

    async def reload(self, cfg: Config) -> None:
        """SIGHUP: the log settings change at once; other changes wait for a restart (queued data is untouched)."""
        apply_live(self.cfg, cfg, AGENT_LIVE_KEYS, ignore_sections=SECTIONS - {"agent", "log"}).report(log)

    async def stop(self) -> None:
        """Stop receiving, forward what is queued until the drain deadline, spool the rest."""
        self._stopping = True
        self._running = False  # /healthz: not ok while it drains and spools
        await self.components.stop()


def _metrics_app(registry: Any, running: Callable[[], bool]) -> web.Application:
    """/metrics, and /healthz and /readyz (the same answer, for probes that ask either): ok once ``running``
    says so (the receivers listen), 503 before and while draining."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        if not running():
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    return app
