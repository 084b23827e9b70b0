"""Configuration layers and errors, the ``spikehound`` command line, and the API's time formats."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spikehound.config import ConfigError, HostPort, effective, load, redact_url, to_toml
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import current_revision, head_revision
from spikehound.timefmt import parse_time, rfc3339

SPIKEHOUND = str(Path(sys.executable).parent / "spikehound")
NS = 1_000_000_000


def write(tmp_path: Path, text: str, name: str = "spikehound.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- layers -----------------------------------------------------------------------------------


def test_defaults(tmp_path):
    cfg = load(env={"SPIKEHOUND_DATA_DIR": str(tmp_path)})

    assert cfg.collector.api == HostPort("127.0.0.1", 8470)
    assert cfg.collector.otlp_grpc == HostPort("0.0.0.0", 4317)
    assert cfg.collector.otlp_http == HostPort("0.0.0.0", 4318)
    assert cfg.database_url == f"sqlite:///{tmp_path / 'spikehound.db'}"
    assert (cfg.log.level, cfg.storage.sqlite_synchronous, cfg.collector.api_token) == ("info", "NORMAL", "")


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path):
    path = write(tmp_path, """
data_dir = "/srv/spikehound"

[collector]
api = "127.0.0.1:1001"
queue_capacity = 1000
window_seconds = 5

