"""The agent's sampling profiler: py-spy's folded output read back, bounded, failures kept apart, real profiles.

Parsing and the failure paths run against recorded py-spy output and a stand-in ``py-spy`` script (a
refused ptrace, a process that is gone, a slow child to kill). The real thing profiles a child Python
process burning CPU in ``burn_cpu`` and finds it at the leaf of the most-sampled stack; an agent in a child
process forwards such profiles to a real ``ProfilesService`` on loopback, spooling them while that server
is down. Which service a process serves is learnt from a real OpenTelemetry SDK exporter's connection.
Tests that need ptrace are skipped, with the reason, where the kernel does not allow it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import psutil
import pytest
from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2, profiles_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from harness.daemons import AgentProcess
from harness.ports import free_port
from harness.waiting import eventually
from spikehound.agent.enrich import Enricher
from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.intake import Intake
from spikehound.agent.otlp_grpc import start_grpc
from spikehound.agent.otlp_http import http_app
from spikehound.agent.profiler import MAX_STACKS, OTHER_STACKS, Profiler, bounded, find_py_spy, parse_folded
from spikehound.agent.runtime import run as run_loop  # uvloop, as the agent runs
from spikehound.agent.services import PID_MAX, RESOLVE_TRIES, ServiceMap, claimed_pid
from spikehound.agent.spool import DiskSpool, Item, Signal
from spikehound.config import HostPort
from spikehound.model import ProfileStack
from spikehound.otlp_profiles import decode_profiles
from tests.support.spool_items import queued

ROOT = Path(__file__).resolve().parents[1]

# What `py-spy record --format raw --full-filenames` wrote for a small server (threads of a pool, a frame
# py-spy could not name, code run by exec), with odd names and paths as they can appear.
RAW = textwrap.dedent("""\
    <module> (/srv/app/server.py:40);main (/srv/app/server.py:31);burn_cpu (/srv/app/work.py:7) 57
    <module> (/srv/app/server.py:40);main (/srv/app/server.py:31);burn_cpu (/srv/app/work.py:8) 12
    {THREAD} 9
    <module> (<string>:6);f (<string>:3) 4
    <module> (/srv/my app/run.py:2);handle (/srv/my app/a;b.py:5) 3
    <module> (/srv/app/server.py:40);<lambda> (/srv/app/server.py:12);wrapper (fn) (/srv/app/deco.py:4) 2
    ??;unknown_native 1
    not a stack line
    py-spy> Wrote raw flamegraph data to '/dev/stdout'. Samples: 88 Errors: 0
    """).replace("{THREAD}", ";".join((
    "_bootstrap (/usr/lib/python3.11/threading.py:995)", "_bootstrap_inner (/usr/lib/python3.11/threading.py:1038)",
    "run (/usr/lib/python3.11/threading.py:975)", "_worker (/usr/lib/python3.11/concurrent/futures/thread.py:83)",
    "tokenize (/srv/app/work.py:20)")))


def write_fake_py_spy(path: Path, body: str) -> str:
    """A stand-in for py-spy: a Python script given py-spy's arguments; ``body`` sees ``args`` and ``output``."""
    path.write_text(f"#!{sys.executable}\nimport os, sys, time\nargs = sys.argv[1:]\n"
                    f"output = args[args.index('--output') + 1]\npid = int(args[args.index('--pid') + 1])\n"
                    + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def replaying_py_spy(tmp_path: Path, raw: str) -> str:
    """A stand-in for py-spy that writes ``raw`` as its output."""
    (tmp_path / "raw.txt").write_text(raw)
    source = str(tmp_path / "raw.txt")
    return write_fake_py_spy(tmp_path / "py-spy", f"open(output, 'w').write(open({source!r}).read())")


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[ForwardQueue]:
    q = ForwardQueue(1 << 20, DiskSpool(tmp_path / "spool", 1 << 24))
    yield q
    q.close()




def queued_stacks(q: ForwardQueue) -> list[ProfileStack]:
    items = queued(q)
    assert all(item.signal is Signal.PROFILES for item in items)
    return [s for item in items for s in decode_profiles(
        profiles_service_pb2.ExportProfilesServiceRequest.FromString(item.payload)).stacks]


# --- parsing and bounds ---------------------------------------------------------------------------------------


def test_py_spy_raw_output_becomes_root_first_stacks_with_counts():
    stacks = parse_folded(RAW)
    assert stacks[(("<module>", "/srv/app/server.py", 40), ("main", "/srv/app/server.py", 31),
                   ("burn_cpu", "/srv/app/work.py", 7))] == 57
    assert stacks[(("<module>", "<string>", 6), ("f", "<string>", 3))] == 4
    # A space and a semicolon in a path, parentheses in a name, frames without a location.
    assert stacks[(("<module>", "/srv/my app/run.py", 2), ("handle", "/srv/my app/a;b.py", 5))] == 3
    assert stacks[(("<module>", "/srv/app/server.py", 40), ("<lambda>", "/srv/app/server.py", 12),
                   ("wrapper (fn)", "/srv/app/deco.py", 4))] == 2
    assert stacks[(("??", "", 0), ("unknown_native", "", 0))] == 1
    threaded = next(s for s in stacks if s[-1][0] == "tokenize")
    assert len(threaded) == 5 and threaded[0] == ("_bootstrap", "/usr/lib/python3.11/threading.py", 995)
    assert sum(stacks.values()) == 57 + 12 + 9 + 4 + 3 + 2 + 1  # the line that is no stack is left out


def test_a_count_that_is_no_ascii_number_or_a_name_split_over_two_lines_is_skipped_not_raised():
    # "²" passes str.isdigit() but not int(); py-spy prints a function name with a newline as it is.
    raw = ("main (a.py:1);x \u00b2\nY (a.py:2) 7\n"  # one stack split by a newline in a function's name
           "main (a.py:1);ok (a.py:3) 40\n"
           "main (a.py:1);f (a.py:4) \u0663\n"  # an Arabic-Indic 3: a digit to isdigit() and int(), not to py-spy
           "main (a.py:1);g (a.py:5) 4\u00b2\n"
           f"main (a.py:1);h (a.py:6) {'9' * 5000}\n"  # past int()'s 4,300 digits
           f"main (a.py:1);i (a.py:{'7' * 5000}) 2\n")  # a line number no file has: a frame without a location
    stacks = parse_folded(raw)
    assert stacks[(("main", "a.py", 1), ("ok", "a.py", 3))] == 40
    assert stacks[(("Y", "a.py", 2),)] == 7  # the second half reads as the stack it looks like
    assert sum(stacks.values()) == 40 + 7 + 2
    assert not any(frame[0].startswith(("x ", "f ", "g ", "h ")) for stack in stacks for frame in stack)


def test_a_process_window_keeps_at_most_max_stacks_and_counts_the_rest_as_other():
    many = {((f"f{i}", "a.py", i),): 1000 - i for i in range(MAX_STACKS + 500)}
    kept, folded = bounded(many, MAX_STACKS)
    assert len(kept) == MAX_STACKS and folded == 501
    assert kept[0] == ((("f0", "a.py", 0),), 1000)
    assert kept[-1][0] == (OTHER_STACKS,)
    assert sum(n for _, n in kept) == sum(many.values())  # no sample is lost, only told apart less


def test_a_window_with_too_many_stacks_is_queued_bounded_and_counted(tmp_path, queue):
    lines = "".join(f"main (app.py:1);leaf_{i} (app.py:{i + 2}) {i % 7 + 1}\n" for i in range(40))
    fake = replaying_py_spy(tmp_path, lines)
    profiler = Profiler(lambda: {os.getpid(): "python3"}, queue, "gpu-1", py_spy=fake, window_seconds=1,
                        max_stacks=10)
    stacks = run_loop(profiler.window())
    assert len(stacks) == 10 and profiler.stats.folded_stacks == 31
    assert sum(s.samples for s in stacks) == sum(i % 7 + 1 for i in range(40))
    back = queued_stacks(queue)
    assert sorted((s.frames, s.samples) for s in back) == sorted((s.frames, s.samples) for s in stacks)
    assert {(s.host, s.pid, s.process, s.kind) for s in back} == {("gpu-1", os.getpid(), "python3", "cpu")}
    assert profiler.stats.windows == 1 and profiler.stats.stacks == 10


def test_a_window_larger_than_the_collector_takes_is_split_into_requests_that_fit(tmp_path, queue):
    lines = "".join(f"main (/srv/app/{'x' * 200}.py:1);leaf_{i} (app.py:{i}) 3\n" for i in range(300))
    fake = replaying_py_spy(tmp_path, lines)
    queue.max_request_bytes = 8192
    profiler = Profiler(lambda: {os.getpid(): "python3"}, queue, "gpu-1", py_spy=fake, window_seconds=1)
    run_loop(profiler.window())
    items = queued(queue)
    assert len(items) > 1 and all(len(item.payload) <= 8192 for item in items)
    back = [s for item in items for s in decode_profiles(
        profiles_service_pb2.ExportProfilesServiceRequest.FromString(item.payload)).stacks]
    assert len(back) == 300 and sum(s.samples for s in back) == 900
    assert profiler.stats.requests == len(items) and profiler.stats.windows == 1


# --- failures ---------------------------------------------------------------------------------------------------


INNOCENT, ODD = 4001, 4002  # the stand-in py-spy attaches to nothing: any pids do


def test_one_processs_odd_output_does_not_cost_another_process_its_window(tmp_path, queue):
    # The adversary's case: a process naming a function "x \u00b2\nY" profiled beside an innocent one.
    fake = write_fake_py_spy(tmp_path / "py-spy", f"""\
        odd = 'main (a.py:1);x \\u00b2\\nY (a.py:2) 7\\n'
        open(output, 'w').write(odd if pid == {ODD} else 'main (b.py:1);serve (b.py:2) 30\\n')
        """)
    profiler = Profiler(lambda: {INNOCENT: "python3", ODD: "python3"}, queue, "gpu-1", py_spy=fake,
                        window_seconds=1)
    stacks = run_loop(profiler.window())
    assert {s.pid: s.samples for s in stacks} == {INNOCENT: 30, ODD: 7}
    assert profiler.stats.windows == 1 and not profiler.stats.failures


def test_a_process_whose_output_cannot_be_read_or_encoded_loses_its_own_window_only(tmp_path, queue, monkeypatch,
                                                                                    caplog):
    import spikehound.agent.profiler as profiler_module

    fake = write_fake_py_spy(tmp_path / "py-spy", f"""\
        open(output, 'w').write('main (a.py:1);' + ('bad' if pid == {ODD} else 'good') + ' (a.py:2) 5\\n')
        """)
    real_parse, real_encode = profiler_module.parse_folded, profiler_module.encode_profiles

    def parse(text):  # a bug yet unknown in reading one process's output
        if "bad" in text:
            raise ValueError("unreadable")
        return real_parse(text)

    profiler = Profiler(lambda: {INNOCENT: "python3", ODD: "python3"}, queue, "gpu-1", py_spy=fake,
                        window_seconds=1)
    monkeypatch.setattr(profiler_module, "parse_folded", parse)
    with caplog.at_level(logging.WARNING, logger="spikehound.agent.profiler"):
        stacks = run_loop(profiler.window())
    assert [s.pid for s in stacks] == [INNOCENT] and [s.pid for s in queued_stacks(queue)] == [INNOCENT]
    assert profiler.stats.failures == {"error": 1} and profiler.stats.windows == 1
    assert any(str(ODD) in r.message and "unreadable" in r.message for r in caplog.records)

    def encode(stacks):  # stacks the encoding refuses (a count past int64, say)
        stacks = list(stacks)
        if any(s.pid == ODD for s in stacks):
            raise ValueError("Value out of range")
        return real_encode(stacks)

    monkeypatch.setattr(profiler_module, "parse_folded", real_parse)
    monkeypatch.setattr(profiler_module, "encode_profiles", encode)
    stacks = run_loop(profiler.window())
    assert [s.pid for s in stacks] == [INNOCENT] and [s.pid for s in queued_stacks(queue)] == [INNOCENT]
    assert profiler.stats.failures == {"error": 2} and profiler.stats.windows == 2


def test_a_refused_ptrace_warns_once_with_the_fix_and_sets_the_process_aside(tmp_path, queue, caplog):
    runs = tmp_path / "runs"
    fake = write_fake_py_spy(tmp_path / "py-spy", f"""\
        open({str(runs)!r}, 'a').write(f'{{pid}}\\n')
        sys.stderr.write('Error: Permission Denied: Try running again with elevated permissions\\n')
        sys.exit(1)
        """)
    now = [0.0]
    others = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        pids = {p.pid: "python3" for p in others}
        profiler = Profiler(lambda: pids, queue, "gpu-1", py_spy=fake, window_seconds=1, clock=lambda: now[0])
        with caplog.at_level(logging.DEBUG, logger="spikehound.agent.profiler"):
            for _ in range(3):
                assert run_loop(profiler.window()) == []
                now[0] += 60
        assert sorted(runs.read_text().split()) == sorted(str(p) for p in pids)  # each once: then set aside
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "AmbientCapabilities=CAP_SYS_PTRACE" in warnings[0].message
        assert "kernel.yama.ptrace_scope" in warnings[0].message
        assert profiler.stats.failures["permission"] == 2 and profiler.profiled_processes == 0
        now[0] += 600  # ten minutes on: tried again
        run_loop(profiler.window())
        assert len(runs.read_text().split()) == 4
    finally:
        for p in others:
            p.kill()
            p.wait()


def test_a_process_that_exits_is_dropped_quietly(tmp_path, queue, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fake = write_fake_py_spy(tmp_path / "py-spy", """\
        sys.stderr.write('Error: Failed to get process executable name. Check that the process is running.\\n')
        sys.exit(1)
        """)
    profiler = Profiler(lambda: {gone.pid: "python3"}, queue, "gpu-1", py_spy=fake, window_seconds=1)
    with caplog.at_level(logging.INFO, logger="spikehound.agent.profiler"):
        assert run_loop(profiler.window()) == []
    assert profiler.stats.failures == {"gone": 1}
    assert not caplog.records and not len(queue)


def test_without_py_spy_one_warning_and_no_profiles(queue, caplog):
    profiler = Profiler(lambda: {os.getpid(): "python3"}, queue, "gpu-1", py_spy="")

    async def run_a_while() -> None:
        task = asyncio.create_task(profiler.run())
        await asyncio.sleep(0.3)
        task.cancel()

    with caplog.at_level(logging.WARNING, logger="spikehound.agent.profiler"):
        run_loop(run_a_while())
    assert not profiler.available
    assert [r.message for r in caplog.records if "py-spy not found" in r.message] and len(caplog.records) == 1
    assert not len(queue)


def test_stopping_the_profiler_kills_its_py_spy_children(tmp_path, queue):
    started = tmp_path / "started"
    fake = write_fake_py_spy(tmp_path / "py-spy", f"""\
        open({str(started)!r}, 'a').write(f'{{os.getpid()}}\\n')
        time.sleep(120)
        """)
    profiler = Profiler(lambda: {os.getpid(): "python3", 1: "init"}, queue, "gpu-1", py_spy=fake,
                        window_seconds=60)

    async def run_then_stop() -> list[int]:
        task = asyncio.create_task(profiler.run())
        while not started.exists() or len(started.read_text().split()) < 2:
            await asyncio.sleep(0.05)
        children = [int(p) for p in started.read_text().split()]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await profiler.aclose()
        return children

    children = run_loop(run_then_stop())
    assert len(children) == 2
    for pid in children:  # killed and reaped: no orphan, no zombie
        assert not psutil.pid_exists(pid)


def test_a_failing_window_is_counted_and_the_profiler_goes_on(queue, caplog):
    calls = []

    def processes() -> dict[int, str]:
        calls.append(1)
        raise RuntimeError("the process table is unreadable")

    profiler = Profiler(processes, queue, "gpu-1", py_spy=sys.executable, window_seconds=1,
                        clock=lambda: 0.0)  # every window is a second after the last

    async def run_a_while() -> None:
        task = asyncio.create_task(profiler.run())
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="spikehound.agent.profiler"):
        run_loop(run_a_while())
    assert profiler.stats.failures["error"] >= 3
    assert len(caplog.records) == 1 and "the process table is unreadable" in caplog.records[0].message


def test_profiles_survive_the_disk_spool_across_a_restart(tmp_path):
    spool = DiskSpool(tmp_path, 1 << 20)
    spool.append(Item(Signal.TRACES, b"spans", 1))
    spool.append(Item(Signal.PROFILES, b"stacks", 2))
    spool.close()
    again = DiskSpool(tmp_path, 1 << 20)
    read = []
    while (head := again.peek()) is not None:
        read.append(head)
        again.pop()
    again.close()
    assert read == [Item(Signal.TRACES, b"spans", 1), Item(Signal.PROFILES, b"stacks", 2)]
    assert again.corrupt_records == 0


# --- a real py-spy on a real process ----------------------------------------------------------------------------

BURN = textwrap.dedent("""\
    import sys, time

    def burn_cpu():
        x = 0
        for i in range(200_000):
            x += i * i
        return x

    def main():
        if len(sys.argv) > 1:  # send a span now and then, as a model server does, to the agent at argv[1]
            from tests.support.otel_send import tracer_provider
            tracer = tracer_provider(sys.argv[1], "burner").get_tracer("burner")
        else:
            tracer = None
        last = 0.0
        while True:
            burn_cpu()
            if tracer is not None and time.monotonic() - last > 0.5:
                last = time.monotonic()
                tracer.start_span("infer").end()

    main()
    """)


def start_burner(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "burner.py"
    script.write_text(BURN)
    return subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def require_ptrace(pid: int) -> str:
    """The py-spy to use, or skip the test saying why it cannot attach here."""
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.skip("py-spy is not installed")
    deadline = time.monotonic() + 10
    while True:  # the child may still be starting up
        done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return py_spy
        if "ermission" in done.stderr or "not permitted" in done.stderr:
            pytest.skip(f"ptrace is not permitted here (py-spy dump: {done.stderr.strip().splitlines()[0]}); "
                        "run as root, with CAP_SYS_PTRACE, or with kernel.yama.ptrace_scope=0")
        if time.monotonic() > deadline:
            pytest.fail(f"py-spy dump --pid {pid} failed: {done.stderr.strip()[:500]}")
        time.sleep(0.2)


@pytest.fixture
def burner(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    child = start_burner(tmp_path)
    yield child
    child.kill()
    child.wait()


def test_a_real_process_burning_cpu_has_its_hot_function_at_the_leaf(burner, queue):
    py_spy = require_ptrace(burner.pid)
    profiler = Profiler(lambda: {burner.pid: "python3"}, queue, "gpu-1", py_spy=py_spy, rate_hz=50,
                        window_seconds=2)
    before = time.time_ns()
    stacks = run_loop(profiler.window())
    after = time.time_ns()
    assert stacks, "py-spy recorded nothing"
    hottest = max(stacks, key=lambda s: s.samples)
    assert hottest.frames[-1][0] == "burn_cpu" and hottest.frames[-1][1].endswith("burner.py")
    assert [f[0] for f in hottest.frames[:2]] == ["<module>", "main"]
    total = sum(s.samples for s in stacks)
    assert 50 <= total <= 2 * 50 + 5  # about rate x window (py-spy's own timer)
    assert sum(s.samples for s in stacks if s.frames[-1][0] == "burn_cpu") >= 0.8 * total
    assert all(before <= s.start_unix_nano < s.end_unix_nano <= after for s in stacks)
    assert {(s.kind, s.period_ns) for s in stacks} == {("cpu", 20_000_000)}
    assert queued_stacks(queue)
    assert profiler.stats.runs == 1 and not profiler.stats.failures
    print(f"py-spy children: {profiler.children_cpu_seconds:.3f} s CPU for one 2 s window at 50 Hz")


# --- which service a process serves -----------------------------------------------------------------------------

SENDER = textwrap.dedent("""\
    import sys
    from tests.support.otel_send import tracer_provider
    provider = tracer_provider(sys.argv[1], sys.argv[2])
    provider.get_tracer("t").start_span("infer").end()
    provider.force_flush()
    print("sent", flush=True)
    sys.stdin.readline()  # keep the connection open until the test has looked
    """)

HTTP_SENDER = textwrap.dedent("""\
    import sys
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    provider = TracerProvider(resource=Resource.create({"service.name": sys.argv[2]}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
    provider.get_tracer("t").start_span("infer").end()
    print("sent", flush=True)
    sys.stdin.readline()
    """)


def test_the_agent_learns_which_service_a_process_serves_from_its_grpc_and_http_connections(tmp_path, queue):
    services = ServiceMap()
    intake = Intake(Enricher({"host.name": "gpu-1"}), queue, services=services)

    async def scenario() -> tuple[dict[int, str], int]:
        from aiohttp import web

        server, port = await start_grpc(intake, HostPort("127.0.0.1", 0), 1 << 22)
        runner = web.AppRunner(http_app(intake, 1 << 22))
        await runner.setup()
        http_port = free_port()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        senders = {}
        try:
            for name, script, endpoint in (("grpc-sender", SENDER, f"127.0.0.1:{port}"),
                                           ("http-sender", HTTP_SENDER, f"http://127.0.0.1:{http_port}/v1/traces")):
                (tmp_path / f"{name}.py").write_text(script)
                child = await asyncio.create_subprocess_exec(
                    sys.executable, str(tmp_path / f"{name}.py"), endpoint, name, cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE)
                assert child.stdout is not None
                assert await asyncio.wait_for(child.stdout.readline(), 60) == b"sent\n"
                senders[name] = child
            pending = services.pending
            await services.refresh()
            found = {child.pid: services.service_of(child.pid) for child in senders.values()}
        finally:
            for child in senders.values():
                assert child.stdin is not None
                child.stdin.close()
                await child.wait()
            await server.stop(None)
            await runner.cleanup()
        return found, pending

    found, pending = run_loop(scenario())
    assert pending == 2  # one connection each, noted on its first request
    assert sorted(found.values()) == ["grpc-sender", "http-sender"]
    assert services.scans == 1


def pid_resource(service: str, pid: object) -> Resource:
    resource = Resource()
    resource.attributes.add(key="service.name").value.string_value = service
    if isinstance(pid, int):
        resource.attributes.add(key="process.pid").value.int_value = pid
    elif isinstance(pid, str):
        resource.attributes.add(key="process.pid").value.string_value = pid
    elif isinstance(pid, float):
        resource.attributes.add(key="process.pid").value.double_value = pid
    return resource


def test_a_resources_process_pid_is_an_int_or_ascii_digits_in_range_and_anything_else_is_no_claim():
    assert claimed_pid(pid_resource("s", 4321)) == 4321 and claimed_pid(pid_resource("s", "4321")) == 4321
    for odd in ("\u00b2", "\u0663", "-5", " 12", "12a", "", "9" * 5000, 0, -1, 1 << 40, PID_MAX + 1, 12.0, None):
        assert claimed_pid(pid_resource("s", odd)) == 0, odd


def span_request(service: str, pid: object) -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.CopyFrom(pid_resource(service, pid))
    rs.scope_spans.add().spans.add(name="op", trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start_time_unix_nano=1,
                                  end_time_unix_nano=2)
    return req.SerializeToString()


def test_a_process_pid_no_int_takes_never_refuses_the_senders_spans(queue, monkeypatch):
    # "²" passed str.isdigit() and made int() raise in the enricher: every span request of the sender failed.
    services = ServiceMap()
    intake = Intake(Enricher({"host.name": "h"}), queue, services=services)
    for n in range(2):
        assert intake.accept(Signal.TRACES, span_request("svc", "\u00b2"), "grpc",
                             peer=f"ipv4:127.0.0.1:{40000 + n}").kept == 1
    # A bug anywhere in learning a service is counted, and the spans are taken all the same.
    monkeypatch.setattr(services, "note_peer", lambda *a: 1 / 0)
    assert intake.accept(Signal.TRACES, span_request("svc2", 7), "grpc", peer="ipv4:127.0.0.1:40009").kept == 1
    assert services.errors == 1 and len(queued(queue)) == 3


class SocketTable:
    """A stand-in for psutil: the TCP sockets of the host (local address -> owner), the pids that exist."""

    def __init__(self, owners: dict[tuple[str, int], int], pids: set[int], readable: bool = True) -> None:
        self.owners, self.pids, self.readable = owners, pids, readable

    def net_connections(self, kind: str) -> list[SimpleNamespace]:
        if not self.readable:
            raise psutil.AccessDenied()
        return [SimpleNamespace(laddr=address, raddr=(), status="ESTABLISHED", pid=pid)
                for address, pid in self.owners.items()]

    def pid_exists(self, pid: int) -> bool:
        return pid in self.pids


def test_the_socket_table_wins_over_a_pid_the_resource_claims():
    sender, other = 5001, 5002
    table = SocketTable({("127.0.0.1", 41000): sender, ("127.0.0.1", 41001): other}, {sender, other, 1})
    services = ServiceMap(table)
    # A sender whose resource claims pid 1 (forged, or its pid inside a container): the kernel names it.
    services.note_peer("ipv4:127.0.0.1:41000", "evil", 1)
    services.note_peer("ipv4:127.0.0.1:41001", "real", other)  # a claim the socket table bears out
    run_loop(services.refresh())
    assert (services.service_of(sender), services.service_of(other), services.service_of(1)) == ("evil", "real", "")
    assert services.refuted_claims == 1
    # Later claims neither override the kernel's word nor revive a refuted pid.
    services.note_peer("unix:/run/otlp.sock", "forged", other)
    services.note_peer("unix:/run/otlp-2.sock", "forged", 1)
    assert (services.service_of(other), services.service_of(1)) == ("real", "")


def test_a_claimed_pid_is_used_only_where_the_socket_table_cannot_say():
    here, elsewhere = 6001, 6002  # pids on this host; 6003 is none
    services = ServiceMap(SocketTable({}, {here, elsewhere}, readable=False), rescan_seconds=0)
    services.note_peer("ipv4:127.0.0.1:42000", "unreadable-table", here)
    services.note_peer("unix:/run/otlp.sock", "unix-socket", elsewhere)  # no address to look up: at once
    services.note_peer("ipv4:127.0.0.1:42001", "no-such-pid", 6003)
    assert services.service_of(elsewhere) == "unix-socket" and services.service_of(here) == ""
    for _ in range(RESOLVE_TRIES):
        run_loop(services.refresh(force=True))
    assert services.service_of(here) == "unreadable-table" and services.service_of(6003) == ""
    assert services.pending == 0

    # A table that can be read and does not show the connection (closed, or from another host): no claim.
    readable = ServiceMap(SocketTable({}, {here}), rescan_seconds=0)
    readable.note_peer("ipv4:10.0.0.7:42002", "remote", here)
    for _ in range(RESOLVE_TRIES):
        run_loop(readable.refresh(force=True))
    assert readable.service_of(here) == "" and readable.pending == 0
    # A connection with no address to look up (a unix socket): its claim, if the pid is on the host.
    readable.note_peer("unix:/run/tokenizer.sock", "tokenizer", here)
    readable.note_peer("unix:/run/ghost.sock", "ghost", 6003)
    assert readable.service_of(here) == "tokenizer" and readable.service_of(6003) == ""
    readable.learn(here, "from-a-connection")  # then the socket table names it: the kernel's word wins
    assert readable.service_of(here) == "from-a-connection"


# --- the agent forwards profiles, spooling them while the collector is away ---------------------------------------


class ProfilesCollector(profiles_service_pb2_grpc.ProfilesServiceServicer):
    """A ProfilesService on loopback that keeps what it receives."""

    def __init__(self, port: int) -> None:
        self.requests: list[profiles_service_pb2.ExportProfilesServiceRequest] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        profiles_service_pb2_grpc.add_ProfilesServiceServicer_to_server(self, self.server)
        # The agent forwards its own metrics (and the burner's spans) too: taken and let go.
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
            "Export": grpc.unary_unary_rpc_method_handler(lambda payload, context: b"")})
            for service in ("opentelemetry.proto.collector.trace.v1.TraceService",
                            "opentelemetry.proto.collector.metrics.v1.MetricsService")])
        self.server.add_insecure_port(f"127.0.0.1:{port}")

    def Export(self, request, context):  # the generated servicer's name
        with self._lock:
            self.requests.append(request)
        return profiles_service_pb2.ExportProfilesServiceResponse()

    def stacks(self) -> list[ProfileStack]:
        with self._lock:
            return [s for r in self.requests for s in decode_profiles(r).stacks]


