"""The demo's child processes: the collector, an agent, the three services and the delaying proxy.

Each runs as a real process with its log in the demo's working directory.
The collector and the agent are the ``spikehound`` commands a deployment
runs; the demo talks to them over OTLP and HTTP only. The services are
configured with the standard ``OTEL_*`` variables and send to the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from spikehound.config import HostPort
from spikehound.demo import feature_store
from spikehound.demo.faults import Fault


class StartError(RuntimeError):
    """A child process did not come up; the message names it and ends with its log."""


# The demo's own ports lie below both the kernel's ephemeral range (where an outgoing connection's local port,
# or any listener on port 0, may take a port between its pick and its bind) and the test harness's ports.
DEMO_PORTS = range(10000, 12000)
_handed_out: set[int] = set()


def _ephemeral_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None) -> int:
    """``preferred`` when nothing listens on it, else a free port of ``DEMO_PORTS`` this process has not handed
    out (a port the OS picks when none is left, or the kernel hands those out itself)."""
    if preferred and _bindable(preferred):
        return preferred
    ephemeral = _ephemeral_range()
    candidates = [p for p in DEMO_PORTS if p not in _handed_out and p not in ephemeral]
    random.shuffle(candidates)
    for port in candidates:
        if _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    """GET (or POST ``body`` as) JSON and return the decoded answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    # The demo is self-contained: a developer's SPIKEHOUND_* or OTEL_* settings must not change it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEHOUND_", "OTEL_"))}
    env.update(extra)
    return env


def profiled_pattern(*ports: int) -> str:
    r"""This demo's three services, by their command lines and ports: another demo's on the host are not ours.

    >>> print(profiled_pattern(5001, 5002))
    spikehound\.demo\.stack \S+ --port (?:5001|5002)\b
    """
    return rf"spikehound\.demo\.stack \S+ --port (?:{'|'.join(map(str, ports))})\b"


PROFILE_WINDOW_S = 5  # the demo's detection window
# A short demo's baseline is the half minute of its warm-up, of mostly idle services: 19 Hz would catch too few
# on-CPU samples in it, and 49 Hz caught 37 of the 50 a clear culprit needs on a busy CI machine (the services
# get less CPU there, the profiler starts later), so nearly 100, py-spy's own default.
PROFILE_RATE_HZ = 97


