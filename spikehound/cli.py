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
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spikehound import __version__
from spikehound.config import Config, ConfigError, HostPort, check_otlp_exposure, effective, load, to_toml
from spikehound.text import printable, recurrence
from spikehound.timefmt import parse_time

DEFAULT_API_URL = "http://127.0.0.1:8470"

# Flag -> configuration key; flags beat environment variables, which beat the file.
COLLECTOR_FLAGS = {"db": "storage.url", "api": "collector.api", "otlp_grpc": "collector.otlp_grpc",
                   "otlp_http": "collector.otlp_http", "log_level": "log.level", "log_format": "log.format"}


AGENT_FLAGS = {"db": "storage.url", "collector": "agent.collector", "otlp_grpc": "agent.otlp_grpc",
               "otlp_http": "agent.otlp_http", "interval": "agent.interval", "log_level": "log.level",
               "log_format": "log.format"}


def _safe(text: object) -> str:
    """Untrusted text (names, summaries and errors from spans or the API) fit for a terminal."""
    return printable(text)


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
    from spikehound.heap import configure_malloc

    configure_malloc()  # before any thread allocates (spikehound/heap.py)
    from spikehound import logs
    from spikehound.collector.daemon import Collector
    from spikehound.lifecycle import serve
    from spikehound.storage.engine import DatabaseUnavailable

    cfg = _config(args)
    try:
        logs.configure(cfg)
        return asyncio.run(serve(Collector(cfg), reload_config=lambda: _config(args)))
    except DatabaseUnavailable as exc:  # one line, what to do, and a status systemd acts on (docs/operations.md)
        print(f"spikehound collector: {exc}", file=sys.stderr)
        return exc.status
    except OSError as exc:
        print(f"spikehound collector: {exc}", file=sys.stderr)
        return 1


def cmd_agent(args: argparse.Namespace) -> int:
    from spikehound.agent.runtime import prefer_poll_transport, run
    from spikehound.heap import configure_malloc

    configure_malloc()  # before any thread allocates (spikehound/heap.py)
    prefer_poll_transport()  # before spikehound.agent.daemon loads gRPC
    from spikehound import logs
    from spikehound.agent.daemon import Agent
    from spikehound.lifecycle import serve

    cfg = _config(args)
    try:
        logs.configure(cfg)
        return run(serve(Agent(cfg), stop_timeout=cfg.agent.drain_seconds + 20,
                                 reload_config=lambda: _config(args)))
    except OSError as exc:
        print(f"spikehound agent: {exc}", file=sys.stderr)
        return 1


def cmd_check_config(args: argparse.Namespace) -> int:
    if args.file:
        if args.config and args.config != args.file:
            raise ConfigError(f"check-config: two files given ({args.file} and --config {args.config})")
        args.config = args.file
    cfg = _config(args)
    sys.stdout.write(to_toml(effective(cfg)))
    try:  # the agent reads the same tree: this stops only a collector, so a note for a collector's file
        if args.config and "collector" in tomllib.loads(Path(args.config).read_text()):
            check_otlp_exposure(cfg)
    except ConfigError as exc:
        print(f"# configuration is valid for an agent; a collector would refuse to start: {exc}", file=sys.stderr)
        return 0
    print("# configuration is valid", file=sys.stderr)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from spikehound.storage.engine import DatabaseUnavailable, make_engine, unavailable
    from spikehound.storage.migrate import upgrade

    cfg = _config(args)
    try:
        try:
            revision = upgrade(make_engine(cfg.database_url, sqlite_synchronous=cfg.storage.sqlite_synchronous))
        except (OperationalError, OSError) as exc:
            raise unavailable(exc, cfg.database_url) from None
    except DatabaseUnavailable as exc:
        print(f"spikehound db upgrade: {exc}", file=sys.stderr)
        return exc.status
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
    cells = [[_safe(x) for x in row] for row in (header, *rows)]
    widths = [max(len(x) for x in col) for col in zip(*cells, strict=False)]
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


def _print_spikes(spikes: Sequence[dict[str, Any]]) -> None:
    rows = [(s["id"], s["state"], s["start"],
             f"{s['peer_service']} -> {s['service']}" if s.get("peer_service") else s["service"], s["operation"],
             f"{s['p99_ms']:.1f}", f"{s['baseline_p99_ms']:.1f}", str(len(s.get("affected_streams", [])) or 1),
             s["causes"][0]["summary"] if s["causes"] else "-") for s in spikes]
    if not rows:
        print("no spikes")
        return
    _print_table(rows, ("ID", "STATE", "START", "SERVICE", "OPERATION", "P99 MS", "BASE MS", "STREAMS", "TOP CAUSE"))


