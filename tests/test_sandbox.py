"""The daemons inside the sandbox their units ask for, as far as a machine without systemd as PID 1 allows.

systemd cannot run the units here (no systemd PID 1; ``systemd-run`` has no manager to talk to), so this
builds the parts of the units' sandbox that plain Linux tools can, around the real daemon:

* a private mount namespace in which every file system is read-only (``ProtectSystem=strict``) except
  ``$STATE_DIRECTORY`` and ``$LOGS_DIRECTORY``, and ``/proc`` mounted as the unit's ``ProtectProc=`` and
  ``ProcSubset=`` say (``unshare``, ``mount``);
* no capabilities and no new privileges (``CapabilityBoundingSet=``, ``NoNewPrivileges=``: ``setpriv``);
* no memory that is both writable and executable (``MemoryDenyWriteExecute=``: ``prctl(PR_SET_MDWE)``,
  the kernel's own form of it since Linux 6.3, inherited across exec).

Inside it each daemon must come up (READY=1), take data, keep it where the unit lets it write, and stop
cleanly. DynamicUser= (an unprivileged user) is left out: this project's interpreter may live under a
home directory that such a user cannot enter; the system call filter and the user namespace are left to
``systemd-analyze security`` (tests/test_systemd_units.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.daemons import free_port
from harness.waiting import eventually
from spikehound.agent.spool import DiskSpool
from spikehound.storage import checkpoints
from spikehound.storage.engine import make_engine
from spikehound.storage.reader import Reader, count_rows
from tests.support.systemd_notify import (
    NotifiedAgent,
    NotifiedCollector,
    NotifySocket,
    send_traces,
    stop_as_systemd_does,
)
from tests.support.systemd_units import service_section

pytestmark = pytest.mark.slow

PR_SET_MDWE, PR_GET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 66, 1

SANDBOX = r"""set -e
mount -t proc -o "$PROC_OPTIONS" proc /proc
# A mount that went away since findmnt listed it (another test's container network namespace) is no error.
for m in $(findmnt -rno TARGET | grep -v -E '^/(proc|sys|dev)(/|$)' | sort -u); do
  mount -o remount,bind,ro "$m" 2>/dev/null || ! findmnt -rno TARGET "$m" >/dev/null || mount -o remount,bind,ro "$m"
done
for d in "$STATE_DIRECTORY" "$LOGS_DIRECTORY"; do mount --bind "$d" "$d"; mount -o remount,bind,rw "$d"; done
exec setpriv --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"
"""
# Sets MemoryDenyWriteExecute for itself and everything it executes, then becomes the daemon.
MDWE = (f"import ctypes, os, sys; assert ctypes.CDLL(None).prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0)"
        " == 0, 'PR_SET_MDWE failed'; os.execv(sys.argv[1], sys.argv[1:])")


def sandbox_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("building the units' sandbox needs root (mount namespaces)")
    for tool in ("unshare", "setpriv", "findmnt", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing (Debian packages util-linux and mount)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) < 0:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3 or newer has)")


def proc_options(unit: str) -> str:
    s = service_section(unit)
    options = []
    if s.get("ProcSubset") == ["pid"]:
        options.append("subset=pid")
    if s.get("ProtectProc") == ["invisible"]:
        options.append("hidepid=invisible")
    return ",".join(options) or "defaults"


def sandboxed(daemon: NotifiedCollector | NotifiedAgent, unit: str, state: Path, logs: Path) -> None:
    daemon.env.update({"STATE_DIRECTORY": str(state), "LOGS_DIRECTORY": str(logs), "PROC_OPTIONS": proc_options(unit),
                       "SPIKEHOUND_LOG_FILE": str(logs / f"{daemon.name}.log"), "PYTHONDONTWRITEBYTECODE": "1"})
    daemon.prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", SANDBOX, "sandbox",
                     sys.executable, "-c", MDWE]


def in_the_sandbox(pid: int) -> None:
    """The running daemon really is read-only outside its directories and has no capabilities."""
    mounts = {line.split()[4]: line.split()[5] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
    assert mounts["/"].startswith("ro"), mounts["/"]
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"


class DefaultDatabaseCollector(NotifiedCollector):
    """Without --db, as the unit runs it: SQLite in data_dir, which defaults to $STATE_DIRECTORY."""

    def args(self) -> list[str]:
        args = super().args()
        at = args.index("--db")
        return args[:at] + args[at + 2:]


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """StateDirectory= and LogsDirectory= stand-ins, outside the test's own (read-only in the sandbox) tree."""
    with tempfile.TemporaryDirectory(prefix="sh-sandbox-") as name:
        state, logs = Path(name, "state"), Path(name, "logs")
        state.mkdir(mode=0o700)
        logs.mkdir(mode=0o750)
        yield state, logs


def test_the_collector_runs_in_its_units_sandbox(tmp_path, dirs):
    sandbox_or_skip()
    state, logs = dirs
    notify = NotifySocket()
    collector = DefaultDatabaseCollector("", tmp_path, notify, SPIKEHOUND_COLLECTOR_IDLE_FLUSH_SECONDS="3600")
    sandboxed(collector, "spikehound-collector.service", state, logs)
    try:
        collector.start()
        in_the_sandbox(collector.proc.pid)
        send_traces(collector.grpc_endpoint)
        stop_as_systemd_does(collector, "spikehound-collector.service")
    finally:
        collector.kill()
        notify.close()
    # The default database went to $STATE_DIRECTORY, the only place the unit lets it write.
    engine = make_engine(f"sqlite:///{state / 'spikehound.db'}")
    assert [s for s, _ in Reader(engine).services()] == ["llm-gateway"] and count_rows(engine, "span_blocks") >= 1
    assert checkpoints.load(engine, "detection") is not None, "the detectors' state was saved at stop"
    assert "collector stopped" in (logs / "collector.log").read_text()


def test_the_agent_runs_in_its_units_sandbox(tmp_path, dirs):
    sandbox_or_skip()
    state, logs = dirs
    notify = NotifySocket()
    agent = NotifiedAgent(f"127.0.0.1:{free_port()}", tmp_path, notify, SPIKEHOUND_AGENT_DRAIN_SECONDS="1")
    del agent.env["SPIKEHOUND_AGENT_SPOOL_DIR"], agent.env["SPIKEHOUND_DATA_DIR"]  # the unit's defaults
    sandboxed(agent, "spikehound-agent.service", state, logs)
    try:
        agent.start()
        in_the_sandbox(agent.proc.pid)
        eventually(lambda: agent.metric("spikehound_agent_sampler_runs_total", sampler="cpu") >= 2, "samples", 30)
        assert agent.metric("spikehound_agent_sampler_errors_total") == 0
        # /proc is all there for the samplers: /proc/stat, /proc/meminfo, /proc/net/dev, /proc/net/snmp
        assert not re.search(r"WARNING agent\.samplers\.(cpu|network)", agent.log_text()), agent.log_tail()
        send_traces(agent.grpc_endpoint)
        stop_as_systemd_does(agent, "spikehound-agent.service")
    finally:
        agent.kill()
        notify.close()
    spool = DiskSpool(state / "spool", 2**30)  # the collector was away: the queue went to $STATE_DIRECTORY/spool
    try:
        assert len(spool) > 0
    finally:
        spool.close()
    assert "agent stopped" in (logs / "agent.log").read_text()
