"""The one typed configuration tree, loaded from layers.

Precedence, highest first: command-line flags, ``SPIKEHOUND_*`` environment
variables, the TOML file, defaults. Every key is ``section.key`` (or a bare
top-level key); its environment variable is ``SPIKEHOUND_SECTION_KEY``.

A bad key or value raises ``ConfigError`` whose message is one line naming the
key, where the value came from and what is wrong:

>>> load(env={"SPIKEHOUND_COLLECTOR_API": "nowhere"})
Traceback (most recent call last):
...
spikehound.config.ConfigError: collector.api (from SPIKEHOUND_COLLECTOR_API): expected HOST:PORT, got 'nowhere'
>>> load(env={}, flags={"storage.url": "sqlite:///tmp/x.db"}).storage.url
'sqlite:///tmp/x.db'
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import os
import re
import ssl
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit, urlunsplit

from spikehound.endpoints import parse_collectors
from spikehound.model import CauseKind

log = logging.getLogger(__name__)

ENV_PREFIX = "SPIKEHOUND_"
ENV_CONFIG_FILE = "SPIKEHOUND_CONFIG"  # names the TOML file; not itself a setting
# Variables of the client commands (``spikehound spikes``), not settings of a daemon.
ENV_NOT_SETTINGS = frozenset({ENV_CONFIG_FILE, "SPIKEHOUND_API_URL"})


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the operator."""


