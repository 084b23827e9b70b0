"""The soak's run (``benchmarks/soak.py``; its two-minute version is ``tests/test_soak.py``): real daemons, the
traffic of :mod:`harness.soak_traffic`, operations on schedules, samples, canaries and the score.

:class:`SoakSettings` holds every knob (the benchmark's flags are its fields); :class:`Soak` runs one storage's
soak and returns its figures as a JSON-ready dict; :func:`score` holds the spikes found to the faults planned.

>>> pooled_slope([(0, 100, 1), (1, 110, 1), (2, 120, 1), (0, 50, 2), (1, 60, 2), (2, 70, 2)])  # two lives
10.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import queue
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from harness.api_client import list_spikes
from harness.daemons import AgentProcess, CollectorProcess
from harness.fault_campaign_parts import GRID_NS, alert_config, notifications, served_once
from harness.pgserver import PostgresServer
from harness.scrape import sample, scrape
from harness.soak_traffic import CHURN_MARK, SoakPlan, send
from harness.webhook_receiver import WebhookReceiver
from spikehound.agent.forwarder import FLUSH_SECONDS
from spikehound.detectors.windows import nearest_rank
from spikehound.timefmt import parse_time
from spikehound.units import NS

WINDOW_S = 10.0  # the collector's default window: a spike may start one window before its fault
FOUND_WITHIN_S = 120.0
BLOCK_S = 6 * 3600  # recall is reported per six hours of event time
# An agent forwards within two of its flush intervals (wall time); on the soak's clock that is ``speed`` times as
# many event seconds, past the collector's default 5 s lateness: the lateness is scaled alike (see ``lateness_s``).
AGENT_FORWARD_WALL_S = 2 * FLUSH_SECONDS
LIFE_SETTLE_S = 300.0  # wall seconds of a collector life (its restore, its catch-up) left out of the RSS slope
GAUGES = {"open_windows": "spikehound_latency_open_windows", "streams": "spikehound_latency_streams",
          "baselines": "spikehound_detector_streams", "resource_series": "spikehound_resource_series",
          "trace_buffer_spans": "spikehound_trace_buffer_spans",
          "trace_buffer_bytes": "spikehound_trace_buffer_bytes", "catching_up": "spikehound_detection_catching_up",
          "stored_span_bytes": "spikehound_storage_span_payload_bytes",
          "late_spans": "spikehound_latency_late_spans_total"}
# The collector's own process by allocator (spikehound/collector/memory_metrics.py), MB: which part of a rise
# is a cache filling (sqlite), C memory in use (malloc_used) or free in its heaps (malloc_free), or Python's
# objects (python_kblocks: its allocated blocks, in thousands, beside them in each sample's heap_mb) and its
# small-object arenas (python_arena_mapped: what the RSS holds of them; python_arena_in_use: their live blocks;
# python_arena_peak_mapped: the most they ever held at once).
HEAP_KINDS = ("malloc_used", "malloc_free", "sqlite")
PYTHON_KINDS = ("python_kblocks", "python_arena_mapped", "python_arena_in_use", "python_arena_peak_mapped")


def lateness_s(speed: float) -> float:
    """The collector's ``allowed_lateness_seconds`` for a soak whose event time runs ``speed`` times the wall
    clock: at least the default 5 s, and the agents' forwarding delay on the soak's clock.

    Left at 5 s, two agents that forward a second apart (12 event seconds at speed 12) had a tenth of all
    spans counted late and left out of their windows: windows judged on part of their requests, hops named
    without their callee, accuracy figures about the compressed clock rather than the detectors.

    >>> lateness_s(1.0), lateness_s(12.0)
    (5.0, 24.0)
    """
    return max(5.0, AGENT_FORWARD_WALL_S * speed)


@dataclass
class SoakSettings:
    """Every knob of a soak run; intervals are wall seconds unless they say event."""

    storage: str = "both"  # sqlite | postgres | both
    hours: float = 2.0  # wall-clock hours per storage
    speed: float = 12.0  # event seconds per wall second
    rate: float = 10_000.0  # spans a second of wall time
    agents: int = 2
    fault_every: float = 1200.0  # event seconds between faults
    churn: float = 0.01  # share of spans with a name never seen before
    reload_every: float = 600.0  # between SIGHUPs (0: none)
    kill_every: float = 1800.0  # between SIGKILLs of the collector (0: none)
    pg_restart_every: float = 3600.0  # between PostgreSQL restarts (the PostgreSQL run; 0: none)
    span_cap_mb: float = 1024.0  # storage.span_retention_max_bytes, MiB
    point_cap: int = 2_000_000  # storage.metric_retention_max_points
    window_days: float = 0.25  # storage.window_retention_days: six hours of event time
    sample_every: float = 30.0
    api_probes: int = 3  # GET /api/v1/spikes per sample
    canary_every: int = 500  # every Nth acknowledged request gives a canary
    seed: int = 31
    out: Path = Path("soak-results")  # folder for the JSON and PNGs
    keep: bool = False  # keep the run's working folder (logs, database)
    replay: bool = False  # no daemons: the plan's event time through one engine (harness/soak_replay.py)
    heap_every: float = 0.0  # between heap snapshots of the collector (harness/heap_probe.py; 0: none)


# -- what is measured --------------------------------------------------------------------------------------


def process_figures(pid: int | None, last: dict[int, tuple[float, float]]) -> dict[str, float] | None:
    """RSS (MB), CPU (share of one core since the last call for each pid), open descriptors, threads: of the
    process and its children together (a collector's detection process is part of the collector; pages a
    forked child still shares with it are counted in both, so RSS is an upper bound). ``pss_mb`` counts a
    shared page once (the memory the tree really holds), ``main_rss_mb`` is the process's own."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    figures = {"rss_mb": 0.0, "pss_mb": 0.0, "main_rss_mb": 0.0, "fds": 0, "threads": 0, "cpu": 0.0}
    for p in tree:
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                used, now = cpu.user + cpu.system, time.monotonic()
                before = last.get(p.pid)
                last[p.pid] = (used, now)
                memory = p.memory_full_info()
                figures["rss_mb"] += memory.rss / 2**20
                figures["pss_mb"] += memory.pss / 2**20
                if p is root:
                    figures["main_rss_mb"] = memory.rss / 2**20
                    figures.update({f"main_{k}_mb": v for k, v in memory_by_kind(p.pid).items()})
                elif p.ppid() == pid and "detect_rss_mb" not in figures:  # its detection process
                    figures["detect_rss_mb"] = memory.rss / 2**20
                    figures.update({f"detect_{k}_mb": v for k, v in memory_by_kind(p.pid).items()})
                figures["fds"] += p.num_fds()
                figures["threads"] += p.num_threads()
                figures["cpu"] += (used - before[0]) / (now - before[1]) if before and now > before[1] else 0.0
        except psutil.Error:
            if p is root:
                return None
    return figures


