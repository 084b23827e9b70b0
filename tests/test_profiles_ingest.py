"""The collector receives OTLP profiles: ProfilesService/Export on its gRPC port and ``POST /v1development/profiles``
on its HTTP port, each export committed in its own transaction before it is answered; bad input refused with a
message and counted, the valid rest stored; a retry stored once; the token, the in-flight bound and a failing
write answered as the other signals are (real collectors on loopback, SQLite and PostgreSQL)."""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
    ExportProfilesServiceResponse,
)
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2_grpc import ProfilesServiceStub
from sqlalchemy.exc import OperationalError

from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.model import DEFAULT_PERIOD_NS, ProfileStack
from spikehound.otlp import trailer_retry_delay
from spikehound.otlp_profiles import (
    MAX_FRAME_CHARS_PER_REQUEST,
    MAX_FRAMES,
    decode_profiles,
    encode_profiles,
)
from spikehound.storage.reader import Reader, count_rows

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
S = 1_000_000_000
MAIN = ("<module>", "/srv/stack.py", 1)
HANDLE = ("handle", "/srv/stack.py", 210)


def window_start(seconds_ago: int = 30) -> int:
    """A 10 s window that ended in the past (profiles dated after the collector's clock are refused)."""
    return (time.time_ns() - seconds_ago * S) // (10 * S) * (10 * S)


def stack(leaf: str, samples: int, start: int, *, pid: int = 42, service: str = "preprocess",
          host: str = "gpu-1") -> ProfileStack:
    return ProfileStack(host=host, service=service, pid=pid, process="python3", start_unix_nano=start,
                        end_unix_nano=start + 10 * S, frames=(MAIN, HANDLE, (leaf, "/srv/stack.py", 180)),
                        samples=samples)


def stored(c: CollectorThread, start: int) -> list[ProfileStack]:
    read = Reader(c.collector.engine).profile_stacks(start - 60 * S, start + 60 * S)
    return sorted(read, key=lambda s: (s.start_unix_nano, s.pid, s.frames))


def ordered(stacks: Sequence[ProfileStack]) -> list[ProfileStack]:
    return sorted(stacks, key=lambda s: (s.start_unix_nano, s.pid, s.frames))


def counter(c: CollectorThread, name: str, **labels: str) -> float:
    return c.metric(f"spikehound_ingest_{name}_total", **labels)


def post(c: CollectorThread, body: bytes, content_type: str = PROTOBUF, headers: dict[str, str] | None = None
         ) -> requests.Response:
    return requests.post(f"{c.http_endpoint}/v1development/profiles", data=body,
                         headers={"Content-Type": content_type} | (headers or {}), timeout=10)


def status_of(r: requests.Response) -> status_pb2.Status:
    """The google.rpc.Status of an error answer, in whichever encoding it came."""
    if r.headers["Content-Type"].startswith(JSON):
        return json_format.ParseDict(r.json(), status_pb2.Status())
    return status_pb2.Status.FromString(r.content)


@pytest.fixture
def export(sqlite_collector: CollectorThread) -> Iterator[Callable[..., Any]]:
    with grpc.insecure_channel(sqlite_collector.grpc_endpoint) as channel:
        yield ProfilesServiceStub(channel).Export


def with_unknown_stack(req: ExportProfilesServiceRequest, index: int = 99, count: int = 5
                       ) -> ExportProfilesServiceRequest:
    """``req`` with one more sample in its first profile, whose stack is not in the dictionary."""
    req.resource_profiles[0].scope_profiles[0].profiles[0].samples.add(stack_index=index, values=[count])
    return req


# --- stored, over both protocols and both databases ------------------------------------------------------------


def test_a_grpc_export_is_stored_before_it_is_answered(collector: CollectorThread):
    start = window_start()
    sent = [stack("burn_cpu", 120, start), stack("json_dumps", 7, start), stack("burn_cpu", 3, start, pid=43),
            stack("burn_cpu", 150, start + 10 * S)]
    with grpc.insecure_channel(collector.grpc_endpoint) as channel:
        response = ProfilesServiceStub(channel).Export(encode_profiles(sent), timeout=10)
    assert not response.HasField("partial_success")
    # Answered after the commit: readable at once, no waiting.
    assert stored(collector, start) == ordered(sent)
    assert counter(collector, "stored", signal="profiles") == 280
    assert counter(collector, "received", signal="profiles", protocol="grpc") == 280


