"""How fast the spike page loads when its slowest request is a 2,000-span trace: Chromium, loopback, real collector.

Run from the repository root: ``python -m benchmarks.web_page`` (``make bench``).

Setup
-----
A ``spikehound collector`` child process on SQLite in a temporary directory
receives the ``gpu_drop`` scenario of ``harness/scenarios/traffic.py`` (five minutes, the
GPU of gpu-2 slowing down at 212 s) as OTLP/HTTP requests, plus one extra request
in the spike's first window: a 2,000-span trace (an LLM-style request whose
forward pass is a thousand decode steps with a sampling span each) that is the
slowest request of the spike, so the spike page draws it as the slow exemplar
beside a normal one. The benchmark checks that the spike's first exemplar is that
trace and that the API serves its 2,000 spans.

What is measured (median and worst of ``--runs``, each in a fresh browser context,
so nothing is cached)
-------------------------------------------------------------------------------
1. **Spike page, in the browser** -- Debian's Chromium (Playwright) opens
   ``/ui/spikes/{id}`` and waits until the page's script has placed every
   waterfall bar and drawn every chart (its ``spikehound-ready`` performance
   mark): that time from navigation start is the load time a person waits. Also
   first contentful paint, the bytes transferred and the page's element count,
   and the same time on a second visit (scripts and styles cached).
2. **Reference, same browser, same run** -- the login page (``/ui/login``): the
   same style sheet, script and chart library, no data. The difference is what
   the spike's data costs.
3. **Server side** -- the spike page's HTML fetched with ``Accept-Encoding:
   gzip`` (render time, and bytes before and after compression), beside the
   API's JSON of the same trace (``/api/v1/traces/{id}``) as a reference for
   reading and serialising the 2,000 spans alone.

This is a measurement, not a test: it exits 0 whatever the times, and non-zero
only when the benchmark itself failed (no spike, a wrong exemplar, no browser
when ``--require-browser`` is given).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness.chromium import CHROMIUM, CHROMIUM_ARGS
from harness.daemons import CollectorProcess
from harness.scenario_io import scenario_requests, send
from harness.scenarios.long_trace import long_trace
from harness.scenarios.traffic import Scenario
from spikehound.otlp import encode_spans
from spikehound.units import MS, NS

SCENARIO = {"name": "gpu_drop", "strength": "large", "seed": 3, "minutes": 5, "onset_s": 212.0, "fault_s": 60.0}
INJECT_AT_S = 216  # inside the spike's first window, [210 s, 220 s)


def build(collector: CollectorProcess, spans: int) -> tuple[dict[str, Any], str]:
    """Send the scenario with the long trace; the spike whose slowest exemplar it is, and the trace id."""
    sc = Scenario(SCENARIO["name"], SCENARIO["strength"], seed=SCENARIO["seed"], minutes=SCENARIO["minutes"],
                  onset_s=SCENARIO["onset_s"], fault_s=SCENARIO["fault_s"])
    bodies = scenario_requests(sc)
    trace_id = bytes.fromhex("5b1e" * 8)
    trace = long_trace(trace_id, sc.start_ns + INJECT_AT_S * NS - 600 * MS, spans)
    cut = 2 * (INJECT_AT_S + 1)  # every second of the scenario is two requests: spans, then samples
    send(collector.http_endpoint, bodies[:cut])
    send(collector.http_endpoint, [("traces", encode_spans(trace).SerializeToString())])
    send(collector.http_endpoint, bodies[cut:])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        spikes = _get_json(f"{collector.api}/api/v1/spikes")["spikes"]
        done = [s for s in spikes if s["service"] == "gateway" and s["state"] == "resolved"]
        if done:
            return done[0], trace_id.hex()
        time.sleep(0.5)
    raise SystemExit(f"no resolved spike on the gateway: {collector.log_tail()}")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def fetch(url: str) -> tuple[float, int, int]:
    """(seconds, bytes on the wire, bytes decoded) of one GET asking for gzip."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        wire = response.read()
        encoded = response.headers.get("Content-Encoding") == "gzip"
    seconds = time.perf_counter() - t0
    return seconds, len(wire), len(gzip.decompress(wire) if encoded else wire)


PAGE_FIGURES = """() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const ready = performance.getEntriesByName("spikehound-ready")[0];
  const paint = performance.getEntriesByName("first-contentful-paint")[0];
  const bytes = performance.getEntriesByType("resource").reduce((n, r) => n + r.transferSize, nav.transferSize);
  return {ready_ms: ready ? ready.startTime : null, fcp_ms: paint ? paint.startTime : null,
          html_ms: nav.responseEnd, bytes: bytes, elements: document.getElementsByTagName("*").length};
}"""


