"""Recorded profiles for the profile-diff tests: py-spy's folded stacks (``tests/fixtures/profiles/``) as the
``ProfileStack`` windows an agent sends, and a spike whose causes name the profiled process."""

from __future__ import annotations

import re
from pathlib import Path

from spikehound.model import Cause, CauseKind, Frame, ProfileStack, Spike
from spikehound.storage.writer import WriteBatch, Writer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
S = 1_000_000_000
WINDOW_NS = 10 * S  # the agent's profile window
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>[0-9]+)\)$")


def folded(name: str) -> list[tuple[tuple[Frame, ...], int]]:
    """The stacks of a folded file (``frame;frame;... count``, root first, py-spy's ``--format raw``)."""
    out = []
    for line in (FIXTURES / name).read_text().splitlines():
        if not line.strip():
            continue
        text, count = line.rsplit(" ", 1)
        frames = []
        for part in text.split(";"):
            m = _FRAME.match(part)
            assert m, part
            frames.append((m["function"], m["file"], int(m["line"])))
        out.append((tuple(frames), int(count)))
    return out


def windows(name: str, start_ns: int, count: int, *, service: str = "preprocess", host: str = "gpu-1",
            pid: int = 4242, kind: str = "cpu") -> list[ProfileStack]:
    """``count`` consecutive 10 s windows from ``start_ns``, each holding the file's stacks."""
    stacks = folded(name)
    return [ProfileStack(host=host, service=service, pid=pid, process="python3", start_unix_nano=t,
                         end_unix_nano=t + WINDOW_NS, frames=frames, samples=samples, kind=kind)
            for t in range(start_ns, start_ns + count * WINDOW_NS, WINDOW_NS) for frames, samples in stacks]


def profiled_spike(spike_id: str, start_ns: int, minutes: int = 2) -> Spike:
    """A resolved spike on the gateway whose top cause is a span of preprocess on gpu-1."""
    return Spike(id=spike_id, service="gateway", operation="POST /v1/predict", state="resolved",
                 start_unix_nano=start_ns, end_unix_nano=start_ns + minutes * 60 * S, p99_ns=410_000_000,
                 baseline_p99_ns=60_000_000, causes=(
                     Cause(kind=CauseKind.SPAN, score=0.85, summary="preprocess span preprocess grew by 340 ms",
                           service="preprocess", operation="preprocess", host="gpu-1"),))


def seed(writer: Writer, spike_id: str, start_ns: int, minutes: int = 2) -> Spike:
    """Store a profiled spike: 10 minutes of the normal profile before it, the hot one during it."""
    spike = profiled_spike(spike_id, start_ns, minutes)
    writer.write(WriteBatch(spikes=[spike]))
    writer.write_profiles(windows("preprocess-before.folded", start_ns - 600 * S, 60)
                          + windows("preprocess-spike.folded", start_ns, minutes * 6))
    return spike