[log]
level = "debug"
""")
    env = {"SPIKEHOUND_COLLECTOR_API": "127.0.0.1:2002", "SPIKEHOUND_COLLECTOR_QUEUE_CAPACITY": "2000",
           "SPIKEHOUND_STORAGE_URL": "sqlite:////srv/env.db", "OTHER_VARIABLE": "ignored"}
    flags = {"collector.api": "127.0.0.1:3003", "storage.url": None, "log.format": "json"}

    cfg = load(path, env=env, flags=flags)

    assert cfg.collector.api == HostPort("127.0.0.1", 3003)  # flag over environment over file
    assert cfg.collector.queue_capacity == 2000  # environment over file
    assert cfg.storage.url == "sqlite:////srv/env.db"  # a flag left unset (None) does not count
    assert cfg.collector.window_seconds == 5.0  # file over default
    assert (cfg.log.level, cfg.log.format) == ("debug", "json")
    assert cfg.data_dir == "/srv/spikehound"
    assert cfg.collector.otlp_grpc == HostPort("0.0.0.0", 4317)  # default


def test_the_file_may_be_named_by_the_environment(tmp_path):
    path = write(tmp_path, "[collector]\nmax_streams = 77\n")

    assert load(env={"SPIKEHOUND_CONFIG": str(path)}).collector.max_streams == 77
    env = {"SPIKEHOUND_CONFIG": str(path), "SPIKEHOUND_COLLECTOR_MAX_STREAMS": "5"}
    assert load(env=env).collector.max_streams == 5


def test_variables_of_the_client_commands_are_not_settings():
    assert load(env={"SPIKEHOUND_API_URL": "http://collector:8470"}).collector.api == HostPort("127.0.0.1", 8470)


@pytest.mark.parametrize(("text", "expected"), [
    ("[::1]:8470", HostPort("::1", 8470)),
    ("localhost:0", HostPort("localhost", 0)),
    (" 10.0.0.1:4317 ", HostPort("10.0.0.1", 4317)),
])
def test_listen_addresses(text, expected):
    assert HostPort.parse(text) == expected
    assert HostPort.parse(str(expected)) == expected


# --- errors -----------------------------------------------------------------------------------

FILE_ERRORS = [
    ('[collector]\nqueue_capacity = "lots"\n', "collector.queue_capacity", "expected a whole number, got 'lots'"),
    ("[collector]\nqueue_capacity = 2.5\n", "collector.queue_capacity", "expected a whole number"),
    ("[collector]\nqueue_capacity = 0\n", "collector.queue_capacity", "must be greater than 0, got 0"),
    ("[collector]\nallowed_lateness_seconds = -1\n", "collector.allowed_lateness_seconds", "must not be negative"),
    ("[collector]\nwindow_seconds = nan\n", "collector.window_seconds", "expected a finite number"),
    ("[collector]\nwindow_seconds = true\n", "collector.window_seconds", "expected a number"),
    ('[collector]\napi = "nowhere"\n', "collector.api", "expected HOST:PORT, got 'nowhere'"),
    ('[collector]\notlp_grpc = "0.0.0.0:70000"\n', "collector.otlp_grpc", "port 70000 is out of range"),
    ("[collector]\napi_token = 123\n", "collector.api_token", "expected a string"),
    ('[storage]\nsqlite_synchronous = "OFF"\n', "storage.sqlite_synchronous", "expected one of NORMAL, FULL"),
    ('[storage]\nurl = "mysql://app@db/x"\n', "storage.url", "expected a sqlite:// or postgresql:// URL"),
    ('[log]\nlevel = "loud"\n', "log.level", "expected one of debug, info, warning, error, got 'loud'"),
    ("[collector]\nqueue_capacty = 5\n", "collector.queue_capacty", "unknown setting"),
    ('[colector]\napi = "127.0.0.1:1"\n', "colector.api", "unknown setting"),
    ("verbose = true\n", "verbose", "unknown setting"),
    ('storage = "sqlite:///x.db"\n', "storage", "unknown setting"),
    ("[collector.limits]\nqueue = 5\n", "collector.limits", "unknown setting"),
]


@pytest.mark.parametrize(("text", "key", "reason"), FILE_ERRORS)
def test_a_bad_file_setting_is_one_line_naming_key_file_and_reason(tmp_path, text, key, reason):
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as caught:
        load(path, env={})

    assert str(caught.value).startswith(f"{key} (from {path}): {reason}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("SPIKEHOUND_COLLECTOR_QUEUE_CAPACITY", "many",
     "collector.queue_capacity (from SPIKEHOUND_COLLECTOR_QUEUE_CAPACITY): expected a whole number, got 'many'"),
    ("SPIKEHOUND_COLLECTOR_WINDOW_SECONDS", "-1",
     "collector.window_seconds (from SPIKEHOUND_COLLECTOR_WINDOW_SECONDS): must be greater than 0, got -1.0"),
    ("SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS", "inf",
     "collector.idle_flush_seconds (from SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS): "
     "expected a finite number, got 'inf'"),
    ("SPIKEHOUND_LOG_FORMAT", "xml",
     "log.format (from SPIKEHOUND_LOG_FORMAT): expected one of plain, json, got 'xml'"),
    ("SPIKEHOUND_COLLECTOR_OTLP_HTTP", "4318",
     "collector.otlp_http (from SPIKEHOUND_COLLECTOR_OTLP_HTTP): expected HOST:PORT, got '4318'"),
    ("SPIKEHOUND_COLLECTOR_QUEUE", "5", "collector.queue (from SPIKEHOUND_COLLECTOR_QUEUE): unknown setting"),
    ("SPIKEHOUND_VERBOSE", "1", "verbose (from SPIKEHOUND_VERBOSE): unknown setting"),
    ("SPIKEHOUND_COLLECTOR_API", "0.0.0.0:8470",
     "collector.api (from SPIKEHOUND_COLLECTOR_API): listening on 0.0.0.0:8470 beyond loopback needs "
     "collector.api_token (set SPIKEHOUND_COLLECTOR_API_TOKEN)"),
    ("SPIKEHOUND_AGENT_PROFILE_RATE_HZ", "0",
     "agent.profile_rate_hz (from SPIKEHOUND_AGENT_PROFILE_RATE_HZ): must be between 1 and 1000 samples a second, "
     "got 0"),
    ("SPIKEHOUND_AGENT_PROFILE_WINDOW_SECONDS", "2.5",
     "agent.profile_window_seconds (from SPIKEHOUND_AGENT_PROFILE_WINDOW_SECONDS): must be a whole number of "
     "seconds from 1 to 3600 (py-spy records whole seconds), got 2.5"),
    ("SPIKEHOUND_AGENT_PROFILING", "maybe",
     "agent.profiling (from SPIKEHOUND_AGENT_PROFILING): expected true or false, got 'maybe'"),
])
def test_a_bad_environment_variable_is_one_line_naming_key_variable_and_reason(name, value, message):
    with pytest.raises(ConfigError) as caught:
        load(env={name: value})

    assert str(caught.value) == message


@pytest.mark.parametrize(("flags", "message"), [
    ({"collector.api": "localhost"}, "collector.api (from --api): expected HOST:PORT, got 'localhost'"),
    ({"storage.url": "mysql://app:hunter2@db/x"},
     "storage.url (from --db): expected a sqlite:// or postgresql:// URL, got 'mysql://app:***@db/x'"),
    ({"collector.queue_capacity": -5}, "collector.queue_capacity (from --queue-capacity): must be greater than 0, "
                                       "got -5"),
    ({"collector.bogus": 1}, "collector.bogus (from --bogus): unknown setting"),
])
def test_a_bad_flag_is_one_line_naming_key_flag_and_reason(flags, message):
    with pytest.raises(ConfigError) as caught:
        load(env={}, flags=flags, flag_names={"collector.api": "--api", "storage.url": "--db"})

    assert str(caught.value) == message
    assert "hunter2" not in str(caught.value)


def test_range_checks_run_on_the_merged_layers(tmp_path):
    """Validation of a value's range runs once, on the merged result: a flag may correct the file."""
    path = write(tmp_path, "[collector]\nqueue_capacity = 0\n")

    assert load(path, env={}, flags={"collector.queue_capacity": 10}).collector.queue_capacity == 10