@dataclass(frozen=True, slots=True)
class HostPort:
    """A listen address such as ``0.0.0.0:4317`` or ``[::1]:4318``."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HostPort:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"port {port} is out of range 0-65535")
        return cls(host.strip("[]"), int(port))

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _default_data_dir() -> str:
    # systemd's StateDirectory= hands us the directory; otherwise follow the FHS / XDG split.
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    if os.geteuid() == 0:
        return "/var/lib/spikehound"
    return str(Path.home() / ".local" / "state" / "spikehound")


@dataclass(slots=True)
class StorageConfig:
    """Where and how long data is kept."""

    # SQLAlchemy URL; empty means SQLite file spikehound.db in data_dir.
    url: str = ""
    # Raw spans older than this (by arrival) are deleted (window_retention_days keeps the windows longer).
    span_retention_hours: float = 72.0
    # Metric samples older than this (by arrival) are deleted.
    metric_retention_hours: float = 168.0
    # SQLite durability: NORMAL survives a killed process, FULL also survives power loss.
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    # Size caps, enforced with the age caps (oldest arrivals go first); 0 means no cap.
    # Span payload bytes (OTLP protobuf as stored) kept at most; spike exemplar traces are never deleted.
    span_retention_max_bytes: int = 10 * 1024**3
    # Metric samples kept at most.
    metric_retention_max_points: int = 200_000_000
    # Sampling-profile rows (one per process, window and stack) kept at most; they also go with the spans' age.
    profile_retention_max_rows: int = 20_000_000
    # Latency windows (the charts of the API and the spike pages) older than this, counted back from the newest
    # window stored (event time), are deleted; spikes and causes are kept. 0 means kept for ever.
    window_retention_days: float = 30.0


@dataclass(slots=True)
class CollectorConfig:
    """The central collector: receivers, ingest queue, API."""

    api: HostPort = field(default_factory=lambda: HostPort("127.0.0.1", 8470))
    otlp_grpc: HostPort = field(default_factory=lambda: HostPort("0.0.0.0", 4317))
    otlp_http: HostPort = field(default_factory=lambda: HostPort("0.0.0.0", 4318))
    # Bearer token the REST API requires; mandatory when the API listens beyond loopback.
    api_token: str = ""
    # Bearer token OTLP senders must present; OTLP beyond loopback needs it or client certificates.
    otlp_token: str = ""
    # OTLP beyond loopback needs otlp_token or client certificates (tls_client_ca_file); true allows neither.
    allow_unauthenticated_otlp: bool = False
    # TLS on all three listeners (OTLP/gRPC, OTLP/HTTP, API): PEM certificate (chain) and its unencrypted key.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # PEM CA certificates: the OTLP receivers require a client certificate signed by one of them (mTLS).
    tls_client_ca_file: str = ""
    # The same for the API port (browsers, Prometheus and the CLI then need a client certificate too).
    api_tls_client_ca_file: str = ""
    # Spans + points waiting to be committed; beyond it senders are told to retry later.
    queue_capacity: int = 200_000
    # Most items committed in one transaction (several requests are merged up to it).
    batch_max_items: int = 20_000
    # Largest OTLP request accepted, after gzip decompression.
    max_request_bytes: int = 32 * 1024 * 1024
    # Request bytes (after decompression) being decoded or awaiting their commit, over both OTLP receivers;
    # beyond it senders are told to retry later. Memory held for them is about 3 times this.
    max_bytes_in_flight: int = 128 * 1024 * 1024
    # Span, event, scope and metric names and attribute keys are cut to this many characters (service and host
    # names to at most 255), attribute values (strings, bytes) to max_attribute_value_length; counted.
    max_name_length: int = 1024
    max_attribute_value_length: int = 4096
    # Attributes kept per span, resource, scope and metric point; the rest are dropped and counted.
    max_attributes_per_span: int = 128
    # Spans ending (and samples dated) more than this after the collector's clock are refused, counted by
    # sender: a host whose clock runs ahead would otherwise close no window until its future came.
    max_clock_skew_seconds: float = 300.0
    # Seconds a sender is asked to wait (Retry-After) when the queue is full.
    retry_after_seconds: int = 1
    # Event-time window that latency aggregates are cut into.
    window_seconds: float = 10.0
    # How late (event time) a span may arrive and still count in its window.
    allowed_lateness_seconds: float = 5.0
    # After this much wall-clock idleness the watermark catches up and open windows close.
    idle_flush_seconds: float = 3.0
    # After a storage outage or a restart from a checkpoint, windows wait until no backlog span (one that ended
    # before the outage ended or the collector started) arrived for this long (at most 10 minutes, or 5 million
    # spans held): senders drain their spools unevenly.
    catch_up_seconds: float = 15.0
    # Most (service, operation) latency streams tracked; the rest are counted as overflow.
    max_streams: int = 10_000
    # URL that links in alerts and CLI output point at; its host is one the API answers to.
    public_url: str = ""
    # More names the API answers to (a proxy's); IP addresses, localhost and public_url's host always. "*": any.
    allowed_hosts: list[str] = field(default_factory=list)
    # Span metrics on /metrics: the OpenTelemetry spanmetrics connector's series and model_inference_latency_seconds.
    span_metrics: bool = True
    # Most series per span-metrics histogram; spans of further series go to one overflow series, counted.
    span_metrics_max_series: int = 1_000


@dataclass(slots=True)
class AgentConfig:
    """The per-host agent: samplers, local receivers, forwarding."""

    # Collector OTLP/gRPC endpoint: host:port, http://host:port or https://host:port (TLS); or several, each trace
    # routed whole to one of them: a comma-separated list, dns:///name:port (every A/AAAA record) or file:///path
    # (one endpoint a line), see docs/scale-out.md.
    collector: str = "127.0.0.1:4317"
    # Seconds between lookups of a dns:/// name or re-reads of a file:/// list.
    collector_resolve_seconds: float = 30.0
    # After the collectors change, a trace seen this recently keeps its collector (0: new membership at once).
    route_sticky_seconds: float = 60.0
    # Bearer token sent to the collector (its collector.otlp_token).
    collector_token: str = ""
    # PEM CA certificates that verify the collector (https:// only); empty: the public CAs gRPC ships with.
    collector_ca_file: str = ""
    # Client certificate (PEM chain) and its unencrypted key, presented to a collector that requires one (mTLS).
    collector_cert_file: str = ""
    collector_key_file: str = ""
    # Local receivers for model servers; loopback by default, where SDKs send unless told otherwise.
    otlp_grpc: HostPort = field(default_factory=lambda: HostPort("127.0.0.1", 4317))
    otlp_http: HostPort = field(default_factory=lambda: HostPort("127.0.0.1", 4318))
    # The agent's own /metrics and /healthz.
    metrics_listen: HostPort = field(default_factory=lambda: HostPort("127.0.0.1", 8471))
    # Seconds between samples of GPUs, CPU and network.
    interval: float = 1.0
    # host.name given to everything this host sends; empty means the system host name.
    host_name: str = ""
    # Model-server processes to watch: regular expressions searched in process name and command line.
    process_patterns: list[str] = field(default_factory=list)
    # ... or PID files naming them.
    pid_files: list[str] = field(default_factory=list)
    # Network interfaces to sample; empty means every interface but loopback.
    interfaces: list[str] = field(default_factory=list)
    # Requests held in memory before spilling to disk.
    memory_queue_bytes: int = 64 * 1024 * 1024
    # Disk spool for when the collector is away; full means senders are pushed back.
    spool_max_bytes: int = 1024 * 1024 * 1024
    # Spool directory; empty means data_dir/spool.
    spool_dir: str = ""
    # Largest request a local sender may send.
    max_request_bytes: int = 32 * 1024 * 1024
    # On SIGTERM, keep forwarding this long before spooling what is left.
    drain_seconds: float = 10.0
    # Sampling profiles of the model-server processes with py-spy, where py-spy is installed and may ptrace them.
    profiling: bool = True
    # Samples per second per process (py-spy --rate); prime, so it does not beat with work on a round period.
    profile_rate_hz: int = 19
    # Seconds one profile covers, whole (py-spy records whole seconds).
    profile_window_seconds: float = 10.0
    # Which threads a sample reads: "gil", the one running Python code (its cost does not grow with the threads);
    # "cpu", every thread on a CPU, native code that released the GIL too; "wall", every thread, idle ones too.
    profile_threads: Literal["gil", "cpu", "wall"] = "gil"
    # Most model-server processes sampled and profiled (py-spy children at once); PID files first, then those
    # running longest. Any local user can start a process that process_patterns matches.
    profile_max_processes: int = 32
    # Only processes of these users (names or numeric uids, as strings) are sampled and profiled; empty: any user's.
    profile_users: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DetectionConfig:
    """When a p99 rise is a spike, and how much the detectors may hold; see docs/detection.md."""

    # false keeps latency windows (the /api/v1/latency series) but detects no spikes.
    enabled: bool = True
    # A spike's p99 is at least this share above the stream's learned baseline...
    min_rise: float = 0.2
    # ... and at least this many milliseconds above it (2 ms -> 3 ms at 3 a.m. pages nobody) ...
    min_abs_rise_ms: float = 5.0
    # ... and its count of requests slower than the baseline p99 has odds under 10^-min_score.
    min_score: float = 6.0
    # Windows with fewer requests are judged merged with the ones before them.
    min_requests: int = 40
    # How many windows back a low-traffic stream may merge.
    max_merge_windows: int = 12
    # Normal windows a stream learns before it is judged at all.
    grace_windows: int = 12
    # Normal windows the rolling baseline covers (90 x 10 s = 15 minutes).
    baseline_windows: int = 90
    # Calm windows in a row of a busy stream that end a spike it carried.
    resolve_windows: int = 2
    # Judge every caller -> callee edge on the callers' CLIENT spans too (a delay in front of a service).
    hop_streams: bool = True
    # Split an entry operation with a generic name (/*, HTTP GET) by route, else by where its requests go.
    split_generic_operations: bool = True
    # Sparse streams, request by request: requests a stream learns before its requests are judged ...
    grace_requests: int = 12
    # ... the evidence (-log10 odds, before the correction for the number of streams) that opens a spike ...
    min_evidence: float = 4.0
    # ... carried by at least this many distinct slow requests ...
    min_slow_requests: int = 2
    # Evidence toward normal (log10 odds, from the requests through a spike's locus) that ends a spike.
    end_evidence: float = 3.0
    # Spans of recent traces held in memory for attribution (about 300 bytes each).
    trace_buffer_spans: int = 200_000
    # Causes kept per spike.
    max_causes: int = 5
    # Seconds between checkpoints of the learned state to storage (also written at shutdown).
    checkpoint_seconds: float = 60.0
    # Run the detectors in a process of their own, on another core (a single collector on a file database).
    own_process: bool = True


@dataclass(slots=True)
class ReceiverConfig:
    """One place alerts go (``[[alerts.receivers]]``): a Slack incoming webhook or a generic webhook."""

    # Routes name receivers by this.
    name: str = ""
    # slack: Block Kit message to an incoming webhook; webhook: Alertmanager (version 4) JSON, signed.
    type: Literal["slack", "webhook"] = "webhook"
    # Where a webhook is POSTed; shown by check-config with its password and query values hidden.
    url: str = ""
    # A URL that is itself the credential (a Slack incoming webhook): never shown, never logged.
    url_secret: str = ""
    # HMAC-SHA256 key of the X-Spikehound-Signature header; required for webhooks beyond loopback.
    signing_secret: str = ""
    # Optional Authorization: Bearer token sent with each webhook.
    bearer_token: str = ""
    # Seconds one delivery attempt may take.
    timeout_seconds: float = 10.0


@dataclass(slots=True)
class RouteConfig:
    """Which spikes go to a receiver, and how often (``[[alerts.routes]]``, tried in order)."""

    receiver: str = ""
    # Names the route's groups; defaults to the receiver's name.
    name: str = ""
    # Shell-style patterns (``model-*``); a spike matches when each non-empty list has a match.
    services: list[str] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    # One of the spike's causes must have one of these kinds (values of spikehound.model.CauseKind) ...
    cause_kinds: list[str] = field(default_factory=list)
    # ... and, when given, one of these resources (metric names such as hw.gpu.utilization) ...
    cause_resources: list[str] = field(default_factory=list)
    # ... and at least this score (share of the added latency it explains).
    min_cause_score: float = 0.0
    # Minimum severity: the spike's p99 over its baseline.
    min_ratio: float = 1.0
    # Minimum duration: a spike is announced once it has lasted this long.
    min_duration_seconds: float = 0.0
    # Wait this long after a group starts firing before its first notification (gathers more spikes).
    group_wait_seconds: float = 0.0
    # Least time between notifications of a group whose spikes changed.
    group_interval_seconds: float = 300.0
    # A group still firing is announced again after this long.
    repeat_interval_seconds: float = 14400.0
    # Hold a resolve notice this long: a spike that comes back within it continues the alert (no storm).
    resolve_wait_seconds: float = 60.0
    # Most notifications of this route in any rolling hour; the rest wait and are merged.
    max_per_hour: int = 60
    # Send a notice when the group's spikes have ended.
    send_resolved: bool = True
    # Keep trying the routes after this one when it matched.
    continue_matching: bool = False


@dataclass(slots=True)
class AlertsConfig:
    """Alerts: receivers, routes and delivery; see docs/alerts.md."""

    # false: spikes are still detected and stored, but nothing is sent.
    enabled: bool = True
    receivers: list[ReceiverConfig] = field(default_factory=list)
    routes: list[RouteConfig] = field(default_factory=list)
    # Attempts before a notification is dead-lettered (visible at /api/v1/alerts/outbox?state=dead).
    max_attempts: int = 10
    # First retry delay; doubled per attempt (with jitter) up to backoff_max_seconds.
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 300.0
    # Delivered notifications are kept this long in the outbox, then deleted.
    delivered_retention_hours: float = 168.0


@dataclass(slots=True)
class ClusterConfig:
    """Several collectors sharing one PostgreSQL, one of them the detection leader; see docs/scale-out.md."""

    # Join the cluster of the collectors on storage.url (PostgreSQL only).
    enabled: bool = False
    # This collector's name among them (letters, digits, "._:-"); empty: the host name and the OTLP/gRPC port.
    member: str = ""
    # Whether this member may become the detection leader; false: it stores its share only (the leader decodes
    # and judges every member's spans, so give that role to the members with a core to spare).
    lead: bool = True
    # Seconds between a member's heartbeats, and between a follower's tries for the leader's lock.
    heartbeat_seconds: float = 1.0
    # A leader silent this long is deposed (another leads); a process starting under a member's name whose
    # row is younger than this first watches for its heartbeats.
    member_timeout_seconds: float = 10.0
    # A member silent this long is gone: the leader stops holding the windows for its share. Longer than a
    # restart under the shipped unit (RestartSec=5, start-up, three heartbeats to take its name back: 10-12 s).
    member_gone_seconds: float = 30.0


@dataclass(slots=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["plain", "json"] = "plain"
    # Also append log lines to this file (reopened when logrotate moves it); empty means stderr only.
    file: str = ""


@dataclass(slots=True)
class Config:
    """The whole tree. Sections are attributes; see docs/configuration.md."""

    data_dir: str = field(default_factory=_default_data_dir)
    storage: StorageConfig = field(default_factory=StorageConfig)
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    log: LogConfig = field(default_factory=LogConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def database_url(self) -> str:
        return self.storage.url or f"sqlite:///{Path(self.data_dir) / 'spikehound.db'}"


SECTIONS = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}
# Settings that no longer exist, and what took their place: a config that still sets one starts, with a
# warning that names the key, instead of failing on an upgrade.
RETIRED = {
    "detection.resolve_requests": "a spike now ends on evidence toward normal: see detection.end_evidence",
}


def load(path: str | os.PathLike[str] | None = None, *, env: typing.Mapping[str, str] | None = None,
         flags: typing.Mapping[str, Any] | None = None,
         flag_names: typing.Mapping[str, str] | None = None) -> Config:
    """Build the configuration from its layers; raise ConfigError on the first problem."""
    env = os.environ if env is None else env
    cfg = Config()
    sources: dict[str, str] = {}  # key -> where its value came from, for the messages of _check
    path = path or env.get(ENV_CONFIG_FILE)
    if path:
        for key, value in _read_toml(Path(path)).items():
            sources[key] = _assign(cfg, key, value, f"{path}")
    unknown: list[tuple[str, str]] = []  # (variable, key): not a setting, unless a receiver secret names it
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name not in ENV_NOT_SETTINGS:
            key = _env_key(name)
            if _known(cfg, key) or key in RETIRED:
                sources[key] = _assign(cfg, key, value, name)
            else:
                unknown.append((name, key))
    for key, value in (flags or {}).items():
        if value is not None:
            source = (flag_names or {}).get(key) or "--" + key.split(".")[-1].replace("_", "-")
            sources[key] = _assign(cfg, key, value, source)
    # ``url_secret = "env:SPIKEHOUND_SLACK_WEBHOOK_URL"``: the variable holds a secret, it is no setting.
    named = {getattr(r, k)[4:] for r in cfg.alerts.receivers for k in SECRET_REFERENCE_FIELDS
             if getattr(r, k).startswith("env:")}
    for name, key in unknown:
        if name not in named:
            raise ConfigError(f"{key} (from {name}): unknown setting")
    _resolve_secret_references(cfg, env, sources)
    _check(cfg, sources)
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                flat[f"{key}.{sub}"] = subvalue
        else:
            flat[key] = value
    return flat


def _env_key(name: str) -> str:
    rest = name[len(ENV_PREFIX):].lower()
    section, _, key = rest.partition("_")
    return f"{section}.{key}" if section in SECTIONS and key else rest


def _known(cfg: Config, key: str) -> bool:
    """Whether ``section.key`` (or a bare top-level key) is a setting."""
    section_name, _, name = key.rpartition(".")
    target: Any = getattr(cfg, section_name, None) if section_name else cfg
    known = {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set()
    return not ((section_name and section_name not in SECTIONS) or name not in known
                or (not section_name and name in SECTIONS))


def _assign(cfg: Config, key: str, raw: Any, source: str) -> str:
    section_name, _, name = key.rpartition(".")
    target: Any = getattr(cfg, section_name, None) if section_name else cfg
    if key in RETIRED:
        log.warning("%s (from %s): retired and ignored; %s", key, source, RETIRED[key])
        return source
    if not _known(cfg, key):
        raise ConfigError(f"{key} (from {source}): unknown setting")
    hint = typing.get_type_hints(type(target))[name]
    try:
        value = _coerce(raw, hint)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} (from {source}): {exc}") from None
    setattr(target, name, value)
    return source


def _coerce(raw: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        return _tables(raw, typing.get_args(hint)[0])
    if typing.get_origin(hint) is list:
        items = [x.strip() for x in raw.split(",") if x.strip()] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"expected a list of strings (or a comma-separated string), got {raw!r}")
        return list(items)
    if hint is HostPort:
        if isinstance(raw, HostPort):
            return raw
        if not isinstance(raw, str):
            raise ValueError(f"expected HOST:PORT, got {raw!r}")
        return HostPort.parse(raw)
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        text = raw if not isinstance(raw, str) else raw.strip()
        lowered = {str(c).lower(): c for c in choices}
        if str(text).lower() in lowered:
            return lowered[str(text).lower()]
        raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {raw!r}")
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).strip().lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {raw!r}")
    if hint is int:
        if isinstance(raw, bool | float):
            raise ValueError(f"expected a whole number, got {raw!r}")
        try:
            return int(str(raw).replace("_", "").strip())
        except ValueError:
            raise ValueError(f"expected a whole number, got {raw!r}") from None
    if hint is float:
        if isinstance(raw, bool):
            raise ValueError(f"expected a number, got {raw!r}")
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return number
    if hint is str:
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {raw!r}")
        return raw
    raise TypeError(f"unsupported setting type {hint!r}")  # pragma: no cover - a programming error


def _tables(raw: Any, cls: Any) -> list[Any]:
    """A TOML array of tables (``[[alerts.routes]]``), or the same as a JSON array (environment variables)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ValueError("expected a JSON array of tables") from None
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise ValueError("expected a list of tables")
    hints = typing.get_type_hints(cls)
    out = []
    for number, table in enumerate(raw, 1):
        item = cls()
        for key, value in table.items():
            if key not in hints:
                raise ValueError(f"entry {number}: {key}: unknown setting")
            try:
                setattr(item, key, _coerce(value, hints[key]))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"entry {number}: {key}: {exc}") from None
        out.append(item)
    return out