ARENA_ALIGN = 64 * 2**20  # glibc maps each of its extra malloc arenas at a 64 MiB boundary (HEAP_MAX_SIZE)
MEMORY_KINDS = ("malloc_main", "malloc_arenas", "anon_other", "files")


def memory_by_kind(pid: int) -> dict[str, float]:
    """A process's resident MB by kind of mapping, to place a slow rise: ``malloc_main`` (the brk heap),
    ``malloc_arenas`` (glibc's other arenas), ``anon_other`` (Python's small-object arenas, blocks of 1 MiB
    or more mapped on their own, native libraries' own maps, thread stacks) and ``files`` (code, mapped
    files). Empty where the map cannot be read."""
    kinds = dict.fromkeys(MEMORY_KINDS, 0.0)
    try:
        maps = psutil.Process(pid).memory_maps(grouped=False)
    except (psutil.Error, OSError):
        return {}
    for m in maps:
        start = int(m.addr.split("-")[0], 16)
        if m.path == "[heap]":
            kind = "malloc_main"
        elif m.path.startswith("/"):
            kind = "files"
        elif m.path in ("[vdso]", "[vvar]", "[vsyscall]"):
            continue  # the kernel's pages, not memory the process holds
        elif m.path != "[stack]" and m.perms.startswith("rw") and start % ARENA_ALIGN == 0:
            kind = "malloc_arenas"
        else:
            kind = "anon_other"
        kinds[kind] += m.rss / 2**20
    return {k: round(v, 1) for k, v in kinds.items()}


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is missing)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for f in path.rglob("*") if path.exists() else ():
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_size
    return total


def timed_get(url: str, timeout: float = 30) -> float | None:
    """Milliseconds a GET took to answer 200 (None on any other outcome)."""
    began = time.perf_counter()
    try:
        r = requests.get(url, timeout=timeout)
    except requests.RequestException:
        return None
    return (time.perf_counter() - began) * 1000 if r.status_code == 200 else None


def settled_samples(samples: list[dict[str, Any]], settle_s: float = LIFE_SETTLE_S) -> list[dict[str, Any]]:
    """The samples taken ``settle_s`` or more after their collector life's first sample: a restart's restore
    and catch-up are a step, not a trend (they are reported by the RSS after a restart).

    >>> rows = [{"life": life, "wall_s": t} for life, t in ((1, 0), (1, 400), (2, 600), (2, 700), (2, 900))]
    >>> [(s["life"], s["wall_s"]) for s in settled_samples(rows)]
    [(1, 400), (2, 900)]
    """
    first: dict[int, float] = {}
    for s in samples:
        first.setdefault(s["life"], s["wall_s"])
    return [s for s in samples if s["wall_s"] - first[s["life"]] >= settle_s]


