"""A throwaway real Prometheus server (Debian's ``prometheus`` package) for tests, and promtool.

``make test`` installs the package when it is missing (``tests/apt-install.sh``); where that was not
possible the tests that need it skip, naming the reason.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.daemons import free_port
from harness.waiting import eventually

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository root
RULES = REPO / "deploy" / "prometheus" / "spikehound-rules.yml"
MISSING = ("Debian's prometheus package is not installed and could not be installed here "
           "(make test runs tests/apt-install.sh; apt-get install prometheus)")


def tool(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``; skips the test when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(MISSING)
    return path


class PrometheusServer:
    """``prometheus`` on a free loopback port with its own data directory, scraping every second."""

    def __init__(self, targets: dict[str, list[str]], rule_files: list[Path]) -> None:
        self.binary = tool("prometheus")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="spikehound-prometheus-"))
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: {addrs!r}\n"
                       for job, addrs in targets.items())
        rules = "".join(f"  - {path}\n" for path in rule_files)
        self.config = self.dir / "prometheus.yml"
        self.config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                               f"rule_files:\n{rules}scrape_configs:\n{jobs}")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> PrometheusServer:
        log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        proc = self.proc

        def state() -> str | None:  # "exited" ends the wait too: a server that died is not waited for
            if proc.poll() is not None:
                return "exited"
            return "ready" if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200 else None

        try:
            ended = eventually(state, "prometheus to be ready", timeout, every=0.2)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"prometheus not ready in {timeout} s: {self.log_tail()}") from None
        if ended == "exited":
            raise RuntimeError(f"prometheus exited with {proc.returncode}: {self.log_tail()}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        path = self.dir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def api(self, path: str, **params: Any) -> Any:
        """``data`` of a Prometheus HTTP API answer; raises with Prometheus's error when it failed."""
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def value(self, expr: str) -> float:
        """The single value of ``expr``; NaN when it has no series."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else math.nan

    def wait_for(self, expr: str, ok: Any = lambda v: v == v, timeout: float = 60) -> float:
        """Poll ``expr`` until ``ok(value)``; the value. NaN (no series) never satisfies the default."""
        def satisfied() -> tuple[float]:
            value = self.value(expr)
            assert ok(value), f"{expr} is {value}"  # chained to the timeout: the last value seen
            return (value,)  # in a tuple, so that a value of 0 counts as found

        (value,) = eventually(satisfied, f"{expr} to satisfy the condition", timeout, every=0.5)
        return value