def test_a_retried_export_is_stored_once(collector: CollectorThread):
    start = window_start()
    req = encode_profiles([stack("burn_cpu", 120, start), stack("json_dumps", 7, start)])
    with grpc.insecure_channel(collector.grpc_endpoint) as channel:
        stub = ProfilesServiceStub(channel)
        stub.Export(req, timeout=10)
        stub.Export(req, timeout=10)  # the agent's retry of an export whose answer was lost
    assert [s.samples for s in stored(collector, start)] == [120, 7]
    assert count_rows(collector.collector.engine, "profile_samples") == 2
    assert count_rows(collector.collector.engine, "profile_stacks") == 2


@pytest.mark.parametrize("encoding", ["protobuf", "protobuf+gzip", "json"])
def test_http_posts_are_stored(sqlite_collector: CollectorThread, encoding: str):
    start = window_start()
    sent = [stack("burn_cpu", 11, start), stack("sleep", 4, start, pid=7)]
    req = encode_profiles(sent)
    headers: dict[str, str] = {}
    if encoding == "json":
        r = post(sqlite_collector, json_format.MessageToJson(req).encode(), JSON)
    elif encoding == "protobuf+gzip":
        headers = {"Content-Encoding": "gzip"}
        r = post(sqlite_collector, gzip.compress(req.SerializeToString()), PROTOBUF, headers)
    else:
        r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 200, r.content
    if encoding == "json":
        assert r.headers["Content-Type"].startswith(JSON) and r.json() == {}
    else:
        assert r.headers["Content-Type"].startswith(PROTOBUF)
        assert not ExportProfilesServiceResponse.FromString(r.content).HasField("partial_success")
    assert stored(sqlite_collector, start) == ordered(sent)
    assert counter(sqlite_collector, "received", signal="profiles", protocol="http") == 15


# --- bad input: a message, counted, nothing else lost -----------------------------------------------------------


def test_a_malformed_body_is_refused_with_a_message(sqlite_collector: CollectorThread, export: Callable[..., Any]):
    garbage = b"\xff\xfe\xfd garbage \x00\x01"
    r = post(sqlite_collector, garbage)
    assert r.status_code == 400
    status = status_of(r)
    assert status.code == 3 and "invalid OTLP protobuf" in status.message
    r = post(sqlite_collector, b'{"resourceProfiles": [', JSON)
    assert r.status_code == 400 and "invalid JSON" in status_of(r).message
    with grpc.insecure_channel(sqlite_collector.grpc_endpoint) as channel:
        raw = channel.unary_unary("/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export")
        with pytest.raises(grpc.RpcError) as raised:
            raw(garbage, timeout=10)  # no serializer: the bytes go out as they are
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid OTLP protobuf" in raised.value.details()
    assert counter(sqlite_collector, "rejected_requests", protocol="http", reason="bad_payload") == 2
    assert counter(sqlite_collector, "rejected_requests", protocol="grpc", reason="bad_payload") == 1
    start = window_start()
    export(encode_profiles([stack("after_bad_input", 1, start)]), timeout=10)  # still served
    assert [s.frames[-1][0] for s in stored(sqlite_collector, start)] == ["after_bad_input"]


def test_http_framing_is_the_other_signals(tmp_path: Path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__max_request_bytes=2000)
    start = window_start()
    body = encode_profiles([stack(f"leaf_{i}", 1, start) for i in range(100)]).SerializeToString()
    assert len(body) > 2000
    with CollectorThread(cfg) as c:
        r = post(c, body, "text/plain")
        assert r.status_code == 415 and "unsupported Content-Type" in r.json()["message"]
        r = post(c, body)
        assert r.status_code == 413 and "exceeds 2000 bytes" in status_of(r).message
        r = post(c, gzip.compress(body), PROTOBUF, {"Content-Encoding": "gzip"})  # small, until inflated
        assert r.status_code == 413
        assert counter(c, "rejected_requests", protocol="http", reason="too_large") == 2
        assert counter(c, "rejected_requests", protocol="http", reason="unsupported_media_type") == 1
        assert stored(c, start) == []