def browser_runs(url: str, runs: int, *, warm: bool = False) -> list[dict[str, Any]]:
    """Page figures of ``runs`` loads: each in a fresh context (cold), or all in one whose cache holds the
    scripts and styles from a first, uncounted load (warm: a second visit)."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = None
            for i in range(runs + warm):
                if context is None or not warm:
                    context = browser.new_context(viewport={"width": 1400, "height": 900})
                page = context.new_page()
                page.goto(url)
                page.wait_for_selector("html[data-ready='1']", timeout=60_000)
                page.wait_for_timeout(50)  # first-contentful-paint is recorded after the frame
                if not (warm and i == 0):
                    out.append(page.evaluate(PAGE_FIGURES))
                page.close()
                if not warm:
                    context.close()
        finally:
            browser.close()
    return out


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} {max(values):8.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="page loads per measurement (default 7)")
    parser.add_argument("--spans", type=int, default=2000, help="spans of the slow exemplar trace (default 2000)")
    parser.add_argument("--require-browser", action="store_true", help="fail when Chromium is missing")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="spikehound-bench-web-") as tmp:
        collector = CollectorProcess(f"sqlite:///{Path(tmp) / 'bench.db'}", Path(tmp))
        collector.start()
        try:
            t0 = time.perf_counter()
            spike, trace_id = build(collector, args.spans)
            built_s = time.perf_counter() - t0
            if spike["exemplar_trace_ids"][:1] != [trace_id]:
                raise SystemExit(f"the spike's slowest exemplar is {spike['exemplar_trace_ids']}, not {trace_id}")
            served = len(_get_json(f"{collector.api}/api/v1/traces/{trace_id}")["spans"])
            if served != args.spans:
                raise SystemExit(f"the API serves {served} spans of the long trace, not {args.spans}")
            page_url = f"{collector.api}/ui/spikes/{spike['id']}"
            fetch(page_url)  # the first read warms SQLite's page cache, as any later visit finds it
            load_before = round(os.getloadavg()[0], 2)
            html = [fetch(page_url) for _ in range(args.runs)]
            api = [fetch(f"{collector.api}/api/v1/traces/{trace_id}") for _ in range(args.runs)]
            result: dict[str, Any] = {
                "spans": args.spans, "runs": args.runs, "scenario_seconds": round(built_s, 1),
                "html_ms": [round(h[0] * 1000, 1) for h in html], "html_bytes": html[0][2],
                "html_gzip_bytes": html[0][1], "api_trace_ms": [round(a[0] * 1000, 1) for a in api],
                "api_trace_bytes": api[0][2], "api_trace_gzip_bytes": api[0][1], "browser": None}
            if CHROMIUM.exists():
                result["browser"] = {"spike": browser_runs(page_url, args.runs),
                                     "spike_warm": browser_runs(page_url, args.runs, warm=True),
                                     "reference_login": browser_runs(f"{collector.api}/ui/login", args.runs)}
            elif args.require_browser:
                raise SystemExit(f"{CHROMIUM} is missing (tests/apt-install.sh installs it)")
            result["load_before"], result["load_after"] = load_before, round(os.getloadavg()[0], 2)
        finally:
            collector.kill()
    report(result, args.json)
    return 0


def report(r: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(r))
        return
    print(f"spike page with a {r['spans']}-span slow exemplar; {r['runs']} runs each; "
          f"scenario sent and judged in {r['scenario_seconds']} s; load average {r['load_before']} before the "
          f"page loads, {r['load_after']} after ({os.cpu_count()} cores: other work slows every figure alike)")
    print(f"{'':48} {'median':>8} {'worst':>8}")
    b = r["browser"]
    if b:
        spike, ref = b["spike"], b["reference_login"]
        print(f"{'browser: spike page ready (charts drawn), cold, ms':48} {summary([x['ready_ms'] for x in spike])}")
        print(f"{'browser: spike page first contentful paint, ms':48} {summary([x['fcp_ms'] for x in spike])}")
        print(f"{'browser: spike page ready, second visit, ms':48} "
              f"{summary([x['ready_ms'] for x in b['spike_warm']])}")
        print(f"{'browser: reference, login page ready, ms':48} {summary([x['ready_ms'] for x in ref])}")
        print(f"{'browser: spike page transferred, kB':48} {spike[0]['bytes'] / 1000:8.1f}"
              f"   ({spike[0]['elements']} elements; reference {ref[0]['bytes'] / 1000:.1f} kB)")
        verdict = statistics.median(x["ready_ms"] for x in spike) < 1000 and max(x["ready_ms"] for x in spike) < 1000
        print(f"under 1 s on loopback: {'yes' if verdict else 'NO'}")
    else:
        print("browser: skipped, /usr/bin/chromium is missing (tests/apt-install.sh installs it)")
    print(f"{'server: spike page HTML, ms':48} {summary(r['html_ms'])}"
          f"   ({r['html_bytes'] / 1000:.0f} kB, {r['html_gzip_bytes'] / 1000:.0f} kB gzip)")
    print(f"{'server: reference, API JSON of the same trace, ms':48} {summary(r['api_trace_ms'])}"
          f"   ({r['api_trace_bytes'] / 1000:.0f} kB, {r['api_trace_gzip_bytes'] / 1000:.0f} kB gzip)")


if __name__ == "__main__":
    sys.exit(main())
