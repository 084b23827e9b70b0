"""Sampling profiles in storage: stacks stored once, retried exports stored once, read by service, host and time,
and aged out with their spans (SQLite and a real PostgreSQL server)."""

from __future__ import annotations

import time

from spikehound.model import ProfileStack
from spikehound.storage import schema
from spikehound.storage.reader import Reader, count_rows
from spikehound.storage.retention import Retention, RetentionPolicy, expire
from spikehound.storage.writer import Writer

S = 1_000_000_000
T0 = 1_750_000_000 * S
HANDLE = ("handle", "/srv/stack.py", 210)


def stack(leaf: str, samples: int, start: int = T0, *, service: str = "preprocess", host: str = "gpu-1",
          pid: int = 42) -> ProfileStack:
    return ProfileStack(host=host, service=service, pid=pid, process="python3", start_unix_nano=start,
                        end_unix_nano=start + 10 * S, frames=(("<module>", "/srv/stack.py", 1), HANDLE,
                                                              (leaf, "/srv/stack.py", 180)), samples=samples)


def test_stacks_round_trip_are_stored_once_and_a_retry_changes_nothing(engine):
    writer = Writer(engine)
    windows = [stack("burn_cpu", 120), stack("json_dumps", 7), stack("burn_cpu", 150, T0 + 10 * S)]
    writer.write_profiles(windows)
    writer.write_profiles(windows[:2])  # the agent's retry of an export whose answer was lost
    assert count_rows(engine, "profile_stacks") == 2
    assert count_rows(engine, "profile_samples") == 3
    read = Reader(engine).profile_stacks(T0, T0 + 20 * S, service="preprocess")
    assert sorted(read, key=lambda s: (s.start_unix_nano, s.samples)) == sorted(
        windows, key=lambda s: (s.start_unix_nano, s.samples))


def test_reads_select_by_service_host_and_overlapping_window(engine):
    Writer(engine).write_profiles([stack("a", 1), stack("b", 2, service="model"), stack("c", 3, host="gpu-2"),
                                   stack("d", 4, T0 + 60 * S)])
    reader = Reader(engine)
    leaves = lambda stacks: sorted(s.frames[-1][0] for s in stacks)  # noqa: E731
    assert leaves(reader.profile_stacks(T0 + 5 * S, T0 + 6 * S)) == ["a", "b", "c"]  # overlapping, not inside
    assert leaves(reader.profile_stacks(T0, T0 + 70 * S, service="preprocess")) == ["a", "c", "d"]
    assert leaves(reader.profile_stacks(T0, T0 + 70 * S, host="gpu-2")) == ["c"]
    assert reader.profile_stacks(T0 + 10 * S, T0 + 60 * S) == []  # windows end where this begins, and after


def test_odd_names_are_stored_as_sent_within_the_columns(engine):
    odd = ProfileStack(host="h" * 300, service="svc\x00", pid=1, process="p", start_unix_nano=T0,
                       end_unix_nano=T0 + S, frames=(("f;g (x:1)\x00", "ф/файл.py", 3),), samples=1)
    Writer(engine).write_profiles([odd])
    (read,) = Reader(engine).profile_stacks(T0, T0 + S)
    assert len(read.host) == schema.profile_samples.c.host.type.length
    assert read.frames[0][0].startswith("f;g (x:1)") and read.frames[0][1] == "ф/файл.py"


def test_retention_deletes_profiles_with_the_spans_and_their_unused_stacks(engine):
    writer = Writer(engine)
    now_ns = time.time_ns()
    writer.write_profiles([stack("old", 1)], now_ns=now_ns - 3600 * S)
    writer.write_profiles([stack("new", 1, T0 + 10 * S)], now_ns=now_ns)
    result = expire(engine, span_cutoff_s=now_ns // S - 60, point_cutoff_s=0)
    assert result.profile_samples == 1
    assert [s.frames[-1][0] for s in Reader(engine).profile_stacks(T0, T0 + 60 * S)] == ["new"]
    assert count_rows(engine, "profile_stacks") == 1


def test_two_processes_without_a_pid_in_one_window_keep_their_own_samples(engine):
    # A producer that sends no process.pid gives pid 0: what tells two processes apart is their name and service.
    Writer(engine).write_profiles([stack("burn_cpu", 100, pid=0, service="preprocess"),
                                   stack("burn_cpu", 900, pid=0, service="model-server")])
    read = Reader(engine).profile_stacks(T0, T0 + 10 * S)
    assert sorted(s.samples for s in read) == [100, 900]


def test_a_long_read_parses_each_stack_once_and_shares_its_frames(engine):
    # 60 windows of the same two stacks: 120 rows, two frame tuples (a five-minute read of a busy process).
    Writer(engine).write_profiles([stack(leaf, 1, T0 + w * 10 * S) for w in range(60) for leaf in ("a", "b")])
    read = Reader(engine).profile_stacks(T0, T0 + 600 * S)
    assert len(read) == 120
    assert len({id(s.frames) for s in read}) == 2


def test_the_row_cap_deletes_the_oldest_arrivals_first(engine):
    writer = Writer(engine)
    now_ns = time.time_ns()
    for age, leaf in ((300, "oldest"), (200, "older"), (100, "newest")):  # seconds ago, as the agent sent them
        writer.write_profiles([stack(leaf, 1, T0 + (1000 - age) * S)], now_ns=now_ns - age * S)
    retention = Retention(engine)
    retention.measure(now_ns / S)
    assert retention.size.profile_rows == 3
    policy = RetentionPolicy(span_max_age_s=86400, point_max_age_s=86400, profile_max_rows=1)
    result = retention.enforce(policy, now_ns / S)
    assert result.profile_samples_over_size == 2
    assert [s.frames[-1][0] for s in Reader(engine).profile_stacks(T0, T0 + 2000 * S)] == ["newest"]
    assert count_rows(engine, "profile_stacks") == 1 and retention.size.profile_rows == 1
