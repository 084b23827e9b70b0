"""systemd's side of the notification protocol (sd_notify), played by a test: the socket it listens on,
daemons started with it, and stopping one as systemd does."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

from harness.daemons import AgentProcess, CollectorProcess, accepts_connections
from tests.support.sdk_traffic import send_spans
from tests.support.systemd_units import unit_seconds

WATCHDOG_USEC = 400_000  # pings every 0.2 s


class NotifySocket:
    """A unix datagram socket standing in for systemd's notification socket; reads parsed messages in order."""

    def __init__(self, directory: Path | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if directory is None:  # Linux's abstract namespace, which systemd itself uses
            name = f"spikehound-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.sock.bind(str(directory / "notify"))
            self.address = str(directory / "notify")
        self.messages: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        """The next message, or None if none came within ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append(message)
        return message

    def wait_for(self, key: str, value: str, timeout: float = 30) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None and message.get(key) == value:
                return message
        raise AssertionError(f"no {key}={value} within {timeout} s; received {self.messages}")

    def close(self) -> None:
        self.sock.close()


class Notified:
    """Mixin for a daemon process whose readiness is systemd's READY=1, with a look at its ports the moment
    READY=1 arrives (the test blocks on the socket, so there is no polling delay in between)."""

    notify: NotifySocket
    ports_at_ready: dict[int, bool] | None = None
    proc: subprocess.Popen[bytes] | None

    def ports(self) -> list[int]:
        raise NotImplementedError

    def ready(self) -> bool:
        message = self.notify.receive(0.1)
        if message is None or message.get("READY") != "1":
            return False
        self.ports_at_ready = {port: accepts_connections(port) for port in self.ports()}
        return True


class NotifiedCollector(Notified, CollectorProcess):
    def __init__(self, db_url: str, workdir: Path, notify: NotifySocket, **env: str) -> None:
        super().__init__(db_url, workdir, {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": str(WATCHDOG_USEC),
                                           **env})
        self.notify = notify

    def ports(self) -> list[int]:
        return [self.api_port, self.grpc_port, self.http_port]


class NotifiedAgent(Notified, AgentProcess):
    def __init__(self, collector: str, workdir: Path, notify: NotifySocket, **env: str) -> None:
        super().__init__(collector, workdir, env={"NOTIFY_SOCKET": notify.address,
                                                  "WATCHDOG_USEC": str(WATCHDOG_USEC), **env})
        self.notify = notify

    def ports(self) -> list[int]:
        return [self.grpc_port, self.http_port, self.metrics_port]


def send_traces(endpoint: str, n: int = 10, **resource: str) -> None:
    """``n`` traces of three spans through the OpenTelemetry SDK; every span acknowledged."""
    recording = send_spans(GrpcSpanExporter(endpoint=endpoint, insecure=True),
                           {"service.name": "llm-gateway", **resource}, n=n)
    assert len(recording.acked) == 3 * n


def stop_as_systemd_does(daemon: Notified, unit: str) -> dict[str, str]:
    """SIGTERM; STOPPING=1 must follow, and exit status 0 within the unit's TimeoutStopSec."""
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    stopping = daemon.notify.wait_for("STOPPING", "1")
    assert daemon.proc.wait(unit_seconds(unit, "TimeoutStopSec")) == 0
    assert "draining" in stopping["STATUS"]
    return stopping
