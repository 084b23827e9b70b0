"""The web pages in a real browser: Debian's Chromium driven by Playwright, against a real collector.

The data are real spikes from injected faults (``tests/support/web_scenarios.py``). The
spike page's screenshot is kept as a test artifact in ``build/test-artifacts/``
(or ``$SPIKEHOUND_TEST_ARTIFACTS``). ``make test`` installs Chromium when it is
missing (``tests/apt-install.sh``); without it these tests skip and say why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.chromium import CHROMIUM, CHROMIUM_ARGS
from harness.daemons import CollectorThread, collector_config
from spikehound.model import ProfileStack
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.writer import Writer
from tests.support.profiles import S, seed
from tests.support.web_scenarios import (
    EVIL_ATTRIBUTE,
    EVIL_SERVICE,
    EVIL_SPAN,
    SpikeData,
    collector_on_copy,
    spike_database,
)

playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="playwright is not installed (pip install -e '.[dev]')")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: Debian's chromium package "
                                 "is not installed (make test installs it with tests/apt-install.sh, as root)")]
ARTIFACTS = Path(os.environ.get("SPIKEHOUND_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "build"
                                / "test-artifacts"))
TOKEN = "browser-secret-3"


@pytest.fixture(scope="module")
def data() -> SpikeData:
    return spike_database()


@pytest.fixture(scope="module")
def site(data: SpikeData, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorThread]:
    with collector_on_copy(data, tmp_path_factory.mktemp("browser")) as collector:
        yield collector


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page with everything it reports: dialogs (alert), uncaught errors and console messages."""

    def __init__(self, browser: Any, width: int = 1400, height: int = 900) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.console: list[str] = []
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))

    def open(self, url: str) -> Any:
        self.page.goto(url)
        self.page.wait_for_selector("html[data-ready='1']")
        return self.page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    w = Watched(browser)
    yield w
    w.close()


def test_from_the_overview_to_the_spike_and_its_evidence(site: CollectorThread, data: SpikeData, watched: Watched):
    spike = data.gpu_spike
    page = watched.open(f"{site.api}/ui/")
    # The gpu_drop spike: its row in the recently resolved list names the GPU, and its start links to the page.
    row = page.locator("table.spikes tr", has_text="GPU utilization (GPU-2) fell").filter(has_text="POST /v1/predict")
    row.get_by_role("link", name="2026-01-01 00:03:30 UTC").click()
    page.wait_for_selector("html[data-ready='1']")
    assert page.url.endswith(f"/ui/spikes/{spike['id']}")

    # The answer at a glance, and the ranked causes with their numbers.
    top = spike["causes"][0]
    assert page.locator(".verdict p").inner_text() == top["summary"]
    assert page.locator(".causes li").count() == len(spike["causes"])
    first = page.locator("#cause-1")
    assert "70% normally → 24%" in first.inner_text()

    # The spike window is shaded on the latency chart, over a real width.
    window = page.locator("#latency .spike-window")
    box = window.bounding_box()
    assert box and box["width"] > 20 and window.is_visible()

    # The slowest request's critical path, with the forward pass marked as grown and named by a cause.
    slow = page.locator("#s-waterfall")
    path_rows = slow.locator(".row.cp")
    assert path_rows.count() >= 5
    forward = slow.locator(".row.cp.grown", has_text="forward")
    assert forward.count() == 1 and "+" in forward.locator(".grew").inner_text()
    assert page.locator("#n-waterfall .row.cp").count() >= 5  # and the normal one beside it

    # The top cause links to the GPU chart of gpu-2, which is on the page.
    first.get_by_role("link", name="GPU utilization on gpu-2").click()
    target = page.url.rsplit("#", 1)[1]
    assert "GPU utilization" in page.locator(f"#{target} figcaption").inner_text()
    assert page.locator(f"#{target}").evaluate("e => e.matches(':target')")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.goto(f"{site.api}/ui/spikes/{spike['id']}")
    page.wait_for_selector("html[data-ready='1']")
    page.screenshot(path=str(ARTIFACTS / "spike-page.png"), full_page=True)
    assert (ARTIFACTS / "spike-page.png").stat().st_size > 50_000
    assert watched.errors == [] and watched.dialogs == []
    assert [m for m in watched.console if m.startswith("error")] == []


