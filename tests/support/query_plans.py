"""What a query plan must not do: scan a table that grows with traffic or time (SQLite's EXPLAIN QUERY PLAN)."""

from __future__ import annotations

import re

# Tables that grow with traffic or time. A full scan of one of them is a bug.
BIG_TABLES = ("span_blocks", "trace_blocks", "span_block_services", "metric_points", "latency_windows", "spikes",
              "causes")
# operations, metric_series and hosts grow with cardinality (services x operations, hosts x metrics), not with
# traffic, and the API lists them whole (/services, /hosts): reading them in index order is what it should do.
FULL_SCAN = re.compile(rf"\bSCAN ({'|'.join(BIG_TABLES)})\b(?! USING (COVERING )?INDEX)")
