"""The per-host agent: samplers, local OTLP receivers, the forward queue and the forwarder.

It talks to the collector over OTLP only, and imports nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent.enrich import Enricher, machine_id
from agent.forward_queue import ForwardQueue
from agent.forwarder import Forwarder, channel_credentials
from agent.intake import Intake
from agent.metrics_out import MetricsBridge
from agent.otlp_grpc import start_grpc
from agent.otlp_http import http_app
from agent.samplers.cpu import CpuSampler
from agent.samplers.network import NetworkSampler
from agent.samplers.nvml import NvmlSampler
from agent.sampling import Sampler, SamplingLoop
from agent.spool import DiskSpool, Item, Signal, SpoolWriteError
from agent.telemetry import AgentMetrics, registry_for
from spikehound import __version__
from spikehound.config import SECTIONS, Config
from spikehound.lifecycle import start_http
from spikehound.live_config import AGENT_LIVE_KEYS, apply_live

log = logging.getLogger("spikehound.agent")


def default_samplers(cfg: Config) -> list[Sampler]:
    a = cfg.agent
    return [NvmlSampler(), CpuSampler(process_patterns=a.process_patterns, pid_files=a.pid_files),
            NetworkSampler(interfaces=a.interfaces)]


class Agent:
    """One agent process. Ports given as 0 are chosen by the OS; see ``*_port`` after start."""

    name = "agent"

    def __init__(self, cfg: Config, samplers: list[Sampler] | None = None) -> None:
        self.cfg = cfg
        self._samplers = samplers
        self.grpc_port = self.http_port = self.metrics_port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._runners: list[web.AppRunner] = []
        self._grpc: grpc.aio.Server | None = None
        self._failed: asyncio.Future[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        cfg, a = self.cfg, self.cfg.agent
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        spool_dir = Path(a.spool_dir or Path(cfg.data_dir) / "spool")
        self.queue = ForwardQueue(a.memory_queue_bytes, DiskSpool(spool_dir, a.spool_max_bytes))
        if len(self.queue.spool):
            log.info("%d requests (%d bytes) spooled on disk from an earlier run; forwarding them first",
                     len(self.queue.spool), self.queue.spool.bytes_used)
        self.sampling = SamplingLoop(self._samplers if self._samplers is not None else default_samplers(cfg))
        host = a.host_name or socket.gethostname()
        gpu_ids = [g["hw.id"] for s in self.sampling.samplers if isinstance(s, NvmlSampler) for g in s.gpus]
        identity: dict[str, Any] = {"host.name": host, "host.id": machine_id(), "nvidia.gpu.uuids": gpu_ids}
        self.intake = Intake(Enricher(identity), self.queue)
        self.bridge = MetricsBridge({"service.name": "spikehound-agent", "service.version": __version__, **identity},
                                    self._queue_own_metrics)
        self.forwarder = Forwarder(self.queue, a.collector, a.collector_token, drop_log=self.intake.drop_log,
                                   credentials=channel_credentials(a.collector_ca_file, a.collector_cert_file,
                                                                   a.collector_key_file))
        registry = registry_for(AgentMetrics(self.intake, self.queue, self.forwarder, self.sampling, self.bridge))
        try:
            self._grpc, self.grpc_port = await start_grpc(self.intake, a.otlp_grpc, a.max_request_bytes)
            runner, self.http_port = await start_http(http_app(self.intake, a.max_request_bytes), a.otlp_http,
                                                      "OTLP/HTTP")
            self._runners.append(runner)
            # Last, so that /healthz answering means the receivers listen.
            runner, self.metrics_port = await start_http(_metrics_app(registry), a.metrics_listen, "agent /metrics")
            self._runners.append(runner)
        except BaseException:
            await self.stop()
            raise
        log.info("host %s, %d GPU(s), forwarding to %s, sampling every %.1f s", host, len(gpu_ids), a.collector,
                 a.interval)
        for coro, name in ((self.forwarder.run(), "forwarder"), (self._sample_forever(), "sampling")):
            task = asyncio.create_task(coro, name=name)
            task.add_done_callback(self._watch)
            self._tasks.append(task)

    def _queue_own_metrics(self, payload: bytes, points: int) -> bool:
        try:
            return self.queue.put(Item(Signal.METRICS, payload, points))
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
        if self._grpc is not None:
            await self._grpc.stop(2.0)
        for runner in self._runners[:1]:  # the OTLP/HTTP receiver; /metrics stays up while draining
            await runner.cleanup()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if hasattr(self, "forwarder"):
            await self._drain(self.cfg.agent.drain_seconds)
            await self.forwarder.close()
        if hasattr(self, "queue"):
            left = self.queue.spill_memory()
            if left:
                log.error("spool full or not writable at shutdown: %d queued requests could not be kept", left)
            if len(self.queue.spool):
                log.info("%d requests left in the disk spool for the next start", len(self.queue.spool))
            self.queue.close()
        if hasattr(self, "sampling"):
            self.sampling.close()
        for runner in self._runners[1:]:
            await runner.cleanup()
        self._runners.clear()

    async def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.queue.peek() is not None and time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.forwarder.flush(timeout=max(remaining, 0.1)), remaining)


def _metrics_app(registry: Any) -> web.Application:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
