"""URLs in what spikehound shows and logs: a password and every query value hidden (webhook keys and tokens
live there, ``?key=...``), libpq's harmless settings (``sslmode``) kept; ``check-config`` run as a user runs it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spikehound import logs
from spikehound.config import load, redact_url, secret_values

SPIKEHOUND = str(Path(sys.executable).parent / "spikehound")
WEBHOOK = "http://127.0.0.1:9/hooks/alert?channel=ops&key=AIzaSy-webhook-s3cret&token=tok%2Bs3cret-value"
DATABASE = "postgresql://app:db-pass-s3cret@db:5432/spikehound?sslmode=require&sslpassword=tls-key-s3cret"


def test_check_config_hides_a_webhooks_query_values_and_the_databases(tmp_path):
    path = tmp_path / "collector.toml"
    path.write_text(f'[storage]\nurl = "{DATABASE}"\n\n[[alerts.receivers]]\nname = "ops"\nurl = "{WEBHOOK}"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_") and k != "STATE_DIRECTORY"}
    done = subprocess.run([SPIKEHOUND, "check-config", "--config", str(path)], capture_output=True, text=True,
                          timeout=60, env={**clean, "HOME": str(tmp_path)}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    assert 'url = "http://127.0.0.1:9/hooks/alert?channel=***&key=***&token=***"' in done.stdout
    assert 'url = "postgresql://app:***@db:5432/spikehound?sslmode=require&sslpassword=***"' in done.stdout


@pytest.mark.parametrize(("url", "shown"), [
    ("https://hooks.example/in?key=abc#frag", "https://hooks.example/in?key=***#***"),
    ("https://hooks.example/in?s3cret-alone", "https://hooks.example/in?***"),
    ("postgresql://app@db/x?connect_timeout=5&application_name=spikehound",
     "postgresql://app@db/x?connect_timeout=5&application_name=spikehound"),
    ("sqlite:///var/lib/spikehound/spikehound.db", "sqlite:///var/lib/spikehound/spikehound.db"),
])
def test_what_is_hidden_and_what_is_kept(url, shown):
    assert redact_url(url) == shown


def test_log_lines_hide_the_query_values_of_configured_urls(tmp_path):
    path = tmp_path / "collector.toml"
    path.write_text(f'[storage]\nurl = "{DATABASE}"\n\n[[alerts.receivers]]\nname = "ops"\nurl = "{WEBHOOK}"\n')
    line = logs.RedactingFormatter(logging.Formatter("%(message)s"), secret_values(load(path, env={})))
    said = line.format(logging.makeLogRecord({
        "msg": "psycopg: sslpassword=%s rejected; POST %s failed", "args": ("tls-key-s3cret", WEBHOOK)}))
    assert "s3cret" not in said, said
    assert said.startswith("psycopg: sslpassword=*** rejected; POST http://127.0.0.1:9/hooks/alert?channel=ops&key=***")


def check_config(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    return subprocess.run([SPIKEHOUND, "check-config", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env={**clean, "HOME": str(tmp_path), **(env or {})})


@pytest.mark.parametrize(("how", "key"), [
    ("flag", "storage.url"), ("env", "storage.url"), ("toml", "alerts.receivers"),
])
@pytest.mark.parametrize("url", ["postgresql://u:pw-s3cret@[::1/d", "postgresql://u:pw-s3cret@db:99999/d",
                                 "postgresql://u:pw-s3cret@db:port/d"])
def test_a_url_that_cannot_be_parsed_is_one_line_naming_the_key(tmp_path, how, key, url):
    args: list[str] = []
    env: dict[str, str] = {}
    if how == "flag":
        args = ["--db", url]
    elif how == "env":
        env = {"SPIKEHOUND_STORAGE_URL": url}
    else:
        hook = url.replace("postgresql://", "http://")
        (tmp_path / "c.toml").write_text(f'[[alerts.receivers]]\nname = "w"\ntype = "webhook"\nurl = "{hook}"\n'
                                         'signing_secret = "abcdefgh12"\n')
        args = ["--config", str(tmp_path / "c.toml")]
    done = check_config(tmp_path, *args, env=env)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "pw-s3cret" not in done.stdout + done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"spikehound: bad configuration: {key}"), line


@pytest.mark.parametrize("url", ["postgresql://u:pw-s3cret@[::1/d", "http://[::1/h?key=s3cret", "http://h:99999/x",
                                 "http://u:pw-s3cret@h:port/x"])
def test_redact_url_never_raises_and_hides_what_it_cannot_read(url):
    shown = redact_url(url)
    assert "s3cret" not in shown


def test_a_user_name_without_a_password_is_hidden_but_a_database_role_is_kept(tmp_path):
    assert redact_url("http://ghp_TokenAsUser123@127.0.0.1:9/h") == "http://***@127.0.0.1:9/h"
    assert redact_url("https://user:pw@hooks.example/in") == "https://user:***@hooks.example/in"
    assert redact_url("postgresql://app@db/x") == "postgresql://app@db/x"
    (tmp_path / "c.toml").write_text('[[alerts.receivers]]\nname = "w"\ntype = "webhook"\n'
                                     'url = "http://ghp_TokenAsUser123@127.0.0.1:9/h"\n'
                                     'signing_secret = "abcdefgh12"\n')
    done = check_config(tmp_path, "--config", str(tmp_path / "c.toml"))
    assert done.returncode == 0, done.stderr
    assert "ghp_TokenAsUser123" not in done.stdout
    assert 'url = "http://***@127.0.0.1:9/h"' in done.stdout
    cfg = load(tmp_path / "c.toml", env={})
    assert "ghp_TokenAsUser123" in secret_values(cfg)  # and kept out of log lines
