"""Property and fuzz tests: generated hostile input never crashes, stalls or 5xx's spikehound.

Each property is a :class:`Property`: a hypothesis strategy and a check of one input that either returns
what happened (``"refused"``, ``"stored"``, a status code ...) or raises. The checks run what the
receivers, ``spikehound replay`` and the API run, on:

* OTLP request bodies (``spikehound/otlp.py``, in the receivers' order: parse, count, decode with limits):
  arbitrary bytes, OTLP messages built from the message types with ids of every length, zero ids, huge,
  negative and reversed times, NaN and infinite doubles, deep and wide AnyValue nesting, long strings,
  unknown fields and invalid UTF-8, then cut, flipped or wrapped; OTLP/JSON with hex or base64 ids, wrong
  types, huge numbers as strings and missing fields. A body is refused with ``PayloadError`` (the
  receivers' 400 / INVALID_ARGUMENT), or every span and point is accepted or rejected, each accepted one
  valid and within the limits, and what storage keeps decodes to exactly those;
* recorded OTLP files (``spikehound/otlp_file.py``): ``spikehound replay`` exits 0, or 2 naming the file
  and its line or message;
* the query parameter parsers, directly and over HTTP: never a 5xx; a 400 names the parameter;
* a real collector, over OTLP/HTTP and gRPC: only the documented answers, and it keeps ingesting.

``make test`` runs a few dozen inputs per property, derandomized (tests/conftest.py loads the ``ci``
profile); ``benchmarks/fuzz.py`` runs the same properties over 100,000 inputs.
"""

from __future__ import annotations

import gzip
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from schemathesis import Case, GenerationMode

from harness.api_checks import ANSWER_CHECKS, check_known, loaded_collector, logged_errors
from harness.daemons import CollectorThread, collector_config
from harness.fuzz_properties import (
    ANY_BYTES,
    METRIC_JSON,
    METRIC_PROTOBUF,
    PARSERS,
    TRACE_JSON,
    TRACE_PROTOBUF,
    Property,
    assert_still_ingesting,
    collector_properties,
    length_prefixed,
    load_sample_data,
    replay_file_property,
    run,
)


class ErrorLog(logging.Handler):
    """Collects log records at ERROR and above: a crash that is answered politely is still a crash."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)  # under the handler's own lock (Handler.handle)

    def messages(self) -> list[str]:
        return [self.format(r) for r in self.records]


# --- the fast subset, for make test ----------------------------------------------------------------------------

FAST = 40  # inputs per property in make test; benchmarks/fuzz.py runs thousands


@pytest.mark.parametrize("prop", [TRACE_PROTOBUF, TRACE_JSON, METRIC_PROTOBUF, METRIC_JSON, ANY_BYTES],
                         ids=lambda p: p.name)
def test_otlp_bodies_are_refused_with_a_reason_or_decode_to_valid_records_within_the_limits(prop: Property):
    outcomes = run(prop, FAST * 2)  # each input's invariants are checked in prop.check, which raises
    # The generated bodies reach both paths: the decoder's refusals and, but for arbitrary bytes, records kept.
    assert "refused" in outcomes or "rejected" in outcomes, outcomes
    assert prop is ANY_BYTES or "accepted" in outcomes, outcomes


def test_query_parameter_parsers_give_a_value_in_range_or_a_value_error():
    outcomes = run(PARSERS, FAST * 5)
    assert outcomes["parsed"] and outcomes["refused"], outcomes


def test_replay_reads_or_names_the_bad_record_of_any_file(tmp_path: Path):
    outcomes = run(replay_file_property(tmp_path), FAST)
    assert outcomes["replayed"] and outcomes["refused"], outcomes


def test_replay_of_garbled_files_exits_2_naming_the_file_and_record(tmp_path: Path):
    """The real ``spikehound replay`` process on a few files damaged in the ways the property draws."""
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent))
    assert exe, "spikehound is not installed in this environment"
    good = ExportTraceServiceRequest()
    good.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\1" * 16, span_id=b"\2" * 8,
                                                          start_time_unix_nano=1, end_time_unix_nano=2)
    body = good.SerializeToString()
    files = {"cut.binpb": (length_prefixed([body, body])[:-3], "message 1"),
             "flipped.binpb": (b"\xff" + body, "message 1"),
             "third.jsonl": (b'{"resourceSpans": []}\n\n{"resourceSpans": [{"scopeSpans": 7}]}\n', "line 3"),
             "ids.jsonl": (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', "line 1"),
             "capture.jsonl.gz": (gzip.compress(b'{"resourceSpans": []}\n'), "message 1")}
    for name, (content, where) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        done = subprocess.run([exe, "replay", str(path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"spikehound replay: {path}: {where}: "), done.stderr
        assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CollectorThread, list[Property], ErrorLog]]:
    """One collector with a little data for the properties over HTTP and gRPC, and its ERROR log records."""
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    db = tmp_path_factory.mktemp("fuzz") / "spikehound.db"
    try:
        with CollectorThread(collector_config(f"sqlite:///{db}")) as c, requests.Session() as session, \
                grpc.insecure_channel(c.grpc_endpoint) as channel:
            load_sample_data(c.http_endpoint, seconds=20)
            yield c, collector_properties(c, session, channel), errors
            assert_still_ingesting(c.http_endpoint, c.api)
    finally:
        logging.getLogger().removeHandler(errors)


@pytest.mark.parametrize("index", range(5), ids=["otlp-http", "otlp-grpc", "query", "path", "silences"])
def test_a_live_collector_answers_fuzzed_requests_as_documented(live: tuple[CollectorThread, list[Property],
                                                                             ErrorLog], index: int):
    _, properties, errors = live
    run(properties[index], FAST)
    assert not errors.messages(), errors.messages()[:3]


@pytest.mark.slow
def test_every_documented_operation_answers_as_the_served_document_says(tmp_path: Path):
    """schemathesis on a collector holding a spike, a dead letter and a silence (benchmarks/api_fuzz.py runs it
    at length): the real objects, then generated requests, valid and not, for every documented operation."""
    collector = loaded_collector(tmp_path)
    try:
        assert check_known(collector.api) == []
        schema = schemathesis.openapi.from_url(f"{collector.api}/api/v1/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/api/v1/spikes/{spike_id}", "/api/v1/alerts/outbox/{row_id}/retry"}
        for op in operations:
            strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
            run(Property(op.label, strategy, answered_as_documented), FAST // 4)
    finally:
        collector.kill()
    assert logged_errors(collector)[0] == []


def answered_as_documented(case: Case) -> str:
    """One generated request: its answer passes schemathesis's checks (no 5xx, documented status, type, shape)."""
    return str(case.call_and_validate(checks=ANSWER_CHECKS, timeout=120).status_code)
