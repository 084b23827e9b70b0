"""The [alerts] configuration: receivers and routes as TOML arrays of tables, secrets kept out of sight."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spikehound.config import ConfigError, effective, load, to_toml

SPIKEHOUND = str(Path(sys.executable).parent / "spikehound")
SLACK_URL = "https://hooks.slack.com/services/T000/B000/XXXXSECRETXXXX"

GOOD = """
[collector]
public_url = "https://spikehound.example.com"

[alerts]
max_attempts = 5

[[alerts.receivers]]
name = "oncall-slack"
type = "slack"
url_secret = "env:SLACK_WEBHOOK_URL"

[[alerts.receivers]]
name = "pager"
type = "webhook"
url = "https://pager.example.com/hook"
signing_secret = "file:{secret_file}"

[[alerts.routes]]
receiver = "pager"
name = "gpu"
cause_kinds = ["resource"]
cause_resources = ["hw.gpu.utilization"]
min_ratio = 1.5

[[alerts.routes]]
receiver = "oncall-slack"
services = ["gateway", "model-*"]
min_duration_seconds = 30
"""


def write_good(tmp_path: Path) -> Path:
    secret = tmp_path / "signing"
    secret.write_text("whsec-s3cret\n")
    path = tmp_path / "spikehound.toml"
    path.write_text(GOOD.format(secret_file=secret))
    return path


def test_receivers_and_routes_load_from_toml_with_secrets_from_env_and_files(tmp_path):
    cfg = load(write_good(tmp_path), env={"SLACK_WEBHOOK_URL": SLACK_URL})
    a = cfg.alerts
    assert [r.name for r in a.receivers] == ["oncall-slack", "pager"]
    assert a.receivers[0].url_secret == SLACK_URL and a.receivers[1].signing_secret == "whsec-s3cret"
    assert [(r.name, r.receiver) for r in a.routes] == [("gpu", "pager"), ("oncall-slack", "oncall-slack")]
    assert a.routes[1].services == ["gateway", "model-*"] and a.routes[1].min_duration_seconds == 30
    assert a.max_attempts == 5

    shown = to_toml(effective(cfg))
    assert "XXXXSECRETXXXX" not in shown and "whsec-s3cret" not in shown
    assert tomllib.loads(shown) == effective(cfg)
    assert tomllib.loads(shown)["alerts"]["receivers"][0]["url_secret"] == "***"


def test_routes_can_come_from_the_environment_as_json(tmp_path):
    cfg = load(env={"SPIKEHOUND_ALERTS_RECEIVERS": '[{"name": "local", "url": "http://127.0.0.1:9000/hook"}]',
                    "SPIKEHOUND_ALERTS_ROUTES": '[{"receiver": "local", "min_ratio": 2}]'})
    assert cfg.alerts.routes[0].min_ratio == 2.0 and cfg.alerts.routes[0].name == "local"


@pytest.mark.parametrize(("text", "message"), [
    ('[[alerts.routes]]\nreceiver = "nobody"\n', "alerts.routes (from {path}): entry 1: receiver 'nobody' is not "
                                                 "one of alerts.receivers (none configured)"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "https://hooks.example.com/a"\n',
     "entry 1 (x): a webhook beyond loopback needs signing_secret"),
    ('[[alerts.receivers]]\nname = "x"\ntype = "slack"\nurl = "https://a/b"\nurl_secret = "https://a/c"\n',
     "give exactly one of url and url_secret"),
    ('[[alerts.receivers]]\nname = "x"\ntype = "teams"\nurl = "http://127.0.0.1/"\n',
     "alerts.receivers (from {path}): entry 1: type: expected one of slack, webhook, got 'teams'"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "ftp://127.0.0.1/"\n', "expected an http:// or https:// URL"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "http://127.0.0.1/"\n[[alerts.receivers]]\nname = "x"\n'
     'url = "http://127.0.0.1/"\n', "entry 2: the name 'x' is used twice"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "http://127.0.0.1/"\n[[alerts.routes]]\nreceiver = "x"\n'
     'srvices = ["a"]\n', "alerts.routes (from {path}): entry 1: srvices: unknown setting"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "http://127.0.0.1/"\n[[alerts.routes]]\nreceiver = "x"\n'
     'cause_kinds = ["gpu"]\n', "cause_kinds ['gpu'] are not span, service, network or resource"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "http://127.0.0.1/"\n[[alerts.routes]]\nreceiver = "x"\n'
     'min_ratio = 0.5\n', "min_ratio is p99 over baseline and must be at least 1"),
    ('[[alerts.receivers]]\nname = "x"\nurl = "http://127.0.0.1/"\nsigning_secret = "env:NOT_SET_ANYWHERE"\n',
     "signing_secret names the environment variable NOT_SET_ANYWHERE, which is not set"),
    ('[alerts]\nreceivers = "oops"\n', "alerts.receivers (from {path}): expected a JSON array of tables"),
])
def test_a_bad_alert_setting_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(path, env={})
    assert message.format(path=path) in str(err.value)
    assert "\n" not in str(err.value)


def test_check_config_never_prints_the_slack_url_or_signing_secret(tmp_path):
    path = write_good(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    done = subprocess.run([SPIKEHOUND, "check-config", "--config", str(path)], capture_output=True, text=True,
                          env={**env, "HOME": str(tmp_path), "SLACK_WEBHOOK_URL": SLACK_URL}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "XXXXSECRETXXXX" not in done.stdout + done.stderr and "whsec-s3cret" not in done.stdout
    assert tomllib.loads(done.stdout)["alerts"]["routes"][0]["cause_resources"] == ["hw.gpu.utilization"]



def example_with_its_slack_receiver(tmp_path: Path) -> Path:
    """systemd/collector.toml with its commented-out receiver and route examples switched on."""
    text = (Path(__file__).parents[1] / "systemd" / "collector.toml").read_text()
    start = text.index("# [[alerts.receivers]]")
    end = text.index("\n\n", start)
    path = tmp_path / "collector.toml"
    path.write_text(text[:start] + "\n".join(line.removeprefix("#").removeprefix(" ")
                                             for line in text[start:end].splitlines()) + text[end:])
    return path


def test_the_example_slack_receiver_reads_its_url_from_the_environment(tmp_path):
    path = example_with_its_slack_receiver(tmp_path)
    assert 'url_secret = "env:SPIKEHOUND_SLACK_WEBHOOK_URL"' in path.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    done = subprocess.run([sys.executable, "-m", "spikehound.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1],
                          env={**env, "HOME": str(tmp_path), "SPIKEHOUND_SLACK_WEBHOOK_URL": SLACK_URL})
    assert done.returncode == 0, done.stderr
    assert "XXXXSECRETXXXX" not in done.stdout + done.stderr
    assert tomllib.loads(done.stdout)["alerts"]["receivers"][0]["url_secret"] == "***"
    # A SPIKEHOUND_ variable that no receiver names must be a setting: a typo is still refused.
    with pytest.raises(ConfigError, match=r"^slack_webhook_url \(from SPIKEHOUND_SLACK_WEBHOOK_URL\): unknown"):
        load(env={"SPIKEHOUND_SLACK_WEBHOOK_URL": SLACK_URL})
