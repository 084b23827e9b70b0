"""What a query plan must not do: scan a table that grows with traffic or time (SQLite's EXPLAIN QUERY PLAN)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# Tables that grow with traffic or time. A full scan of one of them is a bug.
BIG_TABLES = ("span_blocks", "trace_blocks", "span_block_services", "metric_points", "latency_windows", "spikes",
              "causes", "profile_samples", "profile_stacks")
# operations, metric_series and hosts grow with cardinality (services x operations, hosts x metrics), not with
# traffic, and the API lists them whole (/services, /hosts): reading them in index order is what it should do.
FULL_SCAN = re.compile(rf"\bSCAN ({'|'.join(BIG_TABLES)})\b(?! USING (COVERING )?INDEX)")


def plan_of(engine: Any, statements: list[tuple[str, Any]], call: Callable[[], Any]) -> str:
    """SQLite's EXPLAIN QUERY PLAN of every statement ``call`` runs, one line a step.

    ``statements`` is what the ``planned`` fixture (tests/conftest.py) records on ``engine``; ``call`` must answer
    something, so that every statement behind it ran.
    """
    statements.clear()
    assert call(), "the data set answers the query, so every statement behind it ran"
    plan = []
    with engine.connect() as conn:
        for statement, parameters in list(statements):
            plan += [row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)]
    return "\n".join(plan)
