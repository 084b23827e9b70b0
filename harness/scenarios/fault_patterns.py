"""Faults in the shapes production trouble takes: returns, neighbours in a row, and long ones.

The mesh timelines of :mod:`harness.scenarios.mesh_traffic` give every fault at
least 15 minutes of clean traffic after it. Real trouble is rarely so tidy: a
noisy neighbour every few minutes, a cron job, a GC storm or a flapping link
hits the same service again and again, one fault follows another on a
different service, and some faults last half an hour. Three seeded families
of the same traffic (about 45 user requests a minute through ~40 services):

- :func:`recurrences`: chains of 2 to 4 faults of the same kind, size and
  service, 3 to 5 minutes each and 2 to 5 minutes apart; every other chain
  on a service of 2 to 6 calls a minute, the others on a busy one (15 to 25
  calls a minute);
- :func:`back_to_back`: 2 or 3 faults on different services (of 2 calls a
  minute or more), each starting 1 to 4 minutes after the one before it
  ended;
- :func:`long_faults`: one fault of 20 to 40 minutes;
- :func:`chaos`: a chaos campaign, as recorded from real benchmarks: a fault of
  3 to 4 minutes every 7 to 8 minutes for hours, often 2 or 3 in a row on the
  same service, from 10 minutes after the start, so that sparse streams are
  still learning what normal is while faults come and go.

Each pattern of the first three is followed by at least 12 minutes of clean
traffic, after a 20-minute warm-up. Everything follows from the seed; nothing
was fitted.

>>> tl = recurrences(5)
>>> len({f.service for f in tl.faults}) < len(tl.faults), all(180 <= f.duration_s <= 300 for f in tl.faults)
(True, True)
>>> gaps = [b.onset_s - a.onset_s - a.duration_s for a, b in zip(tl.faults, tl.faults[1:])]
>>> min(gaps) >= 120
True
"""

from __future__ import annotations

import random

from harness.scenarios.mesh_traffic import FAULT_KINDS, GATEWAY, MeshFault, MeshTimeline, reach

__all__ = ["FAMILIES", "back_to_back", "busy_services", "chaos", "long_faults", "recurrences", "sparse_services"]

_WARM_UP_S = 20 * 60.0
_CLEAN_AFTER_S = 12 * 60.0
_RATE_PER_MIN = 45.0


def sparse_services() -> list[str]:
    """Services that see 2 to 6 calls a minute at the timelines' mean load."""
    return sorted(s for s, share in reach().items()
                  if s != GATEWAY and 2.0 <= share * _RATE_PER_MIN <= 6.0)


def busy_services() -> list[str]:
    """Services that see 15 calls a minute or more."""
    return sorted(s for s, share in reach().items() if s != GATEWAY and share * _RATE_PER_MIN >= 15.0)


def _size(rng: random.Random, kind: str) -> float:
    return rng.uniform(1000, 2000) if kind != "cpu" else rng.uniform(200, 700)


def _shape(seed: int) -> dict[str, object]:
    return {"route_attribute": seed % 3 == 2, "generic_name": "/*" if seed % 4 == 3 else "HTTP",
            "metrics": seed % 4 != 1}


def recurrences(seed: int, hours: float = 2.0) -> MeshTimeline:
    """The same fault on the same service 2 to 4 times in a row, 3 to 5 minutes each, 2 to 5 minutes apart."""
    rng = random.Random(f"recurrences/{seed}")
    pools = (sparse_services(), busy_services())
    faults: list[MeshFault] = []
    t, chain = _WARM_UP_S + rng.uniform(0, 120), seed % 2
    end = hours * 3600 - 5 * 60
    while True:
        n = rng.randint(2, 4)
        durations = [rng.uniform(180, 300) for _ in range(n)]
        gaps = [rng.uniform(120, 300) for _ in range(n - 1)]
        if t + sum(durations) + sum(gaps) + _CLEAN_AFTER_S > end:
            break
        kind = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))]
        service = rng.choice(pools[chain % 2])
        size = _size(rng, kind)
        for i, duration in enumerate(durations):
            faults.append(MeshFault(kind, service, t, duration, size))
            t += duration + (gaps[i] if i < len(gaps) else 0.0)
        t += _CLEAN_AFTER_S + rng.uniform(0, 120)
        chain += 1
    return MeshTimeline(seed, hours=hours, faults=faults, **_shape(seed))  # type: ignore[arg-type]


def back_to_back(seed: int, hours: float = 2.0) -> MeshTimeline:
    """2 or 3 faults on different services, each 1 to 4 minutes after the one before it ended."""
    rng = random.Random(f"back-to-back/{seed}")
    targets = sorted(s for s, share in reach().items() if s != GATEWAY and share * _RATE_PER_MIN >= 2.0)
    faults: list[MeshFault] = []
    t = _WARM_UP_S + rng.uniform(0, 120)
    end = hours * 3600 - 5 * 60
    while True:
        n = rng.randint(2, 3)
        durations = [rng.uniform(195, 225) for _ in range(n)]
        gaps = [rng.uniform(60, 240) for _ in range(n - 1)]
        if t + sum(durations) + sum(gaps) + _CLEAN_AFTER_S > end:
            break
        for i, (duration, service) in enumerate(zip(durations, rng.sample(targets, n), strict=True)):
            kind = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))]
            faults.append(MeshFault(kind, service, t, duration, _size(rng, kind)))
            t += duration + (gaps[i] if i < len(gaps) else 0.0)
        t += _CLEAN_AFTER_S + rng.uniform(0, 120)
    return MeshTimeline(seed, hours=hours, faults=faults, **_shape(seed))  # type: ignore[arg-type]


def long_faults(seed: int, hours: float = 1.5) -> MeshTimeline:
    """One fault of 20 to 40 minutes, on a sparse service or a busy one."""
    rng = random.Random(f"long/{seed}")
    kind = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))]
    service = rng.choice((sparse_services(), busy_services())[seed % 2])
    duration = rng.uniform(20 * 60, 40 * 60)
    onset = _WARM_UP_S + rng.uniform(0, hours * 3600 - _WARM_UP_S - duration - _CLEAN_AFTER_S)
    return MeshTimeline(seed, hours=hours, faults=[MeshFault(kind, service, onset, duration, _size(rng, kind))],
                        **_shape(seed))  # type: ignore[arg-type]


def chaos(seed: int, hours: float = 3.0) -> MeshTimeline:
    """A fault of 3 to 4 minutes every 7 to 8 minutes (onset to onset) from minute 10, 1 to 3 in a row on one
    service (of 2 calls a minute or more), of one kind and size per run."""
    rng = random.Random(f"chaos/{seed}")
    targets = sorted(s for s, share in reach().items() if s != GATEWAY and share * _RATE_PER_MIN >= 2.0)
    faults: list[MeshFault] = []
    t, end = 10 * 60.0, hours * 3600 - 5 * 60
    while True:
        kind, service = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))], rng.choice(targets)
        size = _size(rng, kind)
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            duration = rng.uniform(180, 240)
            if t + duration > end:
                return MeshTimeline(seed, hours=hours, faults=faults, **_shape(seed))  # type: ignore[arg-type]
            faults.append(MeshFault(kind, service, t, duration, size))
            t += rng.uniform(420, 480)


# name -> generator of one timeline per seed
FAMILIES = {"recurrence": recurrences, "back-to-back": back_to_back, "long": long_faults, "chaos": chaos}
