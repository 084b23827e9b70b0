"""schemathesis over every operation of a live collector's OpenAPI document (issue 16).

Run from the repository root: ``python -m benchmarks.api_fuzz`` (``--max-examples N`` per operation,
``--seed N`` to repeat a run). It starts a real collector (a child process on SQLite in a temporary
directory), loads it first so that the routes answer with data: five minutes of the scenario suite's
traffic with a slow feature query in it (spans and host samples, so there are traces, latency windows,
metrics and a spike), an alert receiver that is never reachable (so the spike's notification is a dead
letter the outbox routes can show and retry) and a silence. Then schemathesis (its CLI, all phases:
examples, coverage, fuzzing, stateful) generates requests for every operation of the document the
collector serves at ``/api/v1/openapi.json`` and checks each answer:

* ``not_a_server_error``: no 5xx;
* ``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``: every answer is one the document describes, in its shape;
* ``missing_required_header``, ``unsupported_method``, ``allow_header_conformance``,
  ``ensure_resource_availability``: routing and methods behave as HTTP says.

Left out, with the reason: ``positive_data_acceptance`` and ``negative_data_rejection`` (a parameter's
validity can depend on another's, since before until, or on what storage holds, 1677 to 2262, which JSON
Schema cannot say, so a schema-valid request may rightly get a 400; and an empty optional parameter is
read as none given), ``use_after_free`` (a silence ended with DELETE stays readable as expired, by
design, docs/alerts.md), ``ignored_auth`` (the run has no token; tests/test_api.py covers tokens).

The requests name the collector by address (its Host check, collector/cross_site.py, passes them) and send
JSON bodies as application/json, as the document asks. Exit status: schemathesis's (0: no failure), or 1
when the collector logged an error or died.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests
import schemathesis
from schemathesis import BaseSchema, Case
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from benchmarks.traffic import Scenario
from tests.daemons import CollectorProcess, free_port
from tests.scenario_io import scenario_requests, send

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,missing_required_header,unsupported_method,allow_header_conformance,"
          "ensure_resource_availability")
LOGGED_ERROR = re.compile(r" (ERROR|CRITICAL) |Traceback")


# aiohttp's HTTP parser refusing a malformed request (schemathesis probes a NUL byte in a header) logs it at
# ERROR with a traceback, though the sender gets its 400: counted apart, as aiohttp's and not a failure.
PARSER_REFUSAL = "ERROR aiohttp.server: Error handling request"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d ")


def logged_errors(collector: CollectorProcess) -> tuple[list[str], int]:
    """The collector's error lines, less the dead letters the unreachable receiver makes on purpose and
    aiohttp's parser refusals (with their tracebacks), and how many of those refusals there were."""
    errors, refusals, in_refusal = [], 0, False
    for line in collector.log_text().splitlines():
        if PARSER_REFUSAL in line:
            refusals, in_refusal = refusals + 1, True
        elif in_refusal and not LOG_LINE.match(line):
            continue  # its traceback
        else:
            in_refusal = False
            if LOGGED_ERROR.search(line) and "dead-lettered" not in line:
                errors.append(line)
    return errors, refusals


def loaded_collector(workdir: Path) -> CollectorProcess:
    """A running collector holding a spike (with causes and exemplar traces), a dead letter and a silence."""
    nowhere = free_port()  # nothing listens there: every delivery fails at once
    collector = CollectorProcess(f"sqlite:///{workdir / 'spikehound.db'}", workdir, env={
        "SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS": "0.5",
        "SPIKEHOUND_ALERTS_RECEIVERS": json.dumps([{"name": "nowhere", "type": "webhook",
                                                    "url": f"http://127.0.0.1:{nowhere}/"}]),
        "SPIKEHOUND_ALERTS_ROUTES": json.dumps([{"receiver": "nowhere"}]),
        "SPIKEHOUND_ALERTS_MAX_ATTEMPTS": "1"})
    collector.start()
    send(collector.http_endpoint, scenario_requests(SCENARIO))
    deadline = time.monotonic() + 60
    while not requests.get(f"{collector.api}/api/v1/alerts/outbox?state=dead", timeout=10).json()["notifications"]:
        if time.monotonic() > deadline:
            collector.kill()
            raise RuntimeError(f"no spike was found and dead-lettered: {collector.log_tail()}")
        time.sleep(0.5)
    requests.post(f"{collector.api}/api/v1/silences", timeout=10, json={
        "matchers": {"service": "preprocess"}, "duration_seconds": 3600, "comment": "api fuzz"}).raise_for_status()
    return collector