def _check(cfg: Config, sources: typing.Mapping[str, str]) -> None:
    def named(key: str) -> str:
        return f"{key} (from {sources[key]})" if key in sources else key

    c = cfg.collector
    positive = {"collector.queue_capacity": c.queue_capacity, "collector.batch_max_items": c.batch_max_items,
                "collector.max_request_bytes": c.max_request_bytes, "collector.window_seconds": c.window_seconds,
                "collector.max_bytes_in_flight": c.max_bytes_in_flight, "collector.max_name_length": c.max_name_length,
                "collector.max_clock_skew_seconds": c.max_clock_skew_seconds,
                "collector.max_attribute_value_length": c.max_attribute_value_length,
                "collector.max_attributes_per_span": c.max_attributes_per_span,
                "collector.max_streams": c.max_streams,
                "collector.span_metrics_max_series": c.span_metrics_max_series,
                "storage.span_retention_hours": cfg.storage.span_retention_hours,
                "storage.metric_retention_hours": cfg.storage.metric_retention_hours,
                "agent.interval": cfg.agent.interval, "agent.memory_queue_bytes": cfg.agent.memory_queue_bytes,
                "agent.spool_max_bytes": cfg.agent.spool_max_bytes,
                "agent.max_request_bytes": cfg.agent.max_request_bytes,
                **{f"detection.{f.name}": getattr(cfg.detection, f.name) for f in dataclasses.fields(cfg.detection)
                   if f.name != "min_abs_rise_ms" and not isinstance(getattr(cfg.detection, f.name), bool)}}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{named(key)}: must be greater than 0, got {value}")
    for key, value in {"collector.allowed_lateness_seconds": c.allowed_lateness_seconds,
                       "collector.idle_flush_seconds": c.idle_flush_seconds,
                       "collector.catch_up_seconds": c.catch_up_seconds,
                       "collector.retry_after_seconds": c.retry_after_seconds,
                       "agent.drain_seconds": cfg.agent.drain_seconds,
                       "detection.min_abs_rise_ms": cfg.detection.min_abs_rise_ms,
                       "storage.span_retention_max_bytes": cfg.storage.span_retention_max_bytes,
                       "storage.metric_retention_max_points": cfg.storage.metric_retention_max_points,
                       "storage.profile_retention_max_rows": cfg.storage.profile_retention_max_rows,
                       "storage.window_retention_days": cfg.storage.window_retention_days}.items():
        if value < 0:
            raise ConfigError(f"{named(key)}: must not be negative, got {value}")
    if not c.api.is_loopback and not c.api_token:
        raise ConfigError(f"{named('collector.api')}: listening on {c.api} beyond loopback needs collector.api_token "
                          "(set SPIKEHOUND_COLLECTOR_API_TOKEN)")
    _check_profiling(cfg.agent, named)
    _check_agent_collector(cfg.agent, named)
    for pattern in cfg.agent.process_patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{named('agent.process_patterns')}: {pattern!r} is not a regular expression: {exc}"
                              ) from None
    link = _url_parts(c.public_url, named("collector.public_url"))
    if c.public_url and (link.scheme not in ("http", "https") or not link.hostname):
        raise ConfigError(f"{named('collector.public_url')}: expected an http:// or https:// URL, got {c.public_url!r}")
    for name in c.allowed_hosts:
        if name != "*" and not re.fullmatch(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]", name):
            raise ConfigError(f"{named('collector.allowed_hosts')}: {name!r} is not a host name (no scheme, port "
                              "or path; \"*\" allows any)")
    url = cfg.database_url
    if not url.startswith(DATABASE_SCHEMES):
        raise ConfigError(f"{named('storage.url')}: expected a sqlite:// or postgresql:// URL, "
                          f"got {redact_url(url)!r}")
    _url_parts(url, named("storage.url"))
    _check_alerts(cfg.alerts, named)
    _check_tls(cfg, named)
    _check_cluster(cfg, named)


