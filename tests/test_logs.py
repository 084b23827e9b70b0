"""Logs as an operator reads them: plain lines (journald priorities under systemd), JSON on request, a log
file beside the journal, and never a secret, whatever a log line or an exception carries."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from sqlalchemy.engine import make_url

from harness.api_client import ApiClient
from harness.daemons import free_port
from harness.waiting import eventually
from spikehound import logs
from spikehound.config import load

SECRETS = {"SPIKEHOUND_COLLECTOR_API_TOKEN": "api-t0ken-7f3a9c", "SPIKEHOUND_COLLECTOR_OTLP_TOKEN": "otlp-t0ken-c41d2e"}
DB_PASSWORD = "db-pa55word-91b"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_a_secret_in_a_message_or_an_exception_never_reaches_the_log(tmp_path, fmt, restore_logging, capsys):
    log_file = tmp_path / "spikehound.log"
    logs.setup("debug", fmt, str(log_file), secrets=["s3cret-token", "pa55"])
    log = logging.getLogger("spikehound.test")
    log.info("sending with Authorization: Bearer %s", "s3cret-token")
    try:
        raise ConnectionError("could not connect to postgresql://app:pa55@db/spikehound")
    except ConnectionError:
        log.exception("storage failed")
    logging.getLogger().handlers[0].flush()

    for text in (capsys.readouterr().err, log_file.read_text()):
        assert "s3cret-token" not in text and "pa55" not in text
        assert "Bearer ***" in text and "postgresql://app:***@db/spikehound" in text
        if fmt == "json":
            lines = [json.loads(line) for line in text.splitlines()]
            assert [entry["level"] for entry in lines] == ["info", "error"]
            assert "app:***@db" in lines[1]["exception"]


RECEIVERS = """
[[alerts.receivers]]
name = "oncall-slack"
type = "slack"
url_secret = "env:SLACK_WEBHOOK_URL"

[[alerts.receivers]]
name = "ops"
url = "https://ops:pa55-w0rd@ops.example.com/hook"
signing_secret = "file:{signing_file}"
bearer_token = "ops-bearer-t0ken"
"""
SLACK_URL = "https://hooks.slack.com/services/T000/B000/XXXXSECRETXXXX"


def test_alert_receiver_secrets_never_reach_the_log(tmp_path, restore_logging, capsys):
    signing_file = tmp_path / "signing"
    signing_file.write_text("whsec-s3cret\n")
    path = tmp_path / "collector.toml"
    path.write_text(RECEIVERS.format(signing_file=signing_file))
    logs.configure(load(path, env={"SLACK_WEBHOOK_URL": SLACK_URL}))
    log = logging.getLogger("spikehound.test")
    log.warning("posting to %s failed", SLACK_URL)
    log.warning("signed with %s, sent Bearer %s", "whsec-s3cret", "ops-bearer-t0ken")
    log.warning("redirected to https://ops:pa55-w0rd@ops.example.com/hook")
    text = capsys.readouterr().err
    for secret in ("XXXXSECRETXXXX", "whsec-s3cret", "ops-bearer-t0ken", "pa55-w0rd"):
        assert secret not in text, secret
    assert "posting to *** failed" in text and "Bearer ***" in text and "https://ops:***@ops.example.com" in text


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    def healthy() -> bool:
        # A daemon that exited will not answer: the timeout's cause then says so.
        assert proc.poll() is None, f"the daemon exited with status {proc.poll()}"
        return requests.get(url, timeout=1).status_code == 200

    eventually(healthy, f"{url} to answer", timeout)


def run_collector(tmp_path: Path, db_url: str, *flags: str, env: dict[str, str] | None = None,
                  stderr_path: Path | None = None) -> tuple[subprocess.Popen[bytes], int, Path]:
    api, stderr_path = free_port(), stderr_path or tmp_path / "stderr.log"
    exe = str(Path(sys.executable).parent / "spikehound")
    with open(stderr_path, "wb") as err:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEHOUND_", "JOURNAL_STREAM"))}
        child_env.update(env or {})
        if env and env.get("JOURNAL_STREAM") == "stderr":  # as systemd sets it: our stderr's device and inode
            st = os.fstat(err.fileno())
            child_env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        proc = subprocess.Popen([exe, "collector", "--db", db_url, "--api", f"127.0.0.1:{api}",
                                 "--otlp-grpc", f"127.0.0.1:{free_port()}", "--otlp-http", f"127.0.0.1:{free_port()}",
                                 *flags], stdout=err, stderr=err, env=child_env)
    wait_healthy(f"http://127.0.0.1:{api}/healthz", proc)
    return proc, api, stderr_path


def test_the_collector_never_logs_its_tokens_or_database_password(tmp_path, pg_url):
    # The test server trusts loopback, so any password works.
    db_url = make_url(pg_url).set(password=DB_PASSWORD).render_as_string(hide_password=False)
    log_file = tmp_path / "collector.log"
    proc, api, stderr = run_collector(tmp_path, db_url, "--log-level", "debug",
                                      env={**SECRETS, "SPIKEHOUND_LOG_FILE": str(log_file)})
    try:
        token = SECRETS["SPIKEHOUND_COLLECTOR_API_TOKEN"]
        client = ApiClient(f"http://127.0.0.1:{api}", headers={"Authorization": f"Bearer {token}"})
        assert client.request("GET", "/api/v1/services", headers={"Authorization": None}).status_code == 401
        assert client.request("GET", "/api/v1/services",
                              headers={"Authorization": f"Bearer wrong-{token}"}).status_code == 401
        assert client.get("/api/v1/services").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    for text in (stderr.read_text(), log_file.read_text()):
        assert "storage postgresql+psycopg://postgres:***@" in text and "collector stopped" in text
        for secret in (*SECRETS.values(), DB_PASSWORD):
            assert secret not in text


def test_under_journald_lines_carry_a_priority_and_no_timestamp(tmp_path):
    proc, _api, stderr = run_collector(tmp_path, f"sqlite:///{tmp_path / 'spikehound.db'}",
                                       env={"JOURNAL_STREAM": "stderr"})
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    lines = stderr.read_text().splitlines()
    assert "<6>INFO spikehound: collector ready" in lines
    ours = [line for line in lines if " spikehound" in line]
    assert ours and all(line.startswith(("<6>INFO ", "<4>WARNING ", "<3>ERROR ")) for line in ours), ours


def test_without_journald_lines_carry_their_own_time(tmp_path):
    proc, _api, stderr = run_collector(tmp_path, f"sqlite:///{tmp_path / 'spikehound.db'}",
                                       env={"JOURNAL_STREAM": "8:12345"})  # another stream: not ours
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    ready = [line for line in stderr.read_text().splitlines() if line.endswith("spikehound: collector ready")]
    assert len(ready) == 1 and ready[0][:4].isdigit() and " INFO " in ready[0]


def test_a_log_file_that_cannot_be_opened_is_one_line_at_start(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "spikehound"), "collector", "--db",
                           f"sqlite:///{tmp_path / 'x.db'}"], capture_output=True, text=True, timeout=60,
                          env={"HOME": str(tmp_path), "SPIKEHOUND_LOG_FILE": str(tmp_path / "missing" / "c.log")})
    assert done.returncode == 2  # a configuration error: the unit does not restart into it
    assert done.stderr.strip().splitlines() == [
        f"spikehound: bad configuration: log.file: cannot open {tmp_path / 'missing' / 'c.log'}: "
        "No such file or directory"]