def test_the_agent_forwards_profiles_and_spools_them_while_the_collector_is_away(tmp_path):
    port = free_port()
    agent = AgentProcess(f"127.0.0.1:{port}", tmp_path, interval=0.5, env={
        "SPIKEHOUND_AGENT_HOST_NAME": "gpu-node-3", "SPIKEHOUND_AGENT_PID_FILES": str(tmp_path / "burner.pid"),
        "SPIKEHOUND_AGENT_PROFILE_WINDOW_SECONDS": "1", "SPIKEHOUND_AGENT_PROFILE_RATE_HZ": "49",
        "SPIKEHOUND_AGENT_DRAIN_SECONDS": "0"})
    burner = start_burner(tmp_path, f"127.0.0.1:{agent.grpc_port}")
    collector = ProfilesCollector(port)
    try:
        require_ptrace(burner.pid)
        (tmp_path / "burner.pid").write_text(f"{burner.pid}\n")
        agent.start()
        # The collector is away: windows are queued, then spooled to disk when the agent stops.
        eventually(lambda: agent.metric("spikehound_agent_profile_windows_total") >= 3, "three profile windows",
                   timeout=60)
        assert agent.metric("spikehound_agent_profile_failures_total") == 0
        agent.terminate()
        spooled_before = time.time_ns()
        assert list((tmp_path / "agent-spool").glob("*.seg2")), "nothing spooled"
        collector.server.start()
        agent.start()
        stacks = eventually(lambda: [s for s in collector.stacks() if s.start_unix_nano < spooled_before] or None,
                            "the spooled profiles at the collector", timeout=60)
        hottest = max(stacks, key=lambda s: s.samples)
        assert hottest.frames[-1][0] == "burn_cpu" and hottest.pid == burner.pid
        assert {s.host for s in stacks} == {"gpu-node-3"}
        # The burner's spans told the agent which service it is.
        eventually(lambda: any(s.service == "burner" for s in collector.stacks()) or None,
                   "profiles labelled with the burner's service.name", timeout=90)
        assert agent.metric("spikehound_agent_forwarded_total", signal="profiles") > 0
        assert agent.metric("spikehound_agent_spool_corrupt_records_total") == 0
        eventually(lambda: agent.metric("spikehound_agent_profile_windows_total") >= 5 or None,
                   "five windows after the restart", timeout=60)
        cpu = agent.metric("spikehound_agent_profiler_cpu_seconds_total")
        windows = agent.metric("spikehound_agent_profile_windows_total")
        print(f"py-spy children: {cpu:.2f} s CPU for {windows:.0f} windows of 1 s at 49 Hz")
        agent.terminate()
        assert not [p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"] == "py-spy"
                    and str(burner.pid) in (p.info["cmdline"] or [])], "py-spy children outlived the agent"
    finally:
        if agent.running:
            agent.kill()
        burner.send_signal(signal.SIGKILL)
        burner.wait()
        collector.server.stop(None)