def _url_parts(url: str, where: str, shown: str | None = None) -> SplitResult:
    """``url`` split, its port read; a :class:`ConfigError` naming ``where`` when it cannot be (an unclosed
    ``[`` of an IPv6 host, a port that is no number or beyond 65535). ``shown``: how to show the URL (a secret's
    reference rather than the URL it holds)."""
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: not a valid URL ({exc}): {shown or repr(redact_url(url))}") from None
    return parts


def _check_cluster(cfg: Config, named: Callable[[str], str]) -> None:
    k = cfg.cluster
    for key, value in {"cluster.heartbeat_seconds": k.heartbeat_seconds,
                       "cluster.member_timeout_seconds": k.member_timeout_seconds,
                       "cluster.member_gone_seconds": k.member_gone_seconds}.items():
        if value <= 0:
            raise ConfigError(f"{named(key)}: must be greater than 0, got {value}")
    if k.member_timeout_seconds < 2 * k.heartbeat_seconds:
        raise ConfigError(f"{named('cluster.member_timeout_seconds')}: must be at least twice "
                          f"cluster.heartbeat_seconds ({k.heartbeat_seconds:g}), got {k.member_timeout_seconds:g}")
    if k.member_gone_seconds < k.member_timeout_seconds:
        raise ConfigError(f"{named('cluster.member_gone_seconds')}: must be at least cluster.member_timeout_seconds "
                          f"({k.member_timeout_seconds:g}), got {k.member_gone_seconds:g}")
    if k.member and not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", k.member):
        raise ConfigError(f"{named('cluster.member')}: expected 1 to 64 letters, digits or \"._:-\", "
                          f"got {k.member!r}")
    if k.enabled and not cfg.database_url.startswith(("postgresql://", "postgresql+psycopg://", "postgres://")):
        raise ConfigError(f"{named('cluster.enabled')}: collectors share their work through one PostgreSQL "
                          f"database; storage.url is {redact_url(cfg.database_url)!r}: set a postgresql:// "
                          "storage.url, or cluster.enabled = false")


