"""Host CPU, memory and model-server process sampling through psutil (Linux first; other platforms emit what
psutil offers there).

Metrics, all OpenTelemetry semantic-convention names (UCUM units):

- ``system.cpu.utilization`` (``1``), whole machine, one point per ``cpu.mode``: the share of the interval since the
  previous sample spent in that mode, from deltas of ``psutil.cpu_times()``. Modes: ``user``, ``nice``, ``system``,
  ``idle``, ``iowait``, ``interrupt`` (hard IRQ; semconv's name for psutil's ``irq``), ``softirq`` and ``steal``,
  only those the platform reports; together they sum to 1 (guest time is already inside user/nice on Linux and is
  not counted twice). One extra mode, ``busy`` = 1 - idle - iowait, is the single "how loaded is the CPU" number
  detectors read; it is *not* part of that sum, so a consumer summing modes must leave it out.
- ``system.cpu.utilization`` per core, with ``cpu.logical_number`` and ``cpu.mode="busy"`` only (per-core per-mode
  would multiply the series count by 9 on hosts with hundreds of cores).
- ``system.cpu.load_average.1m`` / ``.5m`` / ``.15m`` (``{thread}``), as the collector's hostmetrics receiver.
- ``system.cpu.context_switches`` (``{context_switch}``, cumulative COUNTER): the semconv has no system-wide name
  for it, so this one follows the ``system.cpu.*`` family.
- ``system.memory.utilization`` and ``system.memory.usage`` with ``system.memory.state="used"``, where used is
  total - available (what the kernel could not hand out without reclaiming, so page cache does not read as
  pressure), and ``system.memory.limit`` (total, ``By``).
- ``system.paging.utilization`` with ``system.paging.state="used"``: swap used / total, 0 without swap.
- Per model-server process, with ``process.pid`` and ``process.executable.name``: ``process.cpu.utilization``
  (user+system CPU seconds per wall second, as a share of ONE core: 2.0 is two cores busy; the semconv divides by
  the CPU count instead, which hides a single-threaded server pegging one core of 128) and ``process.memory.usage``
  (RSS, ``By``).

The first ``sample()`` has no deltas: it emits load, context switches, memory and RSS only, and primes the deltas.

Model-server processes are found two ways. A *pattern* is a regular expression searched (``re.search``) in the
process name and in its command line joined by spaces, so ``vllm`` finds ``python -m vllm.entrypoints.openai...``
and ``^tritonserver$`` only a process named exactly that; the agent's own process never matches. The process list is
walked at most every ``rescan_interval_s`` (10 s), and even then only new processes and those under a minute old
(a wrapper may still exec the server) have their name and command line read; every sixth walk reads them all. So
a new server is found within 10 s, and one that appears by a late exec or on a just-reused pid within a minute.
A *PID file* holds a decimal pid; it is read at the same cadence and again on the tick after a process vanished.
Missing, garbage or stale PID files are counted in ``errors``, never raised. A process that exits (or turns
zombie) or becomes unreadable is dropped and counted (``process_gone`` / ``process_access_denied``). With
``users``, a tracked process's owner is read again at every sample and whenever the profiler asks which processes
to profile: one that switched to a user not among them is dropped at once (counted in ``left_out`` as ``user``).

Any local user can start a process whose name or command line matches a pattern, and the agent's profiler
attaches to what is tracked here, so what is tracked is bounded. With ``users`` (``agent.profile_users``) only
processes whose real and effective uid are both among them are tracked; one whose owner cannot be read is not.
At most ``max_processes`` (``agent.profile_max_processes``) are tracked: PID-file processes first (an operator
named them), then the longest-running, then the lowest pid. Longest-running first means processes started
later, such as a burst of look-alikes, never displace a server that is already tracked. Each process left out
is counted once in ``left_out`` by reason (``max_processes``, ``user``), and a WARNING is logged once each time
the cap starts being exceeded or foreign-owned matches appear.

Every psutil query runs on its own: one that fails is counted in ``errors`` (logged once per query) and the rest
of the sample still comes out.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from spikehound.agent.sample import Kind, Sample

log = logging.getLogger(__name__)
T = TypeVar("T")
Attributes = dict[str, str | int | float | bool]

# psutil cpu_times field -> semconv cpu.mode value. guest/guest_nice are left out: Linux already counts them in
# user/nice, so adding them would make the modes sum past 1.
CPU_MODES: dict[str, str] = {
    "user": "user",
    "nice": "nice",
    "system": "system",
    "idle": "idle",
    "iowait": "iowait",
    "irq": "interrupt",
    "softirq": "softirq",
    "steal": "steal",
}
DEFAULT_RESCAN_INTERVAL_S = 10.0
FULL_SCAN_EVERY = 6  # pattern scans; with the default interval every process is looked at afresh each minute
SETTLE_S = 60.0  # a process younger than this is re-examined at every scan, in case it has yet to exec the server
DEFAULT_MAX_PROCESSES = 32
LEFT_OUT_REASONS = ("max_processes", "user")


@dataclass(slots=True)
class _Tracked:
    """One model-server process and its CPU reading at the previous sample (None until first read)."""

    process: Any
    attributes: Attributes
    from_pid_file: bool
    started: float = 0.0  # the process's creation time (epoch seconds), as _Candidate's
    cpu_s: float | None = None
    at: float = 0.0


@dataclass(slots=True)
class _Verdict:
    """The last pattern match of one process: its name when it matched, else None."""

    process: Any
    name: str | None
    started: float  # the process's creation time (epoch seconds); 0 when unknown
    uids: tuple[int, ...] = ()  # real and effective uid; () when unreadable


@dataclass(slots=True)
class _Candidate:
    """A process that matched a pattern or a PID file, before the owner filter and the cap."""

    process: Any
    name: str
    from_pid_file: bool
    started: float
    uids: tuple[int, ...]

    def rank(self) -> tuple[bool, float, int]:
        """PID files first, then the longest-running (an unknown start last), then the lowest pid."""
        return not self.from_pid_file, self.started or float("inf"), self.process.pid


def resolve_users(users: Sequence[str]) -> frozenset[int] | None:
    """User names or decimal uids -> uids; None for an empty list (no owner filter).

    Raises ValueError naming a user this host does not know.

    >>> sorted(resolve_users(["root", "1234"]))
    [0, 1234]
    """
    if not users:
        return None
    uids: set[int] = set()
    for user in users:
        if user.isascii() and user.isdigit():
            uids.add(int(user))
            continue
        try:
            uids.add(pwd.getpwnam(user).pw_uid)
        except KeyError:
            raise ValueError(f"no user named {user!r} on this host (give a user name or a numeric uid)") from None
    return frozenset(uids)


def _busy(times: Any, previous: Any) -> tuple[dict[str, float], float] | None:
    """Per-field deltas of two cpu_times readings and their total; None when no time passed."""
    deltas = {field: max(0.0, getattr(times, field) - getattr(previous, field))  # counters can step back on VMs
              for field in CPU_MODES if hasattr(times, field)}
    total = sum(deltas.values())
    return (deltas, total) if total > 0 else None


class CpuSampler:
    """Samples whole-machine and per-core CPU, load, context switches, memory, swap, and the CPU and memory of
    model-server processes found by pattern or PID file."""

    name = "cpu"

    def __init__(self, process_patterns: Sequence[str] = (), pid_files: Sequence[str] = (),
                 psutil_module: Any = None, *, rescan_interval_s: float = DEFAULT_RESCAN_INTERVAL_S,
                 max_processes: int = DEFAULT_MAX_PROCESSES, users: Sequence[str] = ()) -> None:
        self.process_patterns = process_patterns
        self.pid_files = pid_files
        self.rescan_interval_s = rescan_interval_s
        self.max_processes = max(1, max_processes)
        self._uids = resolve_users(users)  # ValueError: an unknown user, caught by the caller as configuration
        # Processes left out now, (pid, start) -> reason, so each is counted once however many scans see it.
        self._left_now: dict[tuple[int, float], str] = {}
        self.left_out: Counter[str] = Counter()
        # Compiled here so a bad pattern fails at start-up (configuration), not every second.
        self._patterns = [re.compile(pattern) for pattern in process_patterns]
        self._ps: Any = psutil_module or psutil  # injected in tests
        self._started = False
        self._own_pid = os.getpid()
        self._prev_times: Any = None
        self._prev_percpu: list[Any] | None = None
        self._tracked: dict[int, _Tracked] = {}
        self._matched: dict[int, _Verdict] = {}  # pid -> its verdict, for the matches of the last pattern scan
        self._verdicts: dict[int, _Verdict] = {}
        self._scans = 0
        self._next_scan = 0.0
        self._reread_pid_files = False
        self.errors: Counter[str] = Counter()
        self._warned: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Begin sampling (psutil is a dependency: always possible)."""
        self._started = True
        self._own_pid = os.getpid()
        return True

    def close(self) -> None:
        """Forget deltas and tracked processes; safe to call more than once."""
        self._started = False
        self._prev_times = None
        self._prev_percpu = None
        self._tracked.clear()
        self._matched.clear()
        self._verdicts.clear()
        self._scans = 0
        self._next_scan = 0.0
        self._reread_pid_files = False
        self._left_now.clear()

    @property
    def processes(self) -> dict[int, Attributes]:
        """The model-server processes being sampled, first-ranked first: pid -> their attributes.

        With ``users``, each one's owner is read again first (one /proc read a process): the profiler asks for
        these before each window, and must not attach to a process that has just switched to another user."""
        if self._uids is not None:
            for pid, tracked in list(self._tracked.items()):
                uids = self._read_process(pid, tracked.process.uids)
                if uids is not None and not self._owned((uids.real, uids.effective)):
                    self._drop_foreign(pid, (uids.real, uids.effective))
        return {pid: dict(tracked.attributes) for pid, tracked in self._tracked.items()}

    def _read_process(self, pid: int, read: Callable[[], T]) -> T | None:
        """``read()`` of a tracked process, or None after dropping it (gone, not ours to read) or counting the
        error."""
        ps = self._ps
        try:
            return read()
        except ps.NoSuchProcess:
            self._drop(pid, "process_gone")
        except ps.AccessDenied:
            self._drop(pid, "process_access_denied")
        except Exception as exc:
            self._count_error("process", exc, str(pid))
        return None

    def _owned(self, uids: tuple[int, ...]) -> bool:
        """Whether a process of real and effective ``uids`` may be tracked (unreadable: not with ``users``)."""
        return self._uids is None or (bool(uids) and set(uids) <= self._uids)

    def _drop_foreign(self, pid: int, uids: tuple[int, ...]) -> None:
        """Stop tracking a process that now runs as a user not in ``users``, counted as left out for it."""
        tracked = self._tracked[pid]
        self._drop(pid, "user", error=False)  # counted in left_out, not among the sampler's errors
        key = (pid, tracked.started)
        if self._left_now.get(key) != "user":
            self.left_out["user"] += 1
            self._left_now[key] = "user"
        log.warning("model-server process %d now runs as uid %s, not in agent.profile_users: no longer sampled or "
                    "profiled", pid, "/".join(map(str, uids)) or "unreadable")

    def left_out_now(self, reason: str) -> int:
        """Matching processes not tracked at the last scan, for ``reason``."""
        return sum(1 for why in self._left_now.values() if why == reason)

    # -- one query ----------------------------------------------------------------------------------------------

    def _read(self, query: str, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args), or None (counted, logged once) when it raises: one broken reading must not stop the rest."""
        try:
            return fn(*args)
        except Exception as exc:
            self._count_error(query, exc)
            return None

    def _count_error(self, query: str, exc: BaseException | str, key: str | None = None) -> None:
        self.errors[query] += 1
        # Warn once per query (and key); a broken /proc would otherwise log every second for the agent's lifetime.
        ident = f"{query}:{key}"
        level = logging.DEBUG if ident in self._warned else logging.WARNING
        self._warned.add(ident)
        detail = f"{exc} ({type(exc).__name__})" if isinstance(exc, BaseException) else exc
        log.log(level, "host sampler: %s failed%s: %s", query, f" for {key}" if key else "", detail)

    # -- sampling -----------------------------------------------------------------------------------------------

    def sample(self) -> list[Sample]:
        """One reading of the host and the model-server processes; [] before start()."""
        if not self._started:
            return []
        out: list[Sample] = []
        self._sample_cpu(out)
        self._sample_percpu(out)
        self._sample_load(out)
        self._sample_memory(out)
        self._sample_processes(out)
        return out

    def _sample_cpu(self, out: list[Sample]) -> None:
        times = self._read("cpu_times", self._ps.cpu_times)
        if times is not None:
            delta = _busy(times, self._prev_times) if self._prev_times is not None else None
            if delta is not None:
                deltas, total = delta
                for field, seconds in deltas.items():
                    out.append(Sample("system.cpu.utilization", seconds / total, "1", {"cpu.mode": CPU_MODES[field]}))
                idle = deltas.get("idle", 0.0) + deltas.get("iowait", 0.0)
                out.append(Sample("system.cpu.utilization", max(0.0, 1 - idle / total), "1", {"cpu.mode": "busy"}))
            self._prev_times = times
        stats = self._read("cpu_stats", self._ps.cpu_stats)
        if stats is not None:
            out.append(Sample("system.cpu.context_switches", float(stats.ctx_switches), "{context_switch}", {},
                              Kind.COUNTER))

    def _sample_percpu(self, out: list[Sample]) -> None:
        percpu = self._read("cpu_times_percpu", self._ps.cpu_times, True)
        if percpu is None:
            return
        previous = self._prev_percpu
        # A CPU hot-plugged in or out changes the list: the indices no longer line up, so re-prime instead.
        if previous is not None and len(previous) == len(percpu):
            for number, (times, before) in enumerate(zip(percpu, previous, strict=True)):
                delta = _busy(times, before)
                if delta is None:
                    continue
                deltas, total = delta
                busy = max(0.0, 1 - (deltas.get("idle", 0.0) + deltas.get("iowait", 0.0)) / total)
                out.append(Sample("system.cpu.utilization", busy, "1",
                                  {"cpu.logical_number": number, "cpu.mode": "busy"}))
        self._prev_percpu = list(percpu)

    def _sample_load(self, out: list[Sample]) -> None:
        load = self._read("load_average", self._ps.getloadavg)
        if load is not None:
            for window, value in zip(("1m", "5m", "15m"), load, strict=True):
                out.append(Sample(f"system.cpu.load_average.{window}", float(value), "{thread}", {}))

    def _sample_memory(self, out: list[Sample]) -> None:
        memory = self._read("memory", self._ps.virtual_memory)
        if memory is not None and memory.total > 0:
            used = max(0, memory.total - memory.available)
            out.append(Sample("system.memory.usage", float(used), "By", {"system.memory.state": "used"}))
            out.append(Sample("system.memory.utilization", used / memory.total, "1", {"system.memory.state": "used"}))
            out.append(Sample("system.memory.limit", float(memory.total), "By", {}))
        swap = self._read("swap", self._ps.swap_memory)
        if swap is not None:
            ratio = swap.used / swap.total if swap.total > 0 else 0.0
            out.append(Sample("system.paging.utilization", ratio, "1", {"system.paging.state": "used"}))

    # -- model-server processes ---------------------------------------------------------------------------------

    def _sample_processes(self, out: list[Sample]) -> None:
        if not self._patterns and not self.pid_files:
            return
        now = time.monotonic()
        if now >= self._next_scan:
            self._scan_patterns()
            self._rebuild()
            self._next_scan = now + self.rescan_interval_s
        elif self._reread_pid_files:
            self._rebuild()  # a process vanished: its PID file may already name the restarted server
        self._reread_pid_files = False
        ps = self._ps
        zombie = getattr(ps, "STATUS_ZOMBIE", "zombie")
        for pid, tracked in list(self._tracked.items()):
            process = tracked.process

            def read(process: Any = process, pid: int = pid) -> tuple[Any, int, tuple[int, ...], float]:
                with process.oneshot():  # one read of /proc/<pid>/stat serves status and cpu_times
                    if process.status() == zombie:
                        raise ps.NoSuchProcess(pid)
                    times = process.cpu_times()
                    rss = process.memory_info().rss
                    # A setuid() since the last scan is seen here, within a sample, not at the next full scan.
                    uids = process.uids() if self._uids is not None else None
                    owner = (uids.real, uids.effective) if uids is not None else ()
                return times, rss, owner, time.monotonic()

            got = self._read_process(pid, read)
            if got is None:
                continue
            times, rss, owner, at = got
            if not self._owned(owner):
                self._drop_foreign(pid, owner)
                continue
            cpu_s = float(times.user + times.system)
            if tracked.cpu_s is not None and at > tracked.at:
                ratio = max(0.0, cpu_s - tracked.cpu_s) / (at - tracked.at)
                out.append(Sample("process.cpu.utilization", ratio, "1", dict(tracked.attributes)))
            tracked.cpu_s, tracked.at = cpu_s, at
            out.append(Sample("process.memory.usage", float(rss), "By", dict(tracked.attributes)))

    def _drop(self, pid: int, reason: str, *, error: bool = True) -> None:
        # Expected when a server restarts, so counted and logged at debug only.
        if error:
            self.errors[reason] += 1
        tracked = self._tracked.pop(pid)
        self._matched.pop(pid, None)
        verdict = self._verdicts.get(pid)
        if verdict is not None:
            verdict.name = None  # not re-adopted from the cache; a full scan looks at it afresh
        self._reread_pid_files = self._reread_pid_files or tracked.from_pid_file
        log.debug("model-server process %d dropped: %s", pid, reason)

    def _scan_patterns(self) -> None:
        """Walk the process list and remember the processes whose name or command line match.

        Reading a process's name and command line costs two /proc reads and ~100 us of psutil; a host runs
        hundreds of processes. So a verdict is kept per process object (process_iter hands back the same object
        while the pid lives) and only new processes, those still in their first minute (a wrapper script may yet
        exec the server), and, on every FULL_SCAN_EVERY-th scan, all processes are examined again.
        """
        if not self._patterns:
            return
        full = self._scans % FULL_SCAN_EVERY == 0
        self._scans += 1
        now = time.time()  # wall clock, as psutil's create_time
        verdicts: dict[int, _Verdict] = {}
        try:
            for process in self._ps.process_iter():
                pid = process.pid
                if pid == self._own_pid:
                    continue
                old = self._verdicts.get(pid)
                if old is not None and old.process is process and not full and now - old.started >= SETTLE_S:
                    verdicts[pid] = old
                    continue
                verdicts[pid] = self._match(process)
        except Exception as exc:
            self._count_error("process_scan", exc)
            return  # keep the previous matches rather than forget every server until the next scan
        self._verdicts = verdicts
        self._matched = {pid: v for pid, v in verdicts.items() if v.name is not None}

    def _match(self, process: Any) -> _Verdict:
        """Whether the process matches a pattern (never when a zombie or gone), with its name and start time."""
        ps = self._ps
        verdict = _Verdict(process, None, 0.0)
        try:
            with process.oneshot():  # status, create_time and name share one read of /proc/<pid>/stat
                if process.status() == getattr(ps, "STATUS_ZOMBIE", "zombie"):
                    return verdict
                verdict.started = float(process.create_time())
                name = process.name() or ""
                verdict.uids = _owner(process, ps)
                try:
                    cmdline = " ".join(process.cmdline())
                except ps.AccessDenied:  # hidepid or another user's process: the name alone must do
                    cmdline = ""
        except (ps.NoSuchProcess, ps.AccessDenied):
            return verdict
        if any(pattern.search(name) or (cmdline and pattern.search(cmdline)) for pattern in self._patterns):
            verdict.name = name
        return verdict

    def _from_pid_file(self, path: str) -> _Candidate | None:
        ps = self._ps
        try:
            text = Path(path).read_text(encoding="ascii", errors="replace").strip()
        except OSError as exc:
            self._count_error("pid_file", exc, path)
            return None
        try:
            pid = int(text)
            if pid <= 0:
                raise ValueError(pid)
        except ValueError:
            self._count_error("pid_file_invalid", f"not a pid: {text[:40]!r}", path)
            return None
        try:
            process = ps.Process(pid)
            with process.oneshot():
                if process.status() != getattr(ps, "STATUS_ZOMBIE", "zombie"):
                    return _Candidate(process, process.name(), True, float(process.create_time()),
                                      _owner(process, ps))
            self._count_error("pid_file_stale", f"process {pid} is a zombie", path)
        except ps.NoSuchProcess:
            self._count_error("pid_file_stale", f"no process {pid}", path)
        except ps.AccessDenied as exc:
            self._count_error("process_access_denied", exc, path)
        except Exception as exc:
            self._count_error("pid_file", exc, path)
        return None

    def _rebuild(self) -> None:
        """Track the pattern matches plus the PID files' processes, keeping the CPU history of known ones; the
        owner filter and the cap decide which."""
        found: dict[int, _Candidate] = {}
        for pid, verdict in self._matched.items():
            if verdict.name is not None:
                found[pid] = _Candidate(verdict.process, verdict.name, False, verdict.started, verdict.uids)
        for path in self.pid_files:
            entry = self._from_pid_file(path)
            if entry is not None and entry.process.pid != self._own_pid:
                known = found.get(entry.process.pid)
                if known is not None:  # so its vanishing re-reads the PID files
                    known.from_pid_file = True
                else:
                    found[entry.process.pid] = entry
        allowed: list[_Candidate] = []
        foreign: list[_Candidate] = []
        for c in found.values():
            owned = self._owned(c.uids)
            (allowed if owned else foreign).append(c)
        allowed.sort(key=_Candidate.rank)
        kept, over = allowed[:self.max_processes], allowed[self.max_processes:]
        self._note_left_out(over, foreign, len(allowed))
        tracked: dict[int, _Tracked] = {}
        for c in kept:
            pid = c.process.pid
            old = self._tracked.get(pid)
            # psutil Processes compare equal on pid and creation time, so a reused pid starts a fresh history.
            if old is not None and old.process == c.process:
                old.from_pid_file = c.from_pid_file
                tracked[pid] = old
            else:
                attributes: Attributes = {"process.pid": pid, "process.executable.name": c.name}
                tracked[pid] = _Tracked(process=c.process, attributes=attributes, from_pid_file=c.from_pid_file,
                                        started=c.started)
        self._tracked = tracked

    def _note_left_out(self, over: list[_Candidate], foreign: list[_Candidate], allowed: int) -> None:
        """Count each newly left-out process once; one WARNING when an episode of either reason begins."""
        now = {(c.process.pid, c.started): "max_processes" for c in over}
        now.update({(c.process.pid, c.started): "user" for c in foreign})
        before = self._left_now
        for key, reason in now.items():
            if before.get(key) != reason:
                self.left_out[reason] += 1
        had = set(before.values())
        if over and "max_processes" not in had:
            log.warning("%d model-server processes match agent.process_patterns / agent.pid_files, more than "
                        "agent.profile_max_processes (%d): sampling and profiling the %d that run longest (PID "
                        "files first), leaving %d out (counted in spikehound_agent_processes_left_out_total)",
                        allowed, self.max_processes, self.max_processes, len(over))
        elif not over and "max_processes" in had:
            log.info("model-server processes: %d match, within agent.profile_max_processes (%d) again", allowed,
                     self.max_processes)
        if foreign and "user" not in had:
            first = foreign[0]
            log.warning("%d processes match agent.process_patterns / agent.pid_files but are owned by users not "
                        "in agent.profile_users (pid %d, uid %s, among them): not sampled or profiled",
                        len(foreign), first.process.pid, "/".join(map(str, first.uids)) or "unreadable")
        self._left_now = now


def _owner(process: Any, ps: Any) -> tuple[int, ...]:
    """The real and effective uid of ``process``; () when they cannot be read (hidepid, gone)."""
    try:
        uids = process.uids()
    except (ps.NoSuchProcess, ps.AccessDenied, AttributeError, OSError):
        return ()
    return uids.real, uids.effective
