"""The load-test workflow of docs/regression-gate.md: Locust drives the demo service, compare judges its spans.

Two builds of the same code (versions 1.0.0 and 1.0.1) run side by side as
``examples/locust/inference_service.py`` processes, really sleeping and really
querying SQLite, sending their spans over OTLP/gRPC to a collector process.
Locust runs headless against each for a few seconds; ``spikehound compare``
then finds exactly the requests Locust made, and passes the identical build.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.daemons import CollectorProcess, free_port
from harness.waiting import eventually
from tests.support.cli import spikehound, unix

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "locust"
LOCUST = shutil.which("locust", path=str(Path(sys.executable).parent))
VERSIONS = ("1.0.0", "1.0.1")


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProcess]:
    running = CollectorProcess(f"sqlite:///{tmp_path / 'spikehound.db'}", tmp_path).start()
    yield running
    running.terminate()


def start_service(version: str, otlp: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(EXAMPLE / "inference_service.py"), "--port", str(port),
                                 "--otlp", otlp, "--version", version], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: requests.get(f"{url}/healthz", timeout=1).status_code == 200,
                   f"service {version} to answer /healthz", timeout=30)
    except AssertionError as exc:
        proc.kill()
        raise RuntimeError(f"service {version} did not start: {log.read_text()}") from exc
    return proc, url


def locust_counts(prefix: Path) -> tuple[int, int]:
    """Requests and failures from Locust's final JSON stats (its CSV's last write can miss the last second)."""
    stats = json.loads(Path(f"{prefix}.json").read_text())
    row = next(r for r in stats if r["name"] == "POST /v1/predict")
    return int(row["num_requests"]), int(row["num_failures"])


@pytest.mark.slow
@pytest.mark.skipif(LOCUST is None, reason="locust is not installed (pip install -e '.[dev]')")
def test_locust_traffic_is_what_compare_judges(collector: CollectorProcess, tmp_path: Path):
    since = time.time_ns()
    # --stop-timeout lets each user finish the request it has in flight when the run time is up, so every
    # request the services served is one Locust counted. 15 s gives each version some 580 requests: then a
    # stall of this shared machine that catches one version's in-flight requests cannot move its p99 alone
    # (at 5 s, about 190 requests, two slow ones did, and compare rightly saw a regression).
    services = [start_service(v, collector.grpc_endpoint, tmp_path / f"service-{v}.log") for v in VERSIONS]
    try:
        runs = [subprocess.Popen([LOCUST, "-f", str(EXAMPLE / "locustfile.py"), "--headless", "--users", "4",
                                  "--spawn-rate", "4", "--run-time", "15s", "--stop-timeout", "20", "--host", url,
                                  "--json-file",
                                  str(tmp_path / version), "--only-summary", "--loglevel", "WARNING"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
                for version, (_, url) in zip(VERSIONS, services, strict=True)]
        for run in runs:
            _, err = run.communicate(timeout=120)
            assert run.returncode == 0, err.decode(errors="replace")[-2000:]
    finally:
        for proc, _ in services:
            proc.send_signal(signal.SIGTERM)  # the service flushes its spans before it exits
        for proc, _ in services:
            assert proc.wait(60) == 0
    until = time.time_ns()

    sent = {v: locust_counts(tmp_path / v) for v in VERSIONS}
    assert all(count >= 100 and failures == 0 for count, failures in sent.values()), sent
    result = spikehound("compare", "--api", collector.api, "--baseline", VERSIONS[0], "--candidate", VERSIONS[1],
                        "--service", "gateway", "--format", "json", "--since", unix(since), "--until", unix(until))
    report = json.loads(result.stdout)
    (gateway,) = report["operations"]
    assert (gateway["operation"], gateway["baseline"]["count"], gateway["candidate"]["count"]) == (
        "POST /v1/predict", sent[VERSIONS[0]][0], sent[VERSIONS[1]][0])
    assert result.returncode == 0, report["message"]
    assert {s["label"] for s in gateway["stages"]} >= {"model-server: forward", "preprocess: feature_lookup",
                                                       "network gateway -> model-server POST /infer"}