def _check_profiling(a: AgentConfig, named: Callable[[str], str]) -> None:
    # py-spy takes a whole number of seconds and at most a few hundred samples a second per process.
    if not 1 <= a.profile_rate_hz <= 1000:
        raise ConfigError(f"{named('agent.profile_rate_hz')}: must be between 1 and 1000 samples a second, "
                          f"got {a.profile_rate_hz}")
    window = a.profile_window_seconds
    if not 1 <= window <= 3600 or window != int(window):
        raise ConfigError(f"{named('agent.profile_window_seconds')}: must be a whole number of seconds from 1 to "
                          f"3600 (py-spy records whole seconds), got {window}")
    if not 1 <= a.profile_max_processes <= 4096:
        raise ConfigError(f"{named('agent.profile_max_processes')}: must be between 1 and 4096, "
                          f"got {a.profile_max_processes}")
    for user in a.profile_users:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?", user):
            raise ConfigError(f"{named('agent.profile_users')}: {user!r} is not a user name or a numeric uid")


def _check_agent_collector(a: AgentConfig, named: Callable[[str], str]) -> None:
    try:
        parse_collectors(a.collector)
    except ValueError as exc:
        raise ConfigError(f"{named('agent.collector')}: {exc}") from None
    if not a.collector_resolve_seconds > 0:
        raise ConfigError(f"{named('agent.collector_resolve_seconds')}: must be greater than 0, "
                          f"got {a.collector_resolve_seconds}")
    if not a.route_sticky_seconds >= 0:
        raise ConfigError(f"{named('agent.route_sticky_seconds')}: must not be negative, got {a.route_sticky_seconds}")


