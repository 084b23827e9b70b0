"""The OCI image (deploy/container/, ``make image``), run by podman as a user would run it.

The image is built by the same script as ``make image`` (Debian's buildah and debootstrap; a second build of
the same inputs finds the image and returns at once). A collector container and an agent container, each
with a read-only root file system and its volume, run on the host's network: scenario traffic sent to the
agent's OTLP/HTTP receiver reaches the collector, whose API then shows the spike the scenario holds. Without
podman, buildah or debootstrap, or where the image cannot be built or run, the tests skip and say why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.api_client import list_spikes
from harness.ports import free_port
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from harness.waiting import eventually

# A first build (debootstrap, the dependencies' wheels) takes about 4 minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "deploy" / "container" / "build_image.py"
# What these machines' podman needs: file and process limits within the host's (its defaults exceed them).
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
TOKEN = uuid.uuid4().hex


@pytest.fixture(scope="module")
def image() -> str:
    missing = [tool for tool in ("podman", "buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)}): the image is "
                    "built with buildah and debootstrap and run with podman")
    done = subprocess.run([sys.executable, str(BUILD)], capture_output=True, text=True, timeout=900)
    if done.returncode == 3:
        pytest.skip(f"the image cannot be built here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.split()[-1]


@pytest.fixture(scope="module")
def podman_run(image: str) -> list[str]:
    """``podman run`` with what this host needs: crun refuses a host with cgroups in hybrid mode, runc runs."""
    base = ["podman", "run", "--rm", *LIMITS]
    errors = []
    for runtime in ([], ["--runtime", "runc"] if shutil.which("runc") else None):
        if runtime is None:
            continue
        done = subprocess.run([*base, *runtime, image, "--version"], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            return [*base, *runtime]
        errors.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    pytest.skip(f"podman cannot run a container here: {'; '.join(errors)}")


class Container:
    """A detached container on the host's network, with a read-only root and named volumes of its own."""

    def __init__(self, run: list[str], image: str, args: list[str], env: dict[str, str],
                 volumes: dict[str, str]) -> None:
        self.name = f"spikehound-test-{uuid.uuid4().hex[:12]}"
        self.volumes = {f"{self.name}-{key}": path for key, path in volumes.items()}
        flags = ["-d", "--name", self.name, "--read-only", "--network", "host", "--health-interval", "disable"]
        for volume, path in self.volumes.items():
            flags += ["-v", f"{volume}:{path}"]
        for key, value in env.items():
            flags += ["-e", f"{key}={value}"]
        done = subprocess.run([*run, *flags, image, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman", "exec", self.name, *argv], capture_output=True, text=True, timeout=60)

    def healthy(self) -> bool:
        return subprocess.run(["podman", "healthcheck", "run", self.name], capture_output=True,
                              timeout=60).returncode == 0

    def logs(self) -> str:
        done = subprocess.run(["podman", "logs", self.name], capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr)[-4000:]

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "--force", "--volumes", "--time", "30", self.name], capture_output=True,
                       timeout=120)
        for volume in self.volumes:
            subprocess.run(["podman", "volume", "rm", "--force", volume], capture_output=True, timeout=60)


@pytest.fixture
def containers(podman_run: list[str], image: str) -> Iterator[list[Container]]:
    made: list[Container] = []
    yield made
    for container in reversed(made):  # the agent before the collector it drains to
        container.remove()


def test_the_image_runs_as_a_non_root_user_with_volumes_and_a_health_check(image: str):
    (config,) = json.loads(subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True,
                                          check=True, timeout=60).stdout)
    settings = config["Config"]
    assert settings["User"] == "10001:10001"
    assert set(settings["Volumes"]) == {"/var/lib/spikehound", "/var/spool/spikehound"}
    assert "healthcheck.py" in " ".join(config["Healthcheck"]["Test"])
    assert settings["Entrypoint"] == ["/opt/spikehound/bin/spikehound"]


def test_containers_take_otlp_through_the_agent_and_find_the_spike(podman_run: list[str], image: str,
                                                                    containers: list[Container]):
    api, grpc, http = free_port(), free_port(), free_port()
    agent_grpc, agent_http, agent_metrics = free_port(), free_port(), free_port()
    collector = Container(podman_run, image, ["collector"], {
        "SPIKEHOUND_COLLECTOR_API": f"127.0.0.1:{api}", "SPIKEHOUND_COLLECTOR_OTLP_GRPC": f"127.0.0.1:{grpc}",
        "SPIKEHOUND_COLLECTOR_OTLP_HTTP": f"127.0.0.1:{http}", "SPIKEHOUND_COLLECTOR_OTLP_TOKEN": TOKEN,
    }, {"data": "/var/lib/spikehound"})
    containers.append(collector)
    agent = Container(podman_run, image, ["agent"], {
        "SPIKEHOUND_AGENT_COLLECTOR": f"127.0.0.1:{grpc}", "SPIKEHOUND_AGENT_COLLECTOR_TOKEN": TOKEN,
        "SPIKEHOUND_AGENT_OTLP_GRPC": f"127.0.0.1:{agent_grpc}",
        "SPIKEHOUND_AGENT_OTLP_HTTP": f"127.0.0.1:{agent_http}",
        "SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{agent_metrics}",
    }, {"spool": "/var/spool/spikehound"})
    containers.append(agent)
    base = f"http://127.0.0.1:{api}"
    for container, url in ((collector, f"{base}/readyz"), (agent, f"http://127.0.0.1:{agent_metrics}/readyz")):
        try:
            eventually(lambda url=url: requests.get(url, timeout=2).status_code == 200, url, timeout=90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {container.name} logs:\n{container.logs()}") from exc
        assert container.healthy(), container.logs()  # the image's own health check agrees

    # Only the volumes are writable, and the daemons run as the image's user.
    assert collector.exec("id", "-u").stdout.strip() == "10001"
    refused = collector.exec("touch", "/opt/spikehound/x")
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    assert collector.exec("test", "-s", "/var/lib/spikehound/spikehound.db").returncode == 0

    # A slow feature query in a five-minute scenario: one spike, led by the gateway's route, caused by the query.
    send(f"http://127.0.0.1:{agent_http}", scenario_requests(Scenario("slow_db", "large", seed=3, minutes=5,
                                                                      onset_s=212.0, fault_s=60.0)))

    def resolved() -> list[dict[str, object]] | None:
        spikes = list_spikes(base)
        return spikes if spikes and all(s["state"] == "resolved" for s in spikes) else None

    try:
        spikes = eventually(resolved, "the spike through the collector's API", timeout=120, every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; collector logs:\n{collector.logs()}\nagent logs:\n{agent.logs()}") from exc
    (spike,) = spikes
    assert (spike["service"], spike["operation"]) == ("gateway", "POST /v1/predict")
    top = spike["causes"][0]
    assert (top["kind"], top["service"], top["operation"]) == ("span", "preprocess", "SELECT features"), top