@pytest.mark.parametrize(("content", "reason"), [
    (b"[collector\n", "invalid TOML"),
    (b"\xff\xfe[collector]\n", "not UTF-8 text"),
])
def test_an_unreadable_file_is_one_line(tmp_path, content, reason):
    path = tmp_path / "broken.toml"
    path.write_bytes(content)

    with pytest.raises(ConfigError) as caught:
        load(path, env={})

    assert str(caught.value).startswith(f"config file {path}: {reason}")
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file .*nope\.toml: No such file or directory$"):
        load(tmp_path / "nope.toml", env={})


def test_a_retired_setting_starts_with_a_warning_naming_it_and_what_replaced_it(tmp_path, caplog):
    """An upgrade must not stop a collector whose file still sets what a release retired."""
    path = write(tmp_path, "[detection]\nresolve_requests = 5\nend_evidence = 2.5\n")
    with caplog.at_level("WARNING", logger="spikehound.config"):
        cfg = load(path, env={"SPIKEHOUND_DETECTION_RESOLVE_REQUESTS": "7"})
    assert cfg.detection.end_evidence == 2.5
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"detection.resolve_requests (from {path}): retired") and "end_evidence" in m
               for m in warned), warned
    assert any(m.startswith("detection.resolve_requests (from SPIKEHOUND_DETECTION_RESOLVE_REQUESTS): retired")
               for m in warned), warned
    with pytest.raises(ConfigError, match=r"^detection\.resolve_request \(from .*typo\.toml\): unknown setting$"):
        load(write(tmp_path, "[detection]\nresolve_request = 5\n", "typo.toml"), env={})


@pytest.mark.parametrize(("api", "token", "ok"), [
    ("0.0.0.0:8470", "", False),
    ("[::]:8470", "", False),
    ("10.1.2.3:8470", "", False),
    ("0.0.0.0:8470", "s3cret", True),
    ("127.0.0.1:8470", "", True),
    ("127.0.0.2:8470", "", True),
    ("[::1]:8470", "", True),
    ("localhost:8470", "", True),
])
def test_the_api_beyond_loopback_needs_a_token(api, token, ok):
    env = {"SPIKEHOUND_COLLECTOR_API": api, "SPIKEHOUND_COLLECTOR_API_TOKEN": token}
    if ok:
        assert str(load(env=env).collector.api) == api
    else:
        with pytest.raises(ConfigError, match=r"^collector\.api \(from SPIKEHOUND_COLLECTOR_API\): .*api_token"):
            load(env=env)


# --- effective configuration ------------------------------------------------------------------


