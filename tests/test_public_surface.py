"""The public surface: what users and outside tools rely on, recorded in ``tests/fixtures/public_surface.json``.

Four parts, each compared with the record:

* the OpenAPI document the collector serves (``openapi_document()``), whole: any change fails;
* the ``spikehound`` command: every subcommand (nested ones as ``db upgrade``) with its options (option
  strings, action, required, default, choices, nargs, type) and positional arguments; help texts are left out.
  A recorded command or option must be there unchanged; new ones may be added (a new option must not be
  required), and the failure message lists them;
* the configuration keys: every ``section.key`` a config file may set (entries of an array of tables as
  ``alerts.routes[].key``), with its type annotation and default, walked from the dataclasses of
  ``spikehound.config``, plus the retired keys (``RETIRED``: each recorded one must stay retired). A recorded
  key must be there unchanged; new keys may be added;
* the Prometheus metric families each daemon shows on ``/metrics`` (the names of its ``# TYPE`` lines): a real
  ``spikehound collector`` and a real ``spikehound agent`` forwarding to it, both child processes on loopback
  with a temporary SQLite database, after real OTLP spans from the OpenTelemetry SDK went through the agent.
  Every recorded family must still be there; new ones may be added.

The record is the surface users and outside tools rely on; regenerate it only for a deliberate, documented
change (say so in the change's description), never to make this test pass. From the root of the tree whose
surface is to be recorded::

    PYTHONPATH=. .venv/bin/python tests/test_public_surface.py --write [OUTPUT]

(``OUTPUT`` defaults to ``tests/fixtures/public_surface.json`` beside this file; ``python -m
tests.test_public_surface --write`` from the repository root does the same.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.daemons import AgentProcess, CollectorProcess
from harness.scrape import scrape, scrape_text, total
from harness.waiting import eventually

FIXTURE = Path(__file__).parent / "fixtures" / "public_surface.json"
ENVIRONMENT_DEPENDENT = "<depends on the environment>"
SPANS_PER_EXPORTER = 3 * 4  # four traces of three spans


def normal(value: Any) -> Any:
    """``value`` as JSON would carry it (tuples as lists, a HostPort as its text, keys sorted)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with these variables set (None: unset) for the duration."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- the OpenAPI document -------------------------------------------------------------------------


def openapi_surface() -> Any:
    from spikehound.collector.rest.app import openapi_document

    return normal(openapi_document())


# --- the command line -----------------------------------------------------------------------------


def _type_name(kind: Any) -> str | None:
    if kind is None:
        return None
    return kind.__name__ if kind in (int, float, str) else "custom"


def _action(action: argparse.Action) -> dict[str, Any]:
    return normal({"action": type(action).__name__, "required": action.required, "default": action.default,
                   "choices": list(action.choices) if action.choices is not None else None,
                   "nargs": action.nargs, "type": _type_name(action.type)})


def _walk_parser(parser: argparse.ArgumentParser, path: tuple[str, ...], out: dict[str, Any]) -> None:
    options: dict[str, Any] = {}
    positionals: list[dict[str, Any]] = []
    subcommands: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                subcommands.append(name)
                _walk_parser(sub, (*path, name), out)
            positionals.append({"subcommand": True, "required": action.required})
        elif action.option_strings:
            options[max(action.option_strings, key=len)] = {"option_strings": list(action.option_strings),
                                                             **_action(action)}
        else:
            positionals.append({"dest": action.dest, **_action(action)})
    out[" ".join(path) or "(spikehound)"] = {"options": options, "positionals": positionals,
                                             "subcommands": sorted(subcommands)}


def cli_surface() -> dict[str, Any]:
    """Every command of the parser that ``spikehound`` runs, built as an unconfigured shell would see it."""
    from spikehound import cli

    with environment(SPIKEHOUND_API_URL=None, SPIKEHOUND_COLLECTOR_API_TOKEN=None):
        parser = cli.build_parser()
    out: dict[str, Any] = {}
    _walk_parser(parser, (), out)
    return dict(sorted(out.items()))


# --- configuration keys ---------------------------------------------------------------------------