def _may_use_tls(collector: str) -> bool:
    """Whether any endpoint of ``agent.collector`` can be https:// (a file's cannot be known before it is read)."""
    try:
        source = parse_collectors(collector)
    except ValueError:
        return False
    return source.kind == "file" or any(e.tls for e in source.endpoints)


def _check_alerts(a: AlertsConfig, named: Callable[[str], str]) -> None:
    """Receivers and routes that can work: unique names, reachable URLs, signed webhooks beyond loopback."""
    for key, value in {"alerts.max_attempts": a.max_attempts,
                       "alerts.backoff_initial_seconds": a.backoff_initial_seconds,
                       "alerts.backoff_max_seconds": a.backoff_max_seconds,
                       "alerts.delivered_retention_hours": a.delivered_retention_hours}.items():
        if value <= 0:
            raise ConfigError(f"{named(key)}: must be greater than 0, got {value}")
    names: set[str] = set()
    for number, r in enumerate(a.receivers, 1):
        where = f"{named('alerts.receivers')}: entry {number}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", r.name):
            raise ConfigError(f"{where}: name must be letters, digits, '_', '.' or '-', got {r.name!r}")
        if r.name in names:
            raise ConfigError(f"{where}: the name {r.name!r} is used twice")
        names.add(r.name)
        if bool(r.url) == bool(r.url_secret):
            raise ConfigError(f"{where} ({r.name}): give exactly one of url and url_secret")
        target = _url_parts(r.url or r.url_secret, f"{where} ({r.name}): {'url' if r.url else 'url_secret'}",
                            shown=None if r.url else "(url_secret)")
        if target.scheme not in ("http", "https") or not target.hostname:
            shown = redact_url(r.url) if r.url else "(url_secret)"
            raise ConfigError(f"{where} ({r.name}): expected an http:// or https:// URL, got {shown!r}")
        if r.timeout_seconds <= 0:
            raise ConfigError(f"{where} ({r.name}): timeout_seconds must be greater than 0")
        if r.type == "webhook" and not r.signing_secret and not _is_loopback_host(target.hostname):
            raise ConfigError(f"{where} ({r.name}): a webhook beyond loopback needs signing_secret, so that "
                              "its receiver can tell spikehound's alerts from forgeries")
    routes: set[str] = set()
    for number, route in enumerate(a.routes, 1):
        where = f"{named('alerts.routes')}: entry {number}"
        if route.receiver not in names:
            raise ConfigError(f"{where}: receiver {route.receiver!r} is not one of alerts.receivers "
                              f"({', '.join(sorted(names)) or 'none configured'})")
        route.name = route.name or route.receiver
        if route.name in routes:
            raise ConfigError(f"{where}: the route name {route.name!r} is used twice (give routes distinct names)")
        routes.add(route.name)
        kinds = [k.value for k in CauseKind]
        unknown = set(route.cause_kinds) - set(kinds)
        if unknown:
            raise ConfigError(f"{where} ({route.name}): cause_kinds {sorted(unknown)} are not "
                              f"{', '.join(kinds[:-1])} or {kinds[-1]}")
        for key in ("min_cause_score", "min_duration_seconds", "group_wait_seconds", "group_interval_seconds",
                    "repeat_interval_seconds", "resolve_wait_seconds"):
            if getattr(route, key) < 0:
                raise ConfigError(f"{where} ({route.name}): {key} must not be negative")
        if route.min_ratio < 1:
            raise ConfigError(f"{where} ({route.name}): min_ratio is p99 over baseline and must be at least 1")
        if route.max_per_hour < 1:
            raise ConfigError(f"{where} ({route.name}): max_per_hour must be at least 1")


def _check_tls(cfg: Config, named: Callable[[str], str]) -> None:
    """TLS files a daemon can use: readable PEM, a key that matches its certificate, client CAs only with TLS."""
    c, a = cfg.collector, cfg.agent
    _check_cert_and_key(named, ("collector.tls_cert_file", c.tls_cert_file), ("collector.tls_key_file", c.tls_key_file))
    for key, path in (("collector.tls_client_ca_file", c.tls_client_ca_file),
                      ("collector.api_tls_client_ca_file", c.api_tls_client_ca_file)):
        if path and not c.tls_cert_file:
            raise ConfigError(f"{named(key)}: requiring client certificates needs TLS: set collector.tls_cert_file "
                              "and collector.tls_key_file too")
        _check_ca(named, key, path)
    _check_cert_and_key(named, ("agent.collector_cert_file", a.collector_cert_file),
                        ("agent.collector_key_file", a.collector_key_file))
    _check_ca(named, "agent.collector_ca_file", a.collector_ca_file)
    for key in ("agent.collector_ca_file", "agent.collector_cert_file"):
        if getattr(a, key.partition(".")[2]) and not _may_use_tls(a.collector):
            raise ConfigError(f"{named(key)}: needs TLS to the collector, but agent.collector ({a.collector}) is not "
                              "an https:// URL; write it as https://HOST:PORT")