def test_effective_configuration_hides_tokens_and_database_passwords(tmp_path):
    cfg = load(env={"SPIKEHOUND_COLLECTOR_API_TOKEN": "api-s3cret", "SPIKEHOUND_COLLECTOR_OTLP_TOKEN": "otlp-s3cret",
                    "SPIKEHOUND_STORAGE_URL": "postgresql://app:db-s3cret@db:5432/spikehound?password=db-s3cret",
                    "SPIKEHOUND_DATA_DIR": str(tmp_path)})

    shown = effective(cfg)
    text = to_toml(shown)

    assert "s3cret" not in text
    assert shown["collector"]["api_token"] == shown["collector"]["otlp_token"] == "***"
    assert shown["storage"]["url"] == "postgresql://app:***@db:5432/spikehound?password=***"
    assert cfg.collector.api_token == "api-s3cret"  # only the display hides it
    assert tomllib.loads(text) == shown
    assert effective(load(env={}))["collector"]["api_token"] == ""  # unset stays visibly unset


@pytest.mark.parametrize("url", ["sqlite:///var/lib/x.db", "sqlite:///:memory:", "postgresql://app@db/spikehound"])
def test_urls_without_a_password_are_shown_as_they_are(url):
    assert redact_url(url) == url


# --- the command line -------------------------------------------------------------------------


def run_cli(*args: str, home: Path, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_") and k != "STATE_DIRECTORY"}
    return subprocess.run([SPIKEHOUND, *args], capture_output=True, text=True, timeout=timeout,
                          env={**clean, "HOME": str(home), **(env or {})}, stdin=subprocess.DEVNULL)


def test_check_config_prints_the_effective_toml(tmp_path):
    path = write(tmp_path, '[collector]\nqueue_capacity = 1234\n\n[log]\nformat = "json"\n')

    done = run_cli("check-config", "--config", str(path), "--api", "127.0.0.1:9999", home=tmp_path,
                   env={"STATE_DIRECTORY": f"{tmp_path / 'state'}:{tmp_path / 'other'}"})  # as systemd sets it

    assert done.returncode == 0, done.stderr
    shown = tomllib.loads(done.stdout)
    assert shown["collector"]["queue_capacity"] == 1234
    assert shown["collector"]["api"] == "127.0.0.1:9999"
    assert shown["log"] == {"level": "info", "format": "json", "file": ""}
    assert shown["data_dir"] == str(tmp_path / "state")


def test_check_config_with_a_bad_line_exits_2_with_one_line_naming_the_key(tmp_path):
    path = write(tmp_path, '[collector]\nwindow_seconds = 10\nqueue_capacity = "lots"\n')

    done = run_cli("check-config", "--config", str(path), home=tmp_path)

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "collector.queue_capacity" in done.stderr and str(path) in done.stderr and "'lots'" in done.stderr


@pytest.mark.parametrize(("text", "key"), [
    ('[collector]\napi = "0.0.0.0:8470"\n', "collector.api"),
    ("[collector]\nmax_stream = 10\n", "collector.max_stream"),
    ('[collector\napi = "x"\n', "invalid TOML"),
])
def test_the_collector_refuses_a_bad_configuration_at_start(tmp_path, text, key):
    path = write(tmp_path, text, "bad.toml")

    done = run_cli("collector", "--config", str(path), "--otlp-grpc", "127.0.0.1:0", "--otlp-http", "127.0.0.1:0",
                   home=tmp_path, timeout=30)

    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and key in lines[0] and str(path) in lines[0], done.stderr


def test_flags_beat_the_environment_on_the_command_line(tmp_path):
    done = run_cli("check-config", "--api", "127.0.0.1:2222", home=tmp_path,
                   env={"SPIKEHOUND_COLLECTOR_API": "127.0.0.1:1111", "SPIKEHOUND_LOG_LEVEL": "debug",
                        "SPIKEHOUND_API_URL": "http://127.0.0.1:1111"})

    assert done.returncode == 0, done.stderr
    shown = tomllib.loads(done.stdout)
    assert (shown["collector"]["api"], shown["log"]["level"]) == ("127.0.0.1:2222", "debug")


def test_check_config_never_prints_secrets(tmp_path):
    done = run_cli("check-config", "--db", "postgresql://app:db-secret@db/spikehound", home=tmp_path,
                   env={"SPIKEHOUND_COLLECTOR_API_TOKEN": "secret"})

    assert done.returncode == 0, done.stderr
    assert "secret" not in done.stdout + done.stderr
    assert tomllib.loads(done.stdout)["collector"]["api_token"] == "***"


@pytest.mark.parametrize("command", [[], ["collector"], ["check-config"], ["db"], ["db", "upgrade"], ["spikes"],
                                     ["spike"], ["demo"]])
def test_every_command_has_help(tmp_path, command):
    done = run_cli(*command, "--help", home=tmp_path)

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: spikehound {' '.join(command)}".rstrip())


def test_db_upgrade_creates_the_schema_and_prints_the_revision(tmp_path):
    url = f"sqlite:///{tmp_path / 'data' / 'x.db'}"

    done = run_cli("db", "upgrade", "--db", url, home=tmp_path)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"database schema at revision {head_revision()}"
    engine = make_engine(url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    again = run_cli("db", "upgrade", "--db", url, home=tmp_path)
    assert (again.returncode, again.stdout) == (0, done.stdout)


# --- times in the API -------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "unix_nano"), [
    ("2023-11-14T22:13:20Z", 1_700_000_000 * NS),
    ("2023-11-14T22:13:20.123456789Z", 1_700_000_000_123_456_789),
    ("2023-11-14T22:13:20.5Z", 1_700_000_000_500_000_000),
    ("2023-11-14T22:13:20.000000001Z", 1_700_000_000_000_000_001),
    ("2023-11-14T22:13:20.1234567899Z", 1_700_000_000_123_456_789),  # beyond nanoseconds: cut, not rounded
    ("2023-11-14T23:43:20.25+01:30", 1_700_000_000_250_000_000),
    ("2023-11-14T17:13:20-05:00", 1_700_000_000 * NS),
    ("2023-11-14t22:13:20z", 1_700_000_000 * NS),
    ("2023-11-14 22:13:20Z", 1_700_000_000 * NS),
    ("1969-12-31T23:59:59.5Z", -500_000_000),
    ("1700000000", 1_700_000_000 * NS),
    ("1700000000.5", 1_700_000_000_500_000_000),
    ("1700000000.123456789", 1_700_000_000_123_456_789),
    (" 1700000000 ", 1_700_000_000 * NS),
    ("0", 0),
])
def test_parse_time_reads_rfc3339_and_unix_seconds_to_the_nanosecond(text, unix_nano):
    assert parse_time(text) == unix_nano