def _type_text(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_text(a) for a in args)}]"
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return normal(f.default)
    factory = f.default_factory
    assert factory is not dataclasses.MISSING, f"{f.name} has no default"
    # A default computed from the environment (data_dir: $STATE_DIRECTORY, the user) is recorded as such.
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        with environment(STATE_DIRECTORY=a, HOME=a, XDG_STATE_HOME=a):
            first = normal(factory())
        with environment(STATE_DIRECTORY=b, HOME=b, XDG_STATE_HOME=b):
            second = normal(factory())
    return first if first == second else ENVIRONMENT_DEPENDENT


def _walk_config(cls: type, prefix: str, out: dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and f.default_factory is hint:  # a section (a HostPort is a value)
            _walk_config(typing.cast(type, hint), f"{prefix}{f.name}.", out)
            continue
        out[prefix + f.name] = {"type": _type_text(hint), "default": _default(f)}
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if item is not None and dataclasses.is_dataclass(item):
            _walk_config(typing.cast(type, item), f"{prefix}{f.name}[].", out)


def config_surface() -> dict[str, Any]:
    from spikehound import config

    keys: dict[str, Any] = {}
    _walk_config(config.Config, "", keys)
    return {"keys": dict(sorted(keys.items())), "retired": normal(dict(config.RETIRED))}


# --- metric families, from real daemons -----------------------------------------------------------


def _families(url: str) -> set[str]:
    return {line.split()[2] for line in scrape_text(url, timeout=10).splitlines() if line.startswith("# TYPE ")}


def _send_spans(exporter: Any, service: str) -> None:
    """Four requests of three spans each through the real SDK; every export acknowledged."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    results: list[SpanExportResult] = []

    class Checked(SpanExporter):
        def export(self, spans: typing.Sequence[ReadableSpan]) -> SpanExportResult:
            result = typing.cast(SpanExportResult, exporter.export(spans))
            results.extend([result] * len(spans))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.version": "1.0"}))
    provider.add_span_processor(SimpleSpanProcessor(Checked()))
    tracer = provider.get_tracer("public-surface")
    for i in range(SPANS_PER_EXPORTER // 3):
        with tracer.start_as_current_span("POST /v1/predict", kind=trace.SpanKind.SERVER,
                                          attributes={"model.name": "resnet50", "batch.size": 8, "request": i}):
            with tracer.start_as_current_span("preprocess"):
                time.sleep(0.002)
            with tracer.start_as_current_span("forward", kind=trace.SpanKind.CLIENT) as forward:
                forward.add_event("batch.enqueued", {"queue.depth": 3})
                time.sleep(0.003)
    provider.shutdown()
    assert results == [SpanExportResult.SUCCESS] * SPANS_PER_EXPORTER, results


def metric_families(workdir: Path) -> dict[str, list[str]]:
    """The families each daemon's /metrics declares after traffic, in two scrapes two seconds apart (only
    those in both: a family that comes and goes with timing is not recorded)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

    collector = CollectorProcess(f"sqlite:///{workdir / 'spikehound.db'}", workdir)
    agent = AgentProcess(collector.grpc_endpoint, workdir, interval=0.5,
                         env={"SPIKEHOUND_AGENT_HOST_NAME": "surface-host"})
    try:
        collector.start()
        agent.start()
        _send_spans(GrpcSpanExporter(endpoint=agent.grpc_endpoint, insecure=True), "surface-grpc")
        _send_spans(HttpSpanExporter(endpoint=f"{agent.http_endpoint}/v1/traces"), "surface-http")
        expected = 2 * SPANS_PER_EXPORTER
        eventually(lambda: total(scrape(collector.api), "spikehound_ingest_stored_total", signal="spans") >= expected,
                   f"the collector to store the {expected} spans sent through the agent", 30)
        eventually(lambda: total(agent.metrics(), "spikehound_agent_forwarded_total", signal="spans") >= expected,
                   f"the agent to count {expected} forwarded spans", 30)
        first = {"collector": _families(collector.api), "agent": _families(agent.metrics_url)}
        time.sleep(2)
        second = {"collector": _families(collector.api), "agent": _families(agent.metrics_url)}
    finally:
        agent.kill()
        collector.kill()
    return {daemon: sorted(first[daemon] & second[daemon]) for daemon in first}


