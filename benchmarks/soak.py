"""Soak: hours of traffic against real daemons, to see what drifts (memory, disk, descriptors, accuracy).

Run from the repository root (``make bench`` runs the default, two hours per storage)::

    python -m benchmarks.soak                                  # SQLite, then PostgreSQL: 2 h each, a day of event time
    python -m benchmarks.soak --storage postgres --hours 0.5 --speed 12
    python -m benchmarks.soak --hours 0.05 --rate 1500 --kill-every 40 --reload-every 20   # a short look

What runs
---------
One ``spikehound collector`` (SQLite or a PostgreSQL server of its own), two ``spikehound agent`` processes,
a webhook receiver for its alerts, and a traffic process (:mod:`harness.soak_traffic`): the mesh family's
traffic at ``--rate`` spans a second of wall time, through the agents (the mesh's four nodes two per agent),
with a latency fault every 20 minutes of event time, 1 % of spans renamed to names never seen before, and a
tenfold load drop between two faults every two hours of event time. Event time runs ``--speed`` times the
wall clock, ending at the present: at speed 12 a two-hour run covers a day of it.

While it runs (every interval is wall time and a flag): a SIGHUP reload every 10 minutes, a SIGKILL of the
collector every 30 minutes (started again at once, from its checkpoint), a PostgreSQL restart every hour on
the PostgreSQL run. Retention is capped by size (``--span-cap-mb``) and the windows' age (``--window-days``),
so that it deletes all the time. The collector's ``allowed_lateness_seconds`` is scaled with ``--speed``
(``harness.soak.lateness_s``: 24 s at speed 12): the agents forward within 2 s of wall time, which the
compressed clock stretches past the default 5 s (left there, a tenth of the spans came too late for their
windows); the share that still does is reported (``late_span_share``).

Sampled every 30 s: RSS, CPU, open descriptors and threads of the collector and the agents; the database on
disk (and its WAL); the agents' spools; the collector's open windows, streams, baselines, resource series,
trace buffer and /metrics series; the answer time of ``GET /api/v1/spikes`` and of the newest spike's page.
Every 500th acknowledged request's middle span is a canary, looked up through ``GET /api/v1/traces/{id}``
a minute later (and again, up to 5 minutes): one not served exactly once is lost or duplicated.

At the end: every fault's recall (a spike starting between one window before its onset and two minutes
after it) and top cause (the first cause names the faulty service), per six hours of event time; spikes
outside every fault (false), each put down to what was near it (a load swing's edge, a churned name,
a generator's service pause, nothing); the RSS slope of each process after the first hour of wall time
(the collector's pooled over its lives between kills, each life from 5 minutes after its start: a restart's
restore and catch-up are a step, shown by the RSS after it, not a trend); the database's band under
retention. Written as JSON and a PNG (matplotlib, when installed: ``pip install '.[bench]'``) into ``--out``.

``--replay`` starts no daemons: the same plan's event time goes through one detection engine and is scored
alike (``harness/soak_replay.py``): the detectors' accuracy on this traffic with nothing in their way,
deterministic, to hold a run's accuracy against (a run starved of CPU showed recall and false spikes that
were about its machine).

A measurement: exits 0 whatever it finds, 1 only when the run could not be carried out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.soak import Soak, SoakSettings
from harness.soak_replay import replay

# -- report -------------------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> bool:
    """RSS, database size, descriptors and recall over time as one PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["samples"]
    minutes = [r["wall_s"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    axes[0].plot(minutes, [(r["collector"] or {}).get("rss_mb") for r in rows], label="collector (RSS, both processes)")
    axes[0].plot(minutes, [(r["collector"] or {}).get("pss_mb") for r in rows], label="collector (PSS)")
    axes[0].plot(minutes, [(r["collector"] or {}).get("main_rss_mb") for r in rows], label="collector process")
    axes[0].plot(minutes, [(r["collector"] or {}).get("detect_rss_mb") for r in rows], label="its detection process")
    for i in range(len(rows[0]["agents"]) if rows else 0):
        axes[0].plot(minutes, [(r["agents"][i] or {}).get("rss_mb") for r in rows], label=f"agent {i + 1}")
    axes[0].set_ylabel("memory (MB)")
    axes[1].plot(minutes, [r["db_bytes"] / 2**20 for r in rows], label="database")
    axes[1].plot(minutes, [r["wal_bytes"] / 2**20 for r in rows], label="of which WAL")
    axes[1].set_ylabel("on disk (MB)")
    axes[2].plot(minutes, [(r["collector"] or {}).get("fds") for r in rows], label="collector fds")
    for i in range(len(rows[0]["agents"]) if rows else 0):
        axes[2].plot(minutes, [(r["agents"][i] or {}).get("fds") for r in rows], label=f"agent {i + 1} fds")
    axes[2].set_ylabel("open descriptors")
    blocks = result.get("recall_per_6h", {})
    if blocks and rows and rows[-1]["event_s"] > 0:
        per_min = rows[-1]["wall_s"] / 60 / (rows[-1]["event_s"] / 3600)  # wall minutes per event hour
        for label, (recall, _) in blocks.items():
            lo, hi = (float(x) for x in label.removesuffix(" h").split("-"))
            if recall is not None:  # the last block ends with the run
                axes[3].hlines(recall, lo * per_min, min(hi * per_min, minutes[-1]))
    axes[3].set_ylim(0, 1.05)
    axes[3].set_ylabel("recall (2 min) per 6 h of event time")
    axes[3].set_xlabel("wall time (min)")
    for when, what in result.get("events", []):
        if what == "kill":
            for ax in axes:
                ax.axvline(when / 60, color="grey", alpha=0.3, lw=0.8)
    for ax in axes[:3]:
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"spikehound soak: {result['storage']}, {result.get('event_hours', 0):.1f} h of event time "
                 "(grey: collector SIGKILLs)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def print_summary(r: dict[str, Any]) -> None:
    if "failed" in r:
        print(f"{r['storage']}: FAILED: {r['failed']}")
        return
    keys = ("event_hours", "acked_spans", "canaries", "collector_lives", "rss_slope_mb_per_h", "pss_slope_mb_per_h",
            "collector_process_rss_slope_mb_per_h", "collector_process_rss_trend",
            "collector_process_rss_less_sqlite_cache_trend", "collector_process_slope_by_kind_mb_per_h",
            "detection_process_rss_trend",
            "detection_process_slope_by_kind_mb_per_h", "collector_pss_mb_by_life", "collector_rss_mb_max",
            "collector_fds", "agent_fds", "db_mb_band", "api_p99_ms", "health_p99_ms", "slow_api_samples",
            "page_p99_ms", "faults", "found", "top1",
            "recall_per_6h", "spikes_per_fault", "false_by_reason", "spikes_paged", "sender_max_lag_s",
            "late_span_share", "spans", "engine_us_per_span", "state_mb_by_hour", "rss_mb_by_hour")
    print(f"\n== soak on {r['storage']}")
    for k in keys:
        if k in r:  # a replay has no daemons: only the accuracy figures
            print(f"  {k}: {r[k]}")
    if "lost" in r:
        print(f"  lost: {len(r['lost'])}  duplicated: {len(r['duplicated'])}  "
              f"served only after 5 minutes: {len(r['late_canaries'])}")
    for label in ("missed", "wrong", "false_spikes"):
        for line in r.get(label, [])[:20]:
            print(f"  {label}: {line}")


HELP = {"storage": "sqlite, postgres or both (one after the other)", "hours": "wall-clock hours per storage",
        "speed": "event seconds per wall second", "rate": "spans a second of wall time",
        "fault_every": "event seconds between faults", "churn": "share of spans with a name never seen before",
        "reload_every": "wall seconds between SIGHUPs (0: none)",
        "kill_every": "wall seconds between SIGKILLs of the collector (0: none)",
        "pg_restart_every": "wall seconds between PostgreSQL restarts (0: none)",
        "span_cap_mb": "storage.span_retention_max_bytes, in MiB", "point_cap": "storage.metric_retention_max_points",
        "window_days": "storage.window_retention_days",
        "sample_every": "wall seconds between samples", "api_probes": "GET /api/v1/spikes per sample",
        "canary_every": "every Nth acknowledged request gives a canary", "out": "folder for the JSON and PNGs",
        "keep": "keep each run's working folder (logs, database)",
        "heap_every": "wall seconds between heap snapshots of the collector's own process, written as "
                      "heap-<storage>/heap-<pid>.jsonl in --out (0: none; tracing on slows the collector)",
        "replay": "no daemons: the plan's event time through one detection engine, scored as a run (its accuracy "
                  "on an idle machine, deterministic; about 40 minutes of one core for 24 hours of event time)"}


def parse_args(argv: list[str] | None = None) -> SoakSettings:
    """The flags are :class:`harness.soak.SoakSettings`' fields (``--fault-every`` for ``fault_every``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    for f in dataclasses.fields(SoakSettings):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action="store_true", help=HELP.get(f.name))
        else:
            kind = {"int": int, "float": float, "Path": Path}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default, help=HELP.get(f.name),
                           **({"choices": ("sqlite", "postgres", "both")} if f.name == "storage" else {}))
    return SoakSettings(**vars(p.parse_args(argv)))


def run(settings: SoakSettings) -> list[dict[str, Any]]:
    """Every storage's run; each result also written as ``soak-<storage>.json`` (and ``.png``) in ``out``."""
    settings.out.mkdir(parents=True, exist_ok=True)
    if settings.replay:
        result = replay(settings)
        (settings.out / "soak-replay.json").write_text(json.dumps(result, indent=1, default=str))
        return [result]
    results = []
    for storage in ("sqlite", "postgres") if settings.storage == "both" else (settings.storage,):
        workdir = Path(tempfile.mkdtemp(prefix=f"soak-{storage}-"))
        try:
            result = Soak(storage, settings, workdir).execute()
        finally:
            if not settings.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        (settings.out / f"soak-{storage}.json").write_text(json.dumps(result, indent=1, default=str))
        if result["samples"] and plot(result, settings.out / f"soak-{storage}.png"):
            result["png"] = str(settings.out / f"soak-{storage}.png")
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    results = run(settings)
    for r in results:
        print_summary(r)
    print(f"\nresults in {settings.out}/")
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
