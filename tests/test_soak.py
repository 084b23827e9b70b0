"""The soak (``benchmarks/soak.py``) for two minutes of wall time: real collector and agents, 24 minutes of event
time with one fault, reloads, and a SIGKILL of the collector as the fault ends. Only what cannot be
noise is asserted: nothing acknowledged lost, no descriptor left behind, the fault found with its service (seed 1
plans +2 s on every call into ts-station-service, which most requests reach: a miss is a broken pipeline, not
a hard case; recall over many faults is the benchmark's).
The figures that need hours (RSS slopes, the database's band, recall per six hours) are ``make bench``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.soak import MEMORY_KINDS, Soak, SoakSettings, score
from harness.soak_replay import REPLAY_START_NS, replay
from harness.soak_traffic import SoakPlan
from spikehound.timefmt import rfc3339
from spikehound.units import NS

pytestmark = pytest.mark.slow


def test_two_minutes_of_soak_lose_nothing_leak_no_descriptor_and_find_the_fault(tmp_path: Path):
    settings = SoakSettings(storage="sqlite", hours=2 / 60, speed=12, rate=1500, fault_every=600, reload_every=30,
                            kill_every=70, canary_every=100, sample_every=10, api_probes=1, span_cap_mb=64,
                            seed=1, out=tmp_path)
    result = Soak("sqlite", settings, tmp_path).execute()

    assert "failed" not in result, result.get("failed")
    assert not result["traffic_error"], result["traffic_error"]
    assert result["collector_lives"] == 2, result["events"]  # killed at 70 s, after its first checkpoint
    assert any(what == "reload" for _, what in result["events"])
    assert result["canaries"] >= 5
    assert result["lost"] == [] and result["duplicated"] == [], (result["lost"], result["duplicated"])
    for low, _high, last in result["agent_fds"]:  # agents live through the run: their descriptors come back
        assert last <= low + 8, result["agent_fds"]
    assert result["faults"] == 1 and result["found"] == 1, result["missed"]
    # The collector's own memory is placed by kind of mapping, and the kinds make up its RSS. The two are read
    # one after the other from a process whose writer swings tens of MB in between: the median sample is held.
    own = [s["collector"] for s in result["samples"] if s.get("collector") and "main_files_mb" in s["collector"]]
    off = sorted(abs(sum(c[f"main_{kind}_mb"] for kind in MEMORY_KINDS) / c["main_rss_mb"] - 1) for c in own)
    assert own and off[len(off) // 2] < 0.1, (off, own[-1:])
    # So is its detection process's (the forked child, where the detectors' state lives).
    child = [s["collector"] for s in result["samples"] if s.get("collector") and "detect_files_mb" in s["collector"]]
    off = sorted(abs(sum(c[f"detect_{kind}_mb"] for kind in MEMORY_KINDS) / c["detect_rss_mb"] - 1) for c in child)
    assert child and off[len(off) // 2] < 0.1, (off, child[-1:])
    # ... and by allocator, from the collector's own gauges: SQLite's page caches are there on SQLite, and
    # inside what malloc has in use; Python's objects are counted.
    heaps = [s["heap_mb"] for s in result["samples"] if s.get("heap_mb")]
    assert heaps and all(0 < h["sqlite"] <= h["malloc_used"] and h["python_kblocks"] > 100 for h in heaps), heaps
    # Its top cause is reported, not asserted: on a loaded 2-core machine a callee's exporter can deliver after
    # the slow trace was broken down, and the wait shows as the caller's call (issue 31: assert only what
    # cannot be noise here; benchmarks.detection holds the causes to their bars).
    assert "no cause" not in " ".join(result["wrong"]), result["wrong"]


def test_a_replay_of_the_soaks_traffic_finds_its_fault_with_its_service_and_pages_nothing_else(tmp_path: Path):
    # No daemons: 36 minutes of the plan's event time through one engine. Deterministic, so the top cause and
    # the absence of false spikes are asserted here, where the daemons' run can only report them.
    result = replay(SoakSettings(hours=0.05, speed=12, rate=2000, seed=1, out=tmp_path), state_every_s=600)
    assert result["event_hours"] == pytest.approx(0.6)
    assert (result["faults"], result["found"], result["top1"]) == (1, 1, 1), (result["missed"], result["wrong"])
    assert result["false_spikes"] == [] and result["spikes_per_fault"] == 1.0, result["false_spikes"]
    # What the detectors hold, every 10 minutes of event time here: nothing learned at the start, then the
    # traffic's streams.
    state = result["state_mb_by_hour"]
    assert len(state) == len(result["rss_mb_by_hour"]) == 4 and state[0] < 0.1 < state[1] <= max(state), state


def test_a_spike_outside_every_fault_is_put_down_to_the_service_pause_it_began_at():
    plan = SoakPlan(seed=41, start_ns=REPLAY_START_NS, seconds=4 * 3600, spans_per_s=800.0)
    faults = [(f.onset_s, f.onset_s + f.duration_s) for f in plan.faults()]
    # A pause with no fault in the ten minutes before it, nor at it.
    pause_s, _, service = next(p for p in plan.pauses() if not any(a < p[0] + 60 and b > p[0] - 700 for a, b in faults))

    def spike(at_s: float, operation: str) -> dict[str, object]:
        return {"id": operation, "start": rfc3339(plan.start_ns + int(at_s * NS)), "service": "ts-gateway-service",
                "operation": operation, "p99_ms": 5000.0, "baseline_p99_ms": 700.0,
                "causes": [{"service": service, "operation": "x"}]}

    # One dated to the window the pause began in, one ten minutes before it.
    acc = score(plan, [spike(pause_s - pause_s % 10, "held"), spike(pause_s - 600, "calm")], float(plan.seconds))
    assert acc.false_by_reason == {"service pause": 1, "other": 1}, acc.false_spikes
