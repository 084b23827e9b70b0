"""Where a fired window test dates a rise (``stream_judge.change_point``): a sparse stream's merged windows,
each ``(start, end, requests)``; the spike's start is read from it, and a start before the fault is scored as a
false spike and a miss."""

from __future__ import annotations

from spikehound.detectors.stream_judge import change_point

MS = 1_000_000
BASELINE = 25 * MS


def _parts(*windows: tuple[float, ...]) -> list[tuple[int, int, tuple[tuple[int, bytes, bytes, int], ...]]]:
    """Windows of 10 s, the first at 0, each with requests of these durations (ms)."""
    return [(10 * i, 10 * i + 10, tuple((int(d * MS), b"t", b"s", 10 * i) for d in durations))
            for i, durations in enumerate(windows)]


def test_a_request_just_over_the_baseline_in_the_window_before_a_rise_does_not_date_it():
    # Recurrence seed 401: a station call of 41 ms against 25, then calls of 2.4 s: the rise began with them.
    parts = _parts((20, 18, 22, 19), (20, 41), (2385, 2445, 2449, 2573, 20, 22), (2365, 2487, 2518))
    assert change_point(parts, BASELINE) == 20


def test_a_request_as_slow_as_the_rise_just_before_it_is_its_first():
    parts = _parts((20, 18, 22, 19), (20, 2300), (2385, 2445, 2449, 2573, 20, 22), (2365, 2487, 2518))
    assert change_point(parts, BASELINE) == 10


def test_a_rise_of_calls_barely_over_the_baseline_begins_at_its_first_one():
    # A mild fault: every slow call only 40-60 % over the baseline; none of them is a weak lead to the others.
    parts = _parts((20, 18, 22, 19), (20, 36), (37, 39, 35, 20), (36, 38, 40))
    assert change_point(parts, BASELINE) == 10


def test_one_stray_long_before_the_rise_is_not_its_start():
    parts = _parts((20, 2400, 22), *[(20, 19, 21)] * 6, (2385, 2445, 2449), (2365, 2487))
    assert change_point(parts, BASELINE) == 70