def _read_pem(named: Callable[[str], str], key: str, path: str, marker: bytes, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{named(key)}: cannot read {path}: {exc.strerror}") from None
    if marker not in data:
        raise ConfigError(f"{named(key)}: {path} holds no PEM {what}")
    return data


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key.
    raise ValueError("the key is encrypted")


def _check_cert_and_key(named: Callable[[str], str], cert: tuple[str, str], key: tuple[str, str]) -> None:
    (cert_key, cert_path), (key_key, key_path) = cert, key
    if not cert_path and not key_path:
        return
    if not key_path or not cert_path:
        given, missing = (cert_key, key_key) if cert_path else (key_key, cert_key)
        raise ConfigError(f"{named(given)}: a TLS certificate and its key go together; set {missing} too")
    _read_pem(named, cert_key, cert_path, b"-----BEGIN CERTIFICATE-----", "certificate (-----BEGIN CERTIFICATE-----)")
    pem = _read_pem(named, key_key, key_path, b"PRIVATE KEY-----", "private key (-----BEGIN PRIVATE KEY-----)")
    if b"ENCRYPTED" in pem:
        raise ConfigError(f"{named(key_key)}: {key_path} is encrypted; a daemon cannot ask for a passphrase, so give "
                          "it the key unencrypted (openssl pkey -in KEY -out KEY.plain), readable by it alone")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=_no_passphrase)
    except (ssl.SSLError, ValueError) as exc:
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{named(key_key)}: the key in {key_path} does not belong to the certificate in "
                              f"{cert_path} ({cert_key})") from None
        raise ConfigError(f"{named(key_key)}: {cert_path} and {key_path} are no usable certificate and key: "
                          f"{getattr(exc, 'reason', None) or exc}") from None


def _check_ca(named: Callable[[str], str], key: str, path: str) -> None:
    if not path:
        return
    _read_pem(named, key, path, b"-----BEGIN CERTIFICATE-----", "CA certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(f"{named(key)}: {path} holds no usable CA certificate: {exc.reason or exc}") from None


def check_otlp_exposure(cfg: Config) -> None:
    """Refuse OTLP receivers beyond loopback that would take data from anyone (the collector calls this at start).

    Not part of ``load``: the agent reads the same tree, and the collector's defaults must not stop it.

    >>> check_otlp_exposure(load(env={}, flags={"collector.otlp_token": "t0ken"}))
    >>> check_otlp_exposure(load(env={}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    spikehound.config.ConfigError: collector.otlp_grpc (default 0.0.0.0:4317): OTLP beyond loopback without ...
    """
    c, defaults = cfg.collector, CollectorConfig()
    if c.otlp_token or c.tls_client_ca_file or c.allow_unauthenticated_otlp:
        return
    for name in ("otlp_grpc", "otlp_http"):
        listen: HostPort = getattr(c, name)
        if not listen.is_loopback:
            shown = f"default {listen}" if listen == getattr(defaults, name) else str(listen)
            raise ConfigError(f"collector.{name} ({shown}): OTLP beyond loopback without authentication takes data "
                              f"from any host that reaches it; bind it to loopback (127.0.0.1:{listen.port}), set "
                              "collector.otlp_token (SPIKEHOUND_COLLECTOR_OTLP_TOKEN), require client certificates "
                              "(collector.tls_client_ca_file), or set collector.allow_unauthenticated_otlp = true")


def _is_loopback_host(host: str) -> bool:
    try:
        return HostPort(host, 0).is_loopback
    except ValueError:
        return False


SECRET_REFERENCE_FIELDS = ("url_secret", "signing_secret", "bearer_token")


def _resolve_secret_references(cfg: Config, env: typing.Mapping[str, str],
                               sources: typing.Mapping[str, str]) -> None:
    """Receiver secrets may be written ``env:NAME`` or ``file:PATH`` (systemd credentials) instead of inline."""
    src = sources.get("alerts.receivers")
    where = f"alerts.receivers (from {src})" if src else "alerts.receivers"
    for number, r in enumerate(cfg.alerts.receivers, 1):
        for key in SECRET_REFERENCE_FIELDS:
            value: str = getattr(r, key)
            if value.startswith("env:"):
                name = value[4:]
                if not env.get(name):
                    raise ConfigError(f"{where}: entry {number}: {key} names the environment variable {name}, "
                                      "which is not set")
                setattr(r, key, env[name])
            elif value.startswith("file:"):
                try:
                    setattr(r, key, Path(value[5:]).read_text().strip())
                except OSError as exc:
                    raise ConfigError(f"{where}: entry {number}: {key} names the file {value[5:]}: "
                                      f"{exc.strerror}") from None


SECRET_SUFFIXES = ("token", "secret", "password")
DATABASE_SCHEMES = ("sqlite://", "postgresql://", "postgresql+psycopg://", "postgres://")


# Query parameters whose values are shown: libpq's connection settings that hold no secret. Any other value (a
# password, a webhook's ?key= or ?token=) is hidden.
SHOWN_QUERY_KEYS = frozenset({"sslmode", "connect_timeout", "application_name", "target_session_attrs",
                              "gssencmode", "channel_binding", "keepalives", "keepalives_idle",
                              "keepalives_interval", "keepalives_count", "tcp_user_timeout"})
MIN_LOGGED_SECRET = 8  # a query value at least this long is also kept out of log lines (shorter: ordinary words)


def _split(url: str) -> SplitResult | None:
    """``url`` split; None when it cannot be (an unclosed ``[``): configuration refuses it, logs must not fail."""
    try:
        return urlsplit(url)
    except ValueError:
        return None


def _token_user(parts: SplitResult) -> str | None:
    """The user name of a URL that has no password and is not a database's: often a token used as the user."""
    if parts.username and parts.password is None and not f"{parts.scheme}://".startswith(DATABASE_SCHEMES):
        return parts.username
    return None


def redact_url(url: str) -> str:
    """Hide the password of a URL and every query value but libpq's harmless settings: ``postgresql://u:***@h/db``,
    ``https://hooks.example/in?key=***``; a fragment is hidden whole. A user name without a password is hidden too
    (a token is often passed that way), but a database URL's role name is kept. A URL that cannot be read is hidden
    whole but its scheme; this never raises.

    >>> redact_url("postgresql://app:s3cret@db/spikehound?sslmode=require&password=s3cret")
    'postgresql://app:***@db/spikehound?sslmode=require&password=***'
    >>> redact_url("https://hooks.example/alert?channel=ops&key=AIzaSyD-s3cret&bare-s3cret#tok")
    'https://hooks.example/alert?channel=***&key=***&***#***'
    >>> redact_url("https://ghp_t0ken@hooks.example/in"), redact_url("postgresql://u:s3cret@[::1/db")
    ('https://***@hooks.example/in', 'postgresql://***')
    """
    parts = original = _split(url)
    if parts is None:
        scheme, sep, _ = url.partition("://")
        return f"{scheme}://***" if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) else "***"
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    elif _token_user(parts):
        parts = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2])
    if parts.query:
        shown = []
        for piece in parts.query.split("&"):
            key, eq, _ = piece.partition("=")
            visible = unquote(key).lower() in SHOWN_QUERY_KEYS
            shown.append(piece if visible or not piece else f"{key}=***" if eq else "***")
        parts = parts._replace(query="&".join(shown))
    if parts.fragment:
        parts = parts._replace(fragment="***")
    return url if parts == original else urlunsplit(parts)