def pooled_slope(points: Iterable[tuple[float, float, int]]) -> float | None:
    """Slope (y per x) of (x, y, life) points with an intercept per life: how a process grows while it runs,
    across restarts that reset it. None with too few points."""
    fit = pooled_fit(points)
    return fit[0] if fit else None


def pooled_fit(points: Iterable[tuple[float, float, int]]) -> tuple[float, float] | None:
    """:func:`pooled_slope` and its standard error: samples that swing by 100 MB around a flat level give a
    slope of some MB an hour either way over an hour, and the error says how far from zero that is.

    >>> slope, error = pooled_fit([(0, 100, 1), (1, 112, 1), (2, 118, 1), (3, 132, 1)])
    >>> round(slope, 1), round(error, 1)
    (10.2, 1.0)
    """
    lives: dict[int, list[tuple[float, float]]] = {}
    for x, y, life in points:
        lives.setdefault(life, []).append((x, y))
    num = den = 0.0
    used: list[tuple[float, float, float, float]] = []  # x, y and the life's means
    for pts in lives.values():
        if len(pts) < 3:
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
        used += [(x, y, mx, my) for x, y in pts]
    if not den:
        return None
    slope = num / den
    freedom = len(used) - 1 - sum(len(p) >= 3 for p in lives.values())  # the slope and each life's intercept
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y, mx, my in used)
    return slope, (residual / freedom / den) ** 0.5 if freedom > 0 else float("inf")


