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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import requests

from spikehound.config import Config, load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collector_config(db_url: str, **settings: Any) -> Config:
    """A collector config on loopback with OS-chosen ports; ``settings`` are ``section.key`` values."""
    flags = {"storage.url": db_url, "collector.api": "127.0.0.1:0", "collector.otlp_grpc": "127.0.0.1:0",
             "collector.otlp_http": "127.0.0.1:0", "collector.idle_flush_seconds": 0.5}
    flags.update({k.replace("__", "."): v for k, v in settings.items()})
    return load(env={}, flags=flags)


class CollectorThread:
    """A collector running in this process on its own event loop thread."""

    def __init__(self, cfg: Config) -> None:
        from collector.daemon import Collector

        self.cfg = cfg
        self.collector = Collector(cfg)
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
        value = self.collector.telemetry.registry.get_sample_value(name, labels)
        return value or 0.0


class CollectorProcess:
    """``spikehound collector`` as a child process, for kill and restart tests."""

    def __init__(self, db_url: str, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.db_url = db_url
        self.workdir = workdir
        self.api_port, self.grpc_port, self.http_port = free_port(), free_port(), free_port()
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: BinaryIO | None = None

    def start(self, timeout: float = 60) -> CollectorProcess:
        exe = shutil.which("spikehound", path=str(Path(sys.executable).parent)) or "spikehound"
        self.starts += 1
        if self._log is not None:
            self._log.close()
        self._log = open(self.workdir / f"collector-{self.starts}.log", "wb")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [exe, "collector", "--db", self.db_url, "--api", f"127.0.0.1:{self.api_port}",
             "--otlp-grpc", f"127.0.0.1:{self.grpc_port}", "--otlp-http", f"127.0.0.1:{self.http_port}"],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if requests.get(f"{self.api}/readyz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"collector not ready in {timeout} s: {self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / f"collector-{self.starts}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def terminate(self, timeout: float = 30) -> int:
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
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"
