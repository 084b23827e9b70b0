"""The demo's load generator: an open loop at a constant arrival rate.

Request *i* is due at ``start + i / rate`` whatever the server does, and its
latency is counted from when it was due, not from when a sender got round to
it. A closed-loop generator (Locust's users, each waiting for its answer
before the next request) sends less while the server is slow, so the slow
period holds fewer requests than it should and the tail hides: coordinated
omission. Here a slow server meets the same arrivals as a fast one, as it
does in production, and the client-side p99 is honest.

>>> sorted_ms = [float(x) for x in range(1, 101)]
>>> percentile(sorted_ms, 0.99), percentile(sorted_ms, 0.5)
(99.0, 50.0)
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (a value that really occurred)."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, slots=True)
class LoadStats:
    sent: int
    completed: int
    errors: int
    p50_ms: float
    p99_ms: float


class OpenLoopLoad:
    """POST ``body(i)`` as JSON to ``host:port`` ``path`` at ``rate`` requests per second until ``stop()``."""

    def __init__(self, host: str, port: int, path: str, rate: float, body: Callable[[int], dict[str, Any]],
                 senders: int = 64) -> None:
        self.host, self.port, self.path = host, port, path
        self.rate = rate
        self.body = body
        self.sent = 0
        self._pool = ThreadPoolExecutor(max_workers=senders, thread_name_prefix="load")
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []  # every sender's, closed by stop()
        self._stop = threading.Event()
        self._results: deque[tuple[float, float, bool]] = deque()  # (completed at, latency s, ok)
        self._thread = threading.Thread(target=self._schedule, name="load-schedule", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=False)
        for conn in self._connections:
            conn.close()

    def _schedule(self) -> None:
        start = time.monotonic()
        i = 0
        while not self._stop.is_set():
            due = start + i / self.rate
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._pool.submit(self._send, i, due)
            self.sent += 1
            i += 1

    def _send(self, i: int, due: float) -> None:
        ok = False
        try:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                self._connections.append(conn)
            try:
                conn.request("POST", self.path, body=json.dumps(self.body(i)),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
        finally:
            now = time.monotonic()
            self._results.append((now, now - due, ok))
            while self._results and self._results[0][0] < now - 600:
                self._results.popleft()

    def stats(self, last_seconds: float) -> LoadStats:
        """What completed in the last ``last_seconds``: count, errors, p50 and p99 from the due times."""
        since = time.monotonic() - last_seconds
        recent = [r for r in list(self._results) if r[0] >= since]
        latencies = sorted(r[1] * 1000 for r in recent if r[2])
        return LoadStats(sent=self.sent, completed=len(recent), errors=sum(1 for r in recent if not r[2]),
                         p50_ms=percentile(latencies, 0.5), p99_ms=percentile(latencies, 0.99))
