"""Resolved spikes as read once: the spike list's cost is their causes and streams, which no longer change.

``GET /api/v1/spikes`` gives each spike with its causes and every stream it moved (up to 50): a hundred spikes
are a few thousand rows turned into objects, tens of milliseconds of the API's CPU, paid again at every poll
of a dashboard or a page. A resolved spike no longer changes, so the :class:`~spikehound.storage.reader.Reader`
keeps the ones it built, by a **stamp** read at each call from storage: the spike's own columns and an
aggregate of its stream and cause rows (counts and sums, computed by the database). A spike written again
(a detection process that judged its windows again after a restart, a leader that took over) has another
stamp and is read afresh; an open spike is always read afresh.

>>> kept = ResolvedSpikes(most=2)
>>> kept.put(("a", 1), "spike a"); kept.put(("b", 1), "spike b"); kept.get(("a", 1))
'spike a'
>>> kept.put(("c", 1), "spike c")  # "b" was the least recently used
>>> kept.get(("b", 1)) is None, kept.get(("a", 2)) is None  # gone; a new stamp is another spike
(True, True)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["MOST_RESOLVED_SPIKES", "ResolvedSpikes"]

MOST_RESOLVED_SPIKES = 500  # the default page of the list; 10-20 MB at most (50 streams each, ~350 bytes a stream)
T = TypeVar("T")


class ResolvedSpikes(Generic[T]):
    """A bounded map from a key that names a resolved spike as it is now (its stamp, or the object the reader
    built) to what was built of it, least recently used out first.

    Thread-safe: the API reads from a pool of threads.
    """

    def __init__(self, most: int = MOST_RESOLVED_SPIKES) -> None:
        self.most = most
        self._kept: OrderedDict[Hashable, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, stamp: Hashable) -> T | None:
        with self._lock:
            found = self._kept.get(stamp)
            if found is not None:
                self._kept.move_to_end(stamp)
            return found

    def put(self, stamp: Hashable, built: T) -> None:
        with self._lock:
            self._kept[stamp] = built
            self._kept.move_to_end(stamp)
            while len(self._kept) > self.most:
                self._kept.popitem(last=False)