@dataclass
class Child:
    """One child process, ready when ``ready_url`` answers 200."""

    name: str
    args: Sequence[str]
    env: Mapping[str, str]
    ready_url: str
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> Child:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([sys.executable, *self.args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=_clean_env(self.env), cwd=self.workdir)
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(self.ready_url, timeout=1) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.2)
        raise StartError(f"{self.name} was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


# The collector's alert route to the demo's local webhook receiver: every spike, announced at once (no group
# wait) and its resolve notice after a short hold, so that each fault's alert shows while the demo runs.
ALERT_ROUTE_TOML = """
[[alerts.receivers]]
name = "demo-webhook"
type = "webhook"
url = "{url}"

[[alerts.routes]]
receiver = "demo-webhook"
resolve_wait_seconds = 5
"""


def alert_route(webhook_url: str) -> str:
    """The TOML that routes every alert to ``webhook_url`` (a loopback receiver: no signing secret needed)."""
    return ALERT_ROUTE_TOML.format(url=webhook_url)


# Short windows so that a three-minute demo can learn normal traffic and still find four faults; firmer
# evidence (min_score 12: the hysteresis then holds a spike open only at the default opening bar of 6), so
# that the background noise of a busy 2-core machine neither opens spikes nor holds one open into the next fault.
DEMO_SETTINGS = {"collector.window_seconds": 5, "collector.allowed_lateness_seconds": 2,
                 "collector.idle_flush_seconds": 1, "detection.grace_windows": 6, "detection.resolve_windows": 1,
                 "detection.min_score": 12}


def collector_toml(public_url: str, alerts: str | None) -> str:
    lines = ["# spikehound demo: short windows and firmer evidence (production defaults: 10 s windows, 12 warm-up",
             "# windows, 5 s lateness, 2 calm windows to resolve a spike, min_score 6)"]
    section = None
    for key, value in DEMO_SETTINGS.items():
        name, _, setting = key.partition(".")
        if name != section:
            lines.append(f"\n[{name}]")
            section = name
            if name == "collector":
                lines.append(f'public_url = "{public_url}"')
        lines.append(f"{setting} = {value}")
    return "\n".join(lines) + "\n" + (alerts or "")


class Stack:
    """Everything the demo starts, and the switches of its faults."""

    def __init__(self, workdir: Path, api: HostPort, webhook_url: str) -> None:
        self.workdir = workdir
        self.features = workdir / "features.db"
        ports = {name: free_port() for name in ("grpc", "http", "agent_grpc", "agent_http", "agent_metrics",
                                                 "gateway", "preprocess", "model", "proxy", "proxy_control")}
        self.ports = ports
        self.api = f"http://{api}"
        self.gateway = ("127.0.0.1", ports["gateway"])
        config = workdir / "collector.toml"
        config.write_text(collector_toml(self.api, alert_route(webhook_url)))
        self.config_path = config
        self.collector = Child("collector", ["-m", "spikehound.cli", "collector", "--config", str(config),
                                             "--db", f"sqlite:///{workdir / 'spikehound.db'}",
                                             "--api", str(api),
                                             "--otlp-grpc", f"127.0.0.1:{ports['grpc']}",
                                             "--otlp-http", f"127.0.0.1:{ports['http']}"],
                               {"SPIKEHOUND_DATA_DIR": str(workdir)}, f"{self.api}/readyz", workdir)
        self.agent = Child("agent", ["-m", "spikehound.cli", "agent", "--collector", f"127.0.0.1:{ports['grpc']}",
                                     "--otlp-grpc", f"127.0.0.1:{ports['agent_grpc']}",
                                     "--otlp-http", f"127.0.0.1:{ports['agent_http']}", "--interval", "1"],
                           {"SPIKEHOUND_DATA_DIR": str(workdir), "SPIKEHOUND_AGENT_SPOOL_DIR": str(workdir / "spool"),
                            "SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{ports['agent_metrics']}",
                            "SPIKEHOUND_AGENT_DRAIN_SECONDS": "3",
                            # The three services are profiled (docs/profiles.md), in the demo's short windows.
                            "SPIKEHOUND_AGENT_PROCESS_PATTERNS": profiled_pattern(
                                ports["gateway"], ports["preprocess"], ports["model"]),
                            "SPIKEHOUND_AGENT_PROFILE_WINDOW_SECONDS": str(PROFILE_WINDOW_S),
                            "SPIKEHOUND_AGENT_PROFILE_RATE_HZ": str(PROFILE_RATE_HZ)},
                           f"http://127.0.0.1:{ports['agent_metrics']}/healthz", workdir)
        url = {name: f"http://127.0.0.1:{ports[name]}" for name in ("preprocess", "model", "gateway", "proxy_control")}
        self.services = [
            self._service("model-server", ["--port", str(ports["model"])]),
            self._service("preprocess", ["--port", str(ports["preprocess"]), "--features", str(self.features)]),
            Child("delay-proxy", ["-m", "spikehound.demo.delay_proxy", "--listen", f"127.0.0.1:{ports['proxy']}",
                                  "--upstream", f"127.0.0.1:{ports['model']}",
                                  "--control", f"127.0.0.1:{ports['proxy_control']}", "--delay-ms", "100"],
                  {}, f"{url['proxy_control']}/healthz", workdir),
            # The gateway reaches the model server through the proxy, and exports over OTLP/HTTP (the others gRPC).
            self._service("gateway", ["--port", str(ports["gateway"]), "--preprocess", url["preprocess"],
                                      "--model-server", f"http://127.0.0.1:{ports['proxy']}"],
                          protocol="http/protobuf"),
        ]
        self.fault_urls = {"cpu": f"{url['preprocess']}/fault", "gpu": f"{url['model']}/fault",
                           "network": f"{url['proxy_control']}/fault"}

    def _service(self, name: str, args: list[str], protocol: str = "grpc") -> Child:
        port = self.ports["agent_http"] if protocol == "http/protobuf" else self.ports["agent_grpc"]
        env = {"OTEL_SERVICE_NAME": name, "OTEL_RESOURCE_ATTRIBUTES": "service.version=demo-1",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
        return Child(name, ["-m", "spikehound.demo.stack", name, *args], env,
                     f"http://127.0.0.1:{args[1]}/healthz", self.workdir)

    @property
    def children(self) -> list[Child]:
        return [self.collector, self.agent, *self.services]

    def start(self) -> None:
        self.collector.start()
        feature_store.create(self.features)  # while the collector starts
        self.collector.wait_ready()
        self.agent.start().wait_ready()
        assert self.agent.proc is not None
        for child in self.services:
            # Where Yama lets a process be read only by its ancestors (Ubuntu's default), the services name the
            # agent, their sibling, as the one that may (see stack.allow_tracer).
            child.env = {**child.env, "SPIKEHOUND_DEMO_TRACER_PID": str(self.agent.proc.pid)}
            child.start()
        for child in self.services:
            child.wait_ready()

    def set_fault(self, fault: Fault, on: bool) -> None:
        if fault.key == "slow-query":
            (feature_store.drop_index if on else feature_store.create_index)(self.features)
        else:
            http_json(self.fault_urls[fault.key], {"on": on})

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and not c.running]

    def stop(self, keep_collector: bool = False) -> None:
        for child in reversed(self.services):  # the gateway first, so no request is cut half-way
            child.stop()
        self.agent.stop()
        if not keep_collector:
            self.collector.stop()
