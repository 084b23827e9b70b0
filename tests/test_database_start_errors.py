"""A collector (or ``spikehound db upgrade``) that cannot use its database at start says so in one line, with what
to do, and exits with a status systemd acts on: 3 when PostgreSQL is down or unreachable (restarted, so it starts
once the database is back), 2 when ``storage.url`` names a SQLite path that cannot work (not restarted).

Real PostgreSQL connection attempts: a loopback port nothing listens on, a host name that cannot resolve
(``.invalid``), and a socket that accepts but never answers; real SQLite paths under a file and on a directory.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from spikehound.cli import main
from spikehound.collector.daemon import Collector
from spikehound.config import load
from spikehound.storage.engine import DatabaseUnavailable

SPIKEHOUND = str(Path(sys.executable).parent / "spikehound")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO) ")


def start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_") and k != "STATE_DIRECTORY"}
    return subprocess.run([SPIKEHOUND, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**clean, "HOME": str(tmp_path), "SPIKEHOUND_DATA_DIR": str(tmp_path / "data")})


def collector(tmp_path: Path, url: str) -> subprocess.CompletedProcess[str]:
    return start(tmp_path, "collector", "--db", url, "--api", "127.0.0.1:0", "--otlp-grpc", "127.0.0.1:0",
                 "--otlp-http", "127.0.0.1:0")


def the_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line that is not an informational log line; no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them) and never answers: a hung or filtered host."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        yield server.getsockname()[1]


def test_postgresql_down_is_one_line_and_status_3(tmp_path):
    port = free_port()
    done = collector(tmp_path, f"postgresql://app:pw-s3cret@127.0.0.1:{port}/spikehound")
    assert done.returncode == 3
    line = the_error(done)
    assert line.startswith("spikehound collector: storage.url postgresql://app:***@127.0.0.1:")
    assert f"at 127.0.0.1:{port}: connection refused: start PostgreSQL there" in line
    assert "pw-s3cret" not in done.stderr


def collector_start_error(tmp_path: Path, url: str) -> DatabaseUnavailable:
    """What a collector started in this process raises on ``url`` (the CLI prints it as its one line)."""
    cfg = load(env={}, flags={"storage.url": url, "data_dir": str(tmp_path), "collector.api": "127.0.0.1:0",
                              "collector.otlp_grpc": "127.0.0.1:0", "collector.otlp_http": "127.0.0.1:0"})
    with pytest.raises(DatabaseUnavailable) as raised:
        asyncio.run(Collector(cfg).start())
    return raised.value


def test_a_host_that_does_not_resolve_says_so(tmp_path):
    error = collector_start_error(tmp_path, "postgresql://app@db.spikehound-test.invalid/spikehound")
    assert error.status == 3
    assert "the host name db.spikehound-test.invalid does not resolve: correct it in storage.url" in str(error)


def test_a_host_that_never_answers_says_so(tmp_path, silent_server):
    error = collector_start_error(tmp_path, f"postgresql://app@127.0.0.1:{silent_server}/x?connect_timeout=2")
    assert error.status == 3
    assert "no answer (connection timeout expired): the host is down or unreachable" in str(error)


def test_db_upgrade_says_the_same_in_one_line(capsys):
    assert main(["db", "upgrade", "--db", f"postgresql://app@127.0.0.1:{free_port()}/spikehound"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spikehound db upgrade: storage.url postgresql://app@127.0.0.1:")
    assert "connection refused" in err


def test_a_sqlite_path_under_a_file_is_a_configuration_error(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    done = collector(tmp_path, f"sqlite:///{tmp_path}/not-a-dir/state/spikehound.db")
    assert done.returncode == 2
    assert f"{tmp_path}/not-a-dir is not a directory; or set storage.url" in the_error(done)


def test_a_sqlite_file_that_cannot_be_opened_is_a_configuration_error(tmp_path):
    (tmp_path / "spikehound.db").mkdir()  # a directory where the file should be: SQLite cannot open it
    error = collector_start_error(tmp_path, f"sqlite:///{tmp_path}/spikehound.db")
    assert error.status == 2
    assert f"cannot open or write the SQLite file {tmp_path}/spikehound.db (unable to open database file)" in str(error)


@pytest.mark.postgres
def test_a_database_that_does_not_exist_says_how_to_create_it(tmp_path, pg_server):
    error = collector_start_error(tmp_path, pg_server.url.rsplit("/", 1)[0] + "/no_such_database")
    assert error.status == 3
    assert 'database "no_such_database" does not exist: create it (createdb)' in str(error)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="runs the collector as another user")
def test_a_sqlite_directory_the_collector_cannot_reach_is_the_same_one_line_error(tmp_path):
    """A directory on the way the collector's user may not traverse: the storage.url line, not a bare errno."""
    locked = tmp_path / "locked"
    (locked / "sub").mkdir(parents=True)
    locked.chmod(0o700)  # root's; the collector runs as nobody
    data = Path(tempfile.mkdtemp(prefix="spikehound-data-"))
    try:
        data.chmod(0o777)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_") and k != "STATE_DIRECTORY"}
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SPIKEHOUND, "collector", "--db",
             f"sqlite:///{locked}/sub/spikehound.db", "--api", "127.0.0.1:0", "--otlp-grpc", "127.0.0.1:0",
             "--otlp-http", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={**clean, "HOME": str(data), "SPIKEHOUND_DATA_DIR": str(data)})
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    line = the_error(done)
    assert line.startswith(f"spikehound collector: storage.url sqlite:///{locked}/sub/spikehound.db: "), line
    assert "Permission denied" in line and "or set storage.url" in line, line