def _query_secrets(url: str) -> set[str]:
    """The query values ``redact_url`` hides that are long enough to look for in log lines, as written and decoded.

    >>> sorted(_query_secrets("https://h/in?sslmode=require&key=s3cret%2Bkey&n=1"))
    ['s3cret%2Bkey', 's3cret+key']
    """
    found: set[str] = set()
    parts = _split(url)
    if parts is None:
        return {url}  # unreadable: hidden whole
    for piece in parts.query.split("&"):
        key, _, value = piece.partition("=")
        if unquote(key).lower() not in SHOWN_QUERY_KEYS and len(unquote(value)) >= MIN_LOGGED_SECRET:
            found.update({value, unquote(value)})
    return found


def effective(cfg: Config) -> dict[str, Any]:
    """The configuration as plain data with secrets hidden, for ``check-config`` and logs."""

    def render(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, HostPort):
                out[f.name] = render(value)
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                out[f.name] = [render(item) for item in value]
            elif f.name.endswith(SECRET_SUFFIXES):
                out[f.name] = "***" if value else ""
            elif isinstance(value, HostPort):
                out[f.name] = str(value)
            elif f.name == "url" and isinstance(value, str):
                out[f.name] = redact_url(value)
            else:
                out[f.name] = value
        return out

    return render(cfg)


def to_toml(doc: dict[str, Any]) -> str:
    """Render ``effective()`` as TOML (top-level keys first, then one table per section)."""

    def literal(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(literal(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def is_tables(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [f"{k} = {literal(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, values in doc.items():
        if isinstance(values, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {literal(v)}" for k, v in values.items() if not is_tables(v)]
            for key, tables in values.items():  # arrays of tables ([[alerts.routes]]) come after the plain keys
                if is_tables(tables):
                    for table in tables:
                        lines += ["", f"[[{section}.{key}]]"] + [f"{k} = {literal(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def secret_values(cfg: Config) -> list[str]:
    """Every secret the configuration holds (tokens, URL passwords, hidden URL query values of 8 characters or
    more), longest first, for log redaction.

    >>> cfg = load(env={}, flags={"collector.api_token": "t0ken", "storage.url": "postgresql://u:p%40ss@db/x"})
    >>> secret_values(cfg)
    ['p%40ss', 't0ken', 'p@ss']
    """
    found: set[str] = set()

    def walk(obj: Any) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, HostPort):
                walk(value)
            elif isinstance(value, list):  # [[alerts.receivers]]: url_secret, signing_secret, bearer_token
                for item in value:
                    if dataclasses.is_dataclass(item):
                        walk(item)
            elif isinstance(value, str) and value and f.name.endswith(SECRET_SUFFIXES):
                found.add(value)
            elif isinstance(value, str) and f.name == "url":
                parts = _split(value)
                password = (parts.password if parts else None) or ""
                found.update({password, unquote(password)} if password else set())
                user = _token_user(parts) if parts else None
                found.update({user, unquote(user)} if user else set())
                found.update(_query_secrets(value))

    walk(cfg)
    parts = _split(cfg.database_url) or urlsplit("")
    if parts.password:
        found.update({parts.password, unquote(parts.password)})
    found.update(v for k, v in parse_qsl(parts.query) if k.lower() == "password" and v)
    found.update(_query_secrets(cfg.database_url))
    return sorted(found, key=lambda s: (-len(s), s))