# --- the record -----------------------------------------------------------------------------------


def surface(workdir: Path) -> dict[str, Any]:
    return {"openapi": openapi_surface(), "cli": cli_surface(), "config": config_surface(),
            "metrics": metric_families(workdir)}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return typing.cast(dict[str, Any], json.loads(FIXTURE.read_text()))


def differences(old: Any, new: Any, path: str = "$") -> Iterator[str]:
    """Where two JSON values differ, one line each."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            if key not in new:
                yield f"{path}.{key}: removed (was {json.dumps(old[key])[:200]})"
            elif key not in old:
                yield f"{path}.{key}: added ({json.dumps(new[key])[:200]})"
            else:
                yield from differences(old[key], new[key], f"{path}.{key}")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from differences(a, b, f"{path}[{i}]")
    elif old != new:
        yield f"{path}: {json.dumps(old)[:200]} -> {json.dumps(new)[:200]}"


def _report(title: str, changed: list[str], added: list[str]) -> str:
    lines = [f"{title}: {len(changed)} recorded item(s) changed or gone", *changed]
    if added:
        lines += ["additions (allowed):", *added]
    return "\n".join(lines)


def test_openapi_document_is_unchanged(recorded: dict[str, Any]) -> None:
    now = openapi_surface()
    changed = list(differences(recorded["openapi"], now))
    assert not changed, _report("OpenAPI document", changed[:60], [])


def test_every_recorded_command_and_option_is_unchanged(recorded: dict[str, Any]) -> None:
    old, now = recorded["cli"], cli_surface()
    changed: list[str] = []
    added: list[str] = []
    for command, was in old.items():
        if command not in now:
            changed.append(f"command {command!r}: gone")
            continue
        is_ = now[command]
        for option, spec in was["options"].items():
            if option not in is_["options"]:
                changed.append(f"{command} {option}: gone")
            elif is_["options"][option] != spec:
                changed += [f"{command} {option}: {line}" for line in differences(spec, is_["options"][option])]
        for option, spec in is_["options"].items():
            if option not in was["options"]:
                (changed if spec["required"] else added).append(
                    f"{command} {option}: new{' and required' if spec['required'] else ''} {spec}")
        if is_["positionals"] != was["positionals"]:
            changed.append(f"{command}: positionals {was['positionals']} -> {is_['positionals']}")
        gone = sorted(set(was["subcommands"]) - set(is_["subcommands"]))
        if gone:
            changed.append(f"{command}: subcommands gone {gone}")
    added += [f"command {command!r}: new" for command in now if command not in old]
    assert not changed, _report("spikehound command line", changed, added)


def test_every_recorded_config_key_is_unchanged(recorded: dict[str, Any]) -> None:
    old, now = recorded["config"], config_surface()
    changed = [f"{key}: gone (was {spec})" if key not in now["keys"] else f"{key}: {spec} -> {now['keys'][key]}"
               for key, spec in old["keys"].items() if now["keys"].get(key) != spec]
    changed += [f"retired key {key}: no longer retired" for key in old["retired"] if key not in now["retired"]]
    added = [f"{key}: new {spec}" for key, spec in now["keys"].items() if key not in old["keys"]]
    added += [f"retired key {key}: new" for key in now["retired"] if key not in old["retired"]]
    assert not changed, _report("configuration keys", changed, added)


def test_every_recorded_metric_family_is_still_exposed(recorded: dict[str, Any], tmp_path: Path) -> None:
    now = metric_families(tmp_path)
    changed: list[str] = []
    added: list[str] = []
    for daemon, families in recorded["metrics"].items():
        changed += [f"{daemon}: {name} gone" for name in families if name not in now[daemon]]
        added += [f"{daemon}: {name} new" for name in now[daemon] if name not in families]
    assert not changed, _report("metric families on /metrics", changed, added)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Record the public surface of the tree on sys.path.")
    parser.add_argument("--write", action="store_true", help="write the record (a deliberate, documented change)")
    parser.add_argument("output", nargs="?", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    import spikehound

    print(f"recording the surface of {Path(spikehound.__file__).parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="spikehound-surface-") as workdir:
        doc = surface(Path(workdir))
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if not args.write:
        sys.stdout.write(text)
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
