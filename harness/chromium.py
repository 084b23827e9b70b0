"""The browser that the web page tests and the page benchmark drive: Debian's Chromium, as this machine runs it."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# As root there is no sandbox; without the background-networking flags Chromium keeps calling home, which
# this machine's closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
