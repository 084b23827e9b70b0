"""Run real collectors for tests: in-process on a background event loop, or as a child process."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Self

import requests

from harness.api_client import list_spikes
from harness.ports import free_port
from harness.scrape import Samples, parse, sample, scrape, total
from harness.waiting import eventually
from spikehound.config import Config, load


def collector_config(db_url: str, **settings: Any) -> Config:
    """A collector config on loopback with OS-chosen ports; ``settings`` are ``section.key`` values."""
    flags = {"storage.url": db_url, "collector.api": "127.0.0.1:0", "collector.otlp_grpc": "127.0.0.1:0",
             "collector.otlp_http": "127.0.0.1:0", "collector.idle_flush_seconds": 0.5}
    flags.update({k.replace("__", "."): v for k, v in settings.items()})
    return load(env={}, flags=flags)


class CollectorThread:
    """A collector running in this process on its own event loop thread."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.time) -> None:
        from spikehound.collector.daemon import Collector

        self.cfg = cfg
        self.collector = Collector(cfg, alerting_clock=clock)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-collector", daemon=True)

    def __enter__(self) -> CollectorThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.collector.start(), self.loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.collector.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.collector.api_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.collector.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.http_port}"

    def metric(self, name: str, **labels: str) -> float:
        """The sample called ``name`` with exactly ``labels``, as ``/metrics`` would show it; 0 when there is none."""
        telemetry = self.collector.telemetry
        value = telemetry.registry.get_sample_value(name, labels)
        if value is None and telemetry.expositions:  # the span metrics, written as text
            value = sample(parse(b"".join(part() for part in telemetry.expositions).decode()), name, **labels)
        return value or 0.0

    def detection_settled(self) -> bool:
        """Every latency window closed, judged and written (so its spikes were handed to alerting too)."""
        return detection_settled(self.metric)

    def spikes_once_settled(self, timeout: float = 60, done: Callable[[list[dict[str, Any]]], bool] = bool
                            ) -> list[dict[str, Any]]:
        """The spikes once every window is closed and judged (see ``detection_settled``) and ``done`` says yes
        to them (default: at least one spike)."""
        def settled() -> tuple[list[dict[str, Any]]] | None:  # in a tuple: no spikes at all is an answer too
            if not self.detection_settled():
                return None
            found = list_spikes(self.api)
            return (found,) if done(found) else None

        # Not "the windows counter stood still for a while": with input idle the last windows close a whole
        # window later, and a loaded machine can hold the counter still for any time.
        (found,) = eventually(settled, "the collector to judge every window", timeout=timeout, every=0.25)
        return found


def detection_settled(metric: Callable[[str], float]) -> bool:
    """From a collector's metrics: no window left open, and every judged window written (the spikes its
    judgement made are stored and were routed). ``metric`` reads one unlabelled sample by name."""
    judged = metric("spikehound_detector_judged_windows_total")
    return (metric("spikehound_latency_open_windows") == 0 and judged > 0
            and metric("spikehound_latency_windows_closed_total") == judged)


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment without its SPIKEHOUND_* variables (the test sets its own), plus ``extra``.

    A developer's SPIKEHOUND_TEST_* knobs would otherwise reach the daemon's configuration as unknown settings.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    env.update(extra or {})
    return env


class DaemonProcess:
    """A ``spikehound`` daemon as a child process; ``start`` may be called again after a stop or kill."""

    name = "daemon"
    # A command line the daemon's own is appended to (a sandbox, say); empty runs it directly.
    prefix: list[str] = []

    def __init__(self, workdir: Path, env: Mapping[str, str] | None) -> None:
        self.workdir = workdir
        self.env = _child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: BinaryIO | None = None

    def args(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 60) -> Self:
        exe = shutil.which("spikehound", path=str(Path(sys.executable).parent)) or "spikehound"
        self.starts += 1
        self._close_log()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives with the process, closed by kill/terminate
        self.proc = subprocess.Popen([*self.prefix, exe, *self.args()], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        proc = self.proc
        try:  # "exited" ends the wait too: a daemon that died is not waited for until the timeout
            state = eventually(lambda: "exited" if proc.poll() is not None else self.ready() and "ready",
                               f"{self.name} to be ready", timeout)
        except AssertionError:
            self.kill()
            raise RuntimeError(f"{self.name} not ready in {timeout} s: {self.log_tail()}") from None
        if state == "exited":
            self._close_log()
            raise RuntimeError(f"{self.name} exited with {proc.returncode}: {self.log_tail()}")
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}-{self.starts}.log"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait; the exit status (raises TimeoutExpired past ``timeout``)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


class CollectorProcess(DaemonProcess):
    """``spikehound collector`` as a child process, for kill and restart tests."""

    name = "collector"

    def __init__(self, db_url: str, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        super().__init__(workdir, env)
        self.db_url = db_url
        self.api_port, self.grpc_port, self.http_port = free_port(), free_port(), free_port()

    def args(self) -> list[str]:
        return ["collector", "--db", self.db_url, "--api", f"127.0.0.1:{self.api_port}",
                "--otlp-grpc", f"127.0.0.1:{self.grpc_port}", "--otlp-http", f"127.0.0.1:{self.http_port}"]

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.api}/readyz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


class AgentProcess(DaemonProcess):
    """``spikehound agent`` on free loopback ports, forwarding to ``collector``.

    Other settings come as ``env`` (``SPIKEHOUND_AGENT_*``); a restart keeps ports, spool and data directory.
    """

    name = "agent"

    def __init__(self, collector: str, workdir: Path, *, spool_dir: Path | None = None,
                 data_dir: Path | None = None, interval: float | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.collector = collector
        self.spool_dir = spool_dir or workdir / "agent-spool"
        self.data_dir = data_dir or workdir / "agent-data"
        self.interval = interval
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        super().__init__(workdir, {"SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{self.metrics_port}",
                                   "SPIKEHOUND_AGENT_SPOOL_DIR": str(self.spool_dir),
                                   "SPIKEHOUND_DATA_DIR": str(self.data_dir), **(env or {})})

    def args(self) -> list[str]:
        args = ["agent", "--collector", self.collector, "--otlp-grpc", f"127.0.0.1:{self.grpc_port}",
                "--otlp-http", f"127.0.0.1:{self.http_port}"]
        return args + (["--interval", str(self.interval)] if self.interval is not None else [])

    def ready(self) -> bool:
        """/healthz answers (it comes up after the receivers) and both receivers accept connections."""
        try:
            healthy = requests.get(f"{self.metrics_url}/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False
        return healthy and all(accepts_connections(port) for port in (self.grpc_port, self.http_port))

    def metrics(self) -> Samples:
        """Every sample of the agent's /metrics: (name, sorted labels) -> value."""
        return scrape(self.metrics_url, timeout=5)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``; 0 when there are none."""
        return total(self.metrics(), name, **labels)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
