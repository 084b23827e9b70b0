"""The distribution: ``python -m build`` makes an sdist and, from it, a wheel that installs into a fresh virtual
environment and runs there, beside packages of its own that are called agent, collector, detectors and storage.

The wheel and the environment are made once per source tree (kept under build/test-dist/ by a hash of the
sources). The fresh environment gets the wheel itself with pip, and its dependencies by a path to this environment's
site-packages (nothing is downloaded); a path in a ``.pth`` file does not run the ``.pth`` files it names, so
this checkout's editable install of spikehound stays out of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import requests

from harness.ports import free_port
from harness.scenario_io import PROTOBUF
from harness.scenarios.traffic import Scenario
from harness.waiting import eventually
from spikehound import __version__
from spikehound.otlp import encode_spans

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "test-dist"
COMPONENTS = ("agent", "collector", "detectors", "storage")
# What a running install needs besides the Python modules.
WEB = "spikehound/collector/web"
MIGRATIONS = "spikehound/storage/migrations"
DATA_FILES = (f"{WEB}/static/spikehound.js", f"{WEB}/static/spikehound.css", f"{WEB}/static/vendor/uPlot.iife.min.js",
              f"{WEB}/templates/spike.html", f"{MIGRATIONS}/script.py.mako", f"{MIGRATIONS}/env.py",
              f"{MIGRATIONS}/versions/0001_initial.py")


def _inputs() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "pyproject.toml",
                             "README.md", "spikehound"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({n for n in listed.split("\0") if n and (ROOT / n).is_file()})


@pytest.fixture(scope="module")
def dist() -> Path:
    """A folder with the sdist and the wheel ``python -m build`` made from a copy of this tree's sources, and
    ``venv/``: a fresh virtual environment with packages named after the components, then the wheel, installed.

    Made once for the sources as they are (under a lock: pytest-xdist workers wait for the first one), and
    kept until they change."""
    names = _inputs()
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (ROOT / name).read_bytes() + b"\0")
    folder = CACHE / h.hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            _build(names, folder)
            _install(folder)
            (folder / "done").touch()
        for old in CACHE.iterdir():  # what was made from sources that have changed since
            if old.is_dir() and old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


def _build(names: list[str], folder: Path) -> None:
    with tempfile.TemporaryDirectory() as work:
        src = Path(work)
        for name in names:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
        # Without isolation: the build backend already installed here is used and nothing is downloaded.
        done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(folder), str(src)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _install(folder: Path) -> None:
    env = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(env / "bin/python"), "-c", where], capture_output=True, text=True,
                               check=True).stdout.strip())
    for name in COMPONENTS:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"WHO = 'the local {name}'\n")
    (site / "spikehound-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = folder.glob("spikehound-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin/python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)


@pytest.fixture(scope="module")
def venv(dist: Path) -> Path:
    return dist / "venv"


def _run(env: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEHOUND_", "PYTHON"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=clean, cwd=env)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Until ``url`` answers 200; a daemon that exited, or never got ready, fails with its log."""
    def ready() -> str | None:
        if proc.poll() is not None:
            return "exited"
        return "ready" if requests.get(url, timeout=2).status_code == 200 else None

    try:
        state = eventually(ready, url, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its log ends:\n{log.read_text()[-3000:]}") from exc
    assert state == "ready", f"{proc.args[:2]} exited with {proc.returncode}: {log.read_text()[-3000:]}"


def test_the_wheel_and_the_sdist_hold_one_package_with_its_data_files(dist: Path):
    (wheel,) = dist.glob("spikehound-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"spikehound", f"spikehound-{__version__}.dist-info"}
    assert set(DATA_FILES) <= set(names), set(DATA_FILES) - set(names)
    assert [n for n in names if n.split("/")[1:2] == ["demo"]], "the demo is not in the wheel"
    entry_points = zipfile.ZipFile(wheel).read(f"spikehound-{__version__}.dist-info/entry_points.txt").decode()
    assert "spikehound = spikehound.cli:main" in entry_points

    (sdist,) = dist.glob("spikehound-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", *DATA_FILES} <= members


def test_the_installed_wheel_and_local_packages_named_like_its_components_both_import(venv: Path):
    probe = ("import importlib, sys\n"
             f"for name in {COMPONENTS!r}:\n"
             "    local = importlib.import_module(name)\n"
             "    ours = importlib.import_module('spikehound.' + name)\n"
             "    print(name, local.WHO, ours.__file__, sep='|')\n"
             "import spikehound.agent.daemon, spikehound.collector.daemon, spikehound.storage.migrate\n"
             "import spikehound.detectors.engine, spikehound.torch_profiling\n")
    done = _run(venv, str(venv / "bin/python"), "-c", probe)
    assert done.returncode == 0, done.stderr
    site = str(venv)
    for line, name in zip(done.stdout.splitlines(), COMPONENTS, strict=True):
        shown, who, path = line.split("|")
        assert (shown, who) == (name, f"the local {name}")
        assert path.startswith(site) and f"/spikehound/{name}/" in path, path  # the wheel's, not this checkout's


def test_the_installed_commands_run_the_collector_and_the_agent(venv: Path, tmp_path: Path):
    exe = str(venv / "bin/spikehound")
    done = _run(venv, exe, "--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"spikehound {__version__}")
    done = _run(venv, exe, "demo", "--help")
    assert done.returncode == 0 and "--faults" in done.stdout, done.stderr

    api, grpc, http = free_port(), free_port(), free_port()
    agent_grpc, agent_http, agent_metrics = free_port(), free_port(), free_port()
    logs = tmp_path / "collector.log", tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEHOUND_", "PYTHON"))}
    env.update({"SPIKEHOUND_DATA_DIR": str(tmp_path), "SPIKEHOUND_AGENT_METRICS_LISTEN": f"127.0.0.1:{agent_metrics}"})
    with logs[0].open("wb") as clog, logs[1].open("wb") as alog:
        collector = subprocess.Popen([exe, "collector", "--db", f"sqlite:///{tmp_path / 'spikehound.db'}",
                                      "--api", f"127.0.0.1:{api}", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                      "--otlp-http", f"127.0.0.1:{http}"], stdout=clog, stderr=clog, env=env)
        agent = subprocess.Popen([exe, "agent", "--collector", f"127.0.0.1:{grpc}", "--otlp-grpc",
                                  f"127.0.0.1:{agent_grpc}", "--otlp-http", f"127.0.0.1:{agent_http}"],
                                 stdout=alog, stderr=alog, env=env)
        try:
            base = f"http://127.0.0.1:{api}"
            _wait_ready(collector, f"{base}/readyz", logs[0])
            _wait_ready(agent, f"http://127.0.0.1:{agent_metrics}/readyz", logs[1])
            # The migrations ran from the installed package, and the web page's files are served from it.
            assert requests.get(f"{base}/api/v1/spikes", timeout=5).json()["spikes"] == []
            page = requests.get(f"{base}/", timeout=5)
            assert page.status_code == 200 and "spikehound" in page.text
            script = requests.get(f"{base}/ui/static/spikehound.js", timeout=5)
            assert script.status_code == 200 and len(script.content) > 1000

            # A span sent to the installed agent is stored by the installed collector.
            batch = next(b for b in Scenario("slow_db", seed=1, minutes=1).batches() if b.spans)
            sent = requests.post(f"http://127.0.0.1:{agent_http}/v1/traces", headers=PROTOBUF, timeout=10,
                                 data=encode_spans(batch.spans).SerializeToString())
            assert sent.status_code == 200, sent.text
            trace_id = batch.spans[0].trace_id.hex()
            eventually(lambda: requests.get(f"{base}/api/v1/traces/{trace_id}", timeout=2).status_code == 200,
                       "the trace to reach the collector through the agent", timeout=30)
        finally:
            for proc in (agent, collector):
                proc.terminate()
            for proc in (agent, collector):
                proc.wait(60)
    assert collector.returncode == 0, logs[0].read_text()[-3000:]
    assert agent.returncode == 0, logs[1].read_text()[-3000:]