@pytest.mark.parametrize(("text", "reason"), [
    ("garbage", "neither RFC 3339 nor unix seconds"),
    ("", "neither RFC 3339 nor unix seconds"),
    ("2023-11-14T22:13:20", "no time zone"),
    ("2023-11-14", "no time zone"),
    ("2023-13-14T22:13:20Z", "neither RFC 3339 nor unix seconds"),
    ("2023-11-14T22:13:20.5.5Z", "neither RFC 3339 nor unix seconds"),
    ("1700000000000", "neither RFC 3339 nor unix seconds"),  # milliseconds are not seconds
    ("-5", "neither RFC 3339 nor unix seconds"),
    ("1e9", "neither RFC 3339 nor unix seconds"),
    ("nan", "neither RFC 3339 nor unix seconds"),
    ("1700000000.", "neither RFC 3339 nor unix seconds"),
    ("99999999999", "out of range"),  # would not fit the 64-bit nanoseconds that storage keeps
    ("9999-12-31T23:59:59Z", "out of range"),
])
def test_parse_time_rejects_garbage_and_naive_times(text, reason):
    with pytest.raises(ValueError, match=reason) as caught:
        parse_time(text)

    assert repr(text) in str(caught.value)


@pytest.mark.parametrize(("unix_nano", "text"), [
    (1_700_000_000_123_456_789, "2023-11-14T22:13:20.123456789Z"),
    (1_700_000_000_100_000_000, "2023-11-14T22:13:20.100000000Z"),
    (1_700_000_000 * NS, "2023-11-14T22:13:20Z"),
    (0, "1970-01-01T00:00:00Z"),
    (-1, "1969-12-31T23:59:59.999999999Z"),
    (None, None),
])
def test_rfc3339_is_utc_and_keeps_every_digit(unix_nano, text):
    assert rfc3339(unix_nano) == text


def test_rfc3339_and_parse_time_round_trip():
    rng = random.Random(3339)
    for _ in range(1000):
        unix_nano = rng.randrange(-(2**62), 2**62)
        assert parse_time(rfc3339(unix_nano)) == unix_nano

