"""Catching up after an episode: the latency windows wait for the senders' backlogs.

While storage is away (or the collector is restarting) senders spool what they
cannot deliver, and afterwards send it oldest first, each at its own pace. Live
data from a sender that drained quickly would move the watermark past windows
that a slower sender's backlog still fills, and allowed lateness (seconds) is
far shorter than an outage: those spans would count as late. So an episode's
end, and a start from a checkpoint, begin a catch-up: the watermark is held
where it was until, for ``quiet_seconds``, no *backlog* span arrived (one
that ended before the catch-up began, by the collector's clock, and after the
held watermark: an older one is late anyway, as a sender whose clock is
behind sends them all the time), or at most
``most_seconds``, or until ``most_spans`` spans arrived while held (open windows keep each entry span's
duration: live traffic must not grow them without end); then the hold is released and the windows close,
a window at a time, as live traffic would have closed them.
Live spans never count as backlog, however late an SDK exports them (its batch
delay is 5 s by default), so a catch-up after a short outage ends about
``quiet_seconds`` after the last spooled span arrived.
"Before the catch-up began" is read on the senders' clock: the data's newest end
times trailed the collector's clock by some lag before the episode (a second or
two when senders are live; hours when all of them replay a recording or their
clocks are behind), and ``begin`` is told that lag, so that live data after the
episode is never taken for backlog: else the windows would stay held for
``most_seconds`` after every restart of such a collector.

>>> from spikehound.units import NS
>>> clock, wall = [0.0], [100 * NS]
>>> c = CatchUp(quiet_seconds=15, clock=lambda: clock[0], wall_ns=lambda: wall[0])
>>> c.begin(); c.active
True
>>> wall[0] += 20 * NS
>>> c.arrived([90 * NS], held_ns=80 * NS)  # ended before storage returned: backlog
>>> clock[0] = 14.0; c.done()
False
>>> c.arrived([110 * NS, 20 * NS], held_ns=80 * NS)  # live, however late it came; and one late anyway
>>> clock[0] = 15.0; c.done()
True
>>> wall[0] = 5000 * NS; c.begin(lag_ns=3600 * NS)  # every sender replays an hour behind the clock
>>> clock[0] = 20.0; c.arrived([1405 * NS], held_ns=1300 * NS)  # their live data: not backlog
>>> clock[0] = 30.0; c.done()
True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from spikehound.detectors.engine import DetectionEngine

__all__ = ["MOST_SECONDS", "MOST_SPANS", "NO_DATA_YET", "CatchUp", "close_held", "hold_where_the_data_is"]

NO_DATA_YET = -(2**62)  # a hold set before any span: nothing may close
MOST_SECONDS = 600.0  # a sender that never drains must not hold the windows for ever
MOST_SPANS = 5_000_000  # spans arrived while held: at most about 400 MB of held window entries (columns)


class CatchUp:
    """Whether the windows are held for a backlog, and when it has drained (see the module)."""

    def __init__(self, quiet_seconds: float, *, most_seconds: float = MOST_SECONDS, most_spans: int = MOST_SPANS,
                 clock: Callable[[], float] = time.monotonic, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.quiet_seconds = quiet_seconds
        self.most_seconds = most_seconds
        self.most_spans = most_spans
        self.held_spans = 0  # arrived since the catch-up began
        self.clock = clock  # seconds, for the quiet period and the limit
        self.wall_ns = wall_ns  # when the catch-up began, as the spans' end times say it
        self.active = False
        self.episodes = 0  # catch-ups begun
        self._began = 0.0
        self._began_ns = 0  # spans that ended before this are backlog
        self._last_backlog = 0.0

    def begin(self, lag_ns: int = 0) -> None:
        """Start (or restart) a catch-up: storage is back, or the collector started from a checkpoint.
        ``lag_ns``: how far the newest data trailed the clock before the episode (see the module)."""
        if self.quiet_seconds <= 0:
            return
        now = self.clock()
        if not self.active:
            self._began = now
            self.held_spans = 0
            self.episodes += 1
        self.active = True
        self._began_ns = self.wall_ns() - max(lag_ns, 0)
        self._last_backlog = now

    def arrived(self, ends_ns: Sequence[int], held_ns: int | None) -> None:
        """A committed batch whose spans ended at ``ends_ns``, while the windows are held at ``held_ns``."""
        self.held_spans += len(ends_ns)
        if not self.active:
            return
        began, held = self._began_ns, -(2**63) if held_ns is None else held_ns
        if any(held <= end < began for end in ends_ns):
            self._last_backlog = self.clock()

    def done(self) -> bool:
        """True once the backlog has drained (or the limit passed); the caller then releases the hold."""
        if not self.active:
            return False
        now = self.clock()
        if (now - self._last_backlog >= self.quiet_seconds or now - self._began >= self.most_seconds
                or self.held_spans >= self.most_spans):
            self.active = False
            return True
        return False


def hold_where_the_data_is(detection: DetectionEngine) -> None:
    """Cap the windows' watermark where the data has brought it (if it is not capped already)."""
    windows = detection.windows
    if windows.hold is None:
        held = windows.data_watermark
        detection.hold(held if held is not None else NO_DATA_YET)


def close_held(detection: DetectionEngine, window_ns: int, step: Callable[[], None]) -> int:
    """The backlog has arrived: move the held watermark to where the data is, a window at a time, as live
    traffic would have moved it, calling ``step`` (the detection engine's advance, its outcome kept) after each move;
    then release the hold. How many steps it took."""
    windows = detection.windows
    held, target = windows.hold, windows.data_watermark
    if held is None:
        return 0
    steps = 0
    earliest = windows.earliest_open_ns
    if target is not None and earliest is not None:
        at = max(held, earliest)
        while at < target:
            at = min(at + window_ns, target)
            detection.hold(at)
            step()
            steps += 1
    detection.hold(None)
    step()
    return steps + 1