def cmd_spikes(args: argparse.Namespace) -> int:
    body = _api_get(args.api_url, "/api/v1/spikes", {"since": args.since, "service": args.service,
                                                     "state": args.state})
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    _print_spikes(body["spikes"])
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from spikehound.collector.detection_driver import detection_settings
    from spikehound.collector.replay import replay
    from spikehound.model_json import spike_json
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
    caller = f"{spike['peer_service']} -> " if spike.get("peer_service") else ""
    print(_safe(f"spike {spike['id']} ({spike['state']}) on {caller}{spike['service']} {spike['operation']}"))
    print(_safe(f"  from {spike['start']} to {spike['end'] or 'now'}: p99 {spike['p99_ms']:.1f} ms "
                f"against a baseline of {spike['baseline_p99_ms']:.1f} ms"))
    if spike.get("recurrence_of"):
        print(_safe(f"  {_recurrence_line(spike)}"))
    for rank, cause in enumerate(spike["causes"], 1):
        print(_safe(f"  {rank}. [{cause['kind']}] {cause['summary']} "
                    f"(explains {cause['score']:.0%} of the added latency)"))
    affected = spike.get("affected_streams", [])
    if len(affected) > 1:
        print(_safe(f"  streams it moved ({len(affected)}, the leader first):"))
        for stream in affected:
            hop = f"{stream['peer_service']} -> " if stream["peer_service"] else ""
            print(_safe(f"    {hop}{stream['service']} {stream['operation']}: p99 {stream['p99_ms']:.1f} ms against "
                        f"{stream['baseline_p99_ms']:.1f} ms, {stream['slow_requests']} slow request(s), "
                        f"evidence {stream['evidence']:.1f} from {stream['start']}"))
    _print_profile(args.api_url, spike["id"])
    for trace_id in spike["exemplar_trace_ids"]:
        print(_safe(f"  trace {args.api_url.rstrip('/')}/api/v1/traces/{trace_id}"))
    from spikehound.collector.web.links import spike_page_url

    print(_safe(f"  page  {spike_page_url(args.api_url, spike['id'])}"))
    return 0


def _recurrence_line(spike: dict[str, Any]) -> str:
    """"the same fault again: 3rd time in 25 min (first: spike X)"."""
    since = parse_time(spike["start"]) - parse_time(spike["first_start"]) if spike.get("first_start") else 0
    return f"the same fault again: {recurrence(spike['occurrence'], since)} (first: spike {spike['recurrence_of']})"


PROFILE_CHANGES_SHOWN = 3


def _print_profile(api_url: str, spike_id: str) -> None:
    """The spike's "Profile" section: per profiled process, the functions whose own share of the samples grew
    most; a collector without the route (older) or a failed read costs the section only."""
    try:
        body = _api_get(api_url, f"/api/v1/spikes/{urllib.parse.quote(spike_id, safe='')}/profile",
                        {"limit": str(PROFILE_CHANGES_SHOWN)})
        groups = body["profiles"]
    except (OSError, ValueError, KeyError, TypeError) as exc:  # urllib's errors are OSErrors, bad JSON ValueError
        print(_safe(f"  Profile: not available ({exc.__class__.__name__})"))
        return
    if not groups:
        print(_safe(f"  Profile: {body.get('reason') or 'no profiles in the spike windows'}"))
        return
    if body.get("partial"):
        print(_safe(f"  Profile (partial): {body['partial']}"))
    for g in groups:
        print(_safe(f"  Profile: {g['service'] or '?'} on {g['host']} ({g['kind']} samples: "
                    f"{g['samples_spike']} during the spike, {g['samples_baseline']} before):"))
        grown = [c for c in g["changes"] if c["self_spike"] > c["self_baseline"]]
        for rank, change in enumerate(grown, 1):
            mark = "  <- culprit" if g["culprit"] and change["function"] == g["culprit"]["function"] \
                and change["file"] == g["culprit"]["file"] else ""
            rate = ""
            if change.get("self_rate_baseline") and change["self_rate_spike"] >= 2 * change["self_rate_baseline"]:
                rate = f", {change['self_rate_spike'] / change['self_rate_baseline']:.1f}x its samples a second"
            print(_safe(f"    {rank}. {change['sentence']} ({change['file']}{rate}){mark}"))
        if not grown:
            print("    no function took a larger share of the samples")
        if g["why_unclear"]:
            print(_safe(f"    no clear culprit: {g['why_unclear']}"))


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


# --- regression gate and serving analysis (compare, baseline, analyze) ---------------------------

EXIT_CANNOT_RUN = 3  # compare: 0 ok, 1 regression, 2 too little data; 3 when it could not ask or read


def _times(args: argparse.Namespace) -> dict[str, str | None]:
    """--since/--until with ``now`` and ``30m``-style durations resolved here, where the clock is."""
    import time

    from spikehound.analysis_report import relative_time

    now = time.time_ns()
    return {name: relative_time(getattr(args, name), now) if getattr(args, name) else None
            for name in ("since", "until")}