def test_a_stack_outside_the_dictionary_is_named_and_the_rest_stored(sqlite_collector: CollectorThread,
                                                                      export: Callable[..., Any]):
    start = window_start()
    good = [stack("burn_cpu", 120, start), stack("json_dumps", 7, start)]
    response = export(with_unknown_stack(encode_profiles(good)), timeout=10)
    assert response.partial_success.rejected_profiles == 5  # the samples refused
    assert "stack 99 is not in the dictionary" in response.partial_success.error_message
    assert stored(sqlite_collector, start) == ordered(good)
    assert counter(sqlite_collector, "rejected", signal="profiles", reason="invalid") == 5
    assert counter(sqlite_collector, "stored", signal="profiles") == 127
    # Over HTTP too, in the request's encoding.
    later = start + 10 * S
    r = post(sqlite_collector, json_format.MessageToJson(with_unknown_stack(encode_profiles(
        [stack("burn_cpu", 1, later)]), index=-1)).encode(), JSON)
    assert r.status_code == 200, r.content
    assert r.json()["partialSuccess"]["rejectedProfiles"] == "5"
    assert "stack -1 is not in the dictionary" in r.json()["partialSuccess"]["errorMessage"]


def test_nothing_valid_is_invalid_argument_with_the_reasons(sqlite_collector: CollectorThread,
                                                            export: Callable[..., Any]):
    req = with_unknown_stack(encode_profiles([stack("burn_cpu", 0, window_start())]))  # a zero count is no sample
    with pytest.raises(grpc.RpcError) as raised:
        export(req, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stack 99 is not in the dictionary" in raised.value.details()
    r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 400 and "stack 99 is not in the dictionary" in status_of(r).message
    assert count_rows(sqlite_collector.collector.engine, "profile_samples") == 0


def test_a_profile_dated_in_the_future_is_refused_and_counted(sqlite_collector: CollectorThread,
                                                             export: Callable[..., Any]):
    ahead = time.time_ns() + 3600 * S  # an hour past the collector's clock: more than the allowed skew
    with pytest.raises(grpc.RpcError) as raised:
        export(encode_profiles([stack("burn_cpu", 30, ahead, host="fast-clock")]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dated after the collector's clock" in raised.value.details()
    assert sqlite_collector.metric("spikehound_ingest_future_records_total", signal="profiles",
                                   service="preprocess", host="fast-clock") == 30
    assert counter(sqlite_collector, "rejected", signal="profiles", reason="invalid") == 30
    # Beside a good one: the good one is stored, the sender told which was refused.
    start = window_start()
    response = export(encode_profiles([stack("burn_cpu", 30, ahead, host="fast-clock"),
                                       stack("burn_cpu", 2, start)]), timeout=10)
    assert response.partial_success.rejected_profiles == 30
    assert [s.host for s in stored(sqlite_collector, start)] == ["gpu-1"]


def test_a_count_storage_cannot_hold_is_refused(sqlite_collector: CollectorThread, export: Callable[..., Any]):
    start = window_start()
    response = export(encode_profiles([stack("huge", 2**31, start), stack("small", 3, start)]), timeout=10)
    assert response.partial_success.rejected_profiles == 2**31
    assert "more than 2147483647" in response.partial_success.error_message
    assert [s.frames[-1][0] for s in stored(sqlite_collector, start)] == ["small"]


def test_a_profile_without_a_period_is_stored_with_the_default_period(sqlite_collector: CollectorThread,
                                                                         export: Callable[..., Any]):
    # period is optional to OTLP producers: 0 in protobuf, left out of a JSON body.
    assert ProfileStack("h", "s", 1, "p", 1, 2, (), 1).period_ns == DEFAULT_PERIOD_NS == 52_631_578
    start = window_start()
    req = encode_profiles([stack("burn_cpu", 7, start)])
    req.resource_profiles[0].scope_profiles[0].profiles[0].period = 0
    assert not export(req, timeout=10).HasField("partial_success")
    later = encode_profiles([stack("burn_cpu", 3, start + 10 * S, pid=43)])
    later.resource_profiles[0].scope_profiles[0].profiles[0].period = 0
    body = json_format.MessageToDict(later)
    assert "period" not in body["resourceProfiles"][0]["scopeProfiles"][0]["profiles"][0]
    r = post(sqlite_collector, json_format.MessageToJson(later).encode(), JSON)
    assert r.status_code == 200, r.content
    assert [(s.samples, s.period_ns) for s in stored(sqlite_collector, start)] == [(7, DEFAULT_PERIOD_NS),
                                                                                  (3, DEFAULT_PERIOD_NS)]
    assert sqlite_collector.metric("spikehound_storage_write_errors_total") == 0


def test_negative_and_huge_counts_are_refused_and_the_valid_rest_stored(sqlite_collector: CollectorThread,
                                                                      export: Callable[..., Any]):
    start = window_start()
    # A profile refused as a whole (no host) whose one sample counts -5: one refused sample, not -5 (a
    # negative counter increment raised: 500 / UNKNOWN with a traceback).
    nohost = encode_profiles([stack("burn_cpu", 5, start, host="")])
    nohost.resource_profiles[0].scope_profiles[0].profiles[0].samples[0].values[0] = -5
    with pytest.raises(grpc.RpcError) as raised:
        export(nohost, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = post(sqlite_collector, nohost.SerializeToString())
    assert r.status_code == 400 and "no host.name" in status_of(r).message
    assert counter(sqlite_collector, "rejected", signal="profiles", reason="invalid") == 2
    # Refused samples summing past int64 beside a valid stack: the sum saturates, the valid stack is stored and
    # the answer is a partial success (rejected_profiles is an int64).
    req = encode_profiles([stack("valid", 3, start, pid=1), stack("a", 1, start, pid=2, host=""),
                           stack("b", 1, start, pid=2, host="")])
    for sample in req.resource_profiles[1].scope_profiles[0].profiles[0].samples:
        sample.values[0] = 2**63 - 1
    response = export(req, timeout=10)
    assert response.partial_success.rejected_profiles == 2**63 - 1
    r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 200, r.content
    assert ExportProfilesServiceResponse.FromString(r.content).partial_success.rejected_profiles == 2**63 - 1
    # Two samples of one stack at int64's largest: summed saturating, then refused as more than storage holds.
    same = encode_profiles([stack("huge", 1, start + 10 * S), stack("small", 2, start + 10 * S)])
    samples = same.resource_profiles[0].scope_profiles[0].profiles[0].samples
    samples[0].values[0] = 2**63 - 1
    samples.add(stack_index=samples[0].stack_index, values=[2**63 - 1])
    response = export(same, timeout=10)
    assert response.partial_success.rejected_profiles == 2**63 - 1
    assert [(s.frames[-1][0], s.samples) for s in stored(sqlite_collector, start)] == [("valid", 3), ("small", 2)]


def test_a_profile_dated_before_2000_is_refused(sqlite_collector: CollectorThread, export: Callable[..., Any]):
    start = window_start()
    response = export(encode_profiles([stack("burn_cpu", 30, 10 * S, host="unset-clock"),
                                       stack("burn_cpu", 2, start)]), timeout=10)
    assert response.partial_success.rejected_profiles == 30
    assert "before 2000-01-01" in response.partial_success.error_message
    assert [s.host for s in stored(sqlite_collector, start)] == ["gpu-1"]
    assert Reader(sqlite_collector.collector.engine).profile_stacks(0, 100 * S) == []


def test_the_wrong_clock_warning_counts_samples(sqlite_collector: CollectorThread, export: Callable[..., Any],
                                                caplog: pytest.LogCaptureFixture):
    ahead = time.time_ns() + 3600 * S
    with caplog.at_level(logging.WARNING, logger="spikehound.collector.ingest"), pytest.raises(grpc.RpcError):
        export(encode_profiles([stack("burn_cpu", 57, ahead, host="fast-clock")]), timeout=10)
    assert "refused 57 profile samples dated more than" in caplog.text


def deep_request(stacks: int, depth: int, name_length: int, start: int) -> ExportProfilesServiceRequest:
    """A small request that expands a lot: ``stacks`` distinct stacks of ``depth`` frames, each named by strings
    of ``name_length`` characters that the request carries once."""
    req = ExportProfilesServiceRequest()
    d = req.dictionary
    d.string_table.extend(["", "f" * name_length, "/" + "x" * (name_length - 1), "cpu"])
    d.function_table.add()
    d.function_table.add(name_strindex=1, filename_strindex=2)
    d.location_table.add()
    for line in range(1, depth + 2):
        d.location_table.add().lines.add(function_index=1, line=line)
    d.stack_table.add()
    rp = req.resource_profiles.add()
    rp.resource.attributes.add(key="host.name").value.string_value = "gpu-1"
    profile = rp.scope_profiles.add().profiles.add(time_unix_nano=start, duration_nano=10 * S, period=10**9 // 19)
    profile.period_type.type_strindex = 3
    for i in range(stacks):
        d.stack_table.add(location_indices=[1 + (i + k) % (depth + 1) for k in range(depth)])
        profile.samples.add(stack_index=len(d.stack_table) - 1, values=[1])
    return req


def test_what_one_request_expands_to_is_bounded_while_it_is_decoded(sqlite_collector: CollectorThread,
                                                                    export: Callable[..., Any]):
    start = window_start()
    # 40 distinct stacks of 256 frames of 2 KB names: 21 MB of frames from a request of about 20 kB.
    req = deep_request(40, MAX_FRAMES, 1024, start)
    per_stack = MAX_FRAMES * (2 * 1024 + 16)
    kept = MAX_FRAME_CHARS_PER_REQUEST // per_stack
    assert len(req.SerializeToString()) < 30_000 and 40 * per_stack > 2 * MAX_FRAME_CHARS_PER_REQUEST
    response = export(req, timeout=30)
    assert response.partial_success.rejected_profiles == 40 - kept
    assert "more than 8388608 characters of frames" in response.partial_success.error_message
    assert len(stored(sqlite_collector, start)) == kept
    assert counter(sqlite_collector, "rejected", signal="profiles", reason="invalid") == 40 - kept
    assert counter(sqlite_collector, "stored", signal="profiles") == kept


def test_the_stacks_past_the_bound_are_refused_unresolved():
    start = window_start()
    req = deep_request(5, 3, 8, start)
    req.dictionary.stack_table[5].location_indices[0] = 999  # past the bound: refused without being looked at
    decoded = decode_profiles(req, max_stacks=3)
    assert len(decoded.stacks) == 3 and decoded.rejected == 2
    assert decoded.errors == ["more than 3 stacks in one request: the rest was refused; send fewer at a time"]
    # Samples of stacks already taken still count; a stack already paid for costs nothing again.
    again = req.resource_profiles[0].scope_profiles[0].profiles[0].samples
    again.add(stack_index=1, values=[4])
    decoded = decode_profiles(req, max_stacks=3)
    assert [s.samples for s in decoded.stacks] == [5, 1, 1] and decoded.rejected == 2
    cost = 3 * (8 + 8 + 16)  # a stack of 3 frames with 8-character names
    decoded = decode_profiles(req, max_frame_chars=2 * cost)
    assert len(decoded.stacks) == 2 and decoded.rejected == 3
    assert "more than 192 characters of frames" in decoded.error_message


def test_a_deep_stack_keeps_its_root_and_its_leaf():
    start = window_start()
    deep = ProfileStack("gpu-1", "svc", 42, "python3", start, start + 10 * S,
                        tuple((f"f{i}", "a.py", i + 1) for i in range(1000)), 9)
    decoded = decode_profiles(encode_profiles([deep]))
    [back] = decoded.stacks
    assert len(back.frames) == MAX_FRAMES and decoded.truncated == {"frames": 1}
    assert back.frames[:128] == deep.frames[:128]  # the caller context
    assert back.frames[128] == ("(745 frames cut)", "", 0)
    assert back.frames[129:] == deep.frames[-127:]  # the leaf: the self share a diff reads


def test_decoding_runs_off_the_event_loop_within_the_in_flight_bound(sqlite_collector: CollectorThread,
                                                                     export: Callable[..., Any]):
    profiles = sqlite_collector.collector.profiles
    assert profiles is not None
    decode, started, release = profiles._decode, threading.Event(), threading.Event()

    def slow(*args: Any) -> Any:
        started.set()
        release.wait(10)  # a decoding that takes its time
        return decode(*args)

    profiles._decode, profiles.max_in_flight = slow, 1  # type: ignore[method-assign]
    start = window_start()
    waiting = export.future(encode_profiles([stack("first", 9, start)]), timeout=20)
    try:
        assert started.wait(10)
        # The event loop is free meanwhile: the API answers, the receivers refuse past the bound.
        t0 = time.monotonic()
        assert requests.get(f"{sqlite_collector.api}/readyz", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 2
        assert profiles.in_flight == 1
        r = post(sqlite_collector, encode_profiles([stack("second", 1, start)]).SerializeToString())
        assert r.status_code == 429
    finally:
        release.set()
    waiting.result()
    assert profiles.in_flight == 0
    assert [s.frames[-1][0] for s in stored(sqlite_collector, start)] == ["first"]


# --- the token, the in-flight bound, a failing write -------------------------------------------------------------


def test_the_token_is_required_when_configured(tmp_path: Path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__otlp_token="s3cret")
    start = window_start()
    req = encode_profiles([stack("burn_cpu", 9, start)])
    with CollectorThread(cfg) as c, grpc.insecure_channel(c.grpc_endpoint) as channel:
        stub = ProfilesServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Export(req, timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert post(c, req.SerializeToString()).status_code == 401
        assert post(c, req.SerializeToString(), headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert counter(c, "rejected_requests", protocol="grpc", reason="unauthenticated") == 1
        assert counter(c, "rejected_requests", protocol="http", reason="unauthenticated") == 2
        assert stored(c, start) == []
        stub.Export(req, metadata=(("authorization", "Bearer s3cret"),), timeout=10)
        r = post(c, encode_profiles([stack("burn_cpu", 9, start, pid=1)]).SerializeToString(),
                 headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.content
        assert len(stored(c, start)) == 2


def test_exports_past_the_in_flight_bound_are_told_to_retry(sqlite_collector: CollectorThread,
                                                            export: Callable[..., Any]):
    profiles = sqlite_collector.collector.profiles
    assert profiles is not None
    write, release = profiles.write, threading.Event()

    def slow(stacks: Sequence[ProfileStack]) -> None:
        release.wait(10)  # a commit that takes its time
        write(stacks)

    profiles.write, profiles.max_in_flight = slow, 1
    start = window_start()
    waiting = export.future(encode_profiles([stack("first", 9, start)]), timeout=20)
    eventually(lambda: profiles.in_flight == 1, "the first export to wait for its commit")
    req = encode_profiles([stack("second", 1, start)])
    with pytest.raises(grpc.RpcError) as raised:
        export(req, timeout=10)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailer_retry_delay(raised.value.trailing_metadata()) == 1
    r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert counter(sqlite_collector, "rejected_requests", protocol="grpc", reason="profiles_in_flight") == 1
    assert counter(sqlite_collector, "rejected_requests", protocol="http", reason="profiles_in_flight") == 1
    release.set()
    waiting.result()
    assert profiles.in_flight == 0  # the place is given back with the answer
    export(req, timeout=10)  # the retry goes through
    assert [s.frames[-1][0] for s in stored(sqlite_collector, start)] == ["first", "second"]


def test_a_failed_write_is_unavailable_and_reported_to_storage_health(sqlite_collector: CollectorThread,
                                                                     export: Callable[..., Any]):
    profiles, pipeline = sqlite_collector.collector.profiles, sqlite_collector.collector.pipeline
    assert profiles is not None and pipeline is not None
    write = profiles.write
    start = window_start()
    req = encode_profiles([stack("burn_cpu", 9, start)])

    def unreachable(stacks: Sequence[ProfileStack]) -> None:
        raise OperationalError("INSERT INTO profile_samples", {}, ConnectionRefusedError(111, "Connection refused"))

    profiles.write = unreachable
    with pytest.raises(grpc.RpcError) as raised:
        export(req, timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailer_retry_delay(raised.value.trailing_metadata()) is not None
    # The database is away: an outage starts, as a failed span commit starts one; senders are refused.
    assert not pipeline.health.available and pipeline.health.kind == "unreachable"
    assert sqlite_collector.metric("spikehound_storage_outages_total", kind="unreachable") == 1
    assert counter(sqlite_collector, "dropped", signal="profiles", reason="storage_error") == 9
    r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    # Storage back: the pipeline's own attempt finds out, and the export goes through.
    profiles.write = write
    eventually(lambda: pipeline.health.available, "storage to be found back", timeout=20)
    export(req, timeout=10)
    assert [s.samples for s in stored(sqlite_collector, start)] == [9]
    assert profiles.in_flight == 0


def test_an_error_of_the_write_alone_is_no_outage(sqlite_collector: CollectorThread, export: Callable[..., Any]):
    profiles, pipeline = sqlite_collector.collector.profiles, sqlite_collector.collector.pipeline
    assert profiles is not None and pipeline is not None

    def broken(stacks: Sequence[ProfileStack]) -> None:
        raise ValueError("a bug of this write's own")

    profiles.write = broken
    with pytest.raises(grpc.RpcError) as raised:
        export(encode_profiles([stack("burn_cpu", 9, window_start())]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailer_retry_delay(raised.value.trailing_metadata()) == 1  # collector.retry_after_seconds
    assert pipeline.health.available and not pipeline.health.episode  # other senders are not refused