# The scenario loaded_collector sends: its range, and where the slow query starts, in unix seconds.
SCENARIO = Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)
START_S, ONSET_S, END_S = (t // 1_000_000_000 for t in (SCENARIO.start_ns, SCENARIO.onset_ns, SCENARIO.end_ns))


def known_cases(schema: BaseSchema, api: str) -> list[Case]:
    """Requests that name what the collector holds (its spikes, their exemplar traces, services, hosts, the
    dead letter and the silence), which generated ids and names rarely hit: every object route with data."""

    def get(path: str) -> Any:
        return requests.get(api + path, timeout=60).json()

    def case(method: str, path: str, path_parameters: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None) -> Case:
        return schema[path][method].Case(path_parameters=path_parameters, query=query)

    cases = [case("GET", p) for p in ("/api/v1/spikes", "/api/v1/services", "/api/v1/hosts", "/healthz", "/readyz",
                                      "/metrics")]
    for spike in get("/api/v1/spikes")["spikes"]:
        cases.append(case("GET", "/api/v1/spikes/{spike_id}", {"spike_id": spike["id"]}))
        cases += [case("GET", "/api/v1/traces/{trace_id}", {"trace_id": t}) for t in spike["exemplar_trace_ids"]]
        cases.append(case("GET", "/api/v1/latency", query={"service": spike["service"], "since": START_S,
                                                           "until": END_S, "peer_service": spike["peer_service"]}))
    for service in get("/api/v1/services")["services"]:
        cases.append(case("GET", "/api/v1/latency", query={"service": service["service"], "since": START_S,
                                                           "until": END_S}))
    for host in get("/api/v1/hosts")["hosts"]:
        cases.append(case("GET", "/api/v1/metrics", query={"host": host["host"], "since": START_S, "until": END_S}))
    before, during, whole = f"{START_S}..{ONSET_S}", f"{ONSET_S}..{END_S}", f"{START_S}..{END_S}"
    cases += [case("GET", "/api/v1/compare", query={"baseline": before, "candidate": during, "replicates": 200}),
              case("GET", "/api/v1/profile", query={"select": whole}),
              case("GET", "/api/v1/analyze/batching", query={"service": "model-server", "select": whole}),
              case("GET", "/api/v1/analyze/pipeline", query={"service": "gateway", "select": whole}),
              case("GET", "/api/v1/silences", query={"state": "all"}),
              case("GET", "/api/v1/alerts/outbox", query={"state": "dead"})]
    for silence in get("/api/v1/silences?state=all")["silences"]:
        cases.append(case("GET", "/api/v1/silences/{silence_id}", {"silence_id": silence["id"]}))
    for row in get("/api/v1/alerts/outbox?state=dead")["notifications"]:
        cases.append(case("GET", "/api/v1/alerts/outbox/{row_id}", {"row_id": row["id"]}))
        # Twice: queued again (200), then no longer a dead letter (409).
        cases += [case("POST", "/api/v1/alerts/outbox/{row_id}/retry", {"row_id": row["id"]})] * 2
    return cases


# The checks of every answer, as functions (the CLI takes them by name: CHECKS).
ANSWER_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
                 response_schema_conformance]


def check_known(api: str) -> list[str]:
    """Send ``known_cases`` and check each answer against the served document: schemathesis's checks, and no
    field the document does not name (its schemas allow extra ones, which would let it fall behind the code).
    The failures, described."""
    schema = schemathesis.openapi.from_url(f"{api}/api/v1/openapi.json")
    document = schema.raw_schema
    failures = []
    for case in known_cases(schema, api):
        where = f"{case.method} {case.formatted_path} {case.query or ''}"
        try:
            response = case.call_and_validate(checks=ANSWER_CHECKS, timeout=120)
        except FailureGroup as exc:  # what was wrong, and how to reproduce it
            failures.append(f"{where}: {exc}")
            continue
        answer = document["paths"][case.path][case.method.lower()]["responses"].get(str(response.status_code), {})
        body_schema = answer.get("content", {}).get("application/json", {}).get("schema")
        if body_schema is not None:
            failures += [f"{where}: {path} is not in the document" for path in
                         undocumented(document, body_schema, response.json())]
    return failures


def undocumented(document: dict[str, Any], schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Paths of the fields of ``value`` that ``schema`` (an object with named properties) does not name."""
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    out = []
    if isinstance(value, dict):
        named, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if named is not None and key in named:
                out += undocumented(document, named[key], item, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += undocumented(document, extra, item, f"{path}.{key}")
            elif named:  # a free-form object (attributes) names nothing and takes anything
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            out += undocumented(document, schema["items"], item, f"{path}[]")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.api_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=200, help="generated cases per operation (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="schemathesis seed (default: a new one, printed)")
    args = parser.parse_args(argv)
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        print("schemathesis is not installed (pip install -e '.[dev]')", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spikehound-api-fuzz-") as tmp:
        workdir = Path(tmp)
        started = time.perf_counter()
        collector = loaded_collector(workdir)
        print(f"collector loaded in {time.perf_counter() - started:.1f} s: {collector.api}", flush=True)
        command = [exe, "run", f"{collector.api}/api/v1/openapi.json", "--checks", CHECKS,
                   "--max-examples", str(args.max_examples), "--header", "Host: 127.0.0.1",
                   "--request-timeout", "120", "--warnings", "off", "--no-color"]
        if args.seed is not None:
            command += ["--seed", str(args.seed)]
        started = time.perf_counter()
        try:
            known = check_known(collector.api)
            print(f"the collector's own objects: {len(known)} answers unlike the document", flush=True)
            for failure in known:
                print(failure)
            status = subprocess.run(command, cwd=workdir, timeout=3600, check=False).returncode
        finally:
            alive = collector.running
            collector.kill()
        logged, refusals = logged_errors(collector)
    print(f"schemathesis exited {status} after {time.perf_counter() - started:.1f} s; answers of the collector's "
          f"objects unlike the document: {len(known)}; collector alive at the end: {alive}; collector error lines "
          f"logged: {len(logged)} (and {refusals} malformed requests refused by aiohttp's parser, logged by it)")
    for line in logged[:10]:
        print(f"  {line}")
    return status or (0 if alive and not logged and not known else 1)


if __name__ == "__main__":
    sys.exit(main())
