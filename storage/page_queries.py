"""Read queries behind the web pages (``collector/web``), each served by an index of ``storage.schema``.

The REST API's queries live in ``storage.reader``; these two answer what only
the pages ask: the last minutes of latency windows of every service (the overview), and
the samples of a few named metrics of one host, with their kind so that the
page can turn counters into rates (the resource charts of a spike).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Engine, func, select

from spikehound.model import LatencyWindow, MetricKind
from storage import schema
from storage.reader import window_of


@dataclass(slots=True, frozen=True)
class KindedSeries:
    """One stored metric series with its points in a range, oldest first."""

    host: str
    name: str
    attributes: dict[str, Any]
    kind: MetricKind
    unit: str
    points: tuple[tuple[int, float], ...]  # (time ns, value)


def recent_windows(engine: Engine, lookback_ns: int) -> list[LatencyWindow]:
    """Every service's windows of its last ``lookback_ns`` (before its newest window), by service and start.

    Per service, the newest window start is found through the (service, start)
    index, and the windows from ``lookback_ns`` before it are read through the same
    index. A service that went quiet a day ago shows its last minutes of a day ago.
    """
    w, o = schema.latency_windows, schema.operations
    out: list[LatencyWindow] = []
    with engine.connect() as conn:
        services = conn.execute(select(o.c.service).distinct().order_by(o.c.service)).scalars().all()
        for service in services:
            newest = conn.execute(select(func.max(w.c.start_ns)).where(w.c.service == service)).scalar()
            if newest is None:
                continue
            rows = conn.execute(select(w).where(w.c.service == service, w.c.start_ns >= newest - lookback_ns,
                                                w.c.peer_service == "")  # entry streams: the service's own
                                .order_by(w.c.start_ns, w.c.operation)).all()
            out += [window_of(r) for r in rows]
    return out


def host_series(engine: Engine, host: str, names: Sequence[str], since_ns: int, until_ns: int, *,
                skip_attribute_keys: Collection[str] = (), max_points_per_series: int = 20_000
                ) -> list[KindedSeries]:
    """The series of ``host`` named in ``names`` with their points in [since, until).

    Series whose point attributes hold any of ``skip_attribute_keys`` are not
    read at all (per-CPU series when the page wants the whole machine). Each
    series keeps at most ``max_points_per_series`` points, the oldest.
    """
    m, p = schema.metric_series, schema.metric_points
    out: list[KindedSeries] = []
    with engine.connect() as conn:
        for name in names:
            series = conn.execute(select(m).where(m.c.host == host, m.c.name == name)
                                  .order_by(m.c.attributes)).all()
            for row in series:
                attributes = orjson.loads(row.attributes)
                if any(key in attributes for key in skip_attribute_keys):
                    continue
                points = conn.execute(select(p.c.t_ns, p.c.value)
                                      .where(p.c.series_id == row.id, p.c.t_ns >= since_ns, p.c.t_ns < until_ns)
                                      .order_by(p.c.t_ns).limit(max_points_per_series)).all()
                if points:
                    out.append(KindedSeries(row.host, row.name, attributes, MetricKind(row.kind), row.unit,
                                            tuple((t, v) for t, v in points)))
    return out
