"""The profile diff stays bounded whatever senders stored: deep, distinct stacks cost a diff a bounded amount of
memory (and say when the diff is partial), and diffs beyond the collector's cap are refused with Retry-After."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import Engine

from spikehound.collector.rest.app import build_app, openapi_document
from spikehound.collector.spike_profile import spike_profile
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.model import ProfileStack, Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.profiles import WINDOW_NS, S, profiled_spike, seed

T0 = 1_767_225_600 * S  # 2026-01-01T00:00:00Z
DEPTH = 256  # the deepest stack the collector stores
STACKS = 800  # distinct stacks stored, half in the spike's windows and half in its baseline's
# What one diff may allocate at its peak: the stacks' frames as tuples (as they were read before) take 40 MiB.
PEAK_BOUND = 16 * 1024 * 1024


def deep_stacks(spike: Spike, count: int) -> list[ProfileStack]:
    """``count`` distinct 256-frame stacks of one process with short names, spread over the spike's and its
    baseline's 10 s windows (what a sender holding the OTLP token may store)."""
    rng = random.Random(7)
    vocabulary = [(f"f{i}", "a.py", line) for i in range(900) for line in (10, 20)]
    spike_windows = [spike.start_unix_nano + i * WINDOW_NS for i in range(12)]
    base_windows = [spike.start_unix_nano - 310 * S + i * WINDOW_NS for i in range(30)]
    out = []
    for n in range(count):
        frames = tuple(rng.choices(vocabulary, k=DEPTH))
        ws = spike_windows if n % 2 else base_windows
        t = ws[n % len(ws)]
        out.append(ProfileStack(host="gpu-1", service="preprocess", pid=4242, process="python3",
                                start_unix_nano=t, end_unix_nano=t + WINDOW_NS, frames=frames, samples=3))
    return out


