"""Exponential backoff with jitter: how long to wait before retrying after consecutive failures.

The step doubles from ``initial`` with each consecutive failure, up to
``most``; the delay is drawn uniformly between ``jitter[0]`` and ``jitter[1]``
times the step, so that clients that failed together do not retry together.
The random source is passed in, so that tests can seed it. Used by the
agent's forwarder, the ingest pipeline's retries of a failed commit, and alert delivery.

>>> import random
>>> alerts = Backoff(initial=1.0, most=300.0)
>>> [alerts.step(n) for n in (1, 2, 3, 10)]
[1.0, 2.0, 4.0, 300.0]
>>> [round(alerts.delay(n, random.Random(1)), 2) for n in (1, 2, 3, 10)]
[0.57, 1.13, 2.27, 170.15]
>>> round(Backoff(0.25, 30.0, jitter=(0.5, 1.5)).delay(1, random.Random(1)), 3)
0.159
"""

from __future__ import annotations

import random
from dataclasses import dataclass

HALF_TO_ALL = (0.5, 1.0)  # the delay is drawn between half the step and all of it
MAX_DOUBLINGS = 60  # past this the step is capped anyway; keeps 2 ** n from growing without end


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays doubling from ``initial`` up to ``most`` seconds, each drawn within ``jitter`` (fractions of the step).

    >>> Backoff(initial=0.25, most=5.0).step(6)
    5.0
    """

    initial: float
    most: float
    jitter: tuple[float, float] = HALF_TO_ALL

    def step(self, failures: int) -> float:
        """The delay after ``failures`` consecutive failures (1 for the first), before jitter."""
        return min(self.most, self.initial * 2 ** min(max(failures - 1, 0), MAX_DOUBLINGS))

    def delay(self, failures: int, rng: random.Random) -> float:
        """The delay after ``failures`` consecutive failures, drawn with ``rng`` within the jitter."""
        step = self.step(failures)
        low, high = self.jitter
        return step * low + rng.random() * step * (high - low)
