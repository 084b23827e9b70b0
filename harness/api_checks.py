"""A collector loaded with one incident of every kind the API shows, and the checks of its answers against the
OpenAPI document it serves: what ``benchmarks/api_fuzz.py`` fuzzes and ``tests/test_fuzz.py`` asserts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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

from harness.api_client import ApiClient, client_of
from harness.daemons import CollectorProcess, free_port
from harness.scenario_io import scenario_requests, send
from harness.scenarios.traffic import Scenario
from spikehound.units import NS

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
    api = client_of(collector.api)
    try:
        api.wait_json("/api/v1/alerts/outbox", lambda body: body["notifications"],
                      what="a spike found and dead-lettered", state="dead")
    except AssertionError as exc:
        collector.kill()
        raise RuntimeError(f"no spike was found and dead-lettered: {collector.log_tail()}") from exc
    made = api.post("/api/v1/silences", json={"matchers": {"service": "preprocess"}, "duration_seconds": 3600,
                                              "comment": "api fuzz"})
    assert made.status_code == 201, made.text
    return collector


# The scenario loaded_collector sends: its range, and where the slow query starts, in unix seconds.
SCENARIO = Scenario("slow_db", "large", seed=3, minutes=5, onset_s=212.0, fault_s=60.0)
START_S, ONSET_S, END_S = (t // NS for t in (SCENARIO.start_ns, SCENARIO.onset_ns, SCENARIO.end_ns))


def known_cases(schema: BaseSchema, api: str) -> list[Case]:
    """Requests that name what the collector holds (its spikes, their exemplar traces, services, hosts, the
    dead letter and the silence), which generated ids and names rarely hit: every object route with data."""

    def get(path: str) -> Any:
        return ApiClient(api, timeout=60).get_json(path)

    def case(method: str, path: str, path_parameters: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None) -> Case:
        return schema[path][method].Case(path_parameters=path_parameters, query=query)

    cases = [case("GET", p) for p in ("/api/v1/spikes", "/api/v1/services", "/api/v1/hosts", "/healthz", "/readyz",
                                      "/metrics")]
    for spike in get("/api/v1/spikes")["spikes"]:
        cases.append(case("GET", "/api/v1/spikes/{spike_id}", {"spike_id": spike["id"]}))
        cases.append(case("GET", "/api/v1/spikes/{spike_id}/profile", {"spike_id": spike["id"]}))
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
