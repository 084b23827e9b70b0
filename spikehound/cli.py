"""The ``spikehound`` command: one entry point for every daemon and tool.

This is the only core module that knows every package; each command imports
what it needs when it runs, so ``spikehound --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from spikehound import __version__
from spikehound.config import Config, ConfigError, HostPort, effective, load, to_toml

DEFAULT_API_URL = "http://127.0.0.1:8470"

# Flag -> configuration key; flags beat environment variables, which beat the file.
COLLECTOR_FLAGS = {"db": "storage.url", "api": "collector.api", "otlp_grpc": "collector.otlp_grpc",
                   "otlp_http": "collector.otlp_http", "log_level": "log.level", "log_format": "log.format"}


AGENT_FLAGS = {"db": "storage.url", "collector": "agent.collector", "otlp_grpc": "agent.otlp_grpc",
               "otlp_http": "agent.otlp_http", "interval": "agent.interval", "log_level": "log.level",
               "log_format": "log.format"}


def _config(args: argparse.Namespace) -> Config:
    mapping = AGENT_FLAGS if args.command == "agent" else COLLECTOR_FLAGS
    flags = {key: getattr(args, flag, None) for flag, key in mapping.items()}
    names = {key: "--" + flag.replace("_", "-") for flag, key in mapping.items()}
    return load(args.config, flags=flags, flag_names=names)


def _add_config_flags(p: argparse.ArgumentParser, *, listeners: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (default: $SPIKEHOUND_CONFIG)")
    p.add_argument("--db", metavar="URL", help="database URL: sqlite:///PATH or postgresql://USER@HOST/DB")
    if listeners:
        p.add_argument("--api", metavar="HOST:PORT", help="REST API listen address (default 127.0.0.1:8470)")
        p.add_argument("--otlp-grpc", metavar="HOST:PORT", help="OTLP/gRPC listen address (default 0.0.0.0:4317)")
        p.add_argument("--otlp-http", metavar="HOST:PORT", help="OTLP/HTTP listen address (default 0.0.0.0:4318)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    p.add_argument("--log-format", choices=["plain", "json"], help="log line format")


def cmd_collector(args: argparse.Namespace) -> int:
    from collector.daemon import Collector
    from spikehound import logs
    from spikehound.lifecycle import serve

    cfg = _config(args)
    logs.setup(cfg.log.level, cfg.log.format)
    try:
        return asyncio.run(serve(Collector(cfg)))
    except OSError as exc:
        print(f"spikehound collector: {exc}", file=sys.stderr)
        return 1


def cmd_agent(args: argparse.Namespace) -> int:
    from agent.daemon import Agent
    from spikehound import logs
    from spikehound.lifecycle import serve

    cfg = _config(args)
    logs.setup(cfg.log.level, cfg.log.format)
    try:
        return asyncio.run(serve(Agent(cfg), stop_timeout=cfg.agent.drain_seconds + 20))
    except OSError as exc:
        print(f"spikehound agent: {exc}", file=sys.stderr)
        return 1


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _config(args)
    sys.stdout.write(to_toml(effective(cfg)))
    print("# configuration is valid", file=sys.stderr)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from storage.engine import make_engine
    from storage.migrate import upgrade

    cfg = _config(args)
    revision = upgrade(make_engine(cfg.database_url, sqlite_synchronous=cfg.storage.sqlite_synchronous))
    print(f"database schema at revision {revision}")
    return 0


def _api_get(base: str, path: str, params: dict[str, str] | None = None) -> Any:
    query = urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v is not None})
    request = urllib.request.Request(base.rstrip("/") + path + (f"?{query}" if query else ""))
    token = os.environ.get("SPIKEHOUND_COLLECTOR_API_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


def _print_spikes(spikes: Sequence[dict[str, Any]]) -> None:
    rows = [(s["id"], s["state"], s["start"], s["service"], s["operation"],
             f"{s['p99_ms']:.1f}", f"{s['baseline_p99_ms']:.1f}",
             s["causes"][0]["summary"] if s["causes"] else "-") for s in spikes]
    if not rows:
        print("no spikes")
        return
    _print_table(rows, ("ID", "STATE", "START", "SERVICE", "OPERATION", "P99 MS", "BASE MS", "TOP CAUSE"))


def cmd_spikes(args: argparse.Namespace) -> int:
    body = _api_get(args.api_url, "/api/v1/spikes", {"since": args.since, "service": args.service,
                                                     "state": args.state})
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    _print_spikes(body["spikes"])
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from collector.api import spike_json
    from collector.detection import detection_settings
    from collector.replay import replay
    from spikehound.otlp_file import OtlpFileError

    cfg = load(args.config)
    try:
        result = replay(args.files, detection_settings(cfg))
    except OtlpFileError as exc:
        print(f"spikehound replay: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"spikehound replay: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    spikes = [spike_json(s) for s in result.spikes]
    if args.format == "json":
        print(json.dumps({"spikes": spikes}, indent=2))
    else:
        _print_spikes(spikes)
    print(f"replayed {result.records} records: {result.spans} spans, {result.points} metric points, "
          f"{result.rejected} rejected as invalid, {result.windows} latency windows, {len(spikes)} spikes",
          file=sys.stderr)
    return 0


def cmd_spike(args: argparse.Namespace) -> int:
    spike = _api_get(args.api_url, f"/api/v1/spikes/{urllib.parse.quote(args.id, safe='')}")
    if args.json:
        print(json.dumps(spike, indent=2))
        return 0
    print(f"spike {spike['id']} ({spike['state']}) on {spike['service']} {spike['operation']}")
    print(f"  from {spike['start']} to {spike['end'] or 'now'}: p99 {spike['p99_ms']:.1f} ms "
          f"against a baseline of {spike['baseline_p99_ms']:.1f} ms")
    for rank, cause in enumerate(spike["causes"], 1):
        print(f"  {rank}. [{cause['kind']}] {cause['summary']} (explains {cause['score']:.0%} of the added latency)")
    for trace_id in spike["exemplar_trace_ids"]:
        print(f"  trace {args.api_url.rstrip('/')}/api/v1/traces/{trace_id}")
    return 0


def _host_port(text: str) -> HostPort:
    try:
        return HostPort.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from spikehound.demo import run_demo

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    return run_demo(rate=args.rate, warmup=args.warmup, fault_seconds=args.fault_seconds,
                    recover_seconds=args.recover_seconds, faults=faults, api=args.api, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spikehound", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"spikehound {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("collector", help="run the central collector (OTLP in, storage, detectors, API)")
    _add_config_flags(p)
    p.set_defaults(func=cmd_collector)

    p = sub.add_parser("agent", help="run the per-host agent (GPU/CPU/network samplers, local OTLP receiver, "
                                     "loss-free forwarding)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (default: $SPIKEHOUND_CONFIG)")
    p.add_argument("--collector", metavar="URL", help="collector OTLP/gRPC endpoint (default 127.0.0.1:4317)")
    p.add_argument("--otlp-grpc", metavar="HOST:PORT", help="local OTLP/gRPC listen address (default 127.0.0.1:4317)")
    p.add_argument("--otlp-http", metavar="HOST:PORT", help="local OTLP/HTTP listen address (default 127.0.0.1:4318)")
    p.add_argument("--interval", metavar="SECONDS", help="sampling interval (default 1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    p.add_argument("--log-format", choices=["plain", "json"], help="log line format")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("check-config", help="validate the configuration and print the effective values")
    _add_config_flags(p)
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("db", help="database maintenance")
    db = p.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    up = db.add_parser("upgrade", help="apply schema migrations (also done at collector start)")
    _add_config_flags(up, listeners=False)
    up.set_defaults(func=cmd_db_upgrade)

    for name, helptext, func in (("spikes", "list spikes from the collector's API", cmd_spikes),
                                 ("spike", "show one spike with its causes", cmd_spike)):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--api-url", default=os.environ.get("SPIKEHOUND_API_URL", DEFAULT_API_URL),
                       help=f"collector API URL (default $SPIKEHOUND_API_URL or {DEFAULT_API_URL})")
        p.add_argument("--json", action="store_true", help="print the API's JSON")
        if name == "spikes":
            p.add_argument("--since", help="RFC 3339 time or unix seconds")
            p.add_argument("--service", help="only this service")
            p.add_argument("--state", choices=["open", "resolved"], help="only open or resolved spikes")
        else:
            p.add_argument("id", help="spike id")
        p.set_defaults(func=func)

    p = sub.add_parser("replay", help="backtest: run recorded OTLP files through the detectors in event time "
                                      "and print the spikes found")
    p.add_argument("files", nargs="+", metavar="FILE", help="OTLP JSON lines (as the OpenTelemetry file exporter "
                   "writes them) or protobuf (length-prefixed messages, or one request body)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration whose [detection] and window settings "
                   "to use (default: $SPIKEHOUND_CONFIG)")
    p.add_argument("--format", choices=["table", "json"], default="table", help="output format (default table)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("demo", help="inject real faults into an instrumented inference stack and show spikehound "
                                     "finding and explaining them (about 3 minutes)")
    p.add_argument("--faults", default="cpu,slow-query,network,gpu",
                   help="faults to inject, in order (default cpu,slow-query,network,gpu)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, open loop (default 20)")
    p.add_argument("--warmup", type=float, default=40.0, metavar="SECONDS",
                   help="normal traffic before the first fault (default 40)")
    p.add_argument("--fault-seconds", type=float, default=15.0, help="how long each fault lasts (default 15)")
    p.add_argument("--recover-seconds", type=float, default=10.0,
                   help="calm time after each fault, longer while its spikes are open (default 10)")
    p.add_argument("--api", metavar="HOST:PORT", type=_host_port,
                   help="collector API address (default 127.0.0.1:8470 when free)")
    p.add_argument("--keep", action="store_true", help="keep the collector running at the end (Ctrl-C stops it)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"spikehound: bad configuration: {exc}", file=sys.stderr)
        return 2
    except urllib.error.HTTPError as exc:
        print(f"spikehound: {exc.url} answered {exc.code}: {exc.read().decode(errors='replace')[:300]}",
              file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"spikehound: cannot reach the collector API: {exc.reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