def medians_by(samples: list[dict[str, Any]], pick: Callable[[dict[str, Any]], float | None],
               every_s: float = 600.0) -> list[tuple[float, float]]:
    """(minute, median) of a figure in each ``every_s`` of wall time: the level a process holds, without the
    30 s samples' swings (a batch in flight, a checkpoint's pickle).

    >>> rows = [{"wall_s": t, "v": 100 + (50 if t % 90 == 0 else 0)} for t in range(0, 1200, 30)]
    >>> medians_by(rows, lambda s: s["v"])
    [(0.0, 100.0), (10.0, 100.0)]
    """
    buckets: dict[int, list[float]] = {}
    for s in samples:
        if (value := pick(s)) is not None:
            buckets.setdefault(int(s["wall_s"] // every_s), []).append(value)
    return [(k * every_s / 60, round(statistics.median(v), 1)) for k, v in sorted(buckets.items())]


def life_levels(samples: list[dict[str, Any]], figure: str = "rss_mb") -> list[float]:
    """The collector's median ``figure`` in each life, from ``LIFE_SETTLE_S`` after its start: a leak raises
    each life above the one before, while a slope within a life also holds the life's own filling (its
    streams, trace buffer and memos reach their bounds in 10-20 minutes).

    >>> rows = [{"life": 1, "wall_s": t, "collector": {"pss_mb": 500 + t / 100}} for t in range(0, 1500, 300)]
    >>> life_levels(rows + [{"life": 2, "wall_s": 1500 + t, "collector": {"pss_mb": 700.0}} for t in (0, 300, 600)],
    ...             "pss_mb")
    [507.5, 700.0]
    """
    return [round(statistics.median(values), 1) for life in sorted({s["life"] for s in samples})
            if (values := [s["collector"][figure] for s in settled_samples(samples)
                           if s["life"] == life and s.get("collector") and figure in s["collector"]])]


def percentile(values: list[float], share: float) -> float | None:
    """The ``share`` quantile of ``values`` by nearest rank, as the detectors take a window's p99; None when empty."""
    return nearest_rank(sorted(values), share) if values else None


def slow_answers(samples: list[dict[str, Any]], over_ms: float = 200) -> list[dict[str, Any]]:
    """Each sample whose spike list answered over ``over_ms`` once, with what places it: ``/healthz`` answered
    just before (the event loop alone), the collector's CPU (cores), and the writer's mean commit since the
    sample before.

    >>> rows = [{"wall_s": 0, "api_ms": [20], "writes": 10, "write_s": 1.0},
    ...         {"wall_s": 30, "api_ms": [15, 450], "health_ms": 300.0, "collector": {"cpu": 0.95}, "writes": 20,
    ...          "write_s": 3.0}]
    >>> slow_answers(rows)
    [{'minute': 0.5, 'api_ms': 450, 'health_ms': 300.0, 'cpu': 0.95, 'commit_ms': 200.0}]
    """
    slow: list[dict[str, Any]] = []
    for before, s in zip([{}, *samples], samples, strict=False):
        if max(s.get("api_ms") or [0]) <= over_ms:
            continue
        writes = (s.get("writes") or 0) - (before.get("writes") or 0)
        spent = (s.get("write_s") or 0) - (before.get("write_s") or 0)
        slow.append({"minute": round(s["wall_s"] / 60, 1), "api_ms": max(s["api_ms"]), "health_ms": s.get("health_ms"),
                     "cpu": (s.get("collector") or {}).get("cpu"),
                     "commit_ms": round(1000 * spent / writes, 1) if writes > 0 and before else None})
    return slow


@dataclass
class Canary:
    trace: str
    span: str
    acked_at: float  # wall (monotonic)


@dataclass
class Accuracy:
    faults: int = 0
    found: int = 0
    top1: int = 0
    per_block: dict[int, list[int]] = field(default_factory=dict)  # block -> [faults, found, top1]
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    false_spikes: list[str] = field(default_factory=list)
    false_by_reason: dict[str, int] = field(default_factory=dict)
    pages_per_fault: list[int] = field(default_factory=list)


def score(plan: SoakPlan, spikes: list[dict[str, Any]], event_end_s: float) -> Accuracy:
    """Each planned fault (onset before ``event_end_s``, the traffic's end) against the spikes found."""
    out = Accuracy()
    starts = [((parse_time(s["start"]) - plan.start_ns) / NS, s) for s in spikes]
    claimed: set[str] = set()
    for f in plan.faults():
        if f.onset_s + f.duration_s > event_end_s:
            continue
        block = out.per_block.setdefault(int(f.onset_s // BLOCK_S), [0, 0, 0])
        out.faults += 1
        block[0] += 1
        during = [(t, s) for t, s in starts if f.onset_s - WINDOW_S <= t < f.onset_s + f.duration_s + WINDOW_S]
        claimed.update(s["id"] for _, s in during)
        label = f"{f.kind} {f.service} +{f.size_ms:.0f} ms at {f.onset_s / 3600:.2f} h"
        first = min(during, key=lambda ts: ts[0], default=None)
        out.pages_per_fault.append(len(during))
        if first is None or first[0] > f.onset_s + FOUND_WITHIN_S:
            out.missed.append(label + ("" if first is None else f" (first spike {first[0] - f.onset_s:.0f} s in)"))
            continue
        out.found += 1
        block[1] += 1
        causes = first[1]["causes"]
        if causes and causes[0]["service"] == f.service:
            out.top1 += 1
            block[2] += 1
        else:
            out.wrong.append(f"{label}: {causes[0]['summary'] if causes else 'no cause'}")
    swings = [edge for a, b in plan.swings() for edge in (a, b)]
    pauses = [start for start, _, _ in plan.pauses()]
    for t, s in starts:
        if s["id"] in claimed:
            continue
        names = " ".join([s["operation"] or "", *(c["operation"] or "" for c in s["causes"][:1])])
        reason = ("churned name" if CHURN_MARK in names else
                  "load swing" if any(abs(t - e) <= 120 for e in swings) else
                  "service pause" if any(-2 * WINDOW_S <= t - p <= WINDOW_S for p in pauses) else "other")
        out.false_by_reason[reason] = out.false_by_reason.get(reason, 0) + 1
        out.false_spikes.append(f"{t / 3600:.2f} h {s['service']}/{s['operation']} p99 {s['p99_ms']:.0f} ms vs "
                                f"{s['baseline_p99_ms']:.0f} ms ({reason})")
    return out


def accuracy_figures(acc: Accuracy) -> dict[str, Any]:
    """What a run reports of its accuracy (a daemons' run and a replay alike)."""
    return {
        "faults": acc.faults, "found": acc.found, "top1": acc.top1,
        "recall_per_6h": {f"{b * 6}-{b * 6 + 6} h": (v[1] / v[0] if v[0] else None, v[0])
                          for b, v in sorted(acc.per_block.items())},
        "spikes_per_fault": statistics.fmean(acc.pages_per_fault) if acc.pages_per_fault else None,
        "missed": acc.missed, "wrong": acc.wrong, "false_spikes": acc.false_spikes,
        "false_by_reason": acc.false_by_reason,
    }


# -- the run ------------------------------------------------------------------------------------------------


class Soak:
    """One soak run on one storage: its daemons, traffic, operations and samples."""

    def __init__(self, storage: str, settings: SoakSettings, workdir: Path, log: Callable[[str], None] = print
                 ) -> None:
        self.storage, self.settings, self.workdir, self.log = storage, settings, workdir, log
        self.pg: PostgresServer | None = None
        self.db_path: Path | None = None
        self.collector: CollectorProcess | None = None
        self.agents: list[AgentProcess] = []
        self.samples: list[dict[str, Any]] = []
        self.events: list[tuple[float, str]] = []  # (wall s since start, what the operations did)
        self.canaries: list[Canary] = []
        self.unserved: list[Canary] = []  # lost: not served within 5 minutes of their ack (nor at the end)
        self.late_canaries: list[str] = []  # not served within 5 minutes, served at the end after all
        self.duplicated: list[str] = []
        self.canaries_checked = 0
        self.traffic: dict[str, Any] = {}
        self.cpu_last: dict[int, tuple[float, float]] = {}
        self.api_ms: list[float] = []
        self.page_ms: list[float] = []
        self.lives = 0  # collector starts
        self.began = 0.0
        self.stop = threading.Event()

    # -- set-up ---------------------------------------------------------------------------------------------

    def start(self, hook_url: str) -> None:
        if self.storage == "postgres":
            self.pg = PostgresServer(base_dir=self.workdir / "pg")
            url = self.pg.start()
        else:
            self.db_path = self.workdir / "soak.sqlite"
            url = f"sqlite:///{self.db_path}"
        config = self.workdir / "collector.toml"
        config.write_text(f"""
[storage]
span_retention_max_bytes = {int(self.settings.span_cap_mb * 2**20)}
metric_retention_max_points = {self.settings.point_cap}
window_retention_days = {self.settings.window_days}

[collector]
allowed_lateness_seconds = {lateness_s(self.settings.speed)}
{alert_config(hook_url)}""")
        self.collector = CollectorProcess(url, self.workdir, env={"SPIKEHOUND_CONFIG": str(config)})
        if self.settings.heap_every > 0:  # tracemalloc on in every life; SIGUSR2 writes where the heap is
            self.collector.env["HEAP_PROBE_DIR"] = str((self.settings.out / f"heap-{self.storage}").resolve())
            self.collector.prefix = [sys.executable, "-m", "harness.heap_probe"]
        self.collector.start(120)
        self.lives = 1
        for i in range(self.settings.agents):
            workdir = self.workdir / f"agent-{i + 1}"
            workdir.mkdir(parents=True, exist_ok=True)
            self.agents.append(AgentProcess(self.collector.grpc_endpoint, workdir, interval=10,
                                            env={"SPIKEHOUND_AGENT_HOST_NAME": f"soak-agent-{i + 1}"}).start(60))

    def stop_all(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.terminate(60)
        if self.collector is not None:
            with contextlib.suppress(Exception):
                self.collector.terminate(120)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                shutil.copy(self.pg.log_path, self.workdir / "postgres.log")
            self.pg.stop()

    # -- probes ---------------------------------------------------------------------------------------------

    @property
    def api(self) -> str:
        assert self.collector is not None
        return self.collector.api

    def db_bytes(self) -> tuple[int, int]:
        """(database bytes on disk, of which WAL)."""
        if self.pg is not None:
            data = self.pg.data_dir
            return tree_bytes(data), tree_bytes(data / "pg_wal")
        assert self.db_path is not None
        wal = tree_bytes(Path(f"{self.db_path}-wal"))
        return tree_bytes(self.db_path) + wal + tree_bytes(Path(f"{self.db_path}-shm")), wal

    def take_sample(self) -> None:
        assert self.collector is not None
        wall = time.monotonic() - self.began
        row: dict[str, Any] = {"wall_s": round(wall, 1), "event_s": self.traffic.get("event_second", -1),
                               "life": self.lives}
        row["collector"] = process_figures(self.collector.proc.pid if self.collector.running else None,
                                           self.cpu_last)
        row["agents"] = [process_figures(a.proc.pid if a.running else None, self.cpu_last) for a in self.agents]
        row["db_bytes"], row["wal_bytes"] = self.db_bytes()
        row["spool_bytes"] = sum(tree_bytes(a.spool_dir) for a in self.agents)
        try:
            metrics = scrape(self.api, timeout=10)
            row.update({k: sample(metrics, name) for k, name in GAUGES.items()})
            row["metrics_series"] = len(metrics)
            row["heap_mb"] = {kind: round(v / 2**20, 1) for kind in HEAP_KINDS
                              if (v := sample(metrics, "spikehound_process_heap_bytes", allocator=kind)) is not None}
            if (blocks := sample(metrics, "spikehound_process_python_blocks")) is not None:
                row["heap_mb"]["python_kblocks"] = round(blocks / 1000, 1)
            for state in ("mapped", "in_use", "peak_mapped"):
                if (arena := sample(metrics, "spikehound_process_python_arena_bytes", state=state)):
                    row["heap_mb"][f"python_arena_{state}"] = round(arena / 2**20, 1)
            row["stored_spans"] = sample(metrics, "spikehound_ingest_stored_total", signal="spans")
            # The writer's commits since the last sample (sum and count) place a cluster of slow answers.
            row["write_s"] = sample(metrics, "spikehound_storage_write_seconds_sum")
            row["writes"] = sample(metrics, "spikehound_storage_write_seconds_count")
        except Exception as exc:  # a collector restarting: the row says so
            row["scrape_error"] = str(exc)[:200]
        # The health answer needs the event loop alone: slow beside a slow list, the process (its loop, the GIL
        # or the cores) was busy; quick beside it, the list's query was.
        row["health_ms"] = round(health, 1) if (health := timed_get(f"{self.api}/healthz")) is not None else None
        answers = [timed_get(f"{self.api}/api/v1/spikes?limit=100") for _ in range(self.settings.api_probes)]
        row["api_ms"] = [round(a, 1) for a in answers if a is not None]
        self.api_ms.extend(row["api_ms"])
        with contextlib.suppress(Exception):
            newest = list_spikes(self.api, limit=1)
            if newest:
                page = timed_get(f"{self.api}/ui/spikes/{newest[0]['id']}")
                if page is not None:
                    row["page_ms"] = round(page, 1)
                    self.page_ms.append(page)
        self.samples.append(row)
        c = row["collector"] or {}
        agents = " ".join(f"{(a or {}).get('rss_mb', 0):.0f}" for a in row["agents"])
        heap = " ".join(f"{kind} {v:.0f}" for kind, v in row.get("heap_mb", {}).items())
        self.log(f"[{self.storage} {wall / 60:5.1f} min, event {row['event_s'] / 3600:5.2f} h] collector "
                 f"{c.get('rss_mb', 0):.0f} MB (PSS {c.get('pss_mb', 0):.0f}, its own process "
                 f"{c.get('main_rss_mb', 0):.0f}: {heap}) {c.get('fds', 0)} fds, agents "
                 f"{agents} MB, db "
                 f"{row['db_bytes'] / 2**20:.0f} MB, spool {row['spool_bytes'] / 2**20:.1f} MB, open windows "
                 f"{row.get('open_windows')}, canaries {self.canaries_checked} checked {len(self.unserved)} lost")

    def check_canaries(self, final: bool = False) -> None:
        """Look up canaries acked a minute ago or more; one not found is looked up again at later samples, up
        to 5 minutes after its ack. ``final`` (after the run has settled): every canary left, once."""
        now = time.monotonic()
        keep = []
        for c in self.canaries:
            if not final and now - c.acked_at < 60:
                keep.append(c)
                continue
            try:
                _, lost, dup = served_once(self.api, [(c.trace, c.span)], workers=1)
            except Exception:  # the collector restarting: next time
                keep.append(c)
                continue
            if lost and not final and now - c.acked_at < 300:
                keep.append(c)
                continue
            self.canaries_checked += 1
            if lost:
                self.unserved.append(c)
            if dup:
                self.duplicated.append(f"{c.trace}/{c.span}")
        self.canaries = keep
        if final:
            # One not served within 5 minutes is looked up once more at the end: served then, it was late
            # (held in an agent's queue or the collector's), not lost.
            still = []
            for c in self.unserved:
                try:
                    _, lost, _ = served_once(self.api, [(c.trace, c.span)], workers=1)
                except Exception:
                    lost = 1
                if lost:
                    still.append(c)
                else:
                    self.late_canaries.append(f"{c.trace}/{c.span}")
            self.unserved = still

    def read_traffic(self, reports: Any) -> None:
        while True:
            try:
                r = reports.get_nowait()
            except queue.Empty:
                return
            now = time.monotonic()
            self.canaries.extend(Canary(t, s, now) for t, s, _ in r.pop("canaries"))
            self.traffic.update(r)

    # -- operations -----------------------------------------------------------------------------------------

    def operations(self) -> None:
        """SIGHUP, SIGKILL and PostgreSQL restarts on their schedules (wall seconds from the start)."""
        a = self.settings
        due = {"reload": a.reload_every, "kill": a.kill_every, "pg-restart": a.pg_restart_every,
               "heap": a.heap_every}
        next_at = {k: v for k, v in due.items() if v > 0 and (k != "pg-restart" or self.pg is not None)}
        while not self.stop.is_set():
            now = time.monotonic() - self.began
            for what, at in sorted(next_at.items(), key=lambda kv: kv[1]):
                if now < at:
                    continue
                try:
                    self.operate(what)
                    self.events.append((round(now, 1), what))
                except Exception as exc:  # said; the run goes on
                    self.events.append((round(now, 1), f"{what} failed: {exc}"))
                    self.log(f"[{self.storage}] {what} failed: {exc}")
                next_at[what] = at + due[what]
            self.stop.wait(1.0)

    def operate(self, what: str) -> None:
        assert self.collector is not None and self.collector.proc is not None
        if what == "reload":
            self.collector.proc.send_signal(signal.SIGHUP)
        elif what == "kill":
            self.collector.kill()
            self.collector.start(180)
            self.lives += 1
        elif what == "pg-restart" and self.pg is not None:
            self.pg.restart("fast")
        elif what == "heap":  # the collector and its forks: a child it ran (no handler) would die of SIGUSR2
            for proc in [p := psutil.Process(self.collector.proc.pid), *p.children(recursive=True)]:
                if "harness.heap_probe" in proc.cmdline():
                    proc.send_signal(signal.SIGUSR2)

    # -- the whole run --------------------------------------------------------------------------------------

    def plan(self) -> SoakPlan:
        wall_s = self.settings.hours * 3600
        event_s = int(wall_s * self.settings.speed)
        # Ends at the present: the collector refuses spans from its future, never ones from its past.
        start_ns = (time.time_ns() + int(wall_s * NS) - event_s * NS) // GRID_NS * GRID_NS
        return SoakPlan(seed=self.settings.seed, start_ns=start_ns, seconds=event_s,
                        spans_per_s=self.settings.rate / self.settings.speed, fault_every_s=self.settings.fault_every,
                        churn=self.settings.churn)

    def execute(self) -> dict[str, Any]:
        result: dict[str, Any] = {"storage": self.storage, "settings": dataclasses.asdict(self.settings)}
        ctx = multiprocessing.get_context("spawn")
        with WebhookReceiver() as hook:
            try:
                self.start(hook.url)
                plan = self.plan()
                reports = ctx.Queue(1000)
                stop_traffic = ctx.Event()
                self.began = time.monotonic()
                traffic = ctx.Process(target=send, name="soak-traffic", daemon=True,
                                      args=(plan, [a.http_endpoint for a in self.agents], time.time(),
                                            self.settings.speed, stop_traffic, reports, self.settings.canary_every))
                traffic.start()
                ops = threading.Thread(target=self.operations, name="soak-operations", daemon=True)
                ops.start()
                next_sample = 0.0
                while traffic.is_alive() and time.monotonic() - self.began < self.settings.hours * 3600 + 60:
                    self.read_traffic(reports)
                    if time.monotonic() - self.began >= next_sample:
                        self.take_sample()
                        self.check_canaries()
                        next_sample += self.settings.sample_every
                    time.sleep(0.5)
                stop_traffic.set()
                self.stop.set()
                ops.join(300)
                traffic.join(60)
                self.read_traffic(reports)
                self.settle()
                self.take_sample()
                self.check_canaries(final=True)
                spikes = list_spikes(self.api, limit=10_000)
                accuracy = score(plan, spikes, float(self.traffic.get("event_second", 0)))
                result["spikes"] = [
                    {"start_h": round((parse_time(k["start"]) - plan.start_ns) / NS / 3600, 4),
                     "end_h": round((parse_time(k["end"]) - plan.start_ns) / NS / 3600, 4) if k.get("end") else None,
                     "stream": f"{k['service']} {k['operation']} {k.get('peer_service') or ''}".strip(),
                     "state": k["state"], "occurrence": k.get("occurrence"),
                     "top": k["causes"][0]["summary"] if k["causes"] else None} for k in spikes]
                firing = {n for n in notifications(hook) if n[1] == "firing"}
                result.update(self.summary(plan, accuracy, len(firing)))
            except Exception as exc:
                result["failed"] = f"{exc.__class__.__name__}: {exc}"
                self.log(f"[{self.storage}] run failed: {result['failed']}")
            finally:
                self.stop.set()
                self.stop_all()
        result["samples"] = self.samples
        result["events"] = self.events
        return result

    def settle(self, timeout: float = 900) -> None:
        """Until the agents' queues and spools are empty and no window is held or open (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                spooled = sum(a.metric("spikehound_agent_spool_requests")
                              + a.metric("spikehound_agent_queue_memory_bytes") for a in self.agents)
                m = scrape(self.api, timeout=10)
                if not spooled and not sample(m, "spikehound_latency_open_windows"):
                    return
            except Exception:  # the collector restarting
                pass
            time.sleep(2)
        self.log(f"[{self.storage}] not settled after {timeout:.0f} s")

    def trend(self, hour: float, figure: str = "main_rss_mb", less_sqlite_cache: bool = False) -> dict[str, Any]:
        """One of the collector's processes' RSS after ``hour`` (its own, ``main_rss_mb``, or its detection
        process's, ``detect_rss_mb``): the samples' slope with its standard error, and the 10-minute medians (of
        the whole run) with their slope, which the samples' swings do not move. ``less_sqlite_cache``: without
        SQLite's page caches (``spikehound_process_heap_bytes{allocator="sqlite"}``), which fill towards their
        bound (128 MiB) for as long as the database has pages not yet read, hours on a database of 2 GB."""

        def pick(s: dict[str, Any]) -> float | None:
            value = (s.get("collector") or {}).get(figure)
            if value is None or not less_sqlite_cache:
                return value
            cache = (s.get("heap_mb") or {}).get("sqlite")
            return None if cache is None else value - cache

        own = [(s, v) for s in settled_samples(self.samples) if (v := pick(s)) is not None]
        fit = pooled_fit((s["wall_s"] / 3600, v, s["life"]) for s, v in own if s["wall_s"] >= hour)
        medians = medians_by([s for s, _ in own], pick)
        later = [(minute / 60, mb, 0) for minute, mb in medians if minute * 60 >= hour]
        return {"slope_mb_per_h": fit[0] if fit else None, "standard_error_mb_per_h": fit[1] if fit else None,
                "medians_slope_mb_per_h": pooled_slope(later) if self.lives == 1 else None,
                "ten_minute_medians_mb": medians}

    def summary(self, plan: SoakPlan, acc: Accuracy, notifications: int) -> dict[str, Any]:
        hour = min(3600.0, self.settings.hours * 3600 / 2)  # "after the first hour" (half of a shorter run)
        late = [s for s in self.samples if s["wall_s"] >= hour]
        settled = [s for s in settled_samples(self.samples) if s["wall_s"] >= hour]

        def slope(pick: Callable[[dict[str, Any]], dict[str, float] | None], life: bool,
                  figure: str = "rss_mb") -> float | None:
            pts = [(s["wall_s"] / 3600, f[figure], s["life"] if life else 0) for s in (settled if life else late)
                   if (f := pick(s)) is not None and figure in f]
            return pooled_slope(pts)

        fds = [s["collector"]["fds"] for s in self.samples if s.get("collector")]
        agent_fds = [[s["agents"][i]["fds"] for s in self.samples if s["agents"][i]] for i in range(len(self.agents))]
        db = [s["db_bytes"] / 2**20 for s in late] or [s["db_bytes"] / 2**20 for s in self.samples]
        # Both counters start again with each life: each life's last figures, summed.
        lives: dict[int, tuple[float, float]] = {}
        for s in self.samples:
            if s.get("late_spans") is not None and s.get("stored_spans"):
                lives[s["life"]] = (s["late_spans"], s["stored_spans"])
        stored = sum(v[1] for v in lives.values())
        return {
            "event_hours": self.traffic.get("event_second", 0) / 3600,
            "acked_spans": self.traffic.get("acked", 0), "rejected_spans": self.traffic.get("rejected", 0),
            "sender_retries": self.traffic.get("retries", 0), "sender_max_lag_s": self.traffic.get("max_lag_s", 0),
            "traffic_error": self.traffic.get("error", ""),
            "canaries": self.canaries_checked, "lost": [f"{c.trace}/{c.span}" for c in self.unserved],
            "duplicated": self.duplicated, "late_canaries": self.late_canaries,
            "collector_lives": self.lives, "spikes_paged": notifications,
            "late_span_share": sum(v[0] for v in lives.values()) / stored if stored else None,
            "rss_slope_mb_per_h": {"collector": slope(lambda s: s["collector"], True),
                                   **{f"agent-{i + 1}": slope(lambda s, i=i: s["agents"][i], False)
                                      for i in range(len(self.agents))}},
            "pss_slope_mb_per_h": {"collector": slope(lambda s: s["collector"], True, "pss_mb"),
                                   **{f"agent-{i + 1}": slope(lambda s, i=i: s["agents"][i], False, "pss_mb")
                                      for i in range(len(self.agents))}},
            "collector_process_rss_slope_mb_per_h": slope(lambda s: s["collector"], True, "main_rss_mb"),
            "collector_process_rss_trend": self.trend(hour),
            "detection_process_rss_trend": self.trend(hour, "detect_rss_mb"),
            "collector_process_rss_less_sqlite_cache_trend": self.trend(hour, less_sqlite_cache=True),
            "collector_process_slope_by_kind_mb_per_h": {
                kind: slope(lambda s: s["collector"], True, f"main_{kind}_mb")
                for kind in MEMORY_KINDS},
            "detection_process_rss_slope_mb_per_h": slope(lambda s: s["collector"], True, "detect_rss_mb"),
            "detection_process_slope_by_kind_mb_per_h": {
                kind: slope(lambda s: s["collector"], True, f"detect_{kind}_mb")
                for kind in MEMORY_KINDS},
            "collector_process_slope_by_allocator_mb_per_h": {
                kind: slope(lambda s: s.get("heap_mb"), True, kind) for kind in (*HEAP_KINDS, *PYTHON_KINDS)},
            "collector_pss_mb_by_life": life_levels(self.samples, "pss_mb"),
            "collector_rss_mb_max": max((s["collector"]["rss_mb"] for s in self.samples if s.get("collector")),
                                        default=None),
            "collector_fds": [min(fds, default=0), max(fds, default=0)],
            "agent_fds": [[min(f, default=0), max(f, default=0), f[-1] if f else 0] for f in agent_fds],
            "db_mb_band": [min(db, default=0), max(db, default=0)],
            "api_p99_ms": percentile(self.api_ms, 0.99),
            "health_p99_ms": percentile([h for s in self.samples if (h := s.get("health_ms")) is not None], 0.99),
            "slow_api_samples": slow_answers(self.samples),
            "page_p99_ms": percentile(self.page_ms, 0.99),
            **accuracy_figures(acc), "plan": {"faults": len(plan.faults()), "swings": plan.swings(),
                                              "start_ns": plan.start_ns, "seconds": plan.seconds},
        }