@pytest.mark.parametrize("ptrace", [False, True], ids=["without-CAP_SYS_PTRACE", "with-CAP_SYS_PTRACE"])
def test_an_agent_without_cap_sys_ptrace_warns_once_and_runs_on_and_one_with_it_profiles(tmp_path, ptrace):
    """The agent unit drops every capability; its commented lines give back CAP_SYS_PTRACE alone (setpriv here)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("dropping capabilities as the unit does needs root and setpriv (util-linux)")
    port = free_port()
    collector = ProfilesCollector(port)
    collector.server.start()
    agent = AgentProcess(f"127.0.0.1:{port}", tmp_path, interval=0.5, env={
        "SPIKEHOUND_AGENT_PID_FILES": str(tmp_path / "burner.pid"), "SPIKEHOUND_AGENT_PROFILE_WINDOW_SECONDS": "1"})
    caps = "-all,+sys_ptrace" if ptrace else "-all"
    agent.prefix = ["setpriv", "--no-new-privs", f"--inh-caps={caps}", f"--bounding-set={caps}",
                    *(["--ambient-caps=+sys_ptrace"] if ptrace else []), "--"]
    burner = start_burner(tmp_path)
    try:
        require_ptrace(burner.pid)
        (tmp_path / "burner.pid").write_text(f"{burner.pid}\n")
        agent.start()
        if ptrace:
            stacks = eventually(lambda: collector.stacks() or None, "profiles at the collector", timeout=60)
            assert max(stacks, key=lambda s: s.samples).frames[-1][0] == "burn_cpu"
            assert agent.metric("spikehound_agent_profile_failures_total", reason="permission") == 0
        else:
            eventually(lambda: agent.metric("spikehound_agent_profile_failures_total", reason="permission") >= 1,
                       "py-spy refused", timeout=60)
            runs = agent.metric("spikehound_agent_sampler_runs_total", sampler="cpu")
            eventually(lambda: agent.metric("spikehound_agent_sampler_runs_total", sampler="cpu") >= runs + 4,
                       "the agent sampling on", timeout=30)
            warnings = [line for line in agent.log_text().splitlines() if "WARNING spikehound.agent.profiler" in line]
            assert len(warnings) == 1 and "AmbientCapabilities=CAP_SYS_PTRACE" in warnings[0], agent.log_tail()
            assert agent.metric("spikehound_agent_profile_failures_total", reason="permission") == 1  # set aside
            assert agent.metric("spikehound_agent_profiler_processes") == 0
            assert not collector.stacks()
        agent.terminate()
    finally:
        if agent.running:
            agent.kill()
        burner.kill()
        burner.wait()
        collector.server.stop(None)
