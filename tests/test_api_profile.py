"""The profile diff at spike time over the API and the CLI, on spikes and profiles seeded in storage (SQLite and
PostgreSQL): the culprit, the periods compared, the answer without profiles, and the refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy.exc import OperationalError

from harness.api_client import ApiClient
from harness.daemons import CollectorThread, collector_config
from spikehound import cli
from spikehound.collector.rest.app import build_app
from spikehound.collector.spike_profile import BASELINE_MIN_NS, GAP_NS, culprit_line, periods, spike_profile
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.model import Cause, CauseKind, Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.profiles import S, profiled_spike, seed, windows

T0 = 1_767_225_600 * S  # 2026-01-01T00:00:00Z


@pytest.fixture
def seeded(db_url: str) -> Iterator[CollectorThread]:
    """A collector on a database holding a profiled spike (sp-hot) and one without profiles (sp-bare)."""
    engine = make_engine(db_url)
    upgrade(engine)
    writer = Writer(engine)
    seed(writer, "sp-hot", T0)
    bare = profiled_spike("sp-bare", T0 + 7200 * S)
    writer.write(WriteBatch(spikes=[bare]))
    engine.dispose()
    with CollectorThread(collector_config(db_url)) as c:
        yield c


def test_the_profile_names_the_hot_function_of_the_top_causes_process(seeded: CollectorThread,
                                                                      capsys: pytest.CaptureFixture[str]):
    api = ApiClient(seeded.api)  # every answer is checked against the served document
    body = api.get_json("/api/v1/spikes/sp-hot/profile")
    assert body["spike_period"] == {"start": "2026-01-01T00:00:00Z", "end": "2026-01-01T00:02:00Z"}
    # Two minutes of spike: the baseline is the 5-minute floor, ending 30 s before the onset.
    assert body["baseline_period"] == {"start": "2025-12-31T23:54:50Z", "end": "2025-12-31T23:59:50Z"}
    (group,) = body["profiles"]
    assert (group["service"], group["host"], group["kind"]) == ("preprocess", "gpu-1", "cpu")
    assert group["processes"] == [{"pid": 4242, "process": "python3"}]
    # 12 windows of the spike; the 30 baseline windows whose middle lies in the 5 minutes before the gap.
    assert (group["samples_spike"], group["samples_baseline"]) == (628 * 12, 317 * 30)
    top = group["changes"][0]
    assert (top["function"], top["file"]) == ("burn_cpu", "stack.py")
    assert top["sentence"] == "burn_cpu in preprocess: 53% of samples during the spike against 6% before"
    assert group["culprit"] == top and group["why_unclear"] is None
    assert body["culprit"] == {"service": "preprocess", "host": "gpu-1", **top}
    assert body["reason"] is None
    assert len(group["changes"]) == 19 and len(api.get_json("/api/v1/spikes/sp-hot/profile",
                                                            limit=2)["profiles"][0]["changes"]) == 2
    # Every one of the 19 functions (the default shows 20).
    flame = group["flame"]
    assert flame["function"] == "all" and flame["spike"] == group["samples_spike"]
    node = flame
    while node["children"]:  # the widest path of the spike ends in burn_cpu
        node = node["children"][0]
    assert node["function"] == "burn_cpu" and node["spike"] == top["self_samples_spike"]

    assert cli.main(["spike", "sp-hot", "--api-url", seeded.api]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  Profile: preprocess on gpu-1 (cpu samples: 7536 during the spike, 9510 before):")
    assert lines[at + 1] == ("    1. burn_cpu in preprocess: 53% of samples during the spike against 6% before "
                             "(stack.py, 17.5x its samples a second)  <- culprit")
    assert lines[at + 2].startswith("  page ")  # no other function's own share grew: listed alone


def test_a_spike_without_profiles_says_why(seeded: CollectorThread, capsys: pytest.CaptureFixture[str]):
    body = ApiClient(seeded.api).get_json("/api/v1/spikes/sp-bare/profile")
    assert body["profiles"] == [] and body["culprit"] is None
    assert body["reason"] == ("no profiles of preprocess on gpu-1, gateway in the spike's windows: is the agent "
                              "profiling? see docs/profiles.md")
    assert cli.main(["spike", "sp-bare", "--api-url", seeded.api]) == 0
    assert f"  Profile: {body['reason']}" in capsys.readouterr().out.splitlines()


def test_unknown_spikes_and_bad_limits_are_refused(sqlite_collector: CollectorThread):
    api = ApiClient(sqlite_collector.api)
    assert api.get_json("/api/v1/spikes/nope/profile", expect=404) == {"error": "spike nope not found"}
    assert "limit" in api.get_json("/api/v1/spikes/nope/profile", expect=400, limit=0)["error"]


def test_a_database_away_is_answered_503_like_every_read():
    class Away(Reader):
        def __init__(self) -> None:
            pass

        def spike(self, spike_id: str) -> Spike | None:
            return profiled_spike(spike_id, T0)

        def profile_stacks(self, *args: Any, **kwargs: Any) -> Any:
            raise OperationalError("SELECT", {}, Exception("connection refused"))

        profile_rows = profile_stacks  # the diff's streamed read

    async def ask() -> tuple[int, Any, str | None]:
        app = build_app(Away(), CollectorTelemetry(), None, "", None)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            r = await client.get("/api/v1/spikes/sp1/profile")
            return r.status, await r.json(), r.headers.get("Retry-After")

    status, body, retry = asyncio.run(ask())
    assert status == 503 and body["error"].startswith("storage unavailable") and retry


def test_the_periods_leave_out_the_gap_and_the_windows_after_the_spike(engine: Any):
    writer = Writer(engine)
    spike = profiled_spike("sp", T0, minutes=1)
    start, end, b_start, b_end = periods(spike, now_ns=0)
    assert (end - start, b_end - b_start, start - b_end) == (60 * S, BASELINE_MIN_NS, GAP_NS)
    writer.write_profiles(windows("preprocess-before.folded", b_start, 30)  # the baseline, exactly
                          # the gap and the spike's last window after it: hot, yet in neither period
                          + windows("preprocess-spike.folded", b_end, 3) + windows("preprocess-spike.folded", end, 1)
                          + windows("preprocess-spike.folded", start, 6))
    (group,) = spike_profile(Reader(engine), spike).groups
    assert (group.diff.samples_spike, group.diff.samples_baseline) == (628 * 6, 317 * 30)
    assert culprit_line(Reader(engine), spike) == (
        "burn_cpu in preprocess: 53% of samples during the spike against 6% before (on gpu-1)")


def test_processes_are_read_in_the_causes_order_and_counted_once(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    spike = Spike(id="sp", service="gateway", operation="POST /v1/predict", state="open", start_unix_nano=T0,
                  end_unix_nano=None, p99_ns=1, baseline_p99_ns=1, causes=(
                      Cause(CauseKind.NETWORK, 0.6, "hop", service="model-server", operation="POST /infer",
                            peer_service="gateway"),
                      Cause(CauseKind.RESOURCE, 0.3, "cpu", host="gpu-1", resource="system.cpu.utilization")))
    Writer(engine).write_profiles(
        windows("preprocess-spike.folded", T0, 3, service="model-server", host="gpu-2")
        + windows("preprocess-spike.folded", T0, 3, service="preprocess", host="gpu-1")
        + windows("preprocess-spike.folded", T0, 1, service="model-server", host="gpu-1", pid=7)
        + windows("preprocess-spike.folded", T0, 2, service="gateway", host="gpu-3", pid=9))
    profile = spike_profile(Reader(engine), spike, now_ns=T0 + 30 * S)
    # The network cause's callee (both hosts, busiest first), its caller, then the resource cause's host
    # (model-server on gpu-1 already read, not counted twice).
    assert [(g.service, g.host) for g in profile.groups] == [
        ("model-server", "gpu-2"), ("model-server", "gpu-1"), ("gateway", "gpu-3"), ("preprocess", "gpu-1")]
    assert [g.diff.samples_spike for g in profile.groups] == [628 * 3, 628, 628 * 2, 628 * 3]
    assert profile.culprit is None  # no baseline anywhere
    assert all(g.diff.why_unclear == "only 0 samples before the spike (50 needed)" for g in profile.groups)