def test_the_resource_charts_share_the_latency_charts_time_axis(site: CollectorThread, data: SpikeData,
                                                                 watched: Watched):
    page = watched.open(f"{site.api}/ui/spikes/{data.gpu_spike['id']}")
    scales = page.evaluate("window.spikehound.charts.map(c => [c.root.parentNode.dataset.panel, "
                           "c.scales.x.min, c.scales.x.max, c.bbox.left, c.bbox.width])")
    assert len(scales) >= 3 and scales[0][0] == "latency"
    titles = page.locator(".chart-box figcaption").all_inner_texts()
    assert any(t.startswith("GPU utilization") for t in titles) and any(t.startswith("CPU") for t in titles)
    for panel, low, high, left, width in scales[1:]:
        assert (low, high) == (scales[0][1], scales[0][2]), panel  # the same time range
        assert (left, width) == (scales[0][3], scales[0][4]), panel  # drawn over the same pixels
    # So the spike's shaded window sits at the same place on every chart.
    boxes = [b.bounding_box() for b in page.locator(".spike-window").all()]
    assert len(boxes) == len(scales)
    for b in boxes[1:]:
        assert abs(b["x"] - boxes[0]["x"]) <= 1 and abs(b["width"] - boxes[0]["width"]) <= 1

    # Zooming one chart (drag across the spike) zooms them all; a double-click goes back.
    over = page.locator("#latency .u-over").bounding_box()
    page.mouse.move(boxes[0]["x"] - 40, over["y"] + 20)
    page.mouse.down()
    page.mouse.move(boxes[0]["x"] + boxes[0]["width"] + 40, over["y"] + 20, steps=5)
    page.mouse.up()
    zoomed = page.evaluate("window.spikehound.charts.map(c => [c.scales.x.min, c.scales.x.max])")
    assert zoomed[0][1] - zoomed[0][0] < (scales[0][2] - scales[0][1]) / 3
    assert all(z == zoomed[0] for z in zoomed)
    page.locator("#latency .u-over").dblclick()
    assert page.evaluate("window.spikehound.charts.map(c => [c.scales.x.min, c.scales.x.max])")[1] == \
        [scales[0][1], scales[0][2]]


def test_markup_from_senders_shows_as_text_and_runs_nothing(site: CollectorThread, data: SpikeData,
                                                            watched: Watched):
    spike = data.hostile_spike
    trace_id = spike["exemplar_trace_ids"][0]
    for path in ("/ui/", "/ui/spikes", f"/ui/spikes/{spike['id']}", f"/ui/traces/{trace_id}"):
        page = watched.open(site.api + path)
        if path.startswith("/ui/traces/"):  # open the hostile span to show its attributes
            page.locator("summary", has_text=EVIL_SPAN).first.click()
            assert page.get_by_text(EVIL_ATTRIBUTE).first.is_visible()
        shown = EVIL_SERVICE if path == "/ui/" else EVIL_SPAN
        assert page.get_by_text(shown).first.is_visible(), f"{path} does not show {shown!r} as text"
        # Nothing the senders wrote became an element: no image, no svg, no script of theirs.
        assert page.locator("img, svg, main script:not(#chart-data)").count() == 0, path
        assert page.evaluate("[...document.scripts].every(s => s.src ? s.src.includes('/ui/static/') "
                             ": s.type === 'application/json')")
    page = watched.open(f"{site.api}/ui/spikes/{spike['id']}")
    assert EVIL_SPAN in page.locator(".verdict p").inner_text()
    page.wait_for_timeout(300)  # an onerror or onload would have fired by now
    assert watched.dialogs == [], "a script from the data ran"
    assert watched.errors == []
    # Had any markup become an element, the Content-Security-Policy would have refused its inline handler and
    # said so on the console; escaping left nothing for it to refuse.
    assert [m for m in watched.console if "Content Security Policy" in m] == []


