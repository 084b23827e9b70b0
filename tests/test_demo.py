"""`spikehound demo` end to end, shortened for CI, and every `curl` example of the README against its collector.

One demo run (three faults: CPU-bound preprocessing, a network delay through
the proxy and the SIMULATED GPU's throttling) is shared by the module: it must
find and explain each, name the function that burns the CPU first in the CPU
fault's profile diff (report, API, CLI, spike page), keep its collector up
(``--keep``), answer every ``curl`` line of README.md
(parsed from the README, so the examples cannot drift from what works), and
exit 0 when stopped.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.chromium import CHROMIUM, CHROMIUM_ARGS
from harness.daemons import free_port

ROOT = Path(__file__).resolve().parents[1]
README_API = "localhost:8470"
KEPT = "collector keeps running at"
# Enough warm-up for 6 learned windows of 5 s, three faults, and short recoveries: about 2 minutes on 2 cores.
DEMO_ARGS = ["--faults", "cpu,network,gpu", "--warmup", "40", "--fault-seconds", "15", "--recover-seconds", "5"]


def readme_curl_examples() -> list[tuple[str, str]]:
    """(id, bash script) per ``curl`` line of the README's sh blocks.

    A script carries what its block's earlier lines set up, so that it passes in any order: their
    ``VAR=$(...)`` assignments, which later lines use, and their ``POST``s (output dropped), whose resources
    later lines list. An assignment line's own script prints the value it assigned.
    """
    examples = []
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    for block in blocks:
        before: list[str] = []
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if "curl " not in command:
                continue
            assigned = re.match(r"^([A-Z_]+)=\$\(", command)
            shown = f'\nprintf "%s" "${assigned[1]}"' if assigned else ""
            examples.append((command[:70], "\n".join([*before, command]) + shown))
            if assigned:
                before.append(command)
            elif "-X POST" in command:
                before.append(command + " >/dev/null")
    return examples


@dataclass
class DemoRun:
    proc: subprocess.Popen[str]
    api_port: int
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)
    returncode: int | None = None

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, marker: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                return False
            self.lines.append(line)
            if marker in line:
                return True
        return False

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        """Ctrl-C, as a user stops ``--keep``; the exit status then is the demo's verdict."""
        if self.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            self.returncode = self.proc.wait(90)
            self.wait_for("finished in", 10)
            self.close()
        return self.returncode

    def close(self) -> None:
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoRun]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEHOUND_", "OTEL_"))}
    proc = subprocess.Popen([sys.executable, "-m", "spikehound.cli", "demo", *DEMO_ARGS,
                             "--api", f"127.0.0.1:{port}", "--keep"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run = DemoRun(proc, port)
    run.wait_for(KEPT, timeout=240)
    yield run
    try:
        run.stop()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        run.close()


@pytest.mark.slow
def test_the_short_demo_finds_and_explains_each_injected_fault(demo: DemoRun):
    out = demo.output
    assert KEPT in out, out[-3000:]
    assert "SHORT demo windows" in out and "SIMULATED" in out
    assert "OK: 3 of 3 faults found and explained by their top cause" in out, out[-3000:]
    table = out.split("FAULT ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(table) == 3
    cpu, network, gpu = table
    assert cpu.startswith("CPU-bound preprocessing") and "resize of preprocess" in cpu
    assert network.startswith("network delay on one hop") and "[network] hop gateway -> model-server" in network
    assert gpu.startswith("GPU stall (SIMULATED GPU)")
    assert "nvidia.gpu.throttle" in gpu or "hw.gpu.utilization" in gpu or "forward of model-server" in gpu
    assert all(row.rstrip().endswith("yes") for row in table)
    assert f"API  http://127.0.0.1:{demo.api_port}/api/v1/spikes" in out
    assert f"web  http://127.0.0.1:{demo.api_port}/" in out


def test_the_readme_has_curl_examples_for_every_read_endpoint():
    urls = " ".join(script for _, script in readme_curl_examples())
    for path in ("/api/v1/spikes", "/api/v1/spikes/$SPIKE", "/api/v1/traces/$TRACE", "/api/v1/services",
                 "/api/v1/latency", "/api/v1/metrics", "/api/v1/hosts", "/metrics"):
        assert f"{README_API}{path}" in urls


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for _, s in readme_curl_examples()], ids=[i for i, _ in readme_curl_examples()])
def test_readme_curl_example_works_against_the_demo(demo: DemoRun, script: str):
    if KEPT not in demo.output:
        pytest.fail("the demo did not keep its collector up:\n" + demo.output[-2000:])
    prelude = ("set -euo pipefail\n"
               "curl() { command curl --fail-with-body --show-error --max-time 30 \"$@\"; }\n")
    body = script.replace(README_API, f"127.0.0.1:{demo.api_port}")
    run = subprocess.run(["bash", "-c", prelude + body], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"{script}\n{run.stdout[-1000:]}\n{run.stderr[-1000:]}"
    own = script.rsplit("\n", 1)[-1]  # the example's own line: the ones before only set it up
    if own.startswith("printf"):  # an assignment: the id it picked
        assert re.fullmatch(r"[0-9a-f]{16,32}", run.stdout), run.stdout[:200]
        return
    if "localhost:8470/metrics" in own:
        assert "spikehound_ingest_stored_total" in run.stdout
        return
    answer = json.loads(run.stdout)
    if "-X POST" in own:  # a created resource (a silence) comes back with its id
        assert answer.get("id"), f"{script}\n{run.stdout[:1000]}"
        return
    # Against the demo every example shows something: no empty list where the demo produced data.
    lists = [v for v in answer.values() if isinstance(v, list)]
    assert lists and all(lists), f"{script}\n{run.stdout[:1000]}"


def cpu_spike_id(demo: DemoRun) -> str:
    """The id of the CPU fault's spike, from the demo's report (its evidence line)."""
    report = demo.output.split("CPU-bound preprocessing: expected", 1)[1].split("\n\n", 1)[0]
    found = re.search(r"/api/v1/spikes/([0-9a-f]+)\)", report)
    assert found, report
    return found[1]


@pytest.mark.slow
def test_the_cpu_faults_profile_names_the_burning_function_first_in_the_report_api_and_cli(demo: DemoRun):
    if KEPT not in demo.output:
        pytest.fail("the demo did not keep its collector up:\n" + demo.output[-2000:])
    report = demo.output.split("CPU-bound preprocessing: expected", 1)[1].split("\n\n", 1)[0]
    assert "  profile:   burn_cpu in preprocess: " in report, report
    spike = cpu_spike_id(demo)
    api = f"http://127.0.0.1:{demo.api_port}"
    with urllib.request.urlopen(f"{api}/api/v1/spikes/{spike}/profile", timeout=30) as answer:
        profile = json.load(answer)
    first = profile["profiles"][0]
    assert (first["service"], first["kind"]) == ("preprocess", "cpu"), profile
    top = first["changes"][0]
    assert top["function"] == "burn_cpu" and top["file"].endswith("spikehound/demo/stack.py"), top
    assert top["self_spike"] > top["self_baseline"]
    cli = subprocess.run([sys.executable, "-m", "spikehound.cli", "spike", spike, "--api-url", api],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    section = cli.stdout.split("  Profile: preprocess on ", 1)[1]
    assert section.splitlines()[1].startswith("    1. burn_cpu in preprocess: "), cli.stdout


@pytest.mark.slow
def test_the_cpu_faults_spike_page_shows_the_burning_function_first(demo: DemoRun):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: make test installs Debian's chromium (tests/apt-install.sh)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{demo.api_port}/ui/spikes/{cpu_spike_id(demo)}")
            page.wait_for_selector("html[data-ready='1']")
            section = page.locator("section.profile")
            assert section.locator("h3").first.inner_text().startswith("preprocess on ")
            assert section.locator("table.profile tbody tr").first.locator("td").first.inner_text() == "burn_cpu"
            assert section.locator(".flame .fbox[data-function='burn_cpu']").first.is_visible()
        finally:
            browser.close()


@pytest.mark.slow
@pytest.mark.ends_shared_fixture
def test_the_demo_exits_0_when_its_kept_collector_is_stopped(demo: DemoRun):
    assert demo.stop() == 0, demo.output[-3000:]
    assert "finished in" in demo.output
