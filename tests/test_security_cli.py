"""`spikehound spikes` and `spikehound spike` print names that any OTLP sender chose: terminal escapes in them
are shown, never obeyed. A real HTTP server answers the CLI with the API's shapes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from spikehound import cli

# Clear the screen, retitle the window, hide the rest (CSI 8m), a C1 CSI, carriage return and backspaces that
# overwrite what was printed, a bidirectional override.
HOSTILE_SERVICE = "gate\x1b[2J\x1b]0;owned\x07way"
HOSTILE_OPERATION = "POST /v1\x1b[8m secret\x0d\x08\x08\x9b31m"
HOSTILE_SUMMARY = "Span \u202etxt.exe\u202c was slow\nFAKE: all clear"
SPIKE = {"id": "sp\x1b[1m1", "service": HOSTILE_SERVICE, "operation": HOSTILE_OPERATION, "state": "open",
         "start": "2026-01-01T00:00:00Z", "end": None, "p99_ms": 250.0, "baseline_p99_ms": 40.0,
         "causes": [{"kind": "span", "service": HOSTILE_SERVICE, "operation": HOSTILE_OPERATION, "peer_service": None,
                     "host": None, "resource": None, "score": 0.8, "baseline": 2.0, "observed": 172.0, "unit": "ms",
                     "summary": HOSTILE_SUMMARY}],
         "exemplar_trace_ids": ["0af7651916cd43dd8448eb211c80319c"]}
HOSTILE_FUNCTION = "burn\x1b]0;owned\x07_cpu"
CHANGE = {"function": HOSTILE_FUNCTION, "file": "stack.py\x1b[2J", "self_spike": 0.53, "self_baseline": 0.06,
          "total_spike": 0.53, "total_baseline": 0.06, "samples_spike": 332, "samples_baseline": 19,
          "self_samples_spike": 332, "self_samples_baseline": 19,
          "sentence": f"{HOSTILE_FUNCTION} in {HOSTILE_SERVICE}: 53% of samples during the spike against 6% before"}
PROFILE = {"spike_id": SPIKE["id"], "culprit": None, "reason": None, "profiles": [
    {"service": HOSTILE_SERVICE, "host": "gpu-1", "kind": "cpu", "processes": [], "samples_spike": 628,
     "samples_baseline": 317, "culprit": CHANGE, "why_unclear": None, "changes": [CHANGE], "flame": {}}]}
UNPRINTABLE = [chr(c) for c in (*range(0x20), *range(0x7f, 0xa0))] + ["\u202e", "\u202c"]


class _Api(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/api/v1/spikes/") and "/profile" in self.path:
            status, body = 200, PROFILE
        elif self.path.startswith("/api/v1/spikes/"):
            status, body = 200, SPIKE
        elif self.path.startswith("/api/v1/spikes"):
            status, body = 200, {"spikes": [SPIKE]}
        else:  # raw, as a hostile proxy in front of the API could answer: OSC 52 writes the clipboard
            status, body = 404, "no spike \x1b]52;c;cm0gLXJmIH4=\x07 here"
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def printed_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    out = capsys.readouterr()
    text = out.out + out.err
    assert not [ch for ch in UNPRINTABLE if ch in text.replace("\n", "")], repr(text)
    return text.splitlines()


def test_spike_shows_escapes_instead_of_obeying_them(api: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["spike", "sp1", "--api-url", api]) == 0
    lines = printed_lines(capsys)
    assert lines[0] == (r"spike sp\x1b[1m1 (open) on gate\x1b[2J\x1b]0;owned\x07way "
                        r"POST /v1\x1b[8m secret\x0d\x08\x08\x9b31m")
    assert lines[2] == (r"  1. [span] Span \u202etxt.exe\u202c was slow\x0aFAKE: all clear "
                        r"(explains 80% of the added latency)")
    assert lines[3] == (r"  Profile: gate\x1b[2J\x1b]0;owned\x07way on gpu-1 (cpu samples: 628 during the spike, "
                        r"317 before):")
    assert lines[4] == (r"    1. burn\x1b]0;owned\x07_cpu in gate\x1b[2J\x1b]0;owned\x07way: 53% of samples during the "
                        r"spike against 6% before (stack.py\x1b[2J)  <- culprit")
    assert len(lines) == 7  # the summary's newline did not make a line of its own


def test_spikes_table_shows_escapes_instead_of_obeying_them(api: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["spikes", "--api-url", api]) == 0
    header, row = printed_lines(capsys)
    assert header.startswith("ID") and r"gate\x1b[2J\x1b]0;owned\x07way" in row and r"slow\x0aFAKE" in row


def test_an_error_from_the_api_is_shown_not_obeyed(api: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["spikes", "--api-url", api + "/nowhere"]) == 1
    (line,) = printed_lines(capsys)
    assert r"\x1b]52;c;cm0gLXJmIH4=\x07" in line
