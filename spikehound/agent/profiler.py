"""Always-on sampling profiles of the model-server processes, taken with py-spy and forwarded as OTLP profiles.

Every window (``agent.profile_window_seconds``, 10 s) each process the CPU sampler tracks
(``agent.process_patterns`` / ``agent.pid_files``) is recorded by its own ``py-spy record --nonblocking
--format raw`` child, all side by side as asyncio subprocesses, so the event loop never waits on them.
``--nonblocking`` reads the target's memory without pausing it: a sample may now and then be torn, but the
model server never stops for the profiler. py-spy's folded output (``f (a.py:1);g (b.py:9) 12``) becomes
:class:`~spikehound.model.ProfileStack` records: one per distinct stack, with its count, at most
``max_stacks`` per process and window (the rarest are summed into one ``(other stacks)`` stack). A window's
stacks of all processes go to the forward queue as one ``ExportProfilesServiceRequest`` (split when larger
than the collector takes), so they are spooled and replayed like spans and metrics.

Which threads a sample reads is ``agent.profile_threads``: ``gil`` (the default, py-spy's ``--gil``) the one
running Python code, whose cost does not grow with the process's threads; ``cpu`` every thread on a CPU,
native code that released the GIL too (a sqlite3 query, a torch kernel); ``wall`` every thread, idle ones too
(``--idle``). ``kind`` is ``cpu`` for the first two (samples of running code) and ``wall`` for the last.
``service`` is what :class:`~spikehound.agent.services.ServiceMap` learnt from the process's spans, "" until then.

Failures keep the agent running, and are counted by reason:

* ``gone``: the process exited (a restart): dropped quietly;
* ``permission``: ptrace is not permitted (another user's process, Yama's ``kernel.yama.ptrace_scope``, a
  sandbox): one warning naming ``AmbientCapabilities=CAP_SYS_PTRACE``, and that process is tried again only
  every ``RETRY_SECONDS``;
* ``not_python``: py-spy finds no Python interpreter in it (``tritonserver``): skipped, tried again as rarely;
* ``timeout``: py-spy ran well past its window: killed; ``error``: anything else (one warning per process),
  output that cannot be read or stacks that cannot be encoded among them: each process's run is parsed and
  encoded on its own account, so one process's odd output never costs the others their window;
* ``queue_full``: the forward queue and spool had no room (the window is lost), ``too_large``: stacks that
  alone exceed the collector's request limit;
* ``max_processes``: more processes than ``max_processes`` (``agent.profile_max_processes``) were handed to a
  window: the first ones, in the order given (the CPU sampler's: PID files first, then the longest-running), are
  recorded, each one left out is counted, and a WARNING is logged once each time it starts happening.

At most ``max_processes`` py-spy children run at once, whatever the processes matched: each costs about 5 MB and
a ptrace attachment, and any local user can start a process that ``agent.process_patterns`` matches. The CPU
sampler applies the same cap, and the owner filter (``agent.profile_users``), before the processes reach here.

Without py-spy (next to the Python running the agent, or on ``PATH``) the agent logs one warning and sends
no profiles. Children are killed when the agent stops; one orphaned by a killed agent ends with its window.

>>> stacks = parse_folded("<module> (app.py:10);main (app.py:9);burn_cpu (app.py:4) 31\\n")
>>> stacks[(("<module>", "app.py", 10), ("main", "app.py", 9), ("burn_cpu", "app.py", 4))]
31
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from spikehound.agent.forward_queue import Sink
from spikehound.agent.services import ServiceMap
from spikehound.agent.spool import Item, Signal, SpoolWriteError
from spikehound.model import Frame, ProfileStack
from spikehound.otlp_profiles import encode_profiles
from spikehound.units import NS

log = logging.getLogger("spikehound.agent.profiler")

DEFAULT_RATE_HZ = 19  # prime, so the samples do not beat with work that runs on a round period
DEFAULT_WINDOW_SECONDS = 10.0
MAX_STACKS = 2000  # distinct stacks kept per process and window
OTHER_STACKS: Frame = ("(other stacks)", "", 0)
RETRY_SECONDS = 600.0  # a process py-spy may not or cannot attach to is tried again this rarely
GRACE_SECONDS = 15.0  # py-spy may take this much longer than its window (attaching, writing) before it is killed
THREAD_FLAGS = {"gil": ["--gil"], "cpu": [], "wall": ["--idle"]}  # agent.profile_threads -> py-spy's flags
FAILURES = ("gone", "permission", "not_python", "timeout", "error", "queue_full", "too_large", "max_processes")
DEFAULT_MAX_PROCESSES = 32  # py-spy children at once (agent.profile_max_processes)
PTRACE_HELP = ("give the agent CAP_SYS_PTRACE (AmbientCapabilities=CAP_SYS_PTRACE in spikehound-agent.service, "
               "see the comment there) or allow ptrace of processes that are not the agent's children "
               "(sysctl kernel.yama.ptrace_scope=0)")
_DENIED = re.compile(r"permission denied|operation not permitted|ptrace|os error 1\b|os error 13\b", re.IGNORECASE)
_NOT_PYTHON = re.compile(r"failed to find python version|not a python process|python interpreter",
                         re.IGNORECASE)
_FRAME = re.compile(r"(?P<name>.*) \((?P<file>.*):(?P<line>[0-9]{1,9})\)", re.DOTALL)
MAX_COUNT_DIGITS = 12  # a count with more digits is no py-spy count (and could overflow the encoding's int64)


def find_py_spy() -> str | None:
    """The py-spy next to the running Python (the agent's virtual environment) first, then on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


# --- py-spy's raw (folded) output ----------------------------------------------------------------------------


def py_spy_error(stderr: str) -> str:
    """What py-spy said went wrong, on one line: its error and causes, without the backtrace.

    >>> py_spy_error("Error: Failed to get process executable name.\\n\\nCaused by:\\n    0: Permission denied (os "
    ...              "error 13)\\n    1: Permission denied (os error 13)\\n\\nStack backtrace:\\n   0: anyhow::msg\\n")
    'Failed to get process executable name.; Permission denied (os error 13)'
    """
    said: list[str] = []
    for line in stderr.split("Stack backtrace:", 1)[0].splitlines():
        text = re.sub(r"^(?:Error:|\d+:)\s*", "", line.strip())
        if text and text != "Caused by:" and text not in said:
            said.append(text)
    return "; ".join(said)[:300] or "no reason given"


def parse_frame(text: str) -> Frame:
    """``name (file:line)`` -> (name, file, line); a frame without a location is (name, "", 0).

    >>> parse_frame("<module> (<string>:6)"), parse_frame("wait (threading.py:320)"), parse_frame("??")
    (('<module>', '<string>', 6), ('wait', 'threading.py', 320), ('??', '', 0))
    """
    found = _FRAME.fullmatch(text)
    if found is None:
        return text.strip(), "", 0
    return found["name"], found["file"], int(found["line"])


def _frames(folded: str) -> tuple[Frame, ...]:
    """Split a folded stack on ``;``, keeping a ``;`` inside a frame's name or file together.

    A piece belongs to the next one while its parentheses are open: ``f (/a;b/c.py:3)`` is one frame.
    """
    frames: list[Frame] = []
    pending = ""
    for piece in folded.split(";"):
        text = f"{pending};{piece}" if pending else piece
        if _FRAME.fullmatch(text) is None and text.count("(") > text.count(")"):
            pending = text
            continue
        pending = ""
        if text:
            frames.append(parse_frame(text))
    if pending:
        frames.append(parse_frame(pending))
    return tuple(frames)


def parse_folded(text: str) -> Counter[tuple[Frame, ...]]:
    """py-spy's ``--format raw`` output: stack (root first) -> samples; lines that are not ``STACK COUNT`` are
    skipped.

    The count is ASCII digits only (``str.isdigit`` takes "²", which ``int`` does not). py-spy prints a
    function name as it is, so one with a newline (``code.replace(co_name=...)``) splits its stack over two
    lines: the first, which ends in no count, is skipped; the second is read as the stack it looks like.

    >>> parse_folded("main (a.py:1);x \\u00b2\\nY (a.py:2) 7\\nmain (a.py:1) 4\\u00b2\\n")
    Counter({(('Y', 'a.py', 2),): 7})
    """
    stacks: Counter[tuple[Frame, ...]] = Counter()
    for line in text.splitlines():
        if line.startswith("py-spy> "):  # its progress lines share stdout with the stacks
            continue
        folded, _, count = line.rstrip().rpartition(" ")
        if not folded or not (count.isascii() and count.isdigit()) or len(count) > MAX_COUNT_DIGITS:
            continue
        frames = _frames(folded)
        if frames:
            stacks[frames] += int(count)
    return stacks


def bounded(stacks: Mapping[tuple[Frame, ...], int], max_stacks: int) -> tuple[list[tuple[tuple[Frame, ...], int]],
                                                                              int]:
    """The ``max_stacks`` most sampled stacks, the others summed into one ``(other stacks)`` stack (which takes
    one of the places); and how many were folded into it.

    >>> a, b, c = ((("a", "", 0),), 5), ((("b", "", 0),), 3), ((("c", "", 0),), 1)
    >>> bounded(dict([a, b, c]), 2)
    ([((('a', '', 0),), 5), ((('(other stacks)', '', 0),), 4)], 2)
    """
    ranked = sorted(stacks.items(), key=lambda kv: kv[1], reverse=True)
    if len(ranked) <= max_stacks:
        return ranked, 0
    kept, rest = ranked[:max_stacks - 1], ranked[max_stacks - 1:]
    return [*kept, ((OTHER_STACKS,), sum(n for _, n in rest))], len(rest)


# --- the profiler -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ProfilerStats:
    windows: int = 0  # windows whose profiles were queued
    requests: int = 0  # requests queued (a window larger than the collector takes is split)
    stacks: int = 0  # stacks queued
    samples: int = 0  # samples in them
    folded_stacks: int = 0  # rare stacks summed into "(other stacks)"
    runs: int = 0  # py-spy runs that ended
    failures: Counter[str] = field(default_factory=Counter)  # by reason (FAILURES)


@dataclass(slots=True)
class _Run:
    """One py-spy child recording one process for one window."""

    pid: int
    process: str
    child: asyncio.subprocess.Process
    stdout: asyncio.StreamReader  # the folded stacks, from a pipe of our own
    transport: asyncio.ReadTransport
    start_ns: int


class Profiler:
    """Profiles the processes ``processes()`` names (pid -> executable name) and queues their stacks.

    Run ``run()`` as a task (cancel to stop: children are killed); ``window()`` takes one window, for tests.
    """

    def __init__(self, processes: Callable[[], Mapping[int, str]], queue: Sink, host: str, *,
                 services: ServiceMap | None = None, rate_hz: int = DEFAULT_RATE_HZ,
                 window_seconds: float = DEFAULT_WINDOW_SECONDS, threads: str = "gil", py_spy: str | None = None,
                 max_stacks: int = MAX_STACKS, retry_seconds: float = RETRY_SECONDS,
                 max_processes: int = DEFAULT_MAX_PROCESSES, clock: Callable[[], float] = time.monotonic) -> None:
        self.processes = processes
        self.queue = queue
        self.host = host
        self.services = services
        self.rate_hz = rate_hz
        self.window_seconds = max(1, round(window_seconds))  # py-spy records whole seconds
        self.threads = threads
        self.kind = "wall" if threads == "wall" else "cpu"
        self.py_spy = py_spy if py_spy is not None else find_py_spy()
        self.max_stacks = max_stacks
        self.retry_seconds = retry_seconds
        self.max_processes = max(1, max_processes)
        self._over_cap = False  # in an episode of more processes than max_processes (warned once per episode)
        self._clock = clock
        self.stats = ProfilerStats()
        self._children: set[asyncio.subprocess.Process] = set()
        self._skip_until: dict[int, float] = {}  # pid -> when to try it again (permission, not Python)
        self._warned: set[str] = set()  # what was said once: "permission", "window", "error:<pid>", ...
        self._children_cpu_at_start = _children_cpu()

    @property
    def available(self) -> bool:
        return bool(self.py_spy)

    @property
    def profiled_processes(self) -> int:
        """Tracked processes not set aside (ptrace refused, no Python): those the next window records."""
        if not self.available:
            return 0
        now = self._clock()
        return min(self.max_processes, sum(1 for pid in self.processes() if self._skip_until.get(pid, 0.0) <= now))

    @property
    def children_cpu_seconds(self) -> float:
        """User and system CPU of the py-spy children reaped since the profiler was made."""
        return max(0.0, _children_cpu() - self._children_cpu_at_start)

    async def run(self) -> None:
        """Profile window after window until cancelled; without py-spy, warn once and wait to be cancelled."""
        if not self.available:
            log.warning("py-spy not found (next to %s or on PATH): no profiles are taken; install the py-spy "
                        "package into the agent's environment", sys.executable)
            await asyncio.Event().wait()
        while True:
            started = self._clock()
            try:
                await self.window()
            except Exception as exc:  # the agent keeps forwarding and sampling whatever befalls the profiler
                self.stats.failures["error"] += 1
                level = logging.DEBUG if "window" in self._warned else logging.WARNING
                self._warned.add("window")
                log.log(level, "profiling: a window failed (%s: %s); trying again", type(exc).__name__, exc)
            # Nothing to profile, or every child failed at once: do not spin.
            rest = self.window_seconds - (self._clock() - started)
            if rest > 0:
                await asyncio.sleep(rest)

    async def window(self) -> list[ProfileStack]:
        """Record every tracked process for one window, side by side; queue and return the stacks."""
        if self.services is not None:
            await self.services.refresh()
        now = self._clock()
        self._skip_until = {pid: t for pid, t in self._skip_until.items() if t > now}
        targets = self._capped({pid: name for pid, name in self.processes().items() if pid not in self._skip_until})
        if not targets or not self.py_spy:
            return []
        runs = [run for run in await asyncio.gather(*(self._start(pid, name) for pid, name in targets.items()))
                if run is not None]
        # One process's run never costs another its window: each is read, parsed and its failure counted alone.
        results = await asyncio.gather(*(self._finish(run) for run in runs), return_exceptions=True)
        stacks: list[ProfileStack] = []
        for run, result in zip(runs, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self._failed(run.pid, run.process, "error", f"{type(result).__name__}: {result}")
            else:
                stacks.extend(result)
        return self._queue(stacks) if stacks else []

    def _capped(self, targets: dict[int, str]) -> dict[int, str]:
        """The first ``max_processes`` targets, in the order given; the rest counted, warned once an episode."""
        over = len(targets) - self.max_processes
        if over <= 0:
            if self._over_cap:
                log.info("profiling: %d processes, within agent.profile_max_processes (%d) again", len(targets),
                         self.max_processes)
            self._over_cap = False
            return targets
        self.stats.failures["max_processes"] += over
        if not self._over_cap:
            log.warning("profiling: %d processes to profile, more than agent.profile_max_processes (%d): "
                        "recording the first %d, leaving %d out of each window while this lasts", len(targets),
                        self.max_processes, self.max_processes, over)
        self._over_cap = True
        return dict(list(targets.items())[:self.max_processes])

    async def _start(self, pid: int, name: str) -> _Run | None:
        assert self.py_spy is not None
        # The folded stacks come through a pipe, not a file: nothing on disk, and a read-only /tmp is no matter.
        # An os.pipe of our own: py-spy opens /dev/stdout, which cannot be opened when it is a socket (uvloop
        # hands children socket pairs).
        args = [self.py_spy, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--nonblocking",
                "--format", "raw", "--full-filenames", "--duration", str(self.window_seconds), "--output",
                "/dev/stdout"]
        # py-spy reads every thread's stack each sample unless told to read the GIL holder's only: with a
        # server's dozens of threads (a thread pool, torch's intra-op threads) that is 10 ms of CPU a sample.
        args.extend(THREAD_FLAGS[self.threads])
        start_ns = time.time_ns()
        read_end, write_end = os.pipe()
        try:
            child = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL, stdout=write_end,
                                                         stderr=asyncio.subprocess.PIPE)
        except OSError as exc:  # removed or no longer executable since start
            os.close(read_end)
            self._failed(pid, name, "error", str(exc))
            return None
        finally:
            os.close(write_end)  # the child's copy is the only one: EOF when it exits
        self._children.add(child)
        stdout = asyncio.StreamReader(limit=1 << 26)
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(read_end, "rb", buffering=0))
        return _Run(pid, name, child, stdout, transport, start_ns)

    async def _finish(self, run: _Run) -> list[ProfileStack]:
        child = run.child
        assert child.stderr is not None
        try:
            out, err, _ = await asyncio.wait_for(asyncio.gather(run.stdout.read(), child.stderr.read(), child.wait()),
                                                 self.window_seconds + GRACE_SECONDS)
        except TimeoutError:
            _kill(child)
            await child.wait()
            self._children.discard(child)
            self._failed(run.pid, run.process, "timeout", f"py-spy ran {GRACE_SECONDS:.0f} s past its window")
            return []
        except asyncio.CancelledError:
            _kill(child)  # the agent stops; it stays listed so that aclose() reaps it
            raise
        finally:
            run.transport.close()
        self._children.discard(child)
        end_ns = time.time_ns()
        self.stats.runs += 1
        if child.returncode != 0:
            self._failed_run(run, err.decode("utf-8", "replace"))
            return []
        try:
            return self._stacks(run, out, end_ns)
        except Exception as exc:  # output no stack could be read from: this process's window only
            self._failed(run.pid, run.process, "error", f"unreadable output: {type(exc).__name__}: {exc}")
            return []

    def _stacks(self, run: _Run, out: bytes, end_ns: int) -> list[ProfileStack]:
        counts, folded = bounded(parse_folded(out.decode("utf-8", "replace")), self.max_stacks)
        self.stats.folded_stacks += folded
        service = self.services.service_of(run.pid) if self.services is not None else ""
        period = round(NS / self.rate_hz)
        return [ProfileStack(host=self.host, service=service, pid=run.pid, process=run.process,
                             start_unix_nano=run.start_ns, end_unix_nano=max(end_ns, run.start_ns + 1), frames=frames,
                             samples=n, kind=self.kind, period_ns=period) for frames, n in counts]

    def _failed_run(self, run: _Run, stderr: str) -> None:
        detail = py_spy_error(stderr)
        if not psutil.pid_exists(run.pid):
            self._failed(run.pid, run.process, "gone", detail)
        elif _NOT_PYTHON.search(stderr):
            self._failed(run.pid, run.process, "not_python", detail)
        elif _DENIED.search(stderr):
            self._failed(run.pid, run.process, "permission", detail)
        else:
            self._failed(run.pid, run.process, "error", detail)

    def _failed(self, pid: int, name: str, reason: str, detail: str) -> None:
        self.stats.failures[reason] += 1
        if len(self._warned) > 1000:  # many short-lived failing processes: bounded, "permission" stays said
            self._warned &= {"permission", "window"}
        if reason in ("permission", "not_python"):
            self._skip_until[pid] = self._clock() + self.retry_seconds
        if reason == "permission" and "permission" not in self._warned:
            self._warned.add("permission")
            log.warning("profiling: py-spy may not read process %d (%s): %s; %s. Not profiling it, trying again "
                        "every %.0f minutes", pid, name, detail, PTRACE_HELP, self.retry_seconds / 60)
        elif reason == "error" and f"error:{pid}" not in self._warned:
            self._warned.add(f"error:{pid}")
            log.warning("profiling: py-spy failed on process %d (%s): %s", pid, name, detail)
        elif reason == "not_python" and f"not_python:{pid}" not in self._warned:
            self._warned.add(f"not_python:{pid}")
            log.info("profiling: process %d (%s) runs no Python that py-spy can read (%s); not profiling it",
                     pid, name, detail)
        else:  # expected (a server restarting) or already said
            log.debug("profiling process %d (%s) failed: %s: %s", pid, name, reason, detail)

    def _queue(self, stacks: list[ProfileStack]) -> list[ProfileStack]:
        """Queue one window's stacks as one request, split when larger than the collector takes; the stacks
        that could be encoded."""
        limit = self.queue.max_request_bytes
        try:
            pieces = _pieces(stacks, limit)
        except Exception:  # one process's stacks cannot be encoded: encode each process alone, drop that one
            pieces: list[tuple[bytes, list[ProfileStack]]] = []
            refused: set[int] = set()
            for pid, (name, own) in _by_process(stacks).items():
                try:
                    pieces += _pieces(own, limit)
                except Exception as exc:
                    refused.add(pid)
                    self._failed(pid, name, "error", f"its stacks cannot be encoded: {type(exc).__name__}: {exc}")
            stacks = [s for s in stacks if s.pid not in refused]
        items = [Item(Signal.PROFILES, payload, len(piece)) for payload, piece in pieces]
        dropped = len(stacks) - sum(item.count for item in items)
        if dropped:
            self.stats.failures["too_large"] += dropped
            log.warning("profiling: %d stacks dropped, each alone larger than the %d bytes the collector takes",
                        dropped, limit)
        if not items:
            return stacks
        try:
            queued = self.queue.put_all(items)
        except SpoolWriteError:  # logged by the spool
            queued = False
        if not queued:
            self.stats.failures["queue_full"] += 1
            log.debug("profiling: the forward queue had no room for a window of %d stacks", len(stacks))
            return stacks
        self.stats.windows += 1
        self.stats.requests += len(items)
        self.stats.stacks += sum(item.count for item in items)
        self.stats.samples += sum(s.samples for _, piece in pieces for s in piece)
        return stacks

    def close(self) -> None:
        """Kill the py-spy children still running (the task was cancelled)."""
        for child in list(self._children):
            _kill(child)
        self._children.clear()

    async def aclose(self) -> None:
        """``close`` and reap the children, so that none is left behind as a zombie."""
        children = list(self._children)
        self.close()
        for child in children:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                await child.wait()


def _pieces(stacks: list[ProfileStack], limit: int) -> list[tuple[bytes, list[ProfileStack]]]:
    """``stacks`` as encoded requests of at most ``limit`` bytes (each with its own dictionary), in order.

    Halved until they fit: a window rarely needs it (2,000 stacks of 30 frames are about 1 MB). A stack
    that alone does not fit is left out.
    """
    payload = encode_profiles(stacks).SerializeToString()
    if len(payload) <= limit:
        return [(payload, stacks)]
    if len(stacks) == 1:
        return []
    half = len(stacks) // 2
    return _pieces(stacks[:half], limit) + _pieces(stacks[half:], limit)


def _by_process(stacks: list[ProfileStack]) -> dict[int, tuple[str, list[ProfileStack]]]:
    """pid -> (its executable name, its stacks), in order."""
    groups: dict[int, tuple[str, list[ProfileStack]]] = {}
    for s in stacks:
        groups.setdefault(s.pid, (s.process, []))[1].append(s)
    return groups


def _kill(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