def _selector(text: str | None) -> str | None:
    """A ``SINCE..UNTIL`` selection may use ``now`` and durations too."""
    import time

    from spikehound.analysis_report import relative_time

    if text is None or ".." not in text or "=" in text:
        return text
    now = time.time_ns()
    return "..".join(relative_time(part, now) for part in text.split("..", 1))


def _print_report(args: argparse.Namespace, report: dict[str, Any], lines: Sequence[str]) -> None:
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(_safe(line) for line in lines))


def _cannot_run(command: str, exc: Exception) -> int:
    if isinstance(exc, urllib.error.HTTPError):
        detail = exc.read().decode(errors="replace")[:300]
        print(_safe(f"spikehound {command}: {exc.url} answered {exc.code}: {detail}"), file=sys.stderr)
    elif isinstance(exc, urllib.error.URLError):
        print(f"spikehound {command}: cannot reach the collector API: {exc.reason}", file=sys.stderr)
    else:
        print(f"spikehound {command}: {exc}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def cmd_compare(args: argparse.Namespace) -> int:
    from spikehound.analysis_report import comparison_lines
    from spikehound.detectors.compare import CompareOptions, compare, comparison_report
    from spikehound.detectors.profile import Profile

    if (args.baseline is None) == (args.baseline_file is None) or args.candidate is None:
        return _cannot_run("compare", ValueError("give --candidate, and --baseline or --baseline-file"))
    params: dict[str, Any] = {**_times(args), "service": args.service, "operation": args.operation}
    try:
        if args.baseline_file is None:
            report = _api_get(args.api, "/api/v1/compare", {
                **params, "baseline": _selector(args.baseline), "candidate": _selector(args.candidate),
                "max_regression": args.max_regression, "min_requests": str(args.min_requests),
                "confidence": str(args.confidence), "seed": str(args.seed)})
        else:
            with open(args.baseline_file, "rb") as f:
                baseline = Profile.from_json(json.load(f))
            candidate = Profile.from_json(_api_get(args.api, "/api/v1/profile", {
                "select": _selector(args.candidate), **_times(args)}))
            options = CompareOptions(max_regression=_fraction(args.max_regression), min_requests=args.min_requests,
                                     confidence=args.confidence, seed=args.seed, service=args.service,
                                     operation=args.operation)
            report = comparison_report(compare(baseline, candidate, options), baseline, candidate)
    except (OSError, ValueError) as exc:  # urllib's errors are OSErrors; a bad file is a ValueError
        return _cannot_run("compare", exc)
    _print_report(args, report, comparison_lines(report))
    return int(report["exit_code"])


def _fraction(text: str) -> float:
    """``5%`` or ``0.05``."""
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= value <= 10:
        raise ValueError(f"--max-regression {text}: give a fraction such as 0.05 or a percentage such as 5%")
    return value


def cmd_baseline_save(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    try:
        profile = _api_get(args.api, "/api/v1/profile", {"select": _selector(args.select), **_times(args)})
        profile["saved_at"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = json.dumps(profile, separators=(",", ":"))
        if args.output == "-":
            print(text)
        else:
            with open(args.output, "w") as f:
                f.write(text + "\n")
    except (OSError, ValueError) as exc:
        return _cannot_run("baseline save", exc)
    requests = sum(op["latency_ns"]["n"] for op in profile["operations"])
    if args.output != "-":
        print(_safe(f"saved the baseline of {profile['selector']} ({requests:,} requests in "
                    f"{len(profile['operations'])} operations) to {args.output}"), file=sys.stderr)
    return 0 if requests else 2


def cmd_analyze_batching(args: argparse.Namespace) -> int:
    from spikehound.analysis_report import batching_lines

    report = _api_get(args.api, "/api/v1/analyze/batching", {
        "service": args.service, "attribute": args.attribute, "p99_target": args.p99_target,
        "select": _selector(args.select), "min_requests": str(args.min_requests), **_times(args)})
    _print_report(args, report, batching_lines(report))
    return 0


def cmd_analyze_pipeline(args: argparse.Namespace) -> int:
    from spikehound.analysis_report import pipeline_lines

    report = _api_get(args.api, "/api/v1/analyze/pipeline", {
        "service": args.service, "operation": args.operation, "select": _selector(args.select), **_times(args)})
    _print_report(args, report, pipeline_lines(report))
    return 0


_SELECTION_HELP = "KEY=VALUE (resource attribute), a service.version value, or SINCE..UNTIL"


def _add_analysis_flags(p: argparse.ArgumentParser, *, output: bool = True) -> None:
    p.add_argument("--api", default=os.environ.get("SPIKEHOUND_API_URL", DEFAULT_API_URL),
                   help=f"collector API URL (default $SPIKEHOUND_API_URL or {DEFAULT_API_URL}); "
                        "$SPIKEHOUND_COLLECTOR_API_TOKEN is sent as the bearer token")
    p.add_argument("--since", help="start of the range for attribute selections: RFC 3339, unix seconds, or a "
                                   "duration before now (30m, 2h, 7d); default one hour before --until")
    p.add_argument("--until", help="end of that range (same forms, or now); default now")
    if output:
        p.add_argument("--format", choices=["table", "json"], default="table", help="output (default table)")


def add_analysis_commands(sub: Any) -> None:
    p = sub.add_parser("compare", help="regression gate: compare a candidate's latency with a baseline "
                                       "(exit 1 on a p99 regression)",
                       description="Exit status: 0 no p99 regression beyond --max-regression, 1 a regression the "
                                   "data support (the message names the operation and the span that grew), 2 too "
                                   "little data to judge, 3 the comparison could not run.")
    p.add_argument("--baseline", metavar="SELECTION", help=_SELECTION_HELP)
    p.add_argument("--baseline-file", metavar="FILE", help="a baseline saved by spikehound baseline save")
    p.add_argument("--candidate", metavar="SELECTION", help=_SELECTION_HELP + " (required)")
    p.add_argument("--service", help="judge only this service's operations")
    p.add_argument("--operation", help="judge only this operation")
    p.add_argument("--max-regression", default="5%", help="allowed p99 growth: 5%% (default) or 0.05")
    p.add_argument("--min-requests", type=int, default=100, help="requests per side to judge an operation (100)")
    p.add_argument("--confidence", type=float, default=0.95, help="of the bootstrap intervals (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap draws (default 0: reproducible)")
    _add_analysis_flags(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("baseline", help="save a latency baseline for compare --baseline-file")
    actions = p.add_subparsers(dest="baseline_command", required=True, metavar="ACTION")
    save = actions.add_parser("save", help="save the latency profile of a selection to a file")
    save.add_argument("--select", metavar="SELECTION", required=True, help=_SELECTION_HELP)
    save.add_argument("-o", "--output", metavar="FILE", required=True, help="file to write (- for stdout)")
    _add_analysis_flags(save, output=False)
    save.set_defaults(func=cmd_baseline_save)

    p = sub.add_parser("analyze", help="serving analyses: batch-size sweet spot, where the time goes")
    kinds = p.add_subparsers(dest="analyze_command", required=True, metavar="ANALYSIS")
    batching = kinds.add_parser("batching", help="latency, throughput and GPU utilization per batch size")
    batching.add_argument("--service", required=True, help="the model server's service name")
    batching.add_argument("--attribute", default="batch.size", help="batch-size span attribute (batch.size)")
    batching.add_argument("--p99-target", metavar="MS", help="p99 target in ms (or 50ms, 0.05s) for the advice")
    batching.add_argument("--select", metavar="SELECTION", help="only these requests: " + _SELECTION_HELP)
    batching.add_argument("--min-requests", type=int, default=100, help="requests a batch size needs (100)")
    _add_analysis_flags(batching)
    batching.set_defaults(func=cmd_analyze_batching)
    pipeline = kinds.add_parser("pipeline", help="share of critical-path time by stage, median vs p99 requests")
    pipeline.add_argument("--service", required=True, help="service whose requests to break down")
    pipeline.add_argument("--operation", help="only this operation (default: each, busiest first)")
    pipeline.add_argument("--select", metavar="SELECTION", help="only these requests: " + _SELECTION_HELP)
    _add_analysis_flags(pipeline)
    pipeline.set_defaults(func=cmd_analyze_pipeline)


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
    p.add_argument("--collector", metavar="URL", help="collector OTLP/gRPC endpoint (default 127.0.0.1:4317); several "
                   "as a comma-separated list, dns:///NAME:PORT or file:///PATH, each trace routed whole to one")
    p.add_argument("--otlp-grpc", metavar="HOST:PORT", help="local OTLP/gRPC listen address (default 127.0.0.1:4317)")
    p.add_argument("--otlp-http", metavar="HOST:PORT", help="local OTLP/HTTP listen address (default 127.0.0.1:4318)")
    p.add_argument("--interval", metavar="SECONDS", help="sampling interval (default 1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    p.add_argument("--log-format", choices=["plain", "json"], help="log line format")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("check-config", help="validate the configuration and print the effective values")
    p.add_argument("file", nargs="?", metavar="FILE", help="TOML file to check (same as --config FILE)")
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
    add_analysis_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"spikehound: bad configuration: {exc}", file=sys.stderr)
        return 2
    except urllib.error.HTTPError as exc:
        print(_safe(f"spikehound: {exc.url} answered {exc.code}: {exc.read().decode(errors='replace')[:300]}"),
              file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"spikehound: cannot reach the collector API: {exc.reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
