"""`spikehound demo` (behind `make demo`) runs end to end and checks its own numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_short_demo_passes_its_own_checks():
    run = subprocess.run([sys.executable, "-m", "spikehound.cli", "demo", "--requests", "120", "--rate", "60"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "OK: all 120 requests are in the collector's latency windows" in run.stdout
    table = run.stdout.split("SERVICE", 1)[1]
    for service, operation in (("gateway", "POST /v1/predict"), ("model-server", "POST /infer"),
                               ("preprocess", "POST /preprocess")):
        line = next(row for row in table.splitlines() if row.startswith(service))
        assert operation in line and " 120 " in line