def test_a_narrow_window_gets_one_column_and_no_sideways_scrolling(site: CollectorThread, data: SpikeData,
                                                                   browser: Any):
    narrow = Watched(browser, width=400, height=800)
    try:
        page = narrow.open(f"{site.api}/ui/spikes/{data.gpu_spike['id']}")
        assert page.evaluate("document.documentElement.scrollWidth") <= 400
        widths = page.evaluate("window.spikehound.charts.map(c => c.width)")
        assert widths and all(200 <= w <= 400 for w in widths)
        slow, normal = (page.locator(f"#{w}-waterfall").bounding_box() for w in ("s", "n"))
        assert normal["y"] > slow["y"] + slow["height"] - 1  # stacked, not side by side
        page.screenshot(path=str(ARTIFACTS / "spike-page-narrow.png"), full_page=True)
        page = narrow.open(f"{site.api}/ui/")
        assert page.evaluate("document.documentElement.scrollWidth") <= 400
        assert narrow.errors == []
    finally:
        narrow.close()


def test_with_a_token_the_browser_logs_in_once(data: SpikeData, browser: Any, tmp_path: Path):
    with collector_on_copy(data, tmp_path, collector__api_token=TOKEN) as guarded:
        w = Watched(browser)
        try:
            page = w.page
            page.goto(f"{guarded.api}/ui/spikes/{data.gpu_spike['id']}")
            assert page.locator("input[name=token]").is_visible()
            page.fill("input[name=token]", TOKEN)
            page.get_by_role("button", name="Log in").click()
            page.wait_for_selector("html[data-ready='1'] .verdict")
            assert page.url.endswith(f"/ui/spikes/{data.gpu_spike['id']}")
            assert page.evaluate("document.cookie") == ""  # HttpOnly: no script can read the session
            page.goto(f"{guarded.api}/ui/spikes")  # the session carries on
            assert page.locator("table.spikes").is_visible()
        finally:
            w.close()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorThread]:
    """A collector holding spike sp-hot, whose top cause's process (preprocess on gpu-1) burns CPU in burn_cpu
    during it (tests/fixtures/profiles/), and a function named with markup by a hostile process."""
    url = f"sqlite:///{tmp_path_factory.mktemp('profiled') / 'spikehound.db'}"
    engine = make_engine(url)
    upgrade(engine)
    start = 1_767_225_600 * S
    seed(Writer(engine), "sp-hot", start)
    Writer(engine).write_profiles([ProfileStack(
        host="gpu-1", service="preprocess", pid=4243, process="python3", start_unix_nano=start,
        end_unix_nano=start + 10 * S, frames=(("<module>", "stack.py", 1), (EVIL_SPAN, EVIL_ATTRIBUTE, 7)),
        samples=40)])
    engine.dispose()
    with CollectorThread(collector_config(url)) as collector:
        yield collector


def test_the_profile_section_names_the_hot_function_first_and_draws_its_box(profiled: CollectorThread,
                                                                           watched: Watched):
    page = watched.open(f"{profiled.api}/ui/spikes/sp-hot")
    section = page.locator("section.profile")
    assert section.locator("h3").first.inner_text().startswith("preprocess on gpu-1")
    assert section.locator("p.culprit strong").inner_text() == "burn_cpu"
    first = section.locator("table.profile tbody tr").first
    assert first.locator("td").first.inner_text() == "burn_cpu"
    assert "culprit" in (first.get_attribute("class") or "")
    # The flame graph: a box for burn_cpu about half as wide as the whole (53% of the spike's samples), red.
    flame = section.locator(".flame").first
    whole = flame.bounding_box()
    boxes = flame.locator(".fbox[data-function='burn_cpu']")
    assert boxes.count() == 1 and boxes.first.is_visible()
    box = boxes.first.bounding_box()
    assert whole and box and 0.45 * whole["width"] < box["width"] < 0.6 * whole["width"]
    red, _, blue = (int(x) for x in boxes.first.evaluate("e => getComputedStyle(e).backgroundColor")
                    .removeprefix("rgb(").removesuffix(")").split(","))
    assert red > blue
    assert "53% of samples during the spike" in (boxes.first.get_attribute("title") or "")
    root = flame.locator(".fbox[data-function='all']").bounding_box()
    assert root and abs(root["width"] - whole["width"]) <= 1
    # The hostile process's function shows as text in the table and the graph, and ran nothing.
    assert section.get_by_text(EVIL_SPAN).first.is_visible()
    assert flame.locator(".fbox", has_text=EVIL_SPAN).count() == 1
    assert page.locator("img, svg").count() == 0
    page.wait_for_timeout(300)
    assert watched.dialogs == [] and watched.errors == []
    assert [m for m in watched.console if m.startswith("error")] == []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "spike-page-profile.png"), full_page=True)
