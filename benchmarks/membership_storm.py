"""The agent's membership under attack: rename storms against a membership file, and an agent named as its own
collector. Each figure is printed beside its reference from the same run.

Run with ``python -m benchmarks.membership_storm`` (``--seconds`` per storm, default 60; ``--pythonpath DIR``
runs the agents from another checkout, e.g. a worktree of an older commit, for comparison). Every agent runs
under a 4 GiB address-space cap (``prlimit``), as an attacker's target would be expected to.

1. Storms. An agent follows ``file:///.../collectors`` (resolve interval 5 s; nobody listens on the members,
   only the membership counts). A child process renames, over and over, a symbolic link to ``/dev/zero``
   (then, in a second storm, a FIFO) over the file, with the good file in between, for ``--seconds``. Reported:
   the agent's RSS before (the reference), its peak during the storm and after, its threads, and how long a
   real change of the file written after the storm takes to be applied (target: within one resolve interval,
   RSS under 100 MB).
2. Self-forwarding. An agent whose membership file names only its own OTLP/gRPC address, then one given
   ``dns:///localhost:<its own port>``, each left running for ``--self-seconds`` (default 30): the host-metric
   points and spans its receivers took (a loop feeds them; the reference is 0), what it forwarded, the
   ``spikehound_agent_self_members_total`` counter and the log lines that say so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil

from harness.daemons import AgentProcess
from harness.membership_storm import storm
from harness.ports import free_port
from harness.waiting import eventually

ADDRESS_SPACE_CAP = 4 << 30
RESOLVE_SECONDS = 5.0
MB = 1 << 20


def agent(workdir: Path, collector: str = "") -> AgentProcess:
    made = AgentProcess(collector, workdir, interval=1.0,
                        env={"SPIKEHOUND_AGENT_PROFILING": "false", "SPIKEHOUND_AGENT_DRAIN_SECONDS": "1",
                             "SPIKEHOUND_AGENT_COLLECTOR_RESOLVE_SECONDS": str(RESOLVE_SECONDS)})
    if shutil.which("prlimit"):
        made.prefix = ["prlimit", f"--as={ADDRESS_SPACE_CAP}", "--"]
    return made


def write_members(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    tmp.replace(path)


def storms(workdir: Path, seconds: float) -> None:
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    path = workdir / "collectors"
    write_members(path, [a])
    daemon = agent(workdir, f"file://{path}").start()
    process = psutil.Process(daemon.proc.pid if daemon.proc else 0)
    try:
        idle = process.memory_info().rss
        print(f"agent idle before the storms: RSS {idle / MB:.1f} MB, {process.num_threads()} threads (reference)")
        for kind, target, change in (("link", "/dev/zero", [a, b]), ("fifo", "/dev/zero", [a])):
            peak = process.memory_info().rss
            with storm(path, target, seconds, kind) as running:
                while running.running and daemon.running:
                    peak = max(peak, process.memory_info().rss)
                    time.sleep(0.25)
            if not daemon.running:
                print(f"{kind} storm: the agent died: {daemon.log_tail(5)}")
                return
            peak = max(peak, process.memory_info().rss)
            written, wanted = time.monotonic(), len(change)
            write_members(path, change)
            try:
                eventually(lambda wanted=wanted: daemon.metric("spikehound_agent_collector_members") == wanted,
                           "the change", 4 * RESOLVE_SECONDS, 0.05)
                applied = f"{time.monotonic() - written:.2f} s"
            except AssertionError:
                applied = f"NOT applied within {4 * RESOLVE_SECONDS:g} s"
            after = process.memory_info().rss
            print(f"{kind} storm, {seconds:g} s ({running.rounds} rounds): RSS peak {peak / MB:.1f} MB, "
                  f"after {after / MB:.1f} MB (idle {idle / MB:.1f} MB); {process.num_threads()} threads; "
                  f"a real change applied after {applied} (resolve interval {RESOLVE_SECONDS:g} s); "
                  f"lookups refused {daemon.metric('spikehound_agent_membership_resolve_failures_total'):.0f}, "
                  f"abandoned {daemon.metric('spikehound_agent_membership_abandoned_lookups_total'):.0f}")
        log = daemon.log_text()
        print(f"  log: {log.count('upkeep failed')} 'upkeep failed', {log.count('MemoryError')} MemoryError, "
              f"{log.count('keeping the last good one')} 'keeping the last good one' warnings")
    finally:
        daemon.kill()


def self_member(workdir: Path, seconds: float, named: str) -> None:
    daemon = agent(workdir)
    if named == "file":
        path = workdir / "self-collectors"
        write_members(path, [daemon.grpc_endpoint])
        daemon.collector = f"file://{path}"
    else:
        daemon.collector = f"dns:///localhost:{daemon.grpc_port}"
    daemon.start()
    try:
        time.sleep(seconds)  # the figure is what a loop would feed it over this time
        m = daemon.metric
        log = daemon.log_text()
        print(f"agent named as its own member by {daemon.collector.split(':')[0]}, {seconds:g} s: received "
              f"{m('spikehound_agent_received_total', signal='metrics'):.0f} metric points and "
              f"{m('spikehound_agent_received_total', signal='spans'):.0f} spans (reference 0), forwarded "
              f"{m('spikehound_agent_forwarded_total'):.0f}, members {m('spikehound_agent_collector_members'):.0f}, "
              f"self_members_total{{address}} {m('spikehound_agent_self_members_total', reason='address'):.0f}, "
              f"forward_loops_total {m('spikehound_agent_forward_loops_total'):.0f}; log lines saying so: "
              f"{log.count('own OTLP listen address')}; RSS "
              f"{psutil.Process(daemon.proc.pid if daemon.proc else 0).memory_info().rss / MB:.1f} MB")
    finally:
        daemon.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each storm")
    parser.add_argument("--self-seconds", type=float, default=30.0, help="how long each self-member agent runs")
    parser.add_argument("--pythonpath", default="", help="run the agents from this checkout")
    args = parser.parse_args()
    if args.pythonpath:
        os.environ["PYTHONPATH"] = args.pythonpath
    with tempfile.TemporaryDirectory(prefix="membership-storm-") as tmp:
        for part in ("storm", "file", "dns"):
            (Path(tmp) / part).mkdir()
        storms(Path(tmp) / "storm", args.seconds)
        for named in ("file", "dns"):
            self_member(Path(tmp) / named, args.self_seconds, named)


if __name__ == "__main__":
    main()