def test_a_diff_of_thousands_of_deep_stacks_allocates_a_bounded_amount(engine: Engine):
    writer = Writer(engine)
    spike = profiled_spike("sp-deep", T0)
    writer.write(WriteBatch(spikes=[spike]))
    stacks = deep_stacks(spike, STACKS)
    for at in range(0, len(stacks), 500):
        writer.write_profiles(stacks[at:at + 500])
    reader = Reader(engine)
    assert reader.spike("sp-deep") is not None  # the engine's pool and statement caches, outside the measure
    tracemalloc.start()
    try:
        profile = spike_profile(reader, spike)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND, f"one diff allocated {peak / 2**20:.0f} MiB at its peak"
    (group,) = profile.groups
    # Every stored sample is counted (the stacks are within the default bounds) and the tree is drawable.
    assert (group.diff.samples_spike, group.diff.samples_baseline) == (3 * STACKS // 2, 3 * STACKS // 2)
    assert group.diff.tree.spike == 3 * STACKS // 2


def test_a_diff_cut_at_its_bounds_says_it_is_partial(engine: Engine):
    writer = Writer(engine)
    spike = profiled_spike("sp-cut", T0)
    writer.write(WriteBatch(spikes=[spike]))
    writer.write_profiles(deep_stacks(spike, 200))
    from spikehound.collector.spike_profile import DiffBounds, profile_json

    profile = spike_profile(Reader(engine), spike, bounds=DiffBounds(stacks=50))
    body = profile_json(profile)
    assert body["partial"] == ("the diff counted 50 distinct stacks, its limit, and left out 150 rows of others: "
                               "the shares are of what was read")
    (group,) = body["profiles"]
    assert group["samples_spike"] + group["samples_baseline"] == 3 * 50
    frames = spike_profile(Reader(engine), spike, bounds=DiffBounds(frames=10 * DEPTH)).partial
    assert frames is not None and frames.startswith(f"the diff read {10 * DEPTH} frames")
    assert spike_profile(Reader(engine), spike).partial is None


class _SlowReader(Reader):
    """A reader whose profile reads wait until the test lets them go: diffs held in flight."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.go = threading.Event()

    def profile_stacks(self, *args: Any, **kwargs: Any) -> Any:  # the read a diff made before it streamed
        self.go.wait(30)
        return super().profile_stacks(*args, **kwargs)

    def profile_rows(self, *args: Any, **kwargs: Any) -> Any:
        self.go.wait(30)
        return super().profile_rows(*args, **kwargs)


@pytest.fixture
def slow_reader(tmp_path: Path) -> Iterator[_SlowReader]:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    seed(Writer(engine), "sp-hot", T0)
    reader = _SlowReader(engine)
    yield reader
    reader.go.set()
    engine.dispose()


def test_diffs_beyond_the_cap_are_refused_with_retry_after_not_5xx(slow_reader: _SlowReader):
    telemetry = CollectorTelemetry()

    async def ask() -> tuple[list[tuple[int, str | None]], str]:
        app = build_app(slow_reader, telemetry, None, "", None)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            async def one() -> tuple[int, str | None]:
                r = await client.get("/api/v1/spikes/sp-hot/profile")
                await r.read()
                return r.status, r.headers.get("Retry-After")

            tasks = [asyncio.create_task(one()) for _ in range(6)]
            deadline = time.monotonic() + 5
            while sum(t.done() for t in tasks) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            # The spike page while the diffs are held: shown, without its profile, saying why.
            try:
                page = await client.get("/ui/spikes/sp-hot", timeout=aiohttp.ClientTimeout(total=5))
                html = await page.text() if page.status == 200 else ""
            except TimeoutError:
                html = ""
            slow_reader.go.set()
            return list(await asyncio.gather(*tasks)), html

    answers, page = asyncio.run(ask())
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200, 200, 429, 429, 429, 429], statuses
    assert all(retry is not None and int(retry) >= 1 for status, retry in answers if status == 429)
    assert telemetry.registry.get_sample_value("spikehound_profile_diffs_refused_total", {"surface": "api"}) == 4
    assert "The profile diff was not computed" in page
    assert telemetry.registry.get_sample_value("spikehound_profile_diffs_refused_total", {"surface": "page"}) == 1
    responses = openapi_document()["paths"]["/api/v1/spikes/{spike_id}/profile"]["get"]["responses"]
    assert "429" in responses


def test_the_alert_line_rests_on_a_whole_diff_only(tmp_path: Path):
    from spikehound.collector.spike_profile import ALERT_BOUNDS, DiffBounds, culprit_line

    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    spike = seed(Writer(engine), "sp-hot", T0)
    reader = Reader(engine)
    assert culprit_line(reader, spike, bounds=ALERT_BOUNDS) == (
        "burn_cpu in preprocess: 53% of samples during the spike against 6% before (on gpu-1)")
    # The same spike's diff cut at its bounds, or out of its time: no line rather than one from part of it.
    assert culprit_line(reader, spike, bounds=DiffBounds(frames=20)) is None
    assert culprit_line(reader, spike, bounds=DiffBounds(seconds=0)) is None
    engine.dispose()


def test_a_diff_of_many_processes_lists_the_busiest_and_counts_the_rest(engine: Engine):
    """Thousands of distinct processes of one service (pids and names are the sender's to choose): the answer
    lists a bounded number of them, the busiest, and says how many it left out."""
    from spikehound.collector.spike_profile import profile_json

    writer = Writer(engine)
    spike = profiled_spike("sp-procs", T0)
    writer.write(WriteBatch(spikes=[spike]))
    frames = (("main", "m.py", 1), ("work", "m.py", 2))
    rows = []
    for side, first in ((0, spike.start_unix_nano), (1, spike.start_unix_nano - 310 * S)):
        for k in range(2000):
            t = first + (k % 12) * WINDOW_NS
            rows.append(ProfileStack(host="gpu-1", service="preprocess", pid=side * 10_000 + k,
                                     process=f"p{k:05d}" + "P" * 200, start_unix_nano=t, end_unix_nano=t + WINDOW_NS,
                                     frames=frames, samples=50 if k < 10 else 1))
    for at in range(0, len(rows), 1000):
        writer.write_profiles(rows[at:at + 1000])
    body = profile_json(spike_profile(Reader(engine), spike))
    (group,) = body["profiles"]
    listed = {p["pid"] for p in group["processes"]}
    assert len(listed) <= 100
    assert set(range(10)) <= listed  # the busiest during the spike are among those listed
    assert group["processes_omitted"] == 4000 - len(listed)
    assert group["samples_spike"] == 10 * 50 + 1990  # every process's samples still count
    schema = openapi_document()["components"]["schemas"]["ProcessProfile"]
    assert "processes_omitted" in schema["properties"]


def test_long_function_names_hold_a_bounded_amount_of_memory(engine: Engine):
    """Distinct functions with long names and files: the diff stops taking functions at a budget of characters,
    says so, and allocates a bounded amount whatever was stored."""
    writer = Writer(engine)
    spike = profiled_spike("sp-names", T0)
    writer.write(WriteBatch(spikes=[spike]))
    stacks, fid = [], 0
    for n in range(1200):  # 12,000 distinct functions of 2,000 characters: 24 MB of names
        frames = []
        for _ in range(10):
            frames.append((f"fn{fid:06d}" + "N" * 992, f"/f{fid:06d}" + "F" * 989 + ".py", 1))
            fid += 1
        t = (spike.start_unix_nano + (n % 12) * WINDOW_NS if n % 2
             else spike.start_unix_nano - 310 * S + (n % 30) * WINDOW_NS)
        stacks.append(ProfileStack(host="gpu-1", service="preprocess", pid=4242, process="python3",
                                   start_unix_nano=t, end_unix_nano=t + WINDOW_NS, frames=tuple(frames), samples=3))
    for at in range(0, len(stacks), 200):
        writer.write_profiles(stacks[at:at + 200])
    reader = Reader(engine)
    assert reader.spike("sp-names") is not None
    tracemalloc.start()
    try:
        profile = spike_profile(reader, spike)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert profile.partial is not None and "characters of function names and files" in profile.partial
    assert peak < PEAK_BOUND, f"one diff allocated {peak / 2**20:.0f} MiB at its peak"
    from spikehound.collector.spike_profile import ALERT_BOUNDS

    alert = spike_profile(reader, spike, bounds=ALERT_BOUNDS)
    assert alert.partial is not None and "characters of function names and files" in alert.partial
