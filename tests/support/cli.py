"""The spikehound command as a user runs it, in a child process, and the times it takes on its command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

NS = 1_000_000_000


def spikehound(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``spikehound ARGS`` from this environment, without the SPIKEHOUND_ settings of the test run."""
    exe = shutil.which("spikehound", path=str(Path(sys.executable).parent)) or "spikehound"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEHOUND_")}
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env)


def unix(ns: int) -> str:
    """Unix seconds with every nanosecond (a float would round them)."""
    return f"{ns // NS}.{ns % NS:09d}"
